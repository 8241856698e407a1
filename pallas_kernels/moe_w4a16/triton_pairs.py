"""Routed INT4 MoE for small expert stacks, Pallas Triton backend: one launch, one program per (token, choice).

out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert_ids[t, j]
with every expert weight a stacked `Int4Weight` (the checkpoint layout):
gate/up qweight int16 [E, I, D/4], scale [E, I, D/32]; down qweight int16 [E, D, I/4], scale [E, D, I/32].

Why a second Triton design beside `triton.py`: at a small model's shapes (the shipped pair: E 32, D 384, I 96,
top-4) the grouped kernel's device-side grouping (a sort, tile tables, gathers: ~30 XLA kernels) and XLA's own
"gather" form (3-5 kernels a layer, each (token, choice) pair a matvec over gathered, dequantized words) cost more
launches than the arithmetic is worth. Here nothing is grouped:
  grid (T * k,): program p owns pair (t, j) = (p // k, p % k); it loads x[t] and its expert's words once, in
  [32, block_k] tiles (I in 32-row chunks, D in block_k-column chunks), dequantizes in registers (int16
  nibbles -> float32, times the group scale) and does the three matvecs as multiply + row sums on the CUDA cores
  (one token: nothing for a tensor core to do), SwiGLU between them; it writes weights[t, j] * y [D] as float32
  row p. XLA sums the k rows of each token (one fusion with the residual add that follows). All loops are
  unrolled (Python loops over static tiles): a program's loads are independent and can all be in flight at once.
  A first version with lax.fori_loop steps ran each program as a chain of dependent loads: 33 us a call at any T
  on the H200 (benchmarks/results/moe_small_h200.md), 8x XLA's gather form at T = 1.
A pair of weight exactly 0 (another shard's expert in `moe_sharded`) reads nothing and writes zeros.
Every token's output is computed the same way whatever T is (no tile of one pair mixes tokens), so an AR step and
a tree verify compute a token's experts alike. Rounding as the per-expert W4A16 matmuls of the other paths:
gate / up / down outputs rounded to x.dtype, SwiGLU in float32 rounded to x.dtype.
Sizes: D and I multiples of 32 (dispatch.pairs_shape_unsupported); D tiles of 128, 64 or 32 (the largest dividing D).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.int4 import GROUP_SIZE
from pallas_kernels.w4a16.triton import _dequant_tile

BLOCK_I = 32  # rows of I per tile (one scale group of the down weight's input)
MAX_BLOCK = 128  # columns of D per tile at most (a [32, 128] float32 tile: 32 values a thread at 4 warps)


def block_k_for(hidden: int) -> int:
    """The D tile: the largest of 128 / 64 / 32 that divides D (D is a multiple of 32, the group size)."""
    return next(b for b in (MAX_BLOCK, 64, GROUP_SIZE) if hidden % b == 0)


def _pair_kernel(ids_ref, w_ref, x_ref, gq_ref, gs_ref, uq_ref, us_ref, dq_ref, ds_ref, y_ref, *, top_k: int,
                 hidden: int, inter: int, act_dtype):
    p = pl.program_id(0)
    expert = ids_ref[p]
    weight = w_ref[p]
    token = p // top_k
    bk = block_k_for(hidden)
    f32 = jnp.float32
    k_steps, i_chunks = range(0, hidden, bk), range(0, inter, BLOCK_I)

    def rounded(v):  # a matmul's output as the other paths round it: to the activation dtype
        return v.astype(act_dtype).astype(f32)

    def tile(q_ref, s_ref, r0, rows, c0, cols):  # W[e, r0:r0+rows, c0:c0+cols] dequantized, float32
        words = pltriton.load(q_ref.at[expert, pl.ds(r0, rows), pl.ds(c0 // 4, cols // 4)])  # [rows, cols/4]
        scale = pltriton.load(s_ref.at[expert, pl.ds(r0, rows), pl.ds(c0 // GROUP_SIZE, cols // GROUP_SIZE)])
        return _dequant_tile(words, scale, method="convert", out_dtype=f32)  # [rows, cols]

    @pl.when(weight != 0)
    def _():
        # Every loop is unrolled and no load depends on a computed value, so all of the pair's words can be in
        # flight at once (a pair's work is a few microseconds of load latency, not of bandwidth or arithmetic).
        x = [pltriton.load(x_ref.at[token, pl.ds(k0, bk)]).astype(f32) for k0 in k_steps]  # D in [bk] pieces
        hidden_chunks = []
        for i0 in i_chunks:  # gate / up: 32 rows of I at a time, D in bk-column tiles
            g = sum(jnp.sum(tile(gq_ref, gs_ref, i0, BLOCK_I, k0, bk) * xk[None, :], axis=1)
                    for k0, xk in zip(k_steps, x, strict=True))
            u = sum(jnp.sum(tile(uq_ref, us_ref, i0, BLOCK_I, k0, bk) * xk[None, :], axis=1)
                    for k0, xk in zip(k_steps, x, strict=True))
            g, u = rounded(g), rounded(u)
            hidden_chunks.append(rounded(g / (1.0 + jnp.exp(-g)) * u))  # [32] silu(g) * u
        for d0 in k_steps:  # down: D in bk-row tiles, each a sum over the I chunks (one scale group each)
            y = sum(jnp.sum(tile(dq_ref, ds_ref, d0, bk, i0, BLOCK_I) * h[None, :], axis=1)
                    for i0, h in zip(i_chunks, hidden_chunks, strict=True))
            pltriton.store(y_ref.at[p, pl.ds(d0, bk)], rounded(y) * weight)

    @pl.when(weight == 0)
    def _():
        for d0 in k_steps:
            pltriton.store(y_ref.at[p, pl.ds(d0, bk)], jnp.zeros((bk,), f32))


@functools.partial(jax.jit, static_argnames=("interpret", "out_dtype", "num_warps"))
def moe_w4a16_pairs(x, experts, expert_ids, weights, *, interpret: bool = False, out_dtype=None, num_warps: int = 8):
    """The one-launch pair kernel. x [T, D] bf16|f32; experts {"gate","up","down"} of stacked Int4Weight;
    expert_ids int32 / weights [T, k]. Returns [T, D] in out_dtype (default x.dtype): the k weighted rows of each
    token summed in float32. Shapes are checked by the public wrapper (`grouped_moe_w4a16`)."""
    num_tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    inter = experts["gate"].qweight.shape[1]
    pairs = num_tokens * top_k
    kernel = functools.partial(_pair_kernel, top_k=top_k, hidden=hidden, inter=inter, act_dtype=x.dtype)
    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    rows = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((pairs, hidden), jnp.float32),
        grid=(pairs,),
        in_specs=[anyspec] * 9,
        out_specs=anyspec,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"moe_w4a16_pairs_d{hidden}_i{inter}",
    )(expert_ids.reshape(pairs), weights.astype(jnp.float32).reshape(pairs), x,
      experts["gate"].qweight, experts["gate"].scale, experts["up"].qweight, experts["up"].scale,
      experts["down"].qweight, experts["down"].scale)  # [T*k, D] f32, weighted
    return rows.reshape(num_tokens, top_k, hidden).sum(axis=1).astype(out_dtype or x.dtype)
