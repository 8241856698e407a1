"""The W4A16 GEMM's plain-jnp forms: the float32 reference (the test oracle, and the op's "xla" implementation for
float32 activations) and the bfloat16 XLA form (the "xla" implementation for bfloat16 activations)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int4 import GROUP_SIZE, Int4Weight, MosaicInt4Weight


def dequantize_words(qweight: jax.Array, scale: jax.Array) -> jax.Array:
    """qweight int16 [..., N, K/4] (nibble q + 8), scale [..., N, K/32] -> float32 W [..., N, K]."""
    *lead, n, nwords = qweight.shape
    k = nwords * 4
    shifts = jnp.arange(4, dtype=jnp.int32) * 4
    nib = (qweight.astype(jnp.int32)[..., None] >> shifts) & 0xF  # [..., N, K/4, 4]
    q = (nib - 8).astype(jnp.float32).reshape(*lead, n, k // GROUP_SIZE, GROUP_SIZE)
    return (q * scale.astype(jnp.float32)[..., None]).reshape(*lead, n, k)


def dequantize_any(w: Int4Weight | MosaicInt4Weight) -> jax.Array:
    """float32 W [..., N, K] of an INT4 weight in either layout (stacked or not)."""
    return dequantize_words(w.qweight, w.scale) if isinstance(w, Int4Weight) else w.dequantize(jnp.float32)


def w4a16_matmul_reference(x: jax.Array, w: Int4Weight | MosaicInt4Weight) -> jax.Array:
    """x [M, K] @ dequant(W)^T -> [M, N] in x.dtype: W dequantized to float32, dot in float32 at HIGHEST
    precision (XLA does not fuse the dequantization into the GEMM: correct, not fast)."""
    y = lax.dot_general(x.astype(jnp.float32), dequantize_any(w), (((1,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def w4a16_matmul_xla(x: jax.Array, w: Int4Weight | MosaicInt4Weight) -> jax.Array:
    """The op's "xla" implementation: float32 x runs the reference; bfloat16 x multiplies W dequantized to
    bfloat16 (each q * scale rounded to bf16, as the Mosaic kernel rounds it) on the tensor cores, accumulating in
    float32, rounded to bf16."""
    if x.dtype != jnp.bfloat16:
        return w4a16_matmul_reference(x, w)
    dense = dequantize_any(w).astype(jnp.bfloat16)  # [N, K]
    y = lax.dot_general(x, dense, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)
