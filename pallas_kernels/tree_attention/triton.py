"""Pallas (Triton backend) body of the tree-masked absorbed-MLA attention kernel.

Layout: the T tree tokens x H heads of one batch row are folded into R = T * H query rows
(row = t * H + h), cut into tiles of `block_rows`. Grid = (B, row tiles, KV splits). Each program
streams KV tiles of `block_kv` cache rows with an online softmax (float32 statistics, exp2 with
log2(e) folded into the scale) and keeps a [block_rows, c] float32 accumulator.

The KV range of batch row b is [0, start[b] + T):
  * full prefix tiles [0, start // block_kv) are visible to every query row: no mask at all;
    they are shared out among the splits;
  * the tail [block_kv * (start // block_kv), start + T) - the partial prefix tile plus the T tree
    rows, at most cdiv(block_kv - 1 + T, block_kv) tiles - is done by the LAST split with a
    per-row visibility mask read from `mask_rows` (built by the wrapper, never S long).

The Triton backend needs power-of-two tensor sizes, so the latent (c) and RoPE (r) parts of the
576-wide rows are loaded and multiplied as two separate dots.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Finite "minus infinity": exp2(NEG - x) == 0 for any real x, and NEG - NEG == 0 never yields NaN.
NEG = -1e30
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tiling of one kernel launch (see tuned.py for the tuned values).

    block_rows: query rows (tree tokens x heads) per program; 64 fills one wgmma M.
    block_kv: cache rows per inner-loop step (power of two, >= 16).
    num_splits: programs sharing one row tile's prefix; > 1 adds an LSE combine in XLA.
    num_warps / num_stages: Triton launch parameters (8 warps = 2 warpgroups share the
      [64, 512] f32 accumulator, as in FlashMLA).
    partial_dtype: dtype of the per-split normalized outputs when num_splits > 1.
    rescale_threshold: 0 = classic online softmax (rescale the accumulator every KV tile);
      tau > 0 = lazy rescale: keep the running max (log2 units) until some row's tile max exceeds
      it by more than tau, so most tiles skip the [block_rows, c] rescale; probabilities then
      reach at most 2**tau before normalization (exact in f32; tau <= 8 keeps bf16 p safe).
    """

    block_rows: int = 64
    block_kv: int = 64
    num_splits: int = 1
    num_warps: int = 8
    num_stages: int = 2
    partial_dtype: str = "float32"
    rescale_threshold: float = 0.0

    def __post_init__(self):
        for name in ("block_rows", "block_kv"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"BlockConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_splits < 1:
            raise ValueError(f"BlockConfig.num_splits must be >= 1, got {self.num_splits}")
        if self.partial_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"BlockConfig.partial_dtype must be float32 or bfloat16, got {self.partial_dtype!r}")
        if not 0.0 <= self.rescale_threshold <= 8.0:
            raise ValueError(f"BlockConfig.rescale_threshold must be in [0, 8], got {self.rescale_threshold}")


def _tree_attention_kernel(
    start_ref,  # [B] int32 (whole array)
    q_ref,  # [block_rows, c + r]
    cache_ref,  # [S_max, c + r] (this batch row's whole cache)
    mask_ref,  # [block_rows, W] int8, W = 2 * block_kv + T (see build_row_mask)
    *out_refs,  # single split: o [block_rows, c]; else o_part [block_rows, c], lse [block_rows]
    c: int,
    r: int,
    num_tree: int,
    scale_log2: float,
    block_kv: int,
    num_splits: int,
    rescale_threshold: float,
):
    b = pl.program_id(0)
    split = pl.program_id(2)
    start = start_ref[b]
    block_rows = q_ref.shape[0]

    q_c = q_ref[:, pl.ds(0, c)]  # [BR, c]
    q_r = q_ref[:, pl.ds(c, r)]  # [BR, r]
    # rows >= kv_end are garbage (maybe NaN): never loaded unmasked; never past the cache either,
    # whatever start a caller passes
    kv_end = jnp.minimum(start + num_tree, cache_ref.shape[0])

    def tile(k0, carry, masked: bool):
        acc, m, denom = carry  # [BR, c] f32, [BR] f32, [BR] f32
        if masked:
            kv_ok = (k0 + jnp.arange(block_kv)) < kv_end  # [BK]
            k_c = pltriton.load(
                cache_ref.at[pl.ds(k0, block_kv), pl.ds(0, c)],
                mask=jnp.broadcast_to(kv_ok[:, None], (block_kv, c)), other=0)  # [BK, c]
            k_r = pltriton.load(
                cache_ref.at[pl.ds(k0, block_kv), pl.ds(c, r)],
                mask=jnp.broadcast_to(kv_ok[:, None], (block_kv, r)), other=0)  # [BK, r]
            # Column block_kv + (k - start) of mask_rows: left pad = 1 (prefix), then the tree
            # mask, then 0 (past start + T). k0 >= start - block_kv + 1 keeps the index >= 1.
            visible = mask_ref[:, pl.ds(block_kv + k0 - start, block_kv)] != 0  # [BR, BK]
        else:
            k_c = cache_ref[pl.ds(k0, block_kv), pl.ds(0, c)]
            k_r = cache_ref[pl.ds(k0, block_kv), pl.ds(c, r)]
        s = jax.lax.dot_general(q_c, k_c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(q_r, k_r, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * scale_log2  # [BR, BK] logits in log2 units
        if masked:
            s = jnp.where(visible, s, NEG)
        m_tile = jnp.max(s, axis=1)  # [BR]
        if rescale_threshold > 0:
            def rescale(acc, m, denom):
                m_new = jnp.maximum(m, m_tile)
                alpha = jnp.exp2(m - m_new)
                return acc * alpha[:, None], m_new, denom * alpha

            grow = jnp.max(m_tile - m) > rescale_threshold  # one branch for the whole tile
            acc, m, denom = jax.lax.cond(grow, rescale, lambda acc, m, denom: (acc, m, denom), acc, m, denom)
        else:
            m_new = jnp.maximum(m, m_tile)
            alpha = jnp.exp2(m - m_new)
            acc, m, denom = acc * alpha[:, None], m_new, denom * alpha
        p = jnp.exp2(s - m[:, None])  # [BR, BK], <= 2**rescale_threshold
        if masked:
            # A row with nothing visible yet has m == NEG and would get p == 1 here.
            p = jnp.where(visible, p, 0.0)
        denom = denom + jnp.sum(p, axis=1)
        acc = acc + jnp.dot(p.astype(k_c.dtype), k_c, preferred_element_type=jnp.float32)
        return acc, m, denom

    carry = (
        jnp.zeros((block_rows, c), jnp.float32),
        jnp.full((block_rows,), NEG, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
    )
    n_full = start // block_kv
    per_split = (n_full + num_splits - 1) // num_splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_full)
    carry = jax.lax.fori_loop(lo, hi, lambda j, cr: tile(j * block_kv, cr, False), carry)
    n_tail = (kv_end - n_full * block_kv + block_kv - 1) // block_kv
    if num_splits > 1:
        n_tail = jnp.where(split == num_splits - 1, n_tail, 0)
    carry = jax.lax.fori_loop(0, n_tail, lambda j, cr: tile((n_full + j) * block_kv, cr, True), carry)
    acc, m, denom = carry

    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    else:
        o_ref, lse_ref = out_refs
        has = denom > 0
        o_ref[...] = (acc / jnp.where(has, denom, 1.0)[:, None]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(has, m + jnp.log2(jnp.where(has, denom, 1.0)), NEG)


def combine_splits(o_part, lse, dtype):
    """The split-KV combine (XLA) of both kernels: per-split normalized outputs o_part [B, NS, R, c] and their
    log2-sum-exp lse [B, NS, R] -> [B, R, c] in `dtype`, each split weighted by exp2(lse - max lse)."""
    w = jnp.exp2(lse - jnp.max(lse, axis=1, keepdims=True))  # the last split always sees the diagonal
    out = jnp.sum(o_part.astype(jnp.float32) * w[..., None], axis=1) / jnp.sum(w, axis=1)[..., None]
    return out.astype(dtype)


def build_row_mask(tree_mask, num_heads: int, rows_padded: int, block_kv: int):
    """[B, T, T] bool -> [B, rows_padded, 2 * block_kv + T] int8 per folded query row.

    Column block_kv + u holds tree_mask[b, t, u] for row t * H + h; the block_kv columns before it
    are 1 (the prefix rows of the tail tile) and the block_kv after it 0 (rows past start + T).
    """
    B, T, _ = tree_mask.shape
    rows = jnp.broadcast_to(tree_mask[:, :, None, :], (B, T, num_heads, T)).reshape(B, T * num_heads, T)
    rows = rows.astype(jnp.int8)
    rows = jnp.pad(rows, ((0, 0), (0, rows_padded - T * num_heads), (0, 0)))
    ones = jnp.ones((B, rows_padded, block_kv), jnp.int8)
    zeros = jnp.zeros((B, rows_padded, block_kv), jnp.int8)
    return jnp.concatenate([ones, rows, zeros], axis=2)


def tree_attention_pallas(q, cache, start, tree_mask, *, scale: float, value_dim: int,
                          config: BlockConfig, interpret: bool = False):
    """Pallas path. q [B, T, H, c + r], cache [B, S_max, c + r], start [B] i32, tree_mask [B, T, T]
    bool -> [B, T, H, c] in q.dtype. Shapes/dtypes are checked by the public wrapper."""
    B, T, H, D = q.shape
    S_max = cache.shape[1]
    c, r = value_dim, D - value_dim
    BR, BK, NS = config.block_rows, config.block_kv, config.num_splits
    R = T * H
    n_row_tiles = pl.cdiv(R, BR)
    R_pad = n_row_tiles * BR
    W = 2 * BK + T

    if S_max < BK:
        # Tiny caches (test models): a [BK, c + r] tile must exist for the (never executed)
        # unmasked-load path to trace. The extra rows lie past start + T: never visible, and the
        # tail loads mask them. Copies fewer than BK rows.
        cache = jnp.pad(cache, ((0, 0), (0, BK - S_max), (0, 0)))
        S_max = BK
    q_rows = q.reshape(B, R, D)  # [B, R, c + r], row = t * H + h
    if R_pad != R:  # only when T * H is not a multiple of block_rows (never for H = 64)
        q_rows = jnp.pad(q_rows, ((0, 0), (0, R_pad - R), (0, 0)))
    mask_rows = build_row_mask(tree_mask, H, R_pad, BK)  # [B, R_pad, W] int8

    kernel = functools.partial(
        _tree_attention_kernel, c=c, r=r, num_tree=T, scale_log2=float(scale) * LOG2E,
        block_kv=BK, num_splits=NS, rescale_threshold=config.rescale_threshold)
    in_specs = [
        pl.BlockSpec((B,), lambda b, i, s: (0,)),
        pl.BlockSpec((None, BR, D), lambda b, i, s: (b, i, 0)),
        pl.BlockSpec((None, S_max, D), lambda b, i, s: (b, 0, 0)),
        pl.BlockSpec((None, BR, W), lambda b, i, s: (b, i, 0)),
    ]
    if NS == 1:
        out_shape = [jax.ShapeDtypeStruct((B, R_pad, c), q.dtype)]
        out_specs = [pl.BlockSpec((None, BR, c), lambda b, i, s: (b, i, 0))]
    else:
        pdt = jnp.dtype(config.partial_dtype)
        out_shape = [jax.ShapeDtypeStruct((B, NS, R_pad, c), pdt),
                     jax.ShapeDtypeStruct((B, NS, R_pad), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, BR, c), lambda b, i, s: (b, s, i, 0)),
                     pl.BlockSpec((None, None, BR), lambda b, i, s: (b, s, i))]
    outs = pl.pallas_call(
        kernel,
        grid=(B, n_row_tiles, NS),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="tree_mla_attention",
    )(start.astype(jnp.int32), q_rows, cache, mask_rows)

    if NS == 1:
        out = outs[0]  # [B, R_pad, c]
    else:
        out = combine_splits(*outs, q.dtype)
    return out[:, :R].reshape(B, T, H, c)
