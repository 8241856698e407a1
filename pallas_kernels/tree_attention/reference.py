"""Tree-masked absorbed MLA attention in plain jnp: the definition the kernel is tested against
(`tree_mla_attention_reference`, float32 at HIGHEST precision) and the op's "xla" implementation
(`tree_mla_attention_xla`: the definition for float32 inputs; for bf16/f16 inputs the form production feeds
XLA, einsums in the input dtype with float32 accumulation and a float32 softmax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _masked_attention(q, cache, start, tree_mask, *, scale: float, value_dim: int, compute_dtype, precision):
    """Both implementations: einsums in `compute_dtype` at `precision` with float32 accumulation, a float32
    softmax over a [B, T, S_max] mask (which the kernel never builds), probabilities cast to `compute_dtype`
    for the value einsum; the result in q.dtype."""
    B, T, H, D = q.shape
    S_max = cache.shape[1]
    offset = jnp.arange(S_max)[None, :] - start[:, None]  # [B, S_max]: row index minus start
    in_tree = (offset >= 0) & (offset < T)  # [B, S_max]
    tree_visible = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(offset, 0, T - 1)[:, None, :], (B, T, S_max)), axis=2)
    visible = (offset < 0)[:, None, :] | (in_tree[:, None, :] & tree_visible)  # [B, T, S_max]
    dot = dict(precision=precision, preferred_element_type=jnp.float32)
    # Garbage rows (past start + T) may hold NaN/Inf, and 0 * NaN would poison the value sum: both einsums read one
    # copy of the cache with those rows zeroed (their scores become -inf below whatever they are). XLA makes that
    # copy in one fusion, which also absorbs the slice of this layer out of the engine's whole [L, B, S, C] cache;
    # zeroing only the value einsum's operand costs a second cache-sized copy, as neither GEMM fuses the slice or
    # the select (deviceless H100 compile, S = 4096, T = 1: 2 copies before 2026-12-06, 1 since).
    rows_ok = (offset < T)[:, :, None]  # [B, S_max, 1]
    cache = jnp.where(rows_ok, cache.astype(compute_dtype), jnp.zeros((), compute_dtype))
    scores = jnp.einsum("bthd,bsd->bths", q.astype(compute_dtype), cache, **dot) * scale
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)  # [B, T, H, S_max]
    probs = jax.nn.softmax(scores, axis=-1).astype(compute_dtype)
    out = jnp.einsum("bths,bsc->bthc", probs, cache[..., :value_dim], **dot)
    return out.astype(q.dtype)


def tree_mla_attention_reference(q, cache, start, tree_mask, *, scale: float, value_dim: int):
    """Plain-jnp definition. q [B, T, H, c+r]; cache [B, S_max, c+r]; start [B] int32;
    tree_mask [B, T, T] bool -> [B, T, H, c] in q.dtype. Computed in float32 at HIGHEST precision
    (also the XLA path of `impl="xla"` for float32 inputs)."""
    return _masked_attention(q, cache, start, tree_mask, scale=scale, value_dim=value_dim,
                             compute_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def tree_mla_attention_xla(q, cache, start, tree_mask, *, scale: float, value_dim: int):
    """The op's "xla" implementation, same arguments and result as the reference. float32 inputs: the
    reference itself (the greedy invariant is checked in float32 at full precision). bf16/f16: the einsums in
    the input dtype with float32 accumulation, float32 softmax, probabilities cast back to the input dtype for
    the value einsum (what the kernel does too), so a half-precision model does not upcast its whole latent
    cache to float32 on every call."""
    if q.dtype == jnp.float32:
        return tree_mla_attention_reference(q, cache, start, tree_mask, scale=scale, value_dim=value_dim)
    return _masked_attention(q, cache, start, tree_mask, scale=scale, value_dim=value_dim,
                             compute_dtype=q.dtype, precision=None)
