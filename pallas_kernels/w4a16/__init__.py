"""W4A16 GEMM: y[M, N] = x[M, K] @ dequant(W)^T with an INT4 group-32 weight.

`w4a16_matmul` is the public entry: it checks shapes/dtypes and asks `pallas_kernels.dispatch.choose_linear`
which implementation runs; the kernel follows from the weight's layout:
  MosaicInt4Weight (int4 [N, K], bf16 scales [K/32, N]) -> "mosaic_gpu" (`mosaic_gpu.py`: a Hopper GPU, bf16
      activations, N and K multiples of 64, M <= dispatch.LINEAR_MAX_ROWS rows a call), converted once at load
      time (kdtree_jax.prepare_params);
  Int4Weight (the checkpoint layout), impl="xla", or a call the kernel cannot take under impl="auto"
      -> "xla" (`reference.w4a16_matmul_xla`: dequantize, then XLA's dot).
Tiling and split-K: `tuned.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.int4 import GROUP_SIZE, Int4Weight, MosaicInt4Weight
from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig, gpu_interpret_params, w4a16_matmul_mgpu_kernel
from pallas_kernels.w4a16.reference import w4a16_matmul_reference, w4a16_matmul_xla
from pallas_kernels.w4a16.tuned import dense_config

__all__ = ["MgpuConfig", "dense_config", "w4a16_matmul", "w4a16_matmul_reference", "w4a16_matmul_xla"]

_ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _check(x: jax.Array, w) -> tuple[int, int, int]:
    if not isinstance(w, Int4Weight | MosaicInt4Weight):
        raise ValueError(f"w must be an Int4Weight or MosaicInt4Weight (pallas_kernels.int4), got {type(w).__name__}")
    n, k = w.check()
    if w.lead_shape:
        raise ValueError(f"w must be one unstacked weight ([N, K] = [{n}, {k}]), got leading dims {w.lead_shape}")
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


def w4a16_matmul(x: jax.Array, w: Int4Weight | MosaicInt4Weight, *, impl: str = "auto", interpret=False,
                 config: MgpuConfig | None = None, split_k: int | None = None,
                 whole_tiles: int | None = None) -> jax.Array:
    """x [M, K] bf16|f32 @ dequant(W)^T -> [M, N] in x.dtype (float32 accumulation).

    impl: "auto" | "mosaic_gpu" | "xla" (pallas_kernels.dispatch.choose_linear; an explicit kernel that cannot run
    here raises KernelUnavailableError, never a fallback). interpret: run the Mosaic kernel in Mosaic GPU interpret
    mode (True or an InterpretGPUParams; tests: the default tiling then stages the dequantized tile in SMEM, the
    only form the interpreter simulates). config / split_k / whole_tiles: the Mosaic tiling and work split
    (`mosaic_gpu.w4a16_matmul_mgpu_kernel`; default: tuned.dense_config; split_k given alone means whole_tiles 0)."""
    m, k, n = _check(x, w)
    choice = dispatch.choose_linear(w, impl=impl, interpret=bool(interpret), rows=m, act_dtype=x.dtype)
    if choice.impl == "xla":
        return w4a16_matmul_xla(x, w)
    assert isinstance(w, MosaicInt4Weight)  # choose_linear runs the kernel on the Mosaic layout only
    tuned_config, tuned_split, tuned_whole = dense_config(k, n, dispatch.sm_count())
    if config is None:
        config = tuned_config if not interpret else MgpuConfig(block_n=tuned_config.block_n,
                                                               block_k=tuned_config.block_k, a_operand="smem")
    interp = gpu_interpret_params() if interpret is True else (interpret or None)
    if split_k is None:
        split_k = tuned_split
        whole_tiles = tuned_whole if whole_tiles is None else whole_tiles
    y_t = w4a16_matmul_mgpu_kernel(x, w.w_i4, w.scale_t, config=config, split_k=split_k,
                                   whole_tiles=whole_tiles or 0, interpret=interp)  # [N, Mp] f32
    return y_t[:, :m].T.astype(x.dtype)  # [M, N]
