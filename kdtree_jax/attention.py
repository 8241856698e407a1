"""Absorbed MLA attention over the latent cache: the one attention entry point of the model.

`mla_attention` calls `pallas_kernels.tree_attention.tree_mla_attention` with the implementation the
caller's `Kernels` asks for (default "auto": pallas_kernels.dispatch picks the tree-masked Mosaic GPU kernel
on a Hopper GPU at the bf16 call shapes where it measured fastest, its plain-jnp form elsewhere;
`kdtree_jax.kernels.kernel_plan` says which, once).
"""

from __future__ import annotations

import jax

from pallas_kernels.dispatch import Kernels
from pallas_kernels.tree_attention import tree_mla_attention

DEFAULT_KERNELS = Kernels()


def mla_attention(q: jax.Array, cache: jax.Array, start: jax.Array, visibility: jax.Array, *,
                  scale: float, value_dim: int, kernels: Kernels = DEFAULT_KERNELS) -> jax.Array:
    """q [B, T, H, c+r]; cache [B, S, c+r] (rows [start, start+T) hold the new tokens); start [B];
    visibility [B, T, T] bool among the new tokens (diagonal True). Returns [B, T, H, c] in q.dtype."""
    return tree_mla_attention(q, cache, start, visibility, scale=scale, value_dim=value_dim,
                              impl=kernels.attention, interpret=kernels.interpret)
