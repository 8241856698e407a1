"""Tile choices for the grouped MoE kernels: `default_config` (Triton) and `default_mosaic_config` (Mosaic GPU,
measured at K2.6 shapes: benchmarks/results/moe_mgpu.md)."""

from __future__ import annotations

from pallas_kernels.int4 import GROUP_SIZE
from pallas_kernels.moe_w4a16.triton import MoEBlockConfig
from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig


def default_config(num_tokens: int, hidden: int, inter: int) -> MoEBlockConfig:
    """Heuristic tiles: block_m = 16 (tokens per expert are few: <= T, ~T*k/E on average); block_k
    shrunk to divide small test dims. Tune on the H200 with benchmarks/bench_k26_slice.py."""
    del num_tokens

    def fit(block, dim):
        while block > GROUP_SIZE and dim % block:
            block //= 2
        return block

    def fit_n(block, dim):
        while block > 16 and dim % block:
            block //= 2
        return block

    return MoEBlockConfig(block_n_up=fit_n(32, inter), block_k_up=fit(256, hidden),
                          block_n_down=fit_n(64, hidden), block_k_down=fit(256, inter))


def default_mosaic_config(k: int) -> MgpuConfig:
    """block_n 64 (the wgmma M), the deepest block_k of 256 / 128 / 64 that divides K, 4 pipeline steps:
    the fastest tiling measured at K2.6 shapes (bk512 and bn128 were slower at every T, a shallower block_k
    for the down launch too)."""
    return MgpuConfig(block_n=64, block_k=next(bk for bk in (256, 128, 64) if k % bk == 0))
