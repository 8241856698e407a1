"""Block sizes for the W4A16 kernel, keyed by (K, N, M bucket); measured on an H200 by
benchmarks/bench_w4a16.py (the table is filled from its results, see docs/int4.md).

Shapes not in the table use `heuristic_config`: enough programs for 132 SMs via split-K.
"""

from __future__ import annotations

from pallas_kernels.w4a16.triton import BlockConfig

NUM_SMS = 132  # H200
M_BUCKETS = (16, 32, 64, 128, 256)

# (K, N, M bucket) -> BlockConfig: best of the sweep in benchmarks/results/w4a16_results.json
# (H200, JAX 0.11.2, 2026-11-30); the comment is the measured CUPTI time at M = bucket.
TUNED: dict[tuple[int, int, int], BlockConfig] = {
    # bn32 from the second sweep (benchmarks/results/w4a16_ablation.json); bn64 was 145.1 us.
    (7168, 18432, 16): BlockConfig(block_m=16, block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=4),  # 98.3 us
    (7168, 18432, 32): BlockConfig(block_m=32, block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4),  # 185.2 us
    (7168, 18432, 64): BlockConfig(block_m=64, block_n=128, block_k=128, split_k=2, num_warps=8, num_stages=3),  # 184.4 us
    (7168, 18432, 128): BlockConfig(block_m=128, block_n=128, block_k=128, split_k=2, num_warps=8, num_stages=3),  # 236.4 us
    (7168, 2048, 16): BlockConfig(block_m=16, block_n=64, block_k=256, split_k=14, num_warps=4, num_stages=4),  # 17.1 us
    (7168, 2048, 32): BlockConfig(block_m=32, block_n=128, block_k=256, split_k=14, num_warps=4, num_stages=3),  # 20.9 us
    (7168, 2048, 64): BlockConfig(block_m=64, block_n=128, block_k=256, split_k=14, num_warps=4, num_stages=3),  # 23.6 us
    (7168, 2048, 128): BlockConfig(block_m=128, block_n=128, block_k=128, split_k=28, num_warps=8, num_stages=3),  # 41.4 us
    (18432, 7168, 16): BlockConfig(block_m=16, block_n=128, block_k=256, split_k=6, num_warps=4, num_stages=3),  # 152.7 us
    (18432, 7168, 32): BlockConfig(block_m=32, block_n=128, block_k=256, split_k=6, num_warps=4, num_stages=3),  # 159.4 us
    (18432, 7168, 64): BlockConfig(block_m=64, block_n=128, block_k=256, split_k=6, num_warps=4, num_stages=3),  # 173.8 us
    (18432, 7168, 128): BlockConfig(block_m=64, block_n=128, block_k=256, split_k=3, num_warps=4, num_stages=3),  # 343.6 us
    (2048, 7168, 16): BlockConfig(block_m=16, block_n=128, block_k=256, split_k=4, num_warps=4, num_stages=3),  # 19.8 us
    (2048, 7168, 32): BlockConfig(block_m=32, block_n=128, block_k=256, split_k=4, num_warps=4, num_stages=3),  # 20.8 us
    (2048, 7168, 64): BlockConfig(block_m=64, block_n=128, block_k=256, split_k=4, num_warps=4, num_stages=3),  # 23.6 us
    (2048, 7168, 128): BlockConfig(block_m=64, block_n=128, block_k=256, split_k=4, num_warps=4, num_stages=3),  # 45.6 us
}


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def _largest_pow2_divisor(k: int, cap: int) -> int:
    b = cap
    while b > 32 and k % b:
        b //= 2
    return b


def heuristic_config(m: int, k: int, n: int) -> BlockConfig:
    """A reasonable config for any M, K % 32 == 0, N % 16 == 0."""
    block_m = min(max(16, 1 << (max(m, 1) - 1).bit_length()), 64)
    # 64-wide N tiles measured fastest at small M (Triton stages the bf16 tile in shared memory).
    if n % 16:
        raise ValueError(f"the W4A16 kernel tiles N by 16, 32 or 64: N={n} is not a multiple of 16")
    block_n = next(b for b in (64, 32, 16) if n % b == 0)
    block_k = _largest_pow2_divisor(k, 256)
    steps = k // block_k
    programs = -(-m // block_m) * (n // block_n)
    split_k = 1
    # Grow split-K (a divisor of the K steps) until the grid covers the SMs about twice.
    for s in range(1, steps + 1):
        if steps % s == 0 and steps // s >= 2:
            split_k = s
            if programs * s >= 2 * NUM_SMS:
                break
    return BlockConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                       num_warps=4, num_stages=4)


def get_config(m: int, k: int, n: int) -> BlockConfig:
    return TUNED.get((k, n, m_bucket(m))) or heuristic_config(m, k, n)
