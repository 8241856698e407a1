"""Tree-masked absorbed MLA attention in plain jnp: the definition the kernel is tested against
(`tree_mla_attention_reference`, float32 at HIGHEST precision) and the op's "xla" implementation
(`tree_mla_attention_xla`: the definition for float32 inputs; for bf16/f16 inputs the form production feeds
XLA, einsums in the input dtype with float32 accumulation and a float32 softmax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_mla_attention_reference(q, cache, start, tree_mask, *, scale: float, value_dim: int):
    """Plain-jnp definition. q [B, T, H, c+r]; cache [B, S_max, c+r]; start [B] int32;
    tree_mask [B, T, T] bool -> [B, T, H, c] in q.dtype. Computed in float32 at HIGHEST precision
    (also the XLA path of `impl="xla"`); it builds a [B, T, S_max] mask, which the kernel never does."""
    B, T, H, D = q.shape
    S_max = cache.shape[1]
    offset = jnp.arange(S_max)[None, :] - start[:, None]  # [B, S_max]: row index minus start
    in_tree = (offset >= 0) & (offset < T)  # [B, S_max]
    tree_visible = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(offset, 0, T - 1)[:, None, :], (B, T, S_max)), axis=2)
    visible = (offset < 0)[:, None, :] | (in_tree[:, None, :] & tree_visible)  # [B, T, S_max]
    # Garbage rows may hold NaN/Inf; 0 * NaN would poison the value sum, so zero them first.
    rows_ok = (offset < T)[:, :, None]  # [B, S_max, 1]
    kv = jnp.where(rows_ok, cache.astype(jnp.float32), 0.0)  # [B, S_max, c+r]
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), kv, precision=hi) * scale
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)  # [B, T, H, S_max]
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bths,bsc->bthc", probs, kv[..., :value_dim], precision=hi)
    return out.astype(q.dtype)


def tree_mla_attention_xla(q, cache, start, tree_mask, *, scale: float, value_dim: int):
    """The op's "xla" implementation, same arguments and result as the reference. float32 inputs: the
    reference itself (the greedy invariant is checked in float32 at full precision). bf16/f16: score and value
    einsums in the input dtype with float32 accumulation, float32 softmax, probabilities cast back to the
    input dtype for the value einsum (what the kernel does too), so a half-precision model does not upcast its
    whole latent cache to float32 on every call."""
    if q.dtype == jnp.float32:
        return tree_mla_attention_reference(q, cache, start, tree_mask, scale=scale, value_dim=value_dim)
    B, T, H, D = q.shape
    S_max = cache.shape[1]
    offset = jnp.arange(S_max)[None, :] - start[:, None]
    tree_visible = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(offset, 0, T - 1)[:, None, :], (B, T, S_max)), axis=2)
    visible = (offset < 0)[:, None, :] | (((offset >= 0) & (offset < T))[:, None, :] & tree_visible)
    kv = jnp.where((offset < T)[:, :, None], cache, jnp.zeros((), cache.dtype))  # garbage rows may hold NaN
    scores = jnp.einsum("bthd,bsd->bths", q, kv, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bths,bsc->bthc", probs, kv[..., :value_dim], preferred_element_type=jnp.float32)
    return out.astype(q.dtype)
