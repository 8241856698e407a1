"""Tree-masked MLA attention: the public entry point, its jnp reference and its XLA path, checked against an
independent float64 NumPy implementation (the float64 truth and the inputs here are shared with the Mosaic GPU
kernel's tests, test_tree_attention_mgpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.tree_attention import (
    check_tree_attention_values,
    tree_mla_attention,
    tree_mla_attention_reference,
    tree_mla_attention_xla,
)

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


def numpy_tree_attention(q, cache, start, tree_mask, scale, value_dim):
    """Float64 loops over (b, t): the ground truth, written from the visibility rule alone."""
    q, cache = np.asarray(q, np.float64), np.asarray(cache, np.float64)
    B, T, H, _ = q.shape
    out = np.zeros((B, T, H, value_dim))
    for b in range(B):
        s0 = int(start[b])
        for t in range(T):
            rows = list(range(s0)) + [s0 + u for u in range(T) if tree_mask[b, t, u]]
            kv = cache[b, rows]  # [n, c + r]
            logits = q[b, t] @ kv.T * scale  # [H, n]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[b, t] = p @ kv[:, :value_dim]
    return out


def make_inputs(seed, B, T, H, c, r, S_max, starts, dtype, chain=False, garbage=np.nan):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, c + r)).astype(np.float32)
    cache = rng.standard_normal((B, S_max, c + r)).astype(np.float32)
    start = np.asarray(starts, np.int32)
    for b in range(B):  # rows past start + T are garbage (NaN by default): they must not leak into the output
        cache[b, start[b] + T:] = garbage
    if chain:
        tree = np.tril(np.ones((B, T, T), bool))
    else:  # random tree: each token's parent is an earlier token; visible = ancestors + itself
        tree = np.zeros((B, T, T), bool)
        for b in range(B):
            for t in range(T):
                tree[b, t, t] = True
                if t:
                    tree[b, t] |= tree[b, rng.integers(0, t)]
    q_j = jnp.asarray(q).astype(dtype)
    cache_j = jnp.asarray(cache).astype(dtype)
    # The truth sees the same rounded inputs as the code under test.
    truth = numpy_tree_attention(np.asarray(q_j.astype(jnp.float32)), np.asarray(cache_j.astype(jnp.float32)),
                                 start, tree, 0.3 / np.sqrt(c + r), c)
    return q_j, cache_j, jnp.asarray(start), jnp.asarray(tree), truth


def rel_err(x, truth):
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    return np.max(np.abs(x - truth)) / np.max(np.abs(truth))


TINY = dict(H=6, c=64, r=16)


def test_reference_matches_numpy():
    q, cache, start, tree, truth = make_inputs(0, B=3, T=7, S_max=50, starts=[0, 13, 43], dtype=jnp.float32, **TINY)
    out = tree_mla_attention_reference(q, cache, start, tree, scale=0.3 / np.sqrt(80), value_dim=64)
    assert out.shape == (3, 7, 6, 64) and out.dtype == jnp.float32
    assert rel_err(out, truth) < 1e-5


def test_xla_impl_is_the_reference_in_float32_and_half_precision_einsums_in_bf16():
    """impl="xla": float32 inputs get the reference bit for bit (NaN garbage rows kept out); bf16 inputs the bf16
    einsum form (float32 accumulation and softmax) over the cache as it is, within bf16 rounding of the float64
    truth, its garbage rows finite (the engine's) but huge: scores that overflow to inf there stay masked, and their
    zero probabilities keep them out of the value sum; float16 zeroes its garbage rows first (NaN kept out)."""
    kw = dict(scale=0.3 / np.sqrt(80), value_dim=64)
    q, cache, start, tree, _ = make_inputs(1, B=2, T=5, S_max=40, starts=[0, 30], dtype=jnp.float32, **TINY)
    np.testing.assert_array_equal(np.asarray(tree_mla_attention_xla(q, cache, start, tree, **kw)),
                                  np.asarray(tree_mla_attention_reference(q, cache, start, tree, **kw)))
    q, cache, start, tree, truth = make_inputs(1, B=2, T=5, S_max=40, starts=[0, 30], dtype=jnp.bfloat16,
                                               garbage=1e38, **TINY)
    out = jax.jit(lambda *a: tree_mla_attention_xla(*a, **kw))(q, cache, start, tree)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, truth) < 2e-2
    np.testing.assert_array_equal(np.asarray(tree_mla_attention(q, cache, start, tree, impl="xla", **kw)),
                                  np.asarray(out))
    q, cache, start, tree, truth = make_inputs(1, B=2, T=5, S_max=40, starts=[0, 30], dtype=jnp.float16, **TINY)
    out = jax.jit(lambda *a: tree_mla_attention_xla(*a, **kw))(q, cache, start, tree)
    assert out.dtype == jnp.float16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, truth) < 2e-2


def test_auto_on_cpu_is_the_reference_path_and_an_explicit_kernel_raises():
    if HAS_GPU:
        pytest.skip("on a GPU, impl='auto' may pick the kernel; covered by test_tree_attention_mgpu.py")
    q, cache, start, tree, truth = make_inputs(3, B=1, T=3, S_max=20, starts=[9], dtype=jnp.float32, **TINY)
    assert dispatch.choose_attention(latent_dim=64, rope_dim=16) == dispatch.Choice("xla", "no GPU, this is cpu")
    out = tree_mla_attention(q, cache, start, tree, scale=0.3 / np.sqrt(80), value_dim=64)
    assert rel_err(out, truth) < 1e-5
    with pytest.raises(dispatch.KernelUnavailableError, match="attention impl='mosaic_gpu' cannot run: needs a Hopper"):
        tree_mla_attention(q, cache, start, tree, scale=0.3 / np.sqrt(80), value_dim=64, impl="mosaic_gpu")
    # interpret mode on a CPU: the Mosaic kernel where its dtype allows; float32 runs XLA and says why
    assert dispatch.choose_attention(latent_dim=64, rope_dim=16, interpret=True, num_heads=6, dtype=jnp.float32,
                                     num_tree=3, cache_rows=20) == dispatch.Choice(
        "xla", "needs bf16 or f16, the model runs in float32")
    np.testing.assert_array_equal(
        np.asarray(tree_mla_attention(q, cache, start, tree, scale=0.3 / np.sqrt(80), value_dim=64, interpret=True)),
        np.asarray(out))


def test_value_and_shape_errors():
    q, cache, start, tree, _ = make_inputs(5, B=1, T=4, S_max=12, starts=[8], dtype=jnp.float32, **TINY)
    kw = dict(scale=0.1, value_dim=64)
    with pytest.raises(ValueError, match="start \\+ T must be <= S_max"):
        tree_mla_attention(q, cache, jnp.array([9], jnp.int32), tree, **kw)
    with pytest.raises(ValueError, match="diagonal"):
        check_tree_attention_values(start, jnp.zeros((1, 4, 4), bool), cache_rows=12)
    with pytest.raises(ValueError, match="share a float dtype"):
        tree_mla_attention(q, cache.astype(jnp.bfloat16), start, tree, **kw)
    with pytest.raises(ValueError, match="tree_mask must be bool"):
        tree_mla_attention(q, cache, start, tree.astype(jnp.int32), **kw)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        tree_mla_attention(q, cache, start, tree, impl="pallas", **kw)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        tree_mla_attention(q, cache, start, tree, impl="triton", **kw)  # deleted 2026-12-04: the Mosaic kernel won
    with pytest.raises(dispatch.KernelUnavailableError, match="latent width 48 not a multiple of 64"):
        tree_mla_attention(q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16), start, tree, scale=0.1, value_dim=48,
                           impl="mosaic_gpu", interpret=True)
    with pytest.raises(ValueError, match="value_dim"):
        tree_mla_attention(q, cache, start, tree, scale=0.1, value_dim=80)
