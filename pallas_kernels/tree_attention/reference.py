"""Tree-masked absorbed MLA attention in plain jnp: the definition the kernel is tested against and the op's
"xla" implementation."""

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
