"""Pallas (Triton backend) front end of the tree build: per-depth top-K log-probs of drafter logits in one launch.

XLA runs `kdtree_jax.tree.top_log_probs` (top_k on the logits, then a logsumexp shift) as 4-6 kernels: a
max and a sum-exp reduction, a sort or TopK kernel, slices, a subtraction. Here one program per (batch row,
depth) holds its whole vocabulary row in registers (V <= MAX_FRONT_VOCAB) and, with no sort:

1. maps each logit to an order-preserving int32 key (the total order `lax.top_k` uses: -0.0 below +0.0);
2. finds the K-th largest key bit by bit, most significant first (32 counts of keys >= a candidate);
3. selects the keys above it and, of those equal to it, the lowest token ids (an exclusive cumsum), and
   writes them compacted, in token order, into the outputs;
4. after a barrier reads the K candidates back, ranks each by counting the candidates that beat it (larger
   key, or equal key and lower token id: lax.top_k's tie rule) in [K, C] tiles, and after another barrier
   writes each to its rank: the value (logit - logsumexp) and the token id.

The logsumexp comes in (`lse`, computed by XLA as `jax.nn.logsumexp`: values bit for bit those of
top_log_probs) or is computed here (`lse=None`: jax.nn.logsumexp's formula, max then sum of exp, in this
kernel's reduction order, so a value can differ from XLA's in the last bits; ranks and tokens cannot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tree_build.triton import INT32_MIN, _sortable, _unsortable, next_pow2

MAX_FRONT_VOCAB = 16384  # a row in registers: 64 values per thread at 8 warps
RANK_TILE = 4096  # candidate comparisons per rank tile


def front_warps(vocab: int) -> int:
    """Warps per program: about 16 row values per thread, 1..8 warps."""
    return max(1, min(8, next_pow2(vocab) // 512))


def _scatter(ref, idx, value, mask, size: int):
    """Masked scatter store. Masked-off lanes get index `size` (past the block): interpret mode stores every
    lane (masked ones write back what they read), so a masked lane must not share an index with a live one;
    XLA drops an out-of-range scatter, and on a GPU the mask stops it."""
    pltriton.store(ref.at[jnp.where(mask, idx, size)], value, mask=mask)


def _front_kernel(*refs, vocab: int, k: int, fused: bool, interpret: bool):
    if fused:
        x_ref, lp_ref, tok_ref = refs
    else:
        x_ref, lse_ref, lp_ref, tok_ref = refs
    ids = lax.broadcasted_iota(jnp.int32, (next_pow2(vocab),), 0)
    valid = ids < vocab
    x = pltriton.load(x_ref.at[ids], mask=valid, other=-jnp.inf).astype(jnp.float32)
    key = jnp.where(valid, _sortable(x), INT32_MIN)  # padding below every logit (-inf included)

    if fused:
        m = jnp.max(x)
        amax = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)  # jax.nn.logsumexp: a non-finite max shifts by 0
        lse = jnp.log(jnp.sum(jnp.exp(x - amax))) + amax
    else:
        lse = lse_ref[()]

    # the K-th largest key: the largest t with count(key >= t) >= K, built from the top bit down in the
    # unsigned image u = key ^ INT32_MIN (c is a candidate u; key >= c ^ INT32_MIN <=> u >= c)
    def bit(i, a):
        c = a | (jnp.int32(1) << (31 - i))
        count = jnp.sum((key >= (c ^ INT32_MIN)).astype(jnp.int32))
        return jnp.where(count >= k, c, a)

    kth = lax.fori_loop(0, 32, bit, jnp.int32(0)) ^ INT32_MIN
    above = key > kth
    tied = key == kth
    tied_before = jnp.cumsum(tied.astype(jnp.int32)) - tied.astype(jnp.int32)
    sel = above | (tied & (tied_before < k - jnp.sum(above.astype(jnp.int32))))
    pos = jnp.cumsum(sel.astype(jnp.int32)) - sel.astype(jnp.int32)
    # the outputs hold the candidates, compacted, until they are ranked
    _scatter(lp_ref, pos, lax.bitcast_convert_type(key, jnp.float32), sel, k)
    _scatter(tok_ref, pos, ids, sel, k)
    if not interpret:
        pltriton.debug_barrier()

    kp = next_pow2(k)
    slot = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    live = slot < k
    ck = lax.bitcast_convert_type(pltriton.load(lp_ref.at[slot], mask=live, other=0.0), jnp.int32)
    cid = pltriton.load(tok_ref.at[slot], mask=live, other=0)
    tile = max(1, min(kp, RANK_TILE // kp))

    def rank_tile(t, rank):
        j = t * tile + lax.broadcasted_iota(jnp.int32, (tile,), 0)
        j_live = j < k
        jk = lax.bitcast_convert_type(pltriton.load(lp_ref.at[j], mask=j_live, other=0.0), jnp.int32)
        jid = pltriton.load(tok_ref.at[j], mask=j_live, other=0)
        beats = (jk[None, :] > ck[:, None]) | ((jk[None, :] == ck[:, None]) & (jid[None, :] < cid[:, None]))
        return rank + jnp.sum((beats & j_live[None, :]).astype(jnp.int32), axis=1)

    rank = lax.fori_loop(0, pl.cdiv(k, tile), rank_tile, jnp.zeros((kp,), jnp.int32))
    if not interpret:
        pltriton.debug_barrier()  # every candidate is read before any is overwritten
    _scatter(lp_ref, rank, _unsortable(ck) - lse, live, k)
    _scatter(tok_ref, rank, cid, live, k)


@functools.partial(jax.jit, static_argnames=("k", "num_warps", "interpret"))
def top_log_probs_pallas(logits: jax.Array, k: int, lse: jax.Array | None = None, *, num_warps: int | None = None,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """logits [B, L, V] (any float dtype, V <= MAX_FRONT_VOCAB), k <= V; lse [B, L] float32 or None (computed
    here) -> (top_lp [B, L, K] float32 descending, equal logits lower token id first; top_tok [B, L, K] int32):
    `kdtree_jax.tree.top_log_probs` in one launch."""
    batch, depth_count, vocab = logits.shape
    if vocab > MAX_FRONT_VOCAB or not 1 <= k <= vocab:
        raise ValueError(f"need 1 <= k <= V <= {MAX_FRONT_VOCAB}, got k={k}, V={vocab}")
    fused = lse is None
    kernel = functools.partial(_front_kernel, vocab=vocab, k=k, fused=fused, interpret=interpret)
    rows = pl.BlockSpec((None, None, vocab), lambda b, d: (b, d, 0))
    in_specs = [rows] if fused else [rows, pl.BlockSpec((None, None), lambda b, d: (b, d))]
    out = pl.BlockSpec((None, None, k), lambda b, d: (b, d, 0))
    return pl.pallas_call(
        kernel,
        grid=(batch, depth_count),
        in_specs=in_specs,
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((batch, depth_count, k), jnp.float32),
                   jax.ShapeDtypeStruct((batch, depth_count, k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or front_warps(vocab), num_stages=1),
        interpret=interpret,
        name="ddtree_top_k",
    )(*((logits,) if fused else (logits, lse.astype(jnp.float32))))
