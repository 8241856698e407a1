"""What the H200 measurements decide for the routed MoE: whether a kernel or XLA runs a call (`measured_fastest`,
read by pallas_kernels.dispatch) and the kernels' tiles: `default_config` (Triton) and `default_mosaic_config`
(Mosaic GPU, measured at K2.6 shapes: benchmarks/results/moe_mgpu.md)."""

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


# Up to this many bytes of float32 dequantized routed experts (E * 3 * D * I * 4, the whole stack) XLA runs them under
# impl="auto" on a GPU; above it the grouped kernels. Measured (benchmarks/results/moe_small_h200.md, H200,
# 2026-12-02, per call in a jitted loop, us) on the shipped pair's stack (E 32, D 384, I 96, top-4: 14 MiB), XLA's
# gather form against the Triton kernel: float32 T 1 / 9 / 33 / 264: 31.6 / 14.6 / 25.6 / 95.7 vs 139 / 157 / 169 /
# 148; bf16: 31.1 / 23.4 / 27.1 / 113 vs 112 / 118 / 157 / 166. Wider stacks were not timed (the run's time ran out),
# so the bound sits just above the one stack measured; K2.6's (384 experts, 7168 x 2048: 63 GiB) is the kernels'.
XLA_FASTER_STACK_BYTES = 16 << 20


def measured_fastest(num_experts: int, hidden: int, inter: int) -> tuple[bool, str]:
    """(XLA is faster than the grouped kernels for this routed stack, why in a few words)."""
    stack = num_experts * 3 * hidden * inter * 4
    if stack <= XLA_FASTER_STACK_BYTES:
        return True, f"small expert stack ({stack / 2**20:.0f} MiB as float32): XLA measured faster than the kernels"
    return False, "large expert stack: the kernel"
