"""Pallas (Triton backend) body of the one-launch DDTree tree builder: the best-first heap, on chip.

One program per batch row (grid = (B,)). The program runs the heap of `reference/tree.py` literally,
`n_drafts` pops, with the frontier held in registers as F-long vectors (F = next power of two >= n_drafts):

  score  sortable int32 image of the float32 score (order-preserving bit trick; inactive = INT32_MIN)
  lex    the entry's position in the lexicographic order of rank tuples among the live entries
  node   depth (6 bits) | rank (10 bits) | parent slot (11 bits), packed in one int32
  pscore the parent's float32 score (a sibling's score is pscore + lp[depth - 1, rank + 1])

A pop is two reductions (max score, then min lex among equal scores: the heap's tie order) and two masked
reductions that read the popped entry's fields. Lexicographic positions stay exact without sorting: when
X = P + (r,) is popped, nothing lies between X and its next sibling P + (r + 1,) but X's own descendants,
and none exists yet, so X's first child and its next sibling go right after X (every later entry shifts
by the number pushed). The popped slot is reused by the first pushed entry, the second takes a new slot,
so F entries suffice for n_drafts pops (the last pop's pushes are never read).

Each pop writes its node (token, parent, depth, score) with scalar stores. After the loop the program
fills the visibility rows: zeros, a barrier, then L + 1 rounds of "mark my current ancestor, step to its
parent" (a gather from the parents just written, a scatter into the flat [T * T] visibility).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

INT32_MIN = -(2**31)
DEPTH_BITS, RANK_BITS, PARENT_BITS = 6, 10, 11  # node = parent << 16 | depth << 10 | rank
MAX_DEPTH = (1 << DEPTH_BITS) - 1  # 63 drafted positions (block size 64)
MAX_RANK = (1 << RANK_BITS) - 1  # K <= 1024
MAX_SLOT = (1 << PARENT_BITS) - 1  # T - 1 <= 2047
FILL_CHUNK = 1024  # visibility zero-fill: elements per store


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (for non-NaN values; -0.0 sorts just below +0.0)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _unsortable(s: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(s ^ ((s >> 31) & 0x7FFFFFFF), jnp.float32)


def _pack(parent, depth, rank):
    return (parent << (DEPTH_BITS + RANK_BITS)) | (depth << RANK_BITS) | rank


def _tree_build_kernel(lp_ref, tok_ref, root_ref, tokens_ref, parents_ref, depths_ref, scores_ref, vis_ref, *,
                       depth_count: int, k: int, n_drafts: int, slots: int, interpret: bool):
    """lp_ref / tok_ref [L, K] (one batch row; log-probs descending per depth, their token ids), root_ref [];
    outputs tokens / parents / depths / scores [T], vis_ref [T * T] int8 (row-major [T, T])."""
    f = next_pow2(n_drafts)
    lanes = lax.broadcasted_iota(jnp.int32, (f,), 0)

    # the root, slot 0; unused tail slots (only when fewer than `budget` nodes exist)
    tokens_ref[0] = root_ref[()]
    parents_ref[0] = jnp.int32(-1)
    depths_ref[0] = jnp.int32(0)
    scores_ref[0] = jnp.float32(0.0)
    if n_drafts + 1 < slots:
        tail = lax.broadcasted_iota(jnp.int32, (next_pow2(slots),), 0)
        tail_mask = (tail > n_drafts) & (tail < slots)
        zeros = jnp.zeros(tail.shape, jnp.int32)
        pltriton.store(tokens_ref.at[tail], zeros, mask=tail_mask)
        pltriton.store(parents_ref.at[tail], zeros - 1, mask=tail_mask)
        pltriton.store(depths_ref.at[tail], zeros, mask=tail_mask)
        pltriton.store(scores_ref.at[tail], jnp.full(tail.shape, -jnp.inf, jnp.float32), mask=tail_mask)

    # frontier: entry 0 = rank tuple (0,), score 0 + lp[0, 0], parent = the root
    first = jnp.float32(0.0) + lp_ref[0, 0]
    is0 = lanes == 0
    score = jnp.where(is0, _sortable(first), INT32_MIN)
    lex = jnp.where(is0, 0, -1)
    node = jnp.where(is0, _pack(0, 1, 0), 0)
    pscore = jnp.zeros((f,), jnp.float32)

    def pop(n, carry):
        score, lex, node, pscore, free = carry
        best = jnp.max(score)
        x = jnp.min(jnp.where(score == best, lex, jnp.int32(2**30)))  # lowest lex among equal scores
        sel = lex == x
        packed = jnp.max(jnp.where(sel, node, INT32_MIN))
        ps = jnp.max(jnp.where(sel, pscore, -jnp.inf))
        s = _unsortable(best)
        parent = packed >> (DEPTH_BITS + RANK_BITS)
        d = (packed >> RANK_BITS) & MAX_DEPTH
        r = packed & MAX_RANK

        tokens_ref[n] = tok_ref[d - 1, r]
        parents_ref[n] = parent
        depths_ref[n] = d
        scores_ref[n] = s

        has_child = d < depth_count
        has_sib = r + 1 < k
        child_s = s + lp_ref[jnp.minimum(d, depth_count - 1), 0]
        sib_s = ps + lp_ref[d - 1, jnp.minimum(r + 1, k - 1)]
        # first pushed entry (child if any, else sibling) reuses the popped slot, the sibling a new one
        a_score = jnp.where(has_child, _sortable(child_s), jnp.where(has_sib, _sortable(sib_s), INT32_MIN))
        a_lex = jnp.where(has_child | has_sib, x + 1, -1)
        a_node = jnp.where(has_child, _pack(n, d + 1, 0), _pack(parent, d, r + 1))
        a_ps = jnp.where(has_child, s, ps)
        two = has_child & has_sib
        new = (lanes == free) & two
        shift = has_child.astype(jnp.int32) + has_sib.astype(jnp.int32)
        lex = jnp.where(lex > x, lex + shift, lex)
        score = jnp.where(sel, a_score, jnp.where(new, _sortable(sib_s), score))
        lex = jnp.where(sel, a_lex, jnp.where(new, x + 2, lex))
        node = jnp.where(sel, a_node, jnp.where(new, _pack(parent, d, r + 1), node))
        pscore = jnp.where(sel, a_ps, jnp.where(new, ps, pscore))
        return score, lex, node, pscore, free + two.astype(jnp.int32)

    lax.fori_loop(1, n_drafts + 1, pop, (score, lex, node, pscore, jnp.int32(1)))

    # visibility: row i = i and its ancestors
    total = slots * slots

    def zero_fill(c, _):
        idx = c * FILL_CHUNK + lax.broadcasted_iota(jnp.int32, (FILL_CHUNK,), 0)
        pltriton.store(vis_ref.at[idx], jnp.zeros((FILL_CHUNK,), jnp.int8), mask=idx < total)
        return _

    lax.fori_loop(0, pl.cdiv(total, FILL_CHUNK), zero_fill, 0)
    if not interpret:
        pltriton.debug_barrier()  # zeros and the parents' scalar stores land before the rows are read/marked
    rows = lax.broadcasted_iota(jnp.int32, (next_pow2(slots),), 0)
    in_tree = rows < slots
    anc = jnp.where(in_tree, rows, -1)
    ones = jnp.ones(rows.shape, jnp.int8)
    for _ in range(depth_count + 1):  # a node's depth is <= L: L + 1 marks reach the root
        live = anc >= 0
        pltriton.store(vis_ref.at[rows * slots + jnp.maximum(anc, 0)], ones, mask=live)
        up = pltriton.load(parents_ref.at[jnp.maximum(anc, 0)], mask=live, other=-1)
        anc = jnp.where(live, up, -1)


@functools.partial(jax.jit, static_argnames=("budget", "n_drafts", "num_warps", "interpret"))
def tree_build_pallas(top_lp: jax.Array, top_tok: jax.Array, root_tokens: jax.Array, *, budget: int,
                      n_drafts: int, num_warps: int = 4, interpret: bool = False):
    """top_lp [B, L, K] float32 (descending per depth, ties by token id), top_tok [B, L, K] int32, root_tokens
    [B] int32 -> (tokens, parents, depths [B, T] int32, scores [B, T] float32, visible [B, T, T] bool),
    T = 1 + budget. Shapes are checked by the caller (pallas_kernels.tree_build.build_tree_from_top)."""
    batch, depth_count, k = top_lp.shape
    slots = 1 + budget
    kernel = functools.partial(_tree_build_kernel, depth_count=depth_count, k=k, n_drafts=n_drafts, slots=slots,
                               interpret=interpret)
    row = lambda b: (b, 0)  # noqa: E731
    lk = pl.BlockSpec((None, depth_count, k), lambda b: (b, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[lk, lk, pl.BlockSpec((None,), lambda b: (b,))],
        out_specs=[pl.BlockSpec((None, slots), row)] * 4 + [pl.BlockSpec((None, slots * slots), row)],
        out_shape=[jax.ShapeDtypeStruct((batch, slots), jnp.int32)] * 3
        + [jax.ShapeDtypeStruct((batch, slots), jnp.float32), jax.ShapeDtypeStruct((batch, slots * slots), jnp.int8)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_tree_build",
    )(top_lp, top_tok, root_tokens)
    tokens, parents, depths, scores, vis = out
    return tokens, parents, depths, scores, vis.reshape(batch, slots, slots).astype(bool)
