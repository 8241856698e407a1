"""HF -> Orbax conversion: same params and same greedy tokens as load_hf, entry-by-entry streaming,
atomicity (errors and Ctrl-C leave nothing), and the per-entry checkpoint format it relies on.

The reference for "same params" is load_hf (itself checked against transformers' logits in
test_hf_import.py); the comparison is bit-exact on every leaf, dtype and shape.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import SMALL

import kdtree_jax as kj
from kdtree_jax import checkpoint as ckpt
from kdtree_jax.checkpoint import CheckpointError, CheckpointWriter, load_checkpoint, save_checkpoint
from kdtree_jax.convert import convert_hf
from kdtree_jax.hf import HFCheckpointError, HFImport, load_hf
from pallas_kernels.int4 import Int4Weight

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ALL = ["hf_k2_dense", "hf_k25_dense", "hf_k2_int4", "hf_dsv3_f32"]


def assert_same_params(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, a), b in zip(flat_got, jax.tree.leaves(want), strict=True):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.fixture(scope="module")
def converted_int4(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "k2_int4"
    convert_hf(FIXTURES / "hf_k2_int4", out, jnp.float32, progress=False)
    return out


# ------------------------------------------------------------------------------ same as load_hf
@pytest.mark.parametrize("name", ALL)
def test_converted_checkpoint_loads_the_params_of_load_hf(name, tmp_path):
    out = convert_hf(FIXTURES / name, tmp_path / "out", jnp.float32, progress=False)
    cfg, params = load_checkpoint(out)
    want_cfg, want = load_hf(FIXTURES / name, jnp.float32, progress=False)
    assert cfg == want_cfg
    assert_same_params(params, want)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left


def test_bf16_conversion_keeps_int4_leaves_and_float32_router(tmp_path):
    out = convert_hf(FIXTURES / "hf_k2_int4", tmp_path / "bf16", jnp.bfloat16, progress=False)
    _, params = load_checkpoint(out)
    _, want = load_hf(FIXTURES / "hf_k2_int4", jnp.bfloat16, progress=False)
    assert_same_params(params, want)
    assert params["layers_1"]["attn"]["q_b"].dtype == jnp.bfloat16
    assert params["layers_1"]["moe"]["router"].dtype == jnp.float32
    assert isinstance(params["layers_1"]["moe"]["experts"]["gate"], Int4Weight)
    meta = json.loads((out / "config.json").read_text())
    assert meta["param_dtype"] == "bfloat16"
    assert sorted(meta["quantization"]["int4_leaves"]) == sorted(
        f"layers_{i}/moe/experts/{p}" for i in (1, 2) for p in ("gate", "up", "down"))


def test_greedy_generation_from_converted_equals_load_hf(converted_int4):
    cfg_a, from_ckpt = load_checkpoint(converted_int4)
    cfg_b, from_hf = load_hf(FIXTURES / "hf_k2_int4", jnp.float32, progress=False)
    prompts = [[3, 17, 42, 5], [9, 8]]
    a = kj.generate(cfg_a, from_ckpt, prompts, max_new_tokens=6, method="ar")
    b = kj.generate(cfg_b, from_hf, prompts, max_new_tokens=6, method="ar")
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    assert int(np.asarray(a.lengths).sum()) > 0


# ----------------------------------------------------------------------------- streaming / memory
def test_conversion_holds_one_entry_at_a_time(monkeypatch, tmp_path):
    """Each entry is written before the next one is read (peak memory about one layer)."""
    events = []
    load, write = HFImport._load, CheckpointWriter.write

    def logged_load(self, key, readers):
        events.append(("load", key))
        return load(self, key, readers)

    def logged_write(self, entry, subtree):
        events.append(("write", entry))
        return write(self, entry, subtree)

    monkeypatch.setattr(HFImport, "_load", logged_load)
    monkeypatch.setattr(CheckpointWriter, "write", logged_write)
    convert_hf(FIXTURES / "hf_k2_dense", tmp_path / "out", jnp.float32, progress=False)
    entries = ["embed_tokens", "layers_0", "layers_1", "layers_2", "final_norm", "lm_head"]
    assert events == [(op, e) for e in entries for op in ("load", "write")]
    assert sorted(os.listdir(tmp_path / "out" / "params")) == sorted(entries)


# ---------------------------------------------------------------------------------------- atomicity
@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_failure_or_interrupt_mid_conversion_leaves_nothing(monkeypatch, tmp_path, error):
    load = HFImport._load

    def failing_load(self, key, readers):
        if key == "layers_1":
            raise error("simulated failure while reading layers_1")
        return load(self, key, readers)

    monkeypatch.setattr(HFImport, "_load", failing_load)
    with pytest.raises(error):
        convert_hf(FIXTURES / "hf_k2_dense", tmp_path / "out", jnp.float32, progress=False)
    assert os.listdir(tmp_path) == []


def test_existing_output_is_refused_then_replaced_with_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_hf(FIXTURES / "hf_dsv3_f32", out, jnp.float32, progress=False)
    # overwrite replaces only a kdtree-jax checkpoint: a directory of other files stays as it is
    with pytest.raises(CheckpointError, match=r"refusing to overwrite .*out: it holds files that are not part "
                       r"of a checkpoint: \['keep.txt'\]"):
        convert_hf(FIXTURES / "hf_dsv3_f32", out, jnp.float32, progress=False, overwrite=True)
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    out.rmdir()
    convert_hf(FIXTURES / "hf_k2_dense", out, jnp.float32, progress=False)
    convert_hf(FIXTURES / "hf_dsv3_f32", out, jnp.float32, progress=False, overwrite=True)
    cfg, _ = load_checkpoint(out)
    assert cfg == load_hf(FIXTURES / "hf_dsv3_f32", jnp.float32, progress=False)[0]  # the new one replaced the old
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_bad_hf_directory_fails_before_anything_is_written(tmp_path):
    bad = tmp_path / "hf"
    shutil.copytree(FIXTURES / "hf_dsv3_f32", bad)
    (bad / "config.json").unlink()
    with pytest.raises(HFCheckpointError, match="no config.json"):
        convert_hf(bad, tmp_path / "out", progress=False)
    with pytest.raises(HFCheckpointError, match="floating dtype"):
        convert_hf(FIXTURES / "hf_dsv3_f32", tmp_path / "out", jnp.int32, progress=False)
    with pytest.raises(CheckpointError, match="refusing to write a checkpoint at .*: it is the Hugging Face directory"):
        convert_hf(FIXTURES / "hf_dsv3_f32", FIXTURES / "hf_dsv3_f32", progress=False, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# --------------------------------------------------------------------------- the writer and format
def test_writer_refuses_incomplete_duplicate_unknown_and_misshaped_entries(tmp_path, small_init_params):
    params = small_init_params
    with pytest.raises(CheckpointError, match=r"incomplete: entries \[.*'layers_1'.*never written"):
        with CheckpointWriter(tmp_path / "a", SMALL, param_dtype="float32") as w:
            for entry in ("embed_tokens", "layers_0"):
                w.write(entry, params[entry])
    w = CheckpointWriter(tmp_path / "b", SMALL, param_dtype="float32")
    w.write("final_norm", params["final_norm"])
    with pytest.raises(CheckpointError, match="already written"):
        w.write("final_norm", params["final_norm"])
    with pytest.raises(CheckpointError, match="'layers_7' is not a params entry"):
        w.write("layers_7", params["layers_0"])
    with pytest.raises(CheckpointError, match=r"layers_0/input_norm: expected float32\[192\], found float32\[3\]"):
        w.write("layers_0", {**params["layers_0"], "input_norm": jnp.ones((3,))})
    w.abort()
    with pytest.raises(CheckpointError, match="aborted"):
        w.write("embed_tokens", params["embed_tokens"])
    assert os.listdir(tmp_path) == []


def test_unexpected_entry_on_disk_is_refused(tmp_path, small_init_params):
    params = small_init_params
    path = save_checkpoint(tmp_path / "c", SMALL, params)
    shutil.copytree(path / "params" / "layers_1", path / "params" / "layers_2")
    with pytest.raises(CheckpointError, match="does not hold the params entry 'layers_2'"):
        load_checkpoint(path)
    shutil.rmtree(path / "params" / "layers_2")
    shutil.rmtree(path / "params" / "layers_1")
    with pytest.raises(CheckpointError, match="missing tensors.*layers_1"):
        load_checkpoint(path)


def test_format_1_single_tree_checkpoints_still_load(tmp_path):
    """Checkpoints written before the per-entry layout: params/ is one Orbax tree."""
    params = kj.init_params(SMALL, jax.random.key(3))
    path = tmp_path / "old"
    path.mkdir()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", params)
    checkpointer.wait_until_finished()
    (path / "config.json").write_text(json.dumps({"format": 1, "kind": "target", "config": SMALL.to_dict(),
                                                  "param_dtype": "float32", "quantization": None}))
    cfg, loaded = load_checkpoint(path)
    assert cfg == SMALL
    assert_same_params(loaded, params)
    meta = json.loads((path / "config.json").read_text())
    meta["format"] = 7
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="unsupported checkpoint format"):
        load_checkpoint(path)


def test_drafter_checkpoint_round_trip_and_kind_check(tmp_path):
    dcfg = kj.DrafterConfig.for_target(SMALL, block_size=4)
    dparams = kj.init_drafter_params(dcfg, jax.random.key(5), jnp.bfloat16)
    path = save_checkpoint(tmp_path / "drafter", dcfg, dparams)
    got_cfg, got = load_checkpoint(path, expect_kind="drafter")
    assert got_cfg == dcfg
    assert_same_params(got, dparams)
    with pytest.raises(CheckpointError, match="holds a drafter checkpoint, expected a target"):
        load_checkpoint(path, expect_kind="target")


def test_int4_leaf_metadata_must_name_dense_weights_of_the_config():
    abstract = jax.eval_shape(lambda: kj.init_params(SMALL, jax.random.key(0)))
    got = ckpt.abstract_int4_leaves(abstract, {"layers_1/moe/experts/down": "bfloat16"})
    leaf = got["layers_1"]["moe"]["experts"]["down"]  # dense [E, I, D] = [8, 64, 192]
    assert isinstance(leaf, Int4Weight)
    assert (leaf.qweight.shape, leaf.qweight.dtype) == ((8, 192, 16), jnp.int16)
    assert (leaf.scale.shape, leaf.scale.dtype) == ((8, 192, 2), jnp.bfloat16)
    assert not isinstance(abstract["layers_1"]["moe"]["experts"]["down"], Int4Weight)  # input untouched
    with pytest.raises(CheckpointError, match="'layers_0/moe/experts/gate', which is not a dense weight"):
        ckpt.abstract_int4_leaves(abstract, {"layers_0/moe/experts/gate": "bfloat16"})
    with pytest.raises(CheckpointError, match="bad scale dtype"):
        ckpt.abstract_int4_leaves(abstract, {"layers_1/moe/experts/up": "nonsense"})
