"""What the H200 measurements decide for tree attention (see docs/tree_attention.md): which implementation is
fastest per call shape (`measured_fastest`, read by pallas_kernels.dispatch), the Mosaic kernel's split count
(`mosaic_config`) and the Triton kernel's tiling (`pick_config`: entries keyed by (c, r, H) and then chosen by T and
S_max; anything not listed falls back to a heuristic that splits the KV length until the grid holds about two waves
of programs).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.tree_attention.mosaic_gpu import MosaicAttentionConfig
from pallas_kernels.tree_attention.triton import BlockConfig

NUM_SMS_H200 = 132

# (c, r, H) -> list of (max T, max S_max, BlockConfig measured best at B = 1); first match wins.
# From benchmarks/results/tree_attention_h200_{sweep1,tune2}.json (H200, jax 0.11.2, 2026-11-30).
# num_splits is for B = 1; pick_config divides it by B (more batch rows = more row tiles).
# For T = 1, S = 32768 bf16 partials were 2 us faster (43.0 vs 45.1 us) but doubled the max
# error; float32 partials are kept.
_K2 = [
    (1, 8192, BlockConfig(block_kv=64, num_stages=2, num_splits=16, rescale_threshold=8.0)),  # 33.8 us
    (1, 1 << 30, BlockConfig(block_kv=32, num_stages=3, num_splits=128, rescale_threshold=8.0)),  # 45.1 us
    (33, 8192, BlockConfig(block_kv=64, num_stages=2, num_splits=4)),  # 94.5 us
    (33, 1 << 30, BlockConfig(block_kv=64, num_stages=2, num_splits=8, rescale_threshold=8.0)),  # 563 us
    (129, 8192, BlockConfig(block_kv=64, num_stages=2, num_splits=2, rescale_threshold=8.0)),  # 310 us
    (129, 1 << 30, BlockConfig(block_kv=128, num_stages=1, num_splits=2)),  # 2135 us
]
TUNED: dict[tuple[int, int, int], list[tuple[int, int, BlockConfig]]] = {(512, 64, 64): _K2}


# Which implementation was measured FASTEST on the H200 per call shape; impl="auto" runs the first of them that can
# run on the device at hand (the Mosaic kernel needs a Hopper GPU), and never a kernel where it measured slower than
# XLA or where nothing was measured.
# K2 (c 512, r 64, H 64), bf16, cache rows S + T rounded up to 64 (tree_attention_mosaic_h200.md, 2026-12-02;
# CUPTI us, wall clock per op in brackets; XLA = the bf16 jnp form):
#   S 32768: T 1: Mosaic 35.3 (103), Triton 44.1 (119), XLA 90.6 (168);  T 33: Mosaic 319 (574), XLA 554 (699),
#            Triton 570 (828);  T 129: Mosaic 1205 (1496), XLA 1862 (2115), Triton 2187 (2541);
#            (2026-12-04, the shared_qk schedule: T 33 300.6 (554), XLA 528.7 (663); T 129 1134 (1490), XLA 1854 (2044))
#   S 4096:  T 1: XLA 23.3 (62), Mosaic 24.0 (118), Triton 34.0 (90);  T 33: Mosaic 58.5 (241), XLA 65.9 (230),
#            Triton 94.8 (222);  T 129: Mosaic 188.7 (342), XLA 191.9 (293), Triton 311.8 (468).
# So: the Mosaic kernel at S_max >= 32768 for T = 1 and T >= 33 (both timings agree); XLA at S_max < 32768 (there the
# kernel time is at most XLA's but the wall clock per op is 5-17% above it: the kernel's XLA glue, more launches;
# those wall clocks came after CUPTI windows of the same process, which inflate launches: to be re-measured);
# T = 2..32 at S_max >= 32768 was not measured (the split count for so few row tiles is untuned): XLA. The Triton
# kernel is behind the Mosaic kernel everywhere measured; it remains the T = 1, S_max >= 32768 choice of a GPU
# without Mosaic support (it beat XLA there).
# float32 (tree_attention_shipped.md, 2026-12-02, the shipped pair's c 128, r 32, H 6, against XLA's float32 HIGHEST
# path): the Triton kernel takes 1.24-2.74x XLA's time at JAX's default precision (S_max 256 and 2048, T 1 and 33)
# and 44.7x at "highest", how the float32 engine runs (527.8 vs 11.8 us, S_max 256, T 1); the Mosaic kernel takes
# bf16 / f16 only.
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
        return ("mosaic_gpu", "triton", "xla"), "per call shape, as measured"
    if cache_rows >= 32768 and num_tree == 1:
        return ("mosaic_gpu", "triton", "xla"), "T=1, S_max >= 32768: Mosaic measured fastest"
    if cache_rows >= 32768 and num_tree >= 33:
        return ("mosaic_gpu", "xla"), f"T={num_tree} >= 33, S_max >= 32768: Mosaic measured fastest"
    return ("xla",), f"T={num_tree}, S_max={cache_rows}: XLA measured fastest (or no kernel measured here)"


def mosaic_config(*, batch: int, num_tree: int, cache_rows: int) -> MosaicAttentionConfig:
    """The Mosaic kernel's KV split count measured best at B = 1 (tree_attention_mosaic_h200.md), divided by B, and its
    schedule: "shared_qk" (one QK^T for both value warpgroups) for T > 1, measured faster at S = 32768 (2026-12-04:
    T = 33 300.6 vs 324.8 us at 4 splits, T = 129 1134 vs 1207 at 1 split); at T = 1 "replicated", as measured at 128
    splits (35-36 us; shared_qk at 64 splits 39.5 vs 39.8: the same)."""
    splits = 128 if num_tree == 1 and cache_rows >= 32768 else 32 if num_tree == 1 else 4 if num_tree <= 33 else 1
    return MosaicAttentionConfig(num_splits=max(1, -(-splits // batch)),
                                 schedule="replicated" if num_tree == 1 else "shared_qk")


def _num_splits(row_tiles: int, kv_tiles: int) -> int:
    """Split the prefix until ~2 waves of programs, keeping >= 4 KV tiles per split."""
    want = max(1, (2 * NUM_SMS_H200) // max(row_tiles, 1))
    return max(1, min(want, kv_tiles // 4))


def pick_config(*, batch: int, num_tree: int, num_heads: int, latent_dim: int, rope_dim: int,
                cache_rows: int) -> BlockConfig:
    """BlockConfig for one call shape: the tuned table first, else the split heuristic."""
    for max_t, max_s, cfg in TUNED.get((latent_dim, rope_dim, num_heads), []):
        if num_tree <= max_t and cache_rows <= max_s:
            return dataclasses.replace(cfg, num_splits=max(1, -(-cfg.num_splits // batch)))
    base = BlockConfig()
    row_tiles = batch * -(-num_tree * num_heads // base.block_rows)
    kv_tiles = cache_rows // base.block_kv
    return BlockConfig(num_splits=_num_splits(row_tiles, kv_tiles))
