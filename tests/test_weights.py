"""Each weight declared once (kdtree_jax/weights.py): init, checkpoints, sharding, the HF plan and
docs/params.md all follow the declarations, and the random init is the one recorded before they existed."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

import kdtree_jax as kj
from kdtree_jax import checkpoint, hf, sharding, weights
from kdtree_jax.drafter import DrafterConfig, declare_drafter, init_drafter_params

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "tiny": TINY,
    "no_q_lora_no_shared_tied": TINY.replace(q_lora_rank=None, n_shared_experts=0, tie_word_embeddings=True,
                                             num_hidden_layers=3),
    "all_dense_but_last": TINY.replace(num_hidden_layers=3, first_k_dense_replace=2),
}

# sha256 over (path, dtype, shape, bytes) of every leaf of init_params(cfg, key(3), dtype), recorded on the
# main branch before the declarations existed (commit 3579984): the init must stay bit-identical.
INIT_GOLDEN = {
    ("tiny", "float32"): "1e13f46c1c37127444842c6dfb1cc9ac99d8ce9461d1dee8f90bdc844c618048",
    ("tiny", "bfloat16"): "4f2a0b0412ea036dfefa26502d23ad2abc3dc759894949d1f984228ae18452e4",
    ("no_q_lora_no_shared_tied", "float32"): "4d1628da1efc4846fd86ee5a072100a16789b2ab0c37d94258fa20c676657ef9",
    ("no_q_lora_no_shared_tied", "bfloat16"): "efa8ab5e1ce167cfed81cf87ef3980a368adfb9a8a52cd178d168493ef0c2c02",
}
DRAFTER_GOLDEN = "1f31912ef5061438dc97f58c2a28bdf4e4b9696c9b1ee28a7580e2f98641231e"  # for_target(TINY, 2 layers)


def _digest(tree) -> str:
    h = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in sorted(flat, key=lambda item: jax.tree_util.keystr(item[0])):
        a = np.asarray(leaf)
        for part in (jax.tree_util.keystr(path), str(a.dtype), str(a.shape)):
            h.update(part.encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _paths(tree) -> dict[tuple[str, ...], tuple]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in flat}


@pytest.mark.slow
@pytest.mark.parametrize("variant, dtype", sorted(INIT_GOLDEN))
def test_init_is_bit_identical_to_the_recorded_golden(variant, dtype):
    # the goldens were recorded on the CPU; a GPU's normal sampler rounds differently, so init runs there
    with jax.default_device(jax.devices("cpu")[0]):
        params = kj.init_params(VARIANTS[variant], jax.random.key(3), jnp.dtype(dtype))
    assert _digest(params) == INIT_GOLDEN[(variant, dtype)]


def test_drafter_init_is_bit_identical_to_the_recorded_golden():
    dcfg = DrafterConfig.for_target(TINY, num_layers=2)
    with jax.default_device(jax.devices("cpu")[0]):  # recorded on the CPU, as above
        params = init_drafter_params(dcfg, jax.random.key(3))
    assert _digest(params) == DRAFTER_GOLDEN


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_declared_weight_is_in_init_and_nothing_else(variant):
    cfg, dtype = VARIANTS[variant], jnp.bfloat16
    declared = weights.declare(cfg)
    initialised = _paths(jax.eval_shape(lambda: kj.init_params(cfg, jax.random.key(0), dtype)))
    want = {path: (spec.shape, np.dtype(spec.dtype(dtype))) for path, spec in declared.items()}
    assert initialised == want
    assert _paths(weights.abstract_params(cfg, dtype)) == want  # what checkpoints are checked against
    router = declared[(f"layers_{cfg.num_hidden_layers - 1}", "moe", "router")]
    assert router.float32 and router.dtype(jnp.bfloat16) == jnp.float32


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sharding_specs_follow_the_declared_axes(variant):
    cfg = VARIANTS[variant]
    declared = weights.declare(cfg)
    specs = sharding.param_specs(weights.abstract_params(cfg))
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, sharding.P))[0]
    got = {tuple(k.key for k in path): spec for path, spec in flat}
    assert set(got) == set(declared)
    for path, spec in declared.items():
        assert got[path] == sharding.spec(*spec.axes), path
    # spot checks of the rules themselves (tensor splits whole heads; experts over "expert")
    last = f"layers_{cfg.num_hidden_layers - 1}"  # an MoE layer in every variant
    assert got[(last, "moe", "experts", "down")] == sharding.P("expert", "tensor", None)
    assert got[("embed_tokens",)] == sharding.P(("expert", "tensor"), None)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_plan_reads_one_tensor_per_declared_weight(variant):
    cfg = VARIANTS[variant]
    declared = weights.declare(cfg)
    linears, vectors = hf._plan(cfg)
    planned = {lin.path for lin in linears} | {vec.path for vec in vectors}
    assert planned == set(declared)
    for lin in linears:
        *lead, k, n = declared[lin.path].shape
        assert (lin.in_features, lin.out_features) == (k, n), lin
        assert lead == ([lin.num_experts] if lin.expert is not None else [])
    last = cfg.num_hidden_layers - 1  # an MoE layer in every variant
    experts = [lin for lin in linears if lin.path == (f"layers_{last}", "moe", "experts", "down")]
    assert [lin.stem for lin in experts] == [f"model.layers.{last}.mlp.experts.{e}.down_proj"
                                            for e in range(cfg.n_routed_experts)]
    router = next(lin for lin in linears if lin.path == (f"layers_{last}", "moe", "router"))
    assert router.stem == f"model.layers.{last}.mlp.gate" and router.float32
    names = {vec.name for vec in vectors}
    assert f"model.layers.{last}.mlp.gate.e_score_correction_bias" in names and "model.norm.weight" in names


def test_adding_a_weight_is_one_row(monkeypatch):
    """A new row in the table reaches the abstract tree (checkpoints), the sharding rules and the HF plan."""
    row = weights._Row(weights.ATTN, "gate_bias", lambda c: (c.num_attention_heads,), ("heads",), "zeros",
                       "gate_bias", hf_linear=False)
    monkeypatch.setattr(weights, "_TABLE", (*weights._TABLE, row))
    weights.declare.cache_clear()
    try:
        path = ("layers_0", "attn", "gate_bias")
        assert weights.declare(TINY)[path].shape == (TINY.num_attention_heads,)
        assert weights.abstract_params(TINY)["layers_0"]["attn"]["gate_bias"].shape == (TINY.num_attention_heads,)
        assert sharding.param_logical_axes(path, 1) == ("heads",)
        _, vectors = hf._plan(TINY)
        assert ("model.layers.0.self_attn.gate_bias", path) in {(v.name, v.path) for v in vectors}
    finally:
        weights.declare.cache_clear()


def test_a_weight_the_model_uses_must_be_declared(monkeypatch):
    table = tuple(row for row in weights._TABLE if row.name != "kv_a_norm")
    monkeypatch.setattr(weights, "_TABLE", table)
    weights.declare.cache_clear()
    try:
        with pytest.raises(KeyError, match="layers_0/attn/kv_a_norm, which kdtree_jax/weights.py does not declare"):
            kj.init_params(TINY, jax.random.key(0))
    finally:
        weights.declare.cache_clear()


def test_checkpoint_expected_tree_is_the_declared_one():
    meta = {"quantization": {"int4_leaves": {"layers_1/moe/experts/gate": "bfloat16"}}}
    expected = checkpoint._abstract_target(TINY, jnp.bfloat16, meta)
    gate = expected["layers_1"]["moe"]["experts"]["gate"]
    assert isinstance(gate, kj.Int4Weight) and gate.dense_shape == weights.declare(TINY)[
        ("layers_1", "moe", "experts", "gate")].shape
    dense = dict(_paths(checkpoint.to_stored(expected)))
    assert dense[("layers_1", "moe", "experts", "gate", "qweight")] == (
        (TINY.n_routed_experts, TINY.moe_intermediate_size, TINY.hidden_size // 4), np.dtype(np.int16))


def test_docs_params_md_names_exactly_the_declared_weights():
    text = (ROOT / "docs" / "params.md").read_text()
    tree = text.split("```")[1]  # the first code block: the params tree
    documented = set(re.findall(r'"([a-z_0-9]+)"', tree))
    blocks = {"attn", "mlp", "moe", "experts", "shared", "layers_0"}
    declared = {row.name for row in weights._TABLE}
    assert documented - blocks == declared
    for row in weights._TABLE:  # the float32 rule is documented where it applies
        line = next(line for line in tree.splitlines() if f'"{row.name}"' in line)
        assert ("float32" in line) == row.float32, line


def test_weight_spec_is_frozen():
    spec = weights.declare(TINY)[("embed_tokens",)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.shape = (1,)


def test_drafter_weights_are_declared_once():
    dcfg = DrafterConfig.for_target(TINY, num_layers=2)
    declared = {path: (shape, np.dtype(np.float32)) for path, (shape, _) in
                declare_drafter(dcfg).items()}
    assert _paths(jax.eval_shape(lambda: init_drafter_params(dcfg, jax.random.key(0)))) == declared
    assert declared[("layers_1", "attn", "k")][0] == (dcfg.hidden_size, dcfg.num_key_value_heads * dcfg.head_dim)
