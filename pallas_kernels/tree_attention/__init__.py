"""Tree-masked MLA attention in absorbed form: T tree tokens x H heads against one latent cache.

Every query head is a (c + r)-wide vector (absorbed latent part, then RoPE part) scored against the
shared cache rows [c_kv | k_pe]; the value is the c-wide latent c_kv, so the output stays in latent
space (the caller applies W_UV). Visible rows for new token t of batch row b:
  * rows j < start[b]                       - the committed prefix, visible to every new token;
  * rows start[b] + u for u < T             - visible iff tree_mask[b, t, u] (ancestors + itself);
  * rows j >= start[b] + T                  - never (garbage: the kernel and float32 / float16 keep even NaN there
                                              out of the result; XLA's bf16 form needs them finite, as the engine's
                                              cache is: `reference.tree_mla_attention_xla`).

`tree_mla_attention` is the public entry point: it checks shapes and asks
`pallas_kernels.dispatch.choose_attention` which implementation runs: "mosaic_gpu" (`mosaic_gpu.py`, Hopper,
bf16 / f16; split count and schedule `tuned.mosaic_config`) or "xla" (`reference.tree_mla_attention_xla`: for
float32 the plain-jnp definition the kernel is tested against); on a GPU "auto" runs the one measured fastest at
the call shape (`tuned.measured_fastest`).
`check_tree_attention_values` checks what shapes cannot show (start >= 0, start + T <= S_max, diagonal of
tree_mask) and must be called outside `jit`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.core import Tracer  # still public in jax 0.11; jax has no other concreteness test

from pallas_kernels import dispatch
from pallas_kernels.tree_attention.mosaic_gpu import tree_attention_mosaic
from pallas_kernels.tree_attention.reference import tree_mla_attention_reference, tree_mla_attention_xla
from pallas_kernels.tree_attention.tuned import mosaic_config
from pallas_kernels.w4a16.mosaic_gpu import gpu_interpret_params

__all__ = [
    "check_tree_attention_values",
    "tree_mla_attention",
    "tree_mla_attention_reference",
    "tree_mla_attention_xla",
]

_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_tree_attention_values(start, tree_mask, *, cache_rows: int) -> None:
    """Value checks that `jit` cannot do (call with concrete arrays, outside jit).

    Raises ValueError if some start[b] < 0, start[b] + T > cache_rows, or tree_mask has a False
    on its diagonal. Inside jit these go unchecked: start + T > S_max reads past the cache."""

    start = np.asarray(start)
    tree_mask = np.asarray(tree_mask)
    T = tree_mask.shape[-1]
    if (start < 0).any():
        raise ValueError(f"start must be >= 0, got {start.tolist()}")
    if (start + T > cache_rows).any():
        raise ValueError(
            f"start + T must be <= S_max = {cache_rows} (T = {T}), got start = {start.tolist()}")
    diag = np.diagonal(tree_mask, axis1=-2, axis2=-1)
    if not diag.all():
        bad = np.argwhere(~diag)[0].tolist()
        raise ValueError(f"tree_mask diagonal must be True (a token sees itself); False at [b, t] = {bad}")


def _check_shapes(q, cache, start, tree_mask, value_dim):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, c + r], got shape {q.shape}")
    B, T, H, D = q.shape
    if cache.ndim != 3 or cache.shape[0] != B or cache.shape[2] != D:
        raise ValueError(f"cache must be [B={B}, S_max, c + r = {D}], got shape {cache.shape}")
    if start.shape != (B,) or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"start must be an integer array of shape ({B},), got {start.dtype}{start.shape}")
    if tree_mask.shape != (B, T, T) or tree_mask.dtype != jnp.bool_:
        raise ValueError(f"tree_mask must be bool [{B}, {T}, {T}], got {tree_mask.dtype}{tree_mask.shape}")
    if not 0 < value_dim < D:
        raise ValueError(f"value_dim must be in (0, {D}) (the latent part of the {D}-wide rows), got {value_dim}")
    if q.dtype != cache.dtype or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q and cache must share a float dtype (bf16/f16/f32), got {q.dtype} and {cache.dtype}")
    if T > cache.shape[1]:
        raise ValueError(f"T = {T} tree tokens cannot fit in S_max = {cache.shape[1]} cache rows")


def tree_mla_attention(q, cache, start, tree_mask, *, scale: float, value_dim: int,
                       impl: str = "auto", interpret: bool = False):
    """Tree-masked absorbed MLA attention.

    q [B, T, H, c+r] (latent part then RoPE part per head); cache [B, S_max, c+r] (this layer's
    latent cache, rows [start, start + T) already hold the new tokens); start [B] int32;
    tree_mask [B, T, T] bool (diagonal True). Returns [B, T, H, c] in q.dtype: softmax over the
    visible rows of (q . row) * scale, times row[:value_dim]; softmax statistics in float32.

    impl: "auto" | "mosaic_gpu" | "xla", chosen by pallas_kernels.dispatch.choose_attention (auto: on a GPU the
          implementation measured fastest at this call shape that can run here (tuned.measured_fastest: the
          Mosaic GPU kernel on a Hopper GPU in bf16, else `tree_mla_attention_xla`); with interpret=True on a
          CPU the Mosaic kernel in its interpret mode where its dtype and widths allow, else XLA); an explicit
          kernel that cannot run here raises KernelUnavailableError. The kernel's split count and schedule:
          tuned.mosaic_config.
    Value checks (start + T <= S_max, ...) run when the inputs are concrete; under jit they cannot,
    so call `check_tree_attention_values` on concrete values before tracing if in doubt (the kernel
    itself never reads past the cache).
    """
    q, cache, start, tree_mask = map(jnp.asarray, (q, cache, start, tree_mask))
    _check_shapes(q, cache, start, tree_mask, value_dim)
    if not any(isinstance(x, Tracer) for x in (start, tree_mask)):
        check_tree_attention_values(start, tree_mask, cache_rows=cache.shape[1])
    B, T, H, D = q.shape
    c, r = value_dim, D - value_dim
    choice = dispatch.choose_attention(latent_dim=c, rope_dim=r, impl=impl, interpret=interpret, num_heads=H,
                                       dtype=q.dtype, num_tree=T, cache_rows=cache.shape[1])
    if choice.impl == "xla":
        return tree_mla_attention_xla(q, cache, start, tree_mask, scale=scale, value_dim=value_dim)
    return tree_attention_mosaic(q, cache, start, tree_mask, scale=scale, value_dim=value_dim,
                                 config=mosaic_config(batch=B, num_tree=T, cache_rows=cache.shape[1]),
                                 interpret=gpu_interpret_params() if interpret else None)
