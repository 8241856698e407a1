"""Grouped W4A16 MoE: the routed experts' SwiGLU over INT4 group-32 expert stacks.

out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert_ids[t, j]
with every expert weight an INT4 weight (pallas_kernels.int4, dict form) stacked over experts:
gate/up {"qweight": int16 [E, I, D/4], "scale": [E, I, D/32]}, down {int16 [E, D, I/4], [E, D, I/32]}.

Design (Pallas, Triton backend; the same swap-AB tile loop and bf16 bit-trick dequant as
`pallas_kernels.w4a16`, whose docs/int4.md explains why it is Triton and what Mosaic GPU would add):
  1. Grouping on device, static shapes (`group_assignments`): the T*k (token, choice) assignments are
     sorted by expert; each expert's rows start at a block_m-aligned row of a padded buffer, so every
     row tile holds rows of ONE expert. The number of row tiles is data dependent but bounded
     (`max_row_tiles`); a tile table gives each tile its expert, or -1 for unused tiles.
  2. Kernel 1 (gate/up + SwiGLU fused), grid (row tiles, I / block_n): a program loads its tile's
     expert id, skips the whole body when it is -1 (so no untouched expert is ever read), and streams
     the expert's gate and up words for its block_n slice of I once over D, accumulating both in f32;
     silu(g) * u is written in x.dtype (the down matmul's input dtype).
  3. Kernel 2 (down + combine weight), grid (row tiles, D / block_n): same loop over I with the down
     words; each row is scaled by its assignment's combine weight in-kernel, written float32.
  4. The k rows of each token are summed (an XLA gather of T*k rows: tiny next to the weights).
Tile axis fastest: when one expert owns several row tiles (more than block_m tokens chose it), the
programs re-reading its weight slice run side by side and hit L2; with block_m >= T (the default for
T <= 16) every touched expert's words and scales are read exactly once from HBM.
Assignments with weight exactly 0 (e.g. another shard's experts in `moe_sharded`) are dropped before
grouping: they contribute nothing and must not make an expert "touched".

Also here: `grouped_moe_w4a16_reference` (plain jnp, dequantize then einsum: the test oracle) and the
XLA alternatives the benchmark compares against (`moe_w4a16_xla_touched`, `_dense`, `_gather`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.w4a16.kernel import (GROUP_SIZE, _dequant_tile, w4a16_matmul_reference,
                                         w4a16_matmul_xla_bf16)



@dataclasses.dataclass(frozen=True)
class MoEBlockConfig:
    """Tile sizes for the two kernels. block_m: rows (assignments) per tile; *_up: gate/up kernel
    (N = I, K = D); *_down: down kernel (N = D, K = I). Powers of two; block_k >= 32 (one group)."""

    block_m: int = 16
    block_n_up: int = 32
    block_k_up: int = 256
    block_n_down: int = 64
    block_k_down: int = 256
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n_up", "block_k_up", "block_n_down", "block_k_down"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if min(self.block_m, self.block_n_up, self.block_n_down) < 16:
            raise ValueError(f"block_m/block_n_* must be >= 16 (Triton dot minimum), got {self}")
        if min(self.block_k_up, self.block_k_down) < GROUP_SIZE:
            raise ValueError(f"block_k_* must be >= {GROUP_SIZE} (one scale group), got {self}")


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


# ----------------------------------------------------------------------------------------- grouping
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
    # The expert owning row tile_start: the first e whose padded range ends after it.
    tile_expert = jnp.searchsorted(padded_ends, tile_start, side="right").astype(jnp.int32)
    tile_expert = jnp.where(tile_start < padded_ends[-1], tile_expert, -1)  # [R]
    return Grouping(row_token, row_weight, row_valid, tile_expert, position.reshape(num_tokens, top_k),
                    keep.reshape(num_tokens, top_k), jnp.sum(counts > 0).astype(jnp.int32))


# ------------------------------------------------------------------------------------------ kernels
def _gate_up_kernel(tile_expert_ref, x_ref, gq_ref, gs_ref, uq_ref, us_ref, h_ref, *, bm, bn, bk, k_dim,
                    compute_dtype):
    t, j = pl.program_id(0), pl.program_id(1)
    expert = tile_expert_ref[t]
    r0 = pl.multiple_of(t * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def body(i, accs):
        acc_g, acc_u = accs
        k0 = pl.multiple_of(i * bk, bk)
        x = pltriton.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)]).astype(compute_dtype)  # [bm, bk]
        wk = pl.ds(pl.multiple_of(k0 // 4, bk // 4), bk // 4)
        sk = pl.ds(k0 // GROUP_SIZE, bk // GROUP_SIZE)
        out = []
        for q_ref, s_ref, acc in ((gq_ref, gs_ref, acc_g), (uq_ref, us_ref, acc_u)):
            words = pltriton.load(q_ref.at[expert, pl.ds(n0, bn), wk], eviction_policy="evict_first")  # [bn, bk/4]
            scale = pltriton.load(s_ref.at[expert, pl.ds(n0, bn), sk])  # [bn, bk/32]
            w = _dequant_tile(words, scale, method="magic", out_dtype=compute_dtype)  # [bn, bk]
            out.append(acc + lax.dot_general(w, x, (((1,), (1,)), ((), ())), precision=precision,
                                             preferred_element_type=jnp.float32))  # [bn, bm]
        return tuple(out)

    @pl.when(expert >= 0)
    def _():
        zeros = jnp.zeros((bn, bm), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, k_dim // bk, body, (zeros, zeros))
        # Same roundings as two W4A16 matmuls followed by swiglu in x.dtype.
        # silu itself in float32: Triton has no bf16 division.
        g = acc_g.T.astype(h_ref.dtype).astype(jnp.float32)  # [bm, bn]
        u = acc_u.T.astype(h_ref.dtype)
        h_ref[...] = (g / (1.0 + jnp.exp(-g))).astype(h_ref.dtype) * u

    @pl.when(expert < 0)
    def _():
        h_ref[...] = jnp.zeros((bm, bn), h_ref.dtype)


def _down_kernel(tile_expert_ref, row_weight_ref, h_ref, dq_ref, ds_ref, y_ref, *, bm, bn, bk, k_dim,
                 compute_dtype, act_dtype):
    t, j = pl.program_id(0), pl.program_id(1)
    expert = tile_expert_ref[t]
    r0 = pl.multiple_of(t * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def body(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        h = pltriton.load(h_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)]).astype(compute_dtype)  # [bm, bk]
        words = pltriton.load(dq_ref.at[expert, pl.ds(n0, bn), pl.ds(pl.multiple_of(k0 // 4, bk // 4), bk // 4)],
                              eviction_policy="evict_first")  # [bn, bk/4]
        scale = pltriton.load(ds_ref.at[expert, pl.ds(n0, bn), pl.ds(k0 // GROUP_SIZE, bk // GROUP_SIZE)])
        w = _dequant_tile(words, scale, method="magic", out_dtype=compute_dtype)  # [bn, bk]
        return acc + lax.dot_general(w, h, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)  # [bn, bm]

    @pl.when(expert >= 0)
    def _():
        acc = lax.fori_loop(0, k_dim // bk, body, jnp.zeros((bn, bm), jnp.float32))
        row_w = pltriton.load(row_weight_ref.at[pl.ds(r0, bm)])  # [bm] f32, 0 on pad rows
        # The down output is rounded to x.dtype before the combine, as a per-expert W4A16 matmul is.
        y = acc.T.astype(act_dtype).astype(jnp.float32)  # [bm, bn]
        y_ref[...] = y * row_w[:, None]

    @pl.when(expert < 0)
    def _():
        y_ref[...] = jnp.zeros((bm, bn), jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "out_dtype"))
def grouped_moe_w4a16_pallas(x, experts, expert_ids, weights, *, cfg: MoEBlockConfig, interpret: bool = False,
                             out_dtype=None):
    """The two Pallas kernels around device-side grouping. Shapes are checked by the wrapper.

    x [T, D] bf16|f32; expert_ids/weights [T, k]; returns [T, D] in out_dtype (default x.dtype)."""
    num_tokens, hidden = x.shape
    num_experts, inter = experts["gate"]["qweight"].shape[:2]
    bm = cfg.block_m
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    grp = group_assignments(expert_ids, weights, num_experts, bm)
    n_tiles = grp.tile_expert.shape[0]
    p = n_tiles * bm
    x_rows = jnp.where(grp.row_valid[:, None], x[grp.row_token], 0).astype(x.dtype)  # [P, D]
    params = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    anyspec = pl.BlockSpec(memory_space=pl.ANY)

    bn, bk = cfg.block_n_up, cfg.block_k_up
    gate_up = functools.partial(_gate_up_kernel, bm=bm, bn=bn, bk=bk, k_dim=hidden, compute_dtype=compute_dtype)
    h = pl.pallas_call(
        gate_up,
        out_shape=jax.ShapeDtypeStruct((p, inter), x.dtype),
        grid=(n_tiles, inter // bn),
        in_specs=[anyspec] * 6,
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        compiler_params=params, interpret=interpret,
        name=f"moe_w4a16_gate_up_bm{bm}_bn{bn}_bk{bk}",
    )(grp.tile_expert, x_rows, experts["gate"]["qweight"], experts["gate"]["scale"],
      experts["up"]["qweight"], experts["up"]["scale"])  # [P, I]

    bn, bk = cfg.block_n_down, cfg.block_k_down
    down = functools.partial(_down_kernel, bm=bm, bn=bn, bk=bk, k_dim=inter, compute_dtype=compute_dtype,
                             act_dtype=x.dtype)
    y = pl.pallas_call(
        down,
        out_shape=jax.ShapeDtypeStruct((p, hidden), jnp.float32),
        grid=(n_tiles, hidden // bn),
        in_specs=[anyspec] * 5,
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        compiler_params=params, interpret=interpret,
        name=f"moe_w4a16_down_bm{bm}_bn{bn}_bk{bk}",
    )(grp.tile_expert, grp.row_weight, h, experts["down"]["qweight"], experts["down"]["scale"])  # [P, D] f32

    rows = jnp.where(grp.keep[..., None], y[grp.position], 0.0)  # [T, k, D] f32, weighted
    return jnp.sum(rows, axis=1).astype(out_dtype or x.dtype)


# --------------------------------------------------------------------------------- jnp / XLA paths
def _dequant_stack(leaf) -> jax.Array:
    """INT4 leaf [E, N, K/4] -> float32 [E, N, K] (plain jnp)."""
    qweight, scale = leaf["qweight"], leaf["scale"]
    e, n, nwords = qweight.shape
    k = nwords * 4
    nib = (qweight.astype(jnp.int32)[..., None] >> (jnp.arange(4, dtype=jnp.int32) * 4)) & 0xF  # [E, N, K/4, 4]
    q = (nib - 8).astype(jnp.float32).reshape(e, n, k // GROUP_SIZE, GROUP_SIZE)
    return (q * scale.astype(jnp.float32)[..., None]).reshape(e, n, k)


def grouped_moe_w4a16_reference(x, experts, expert_ids, weights):
    """Plain jnp in float32: dequantize every expert, then einsum per (token, choice) -> [T, D] x.dtype.

    The test oracle for small shapes (materializes [E, N, K] float32; never use at K2 width)."""
    hp = lax.Precision.HIGHEST
    gate, up, down = (_dequant_stack(experts[n]) for n in ("gate", "up", "down"))  # [E,I,D],[E,I,D],[E,D,I]
    xf = x.astype(jnp.float32)
    g = jnp.einsum("td,tkid->tki", xf, gate[expert_ids], precision=hp)  # [T, k, I]
    u = jnp.einsum("td,tkid->tki", xf, up[expert_ids], precision=hp)
    y = jnp.einsum("tki,tkdi->tkd", jax.nn.silu(g) * u, down[expert_ids], precision=hp)  # [T, k, D]
    return jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32), precision=hp).astype(x.dtype)


def _expert_swiglu(x, experts, e, matmul):
    """SwiGLU of expert e (traced index) on x [M, D] via an XLA W4A16 matmul -> [M, D] in x.dtype."""
    leaf = lambda n: (experts[n]["qweight"][e], experts[n]["scale"][e])  # noqa: E731
    h = jax.nn.silu(matmul(x, *leaf("gate"))) * matmul(x, *leaf("up"))  # [M, I] x.dtype
    return matmul(h, *leaf("down"))  # [M, D]


_MATMULS = {"f32": w4a16_matmul_reference, "bf16": w4a16_matmul_xla_bf16}


def moe_w4a16_xla_touched(x, experts, expert_ids, weights, *, dequant: str = "f32", out_dtype=None):
    """XLA: loop over the distinct touched experts (ascending), each on all T tokens with its combine
    column (zero for tokens that did not choose it). Reads touched experts only; T-fold compute.

    With dequant="f32" this is, term for term, the model's per-expert INT4 loop with the untouched
    experts skipped (the impl="xla" path of the wrapper)."""
    matmul = _MATMULS[dequant]
    num_tokens, top_k = expert_ids.shape
    num_experts = experts["gate"]["qweight"].shape[0]
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], expert_ids].add(weights.astype(jnp.float32))  # [T, E]
    flat = jnp.where(weights != 0, expert_ids, num_experts).reshape(-1)
    size = min(num_experts, num_tokens * top_k)
    touched = jnp.unique(flat, size=size, fill_value=num_experts)  # [U] ascending, E = unused slot

    def step(out, e):
        def run(out):
            y = _expert_swiglu(x, experts, e, matmul)  # [T, D]
            return out + combine[:, e, None] * y.astype(jnp.float32)
        return lax.cond(e < num_experts, run, lambda o: o, out), None

    out, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), touched)
    return out.astype(out_dtype or x.dtype)


def moe_w4a16_xla_dense(x, experts, expert_ids, weights, *, dequant: str = "bf16"):
    """XLA baseline 'dense all experts': every expert on every token (reads all E experts)."""
    matmul = _MATMULS[dequant]
    num_tokens = x.shape[0]
    num_experts = experts["gate"]["qweight"].shape[0]
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], expert_ids].add(weights.astype(jnp.float32))  # [T, E]

    def step(out, e):
        return out + combine[:, e, None] * _expert_swiglu(x, experts, e, matmul).astype(jnp.float32), None

    out, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), jnp.arange(num_experts))
    return out.astype(x.dtype)


def moe_w4a16_xla_gather(x, experts, expert_ids, weights, *, dequant: str = "bf16"):
    """XLA baseline 'gather then dot': per assignment, gather its expert and run it on its one token
    (reads an expert once per assignment: T*k expert reads)."""
    matmul = _MATMULS[dequant]
    num_tokens, top_k = expert_ids.shape
    flat_e = expert_ids.reshape(-1)
    flat_w = weights.reshape(-1).astype(jnp.float32)

    def step(out, a):
        t = a // top_k
        y = _expert_swiglu(lax.dynamic_slice_in_dim(x, t, 1), experts, flat_e[a], matmul)  # [1, D]
        return out.at[t].add(flat_w[a] * y[0].astype(jnp.float32)), None

    out, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), jnp.arange(num_tokens * top_k))
    return out.astype(x.dtype)
