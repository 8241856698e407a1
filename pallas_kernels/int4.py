"""INT4 W4A16 group-32 weights as typed pytrees: the file format, the two in-memory layouts, conversions.

File layout (compressed-tensors `pack-quantized`, what safetensors holds and `reference/int4.py` defines):
  packed int32 [..., N, K/8]: word j of a row holds input columns 8j..8j+7, column 8j+i in bits
  4i..4i+3 as the unsigned nibble q + 8 (q in [-8, 7]); scale [..., N, K/32] (bf16 or float32);
  W[n, k] = q[n, k] * scale[n, k // 32].

`Int4Weight` - the checkpoint layout, what every INT4 weight of a params tree is by default:
  qweight int16 [..., N, K/4]: the file's int32 words reinterpreted as little-endian int16 halves, so word w
  holds columns 4w..4w+3 (nibble i = column 4w+i, stored as q + 8). The Triton kernels want 16-bit words:
  (word >> 4i) & 0xF | 0x4300 is the bf16 number 128 + q + 8, so one bf16 subtraction yields q exactly.
  scale bf16|float32 [..., N, K/32]. Conversion from/to the file layout is a bit-exact reinterpretation.
`MosaicInt4Weight` - the Mosaic GPU kernels' layout (made once at load time, never saved):
  w_i4 jnp.int4 [..., N, K] (q itself) with the columns of every 32-column group in *lane order*
  (`to_lane_order`), scale_t bf16 [..., K/32, N].
  Lane order: stored column 8t + 4e + i of a group holds column 8i + 2t + e (t, i in 0..3, e in 0..1). The Mosaic
  kernel loads a group's row as 4 threads x 8 consecutive nibbles (one 32-bit register each); the WGMMA operand
  wants thread t to hold columns 2t and 2t + 1 of every 8-column tile i. Stored in lane order, thread t's word
  already holds exactly those, and the pair of tile i sits in nibbles i and 4 + i, so (word >> 4i) & 0x000F000F
  puts it in the low nibbles of the two bf16 halves: no shuffles between threads, no byte permutes.

N is the output dim and K the input dim ([out, in], the PyTorch/file order); dense params store [in, out],
so `Int4Weight.from_dense` transposes. Stacked expert weights carry a leading E axis on every array.

Both classes are registered dataclass pytrees: they go through `jit`, `tree.map` and shardings like arrays
do, and the kernel that runs for a weight follows from its type. Checkpoints store `Int4Weight` as the dict
{"qweight", "scale"} (`to_dict` / `from_dict` at the checkpoint boundary), the format of existing files.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

GROUP_SIZE = 32
PACK_FACTOR = 8  # 4-bit values per int32 word of the file layout
QMIN, QMAX = -8, 7
SCALE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

__all__ = [
    "GROUP_SIZE", "PACK_FACTOR", "QMAX", "QMIN", "SCALE_DTYPES", "Int4Weight", "MosaicInt4Weight",
    "dequantize_int4", "from_lane_order", "is_quantized", "pack_int4", "quantize_int4", "to_lane_order",
    "unpack_int4",
]


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
        raise ValueError(f"scale_dtype must be bfloat16 or float32, got {jnp.dtype(scale_dtype).name}")
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


# --------------------------------------------------------------------------- the typed weights
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """An INT4 weight in the checkpoint layout: qweight int16 [..., N, K/4], scale bf16|f32 [..., N, K/32]."""

    # jax.Array in params; abstract trees hold a jax.ShapeDtypeStruct per field and sharding specs a
    # PartitionSpec (the same type is the pytree prefix for all three), hence Any
    qweight: Any  # int16 [..., N, K/4]
    scale: Any  # bf16|f32 [..., N, K/32]

    LAYOUT = "checkpoint"

    # shape queries work on arrays, ShapeDtypeStructs and tracers alike
    @property
    def out_features(self) -> int:  # N
        return self.qweight.shape[-2]

    @property
    def in_features(self) -> int:  # K
        return self.qweight.shape[-1] * 4

    @property
    def lead_shape(self) -> tuple[int, ...]:  # e.g. (E,) for stacked experts
        return tuple(self.qweight.shape[:-2])

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """The shape of the dense weight in the params convention: [..., K, N] ([in, out])."""
        return (*self.lead_shape, self.in_features, self.out_features)

    def check(self) -> tuple[int, int]:
        """Validate dtypes and shapes; return (N, K). Raises ValueError naming the bad field."""
        if jnp.dtype(self.qweight.dtype) != jnp.dtype(jnp.int16):
            raise ValueError(f"Int4Weight.qweight must be int16 [..., N, K/4], got {self.qweight.dtype}")
        if jnp.dtype(self.scale.dtype) not in SCALE_DTYPES:
            raise ValueError(f"Int4Weight.scale must be bfloat16 or float32, got {self.scale.dtype}")
        n, k = self.out_features, self.in_features
        want = (*self.lead_shape, n, k // GROUP_SIZE)
        if tuple(self.scale.shape) != want:
            raise ValueError(f"Int4Weight.scale shape {tuple(self.scale.shape)} does not match qweight "
                             f"{tuple(self.qweight.shape)}: want {want}")
        return n, k

    # ---- conversions
    @classmethod
    def from_compressed(cls, packed: jax.Array, scale: jax.Array) -> Int4Weight:
        """File layout (packed int32 [..., N, K/8], scale [..., N, K/32]) -> Int4Weight. Bit-exact."""
        if packed.dtype != jnp.int32:
            raise ValueError(f"packed must be int32 [..., N, K/8], got {packed.dtype}")
        k = packed.shape[-1] * PACK_FACTOR
        if scale.shape != (*packed.shape[:-1], k // GROUP_SIZE):
            raise ValueError(f"scale shape {scale.shape} does not match packed {packed.shape}: "
                             f"want {(*packed.shape[:-1], k // GROUP_SIZE)}")
        if jnp.dtype(scale.dtype) not in SCALE_DTYPES:
            raise ValueError(f"scale must be bfloat16 or float32, got {scale.dtype}")
        # int32 -> [..., K/8, 2] int16, element 0 = low half (little-endian on CPU and GPU), so the
        # nibble order of the file survives: int16 word 2j+h holds columns 8j+4h .. 8j+4h+3.
        halves = lax.bitcast_convert_type(packed, jnp.int16)
        return cls(qweight=halves.reshape(*packed.shape[:-1], k // 4), scale=scale)

    def to_compressed(self) -> tuple[jax.Array, jax.Array]:
        """-> file layout (packed int32 [..., N, K/8], scale [..., N, K/32]). Bit-exact."""
        _, k = self.check()
        halves = self.qweight.reshape(*self.qweight.shape[:-1], k // PACK_FACTOR, 2)
        return lax.bitcast_convert_type(halves, jnp.int32), self.scale

    @classmethod
    def from_dense(cls, w: jax.Array, scale_dtype=jnp.bfloat16) -> Int4Weight:
        """Quantize a params-convention weight [..., K, N] ([in, out]; stacked experts [E, K, N])."""
        q, scale = quantize_int4(jnp.swapaxes(w, -1, -2), scale_dtype)  # [..., N, K]
        return cls.from_compressed(pack_int4(q), scale)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """-> dense W [..., N, K] ([out, in]) in `dtype`."""
        packed, scale = self.to_compressed()
        return dequantize_int4(unpack_int4(packed), scale, dtype)

    def to_mosaic(self) -> MosaicInt4Weight:
        """-> the Mosaic GPU layout: int4 [..., N, K] in lane order and bf16 scales [..., K/32, N] (same bytes)."""
        q = unpack_int4(self.to_compressed()[0])  # int8 [..., N, K]
        return MosaicInt4Weight(w_i4=to_lane_order(q).astype(jnp.int4),
                                scale_t=jnp.swapaxes(self.scale.astype(jnp.bfloat16), -1, -2))

    # ---- the checkpoint boundary (Orbax files keep the dict format)
    def to_dict(self) -> dict[str, Any]:
        return {"qweight": self.qweight, "scale": self.scale}

    @classmethod
    def from_dict(cls, d: Any) -> Int4Weight:
        if not cls.is_dict(d):
            keys = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"not a stored INT4 weight: want a dict with keys ['qweight', 'scale'], got {keys}")
        return cls(qweight=d["qweight"], scale=d["scale"])

    @staticmethod
    def is_dict(d: Any) -> bool:
        """True for the stored (checkpoint file) form {"qweight", "scale"}."""
        return isinstance(d, dict) and set(d) == {"qweight", "scale"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MosaicInt4Weight:
    """An INT4 weight in the Mosaic GPU kernels' layout: w_i4 int4 [..., N, K], scale_t bf16 [..., K/32, N].
    Made at load time from an Int4Weight (`Int4Weight.to_mosaic`); checkpoints never hold it."""

    # jax.Array in params, jax.ShapeDtypeStruct / PartitionSpec in abstract trees / sharding specs (as above)
    w_i4: Any  # int4 [..., N, K]
    scale_t: Any  # bf16 [..., K/32, N]

    LAYOUT = "mosaic_gpu"

    @property
    def out_features(self) -> int:  # N
        return self.w_i4.shape[-2]

    @property
    def in_features(self) -> int:  # K
        return self.w_i4.shape[-1]

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return tuple(self.w_i4.shape[:-2])

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return (*self.lead_shape, self.in_features, self.out_features)

    def check(self) -> tuple[int, int]:
        if jnp.dtype(self.w_i4.dtype) != jnp.dtype(jnp.int4):
            raise ValueError(f"MosaicInt4Weight.w_i4 must be int4 [..., N, K], got {self.w_i4.dtype}")
        if jnp.dtype(self.scale_t.dtype) != jnp.dtype(jnp.bfloat16):
            raise ValueError(f"MosaicInt4Weight.scale_t must be bfloat16, got {self.scale_t.dtype}")
        n, k = self.out_features, self.in_features
        want = (*self.lead_shape, k // GROUP_SIZE, n)
        if tuple(self.scale_t.shape) != want:
            raise ValueError(f"MosaicInt4Weight.scale_t shape {tuple(self.scale_t.shape)} != {want}")
        return n, k

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """-> dense W [..., N, K] ([out, in]) in `dtype`."""
        scale = jnp.swapaxes(self.scale_t, -1, -2)  # [..., N, K/32]
        return dequantize_int4(self.q(), scale, dtype)

    def q(self) -> jax.Array:
        """int8 [..., N, K]: the quantized values in column order (the stored int4 is in lane order)."""
        return from_lane_order(self.w_i4.astype(jnp.int8))

    def to_checkpoint_layout(self) -> Int4Weight:
        """Back to the checkpoint layout (bf16 scales; bit-exact for weights that came from bf16 scales)."""
        return Int4Weight.from_compressed(pack_int4(self.q()), jnp.swapaxes(self.scale_t, -1, -2))


def to_lane_order(q: jax.Array) -> jax.Array:
    """[..., K] in column order -> lane order (module docstring): within each 32-column group, column
    8i + 2t + e (tile i, thread t, element e) moves to 8t + 4e + i."""
    *lead, k = q.shape
    g = q.reshape(*lead, k // GROUP_SIZE, 4, 4, 2)  # [..., group, i, t, e]
    return jnp.moveaxis(g, -3, -1).reshape(*lead, k)  # [..., group, t, e, i]


def from_lane_order(q: jax.Array) -> jax.Array:
    """The inverse of `to_lane_order`."""
    *lead, k = q.shape
    g = q.reshape(*lead, k // GROUP_SIZE, 4, 2, 4)  # [..., group, t, e, i]
    return jnp.moveaxis(g, -1, -3).reshape(*lead, k)  # [..., group, i, t, e]


def is_quantized(x: Any) -> bool:
    """True for an INT4 weight in either layout."""
    return isinstance(x, (Int4Weight, MosaicInt4Weight))
