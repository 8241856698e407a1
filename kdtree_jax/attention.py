"""Absorbed MLA attention over the latent cache: the one attention entry point of the model.

Dispatches to the tree-masked Pallas kernel (pallas_kernels/tree_attention) on a GPU and to its
plain-jnp reference elsewhere; `set_attention_impl` / the KDTREE_ATTENTION env var pin the choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mla_attention(q: jax.Array, cache: jax.Array, start: jax.Array, visibility: jax.Array, *,
                  scale: float, value_dim: int) -> jax.Array:
    """q [B, T, H, c+r]; cache [B, S, c+r] (rows [start, start+T) hold the new tokens); start [B];
    visibility [B, T, T] bool among the new tokens. Returns [B, T, H, c] in q.dtype."""
    steps = q.shape[1]
    slots = jnp.arange(cache.shape[1])
    # [B, T, S]: committed prefix fully visible; the T new rows by `visibility`; later rows never.
    offset = slots[None, None, :] - start[:, None, None]
    in_block = (offset >= 0) & (offset < steps)
    block_visible = jnp.take_along_axis(
        visibility, jnp.clip(offset, 0, steps - 1).astype(jnp.int32), axis=2)
    mask = (offset < 0) | (in_block & block_visible)
    scores = jnp.einsum("bthd,bsd->bhts", q, cache, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bsc->bthc", probs, cache[..., :value_dim].astype(jnp.float32))
    return out.astype(q.dtype)
