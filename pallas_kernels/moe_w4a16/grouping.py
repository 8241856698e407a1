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


# Up to this many compares (padded rows x assignments) the grouping compares all pairs instead of sorting and
# scattering: a verify's few assignments (T = 9 / 33 / 129 at K2.6's top-8: 72 / 264 / 1032) in 9 fewer launches
# (deviceless census for an H100: the T = 9 MoE call 24 -> 15 by this alone); a prefill's thousands keep the sort.
COMPARE_ALL_MAX = 1 << 24


def group_assignments(expert_ids: jax.Array, weights: jax.Array, num_experts: int, block_m: int) -> Grouping:
    """Sort the T*k assignments by expert into block_m-aligned per-expert row groups (on device): each expert's
    assignments in (token, choice) order from the first row of its group, groups in expert order. Few assignments
    (padded rows x assignments <= COMPARE_ALL_MAX) by comparing all pairs, more by an argsort and scatters: the same
    tables either way (tests/kernels/test_moe_w4a16.py)."""
    num_tokens, top_k = expert_ids.shape
    a = num_tokens * top_k
    flat_w = weights.reshape(a).astype(jnp.float32)  # [A]
    keep = flat_w != 0.0  # a zero-weight choice adds nothing and must not make an expert touched
    flat_e = jnp.where(keep, expert_ids.reshape(a).astype(jnp.int32), num_experts)  # [A]; E = dropped
    n_tiles = max_row_tiles(a, num_experts, block_m)
    p = n_tiles * block_m
    slot = jnp.arange(a, dtype=jnp.int32)
    slot_token = slot // top_k
    e_safe = jnp.minimum(flat_e, num_experts - 1)
    if p * a <= COMPARE_ALL_MAX:
        # Without a sort or a scatter (each scatter needs its zeroed buffer first: a launch of its own on a GPU):
        # an expert's count, an assignment's rank among the earlier ones of its expert, and each padded row's
        # assignment are sums of compares.
        counts = jnp.sum(flat_e[:, None] == jnp.arange(num_experts, dtype=jnp.int32), axis=0, dtype=jnp.int32)
        rank = jnp.sum((flat_e[None, :] == flat_e[:, None]) & (slot[None, :] < slot[:, None]), axis=1,
                       dtype=jnp.int32)  # [A]
        padded = (counts + block_m - 1) // block_m * block_m  # [E]
        padded_ends = jnp.cumsum(padded)  # [E]
        position = jnp.where(keep, (padded_ends - padded)[e_safe] + rank, 0)  # [A]: slot -> padded row
        # Computed once: left to itself XLA recomputes it (the counts' cumulative sum, a gather) inside each consumer's
        # fusion, the MoE's final per-choice gather included (7.2 -> 13.9 us at T = 9 on an H100, session 33)
        position = jax.lax.optimization_barrier(position)
        hit = (position[None, :] == jnp.arange(p, dtype=jnp.int32)[:, None]) & keep[None, :]  # [P, A]
        row_token = jnp.sum(jnp.where(hit, slot_token, 0), axis=1, dtype=jnp.int32)
        row_weight = jnp.sum(jnp.where(hit, flat_w, 0.0), axis=1)
        row_valid = jnp.any(hit, axis=1)
    else:
        order = jnp.argsort(flat_e, stable=True)  # [A]
        sorted_e = flat_e[order]  # [A]
        counts = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_e].add(1)[:num_experts]  # [E]
        starts = jnp.cumsum(counts) - counts  # [E] first sorted slot of each expert
        padded = (counts + block_m - 1) // block_m * block_m  # [E]
        padded_ends = jnp.cumsum(padded)  # [E]
        sorted_safe = jnp.minimum(sorted_e, num_experts - 1)
        rank = slot - starts[sorted_safe]
        pos_sorted = jnp.where(sorted_e < num_experts, (padded_ends - padded)[sorted_safe] + rank, 0)  # [A]
        position = jnp.zeros((a,), jnp.int32).at[order].set(pos_sorted)  # [A]: slot -> padded row
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
