"""Mosaic GPU W4A16 kernels (Hopper): the grouped INT4 MoE (`moe.py`, the model's on Hopper + bf16) and a
dense GEMM prototype (`w4a16_matmul_mgpu`, not wired into any dispatcher); see docs/w4a16_mgpu.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.w4a16_mgpu.kernel import GROUP_SIZE, MgpuConfig, to_mgpu_layout, w4a16_matmul_mgpu_kernel

__all__ = ["MgpuConfig", "gpu_interpret_params", "to_mgpu_layout", "w4a16_matmul_mgpu"]


def gpu_interpret_params(**kwargs):
    """InterpretGPUParams(**kwargs), e.g. detect_races=True (private import path in jax 0.11; public as
    plgpu.InterpretGPUParams from 0.12)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(**kwargs)


def w4a16_matmul_mgpu(x: jax.Array, leaf: dict, *, interpret=False,
                      config: MgpuConfig | None = None) -> jax.Array:
    """x bf16 [M, K] @ dequant(W)^T -> bf16 [M, N] (f32 accumulation).

    leaf: INT4 leaf {"qweight": int16 [N, K/4], "scale": bf16|f32 [N, K/32]}; converted to the kernel layout
    (int4 [N, K], bf16 scale [K/32, N]) inside this call for now.
    interpret: False, True or an InterpretGPUParams: run in Mosaic GPU interpret mode (CPU simulation of threads, SMEM, TMA and barriers).
      The default config then stages the dequantized tile in SMEM (a_operand="smem") because jax 0.11's
      interpreter cannot take wgmma's A operand from registers; natively the default is register-A.
    """
    if not isinstance(leaf, dict) or set(leaf) != {"qweight", "scale"}:
        raise ValueError(f"leaf must be a dict with keys qweight, scale; got {leaf!r:.80}")
    qweight, scale = leaf["qweight"], leaf["scale"]
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [M, K], got {x.dtype} {x.shape}")
    m, k = x.shape
    if qweight.dtype != jnp.int16 or qweight.ndim != 2 or qweight.shape[1] * 4 != k:
        raise ValueError(f"qweight must be int16 [N, K/4] with K={k}, got {qweight.dtype} {qweight.shape}")
    n = qweight.shape[0]
    if scale.shape != (n, k // GROUP_SIZE) or k % GROUP_SIZE:
        raise ValueError(f"scale shape {scale.shape} != (N, K/32) = {(n, k // GROUP_SIZE)} (K={k})")
    if not 1 <= m <= 256:
        raise ValueError(f"M={m} must be in [1, 256] (tokens are the wgmma N dimension)")
    mp = -(-m // 8) * 8
    x_p = jnp.pad(x, ((0, mp - m), (0, 0)))  # [Mp, K]
    w_i4, scale_t = to_mgpu_layout(qweight, scale)
    interp = gpu_interpret_params() if interpret is True else (interpret or None)
    if config is None:
        config = MgpuConfig(a_operand="smem" if interpret else "registers")
    y_t = w4a16_matmul_mgpu_kernel(x_p, w_i4, scale_t, config=config,
                                   interpret=interp)  # [N, Mp] f32
    return y_t[:, :m].T.astype(jnp.bfloat16)  # [M, N]
