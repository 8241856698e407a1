"""y = x @ W for a dense [in, out] weight or an INT4 (W4A16 group-32) leaf."""

from __future__ import annotations

import jax

from kdtree_jax.quant import int4_linear, is_int4_leaf

__all__ = ["is_int4_leaf", "linear"]


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., K] -> [..., N]. Dense weights are [K, N]; INT4 leaves go to the W4A16 kernel path."""
    if is_int4_leaf(w):
        return int4_linear(x, w)
    return x @ w.astype(x.dtype)
