"""Device-side grouping of routed (token, choice) assignments by expert, with static shapes: shared by the
Triton and Mosaic GPU MoE kernels."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Grouping(NamedTuple):
    """Static-shape routing tables. A = T*k assignments, P = max_row_tiles * block_m padded rows."""

    row_token: jax.Array  # [P] int32: token of each padded row (0 on pad rows)
    row_weight: jax.Array  # [P] float32: combine weight of each row (0 on pad rows)
    row_valid: jax.Array  # [P] bool
    tile_expert: jax.Array  # [R] int32: expert of each row tile, -1 for unused tiles
    position: jax.Array  # [T, k] int32: padded row of each assignment
    keep: jax.Array  # [T, k] bool: False for dropped (weight == 0) assignments
    touched: jax.Array  # [] int32: number of distinct experts with a kept assignment


def max_row_tiles(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound on row tiles: sum_e ceil(c_e / bm) <= (A + (bm - 1) * min(E, A)) // bm."""
    return (num_assignments + (block_m - 1) * min(num_experts, num_assignments)) // block_m


def group_assignments(expert_ids: jax.Array, weights: jax.Array, num_experts: int, block_m: int) -> Grouping:
    """Sort the T*k assignments by expert into block_m-aligned per-expert row groups (on device)."""
    num_tokens, top_k = expert_ids.shape
    a = num_tokens * top_k
    flat_w = weights.reshape(a).astype(jnp.float32)  # [A]
    keep = flat_w != 0.0  # a zero-weight choice adds nothing and must not make an expert touched
    flat_e = jnp.where(keep, expert_ids.reshape(a).astype(jnp.int32), num_experts)  # [A]; E = dropped
    order = jnp.argsort(flat_e, stable=True)  # [A]
    sorted_e = flat_e[order]  # [A]
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_e].add(1)[:num_experts]  # [E]
    starts = jnp.cumsum(counts) - counts  # [E] first sorted slot of each expert
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_ends = jnp.cumsum(padded)  # [E]
    padded_starts = padded_ends - padded
    e_safe = jnp.minimum(sorted_e, num_experts - 1)
    rank = jnp.arange(a, dtype=jnp.int32) - starts[e_safe]
    pos_sorted = jnp.where(sorted_e < num_experts, padded_starts[e_safe] + rank, 0)  # [A]
    position = jnp.zeros((a,), jnp.int32).at[order].set(pos_sorted)  # [A]: slot -> padded row

    n_tiles = max_row_tiles(a, num_experts, block_m)
    p = n_tiles * block_m
    slot_token = jnp.arange(a, dtype=jnp.int32) // top_k
    target = jnp.where(keep, position, p)  # dropped assignments scatter out of bounds (mode="drop")
    row_token = jnp.zeros((p,), jnp.int32).at[target].set(slot_token, mode="drop")
    row_weight = jnp.zeros((p,), jnp.float32).at[target].set(flat_w, mode="drop")
    row_valid = jnp.zeros((p,), jnp.bool_).at[target].set(True, mode="drop")
    tile_start = jnp.arange(n_tiles, dtype=jnp.int32) * block_m
    # The expert owning row tile_start: the first e whose padded range ends after it. compare_all: one fusion of
    # R x E compares; the default binary search is a loop of log2(E) steps that XLA runs as a while loop, ~4 launches
    # a step (36 of a T = 9 call's 69 at E = 384, H200, moe_mgpu_timeline_h200_s30.md).
    tile_expert = jnp.searchsorted(padded_ends, tile_start, side="right", method="compare_all").astype(jnp.int32)
    tile_expert = jnp.where(tile_start < padded_ends[-1], tile_expert, -1)  # [R]
    return Grouping(row_token, row_weight, row_valid, tile_expert, position.reshape(num_tokens, top_k),
                    keep.reshape(num_tokens, top_k), jnp.sum(counts > 0).astype(jnp.int32))
