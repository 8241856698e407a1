"""W4A16 GEMM: y[M, N] = x[M, K] @ dequant(W)^T with an INT4 group-32 `Int4Weight`.

`w4a16_matmul` is the public entry: it checks shapes/dtypes and asks `pallas_kernels.dispatch.choose_linear`
which implementation runs: "triton" (the Pallas Triton kernel, `triton.py`; natively on a GPU, on CPU with
interpret=True) or "xla" (`reference.py`: dequantize then dot). Block sizes: `tuned.py`.
The Mosaic GPU tile loop in `mosaic_gpu.py` is shared by the routed MoE kernel and the dense prototype in
`pallas_kernels.experimental`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.int4 import GROUP_SIZE, Int4Weight
from pallas_kernels.w4a16.reference import w4a16_matmul_reference
from pallas_kernels.w4a16.triton import BlockConfig, w4a16_matmul_pallas
from pallas_kernels.w4a16.tuned import get_config, heuristic_config

__all__ = ["BlockConfig", "get_config", "heuristic_config", "w4a16_matmul", "w4a16_matmul_reference"]

_ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _check(x: jax.Array, w: Int4Weight) -> tuple[int, int, int]:
    if not isinstance(w, Int4Weight):
        raise ValueError(f"w must be an Int4Weight (pallas_kernels.int4), got {type(w).__name__}")
    n, k = w.check()
    if w.qweight.ndim != 2:
        raise ValueError(f"w must be one unstacked weight (qweight [N, K/4]), got qweight {tuple(w.qweight.shape)}")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in _ACT_DTYPES:
        raise ValueError(f"x dtype must be bfloat16 or float32, got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]} columns, the weight takes K={k}")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} must be divisible by the group size {GROUP_SIZE}")
    if x.shape[0] == 0:
        raise ValueError("x has M=0 rows")
    return x.shape[0], k, n


def w4a16_matmul(x: jax.Array, w: Int4Weight, *, impl: str = "auto", interpret: bool = False,
                 config: BlockConfig | None = None) -> jax.Array:
    """x [M, K] bf16|f32 @ dequant(W)^T -> [M, N] in x.dtype (float32 accumulation).

    w: Int4Weight, qweight int16 [N, K/4], scale bf16|f32 [N, K/32]. impl: "auto" | "triton" | "xla"
    (pallas_kernels.dispatch; a kernel that cannot run here raises KernelUnavailableError).
    config: block sizes for the Triton kernel (default: tuned table, else heuristic)."""
    m, k, n = _check(x, w)
    choice = dispatch.choose_linear(w, impl=impl, interpret=interpret)
    if choice.impl == "xla":
        return w4a16_matmul_reference(x, w)
    cfg = config or get_config(m, k, n)
    if n % cfg.block_n:
        raise ValueError(f"N={n} must be divisible by block_n={cfg.block_n}")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"K={k} must be divisible by block_k*split_k={cfg.block_k}*{cfg.split_k}")
    return w4a16_matmul_pallas(x, w.qweight, w.scale, cfg=cfg, interpret=interpret)
