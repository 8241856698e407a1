"""y = x @ W for a dense [in, out] weight or an INT4 (W4A16 group-32) weight, in either layout."""

from __future__ import annotations

import jax

from pallas_kernels import dots
from pallas_kernels.dispatch import Kernels
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from pallas_kernels.w4a16 import w4a16_matmul

__all__ = ["linear"]

DEFAULT_KERNELS = Kernels()


def linear(x: jax.Array, w, kernels: Kernels = DEFAULT_KERNELS) -> jax.Array:
    """x [..., K] -> [..., N]. Dense weights are [K, N]; an INT4 weight (Int4Weight [N, K/4] words, or the Mosaic
    layout prepare_params gives it on a Hopper GPU) runs the W4A16 GEMM chosen by `kernels.linear`
    (pallas_kernels.dispatch.choose_linear)."""
    if not isinstance(w, Int4Weight | MosaicInt4Weight):
        return dots.matmul(x, w.astype(x.dtype))
    n, k = w.check()
    if w.lead_shape:
        raise ValueError(f"linear wants an unstacked INT4 weight ([N, K] = [{n}, {k}]), got leading dims "
                         f"{w.lead_shape}")
    if x.shape[-1] != k:
        raise ValueError(f"x last dim {x.shape[-1]} != weight input dim K={k}")
    lead = x.shape[:-1]
    y = w4a16_matmul(x.reshape(-1, k), w, impl=kernels.linear, interpret=kernels.interpret)  # [M, N]
    return y.reshape(*lead, n)
