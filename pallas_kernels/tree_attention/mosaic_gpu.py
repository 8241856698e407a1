"""Tree-masked absorbed-MLA attention on the Pallas Mosaic GPU backend (Hopper).

Same op as `reference.tree_mla_attention_reference` (see the package docstring for the visibility rule):
q [B, T, H, c + r], cache [B, S_max, c + r], start [B] int32, tree_mask [B, T, T] bool -> [B, T, H, c].

Layout: the T tree tokens x H heads of one batch row are folded into R = T * H query
rows (row = t * H + h), cut into tiles of 64 rows (one wgmma M). Grid (B, row tiles, KV splits), one CTA per
(batch row, row tile, split), `num_wg` = c / value_block consumer warpgroups per CTA:
  * the value (output) columns are cut into num_wg chunks of value_block (<= 256, so that a [64, value_block]
    float32 accumulator fits one warpgroup's registers: c = 512 needs 2 warpgroups, FlashMLA's O_L / O_R);
    warpgroup w owns output columns [w * value_block, (w + 1) * value_block);
  * the [64, block_kv] score tile S = q . row (the c latent columns as num_wg chunked wgmmas plus one RoPE
    wgmma) is computed by one of two schedules (`MosaicAttentionConfig.schedule`):
      "shared_qk" (default): warpgroup 0 alone computes S and the online softmax, and hands P (input dtype) and
        the row rescale to warpgroup 1 through SMEM (barriers p_ready / p_free); both then run their half of
        P @ V. The tensor cores do the QK^T once (1088 instead of 1664 multiply-adds per score at K2 widths):
        6-7% faster at S = 32768, T = 33 / 129 on the H200, the same at T = 1;
      "replicated": every warpgroup computes the whole S and its own softmax, no hand-off, twice the QK^T work
        (the T = 1 choice of tuned.mosaic_config, as measured there);
      (a third, "split_rows", each warpgroup the scores of half a tile's cache rows, was measured slower than
        these two on an H100 on 2026-12-05 and removed: docs/tree_attention.md)
  * the cache streams with TMA through a ring of `max_concurrent_steps` SMEM slots (latent columns in num_wg
    chunks + the RoPE columns, one barrier per copy). replicated: warpgroup 0 issues every copy and refills a
    slot once every warpgroup arrived on its "consumed" barrier; shared_qk: each warpgroup refills the chunk it
    read last (warpgroup 0 also the RoPE columns), right after its P @ V;
  * online softmax in float32 (exp2 with the scale and log2(e) in its argument's FMA; approximate exp2 / log2,
    `approx_math`: ex2.approx.ftz, one MUFU each), P cast to the input dtype for the
    value wgmma; replicated: fed from registers natively (p_operand "registers") or staged in SMEM ("smem",
    the only form jax 0.11's GPU interpreter simulates; the default picks by `interpret`); shared_qk: SMEM.

The KV range of batch row b is [0, start[b] + T):
  * full prefix tiles [0, start // block_kv) are visible to every query row: no mask at all; they are shared
    out among the splits;
  * the tail [block_kv * (start // block_kv), start + T), at most cdiv(block_kv - 1 + T, block_kv) tiles, is
    done by the last split with a per-row visibility mask: row i's tree row (token t = i // H) arrives as
    cdiv(T, 32) int32 bit words (bit u = tree_mask[b, t, u]) and is expanded in registers (T = 1, an AR step: no
    words at all, the token sees the prefix and itself, so no XLA op builds them); rows at or past
    start + T are masked, and their latent columns are zeroed in SMEM before any wgmma reads them (they may
    hold NaN, and 0 * NaN would reach the accumulator). A tail tile that would run past S_max is moved back
    to end at S_max (rows already done by the previous tile are masked), so no copy ever reads past the cache
    (S_max not a multiple of block_kv: the wrapper pads the cache, see tree_attention_mosaic).

num_splits > 1: each split writes its normalized partial output (in the input dtype: it is staged in the q chunk's
SMEM) and its float32 log2-sum-exp; an XLA combine (`combine_splits`) weights them by exp2(lse - the row's total).

Status: checked in Mosaic GPU interpret mode on CPU (tests/kernels/test_tree_attention_mgpu.py, tiny shapes, both
schedules), its CUDA lowering at K2 shapes (c 512, r 64, H 64), and natively on an H200 (the @gpu tests of that
file, both schedules; timed in benchmarks/results/tree_attention_mosaic_h200.md), and as it stands on an H100
(2026-12-06: the @gpu tests passed; timed in benchmarks/results/tree_attention_mosaic_h100_s27_*.md).
pallas_kernels.dispatch runs it where it was measured fastest (tuned.measured_fastest). What jax 0.11.2's GPU
interpreter cannot run, and so only the native tests cover: wgmma with A (P) from registers (interpret mode stages P
in SMEM) and accumulating into a carried accumulator with pl.run_state (interpret mode adds a fresh product in
registers instead, see `_accumulate`). Its race detector reported no race, but it also stays silent with the
cross-warpgroup sync of a tail tile removed, so the ordering between warpgroups is reasoned (and the native tests
pass), not proven.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.w4a16.mosaic_gpu import smem_transforms

LOG2E = math.log2(math.e)
# Finite "minus infinity": exp2(NEG - x) == 0 for any real x, and NEG - NEG == 0 never yields NaN.
NEG = -1e30
ROWS = 64  # query rows per CTA: one wgmma M
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SCHEDULES = ("shared_qk", "replicated")


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """block_kv: cache rows per pipeline step, a multiple of 64 (wgmma N of QK^T, K of PV).
    num_splits: CTAs sharing one row tile's prefix; > 1 adds an LSE combine in XLA.
    max_concurrent_steps: SMEM ring depth (KV tiles in flight), >= 1.
    value_block: output columns per warpgroup (None: min(c, 256)); c / value_block warpgroups, at most 2.
    p_operand: "registers" (wgmma A straight from registers; native only), "smem" (P staged in SMEM: the only
      form jax 0.11's GPU interpreter simulates; 16 KiB more SMEM, which c = 512 does not have at block_kv 64
      and depth 2), or None: registers natively, smem in interpret mode. Replicated schedule only.
    schedule: with two value warpgroups, "shared_qk" (warpgroup 0 computes the score tile and the softmax once and
      hands P and the row rescale to warpgroup 1 through SMEM) or "replicated" (each warpgroup computes the whole
      score tile itself, no hand-off). One warpgroup: the same kernel either way."""

    block_kv: int = 64
    num_splits: int = 1
    max_concurrent_steps: int = 2
    value_block: int | None = None
    p_operand: str | None = None
    schedule: str = "shared_qk"


def width_problem(c: int, r: int, *, native: bool) -> str | None:
    """Why the kernel cannot take latent width c and RoPE width r, or None; native: on the GPU (GPU interpret mode
    takes any row width). pallas_kernels.dispatch asks this before choosing the kernel."""
    if c % 64:
        return f"latent width {c} not a multiple of 64 (wgmma, 128 B swizzle)"
    if r < 16 or r & (r - 1):
        return f"RoPE width {r} not a power of two >= 16 (a TMA swizzle)"
    if native and (c + r) % 64:
        return f"row width c + r = {c + r} not a multiple of 64 (the TMA tiling of the cache rows; K2: 512 + 64)"
    return None


def _check(q, cache, start, tree_mask, value_dim, config: MosaicAttentionConfig, interpret) -> int:
    """Shape/dtype/config checks; returns value_block."""
    if q.ndim != 4 or cache.ndim != 3:
        raise ValueError(f"q must be [B, T, H, c + r] and cache [B, S_max, c + r], got {q.shape} and {cache.shape}")
    B, T, H, D = q.shape
    if cache.shape[0] != B or cache.shape[2] != D:
        raise ValueError(f"cache must be [B={B}, S_max, c + r = {D}], got shape {cache.shape}")
    if start.shape != (B,) or tree_mask.shape != (B, T, T) or tree_mask.dtype != jnp.bool_:
        raise ValueError(f"start must be [{B}] and tree_mask bool [{B}, {T}, {T}], got {start.shape} and "
                         f"{tree_mask.dtype}{tree_mask.shape}")
    if q.dtype != cache.dtype or jnp.dtype(q.dtype) not in _DTYPES:
        raise ValueError(f"the Mosaic GPU attention kernel takes bf16 or f16 q and cache of one dtype, got "
                         f"{q.dtype} and {cache.dtype}")
    if not 0 < value_dim < D:
        raise ValueError(f"value_dim must be in (0, {D}) (the latent part of the {D}-wide rows), got {value_dim}")
    c, r = value_dim, D - value_dim
    widths = f"the Mosaic GPU attention kernel cannot take these rows (c = value_dim = {c}, r = {r})"
    if why := width_problem(c, r, native=False):
        raise ValueError(f"{widths}: {why}")
    vb = config.value_block or min(c, 256)
    if vb % 64 or c % vb or c // vb > 2 or vb > 256:
        raise ValueError(f"value_block = {vb} must be a multiple of 64, <= 256, dividing c = {c} into 1 or 2 "
                         "warpgroups")
    if config.block_kv % 64 or not 64 <= config.block_kv <= 256:
        raise ValueError(f"block_kv = {config.block_kv} must be 64, 128, 192 or 256")
    if config.num_splits < 1 or config.max_concurrent_steps < 1:
        raise ValueError(f"num_splits ({config.num_splits}) and max_concurrent_steps "
                         f"({config.max_concurrent_steps}) must be >= 1")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {config.schedule!r}")
    if config.schedule == "shared_qk" and c // vb > 1 and config.p_operand == "registers":
        raise ValueError("p_operand='registers' is the replicated schedule's: shared_qk hands P over in SMEM")
    if config.p_operand not in (None, "smem", "registers"):
        raise ValueError(f"p_operand must be None, 'smem' or 'registers', got {config.p_operand!r}")
    if interpret and config.p_operand == "registers":
        raise ValueError("p_operand='registers' cannot run in GPU interpret mode: jax 0.11's interpreted wgmma "
                         "reads A from SMEM only; use p_operand='smem' there")
    if interpret is None and (why := width_problem(c, r, native=True)):  # GPU interpret mode takes any row width
        raise ValueError(f"{widths}: {why}")
    if T > cache.shape[1]:
        raise ValueError(f"T = {T} tree tokens cannot fit in S_max = {cache.shape[1]} cache rows")
    return vb


def tree_mask_bits(tree_mask, num_heads: int, rows_padded: int):
    """[B, T, T] bool -> [B, cdiv(T, 32), rows_padded] int32: bit u % 32 of word u // 32 of row t * H + h is
    tree_mask[b, t, u] (padding rows: 0)."""
    B, T, _ = tree_mask.shape
    words = -(-T // 32)
    m = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, 32 * words - T))).reshape(B, T, words, 32).astype(jnp.uint32)
    bits = jnp.sum(m << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)  # [B, T, words]
    bits = lax.bitcast_convert_type(bits, jnp.int32)
    rows = jnp.broadcast_to(bits[:, :, None, :], (B, T, num_heads, words)).reshape(B, T * num_heads, words)
    rows = jnp.pad(rows, ((0, 0), (0, rows_padded - T * num_heads), (0, 0)))
    return rows.transpose(0, 2, 1)  # [B, words, rows_padded]


def _accumulate(acc, a, b, interpret):
    """acc + a @ b on the tensor cores, float32. Natively the wgmma accumulates into `acc` itself, carried in
    registers (pl.run_state). jax 0.11's GPU interpreter runs neither pl.run_state nor stores into an
    accumulator, so there the product goes into a fresh zero accumulator and is added to `acc` in registers
    (the same sum, one more rounding per step; natively that would cost a second accumulator's registers)."""
    if interpret is None:
        def body(acc_ref):
            plgpu.wgmma(acc_ref, a, b)

        return pl.run_state(body)(plgpu.WGMMAAccumulatorRef.init(acc))

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return acc + pl.run_scoped(product, plgpu.WGMMAAccumulatorRef(acc.shape, jnp.float32))


def _make_kernel(*, c: int, r: int, num_tree: int, s_max: int, scale_log2: float, dtype, vb: int,
                 config: MosaicAttentionConfig, interpret):
    nwg = c // vb
    bk, ns, depth = config.block_kv, config.num_splits, config.max_concurrent_steps
    # T = 1 (an AR step) needs no mask words: the one tree token sees the prefix and itself (the mask's diagonal)
    words = -(-num_tree // 32) if num_tree > 1 else 0
    shared = config.schedule == "shared_qk" and nwg > 1
    p_register = not shared and (config.p_operand or ("registers" if interpret is None else "smem")) == "registers"
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(start_ref, q_ref, cache_ref, bits_ref, *out_refs, scratch):
        (qc_smem, qr_smem, kc_smem, kr_smem, p_smem, row_smem), (q_bar, kc_bar, kr_bar), consumed, sync, \
            p_ready, p_free = scratch
        # one row of float32 per query row: the rescale (shared_qk, in the loop), then warpgroup 0's final
        # denominator (shared_qk) and the log2-sum-exp staging (splits), when no warpgroup reads the rescale any more
        alpha_smem = denom_smem = lse_smem = row_smem
        b, tile, split = lax.axis_index("b"), lax.axis_index("tile"), lax.axis_index("split")
        wg = lax.axis_index("wg")
        row0 = tile * ROWS
        start = start_ref[b]
        kv_end = jnp.minimum(start + num_tree, s_max)
        n_full = start // bk
        per_split = (n_full + ns - 1) // ns
        lo = jnp.minimum(split * per_split, n_full)
        hi = jnp.minimum(lo + per_split, n_full)
        n_prefix = hi - lo
        n_tail = (kv_end - n_full * bk + bk - 1) // bk
        if ns > 1:
            n_tail = jnp.where(split == ns - 1, n_tail, 0)
        n_steps = n_prefix + n_tail

        def nominal_k0(step):  # first cache row of pipeline step `step` before the clamp
            return jnp.where(step < n_prefix, (lo + step) * bk, (n_full + step - n_prefix) * bk)

        def actual_k0(step):  # a tail tile never runs past the cache: it is moved back to end at S_max
            return jnp.minimum(nominal_k0(step), s_max - bk)

        def issue_chunk(step, j):  # TMA of latent chunk j of KV tile `step` into slot step % depth
            slot = lax.rem(step, depth)
            plgpu.copy_gmem_to_smem(cache_ref.at[b, pl.ds(actual_k0(step), bk), pl.ds(j * vb, vb)],
                                    kc_smem.at[slot, j], kc_bar.at[slot * nwg + j])

        def issue_rope(step):
            slot = lax.rem(step, depth)
            plgpu.copy_gmem_to_smem(cache_ref.at[b, pl.ds(actual_k0(step), bk), pl.ds(c, r)], kr_smem.at[slot],
                                    kr_bar.at[slot])

        def issue(step):  # the whole tile
            for j in range(nwg):
                issue_chunk(step, j)
            issue_rope(step)

        @pl.when(wg == 0)
        def _():
            for j in range(nwg):
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, ROWS), pl.ds(j * vb, vb)], qc_smem.at[j],
                                        q_bar.at[j])
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, ROWS), pl.ds(c, r)], qr_smem, q_bar.at[nwg])
            for s in range(depth):
                pl.when(s < n_steps)(functools.partial(issue, s))

        if shared:
            @pl.when(wg == 0)
            def _():
                for j in range(nwg + 1):
                    plgpu.barrier_wait(q_bar.at[j])
        else:
            for j in range(nwg + 1):
                plgpu.barrier_wait(q_bar.at[j])

        word_rows = [plgpu.load(bits_ref.at[b, w, pl.ds(row0, ROWS)], layout=row_layout,
                                optimized=False) for w in range(words)]

        def wait_tile(slot):
            for j in range(nwg):
                plgpu.barrier_wait(kc_bar.at[slot * nwg + j])
            plgpu.barrier_wait(kr_bar.at[slot])

        def visibility(step, k0):
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=wgmma_layout) + k0  # cache row
            # rows already covered by the previous tile (a clamped last tile) or >= start + T: never
            rel = col - start  # position in the tree, < 0 for the prefix
            if not words:  # T = 1: the prefix and the token itself
                return (rel <= 0) & (col >= nominal_k0(step))
            # the mask word of each column's tree position (a select per word), then one shift: rel // 32 picks
            # the word, rel % 32 the bit (positions outside [0, T) pick some word; the range test drops them)
            word_of = lax.shift_right_arithmetic(rel, 5)
            word = lax.broadcast_in_dim(word_rows[0], (ROWS, bk), [0])
            for w in range(1, words):
                word = jnp.where(word_of == w, lax.broadcast_in_dim(word_rows[w], (ROWS, bk), [0]), word)
            bit = lax.shift_right_logical(word, rel & 31) & 1
            tree = (rel >= 0) & (rel < num_tree) & (bit != 0)
            return ((rel < 0) | tree) & (col >= nominal_k0(step))

        def zero_garbage(chunk, k0):
            # Zero the latent columns of rows >= kv_end (garbage, maybe NaN: 0 * NaN in the value wgmma would
            # poison the accumulator). (NaN RoPE columns only reach masked scores, which the select replaces.)
            kv_rows = plgpu.broadcasted_iota(jnp.int32, (bk, vb), 0, layout=wgmma_layout) + k0
            chunk[...] = jnp.where(kv_rows < kv_end, plgpu.load(chunk, layout=wgmma_layout), jnp.zeros((), dtype))

        def scores(slot):  # [64, bk] float32, unscaled (q . row; softmax_step applies the scale)
            def qk(acc_ref):
                for j in range(nwg):
                    plgpu.wgmma(acc_ref, qc_smem.at[j], kc_smem.at[slot, j].T)
                plgpu.wgmma(acc_ref, qr_smem, kr_smem.at[slot].T)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            return pl.run_scoped(qk, plgpu.WGMMAAccumulatorRef((ROWS, bk), jnp.float32))

        def softmax_step(s, m, denom, visible):
            """Online softmax of one tile of unscaled scores s (m: the rows' running maximum of them; the scale is
            positive, so it commutes with the maximum): (p float32, m_new, alpha, denom_new). The scale and log2(e)
            multiply inside each exp2's argument, s * c - m * c, one FMA an element instead of a scaling pass."""
            if visible is not None:
                s = jnp.where(visible, s, NEG)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2((m - m_new) * scale_log2)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new * scale_log2, s.shape, [0]))
            if visible is not None:  # a row with nothing visible yet has m_new == NEG and would get p == 1
                p = jnp.where(visible, p, 0.0)
            return p, m_new, alpha, denom * alpha + p.sum(axis=1)

        def step_replicated(step, carry, masked: bool):
            acc, m, denom = carry
            slot = lax.rem(step, depth)
            wait_tile(slot)
            k0 = actual_k0(step)
            visible = None
            if masked:
                visible = visibility(step, k0)

                @pl.when(k0 + bk > kv_end)  # only the tile that reaches past the KV range holds garbage rows
                def _():
                    # each warpgroup zeroes its own chunk; the sync keeps every warpgroup's QK^T reads of the tile
                    # after all the zeroing
                    zero_garbage(kc_smem.at[slot, wg], k0)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(sync)
                    plgpu.barrier_wait(sync)
            p, m_new, alpha, denom = softmax_step(scores(slot), m, denom, visible)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            if not p_register:
                p_smem.at[wg][...] = p16
                plgpu.commit_smem()
                p_in = p_smem.at[wg]
            else:
                p_in = p16

            acc = _accumulate(acc, p_in, kc_smem.at[slot, wg], interpret)
            plgpu.barrier_arrive(consumed.at[slot])

            @pl.when((wg == 0) & (step + depth < n_steps))
            def _():
                plgpu.barrier_wait(consumed.at[slot])  # every warpgroup is done with this slot
                issue(step + depth)

            return acc, m_new, denom

        def step_shared(step, carry, masked: bool):
            acc, m, denom = carry  # m, denom: warpgroup 0's softmax state (the others carry it unused)
            slot = lax.rem(step, depth)

            def score_and_hand_off(m, denom):  # warpgroup 0: the score tile, the softmax, P and the rescale out
                wait_tile(slot)
                k0 = actual_k0(step)
                visible = None
                if masked:
                    visible = visibility(step, k0)

                    @pl.when(k0 + bk > kv_end)  # only the tile that reaches past the KV range holds garbage rows
                    def _():
                        for j in range(nwg):  # warpgroup 0 zeroes every chunk: it reads them all first (QK^T)
                            zero_garbage(kc_smem.at[slot, j], k0)
                        plgpu.commit_smem()
                p, m_new, alpha, denom = softmax_step(scores(slot), m, denom, visible)

                @pl.when(step > 0)
                def _():
                    plgpu.barrier_wait(p_free)  # the other warpgroups are done with the previous P

                p_smem[...] = p.astype(dtype)
                alpha_smem[...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
                return m_new, denom

            m, denom = lax.cond(wg == 0, score_and_hand_off, lambda m, denom: (m, denom), m, denom)

            @pl.when(wg != 0)
            def _():
                plgpu.barrier_wait(p_ready)

            alpha = plgpu.load(alpha_smem, layout=row_layout, optimized=False)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            acc = _accumulate(acc, p_smem, kc_smem.at[slot, wg], interpret)

            @pl.when(wg != 0)
            def _():
                plgpu.barrier_arrive(p_free)

            # Each warpgroup refills what it read last: its latent chunk (warpgroup 0 also the RoPE columns,
            # which only its QK^T reads), so no warpgroup waits for another before the next tile's loads.
            for j in range(nwg):
                @pl.when((wg == j) & (step + depth < n_steps))
                def _(j=j):
                    issue_chunk(step + depth, j)
                    if j == 0:
                        issue_rope(step + depth)

            return acc, m, denom

        acc0 = plgpu.layout_cast(jnp.zeros((ROWS, vb), jnp.float32), wgmma_layout)
        carry = (acc0, plgpu.layout_cast(jnp.full((ROWS,), NEG, jnp.float32), row_layout),
                 plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout))
        if shared:
            carry = lax.fori_loop(0, n_prefix, functools.partial(step_shared, masked=False), carry)
            acc, m, denom = lax.fori_loop(n_prefix, n_steps, functools.partial(step_shared, masked=True), carry)

            @pl.when(wg == 0)
            def _():
                @pl.when(n_steps > 0)
                def _():  # observe the last P release too (never left pending, as the interpreter checks)
                    plgpu.barrier_wait(p_free)

                denom_smem[...] = denom  # for the other warpgroups' normalization
                plgpu.commit_smem()

            plgpu.barrier_arrive(sync)  # warpgroup 0's denominator is in SMEM, its last QK^T done
            plgpu.barrier_wait(sync)
            denom = plgpu.load(denom_smem, layout=row_layout, optimized=False)
        else:
            carry = lax.fori_loop(0, n_prefix, functools.partial(step_replicated, masked=False), carry)
            acc, m, denom = lax.fori_loop(n_prefix, n_steps, functools.partial(step_replicated, masked=True), carry)

            @pl.when(wg == 0)
            def _():  # observe the last `depth` consumed phases too (never left pending, as the interpreter checks)
                @pl.loop(jnp.maximum(n_steps - depth, 0), n_steps)
                def _(step):
                    plgpu.barrier_wait(consumed.at[lax.rem(step, depth)])

        # Rows with nothing visible (denom == 0) occur only in a split that got no prefix tiles: lse = NEG.
        has = denom > 0
        # one reciprocal a row, then a multiply an element (a division an element is ~5 instructions each)
        out = acc * lax.broadcast_in_dim(1.0 / jnp.where(has, denom, 1.0), acc.shape, [0])
        # The output is staged in this warpgroup's q chunk (SMEM is tight at c = 512: 72 KiB of q + 2 x 72 KiB
        # of cache ring); a sync keeps it after every warpgroup's last QK^T read of the q chunks (shared_qk: the
        # one above).
        if not shared:
            plgpu.barrier_arrive(sync)
            plgpu.barrier_wait(sync)
        o_smem = qc_smem
        o_smem.at[wg][...] = out.astype(dtype)
        cols = pl.ds(wg * vb, vb)
        if ns == 1:
            (o_ref,) = out_refs
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[b, pl.ds(row0, ROWS), cols])
        else:
            o_ref, lse_ref = out_refs
            if shared:  # every warpgroup has read the denominator that the lse now overwrites
                plgpu.barrier_arrive(sync)
                plgpu.barrier_wait(sync)

            @pl.when(wg == 0)
            def _():
                lse_smem[...] = jnp.where(has, m * scale_log2 + jnp.log2(jnp.where(has, denom, 1.0)), NEG)

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[b, split, pl.ds(row0, ROWS), cols])

            @pl.when(wg == 0)
            def _():
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, pl.ds(row0, ROWS)])

        # The CTA may exit once the copies have read their SMEM; their global writes complete before any later
        # kernel reads them (the kernel boundary), as jax's own Hopper matmul ends. Waiting for the writes too held
        # each CTA ~6.5% of its time at exit (the T = 1 profile, benchmarks/results/tree_attention_t1_ncu_h100_s24.md).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def entry(start_ref, q_ref, cache_ref, *refs):
        bits_ref, out_refs = (refs[0], refs[1:]) if words else (None, refs)  # T = 1: no mask words
        if shared:  # one P tile, written by warpgroup 0, read by all
            p_buf = plgpu.SMEM((ROWS, bk), dtype, transforms=smem_transforms(bk, dtype))
        elif p_register:
            p_buf = None
        else:
            p_buf = plgpu.SMEM((nwg, ROWS, bk), dtype, transforms=smem_transforms(bk, dtype))
        smem = (
            plgpu.SMEM((nwg, ROWS, vb), dtype, transforms=smem_transforms(vb, dtype)),  # q latent chunks
            plgpu.SMEM((ROWS, r), dtype, transforms=smem_transforms(r, dtype)),  # q RoPE part
            plgpu.SMEM((depth, nwg, bk, vb), dtype, transforms=smem_transforms(vb, dtype)),  # cache latent ring
            plgpu.SMEM((depth, bk, r), dtype, transforms=smem_transforms(r, dtype)),  # cache RoPE ring
            p_buf,
            plgpu.SMEM((ROWS,), jnp.float32),  # see alpha_smem
        )
        barriers = (plgpu.Barrier(num_barriers=nwg + 1), plgpu.Barrier(num_barriers=depth * nwg),
                    plgpu.Barrier(num_barriers=depth))
        pl.run_scoped(
            lambda *scratch: kernel(start_ref, q_ref, cache_ref, bits_ref, *out_refs, scratch=scratch),
            smem, barriers,
            plgpu.Barrier(num_arrivals=nwg, num_barriers=depth),  # consumed (replicated)
            plgpu.Barrier(num_arrivals=nwg),  # sync
            plgpu.Barrier(num_arrivals=1),  # p_ready (shared_qk): warpgroup 0 wrote P and the rescale
            plgpu.Barrier(num_arrivals=max(nwg - 1, 1)),  # p_free (shared_qk): the others are done with P
            collective_axes="wg",
        )

    return entry, nwg


def combine_splits(o_part, lse, dtype):
    """The split-KV combine (XLA): per-split normalized outputs o_part [B, NS, R, c] and their log2-sum-exp
    lse [B, NS, R] -> [B, R, c] in `dtype`: the softmax-weighted mean of the splits, each weighted by exp2(lse).

    Two stages: each row's total log2-sum-exp over the splits first (a log-add-exp reduction over the small [B, NS,
    R] LSEs, which XLA keeps to one reduction kernel), then the weighted sum of the partials with exp2(lse - total),
    whose weights sum to 1, so no division follows. Measured fastest of three forms (bench_tree_attention.py
    --combine, H100, 64 rows x 512, tree_attention_combine_h100.md): 6.8 us at 128 splits in 3 kernels against 8.9 in
    5 for max / exp2 weights / their sum / weighted sum / division, and 15.5 for one variadic reduction carrying
    (lse, output) pairs (two kernels, but the merge's exp2, log2 and reciprocal per element of the partials cost more
    than the launches it saves). The identity of the log-add is a finite NEG, so that two empty operands never
    compute -inf - -inf; a row no split saw (lse NEG everywhere: a padded row) sums its partials, which are 0."""

    def log2_add(a, b):
        m = jnp.maximum(a, b)
        return m + jnp.log2(jnp.exp2(a - m) + jnp.exp2(b - m))

    total = lax.reduce(lse, jnp.float32(NEG), log2_add, (1,))  # [B, R]
    weights = jnp.exp2(lse - total[:, None])  # [B, NS, R], summing to 1 over the splits
    return jnp.sum(o_part.astype(jnp.float32) * weights[..., None], axis=1).astype(dtype)


def tree_attention_mosaic(q, cache, start, tree_mask, *, scale: float, value_dim: int,
                          config: MosaicAttentionConfig = MosaicAttentionConfig(), interpret=None):
    """Mosaic GPU path. q [B, T, H, c + r] bf16/f16, cache [B, S_max, c + r] same dtype, start [B] int,
    tree_mask [B, T, T] bool -> [B, T, H, c] in q.dtype. interpret: None (native, Hopper) or
    InterpretGPUParams (`pallas_kernels.w4a16.mosaic_gpu.gpu_interpret_params()`, CPU). Value checks
    (start + T <= S_max, diagonal) are the caller's, as for `tree_mla_attention`; at T = 1 tree_mask is not read
    (its one entry is the diagonal)."""
    q, cache, start, tree_mask = map(jnp.asarray, (q, cache, start, tree_mask))
    vb = _check(q, cache, start, tree_mask, value_dim, config, interpret)
    if not float(scale) > 0:  # the running maximum is taken of unscaled scores: the scale must keep their order
        raise ValueError(f"scale must be a positive number (the softmax scale), got {scale}")
    B, T, H, D = q.shape
    c, r = value_dim, D - value_dim
    bk, ns = config.block_kv, config.num_splits
    S_max = cache.shape[1]
    if S_max % bk:
        # Mosaic GPU's layout inference must prove every TMA row offset a multiple of the SMEM tiling; the last tail
        # tile's offset is S_max - block_kv, so S_max is padded to a multiple of block_kv (also: a whole tile must
        # exist). The extra rows lie past start + T (never visible, zeroed). The pad copies the cache: callers that
        # care allocate S_max as a multiple of 64.
        cache = jnp.pad(cache, ((0, 0), (0, -S_max % bk), (0, 0)))
        S_max = cache.shape[1]
    R = T * H
    n_tiles = -(-R // ROWS)
    R_pad = n_tiles * ROWS
    q_rows = q.reshape(B, R, D)  # row = t * H + h
    if R_pad != R:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, R_pad - R), (0, 0)))
    # [B, words, R_pad] int32; none at T = 1 (an AR step: no XLA op builds them, the kernel reads none)
    bits = (tree_mask_bits(tree_mask, H, R_pad),) if T > 1 else ()

    entry, nwg = _make_kernel(c=c, r=r, num_tree=T, s_max=S_max, scale_log2=float(scale) * LOG2E,
                              dtype=q.dtype, vb=vb, config=config, interpret=interpret)
    if ns == 1:
        out_type = jax.ShapeDtypeStruct((B, R_pad, c), q.dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((B, ns, R_pad, c), q.dtype),
                    jax.ShapeDtypeStruct((B, ns, R_pad), jnp.float32))
    f = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(B, n_tiles, ns),
        grid_names=("b", "tile", "split"),
        num_threads=nwg,
        thread_name="wg",
        interpret=interpret,
        # The row reductions (max, sum over a score tile's columns) stay inside a warp in the WGMMA layout and need
        # no SMEM scratch; the default reserves 2 KiB for cross-warp ones, which the shared_qk schedule's P tile
        # needs at c = 512 (it would exceed the 227 KiB by 112 B). A reduction that did need scratch fails to lower.
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0, approx_math=True),
    )
    outs = f(start.astype(jnp.int32), q_rows, cache, *bits)
    if ns == 1:
        out = outs
    else:
        out = combine_splits(*outs, q.dtype)  # [B, ns, R_pad, c] partials, [B, ns, R_pad] log2 LSEs
    return out[:, :R].reshape(B, T, H, c)
