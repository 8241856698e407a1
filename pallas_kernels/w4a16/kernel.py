"""W4A16 GEMM body (Pallas, Triton backend) and its plain-jnp reference.

y[M, N] = x[M, K] @ dequant(W)^T with W given as the Int4Weight layout of `pallas_kernels.int4`:
qweight int16 [N, K/4] (nibble i of word w = column 4w+i, stored as q + 8), scale [N, K/32].

Design (swap-AB, split-K):
  - Each program owns a [block_n, block_m] tile of y^T: output features fill the MMA's wide M side,
    tokens (padded to >= 16, Triton's minimum dot size) the narrow side, so small batches waste little
    tensor-core work.
  - Grid (m_tiles, n_tiles, split_k): m is the fastest axis so programs sharing a weight tile run
    together and hit L2; split_k > 1 cuts K so that a small N (an expert's 2048) still yields enough
    programs for 132 SMs. Split partials are float32 [split_k, M, N], summed by XLA.
  - Per K step: int16 weight words [block_n, block_k/4] are loaded with evict_first (read once), each
    nibble is made into bf16 by the bit trick (nibble | 0x4300 is bf16 128 + q + 8; minus 136 gives q
    exactly, no int->float convert), times the group scale broadcast over 32 columns, then
    dot(w [block_n, block_k], x [block_m, block_k]^T) accumulates in float32.
The Triton backend is deprecated in JAX 0.11 but works; it was picked because it could be made correct
and measured in the time available (docs/int4.md has the Mosaic GPU plan).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

GROUP_SIZE = 32


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and Triton knobs. block_m/n/k powers of two; block_k >= 32 (one group)."""

    block_m: int = 16
    block_n: int = 128
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "magic"  # "magic": bf16 bit trick; "convert": int -> float32 convert, then scale

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"block_m={self.block_m} and block_n={self.block_n} must be >= 16 (Triton dot)")
        if self.block_k < GROUP_SIZE:
            raise ValueError(f"block_k={self.block_k} must be >= {GROUP_SIZE}")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k} must be >= 1")
        if self.dequant not in ("magic", "convert"):
            raise ValueError(f"dequant={self.dequant!r} must be 'magic' or 'convert'")


def _dequant_tile(words, scale, *, method: str, out_dtype):
    """words int16 [bn, bk/4], scale [bn, bk/32] -> W tile [bn, bk] in out_dtype."""
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


def _w4a16_kernel(x_ref, qw_ref, s_ref, o_ref, *, cfg: BlockConfig, k_per_split: int, compute_dtype):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m_idx, n_idx, s_idx = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = pl.multiple_of(m_idx * bm, bm)
    n0 = pl.multiple_of(n_idx * bn, bn)
    k_begin = s_idx * k_per_split
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def body(i, acc):
        k0 = pl.multiple_of(k_begin + i * bk, bk)
        x = pltriton.load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)])  # [bm, bk]
        words = pltriton.load(
            qw_ref.at[pl.ds(n0, bn), pl.ds(pl.multiple_of(k0 // 4, bk // 4), bk // 4)],
            eviction_policy="evict_first",
        )  # [bn, bk/4] int16
        scale = pltriton.load(s_ref.at[pl.ds(n0, bn), pl.ds(k0 // GROUP_SIZE, bk // GROUP_SIZE)])  # [bn, bk/32]
        w = _dequant_tile(words, scale, method=cfg.dequant, out_dtype=compute_dtype)  # [bn, bk]
        return acc + lax.dot_general(
            w, x.astype(compute_dtype), (((1,), (1,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )  # [bn, bm]

    acc = lax.fori_loop(0, k_per_split // bk, body, jnp.zeros((bn, bm), jnp.float32))
    o_ref[...] = acc.T.astype(o_ref.dtype)  # [bm, bn]


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def w4a16_matmul_pallas(x: jax.Array, qweight: jax.Array, scale: jax.Array, *, cfg: BlockConfig,
                        interpret: bool = False) -> jax.Array:
    """x [M, K] (bf16|f32) @ dequant(W)^T -> [M, N] in x.dtype. Shapes are checked by the wrapper."""
    m, k = x.shape
    n = qweight.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if n % bn or k % (bk * cfg.split_k):
        raise ValueError(f"N={n}, K={k} not tiled by block_n={bn}, block_k*split_k={bk * cfg.split_k}")
    m_pad = -(-m // bm) * bm
    if m_pad != m:
        # Zero rows past M: they only produce output rows that are sliced off below.
        x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    split = cfg.split_k
    out_dtype = jnp.float32 if split > 1 else x.dtype
    grid = (m_pad // bm, n // bn, split)
    kernel = functools.partial(_w4a16_kernel, cfg=cfg, k_per_split=k // split, compute_dtype=compute_dtype)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, m_pad, n), out_dtype),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3,
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"w4a16_bm{bm}_bn{bn}_bk{bk}_s{split}",
    )(x, qweight, scale)  # [split, m_pad, n]
    y = out[0] if split == 1 else jnp.sum(out, axis=0)
    return y[:m].astype(x.dtype)


def w4a16_matmul_reference(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> jax.Array:
    """Plain jnp: dequantize the leaf layout to float32, dot in float32 -> [M, N] in x.dtype.

    Also the XLA path (impl="xla") of the wrapper: XLA does not fuse the dequantization into the GEMM.
    """
    n, nwords = qweight.shape
    k = nwords * 4
    shifts = jnp.arange(4, dtype=jnp.int32) * 4
    nib = (qweight.astype(jnp.int32)[..., None] >> shifts) & 0xF  # [N, K/4, 4]
    q = (nib - 8).astype(jnp.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    w = (q * scale.astype(jnp.float32)[..., None]).reshape(n, k)  # [N, K]
    y = lax.dot_general(x.astype(jnp.float32), w, (((1,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def w4a16_matmul_xla_bf16(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> jax.Array:
    """XLA dequantize-to-x.dtype then dot: the realistic XLA baseline (bf16 weights, f32 accumulate)."""
    n, nwords = qweight.shape
    k = nwords * 4
    shifts = jnp.arange(4, dtype=jnp.int16) * 4
    nib = (qweight[..., None] >> shifts) & 0xF  # [N, K/4, 4]
    q = (nib - 8).astype(x.dtype).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    w = (q * scale.astype(x.dtype)[..., None]).reshape(n, k)  # [N, K]
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)
