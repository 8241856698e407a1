"""Absorbed MLA attention over the latent cache: the one attention entry point of the model.

`mla_attention` calls `pallas_kernels.tree_attention.tree_mla_attention`: the tree-masked Pallas
kernel on a GPU, its plain-jnp reference (an XLA computation, not the kernel) on other backends, with
a one-time TreeAttentionFallbackWarning saying so (KDTREE_ATTENTION=xla silences it).
The environment variable KDTREE_ATTENTION=auto|pallas|xla pins the choice (read at trace time);
`describe_impl()` says what a trace on the current backend uses, so benchmarks can report it.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.tree_attention import tree_mla_attention

_CHOICES = ("auto", "pallas", "xla")


def selected_impl() -> str:
    choice = os.environ.get("KDTREE_ATTENTION", "auto")
    if choice not in _CHOICES:
        raise ValueError(f"KDTREE_ATTENTION must be one of {_CHOICES}, got {choice!r}")
    return choice


def describe_impl() -> str:
    """'pallas-triton kernel' or 'xla (jnp reference)': what `mla_attention` runs here."""
    choice = selected_impl()
    if choice == "auto":
        choice = "pallas" if jax.default_backend() == "gpu" else "xla"
    return "pallas-triton kernel" if choice == "pallas" else "xla (jnp reference)"


def mla_attention(q: jax.Array, cache: jax.Array, start: jax.Array, visibility: jax.Array, *,
                  scale: float, value_dim: int) -> jax.Array:
    """q [B, T, H, c+r]; cache [B, S, c+r] (rows [start, start+T) hold the new tokens); start [B];
    visibility [B, T, T] bool among the new tokens (diagonal True). Returns [B, T, H, c] in q.dtype."""
    return tree_mla_attention(q, cache, start, visibility, scale=scale, value_dim=value_dim,
                              impl=selected_impl())
