"""Tuned tiling for the tree-attention kernel on the H200 (see docs/tree_attention.md).

Entries are keyed by (c, r, H) and then chosen by T and S_max; anything not listed falls back to
a heuristic that splits the KV length until the grid holds about two waves of programs.
"""

from __future__ import annotations

import dataclasses

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
