"""y = x @ W for a dense [in, out] weight or an INT4 (W4A16 group-32) Int4Weight."""

from __future__ import annotations

import jax

from kdtree_jax.quant import is_int4_leaf
from pallas_kernels.dispatch import Kernels
from pallas_kernels.int4 import Int4Weight
from pallas_kernels.w4a16 import w4a16_matmul

__all__ = ["is_int4_leaf", "linear"]  # TODO(merge): is_int4_leaf re-exported for ddtree until the typed weights land

DEFAULT_KERNELS = Kernels()


def linear(x: jax.Array, w, kernels: Kernels = DEFAULT_KERNELS) -> jax.Array:
    """x [..., K] -> [..., N]. Dense weights are [K, N]; an Int4Weight ([N, K/4] words) runs the W4A16 GEMM
    chosen by `kernels.linear` (pallas_kernels.dispatch)."""
    if is_int4_leaf(w):  # TODO(merge): the stored dict form, until params hold Int4Weight
        w = Int4Weight.from_dict(w)
    if not isinstance(w, Int4Weight):
        return x @ w.astype(x.dtype)
    n, k = w.check()
    if w.qweight.ndim != 2:
        raise ValueError(f"linear wants an unstacked INT4 weight (qweight [N, K/4]), got {tuple(w.qweight.shape)}")
    if x.shape[-1] != k:
        raise ValueError(f"x last dim {x.shape[-1]} != weight input dim K={k}")
    lead = x.shape[:-1]
    y = w4a16_matmul(x.reshape(-1, k), w, impl=kernels.linear, interpret=kernels.interpret)  # [M, N]
    return y.reshape(*lead, n)
