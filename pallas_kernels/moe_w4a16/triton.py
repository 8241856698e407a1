"""Grouped W4A16 MoE, Pallas Triton backend: the routed experts' SwiGLU over INT4 group-32 expert stacks.

out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert_ids[t, j]
with every expert weight an `Int4Weight` stacked over experts:
gate/up qweight int16 [E, I, D/4], scale [E, I, D/32]; down qweight int16 [E, D, I/4], scale [E, D, I/32].

Design (Pallas, Triton backend; the same swap-AB tile loop and bf16 bit-trick dequant as
`pallas_kernels.w4a16`, whose docs/int4.md explains why it is Triton and what Mosaic GPU would add):
  1. Grouping on device, static shapes (`grouping.group_assignments`): the T*k (token, choice) assignments are
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
Tiles: `MoEBlockConfig`, chosen by `tuned.default_config`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.int4 import GROUP_SIZE
from pallas_kernels.moe_w4a16.grouping import group_assignments


def _dequant_tile(words, scale, *, method: str, out_dtype):
    """words int16 [bn, bk/4], scale [bn, bk/32] -> W tile [bn, bk] in out_dtype. method "magic" (bf16 only): OR each
    nibble into the mantissa of bf16 128.0 and subtract 136 (q exact in bf16, no int -> float convert); else convert."""
    bn, nwords = words.shape
    bk = nwords * 4
    shifts = (lax.broadcasted_iota(jnp.int16, (1, 1, 4), 2) * 4).astype(jnp.int16)
    nib = lax.shift_right_logical(words.reshape(bn, nwords, 1), shifts) & jnp.int16(0xF)  # [bn, bk/4, 4]
    if method == "magic" and out_dtype == jnp.bfloat16:
        q = lax.bitcast_convert_type(nib | jnp.int16(0x4300), jnp.bfloat16) - jnp.bfloat16(136.0)
        q = q.reshape(bn, bk // GROUP_SIZE, GROUP_SIZE)  # [bn, G, 32], exact integers in bf16
        w = q * scale.astype(jnp.bfloat16).reshape(bn, bk // GROUP_SIZE, 1)
    else:
        q = (nib.astype(jnp.int32) - 8).astype(jnp.float32).reshape(bn, bk // GROUP_SIZE, GROUP_SIZE)
        w = q * scale.astype(jnp.float32).reshape(bn, bk // GROUP_SIZE, 1)
    return w.reshape(bn, bk).astype(out_dtype)


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

    x [T, D] bf16|f32; experts {"gate","up","down"} of stacked Int4Weight; expert_ids/weights [T, k];
    returns [T, D] in out_dtype (default x.dtype)."""
    num_tokens, hidden = x.shape
    num_experts, inter = experts["gate"].qweight.shape[:2]
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
    )(grp.tile_expert, x_rows, experts["gate"].qweight, experts["gate"].scale,
      experts["up"].qweight, experts["up"].scale)  # [P, I]

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
    )(grp.tile_expert, grp.row_weight, h, experts["down"].qweight, experts["down"].scale)  # [P, D] f32

    rows = jnp.where(grp.keep[..., None], y[grp.position], 0.0)  # [T, k, D] f32, weighted
    return jnp.sum(rows, axis=1).astype(out_dtype or x.dtype)


