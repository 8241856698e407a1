"""Tuned tiling for the tree-attention kernel on the H200 (see docs/tree_attention.md).

Entries are keyed by (c, r, H) and then chosen by T and S_max; anything not listed falls back to
a heuristic that splits the KV length until the grid holds about two waves of programs.
"""

from __future__ import annotations

from .kernel import BlockConfig

NUM_SMS_H200 = 132

# (c, r, H) -> list of (max T, max S_max, BlockConfig); first matching row wins.
# Filled from benchmarks/results/tree_attention_*.json (H200, jax 0.11.2).
TUNED: dict[tuple[int, int, int], list[tuple[int, int, BlockConfig]]] = {}


def _num_splits(row_tiles: int, kv_tiles: int) -> int:
    """Split the prefix until ~2 waves of programs, keeping >= 4 KV tiles per split."""
    want = max(1, (2 * NUM_SMS_H200) // max(row_tiles, 1))
    return max(1, min(want, kv_tiles // 4))


def pick_config(*, batch: int, num_tree: int, num_heads: int, latent_dim: int, rope_dim: int,
                cache_rows: int) -> BlockConfig:
    """BlockConfig for one call shape: the tuned table first, else the split heuristic."""
    for max_t, max_s, cfg in TUNED.get((latent_dim, rope_dim, num_heads), []):
        if num_tree <= max_t and cache_rows <= max_s:
            return cfg
    base = BlockConfig()
    row_tiles = batch * -(-num_tree * num_heads // base.block_rows)
    kv_tiles = cache_rows // base.block_kv
    return BlockConfig(num_splits=_num_splits(row_tiles, kv_tiles))
