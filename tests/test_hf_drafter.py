"""load_hf_drafter / export_hf_drafter against z-lab's DFlash reference implementation, and every bad input.

The fixtures under tests/fixtures/dflash_*/ were written by tests/fixtures/make_dflash_fixtures.py with
z-lab/dflash's `DFlashDraftModel` (torch, float64); cases.npz holds its draft logits for given target hidden
states and bonus tokens. Neither torch nor transformers is needed here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params, rel_err
from safetensors.numpy import load_file, save_file

import kdtree_jax as kj
from kdtree_jax import cli
from kdtree_jax.config import ConfigError, YarnScaling
from kdtree_jax.drafter import (
    DrafterConfig,
    drafter_extend_context,
    drafter_forward,
    init_drafter_cache,
    init_drafter_params,
)
from kdtree_jax.hf import HFCheckpointError
from kdtree_jax.hf_drafter import (
    QWEN3_DEFAULTS,
    DrafterFormatError,
    build_target_layer_ids,
    drafter_config_from_hf,
    export_hf_drafter,
    load_hf_drafter,
    rope_halves_to_pairs,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ALL = ["dflash_b16_gqa", "dflash_b8_yarn"]
RTOL = 1e-5


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))


def draft_logits(dcfg: DrafterConfig, dparams: dict, data) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Our logits for the fixture's two rows, run as one ragged batch; and the oracle's."""
    n, D = dcfg.num_target_layers, dcfg.hidden_size
    lengths = [data[f"target_hidden_{r}"].shape[0] for r in range(2)]
    T = max(lengths)
    hidden = np.zeros((2, T, n, D), np.float32)  # [B, T, n, D]
    positions = np.zeros((2, T), np.int32)
    embed = np.zeros((TINY.vocab_size, D), np.float32)
    for r in range(2):
        hidden[r, : lengths[r]] = data[f"target_hidden_{r}"].reshape(lengths[r], n, D)
        positions[r] = int(data[f"start_{r}"]) + np.arange(T)
        embed[[int(data[f"bonus_{r}"]), dcfg.mask_token_id]] = data[f"embed_rows_{r}"]
    cache = init_drafter_cache(dcfg, 2, T)
    cache = drafter_extend_context(dparams, dcfg, cache, jnp.asarray(hidden), jnp.asarray(positions),
                                   jnp.asarray(lengths, jnp.int32))
    bonus = jnp.asarray([int(data[f"bonus_{r}"]) for r in range(2)], jnp.int32)
    start = jnp.asarray([int(data[f"start_{r}"]) + lengths[r] for r in range(2)], jnp.int32)
    lm_head = jnp.asarray(data["lm_head"], jnp.float32)  # [D, V]
    got = np.asarray(drafter_forward(dparams, dcfg, cache, jnp.asarray(embed), lm_head, bonus, start))
    return [got[r] for r in range(2)], [data[f"logits_{r}"] for r in range(2)]


# ------------------------------------------------------------------------------- oracle logits
@pytest.mark.parametrize("name", ALL)
def test_logits_match_dflash_reference(name):
    """Imported drafter (RoPE halves -> pairs, GQA, q/k norms, YaRN, shards) == DFlashDraftModel's logits."""
    dcfg, dparams = load_hf_drafter(FIXTURES / name, jnp.float32, target=TINY)
    got, want = draft_logits(dcfg, dparams, np.load(FIXTURES / name / "cases.npz"))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (dcfg.block_size - 1, TINY.vocab_size)
        assert rel_err(g, w) <= RTOL


def test_fixture_configs_are_read_as_written():
    gqa, _ = load_hf_drafter(FIXTURES / "dflash_b16_gqa", jnp.float32)
    assert gqa == DrafterConfig(hidden_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, intermediate_size=96, block_size=16, target_layer_ids=(1, 3),
                                mask_token_id=399, rms_norm_eps=1e-6, rope_theta=50000.0)
    yarn, params = load_hf_drafter(FIXTURES / "dflash_b8_yarn", jnp.bfloat16)
    assert (yarn.block_size, yarn.target_layer_ids, yarn.num_attention_heads, yarn.num_key_value_heads) == (
        8, (0, 2, 4), 8, 2)
    assert yarn.rope_scaling == YarnScaling(4.0, 64, 32.0, 1.0, 1.0, 0.0)
    assert yarn.rms_norm_eps == 1e-5
    assert json.loads((FIXTURES / "dflash_b8_yarn" / "model.safetensors.index.json").read_text())  # sharded
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))


def test_the_rope_permutation_is_halves_to_pairs():
    np.testing.assert_array_equal(rope_halves_to_pairs(8), [0, 4, 1, 5, 2, 6, 3, 7])
    # without the permutation the logits are wrong: the test above would catch an importer that skipped it
    dcfg, dparams = load_hf_drafter(FIXTURES / "dflash_b16_gqa", jnp.float32)
    inv = np.argsort(rope_halves_to_pairs(dcfg.head_dim))
    bad = jax.tree.map(lambda x: x, dparams)
    for i in range(dcfg.num_hidden_layers):
        attn = bad[f"layers_{i}"]["attn"]
        attn["q_norm"], attn["k_norm"] = attn["q_norm"][inv], attn["k_norm"][inv]
    got, want = draft_logits(dcfg, bad, np.load(FIXTURES / "dflash_b16_gqa" / "cases.npz"))
    assert rel_err(got[0], want[0]) > 1e-3


# ------------------------------------------------------------------------------ greedy invariant
@pytest.fixture(scope="module")
def tiny_ar():
    params = random_params(TINY, seed=4)
    prompts = [[5, 9, 13, 200, 7], [3], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    ar = kj.generate(TINY, params, prompts, max_new_tokens=12, stop_tokens=())
    return params, prompts, ar


@pytest.mark.parametrize("name,method,budget", [("dflash_b16_gqa", "ddtree", 8), ("dflash_b8_yarn", "ddtree", 20),
                                                ("dflash_b8_yarn", "dflash", None)])
def test_greedy_speculative_decoding_with_an_imported_drafter_equals_autoregressive(tiny_ar, name, method, budget):
    params, prompts, ar = tiny_ar
    drafter = load_hf_drafter(FIXTURES / name, jnp.float32, target=TINY)
    kwargs = {} if budget is None else {"tree_budget": budget}
    out = kj.generate(TINY, params, prompts, max_new_tokens=12, method=method, drafter=drafter, stop_tokens=(),
                      **kwargs)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    assert int(out.rounds) >= 2


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("name", ALL)
def test_export_then_import_is_bit_exact(name, tmp_path):
    dtype = jnp.float16 if name == "dflash_b16_gqa" else jnp.bfloat16  # the files' own dtypes
    dcfg, dparams = load_hf_drafter(FIXTURES / name, dtype)
    out = export_hf_drafter(dcfg, dparams, tmp_path / "exported", target=TINY)
    dcfg2, dparams2 = load_hf_drafter(out, dtype, target=TINY)
    assert dcfg2 == dcfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), dparams, dparams2)
    # and the files are the original's, tensor for tensor (the permutation inverts exactly)
    original = {}
    for file in (FIXTURES / name).glob("*.safetensors"):
        original.update(load_file(file))
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_our_drafters_export_and_come_back_bit_exact(dtype, tmp_path):
    """A drafter this project makes (random here; trained ones have the same tree) -> DFlash files -> back."""
    dcfg = DrafterConfig.for_target(TINY, num_layers=2, block_size=8, num_key_value_heads=2)
    dparams = init_drafter_params(dcfg, jax.random.key(7), dtype)
    rng = np.random.default_rng(0)
    dparams = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), dtype), dparams)
    dcfg = dcfg.replace(rope_scaling=TINY.rope_scaling, rope_theta=TINY.rope_theta)
    out = export_hf_drafter(dcfg, dparams, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"] == {"block_size": 8, "target_layer_ids": list(dcfg.target_layer_ids),
                                       "mask_token_id": 399}
    assert config["rope_parameters"]["rope_type"] == "yarn"
    dcfg2, dparams2 = load_hf_drafter(out, dtype)
    assert dcfg2 == dcfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), dparams, dparams2)
    with pytest.raises(HFCheckpointError, match="already exists"):
        export_hf_drafter(dcfg, dparams, out)


def test_export_refuses_a_params_tree_that_does_not_fit(tmp_path):
    dcfg = DrafterConfig.for_target(TINY, num_layers=1)
    dparams = init_drafter_params(dcfg, jax.random.key(0))
    with pytest.raises(HFCheckpointError, match="entries"):
        export_hf_drafter(dcfg, {k: v for k, v in dparams.items() if k != "fc"}, tmp_path / "a")
    bad = dict(dparams, fc=dparams["fc"][:, :10])
    with pytest.raises(HFCheckpointError, match="fc"):
        export_hf_drafter(dcfg, bad, tmp_path / "b")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.tmp-*"))


# ------------------------------------------------------------------------------------- config
def test_qwen3_defaults_are_transformers_own():
    """The defaults filled in for absent fields are Qwen3Config's (recorded by the fixture generator)."""
    recorded = json.loads((FIXTURES / "dflash_qwen3_defaults.json").read_text())
    assert recorded == QWEN3_DEFAULTS


def test_absent_fields_take_qwen3_defaults_and_dflash_placement():
    dcfg = drafter_config_from_hf({"hidden_size": 7168, "num_hidden_layers": 6, "num_attention_heads": 64,
                                   "num_key_value_heads": 8, "intermediate_size": 18432, "num_target_layers": 61,
                                   "dflash_config": {"mask_token_id": 163838}})
    assert dcfg.head_dim == 128 and dcfg.head_dim != 7168 // 64  # Qwen3Config's head_dim, not hidden/heads
    assert (dcfg.rms_norm_eps, dcfg.rope_theta, dcfg.rope_scaling, dcfg.block_size) == (1e-6, 10000.0, None, 16)
    # DFlash's build_target_layer_ids(61, 6): the published Kimi-K2.5-DFlash reads exactly these
    assert dcfg.target_layer_ids == (1, 12, 24, 35, 47, 58) == build_target_layer_ids(61, 6)
    assert build_target_layer_ids(36, 1) == (18,)
    # num_key_value_heads absent -> Qwen3Config's 32 (not the head count): 64 heads still divide
    assert drafter_config_from_hf({"num_attention_heads": 64, "dflash_config": {
        "mask_token_id": 0, "target_layer_ids": [1]}}).num_key_value_heads == 32


def test_null_options_read_as_their_defaults():
    dcfg = drafter_config_from_hf(dict(BASE, input_embedding_scale=None, output_multiplier=None,
                                       final_logit_softcapping=None, layer_types=None))
    assert dcfg.num_hidden_layers == 2


def test_dflash_config_wins_over_top_level_like_dflash():
    dcfg = drafter_config_from_hf({"block_size": 4, "mask_token_id": 1, "target_layer_ids": [9],
                                   "dflash_config": {"block_size": 8, "target_layer_ids": [2, 3]}})
    assert (dcfg.block_size, dcfg.mask_token_id, dcfg.target_layer_ids) == (8, 1, (2, 3))


BASE = {"hidden_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 96, "dflash_config": {"mask_token_id": 399, "target_layer_ids": [1, 3]}}


@pytest.mark.parametrize("change,match", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"input_embedding_scale": 2.0}, "input_embedding_scale=2.0 is not supported"),
    ({"dflash_config": dict(BASE["dflash_config"], output_multiplier=0.5)}, "output_multiplier=0.5"),
    ({"dflash_config": dict(BASE["dflash_config"], final_logit_softcapping=20.0)}, "final_logit_softcapping=20.0"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types=\\['sliding_attention'\\]"),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "expected a list of 2 layer types"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers='2'"),
    ({"input_embedding_scale": "x"}, "input_embedding_scale='x'.*expected a number"),
    ({"is_causal": True}, "is_causal=True"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ({"dflash_config": dict(BASE["dflash_config"], conv_kernel_size=2)}, "DFlash2.*conv_kernel_size"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures=\\['Qwen3ForCausalLM'\\]"),
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type='linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 64}, "max_position_embeddings": 1024},
     "ambiguous"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 1.0}},
     "attention_factor=1.0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": False}}, "truncate"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 3}}, "neither dflash_config.target_layer_ids nor num_target_layers"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"dflash_config": dict(BASE["dflash_config"], block_size=1)}, r"block_size must be in \[2, 64\]"),
])
def test_unsupported_or_bad_configs_are_refused_by_name(change, match):
    with pytest.raises(DrafterFormatError, match=match):
        drafter_config_from_hf(dict(BASE, **change))


def test_yarn_with_both_mscales_and_defaults():
    dcfg = drafter_config_from_hf(dict(BASE, rope_scaling={"type": "yarn", "factor": 8.0, "mscale": 1.0,
                                                           "mscale_all_dim": 1.0}, max_position_embeddings=512))
    assert dcfg.rope_scaling == YarnScaling(8.0, 512, 32.0, 1.0, 1.0, 1.0)  # original = max_position_embeddings
    assert dcfg.rope_scaling.attention_factor == 1.0


# ------------------------------------------------------------------------------ target checks
@pytest.mark.parametrize("target,match", [
    (TINY.replace(hidden_size=96), "hidden_size=192 != target hidden_size=96"),
    (TINY.replace(num_hidden_layers=3), "target_layer_ids \\[3\\] do not exist"),
    (TINY.replace(vocab_size=300, mask_token_id=None), "mask_token_id=399 is outside the target vocabulary"),
    (TINY.replace(mask_token_id=398), "differs from the target config's mask_token_id=398"),
    (TINY.replace(num_hidden_layers=8), "num_target_layers=6.*num_hidden_layers=8"),
])
def test_a_drafter_that_does_not_fit_the_target_is_refused(target, match):
    with pytest.raises(ConfigError, match=match):
        load_hf_drafter(FIXTURES / "dflash_b16_gqa", jnp.float32, target=target)


# ------------------------------------------------------------------------------ bad files
def test_missing_extra_misshaped_and_wrong_dtype_tensors(tmp_path):
    src = FIXTURES / "dflash_b16_gqa" / "model.safetensors"
    tensors = load_file(src)
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "layers.1.self_attn.k_norm.weight"},
                    "missing 1 tensor.*layers.1.self_attn.k_norm.weight"),
        "extra": (dict(tensors, **{"layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)}),
                  "unexpected tensor.*layers.0.self_attn.q_proj.bias"),
        "shape": (dict(tensors, **{"fc.weight": np.zeros((192, 192), np.float32)}),
                  "'fc.weight'.*shape \\[192, 192\\], expected \\[192, 384\\]"),
        "dtype": (dict(tensors, **{"norm.weight": np.zeros(192, np.int32)}), "'norm.weight'.*dtype I32"),
    }
    for case, (content, match) in cases.items():
        d = copy_fixture("dflash_b16_gqa", tmp_path / case)
        save_file(content, str(d / "model.safetensors"))
        with pytest.raises(HFCheckpointError, match=match):
            load_hf_drafter(d, jnp.float32)


def test_truncated_file_and_missing_shard(tmp_path):
    d = copy_fixture("dflash_b16_gqa", tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HFCheckpointError, match="truncated or corrupt|cannot read"):
        load_hf_drafter(d, jnp.float32)
    d = copy_fixture("dflash_b8_yarn", tmp_path)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(HFCheckpointError, match=f"shard '{shard.name}'.*does not exist"):
        load_hf_drafter(d, jnp.float32)


def test_bad_directories(tmp_path):
    with pytest.raises(DrafterFormatError, match="not a directory"):
        load_hf_drafter(tmp_path / "nope")
    with pytest.raises(DrafterFormatError, match="no config.json"):
        load_hf_drafter(tmp_path)
    d = copy_fixture("dflash_b16_gqa", tmp_path)
    edit_config(d, attention_bias=True)
    with pytest.raises(DrafterFormatError, match="config.json: DFlash config attention_bias=True"):
        load_hf_drafter(d)
    with pytest.raises(HFCheckpointError, match="floating dtype"):
        load_hf_drafter(FIXTURES / "dflash_b16_gqa", jnp.int32)


# ------------------------------------------------------------------------------------- CLI
def test_cli_convert_both_ways_and_generate_with_an_hf_drafter(tmp_path, capsys):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert cli.main(["convert", "--drafter", str(FIXTURES / "dflash_b8_yarn"), str(ckpt), "--dtype", "float32"]) == 0
    assert "reads target layers [0, 2, 4]" in capsys.readouterr().out
    dcfg, dparams = kj.load_checkpoint(ckpt, expect_kind="drafter")
    want_cfg, want = load_hf_drafter(FIXTURES / "dflash_b8_yarn", jnp.float32)
    assert dcfg == want_cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), dparams, want)
    assert cli.main(["convert", "--to-hf-drafter", str(ckpt), str(back)]) == 0
    _, again = load_hf_drafter(back, jnp.float32)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), again, want)

    rc = cli.main(["generate", "--preset", "tiny", "--hf-drafter", str(FIXTURES / "dflash_b16_gqa"), "--method",
                   "all", "--budget", "4", "--prompt", "1 2 3", "--max-new-tokens", "5", "--no-warmup"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "DFlash drafter" in out
    table = out[out.index("same tokens as ar"):].splitlines()[1:4]  # then a note on a CPU
    assert [row.split()[-1] for row in table] == ["yes", "yes", "yes"]

    rc = cli.main(["generate", "--preset", "tiny", "--layers", "2", "--hf-drafter",
                   str(FIXTURES / "dflash_b16_gqa"), "--method", "ddtree", "--budget", "4"])
    err = capsys.readouterr().err
    assert rc != 0 and "does not fit the target" in err and "target_layer_ids [3]" in err


def test_the_float64_reference_drafter_refuses_yarn_instead_of_ignoring_it():
    from reference import drafter as ref_drafter  # noqa: PLC0415

    dcfg, dparams = load_hf_drafter(FIXTURES / "dflash_b8_yarn", jnp.float32)
    p = jax.tree.map(np.asarray, dparams)
    with pytest.raises(NotImplementedError, match="plain RoPE only"):
        ref_drafter.project_kv(p["layers_0"]["attn"], dcfg, np.zeros((1, 192)), np.zeros(1, np.int64))


def test_export_overwrite_replaces_only_an_exported_drafter(tmp_path):
    """overwrite=True replaces a DFlash drafter directory; a directory holding anything else is refused and
    keeps every file (issue 15 item 1 for the export)."""
    dcfg = DrafterConfig.for_target(TINY, num_layers=1)
    dparams = init_drafter_params(dcfg, jax.random.key(0))
    out = export_hf_drafter(dcfg, dparams, tmp_path / "d")
    again = export_hf_drafter(dcfg, dparams, tmp_path / "d" / ".." / "d", overwrite=True)  # X/../X is X
    assert again == out.resolve() and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(HFCheckpointError, match="refusing to overwrite"):
        export_hf_drafter(dcfg, dparams, precious, overwrite=True)
    assert (precious / "notes.txt").read_text() == "keep me"
    assert not list(tmp_path.glob(".*.tmp-*")) and not list(tmp_path.glob(".*.lock"))
