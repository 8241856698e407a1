"""What the H200 measurements decide for tree attention (see docs/tree_attention.md): which implementation runs
per call shape (`measured_fastest`, read by pallas_kernels.dispatch) and the Mosaic kernel's split count and schedule
(`mosaic_config`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.tree_attention.mosaic_gpu import MosaicAttentionConfig


# Which implementation was measured FASTEST on Hopper (the H200; one H100 run below) per call shape; impl="auto" runs
# the first of them that can run on the device at hand (the Mosaic kernel needs a Hopper GPU), and never a kernel where
# it measured slower than XLA or where nothing was measured. (The Triton kernel timed below was deleted on 2026-12-04:
# behind the Mosaic kernel at every measured shape.)
# K2 (c 512, r 64, H 64), bf16, cache rows S + T rounded up to 64 (tree_attention_mosaic_h200.md, 2026-12-02;
# CUPTI us, wall clock per op in brackets; XLA = the bf16 jnp form):
#   S 32768: T 1: Mosaic 35.3 (103), Triton 44.1 (119), XLA 90.6 (168);  T 33: Mosaic 319 (574), XLA 554 (699),
#            Triton 570 (828);  T 129: Mosaic 1205 (1496), XLA 1862 (2115), Triton 2187 (2541);
#            (2026-12-04, the shared_qk schedule: T 33 300.6 (554), XLA 528.7 (663); T 129 1134 (1490), XLA 1854 (2044))
#   S 4096:  T 1: XLA 23.3 (62), Mosaic 24.0 (118), Triton 34.0 (90);  T 33: Mosaic 58.5 (241), XLA 65.9 (230),
#            Triton 94.8 (222);  T 129: Mosaic 188.7 (342), XLA 191.9 (293), Triton 311.8 (468).
#   S 4096 again, wall clocks first (2026-12-05, an NVIDIA H100: no H200 came; tree_attention_mosaic_h100_s23_s4096.md):
#            T 33: Mosaic (shared_qk, 4 splits) 65.4 (162), XLA 67.5 (170);  T 129: Mosaic (shared_qk, 1) 181 (354),
#            XLA 213 (376): the kernel is faster by both measures. T 1 (tree_attention_mosaic_h100_s23_t1_4096.md):
#            XLA 20.5 (79), Mosaic 24.9 (69) at 16 splits with the 5.7 us combine of that day (two-stage: 3.4).
#   T = 9 (a budget-8 verify; 2026-12-06, an H100, tree_attention_mosaic_h100_s27_t9{,_splits}.md, wall clocks first):
#            S 32768: Mosaic (shared_qk, 32 splits) 135.6 (223), XLA 214.6 (286): faster by both measures (16 splits
#            153.3, 64 splits 142.2); S 4096: Mosaic (shared_qk, 8 splits) 32.2 (105), XLA 39.1 (99): faster by CUPTI,
#            slower by the wall clock.
#   The same day, same H100 (tree_attention_mosaic_h100_s27_t129_t1_4096.md): S 4096 T 1: Mosaic (shared_qk, 32)
#            18.4 (55), XLA 20.5 (52.5): again faster by CUPTI only, so XLA stays there.
# So: the Mosaic kernel at S_max >= 32768 for T = 1 and T = 9 and at S_max >= 4096 for T >= 33 (there the 2026-12-02
# H200 wall clocks that had kept XLA came after CUPTI windows of the same process, which inflate launches; the
# wall-clock-first run above reverses them); XLA at T = 1 and T = 9 below S_max 32768 (XLA faster by one measure)
# and everywhere below S_max 4096 (not measured); the other T in 2..32 were not measured: XLA.
# float32: the Mosaic kernel takes bf16 / f16 only (and the Triton kernel took 1.24-44.7x XLA's float32 time,
# tree_attention_shipped.md).
def measured_fastest(*, num_heads: int, latent_dim: int, rope_dim: int, dtype, num_tree: int | None = None,
                     cache_rows: int | None = None) -> tuple[tuple[str, ...], str]:
    """(implementations, fastest first, always ending in "xla"; why, in a few words) for one call shape. Without
    num_tree / cache_rows (a plan before any call): every implementation some call shape of this (H, c, r, dtype)
    measured fastest with."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return ("xla",), "float32: the kernel measured slower than XLA"
    if (latent_dim, rope_dim, num_heads) != (512, 64, 64) or dtype != jnp.bfloat16:
        return ("xla",), f"not measured faster than XLA at H={num_heads}, c={latent_dim}, r={rope_dim}, {dtype}"
    if num_tree is None or cache_rows is None:
        return ("mosaic_gpu", "xla"), "per call shape, as measured"
    if cache_rows >= 32768 and num_tree in (1, 9):
        return ("mosaic_gpu", "xla"), f"T={num_tree}, S_max >= 32768: Mosaic measured fastest"
    if cache_rows >= 4096 and num_tree >= 33:
        return ("mosaic_gpu", "xla"), f"T={num_tree} >= 33, S_max >= 4096: Mosaic measured fastest"
    return ("xla",), f"T={num_tree}, S_max={cache_rows}: XLA measured fastest (or no kernel measured here)"


def mosaic_config(*, batch: int, num_tree: int, cache_rows: int) -> MosaicAttentionConfig:
    """The Mosaic kernel's KV split count measured best at B = 1 (tree_attention_mosaic_h200.md; T <= 9 at S = 32768:
    the H100's tree_attention_mosaic_h100_s27_t9_splits.md, 32 of 16 / 32 / 64), divided by B, and its schedule:
    "shared_qk" (one QK^T for both value warpgroups) for T > 1, measured faster at S = 32768 (2026-12-04: T = 33 300.6
    vs 324.8 us at 4 splits, T = 129 1134 vs 1207 at 1 split; 2026-12-06, H100: T = 9 135.6 vs 144.5 at 32); at T = 1
    "replicated", as measured at 128 splits (35-36 us; shared_qk at 64 splits 39.5 vs 39.8: the same)."""
    if num_tree == 1:
        splits = 128 if cache_rows >= 32768 else 32
    elif num_tree <= 9 and cache_rows >= 32768:
        splits = 32
    elif num_tree <= 33:
        splits = 4
    else:
        splits = 1
    return MosaicAttentionConfig(num_splits=max(1, -(-splits // batch)),
                                 schedule="replicated" if num_tree == 1 else "shared_qk")
