"""Pallas (Triton backend) body of the one-launch DDTree tree builder: the best-first heap, on chip.

One program per batch row (grid = (B,)). The program runs the heap of `reference/tree.py` literally,
`n_drafts` pops, with the frontier held in registers as F-long vectors (F = next power of two >= n_drafts).
Both pop loops below order the frontier by (score descending, lexicographic position ascending), the heap's
order with its tie rule. Lexicographic positions stay exact without sorting: when X = P + (r,) is popped,
nothing lies between X and its next sibling P + (r + 1,) but X's own descendants, and none exists yet, so
X's first child and its next sibling go right after X (every later entry shifts by the number pushed).

pop="lex" (the first kernel): per lane a sortable int32 score, the lexicographic position, the node's
depth (6 bits) | rank (10 bits) | parent slot (11 bits) in one int32, and the parent's float32 score. A pop
is four reductions, three of them dependent (max score; min position among equal scores; the popped
entry's packed fields and parent score), then two loads that depend on them (the pushed entries' log-probs;
the sibling's is a new address nearly every pop). The popped lane takes the first pushed entry, the
second a new lane.

pop="key": lane p holds the one frontier entry whose parent is node p (a node's children are pushed one at
a time, each by its left sibling, so there is never more than one). Per lane: the sortable score; a low
word `inverted position | depth | rank` that decodes the popped entry; the sortable score of the entry's
next sibling, computed when the entry is pushed; the parent's score. A pop is two dependent int32 max
reductions (score, then the low word among equal scores: the largest inverted position is the lowest
lexicographic one), which the GPU does as single warp-wide `redux` instructions, then one load (the
child's log-prob, one of L addresses, cached); the parent slot is a third reduction nothing waits on. The
popped lane takes the sibling (its score precomputed), lane n the child; the next sibling's log-prob is
loaded for the lane's next pop. Positions are kept dense (0..live-1) so they fit the low word.

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

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
DEPTH_BITS, RANK_BITS, PARENT_BITS = 6, 10, 11  # pop="lex": node = parent << 16 | depth << 10 | rank
MAX_DEPTH = (1 << DEPTH_BITS) - 1  # 63 drafted positions (block size 64)
MAX_RANK = (1 << RANK_BITS) - 1  # K <= 1024
MAX_SLOT = (1 << PARENT_BITS) - 1  # T - 1 <= 2047
FILL_CHUNK = 1024  # visibility zero-fill: elements per store
POP_LOOPS = ("lex", "key")


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


def _write_node(refs, n, token, parent, depth, score):
    tokens_ref, parents_ref, depths_ref, scores_ref = refs
    tokens_ref[n] = token
    parents_ref[n] = parent
    depths_ref[n] = depth
    scores_ref[n] = score


def _lex_pops(lp_ref, tok_ref, refs, *, depth_count: int, k: int, n_drafts: int):
    f = next_pow2(n_drafts)
    lanes = lax.broadcasted_iota(jnp.int32, (f,), 0)
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
        _write_node(refs, n, tok_ref[d - 1, r], parent, d, s)

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


def _key_pops(lp_ref, tok_ref, refs, *, depth_count: int, k: int, n_drafts: int):
    f = next_pow2(n_drafts)  # lanes 0..n_drafts-1: the last pop's child (lane n_drafts) is never read
    lanes = lax.broadcasted_iota(jnp.int32, (f,), 0)
    r_bits = (k - 1).bit_length()
    d_bits = depth_count.bit_length()
    shift_pos = r_bits + d_bits  # low = inv << shift_pos | depth << r_bits | rank, inv = F - 1 - position
    r_mask, d_mask = (1 << r_bits) - 1, (1 << d_bits) - 1
    sib1 = min(1, k - 1)  # rank of a first child's next sibling (clamped: K = 1 has none)

    def low_word(inv, depth, rank):
        return (inv << shift_pos) | (depth << r_bits) | rank

    # lane 0 (parent = the root): rank tuple (0,); empty lanes: score INT32_MIN, low INT32_MAX (never
    # below a shift threshold, never equal to a popped low word)
    is0 = lanes == 0
    score = jnp.where(is0, _sortable(jnp.float32(0.0) + lp_ref[0, 0]), INT32_MIN)
    low = jnp.where(is0, low_word(f - 1, 1, 0), INT32_MAX)
    nxt = jnp.where(is0, _sortable(jnp.float32(0.0) + lp_ref[0, sib1]), INT32_MIN)
    pscore = jnp.zeros((f,), jnp.float32)

    def pop(n, carry):
        score, low, nxt, pscore = carry
        best = jnp.max(score)
        lo = jnp.max(jnp.where(score == best, low, -1))  # the lowest position among equal scores
        sel = low == lo
        parent = jnp.max(jnp.where(sel, lanes, -1))  # the lane is the parent; nothing below waits on it
        inv = lo >> shift_pos
        d = (lo >> r_bits) & d_mask
        r = lo & r_mask
        s = _unsortable(best)
        _write_node(refs, n, tok_ref[d - 1, r], parent, d, s)

        has_child = d < depth_count
        has_sib = r + 1 < k
        dc = jnp.minimum(d, depth_count - 1)
        child_s = s + lp_ref[dc, 0]
        # positions: the child takes the popped entry's, the sibling the next; later entries move by
        # (entries pushed - 1); inv < popped inv <=> position > popped position
        moved = has_child.astype(jnp.int32) + has_sib.astype(jnp.int32) - 1
        low = jnp.where(low < (inv << shift_pos), low - (moved << shift_pos), low)
        sib_low = jnp.where(has_sib, low_word(inv - has_child.astype(jnp.int32), d, r + 1), INT32_MAX)
        score = jnp.where(sel, jnp.where(has_sib, nxt, INT32_MIN), score)
        low = jnp.where(sel, sib_low, low)
        nxt = jnp.where(sel, _sortable(pscore + lp_ref[d - 1, jnp.minimum(r + 2, k - 1)]), nxt)
        at_n = (lanes == n) & has_child
        score = jnp.where(at_n, _sortable(child_s), score)
        low = jnp.where(at_n, low_word(inv, d + 1, 0), low)
        nxt = jnp.where(at_n, _sortable(s + lp_ref[dc, sib1]), nxt)
        pscore = jnp.where(at_n, s, pscore)
        return score, low, nxt, pscore

    lax.fori_loop(1, n_drafts + 1, pop, (score, low, nxt, pscore))


def _tree_build_kernel(lp_ref, tok_ref, root_ref, tokens_ref, parents_ref, depths_ref, scores_ref, vis_ref, *,
                       depth_count: int, k: int, n_drafts: int, slots: int, pop: str, interpret: bool):
    """lp_ref / tok_ref [L, K] (one batch row; log-probs descending per depth, their token ids), root_ref [];
    outputs tokens / parents / depths / scores [T], vis_ref [T * T] (row-major [T, T])."""
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

    pops = _lex_pops if pop == "lex" else _key_pops
    pops(lp_ref, tok_ref, (tokens_ref, parents_ref, depths_ref, scores_ref), depth_count=depth_count, k=k,
         n_drafts=n_drafts)

    # visibility: row i = i and its ancestors
    total = slots * slots

    def zero_fill(c, _):
        idx = c * FILL_CHUNK + lax.broadcasted_iota(jnp.int32, (FILL_CHUNK,), 0)
        pltriton.store(vis_ref.at[idx], jnp.zeros((FILL_CHUNK,), vis_ref.dtype), mask=idx < total)
        return _

    lax.fori_loop(0, pl.cdiv(total, FILL_CHUNK), zero_fill, 0)
    if not interpret:
        pltriton.debug_barrier()  # zeros and the parents' scalar stores land before the rows are read/marked
    rows = lax.broadcasted_iota(jnp.int32, (next_pow2(slots),), 0)
    in_tree = rows < slots
    anc = jnp.where(in_tree, rows, -1)
    ones = jnp.ones(rows.shape, vis_ref.dtype)
    for _ in range(depth_count + 1):  # a node's depth is <= L: L + 1 marks reach the root
        live = anc >= 0
        pltriton.store(vis_ref.at[rows * slots + jnp.maximum(anc, 0)], ones, mask=live)
        up = pltriton.load(parents_ref.at[jnp.maximum(anc, 0)], mask=live, other=-1)
        anc = jnp.where(live, up, -1)


@functools.partial(jax.jit, static_argnames=("budget", "n_drafts", "num_warps", "pop", "interpret"))
def tree_build_pallas(top_lp: jax.Array, top_tok: jax.Array, root_tokens: jax.Array, *, budget: int,
                      n_drafts: int, num_warps: int = 4, pop: str = "key", interpret: bool = False):
    """top_lp [B, L, K] float32 (descending per depth, ties by token id), top_tok [B, L, K] int32, root_tokens
    [B] int32 -> (tokens, parents, depths [B, T] int32, scores [B, T] float32, visible [B, T, T] bool),
    T = 1 + budget. Shapes are checked by the caller (pallas_kernels.tree_build.build_tree_from_top).

    pop="lex" writes the visibility as int8 (then one XLA convert to bool), as the first kernel did;
    pop="key" writes bool (stored as bytes), so the launch is the whole build."""
    if pop not in POP_LOOPS:
        raise ValueError(f"pop must be one of {POP_LOOPS}, got {pop!r}")
    batch, depth_count, k = top_lp.shape
    slots = 1 + budget
    vis_dtype = jnp.int8 if pop == "lex" else jnp.bool_
    kernel = functools.partial(_tree_build_kernel, depth_count=depth_count, k=k, n_drafts=n_drafts, slots=slots,
                               pop=pop, interpret=interpret)
    row = lambda b: (b, 0)  # noqa: E731
    lk = pl.BlockSpec((None, depth_count, k), lambda b: (b, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[lk, lk, pl.BlockSpec((None,), lambda b: (b,))],
        out_specs=[pl.BlockSpec((None, slots), row)] * 4 + [pl.BlockSpec((None, slots * slots), row)],
        out_shape=[jax.ShapeDtypeStruct((batch, slots), jnp.int32)] * 3
        + [jax.ShapeDtypeStruct((batch, slots), jnp.float32), jax.ShapeDtypeStruct((batch, slots * slots), vis_dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_tree_build",
    )(top_lp, top_tok, root_tokens)
    tokens, parents, depths, scores, vis = out
    return tokens, parents, depths, scores, vis.reshape(batch, slots, slots).astype(bool)
