"""Tiling of the dense Mosaic GPU W4A16 GEMM (`mosaic_gpu.w4a16_matmul_mgpu_kernel`) and where XLA runs instead,
from H100 / H200 measurements (benchmarks/bench_w4a16.py; docs/w4a16_mgpu.md has the tables).
"""

from __future__ import annotations

from pallas_kernels.dispatch import HOPPER_SMS
from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig


def dense_config(k: int, n: int, num_sms: int = HOPPER_SMS) -> tuple[MgpuConfig, int, int]:
    """(tiling, split_k, whole_tiles) for a [N, K] weight on a GPU of num_sms SMs (w4a16_matmul passes the device's:
    `dispatch.sm_count`): block_n 64 (the wgmma M) and 4 pipeline steps.

    The SMs should get equal work. With fewer 64-wide N slices than SMs, every slice splits K into the fewest chunks
    (a divisor of K / 64) that make at least num_sms CTAs (whole_tiles 0). With more slices than SMs, the largest
    multiple of num_sms of them run whole (whole_tiles) and the remainder splits K into the most chunks that still
    give no SM two of them (rest x split <= num_sms). At 7168 x 18432 (H100, 2026-12-06, M = 8): 264 whole + 24 x 4
    chunks 30.3 us, against 33.6 for 288 whole slices (2.18 an SM: 24 SMs ran 3), 35.3 for 24 x 7 chunks, 34.6 for
    24 x 14 (docs/w4a16_mgpu.md). block_k: the deepest of 256 / 128 / 64 that divides a chunk (256 measured fastest
    at 7168 x 18432, M <= 16)."""
    tiles = n // 64
    steps = k // 64
    whole = tiles - tiles % num_sms
    rest = tiles - whole
    if not rest:
        split = 1
    elif whole:
        split = max(s for s in range(1, steps + 1) if steps % s == 0 and rest * s <= num_sms)
    else:
        split = next((s for s in range(1, steps + 1) if steps % s == 0 and rest * s >= num_sms), steps)
    chunk = k // split
    return MgpuConfig(block_n=64, block_k=next(bk for bk in (256, 128, 64) if chunk % bk == 0)), split, whole
