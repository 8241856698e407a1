"""Orbax checkpoints: bit-exact round trip, atomic writes, and clear errors on damaged checkpoints."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL

import kdtree_jax as kj


@pytest.fixture(scope="module")
def saved(tmp_path_factory, small_params):
    params = small_params
    path = tmp_path_factory.mktemp("ckpt") / "model"
    kj.save_checkpoint(path, SMALL, params)
    return path, params


def test_round_trip_is_bit_exact(saved):
    path, params = saved
    cfg, loaded = kj.load_checkpoint(path)
    assert cfg == SMALL
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_round_trip(tmp_path):
    params = kj.init_params(SMALL, jax.random.key(1), dtype=jnp.bfloat16)
    kj.save_checkpoint(tmp_path / "bf16", SMALL, params)
    _, loaded = kj.load_checkpoint(tmp_path / "bf16")
    assert loaded["layers_0"]["attn"]["q_b"].dtype == jnp.bfloat16
    assert loaded["layers_1"]["moe"]["router"].dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_existing_path_is_not_overwritten_without_consent(saved, tmp_path):
    path, params = saved
    with pytest.raises(kj.CheckpointError, match="already exists"):
        kj.save_checkpoint(path, SMALL, params)
    target = tmp_path / "again"
    kj.save_checkpoint(target, SMALL, params)
    kj.save_checkpoint(target, SMALL, params, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["again"]  # no temporary or old directories left


def test_failed_save_leaves_nothing_behind(tmp_path, small_params):
    params = small_params
    bad = dict(params)
    bad["final_norm"] = jnp.ones((3,))
    with pytest.raises(kj.CheckpointError, match="final_norm"):
        kj.save_checkpoint(tmp_path / "bad", SMALL, bad)
    assert os.listdir(tmp_path) == []


def _copy(saved, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(saved[0], dst)
    return dst


def test_config_that_does_not_match_the_tensors_is_refused(saved, tmp_path):
    dst = _copy(saved, tmp_path)
    meta = json.loads((dst / "config.json").read_text())
    meta["config"]["num_hidden_layers"] = 3
    (dst / "config.json").write_text(json.dumps(meta))
    with pytest.raises(kj.CheckpointError, match="missing tensors.*layers_2"):
        kj.load_checkpoint(dst)
    meta["config"]["num_hidden_layers"] = 2
    meta["config"]["hidden_size"] = 96
    (dst / "config.json").write_text(json.dumps(meta))
    with pytest.raises(kj.CheckpointError, match="expected float32\\[96"):
        kj.load_checkpoint(dst)


def test_missing_or_damaged_files_are_refused(saved, tmp_path):
    with pytest.raises(kj.CheckpointError, match="kdtree-jax checkpoint path .* is not a directory"):
        kj.load_checkpoint(tmp_path / "nope")
    dst = _copy(saved, tmp_path)
    (dst / "config.json").unlink()
    with pytest.raises(kj.CheckpointError, match="no config.json in .*: not a kdtree-jax checkpoint directory"):
        kj.load_checkpoint(dst)
    dst2 = tmp_path / "copy2"
    shutil.copytree(saved[0], dst2)
    (dst2 / "config.json").write_text("{not json")
    with pytest.raises(kj.CheckpointError, match="not valid JSON"):
        kj.load_checkpoint(dst2)
    dst3 = tmp_path / "copy3"
    shutil.copytree(saved[0], dst3)
    for root, _, files in os.walk(dst3 / "params"):
        for name in files:
            file = os.path.join(root, name)
            if os.path.getsize(file) > 1000 and "ocdbt" not in name:
                with open(file, "r+b") as f:
                    f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(kj.CheckpointError):
        kj.load_checkpoint(dst3)


def test_relative_paths_load(saved, tmp_path, monkeypatch):
    path, params = saved
    monkeypatch.chdir(path.parent)
    cfg, loaded = kj.load_checkpoint(path.name)
    assert cfg == SMALL
    np.testing.assert_array_equal(np.asarray(loaded["final_norm"]), np.asarray(params["final_norm"]))


def test_checkpoint_written_on_another_platform_loads(saved, tmp_path):
    """Orbax stores each array's save-time device ("cpu:0" for the shipped pair); restoring without an
    explicit target sharding on another platform fails with "Topology mismatch" (seen on the H200).
    Simulate a checkpoint written on the other platform by rewriting the stored device: cpu:0 -> cuda:0
    on a CPU host, cuda:0 -> cpu:0 on a GPU host."""
    path, params = saved
    here = "cuda:0" if jax.default_backend() == "gpu" else "cpu:0"
    other = "cpu:0" if here == "cuda:0" else "cuda:0"
    copy = tmp_path / "from_other_platform"
    shutil.copytree(path, copy)
    rewritten = 0
    for f in copy.rglob("_sharding"):
        text = f.read_text()
        f.write_text(text.replace(here, other))
        rewritten += here in text
    assert rewritten > 0, f"no stored sharding names {here}"
    cfg, loaded = kj.load_checkpoint(copy)
    assert cfg == SMALL
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
