"""INT4 W4A16 group-32 format in plain NumPy: the ground truth for `pallas_kernels.int4` and the kernel.

Written for clarity, not speed (loops over nibbles, float64 math).

Format (compressed-tensors `pack-quantized`, symmetric, group size 32):
  - a weight W [N, K] (PyTorch [out, in]) is cut into groups of 32 consecutive input columns;
  - scale[n, g] = max(|W[n, 32g:32g+32]|) / 7  (a zero group gets scale 1 so q = 0 decodes to 0);
  - q[n, k] = clip(round_half_even(W[n, k] / scale[n, k // 32]), -8, 7);
  - packed[n, j] (int32) holds columns 8j..8j+7: column 8j+i sits in bits 4i..4i+3 as the unsigned
    nibble q + 8.  Worked example: q = [-8, -7, -1, 0, 1, 2, 3, 7] -> 0xFBA98710.
  - dequant(W)[n, k] = q[n, k] * scale[n, k // 32].
"""

from __future__ import annotations

import numpy as np

GROUP_SIZE = 32
PACK_FACTOR = 8  # nibbles per int32 word
QMIN, QMAX = -8, 7


def _check_k(k: int) -> None:
    if k % GROUP_SIZE != 0:
        raise ValueError(f"input dim K={k} must be divisible by the group size {GROUP_SIZE}")


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [..., N, K] float -> (q int8 [..., N, K] in [-8, 7], scale float64 [..., N, K/32])."""
    w = np.asarray(w, dtype=np.float64)
    _check_k(w.shape[-1])
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP_SIZE, GROUP_SIZE)  # [..., N, G, 32]
    scale = np.abs(groups).max(axis=-1) / QMAX  # [..., N, G]
    scale = np.where(scale == 0.0, 1.0, scale)
    q = np.clip(np.rint(groups / scale[..., None]), QMIN, QMAX).astype(np.int8)
    return q.reshape(w.shape), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q [..., N, K] int, scale [..., N, K/32] -> float64 [..., N, K]."""
    q = np.asarray(q)
    _check_k(q.shape[-1])
    expanded = np.repeat(np.asarray(scale, dtype=np.float64), GROUP_SIZE, axis=-1)  # [..., N, K]
    return q.astype(np.float64) * expanded


def pack(q: np.ndarray) -> np.ndarray:
    """q [..., N, K] int in [-8, 7] -> packed int32 [..., N, K/8] (compressed-tensors layout)."""
    q = np.asarray(q)
    if q.shape[-1] % PACK_FACTOR != 0:
        raise ValueError(f"K={q.shape[-1]} must be divisible by {PACK_FACTOR}")
    if q.min(initial=0) < QMIN or q.max(initial=0) > QMAX:
        raise ValueError(f"q values must lie in [{QMIN}, {QMAX}], got [{q.min()}, {q.max()}]")
    nibbles = (q.astype(np.int64) + 8).reshape(*q.shape[:-1], q.shape[-1] // PACK_FACTOR, PACK_FACTOR)
    words = np.zeros(nibbles.shape[:-1], dtype=np.uint64)
    for i in range(PACK_FACTOR):
        words |= nibbles[..., i].astype(np.uint64) << np.uint64(4 * i)
    return words.astype(np.uint32).view(np.int32)


def unpack(packed: np.ndarray) -> np.ndarray:
    """packed int32 [..., N, K/8] -> q int8 [..., N, K]."""
    words = np.asarray(packed).astype(np.int32).view(np.uint32).astype(np.uint64)
    nibbles = [((words >> np.uint64(4 * i)) & np.uint64(0xF)).astype(np.int64) - 8 for i in range(PACK_FACTOR)]
    q = np.stack(nibbles, axis=-1)  # [..., N, K/8, 8]
    return q.reshape(*q.shape[:-2], q.shape[-2] * PACK_FACTOR).astype(np.int8)


def matmul(x: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x [..., K] @ dequant(W)^T in float64 -> [..., N] (W given as packed [N, K/8] + scale [N, K/32])."""
    w = dequantize(unpack(packed), scale)  # [N, K]
    return np.asarray(x, dtype=np.float64) @ w.T
