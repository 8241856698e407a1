"""Tiling of the dense Mosaic GPU W4A16 GEMM (`mosaic_gpu.w4a16_matmul_mgpu_kernel`) and where XLA runs instead,
from H200 measurements (benchmarks/bench_w4a16.py; docs/int4.md has the table).
"""

from __future__ import annotations

from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig

NUM_SMS = 132  # H200


def dense_config(k: int, n: int) -> tuple[MgpuConfig, int]:
    """(tiling, split_k) for a [N, K] weight: block_n 64 (the wgmma M), and the fewest K splits (a divisor of
    K / 64) that give at least NUM_SMS CTAs, each still streaming whole 64-column steps; block_k the deepest of
    256 / 128 / 64 that divides a split, 4 pipeline steps (block_k 256 measured fastest at 7168 x 18432, M <= 16:
    docs/w4a16_mgpu.md)."""
    tiles = n // 64
    steps = k // 64
    split = next((s for s in range(1, steps + 1) if steps % s == 0 and tiles * s >= NUM_SMS), steps)
    chunk = k // split
    return MgpuConfig(block_n=64, block_k=next(bk for bk in (256, 128, 64) if chunk % bk == 0)), split
