"""load_hf against the Hugging Face transformers oracle, and every bad input it must refuse.

The fixtures under tests/fixtures/hf_*/ were written by tests/fixtures/make_hf_fixtures.py with
transformers' DeepseekV3ForCausalLM (float32, eager attention); logits.npy is that oracle's output for
tokens.npy. Neither torch nor transformers is needed here.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kdtree_jax as kj
from kdtree_jax.hf import INDEX_FILE, HFCheckpointError, load_hf
from pallas_kernels.int4 import Int4Weight

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ALL = ["hf_k2_dense", "hf_k25_dense", "hf_k2_int4", "hf_dsv3_f32"]
RTOL = 1e-4


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def oracle(name: str) -> tuple[np.ndarray, np.ndarray]:
    return np.load(FIXTURES / name / "tokens.npy"), np.load(FIXTURES / name / "logits.npy")


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


# ------------------------------------------------------------------------------- oracle logits
@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(name):
    """kj.forward on load_hf's params reproduces transformers' logits (INT4: on the INT4 leaves)."""
    cfg, params = load_hf(FIXTURES / name, dtype=jnp.float32, progress=False)
    tokens, want = oracle(name)
    got = kj.forward(params, cfg, tokens)
    assert got.shape == want.shape
    assert rel_err(got, want) <= RTOL


def test_int4_experts_stay_packed_and_dequantize_to_the_oracle_weights():
    """INT4 experts load as Int4Weights (never dense); dequantized, they give the oracle's logits."""
    cfg, params = load_hf(FIXTURES / "hf_k2_int4", dtype=jnp.float32, progress=False)
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        experts = params[f"layers_{layer}"]["moe"]["experts"]
        for proj, (n, k) in {"gate": (32, 64), "up": (32, 64), "down": (64, 32)}.items():
            leaf = experts[proj]
            assert isinstance(leaf, Int4Weight)
            assert leaf.qweight.shape == (cfg.n_routed_experts, n, k // 4)
            assert leaf.scale.dtype == jnp.bfloat16  # the file's scale dtype, untouched
    # Everything else stays dense.
    assert params["layers_1"]["moe"]["shared"]["gate"].dtype == jnp.float32
    is_int4 = lambda x: isinstance(x, Int4Weight)  # noqa: E731
    dense = jax.tree.map(lambda leaf: jnp.swapaxes(leaf.dequantize(), -1, -2) if is_int4(leaf) else leaf,
                         params, is_leaf=is_int4)
    tokens, want = oracle("hf_k2_int4")
    assert rel_err(kj.forward(dense, cfg, tokens), want) <= RTOL


def test_weights_are_transposed_hf_tensors():
    """Spot-check the name map and orientation against the raw float32 file."""
    raw = load_file(FIXTURES / "hf_dsv3_f32" / "model.safetensors")
    cfg, params = load_hf(FIXTURES / "hf_dsv3_f32", dtype=jnp.float32, progress=False)
    layer = params["layers_1"]
    np.testing.assert_array_equal(layer["attn"]["q"], raw["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(layer["attn"]["kv_b"], raw["model.layers.1.self_attn.kv_b_proj.weight"].T)
    np.testing.assert_array_equal(layer["moe"]["experts"]["down"][5],
                                  raw["model.layers.1.mlp.experts.5.down_proj.weight"].T)
    np.testing.assert_array_equal(layer["moe"]["router_bias"],
                                  raw["model.layers.1.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(params["lm_head"], raw["lm_head.weight"].T)


def test_configs_and_dtypes():
    cfg, params = load_hf(FIXTURES / "hf_k2_dense", dtype=jnp.bfloat16, progress=False)
    assert (cfg.rope_scaling.beta_fast, cfg.rope_scaling.factor, cfg.n_group) == (1.0, 32.0, 1)
    assert cfg.routed_scaling_factor == 2.827 and cfg.latent_norm_eps == 1e-6
    assert params["layers_0"]["attn"]["q_a"].dtype == jnp.bfloat16
    assert params["layers_1"]["moe"]["experts"]["gate"].shape == (8, 64, 32)
    assert params["layers_1"]["moe"]["router"].dtype == jnp.float32
    assert params["layers_1"]["moe"]["router_bias"].dtype == jnp.float32
    cfg25, _ = load_hf(FIXTURES / "hf_k25_dense")  # with the tqdm bar
    assert (cfg25.rope_scaling.beta_fast, cfg25.rope_scaling.factor) == (32.0, 64.0)
    assert (cfg25.n_group, cfg25.topk_group, cfg25.rms_norm_eps) == (2, 1, 1e-5)


def test_kimi_k25_config_in_kimis_original_form(tmp_path):
    """Kimi's own K2.5 config.json: text_config model_type kimi_k2 with legacy rope keys."""
    path = copy_fixture("hf_k25_dense", tmp_path)
    raw = json.loads((path / "config.json").read_text())
    text = raw["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = dict(rope, type=rope.pop("rope_type"))
    text["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(raw))
    cfg, params = load_hf(path, dtype=jnp.float32, progress=False)
    reference_cfg, _ = load_hf(FIXTURES / "hf_k25_dense", dtype=jnp.float32, progress=False)
    assert cfg == reference_cfg
    tokens, want = oracle("hf_k25_dense")
    assert rel_err(kj.forward(params, cfg, tokens), want) <= RTOL


def test_mtp_layers_past_num_hidden_layers_are_skipped(tmp_path):
    path = copy_fixture("hf_k2_dense", tmp_path)
    extra = {"model.layers.3.eh_proj.weight": np.ones((64, 128), np.float32),
             "model.layers.3.self_attn.o_proj.weight": np.ones((64, 64), np.float32)}
    save_file(extra, path / "mtp.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in extra})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg, params = load_hf(path, dtype=jnp.float32, progress=False)
    assert "layers_3" not in params
    tokens, want = oracle("hf_k2_dense")
    assert rel_err(kj.forward(params, cfg, tokens), want) <= RTOL


# ---------------------------------------------------------------------------------- bad inputs
def rewrite_single_file(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_config_json(tmp_path):
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(HFCheckpointError, match="no config.json"):
        load_hf(path, progress=False)


def test_not_a_directory(tmp_path):
    with pytest.raises(HFCheckpointError, match="not a directory"):
        load_hf(tmp_path / "nope", progress=False)


def test_unsupported_model_type(tmp_path):
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="unsupported model_type 'llama'"):
        load_hf(path, progress=False)


def test_no_weights_file(tmp_path):
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        load_hf(path, progress=False)


def test_missing_tensor(tmp_path):
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    rewrite_single_file(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(HFCheckpointError,
                       match=r"missing 1 tensor.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_hf(path, progress=False)


def test_missing_tensor_names_the_kimi_k25_prefix(tmp_path):
    path = copy_fixture("hf_k25_dense", tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["language_model.model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=r"language_model\.model\.norm\.weight"):
        load_hf(path, progress=False)


def test_extra_tensor(tmp_path):
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    rewrite_single_file(path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)}))
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor.*model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_hf(path, progress=False)


def test_wrong_shape(tmp_path):
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    rewrite_single_file(path, lambda t: t.update(
        {"model.layers.0.self_attn.kv_b_proj.weight": np.zeros((128, 16), np.float32)}))
    with pytest.raises(HFCheckpointError, match=r"kv_b_proj\.weight.*shape \[128, 16\], expected \[128, 32\]"):
        load_hf(path, progress=False)


def test_truncated_shard(tmp_path):
    path = copy_fixture("hf_k2_dense", tmp_path)
    shard = path / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(HFCheckpointError, match=r"cannot read shard .*model-00002-of-00003\.safetensors.*truncated"):
        load_hf(path, progress=False)


def test_shard_missing_from_disk(tmp_path):
    path = copy_fixture("hf_k2_dense", tmp_path)
    (path / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match=r"shard 'model-00003-of-00003\.safetensors'.*does not exist"):
        load_hf(path, progress=False)


def test_index_names_a_tensor_its_shard_lacks(tmp_path):
    path = copy_fixture("hf_k2_dense", tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    if "model.norm.weight" in load_file_keys(path / "model-00001-of-00003.safetensors"):
        index["weight_map"]["model.norm.weight"] = "model-00002-of-00003.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=r"'model\.norm\.weight' is mapped to shard .* but is not in it"):
        load_hf(path, progress=False)


def load_file_keys(file: Path) -> set[str]:
    from safetensors import safe_open
    with safe_open(file, framework="flax") as f:
        return set(f.keys())


def test_unexpected_non_text_tensor_in_kimi_k25(tmp_path):
    path = copy_fixture("hf_k25_dense", tmp_path)
    save_file({"model.embed_tokens.weight": np.zeros((128, 64), np.float32)}, path / "stray.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = "stray.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor 'model\.embed_tokens\.weight' in a kimi_k25"):
        load_hf(path, progress=False)


def test_int4_weight_shape_mismatch(tmp_path):
    path = copy_fixture("hf_k2_int4", tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.2.mlp.experts.4.down_proj.weight_shape"
    shard = path / index["weight_map"][name]
    tensors = load_file_flax(shard)
    tensors[name] = np.array([64, 64], np.int32)
    save_file_flax(tensors, shard)
    with pytest.raises(HFCheckpointError,
                       match=r"experts\.4\.down_proj\.weight_shape.*\[64, 64\], expected \[64, 32\]"):
        load_hf(path, progress=False)


def test_int4_without_quantization_config(tmp_path):
    path = copy_fixture("hf_k2_int4", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="INT4-packed but config.json has no compressed-tensors"):
        load_hf(path, progress=False)


def test_unsupported_compressed_tensors_scheme(tmp_path):
    path = copy_fixture("hf_k2_int4", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="group_size"):
        load_hf(path, progress=False)


def test_unsupported_quant_method(tmp_path):
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="unsupported quantization_config quant_method 'gptq'"):
        load_hf(path, progress=False)


def load_file_flax(file: Path) -> dict[str, np.ndarray]:
    """Read every tensor (bf16 included) as numpy, via the flax binding (numpy's lacks bf16)."""
    from safetensors import safe_open
    with safe_open(file, framework="flax") as f:
        return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}


def save_file_flax(tensors: dict[str, np.ndarray], file: Path) -> None:
    from safetensors.flax import save_file as save_jax
    save_jax({k: jnp.asarray(v) for k, v in tensors.items()}, str(file))


# ----------------------------------------------------------------------------------------- FP8
def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek block-128 FP8: (weight float8_e4m3fn [out, in], scale_inv float32 [ceil/128, ceil/128])."""
    out, inp = w.shape
    bo, bi = -(-out // 128), -(-inp // 128)
    scale = np.zeros((bo, bi), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(bo):
        for j in range(bi):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = np.abs(block).max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def make_fp8(tmp_path: Path, names: list[str], with_quant_config: bool = True,
             with_scale_inv: bool = True) -> tuple[Path, dict]:
    path = copy_fixture("hf_dsv3_f32", tmp_path)
    tensors = load_file(path / "model.safetensors")
    want = {}
    for name in names:
        q, scale = fp8_quantize(tensors[name])
        tensors[name] = q
        if with_scale_inv:
            tensors[name.replace(".weight", ".weight_scale_inv")] = scale
        # Independent float64 dequantization, element by element block index.
        rows = np.arange(q.shape[0])[:, None] // 128
        cols = np.arange(q.shape[1])[None, :] // 128
        want[name] = q.astype(np.float64) * scale[rows, cols].astype(np.float64)
    save_file(tensors, path / "model.safetensors")
    if with_quant_config:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}
        (path / "config.json").write_text(json.dumps(cfg))
    return path, want


FP8_NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.1.mlp.experts.2.gate_proj.weight", "lm_head.weight"]


def test_fp8_block_weights_are_dequantized(tmp_path):
    path, want = make_fp8(tmp_path, FP8_NAMES)
    _, params = load_hf(path, dtype=jnp.float32, progress=False)
    got = {FP8_NAMES[0]: params["layers_0"]["attn"]["q"], FP8_NAMES[1]: params["layers_0"]["mlp"]["down"],
           FP8_NAMES[2]: params["layers_1"]["moe"]["experts"]["gate"][2], FP8_NAMES[3]: params["lm_head"]}
    for name in FP8_NAMES:
        np.testing.assert_allclose(np.asarray(got[name], np.float64), want[name].T, rtol=1e-6, atol=0)


def test_fp8_without_scale_inv(tmp_path):
    path, _ = make_fp8(tmp_path, FP8_NAMES[:1], with_scale_inv=False)
    with pytest.raises(HFCheckpointError, match=r"missing 1 tensor.*q_proj\.weight_scale_inv"):
        load_hf(path, progress=False)


def test_fp8_without_quantization_config(tmp_path):
    path, _ = make_fp8(tmp_path, FP8_NAMES[:1], with_quant_config=False)
    with pytest.raises(HFCheckpointError, match="F8_E4M3 weights but config.json has no fp8"):
        load_hf(path, progress=False)


def test_non_float_dtype_argument():
    with pytest.raises(HFCheckpointError, match="floating dtype"):
        load_hf(FIXTURES / "hf_dsv3_f32", dtype=jnp.int32, progress=False)


# ------------------------------------------------------------------ config values of the wrong JSON type
def _edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _set_in(keys: tuple, value):
    def edit(data):
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value
    return edit


WRONG_TYPES = [  # (fixture, file, keys to the value, wrong value, message)
    ("hf_k2_int4", "config.json", ("quantization_config",), ["compressed-tensors"],
     "quantization_config must be a dict, got ['compressed-tensors']"),
    ("hf_k2_int4", "config.json", ("quantization_config",), "int4", "quantization_config must be a dict, got 'int4'"),
    ("hf_k2_int4", "config.json", ("quantization_config", "config_groups"), ["group_0"],
     "quantization_config.config_groups must be a dict of groups, got ['group_0']"),
    ("hf_k2_int4", "config.json", ("quantization_config", "config_groups", "group_0"), "W4A16",
     "config group 'group_0' must be a dict with a 'weights' dict, got 'W4A16'"),
    ("hf_k2_int4", "config.json", ("quantization_config", "config_groups", "group_0", "weights"), [4, 32],
     "config group 'group_0' must be a dict with a 'weights' dict"),
    ("hf_dsv3_f32", "config.json", ("quantization_config",), {"quant_method": "fp8", "weight_block_size": 128},
     "FP8 weight_block_size 128 is not supported"),
    ("hf_k2_dense", "config.json", ("rope_scaling",), ["yarn"], "'rope_scaling' must be a dict or null, got ['yarn']"),
    ("hf_k2_dense", "model.safetensors.index.json", ("weight_map",), ["model.norm.weight"],
     "'weight_map' must be a dict of tensor name -> shard file, got list"),
    ("hf_k2_dense", "model.safetensors.index.json", ("weight_map",), "model-00001-of-00003.safetensors",
     "'weight_map' must be a dict of tensor name -> shard file, got str"),
    ("hf_k2_dense", "model.safetensors.index.json", ("weight_map", "model.norm.weight"), 3,
     "weight_map entry 'model.norm.weight' must be a shard file name, got 3"),
    ("hf_k2_dense", "model.safetensors.index.json", ("weight_map", "model.norm.weight"), None,
     "weight_map entry 'model.norm.weight' must be a shard file name, got None"),
]


@pytest.mark.parametrize("fixture, file, keys, value, match", WRONG_TYPES,
                         ids=[f"{'.'.join(k)}={v!r}"[:50] for _, _, k, v, _ in WRONG_TYPES])
def test_config_values_of_the_wrong_json_type_are_named(fixture, file, keys, value, match, tmp_path):
    """These were AttributeErrors / TypeErrors (the CLI's "internal error"); now one clear error."""
    path = copy_fixture(fixture, tmp_path)
    _edit_json(path / file, _set_in(keys, value))
    with pytest.raises(HFCheckpointError, match=re.escape(match)):
        load_hf(path, progress=False)


# ------------------------------------------------------------------ shards outside the model directory
def _point_norm_at(path: Path, file: str) -> None:
    """Map model.norm.weight to `file` (a copy of its real shard, so that only the location is wrong)."""
    _edit_json(path / INDEX_FILE, _set_in(("weight_map", "model.norm.weight"), file))


def _norm_shard(path: Path) -> Path:
    return path / json.loads((path / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]


def test_weight_map_entry_with_dotdot_is_refused(tmp_path):
    path = copy_fixture("hf_k2_dense", tmp_path / "a" / "b")
    shutil.copy(_norm_shard(path), tmp_path / "x.safetensors")  # readable: only the location is wrong
    _point_norm_at(path, "../../x.safetensors")
    with pytest.raises(HFCheckpointError, match=r"weight_map entry 'model\.norm\.weight' -> '\.\./\.\./x\.safetensors'"
                       r" leaves the model directory"):
        load_hf(path, progress=False)


def test_weight_map_entry_with_an_absolute_path_is_refused(tmp_path):
    path = copy_fixture("hf_k2_dense", tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(_norm_shard(path), outside)
    _point_norm_at(path, str(outside))
    with pytest.raises(HFCheckpointError, match=r"entry 'model\.norm\.weight' -> '/.*elsewhere\.safetensors' leaves"):
        load_hf(path, progress=False)


def test_weight_map_entry_linking_out_of_the_directory_is_refused(tmp_path):
    path = copy_fixture("hf_k2_dense", tmp_path / "model")
    shard = _norm_shard(path)
    outside = tmp_path / "outside.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    with pytest.raises(HFCheckpointError, match=rf"entry '.*' -> '{re.escape(shard.name)}' is a link to "
                       r"'.*outside\.safetensors', outside the model directory"):
        load_hf(path, progress=False)


def test_hugging_face_hub_cache_links_to_blobs_are_allowed(tmp_path):
    """The hub cache keeps snapshots/<revision>/<file> as links to ../../blobs/<hash>: that layout loads."""
    repo = tmp_path / "models--kimi--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted((FIXTURES / "hf_k2_dense").iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    _, got = load_hf(snapshot, jnp.float32, progress=False)
    _, want = load_hf(FIXTURES / "hf_k2_dense", jnp.float32, progress=False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
