"""The Mosaic GPU (plgpu) W4A16 group-32 GEMM for Hopper: the tile loop y^T = dequant(W) @ x^T over one block_n
slice of W, with W a `MosaicInt4Weight` (int4 [N, K] in lane order, bf16 scales [K/32, N]), shared by the routed
MoE kernel (`pallas_kernels.moe_w4a16.mosaic_gpu`), and the dense GEMM on it (`w4a16_matmul_mgpu_kernel`: the
model's INT4 dense linears, chosen by `pallas_kernels.dispatch.choose_linear`).

"Swap AB": the weights are the wgmma A operand (block_n output features per CTA) and the tokens are the
narrow wgmma N dimension (an Mp-row tile, M rounded up to a multiple of 8; the dense kernel reads it past row M < 8,
which the TMA fills with zeros), so tiny decode batches waste no tensor-core rows.
Grid: one CTA (one warpgroup) per block_n rows of W; inside it emit_pipeline streams, per K step, an int4
[block_n, block_k] weight tile, a bf16 [Mp, block_k] activation tile and the bf16 [block_k/32, block_n]
scales into SMEM with TMA. The warpgroup loads the int4 tile with the WGMMA_UPCAST_4X layout (a 32-bit word of 8
nibbles a thread), turns it into bf16 in the WGMMA layout with no data movement between threads
(`dequantize_lane_order`: the weight's lane order puts each thread's WGMMA pairs in its own word), multiplies each
32-column group (a static register slice) by its scale row broadcast along K, and issues wgmma with A from
registers (or, for GPU interpret mode, staged through SMEM) and B = the transposed activation tile, accumulating f32.
block_k >= 64 because the smallest TMA swizzle Mosaic accepts is 32 B (= 64 int4).

Dense split-K: a weight with few block_n slices (N = 2048 is 32 CTAs on 132 SMs) also splits K; each CTA writes
its float32 partial [block_n, Mp] and XLA sums the split_k partials. A weight with more slices than SMs but not a
multiple of them (N = 18432: 288 slices, 2.18 an SM) runs whole-K CTAs for the slices that divide evenly (264) and
split-K CTAs for the rest, in the same launch (`whole_tiles`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.int4 import GROUP_SIZE, from_lane_order


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """block_n: weight rows (output features) per CTA, a multiple of 64 (the wgmma M).
    block_k: K per pipeline step, a multiple of 64 (an int4 row of 32 B is the smallest swizzle).
    max_concurrent_steps: pipeline depth (SMEM buffers in flight).
    a_operand: "registers" (the fast path: dequantized weights are wgmma register-A) or "smem" (stage them
      in SMEM first; the only form jax 0.11's GPU interpret mode can simulate).
    Group scales: the dequantized [block_n, block_k] register tile is cut into static [block_n, 32] slices
    (register subsets of the WGMMA layout: no data moves), each multiplied by its group's broadcast row."""
    block_n: int = 64
    block_k: int = 64
    max_concurrent_steps: int = 4
    a_operand: str = "registers"

    @classmethod
    def parse(cls, text: str) -> MgpuConfig:
        """A tiling written as colon-separated fields, e.g. "bn64:bk256:s4" or "bn128:bk128:s3:smem":
        bnN block_n, bkN block_k, sN max_concurrent_steps, and the words registers / smem (a_operand).
        Unnamed fields keep their defaults."""
        numbers = {"bn": "block_n", "bk": "block_k", "s": "max_concurrent_steps"}
        words = {"registers": "a_operand", "smem": "a_operand"}
        fields = {}
        for part in text.split(":"):
            key = part.rstrip("0123456789")
            if part in words:
                fields[words[part]] = part
            elif key in numbers and part[len(key):].isdigit():
                fields[numbers[key]] = int(part[len(key):])
            else:
                raise ValueError(f"bad Mosaic tiling {text!r} (field {part!r}): want e.g. bn64:bk256:s4 or "
                                 "bn64:bk128:s4:smem")
        return cls(**fields)


def smem_transforms(minor_elems: int, dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8 if jnp.dtype(dtype) != jnp.dtype(jnp.int4) else 4
    swizzle = plgpu.find_swizzle(minor_elems * bits, str(jnp.dtype(dtype)))
    # jax 0.11 types both as subclasses of an abstract Transform base that they implement at run time
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)),  # pyright: ignore[reportAbstractUsage]
            plgpu.SwizzleTransform(swizzle))  # pyright: ignore[reportAbstractUsage]


MAX_SMEM_BYTES = 232448  # shared memory one CTA may take on an H200 (227 KiB)


def smem_bytes(config: MgpuConfig, mp: int) -> int:
    """Shared memory of one CTA: max_concurrent_steps buffers of the int4 weight, bf16 activation and bf16 scale
    tiles, the float32 [block_n, Mp] output staging, and the SMEM-A tile (Mosaic's own barriers not counted; 256
    rows at block_k 256 measured 626720 B on the H200 against this formula's 626688)."""
    bn, bk = config.block_n, config.block_k
    step = bn * bk // 2 + mp * bk * 2 + (bk // GROUP_SIZE) * bn * 2
    a_tile = bn * bk * 2 if config.a_operand == "smem" else 0
    return config.max_concurrent_steps * step + bn * mp * 4 + a_tile


def check_config(config: MgpuConfig, n: int, k: int, mp: int, interpret) -> None:
    if config.block_k % 64 or k % config.block_k:
        raise ValueError(f"block_k={config.block_k} must be a multiple of 64 (int4 swizzle >= 32 B) dividing K={k}")
    if config.a_operand not in ("registers", "smem"):
        raise ValueError(f"a_operand must be 'registers' or 'smem', got {config.a_operand!r}")
    if interpret is not None and config.a_operand == "registers":
        raise ValueError("a_operand='registers' cannot run in GPU interpret mode: jax 0.11's interpreted wgmma "
                         "reads A from an SMEM allocation only; use a_operand='smem' there")
    if config.block_n % 64:
        raise ValueError(f"block_n={config.block_n} must be a multiple of 64 (wgmma M)")
    if n % config.block_n:
        raise ValueError(f"N={n} must be divisible by block_n={config.block_n}")
    if mp % 8 or mp > 256:
        raise ValueError(f"the token tile's Mp={mp} rows must be a multiple of 8 and <= 256 (wgmma N)")
    if (need := smem_bytes(config, mp)) > MAX_SMEM_BYTES:
        raise ValueError(f"tiling {config} at M={mp} needs {need} B of shared memory, the H200 has {MAX_SMEM_BYTES}: "
                         "use a smaller block_k or fewer pipeline steps")


def dequantize_lane_order(w: jax.Array) -> jax.Array:
    """int4 [rows, cols] loaded in the WGMMA_UPCAST_4X layout from a lane-order weight (`pallas_kernels.int4`) ->
    the same values as bf16 in the WGMMA layout, in column order (call inside a kernel; unscaled: q itself).

    Each thread's 32-bit register holds 8 nibbles of one row: in lane order, nibbles i and 4 + i are the pair of
    columns the WGMMA layout gives this thread in 8-column tile i. So tile i's bf16 pair is (word >> 4i) &
    0x000F000F with 0x4308 xor-ed into each half (exponent of 128, sign bit flipped: the bf16 number 136 + q),
    minus 136: one shift, one LOP3, one bf16x2 subtraction a pair, where Mosaic's own relayout + cast of
    column-order int4 spends a shuffle, two byte permutes, a LOP3 and a subtraction (the CUTLASS int4 -> bf16
    conversion, as Mosaic's `astype` does it, without its byte permute)."""
    from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415 (inside-the-kernel builders, only when lowering)
    from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
    from jaxlib.mlir import ir  # noqa: PLC0415
    from jaxlib.mlir.dialects import arith, llvm  # noqa: PLC0415

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def cast(_ctx, arr):
        i32 = ir.IntegerType.get_signless(32)
        pair_type = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(fa.WGMMA_LAYOUT.registers_shape(tuple(arr.shape)), dtype=object)
        for idx, reg in np.ndenumerate(arr.registers):  # idx[1]: the 32-column group; the WGMMA index: 8-col tiles
            word = mgpu_utils.bitcast(reg, i32)
            for i in range(4):
                src = word if i == 0 else arith.shrui(word, arith.constant(i32, 4 * i))
                pair = llvm.inline_asm(
                    i32, [src],
                    "{\n.reg .b32 s<2>;\n"
                    "lop3.b32 s0, $1, 0x000F000F, 0x43084308, 0x6a;\n"  # (src & 0x000F000F) ^ 0x43084308
                    "mov.b32 s1, 0x43084308;\n"
                    "sub.bf16x2 $0, s0, s1;\n}",
                    "=r,r")
                out[(idx[0], idx[1] * 4 + i, *idx[2:])] = mgpu_utils.bitcast(pair, pair_type)
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return cast(w)  # pyright: ignore[reportCallIssue] (inline_mgpu's wrapper passes the launch context itself)


def make_tile_matmul(config: MgpuConfig, k: int, mp: int, interpret=None):
    """The shared inner loop: (w_gmem [block_n, K] int4 in lane order, x_gmem bf16 [M, K] with M = Mp or M < 8 = Mp
    (rows past M are read as the TMA's zeros), s_gmem [K/32, block_n] bf16, a_smem or None) -> f32 [block_n, Mp] =
    dequant(w) @ x_tile^T, as registers (call inside a kernel).
    interpret: None natively, else the GPU interpreter's parameters (the tile's lane order undone by array ops)."""
    block_n, block_k = config.block_n, config.block_k
    groups = block_k // GROUP_SIZE
    k_iters = k // block_k
    w_tr = smem_transforms(block_k, jnp.int4)
    x_tr = smem_transforms(block_k, jnp.bfloat16)

    def tile_matmul(w_gmem, x_gmem, s_gmem, a_smem):
        def body(acc_ref):
            def step(_, w_smem, x_smem, s_smem):
                w = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA_UPCAST_4X)  # int4 [block_n, block_k], lane order
                if interpret is None:
                    w = dequantize_lane_order(w)  # bf16, the WGMMA layout, column order
                else:  # the interpreter has no inline_mgpu: the same values by array ops
                    w = from_lane_order(w.astype(jnp.bfloat16))
                scales = [plgpu.load(s_smem.at[g], layout=plgpu.Layout.WGMMA.reduce(1))  # bf16 [block_n] each
                          for g in range(groups)]
                # Group g = columns [32 g, 32 g + 32): a static slice of the WGMMA tiling (8 columns per
                # register tile) is a subset of each thread's registers, so this moves no data.
                w = jnp.concatenate(
                    [w[:, g * GROUP_SIZE:(g + 1) * GROUP_SIZE] * lax.broadcast_in_dim(s, (block_n, GROUP_SIZE), [0])
                     for g, s in enumerate(scales)], axis=1)
                if a_smem is None:
                    a = w  # register-A: the dequantized tile feeds wgmma straight from registers
                else:
                    a_smem[...] = w  # SMEM-A (interpret mode): stage the dequantized tile in SMEM
                    plgpu.commit_smem()
                    a = a_smem
                plgpu.wgmma(acc_ref, a, x_smem.T)  # [block_n, block_k] @ [block_k, Mp]
                plgpu.wgmma_wait(0)  # the A tile is reused next step: finish reading it first

            plgpu.emit_pipeline(
                step,
                grid=(k_iters,),
                in_specs=[
                    plgpu.BlockSpec((block_n, block_k), lambda ki: (0, ki), transforms=w_tr),
                    plgpu.BlockSpec((mp, block_k), lambda ki: (0, ki), transforms=x_tr),
                    plgpu.BlockSpec((groups, block_n), lambda ki: (ki, 0)),
                ],
                max_concurrent_steps=min(config.max_concurrent_steps, k_iters),
            )(w_gmem, x_gmem, s_gmem)
            return acc_ref[...]

        return pl.run_scoped(body, plgpu.WGMMAAccumulatorRef((block_n, mp), jnp.float32))  # [block_n, Mp] f32

    return tile_matmul


def store_tile(value, o_smem, o_gmem_tile) -> None:
    """A CTA's f32 [block_n, Mp] result through SMEM (`scratch_types`' o_smem) to its tile of the output (call inside
    a kernel; the dense GEMM and the grouped MoE kernels)."""
    o_smem[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem_tile)
    plgpu.wait_smem_to_gmem(0)


def scratch_types(config: MgpuConfig, mp: int) -> dict:
    scratch = dict(o_smem=plgpu.SMEM((config.block_n, mp), jnp.float32))  # [block_n, Mp]
    if config.a_operand == "smem":
        scratch["a_smem"] = plgpu.SMEM((config.block_n, config.block_k), jnp.bfloat16,
                                       transforms=smem_transforms(config.block_k, jnp.bfloat16))
    return scratch


def w4a16_matmul_mgpu_kernel(x: jax.Array, w_i4: jax.Array, scale_t: jax.Array, *, config: MgpuConfig = MgpuConfig(),
                             split_k: int = 1, whole_tiles: int = 0, interpret=None) -> jax.Array:
    """The dense GEMM: x bf16 [M, K], w_i4 int4 [N, K], scale_t bf16 [K/32, N] -> y^T float32 [N, Mp], Mp = M rounded
    up to a multiple of 8 (the wgmma N). At M < 8 (a decode step) the token tile's rows past M are read out of bounds,
    which the TMA fills with zeros, so x needs no pad (an XLA launch); they reach only y^T's columns past M. Mosaic
    takes such a TMA only for fewer rows than its 8-row tiling: above 8, an M that is not a multiple of 8 is padded.

    One launch, one CTA per work item: the first `whole_tiles` block_n slices of W each stream the whole K (one CTA
    a slice), the other slices are split into split_k K chunks (one CTA a chunk, writing a float32 partial
    [block_n, Mp] that XLA sums after the launch). CTA p < whole_tiles takes slice p; CTA whole_tiles + q takes
    chunk q // rest of slice whole_tiles + q % rest (rest = N / block_n - whole_tiles). whole_tiles = 0 is plain
    split-K; whole_tiles = N / block_n (split_k 1) no split. Mixing the two evens out the SMs' work where the
    slices alone do not divide over them (tuned.dense_config). (Splitting the whole slices' K too, for 4 CTAs an SM
    instead of 2, was slower: 37.5 against 30.6 us at 7168 x 18432, M = 8, H100: w4a16_h100_s30_lead_split.md.)"""
    m, k = x.shape
    mp = -(-m // 8) * 8
    if m > 8 and m % 8:  # Mosaic tiles a TMA's GMEM rows by 8: fewer rows than that, or a multiple (else, pad)
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    n = w_i4.shape[0]
    if n % config.block_n:
        raise ValueError(f"N={n} must be divisible by block_n={config.block_n}")
    tiles = n // config.block_n
    if not 0 <= whole_tiles <= tiles:
        raise ValueError(f"whole_tiles={whole_tiles} must be in [0, {tiles}] (N / block_n)")
    rest = tiles - whole_tiles
    if split_k < 1 or k % split_k or (rest == 0 and split_k != 1):
        raise ValueError(f"split_k={split_k} must be a positive divisor of K={k}, and 1 when no slice is split")
    block_n = config.block_n
    # Two groups of slices, each (first slice, slices, K chunks): CTAs [start, start + slices * chunks) of the grid.
    parts = [(0, whole_tiles, 1), (whole_tiles, rest, split_k)]
    parts = [part for part in parts if part[1]]
    for _, _, chunks in parts:
        check_config(config, n, k // chunks, mp, interpret)
    out_types = tuple(jax.ShapeDtypeStruct((chunks, slices * block_n, mp), jnp.float32) for _, slices, chunks in parts)
    matmuls = [make_tile_matmul(config, k // chunks, mp, interpret) for _, _, chunks in parts]

    def kernel(x_gmem, w_gmem, s_gmem, *outs, o_smem, a_smem=None):
        p = lax.axis_index("p")
        start = 0
        for (first, slices, chunks), matmul, out in zip(parts, matmuls, outs, strict=True):
            @pl.when((p >= start) & (p < start + slices * chunks))
            def _(first=first, slices=slices, chunks=chunks, matmul=matmul, out=out, start=start):
                q = p - start
                tile, split = q % slices, q // slices
                k_chunk = k // chunks
                n_slice = pl.ds((first + tile) * block_n, block_n)
                k_slice = pl.ds(split * k_chunk, k_chunk)
                groups = k_chunk // GROUP_SIZE
                store_tile(matmul(w_gmem.at[n_slice, k_slice], x_gmem.at[:, k_slice],
                                  s_gmem.at[pl.ds(split * groups, groups), n_slice], a_smem),
                           o_smem, out.at[split, pl.ds(tile * block_n, block_n)])
            start += slices * chunks

    f = plgpu.kernel(
        kernel,
        out_type=out_types,
        grid=(sum(slices * chunks for _, slices, chunks in parts),),
        grid_names=("p",),
        scratch_types=scratch_types(config, mp),
        interpret=interpret,
    )
    pieces = [out[0] if out.shape[0] == 1 else out.sum(0) for out in f(x, w_i4, scale_t)]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)  # [N, Mp]


def gpu_interpret_params(**kwargs):
    """InterpretGPUParams(**kwargs), e.g. detect_races=True (private import path in jax 0.11; public as
    plgpu.InterpretGPUParams from 0.12)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415

    return InterpretGPUParams(**kwargs)
