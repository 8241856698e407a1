"""INT4 W4A16 group-32 weights: the file format (compressed-tensors `pack-quantized`), the params leaf
the model carries (the W4A16 linear itself: kdtree_jax.linear).

File layout (what safetensors holds, what `reference/int4.py` defines):
  packed int32 [..., N, K/8]: word j of a row holds input columns 8j..8j+7, column 8j+i in bits
  4i..4i+3 as the unsigned nibble q + 8 (q in [-8, 7]); scale [..., N, K/32] (bf16 or float32);
  W[n, k] = q[n, k] * scale[n, k // 32].

INT4 params leaf (a plain dict of arrays, so it lives in the params pytree, goes through `jit` and is
saved by Orbax):
  {"qweight": int16 [..., N, K/4], "scale": bf16|float32 [..., N, K/32]}
  qweight is the file's int32 words reinterpreted as little-endian int16 halves, so int16 word w holds
  columns 4w..4w+3 (nibble i = column 4w+i, still stored as q + 8).  The kernel wants 16-bit words:
  (word >> 4i) & 0xF | 0x4300 is the bf16 number 128 + q + 8, so one bf16 subtraction yields q
  exactly without an int->float conversion.  Conversion both ways is a bit-exact reinterpretation.
  Stacked expert weights carry a leading E axis on both arrays ([E, N, K/4], [E, N, K/32]).

N is the output dim and K the input dim ([out, in], the PyTorch/file order); dense params store
[in, out], so `int4_leaf_from_dense` transposes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

GROUP_SIZE = 32
PACK_FACTOR = 8  # 4-bit values per int32 word of the file layout
QMIN, QMAX = -8, 7
LEAF_KEYS = ("qweight", "scale")
SCALE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _check_k(k: int) -> None:
    if k % GROUP_SIZE != 0:
        raise ValueError(f"input dim K={k} must be divisible by the group size {GROUP_SIZE}")


# --------------------------------------------------------------------------- format functions


def quantize_int4(w: jax.Array, scale_dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """Symmetric group-32 quantization of W [..., N, K] -> (q int8 [..., N, K], scale [..., N, K/32]).

    q is computed against the stored (possibly bf16-rounded) scale, so dequantization error stays
    within half a step of that scale. An all-zero group gets scale 1.
    """
    if jnp.dtype(scale_dtype) not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be bfloat16 or float32, got {scale_dtype}")
    _check_k(w.shape[-1])
    groups = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    scale = jnp.max(jnp.abs(groups), axis=-1) / QMAX  # [..., N, G]
    scale = jnp.where(scale == 0.0, 1.0, scale).astype(scale_dtype)
    q = jnp.clip(jnp.round(groups / scale.astype(jnp.float32)[..., None]), QMIN, QMAX)
    return q.astype(jnp.int8).reshape(w.shape), scale


def dequantize_int4(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """q [..., N, K] int, scale [..., N, K/32] -> W [..., N, K] in `dtype` (product taken in float32)."""
    _check_k(q.shape[-1])
    if scale.shape != (*q.shape[:-1], q.shape[-1] // GROUP_SIZE):
        raise ValueError(f"scale shape {scale.shape} does not match q shape {q.shape} (want [..., N, K/32])")
    groups = q.astype(jnp.float32).reshape(*scale.shape, GROUP_SIZE)
    return (groups * scale.astype(jnp.float32)[..., None]).reshape(q.shape).astype(dtype)


def pack_int4(q: jax.Array) -> jax.Array:
    """q [..., N, K] in [-8, 7] -> packed int32 [..., N, K/8] (file layout; values are not range-checked)."""
    if q.shape[-1] % PACK_FACTOR != 0:
        raise ValueError(f"K={q.shape[-1]} must be divisible by {PACK_FACTOR}")
    nibbles = (q.astype(jnp.int32) + 8).astype(jnp.uint32)
    nibbles = nibbles.reshape(*q.shape[:-1], q.shape[-1] // PACK_FACTOR, PACK_FACTOR)  # [..., N, K/8, 8]
    shifts = jnp.arange(PACK_FACTOR, dtype=jnp.uint32) * 4
    # Nibbles occupy disjoint bits, so a sum is an OR.
    words = jnp.sum(nibbles << shifts, axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """packed int32 [..., N, K/8] (file layout) -> q int8 [..., N, K]."""
    if packed.dtype != jnp.int32:
        raise ValueError(f"packed must be int32, got {packed.dtype}")
    words = lax.bitcast_convert_type(packed, jnp.uint32)[..., None]  # [..., N, K/8, 1]
    shifts = jnp.arange(PACK_FACTOR, dtype=jnp.uint32) * 4
    q = ((words >> shifts) & 0xF).astype(jnp.int8) - 8  # [..., N, K/8, 8]
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * PACK_FACTOR)


# --------------------------------------------------------------------------- the params leaf


def is_int4_leaf(x: Any) -> bool:
    """True for an INT4 params leaf (a dict with exactly the keys qweight and scale)."""
    return isinstance(x, dict) and set(x.keys()) == set(LEAF_KEYS)


MOSAIC_LEAF_KEYS = ("scale_t", "w_i4")


def is_mosaic_leaf(x: Any) -> bool:
    """True for an INT4 leaf in the Mosaic GPU kernel layout (`kdtree_jax.quantize.to_mosaic_experts`):
    {"w_i4": jnp.int4 [..., N, K] (q itself), "scale_t": bf16 [..., K/32, N]}. A device-side layout
    made at load time for the routed experts; checkpoints always hold the canonical leaf above."""
    return isinstance(x, dict) and set(x.keys()) == set(MOSAIC_LEAF_KEYS)


def is_any_int4_leaf(x: Any) -> bool:
    """An INT4 leaf in either layout (the canonical one or the Mosaic GPU one)."""
    return is_int4_leaf(x) or is_mosaic_leaf(x)


def check_int4_leaf(leaf: Any) -> tuple[int, int]:
    """Validate an INT4 leaf and return (N, K). Raises ValueError naming the bad field."""
    if not is_int4_leaf(leaf):
        keys = sorted(leaf.keys()) if isinstance(leaf, dict) else type(leaf).__name__
        raise ValueError(f"not an INT4 leaf: want a dict with keys {LEAF_KEYS}, got {keys}")
    qweight, scale = leaf["qweight"], leaf["scale"]
    if qweight.dtype != jnp.int16:
        raise ValueError(f"INT4 leaf qweight must be int16 [..., N, K/4], got {qweight.dtype}")
    if jnp.dtype(scale.dtype) not in SCALE_DTYPES:
        raise ValueError(f"INT4 leaf scale must be bfloat16 or float32, got {scale.dtype}")
    n, k = qweight.shape[-2], qweight.shape[-1] * 4
    if scale.shape != (*qweight.shape[:-1], k // GROUP_SIZE):
        raise ValueError(
            f"INT4 leaf scale shape {scale.shape} does not match qweight {qweight.shape}: "
            f"want {(*qweight.shape[:-1], k // GROUP_SIZE)}"
        )
    return n, k


def int4_leaf_from_compressed(packed: jax.Array, scale: jax.Array) -> dict[str, jax.Array]:
    """File layout (packed int32 [..., N, K/8], scale [..., N, K/32]) -> INT4 leaf. Bit-exact."""
    if packed.dtype != jnp.int32:
        raise ValueError(f"packed must be int32 [..., N, K/8], got {packed.dtype}")
    k = packed.shape[-1] * PACK_FACTOR
    if scale.shape != (*packed.shape[:-1], k // GROUP_SIZE):
        raise ValueError(
            f"scale shape {scale.shape} does not match packed {packed.shape}: "
            f"want {(*packed.shape[:-1], k // GROUP_SIZE)}"
        )
    if jnp.dtype(scale.dtype) not in SCALE_DTYPES:
        raise ValueError(f"scale must be bfloat16 or float32, got {scale.dtype}")
    # int32 -> [..., K/8, 2] int16, element 0 = low half (little-endian on CPU and GPU), so the
    # nibble order of the file survives: int16 word 2j+h holds columns 8j+4h .. 8j+4h+3.
    halves = lax.bitcast_convert_type(packed, jnp.int16)
    qweight = halves.reshape(*packed.shape[:-1], k // 4)
    return {"qweight": qweight, "scale": scale}


def int4_leaf_to_compressed(leaf: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """INT4 leaf -> file layout (packed int32 [..., N, K/8], scale [..., N, K/32]). Bit-exact."""
    n, k = check_int4_leaf(leaf)
    qweight = leaf["qweight"]
    halves = qweight.reshape(*qweight.shape[:-1], k // PACK_FACTOR, 2)
    return lax.bitcast_convert_type(halves, jnp.int32), leaf["scale"]


def int4_leaf_from_dense(w: jax.Array, scale_dtype=jnp.bfloat16) -> dict[str, jax.Array]:
    """Quantize a params-convention weight [..., K, N] ([in, out], stacked experts [E, K, N]) to a leaf."""
    q, scale = quantize_int4(jnp.swapaxes(w, -1, -2), scale_dtype)  # [..., N, K]
    return int4_leaf_from_compressed(pack_int4(q), scale)


def int4_leaf_dequantize(leaf: dict[str, jax.Array], dtype=jnp.float32) -> jax.Array:
    """INT4 leaf -> dense W [..., N, K] ([out, in]) in `dtype`."""
    packed, scale = int4_leaf_to_compressed(leaf)
    return dequantize_int4(unpack_int4(packed), scale, dtype)
