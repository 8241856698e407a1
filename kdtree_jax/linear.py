"""y = x @ W for a dense [in, out] weight or an INT4 (W4A16 group-32) `Int4Weight`."""

from __future__ import annotations

import jax

from pallas_kernels.int4 import Int4Weight

__all__ = ["int4_linear", "linear"]


def int4_linear(x: jax.Array, w: Int4Weight, *, impl: str = "auto") -> jax.Array:
    """x [..., K] @ dequant(W)^T -> [..., N] in x.dtype, via `pallas_kernels.w4a16.w4a16_matmul`.

    `impl` is passed through: "auto" runs the Pallas kernel on a GPU and, on CPU, the XLA
    dequantize-then-dot path with a one-time W4A16FallbackWarning; "xla" / "pallas" force a path.
    Stacked (expert) weights are not accepted here: index the expert first.
    """
    from pallas_kernels.w4a16 import w4a16_matmul  # noqa: PLC0415 (keeps kdtree_jax importable alone)

    n, k = w.check()
    if w.lead_shape:
        raise ValueError(f"int4_linear wants an unstacked weight ([N, K] = [{n}, {k}]), got leading dims "
                         f"{w.lead_shape}")
    if x.shape[-1] != k:
        raise ValueError(f"x last dim {x.shape[-1]} != weight input dim K={k}")
    lead = x.shape[:-1]
    y = w4a16_matmul(x.reshape(-1, k), w, impl=impl)  # [M, N]
    return y.reshape(*lead, n)


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., K] -> [..., N]. Dense weights are [K, N]; an Int4Weight goes to the W4A16 kernel path."""
    if isinstance(w, Int4Weight):
        return int4_linear(x, w)
    return x @ w.astype(x.dtype)
