"""The DFlash-style drafter against the float64 NumPy reference (reference/drafter.py)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.config import ConfigError, ModelConfig
from kdtree_jax.drafter import (
    MAX_BLOCK_SIZE,
    Drafter,
    DrafterCache,
    DrafterConfig,
    default_target_layer_ids,
    drafter_extend_context,
    drafter_forward,
    drafter_param_names,
    fold_drafter_params,
    init_drafter_cache,
    init_drafter_params,
)
from reference import drafter as ref

VOCAB = 50
TOL = 1e-5
# Jitted once per config: op-by-op eager dispatch compiles every primitive separately, which dominates
# the runtime of these tiny shapes on CPU. The eager path is exercised by the shape-error tests.
extend = jax.jit(drafter_extend_context, static_argnums=1)
forward = jax.jit(drafter_forward, static_argnums=1)


def small_config(**changes) -> DrafterConfig:
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, block_size=5, target_layer_ids=(0, 2), mask_token_id=VOCAB - 1,
                rms_norm_eps=1e-5, rope_theta=1000.0)
    base.update(changes)
    return DrafterConfig(**base).validate()


def random_params(dcfg: DrafterConfig, seed: int = 0) -> dict:
    """init_drafter_params with every norm weight randomised too, so the norms are exercised."""
    params = init_drafter_params(dcfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda w: np.asarray(w) + 0.3 * rng.normal(size=w.shape).astype(np.float32)
                        if w.ndim == 1 else np.asarray(w), params)


def target_weights(dcfg: DrafterConfig, seed: int = 7):
    rng = np.random.default_rng(seed)
    embed = rng.normal(size=(VOCAB, dcfg.hidden_size)).astype(np.float32)  # [V, D]
    lm_head = (rng.normal(size=(dcfg.hidden_size, VOCAB)) * dcfg.hidden_size**-0.5).astype(np.float32)  # [D, V]
    return jnp.asarray(embed), jnp.asarray(lm_head)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def ragged_context(dcfg, lengths, T, seed=3, offsets=None):
    """Random target hidden [B, T, n, D] (rows past lengths[b] are garbage) and positions [B, T]."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    hidden = rng.normal(size=(B, T, dcfg.num_target_layers, dcfg.hidden_size)).astype(np.float32) * 2.0
    offsets = np.zeros(B, np.int32) if offsets is None else np.asarray(offsets, np.int32)
    positions = (offsets[:, None] + np.arange(T, dtype=np.int32)[None, :]).astype(np.int32)  # [B, T]
    return hidden, positions


# ---------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("dcfg", [small_config(), small_config(num_hidden_layers=1, num_key_value_heads=4,
                                                                target_layer_ids=(1,), block_size=3)],
                         ids=["gqa-2layers", "mha-1layer"])
def test_extend_and_forward_match_reference_ragged(dcfg):
    params = random_params(dcfg)
    embed, lm_head = target_weights(dcfg)
    lengths = np.array([0, 5, 9], np.int32)
    offsets = np.array([0, 2, 11], np.int32)  # positions need not start at 0
    hidden, positions = ragged_context(dcfg, lengths, T=9, offsets=offsets)
    cache = init_drafter_cache(dcfg, batch=3, max_len=12)
    cache = extend(params, dcfg, cache, jnp.asarray(hidden), jnp.asarray(positions), jnp.asarray(lengths))
    np.testing.assert_array_equal(cache.lengths, lengths)

    bonus = jnp.array([4, 17, 31], jnp.int32)
    block_start = jnp.asarray(offsets + lengths)
    logits = forward(params, dcfg, cache, embed, lm_head, bonus, block_start)
    assert logits.shape == (3, dcfg.block_size - 1, VOCAB) and logits.dtype == jnp.float32

    p64 = ref.to_float64(params)
    keys, values = np.asarray(cache.keys), np.asarray(cache.values)
    for b in range(3):
        n = int(lengths[b])
        want_kv = ref.context_keys_values(p64, dcfg, hidden[b, :n].astype(np.float64), positions[b, :n])
        for layer, (k, v) in enumerate(want_kv):
            if n:
                assert rel_err(keys[layer, b, :n], k) < TOL
                assert rel_err(values[layer, b, :n], v) < TOL
        want = ref.drafter_logits(p64, dcfg, hidden[b, :n], positions[b, :n], embed, lm_head,
                                  int(bonus[b]), int(block_start[b]))
        assert rel_err(logits[b], want) < TOL, f"row {b}"


@pytest.mark.parametrize("dcfg", [small_config(), small_config(num_hidden_layers=1, num_key_value_heads=4,
                                                                target_layer_ids=(1,), block_size=3)],
                         ids=["gqa-2layers", "mha-1layer"])
def test_folded_params_give_the_same_drafts_and_context(dcfg):
    """fold_drafter_params ([q | k | v], [gate | up] per layer, every layer's [k | v]): the context update writes the
    same cache rows and the forward gives the same logits as on the separate matrices, and the float64 reference;
    the params passed in are left as they were."""
    params = random_params(dcfg)
    folded = fold_drafter_params(params, dcfg)
    assert "qkv" in folded["layers_0"]["attn"] and "gate_up" in folded["layers_0"]["mlp"] and "kv_all" in folded
    assert "qkv" not in params["layers_0"]["attn"] and "kv_all" not in params
    embed, lm_head = target_weights(dcfg)
    lengths = np.array([3, 7], np.int32)
    hidden, positions = ragged_context(dcfg, lengths, T=7)
    bonus, block_start = jnp.array([4, 17], jnp.int32), jnp.asarray(lengths)
    got = {}
    for label, p in (("separate", params), ("folded", folded)):
        cache = extend(p, dcfg, init_drafter_cache(dcfg, batch=2, max_len=12), jnp.asarray(hidden),
                       jnp.asarray(positions), jnp.asarray(lengths))
        got[label] = (np.asarray(cache.keys), np.asarray(cache.values),
                      np.asarray(forward(p, dcfg, cache, embed, lm_head, bonus, block_start)))
    for sep, fold in zip(got["separate"], got["folded"], strict=True):
        assert rel_err(fold, sep) < TOL
    p64 = ref.to_float64(params)
    for b in range(2):
        n = int(lengths[b])
        want = ref.drafter_logits(p64, dcfg, hidden[b, :n], positions[b, :n], embed, lm_head, int(bonus[b]), n)
        assert rel_err(got["folded"][2][b], want) < TOL


def test_garbage_context_rows_are_ignored():
    """Rows past lengths[b] (padding of a shape-stable extend) must not change the draft."""
    dcfg = small_config()
    params = random_params(dcfg)
    embed, lm_head = target_weights(dcfg)
    lengths = jnp.array([3, 6], jnp.int32)
    hidden, positions = ragged_context(dcfg, [3, 6], T=6)
    outs = []
    for seed in (0, 1):
        noisy = hidden.copy()
        noisy[0, 3:] = np.random.default_rng(seed).normal(size=noisy[0, 3:].shape) * 10
        cache = extend(params, dcfg, init_drafter_cache(dcfg, 2, 8), jnp.asarray(noisy),
                       jnp.asarray(positions), lengths)
        outs.append(forward(params, dcfg, cache, embed, lm_head, jnp.array([1, 2], jnp.int32), lengths))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_chunked_extend_equals_at_once():
    dcfg = small_config()
    params = random_params(dcfg)
    embed, lm_head = target_weights(dcfg)
    chunks = np.array([[2, 0, 3], [4, 4, 1], [0, 1, 0]], np.int32)  # [B, rounds]: valid rows per call
    totals = chunks.sum(1)
    full_hidden, full_pos = ragged_context(dcfg, totals, T=int(totals.max()))
    B, T_chunk, max_len = 3, 4, 12

    at_once = extend(params, dcfg, init_drafter_cache(dcfg, B, max_len), jnp.asarray(full_hidden),
                     jnp.asarray(full_pos), jnp.asarray(totals))
    cache = init_drafter_cache(dcfg, B, max_len)
    done = np.zeros(B, np.int32)
    rng = np.random.default_rng(5)
    for r in range(chunks.shape[1]):
        # Each call carries T_chunk rows per batch row; rows past the valid count are random garbage.
        hid = rng.normal(size=(B, T_chunk, dcfg.num_target_layers, dcfg.hidden_size)).astype(np.float32)
        pos = np.zeros((B, T_chunk), np.int32)
        for b in range(B):
            n = chunks[b, r]
            hid[b, :n] = full_hidden[b, done[b]:done[b] + n]
            pos[b] = done[b] + np.arange(T_chunk)
        cache = extend(params, dcfg, cache, jnp.asarray(hid), jnp.asarray(pos), jnp.asarray(chunks[:, r]))
        done += chunks[:, r]
    np.testing.assert_array_equal(cache.lengths, totals)
    chunked_np, at_once_np = jax.tree.map(np.asarray, cache), jax.tree.map(np.asarray, at_once)
    for b in range(B):
        n = int(totals[b])
        np.testing.assert_allclose(chunked_np.keys[:, b, :n], at_once_np.keys[:, b, :n], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(chunked_np.values[:, b, :n], at_once_np.values[:, b, :n], rtol=1e-6, atol=1e-6)
    bonus = jnp.array([3, 8, 9], jnp.int32)
    got = forward(params, dcfg, cache, embed, lm_head, bonus, cache.lengths)
    want = forward(params, dcfg, at_once, embed, lm_head, bonus, at_once.lengths)
    assert rel_err(got, want) < 1e-6


def test_runs_inside_while_loop():
    """Shape stability: extend + draft as the carried state of a lax.while_loop, as the DDTree loop does.
    Each round appends a ragged number of context rows; the final draft equals the reference on the
    whole context."""
    dcfg = small_config()
    params = random_params(dcfg)
    embed, lm_head = target_weights(dcfg)
    per_round = np.array([[1, 3, 2], [2, 0, 4]], np.int32)  # [B, rounds]
    B, T = 2, 4
    totals = per_round.sum(1)
    hidden, _ = ragged_context(dcfg, totals, T=int(totals.max()))
    rounds_hidden = np.zeros((3, B, T) + hidden.shape[2:], np.float32)  # [rounds, B, T, n, D]
    done = np.zeros(B, np.int32)
    for r in range(3):
        for b in range(B):
            rounds_hidden[r, b, :per_round[b, r]] = hidden[b, done[b]:done[b] + per_round[b, r]]
        done += per_round[:, r]

    @jax.jit
    def run(params, embed, lm_head, rounds_hidden, per_round):
        def body(state):
            r, cache, _ = state
            pos = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
            cache = drafter_extend_context(params, dcfg, cache, rounds_hidden[r], pos, per_round[:, r])
            bonus = jnp.full((B,), 7, jnp.int32)
            return r + 1, cache, drafter_forward(params, dcfg, cache, embed, lm_head, bonus, cache.lengths)

        init = (0, init_drafter_cache(dcfg, B, 12), jnp.zeros((B, dcfg.block_size - 1, VOCAB), jnp.float32))
        return jax.lax.while_loop(lambda s: s[0] < 3, body, init)

    _, cache, logits = run(params, embed, lm_head, jnp.asarray(rounds_hidden), jnp.asarray(per_round))
    np.testing.assert_array_equal(cache.lengths, totals)
    p64 = ref.to_float64(params)
    for b in range(B):
        n = int(totals[b])
        want = ref.drafter_logits(p64, dcfg, hidden[b, :n], np.arange(n), embed, lm_head, 7, n)
        assert rel_err(logits[b], want) < TOL


def test_linen_wrapper_agrees_with_plain_functions():
    dcfg = small_config()
    params = random_params(dcfg)
    embed, lm_head = target_weights(dcfg)
    hidden, positions = ragged_context(dcfg, [2, 4], T=4)
    args = (jnp.asarray(hidden), jnp.asarray(positions), jnp.array([2, 4], jnp.int32))
    plain_cache = extend(params, dcfg, init_drafter_cache(dcfg, 2, 6), *args)
    fwd_args = (embed, lm_head, jnp.array([5, 6], jnp.int32), plain_cache.lengths)
    plain_logits = forward(params, dcfg, plain_cache, *fwd_args)

    module = Drafter(dcfg)
    fresh = jax.jit(functools.partial(module.init, method="init_params"))(jax.random.key(0))["params"]
    assert sorted(fresh) == sorted(drafter_param_names(dcfg))
    assert jax.tree.map(jnp.shape, dict(fresh)) == jax.tree.map(jnp.shape, params)
    variables = {"params": params}
    cache = jax.jit(functools.partial(module.apply, method="extend_context"))(
        variables, init_drafter_cache(dcfg, 2, 6), *args)
    np.testing.assert_allclose(cache.keys, plain_cache.keys, rtol=1e-6, atol=1e-6)
    logits = jax.jit(module.apply)(variables, plain_cache, *fwd_args)
    assert rel_err(logits, plain_logits) < 1e-6


def test_params_tree_layout():
    dcfg = small_config()
    params = init_drafter_params(dcfg, jax.random.key(0))
    assert type(params) is dict and all(type(params[f"layers_{i}"]) is dict for i in range(2))
    assert params["fc"].shape == (2 * 32, 32)
    attn = params["layers_0"]["attn"]
    assert (attn["q"].shape, attn["k"].shape, attn["v"].shape, attn["o"].shape) == (
        (32, 32), (32, 16), (32, 16), (32, 32))
    assert attn["q_norm"].shape == attn["k_norm"].shape == (8,)
    assert init_drafter_params(dcfg, jax.random.key(0), jnp.bfloat16)["fc"].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("changes, match", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(block_size=1), r"block_size must be in \[2, 64\].*got 1"),
    (dict(block_size=2000), r"block_size must be in \[2, 64\].*take minutes to compile.*got 2000"),
    (dict(target_layer_ids=()), "target_layer_ids must be a non-empty"),
    (dict(target_layer_ids=[0, 1]), "target_layer_ids must be a non-empty tuple"),
    (dict(target_layer_ids=(1, -1)), "entries must be integers >= 0"),
    (dict(target_layer_ids=(2, 2)), "duplicates"),
    (dict(mask_token_id=None), "mask_token_id"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(intermediate_size=2.5), "intermediate_size"),
])
def test_config_validation_errors(changes, match):
    with pytest.raises(ConfigError, match=match):
        small_config(**changes)


def test_block_size_limit_is_inclusive():
    assert MAX_BLOCK_SIZE == 64
    assert small_config(block_size=MAX_BLOCK_SIZE).num_draft_tokens == 63
    with pytest.raises(ConfigError, match="got 65"):
        small_config(block_size=MAX_BLOCK_SIZE + 1)
    with pytest.raises(ConfigError, match="got 65"):  # a checkpoint's config.json is checked the same way
        DrafterConfig.from_dict({**small_config().to_dict(), "block_size": 65})


def test_config_round_trip_and_for_target(tiny_cfg):
    dcfg = small_config()
    assert DrafterConfig.from_dict(json.loads(json.dumps(dcfg.to_dict()))) == dcfg
    hash(dcfg)
    with pytest.raises(ConfigError, match="unknown DrafterConfig fields"):
        DrafterConfig.from_dict({**dcfg.to_dict(), "bogus": 1})

    tiny = tiny_cfg
    d = DrafterConfig.for_target(tiny)
    assert (d.hidden_size, d.mask_token_id, d.target_layer_ids, d.num_hidden_layers) == (192, 399, (3,), 1)
    assert d.num_attention_heads % d.num_key_value_heads == 0
    assert DrafterConfig.for_target(tiny, num_layers=3).target_layer_ids == (1, 2, 3)
    # DFlash's published Qwen3-8B drafter: 5 layers over a 36-layer target.
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert DrafterConfig.for_target(ModelConfig.kimi_k26(), num_layers=4).num_key_value_heads == 8
    with pytest.raises(ConfigError, match="no mask_token_id"):
        DrafterConfig.for_target(tiny.replace(mask_token_id=None))
    # the default KV heads derive from the heads, so bad heads are named before anything else
    for heads in (0, 2.0, True):
        with pytest.raises(ConfigError, match=rf"num_attention_heads must be a positive integer, got {heads!r}"):
            DrafterConfig.for_target(tiny, num_attention_heads=heads)
    assert DrafterConfig.for_target(tiny, num_attention_heads=np.int64(16)).num_key_value_heads == 2
    with pytest.raises(ConfigError, match="6 layers"):
        default_target_layer_ids(6, 7)


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_size=64), "hidden_size=64 != target hidden_size=192"),
    (dict(target_layer_ids=(1, 6)), r"\[6\] do not exist"),
    (dict(mask_token_id=400), "outside the target vocabulary"),
    (dict(mask_token_id=398), "differs from the target config"),
])
def test_check_target_errors(changes, match, tiny_cfg):
    tiny = tiny_cfg
    dcfg = DrafterConfig.for_target(tiny)
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(dcfg, **changes).check_target(tiny)


def test_api_shape_errors():
    dcfg = small_config()
    params = init_drafter_params(dcfg, jax.random.key(0))
    embed, lm_head = target_weights(dcfg)
    cache = init_drafter_cache(dcfg, 2, 4)
    hidden = jnp.zeros((2, 3, 2, 32))
    pos = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="target_hidden must be"):
        drafter_extend_context(params, dcfg, cache, jnp.zeros((2, 3, 1, 32)), pos, jnp.array([1, 1]))
    with pytest.raises(ValueError, match="positions must be int"):
        drafter_extend_context(params, dcfg, cache, hidden, pos.astype(jnp.float32), jnp.array([1, 1]))
    with pytest.raises(ValueError, match="exceeds the cache's max_len=4"):
        drafter_extend_context(params, dcfg, cache._replace(lengths=jnp.array([2, 0], jnp.int32)), hidden,
                               pos, jnp.array([3, 0]))
    with pytest.raises(ValueError, match="num_valid must be in"):
        drafter_extend_context(params, dcfg, cache, hidden, pos, jnp.array([4, 0]))
    with pytest.raises(ValueError, match="lm_head must be"):
        drafter_forward(params, dcfg, cache, embed, lm_head.T, jnp.array([1, 2]), cache.lengths)
    with pytest.raises(ValueError, match="lm_head must be a dense"):
        drafter_forward(params, dcfg, cache, embed, {"packed": lm_head}, jnp.array([1, 2]), cache.lengths)
    with pytest.raises(ValueError, match="bonus_tokens must be int"):
        drafter_forward(params, dcfg, cache, embed, lm_head, jnp.array([1, 2, 3]), cache.lengths)
    with pytest.raises(ValueError, match="do not match"):
        drafter_forward(params, small_config(num_hidden_layers=1), cache, embed, lm_head, jnp.array([1, 2]),
                        cache.lengths)
    unvalidated = dataclasses.replace(dcfg, mask_token_id=None)  # dataclasses.replace skips validate()
    with pytest.raises(ValueError, match="mask_token_id is None"):
        drafter_forward(params, unvalidated, cache, embed, lm_head, jnp.array([1, 2]), cache.lengths)
    with pytest.raises(ValueError, match="max_len must be a positive"):
        init_drafter_cache(dcfg, 2, 0)
    assert isinstance(cache, DrafterCache)
