"""W4A16 GEMM: y[M, N] = x[M, K] @ dequant(W)^T with INT4 group-32 weights (pallas_kernels.int4.Int4Weight).

`w4a16_matmul` is the public entry: it checks shapes/dtypes and picks the implementation.
  impl="pallas": the Pallas kernel (natively on a GPU; `interpret=True` runs it on CPU).
  impl="xla":    XLA dequantize-then-dot (w4a16_matmul_reference): correct everywhere, not fast.
  impl="auto":   "pallas" on a GPU; on CPU "xla" with a one-time W4A16FallbackWarning.
`resolve_impl(impl)` returns the name that will run, so callers and benchmarks can record it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.int4 import Int4Weight

from pallas_kernels.w4a16.kernel import (
    GROUP_SIZE,
    BlockConfig,
    w4a16_matmul_pallas,
    w4a16_matmul_reference,
    w4a16_matmul_xla_bf16,
)
from pallas_kernels.w4a16.tuning import get_config, heuristic_config

__all__ = [
    "BlockConfig", "W4A16FallbackWarning", "get_config", "heuristic_config", "resolve_impl",
    "w4a16_matmul", "w4a16_matmul_reference", "w4a16_matmul_xla_bf16",
]

_ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_SCALE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


class W4A16FallbackWarning(UserWarning):
    """impl="auto" ran the XLA dequantize-then-dot path because no GPU is present."""


def resolve_impl(impl: str = "auto", *, interpret: bool = False) -> str:
    """The implementation `w4a16_matmul` will run: "pallas" or "xla" (auto on CPU warns)."""
    return dispatch.resolve_impl(impl, interpret=interpret, op="w4a16_matmul", fallback="the XLA dequantize-then-dot path",
                                 kernel="the Pallas W4A16 kernel", warning=W4A16FallbackWarning)


def _split_weights(leaf_or_arrays):
    if isinstance(leaf_or_arrays, Int4Weight):
        return leaf_or_arrays.qweight, leaf_or_arrays.scale
    if isinstance(leaf_or_arrays, dict):
        if set(leaf_or_arrays) != {"qweight", "scale"}:
            raise ValueError(f"INT4 leaf must have keys qweight, scale; got {sorted(leaf_or_arrays)}")
        return leaf_or_arrays["qweight"], leaf_or_arrays["scale"]
    if isinstance(leaf_or_arrays, (tuple, list)) and len(leaf_or_arrays) == 2:
        return tuple(leaf_or_arrays)
    raise ValueError(f"want an INT4 leaf dict or (qweight, scale), got {type(leaf_or_arrays).__name__}")


def w4a16_matmul(x: jax.Array, leaf_or_arrays, *, impl: str = "auto", interpret: bool = False,
                 config: BlockConfig | None = None) -> jax.Array:
    """x [M, K] bf16|f32 @ dequant(W)^T -> [M, N] in x.dtype (float32 accumulation).

    leaf_or_arrays: an Int4Weight (qweight int16 [N, K/4], scale bf16|f32 [N, K/32]), its dict form or the pair.
    config: block sizes for impl="pallas" (default: tuned table, else heuristic).
    """
    qweight, scale = _split_weights(leaf_or_arrays)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in _ACT_DTYPES:
        raise ValueError(f"x dtype must be bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} must be divisible by the group size {GROUP_SIZE}")
    if qweight.dtype != jnp.int16 or qweight.ndim != 2:
        raise ValueError(f"qweight must be int16 [N, K/4], got {qweight.dtype} {qweight.shape}")
    n = qweight.shape[0]
    if qweight.shape[1] * 4 != k:
        raise ValueError(f"qweight {qweight.shape} holds K={qweight.shape[1] * 4} columns, x has K={k}")
    if jnp.dtype(scale.dtype) not in _SCALE_DTYPES:
        raise ValueError(f"scale dtype must be bfloat16 or float32, got {scale.dtype}")
    if scale.shape != (n, k // GROUP_SIZE):
        raise ValueError(f"scale shape {scale.shape} != (N, K/32) = {(n, k // GROUP_SIZE)}")
    if m == 0:
        raise ValueError("x has M=0 rows")
    chosen = resolve_impl(impl, interpret=interpret)
    if chosen == "xla":
        return w4a16_matmul_reference(x, qweight, scale)
    cfg = config or get_config(m, k, n)
    if n % cfg.block_n:
        raise ValueError(f"N={n} must be divisible by block_n={cfg.block_n}")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"K={k} must be divisible by block_k*split_k={cfg.block_k}*{cfg.split_k}")
    return w4a16_matmul_pallas(x, qweight, scale, cfg=cfg, interpret=interpret)
