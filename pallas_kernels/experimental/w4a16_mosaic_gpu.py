"""Prototype, not wired into any dispatcher: a dense W4A16 GEMM on the Mosaic GPU tile loop (Hopper),
y[M, N] = x[M, K] @ dequant(W)^T. It shares `pallas_kernels.w4a16.mosaic_gpu`'s inner loop with the routed
MoE kernel; measured against the Triton kernel in docs/w4a16_mgpu.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.int4 import GROUP_SIZE, Int4Weight, MosaicInt4Weight
from pallas_kernels.w4a16 import mosaic_gpu as mosaic
from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig, gpu_interpret_params

__all__ = ["MgpuConfig", "w4a16_matmul_mgpu", "w4a16_matmul_mgpu_kernel"]


def w4a16_matmul_mgpu_kernel(x: jax.Array, w_i4: jax.Array, scale_t: jax.Array, *,
                             config: MgpuConfig = MgpuConfig(), interpret=None) -> jax.Array:
    """x bf16 [Mp, K] (Mp % 8 == 0), w_i4 int4 [N, K], scale_t bf16 [K/32, N] -> y^T f32 [N, Mp]."""
    mp, k = x.shape
    n = w_i4.shape[0]
    mosaic.check_config(config, n, k, mp, interpret)
    block_n = config.block_n
    tile_matmul = mosaic.make_tile_matmul(config, k, mp)

    def kernel(x_gmem, w_gmem, s_gmem, o_gmem, o_smem, a_smem=None):
        n_slice = pl.ds(lax.axis_index("n") * block_n, block_n)
        o_smem[...] = tile_matmul(w_gmem.at[n_slice], x_gmem, s_gmem.at[:, n_slice], a_smem)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[n_slice])
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n, mp), jnp.float32),
        grid=(n // block_n,),
        grid_names=("n",),
        scratch_types=mosaic.scratch_types(config, mp),
        interpret=interpret,
    )
    return f(x, w_i4, scale_t)


def w4a16_matmul_mgpu(x: jax.Array, w: Int4Weight | MosaicInt4Weight, *, interpret=False,
                      config: MgpuConfig | None = None) -> jax.Array:
    """x bf16 [M, K] @ dequant(W)^T -> bf16 [M, N] (f32 accumulation).

    w: a MosaicInt4Weight (int4 [N, K], bf16 scale_t [K/32, N]), or an Int4Weight converted inside this call
    (a prototype convenience: a wired kernel would take the Mosaic layout made once at load time).
    interpret: False, True or an InterpretGPUParams: run in Mosaic GPU interpret mode (CPU simulation of
      threads, SMEM, TMA and barriers). The default config then stages the dequantized tile in SMEM
      (a_operand="smem") because jax 0.11's interpreter cannot take wgmma's A operand from registers."""
    if isinstance(w, Int4Weight):
        w.check()
        w = w.to_mosaic()
    if not isinstance(w, MosaicInt4Weight):
        raise ValueError(f"w must be an Int4Weight or MosaicInt4Weight, got {type(w).__name__}")
    n, k = w.check()
    if w.w_i4.ndim != 2:
        raise ValueError(f"w must be one unstacked weight (w_i4 [N, K]), got {tuple(w.w_i4.shape)}")
    if x.ndim != 2 or x.dtype != jnp.bfloat16 or x.shape[1] != k:
        raise ValueError(f"x must be bf16 [M, K={k}], got {x.dtype} {x.shape}")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} must be divisible by the group size {GROUP_SIZE}")
    m = x.shape[0]
    if not 1 <= m <= 256:
        raise ValueError(f"M={m} must be in [1, 256] (tokens are the wgmma N dimension)")
    mp = -(-m // 8) * 8
    x_p = jnp.pad(x, ((0, mp - m), (0, 0)))  # [Mp, K]
    interp = gpu_interpret_params() if interpret is True else (interpret or None)
    if config is None:
        config = MgpuConfig(a_operand="smem" if interpret else "registers")
    y_t = w4a16_matmul_mgpu_kernel(x_p, w.w_i4, w.scale_t, config=config, interpret=interp)  # [N, Mp] f32
    return y_t[:, :m].T.astype(jnp.bfloat16)  # [M, N]
