"""The grouped INT4 MoE on the Mosaic GPU W4A16 tile loop (Hopper): the routed experts' SwiGLU for T tokens
routed top-k, reading each touched expert's weights once and never an untouched one. Experts are
`MosaicInt4Weight` stacks (made once at load time: kdtree_jax.kernels.prepare_params); the dispatcher
(pallas_kernels.dispatch.choose_moe) runs this for them on a Hopper GPU with bf16 activations.

T > 1: the shared device-side grouping (`grouping.group_assignments`: assignments sorted by expert into
block_m-row tiles, a tile -> expert table, -1 for unused tiles); T = 1 (a decode step): one tile per choice,
no sort. Then three launches of `grouped_w4a16_mgpu_kernel` (gate, up, down; tokens are the wgmma N
dimension, so block_m = 8 wastes nothing at decode sizes) with the SwiGLU, the combine weights and the
per-token sum in XLA between them; or, with `fused_gate_up` (the default), two:
`grouped_gate_up_mgpu_kernel` runs a tile's gate and up products in one CTA and applies the SwiGLU in its epilogue,
then the down launch.
Roundings follow the Triton path (gate/up/down outputs rounded to bf16). Status and numbers: docs/w4a16_mgpu.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch
from pallas_kernels.int4 import GROUP_SIZE
from pallas_kernels.moe_w4a16.grouping import group_assignments
from pallas_kernels.moe_w4a16.tuned import default_mosaic_config
from pallas_kernels.w4a16 import mosaic_gpu as mosaic
from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig, gpu_interpret_params


def grouped_w4a16_mgpu_kernel(x_rows: jax.Array, w_i4: jax.Array, scale_t: jax.Array, tile_expert: jax.Array, *,
                              tile_weight: jax.Array | None = None, config: MgpuConfig = MgpuConfig(),
                              interpret=None) -> jax.Array:
    """Grouped (per-tile expert) W4A16: x_rows bf16 [R * Mp, K] (row tile t = rows [t Mp, (t + 1) Mp)) or [M < 8, K]
    (one token tile for every row tile, Mp = 8: `_token_tiles`), w_i4 int4 [E, N, K], scale_t bf16 [E, K/32, N],
    tile_expert int32 [R] (the expert of each row tile, -1 = unused) -> y^T f32 [R, N, Mp],
    tile t = dequant(W[tile_expert[t]]) @ x_tile^T.

    Grid (R, N / block_n): a CTA reads its tile's expert id from global memory and skips the tile when it
    is -1, so untouched experts and unused tiles cost no weight bytes. tile_weight (float32 [R], optional): a
    tile whose weight is 0 is unused too (the decode path passes the routing weights as they are, so no XLA
    launch has to build the table). The output of an unused tile is NOT written (undefined): mask it."""
    (r,), (num_experts, n, k) = tile_expert.shape, w_i4.shape
    mp, x_tile = _token_tiles(x_rows, r, k)
    mosaic.check_config(config, n, k, mp, interpret)
    if w_i4.shape != (num_experts, n, k) or scale_t.shape != (num_experts, k // GROUP_SIZE, n):
        raise ValueError(f"w_i4 {w_i4.shape} / scale_t {scale_t.shape} do not match E={num_experts}, N={n}, K={k}")
    block_n = config.block_n
    tile_matmul = mosaic.make_tile_matmul(config, k, mp, interpret)

    def kernel(e_gmem, tw_gmem, x_gmem, w_gmem, s_gmem, o_gmem, o_smem, a_smem=None):
        t = lax.axis_index("t")
        n_slice = pl.ds(lax.axis_index("n") * block_n, block_n)
        expert = _tile_expert(e_gmem, tw_gmem, t)

        @pl.when(expert >= 0)
        def _():
            mosaic.store_tile(tile_matmul(w_gmem.at[expert, n_slice], x_tile(x_gmem, t),
                                          s_gmem.at[expert, :, n_slice], a_smem), o_smem, o_gmem.at[t, n_slice])

    return _grouped_launch(kernel, r, n, mp, config, interpret)(*_tile_table(tile_expert, tile_weight), x_rows, w_i4,
                                                                scale_t)


def _token_tiles(x_rows: jax.Array, r: int, k: int):
    """A grouped kernel's token tiles: x_rows bf16 [R * Mp, K] (row tile t = rows [t Mp, (t + 1) Mp)), or [M, K] with
    M < 8, one token tile that every row tile reads (Mp = 8: the TMA fills rows M..7 with zeros, which reach only
    output columns past M; the decode step's token, with no XLA launch to pad or repeat it). -> (Mp, a function
    (x_gmem, t) -> row tile t's [Mp, K] ref, to call inside the kernel)."""
    rows = x_rows.shape[0]
    if x_rows.ndim != 2 or x_rows.shape[1] != k:
        raise ValueError(f"x_rows {x_rows.shape} must be [rows, K={k}]")
    if rows < 8:
        return 8, lambda x_gmem, _t: x_gmem
    if rows % r:
        raise ValueError(f"x_rows has {rows} rows, not a multiple of the {r} row tiles (nor fewer than 8 rows, "
                         "one token tile for every row tile)")
    mp = rows // r
    return mp, lambda x_gmem, t: x_gmem.at[pl.ds(t * mp, mp)]


def _tile_table(tile_expert: jax.Array, tile_weight: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The kernels' first two operands: the tile -> expert table (int32 [R]) and the tiles' weights (float32 [R];
    all ones when not given: then only -1 marks an unused tile)."""
    r = tile_expert.shape[0]
    if tile_weight is None:
        tile_weight = jnp.ones((r,), jnp.float32)
    if tile_weight.shape != (r,):
        raise ValueError(f"tile_weight {tile_weight.shape} must be [R] = [{r}], one weight a row tile")
    return tile_expert.astype(jnp.int32), tile_weight.astype(jnp.float32)


def _tile_expert(e_gmem, tw_gmem, t):
    """Inside a grouped kernel: row tile t's expert, -1 when the tile is unused (-1 in the table or weight 0)."""
    return jnp.where(tw_gmem[t] != 0, e_gmem[t], -1)


def _grouped_launch(kernel, r: int, n: int, mp: int, config: MgpuConfig, interpret, rows_out: bool = False):
    """The grouped kernels' launch: grid (R row tiles, N / block_n), the tile loop's scratch, and out f32 [R, N, Mp]
    staged through o_smem f32 [block_n, Mp]; rows_out: out bf16 [R, Mp, N] (token rows) through o_smem bf16
    [Mp, block_n] instead."""
    scratch = mosaic.scratch_types(config, mp)
    out_type = jax.ShapeDtypeStruct((r, n, mp), jnp.float32)
    if rows_out:
        scratch["o_smem"] = plgpu.SMEM((mp, config.block_n), jnp.bfloat16)
        out_type = jax.ShapeDtypeStruct((r, mp, n), jnp.bfloat16)
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(r, n // config.block_n),
        grid_names=("t", "n"),
        scratch_types=scratch,
        interpret=interpret,
    )


def _bf16(v):
    """Round to bf16 and back: the roundings the three-launch path makes between its launches."""
    return v.astype(jnp.bfloat16).astype(jnp.float32)


def grouped_gate_up_mgpu_kernel(x_rows: jax.Array, gate_w: jax.Array, gate_s: jax.Array, up_w: jax.Array,
                                up_s: jax.Array, tile_expert: jax.Array, *, tile_weight: jax.Array | None = None,
                                config: MgpuConfig = MgpuConfig(), interpret=None) -> jax.Array:
    """The gate and up launches in one, SwiGLU in the epilogue: x_rows bf16 [R * Mp, K] or [M < 8, K] (as
    `grouped_w4a16_mgpu_kernel`), gate_w / up_w int4 [E, N, K], gate_s / up_s bf16 [E, K/32, N], tile_expert int32
    [R] (-1 = unused) -> h bf16 [R, Mp, N], rows as x_rows' (the down launch's operand as it is), with
    h = bf16(bf16(silu(bf16(g))) * bf16(u)), g / u the tile's gate / up products (the same roundings as the
    three-launch path's XLA SwiGLU).

    Grid (R, N / block_n) as `grouped_w4a16_mgpu_kernel`: a CTA streams its expert's gate tile, then its up
    tile, through the same pipeline, with the token tile read twice from L2, and stores its [block_n, Mp] result
    transposed into a bf16 [Mp, block_n] SMEM tile (4 values a thread at block_n 64, Mp 8), then by TMA to its rows'
    slice; tile_weight and unused tiles as in `grouped_w4a16_mgpu_kernel` (an unused tile's rows are NOT written:
    skip or mask them)."""
    (r,), (num_experts, n, k) = tile_expert.shape, gate_w.shape
    mp, token_tile = _token_tiles(x_rows, r, k)
    mosaic.check_config(config, n, k, mp, interpret)
    want_w, want_s = (num_experts, n, k), (num_experts, k // GROUP_SIZE, n)
    if not (gate_w.shape == up_w.shape == want_w and gate_s.shape == up_s.shape == want_s):
        raise ValueError(f"gate {gate_w.shape} / {gate_s.shape} and up {up_w.shape} / {up_s.shape} do not match "
                         f"E={num_experts}, N={n}, K={k}")
    block_n = config.block_n
    tile_matmul = mosaic.make_tile_matmul(config, k, mp, interpret)

    def kernel(e_gmem, tw_gmem, x_gmem, gw_gmem, gs_gmem, uw_gmem, us_gmem, o_gmem, o_smem, a_smem=None):
        t = lax.axis_index("t")
        n_slice = pl.ds(lax.axis_index("n") * block_n, block_n)
        expert = _tile_expert(e_gmem, tw_gmem, t)

        @pl.when(expert >= 0)
        def _():
            x_tile = token_tile(x_gmem, t)
            g = _bf16(tile_matmul(gw_gmem.at[expert, n_slice], x_tile, gs_gmem.at[expert, :, n_slice], a_smem))
            u = _bf16(tile_matmul(uw_gmem.at[expert, n_slice], x_tile, us_gmem.at[expert, :, n_slice], a_smem))
            h = (_bf16(g / (1.0 + jnp.exp(-g))) * u).astype(jnp.bfloat16)  # [block_n, Mp]
            o_smem.T[...] = h
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[t, :, n_slice])
            plgpu.wait_smem_to_gmem(0)

    return _grouped_launch(kernel, r, n, mp, config, interpret, rows_out=True)(
        *_tile_table(tile_expert, tile_weight), x_rows, gate_w, gate_s, up_w, up_s)


@functools.partial(jax.jit, static_argnames=("block_m", "config_up", "config_down", "interpret", "out_dtype",
                                             "fused_gate_up"))
def grouped_moe_w4a16_mgpu(x: jax.Array, experts_mgpu: dict, expert_ids: jax.Array, weights: jax.Array, *,
                           block_m: int = 8, config_up: MgpuConfig | None = None,
                           config_down: MgpuConfig | None = None, interpret=None,
                           out_dtype=jnp.bfloat16, fused_gate_up: bool = True) -> jax.Array:
    """sum_j weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]) -> [T, D] in out_dtype (summed in float32).

    x bf16 [T, D]; experts_mgpu {"gate","up","down"} of stacked MosaicInt4Weight (int4 [E, N, K], bf16
    scale_t [E, K/32, N]); expert_ids [T, k] int32 in [0, E);
    weights [T, k] float (zero-weight choices are dropped: they touch nothing). block_m: rows per tile
    (a multiple of 8, <= 256; at T = 1 the tiles have 8 rows whatever it is). config_up (gate and up launches) /
    config_down: tilings, by default `tuned.default_mosaic_config` of their K. interpret: None natively, or
    InterpretGPUParams (needs a_operand="smem"). fused_gate_up (default True): gate and up in one launch with the
    SwiGLU in its epilogue (`grouped_gate_up_mgpu_kernel`), writing h as the down launch's rows, so no XLA launch
    runs between the two; False: the three launches (gate, up, down) with the SwiGLU and a transpose in XLA. The
    fused form measured faster at T = 1 (H200 2026-12-03: 84.6 vs 85.8 us) and, since it writes h transposed, at
    T = 9 too (H100 2026-12-07: 596.8 vs 613.5 us; T = 1 81.8 vs 87.8), docs/w4a16_mgpu.md."""
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [T, D], got {x.dtype} {x.shape}")
    if block_m % 8 or not 8 <= block_m <= 256:
        raise ValueError(f"block_m={block_m} must be a multiple of 8 in [8, 256] (the wgmma N dimension)")
    (gate_w, gate_s), (up_w, up_s), (down_w, down_s) = ((experts_mgpu[n].w_i4, experts_mgpu[n].scale_t)
                                                        for n in ("gate", "up", "down"))
    num_experts, inter, hidden = gate_w.shape
    if x.shape[1] != hidden or down_w.shape != (num_experts, hidden, inter) or up_w.shape != gate_w.shape:
        raise ValueError(f"expert shapes gate {gate_w.shape}, up {up_w.shape}, down {down_w.shape} do not fit "
                         f"x {x.shape}")
    if (why := dispatch.mosaic_moe_shape_unsupported(hidden, inter)) is not None:
        raise ValueError(f"the Mosaic GPU MoE kernel cannot run these experts: {why}")
    config_up = config_up or default_mosaic_config(hidden)
    config_down = config_down or default_mosaic_config(inter)
    if expert_ids.shape != weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {expert_ids.shape} and weights {weights.shape} must both be [T, k], "
                         f"T={x.shape[0]}")

    def swiglu_tiles(x_rows, tile_expert, tile_weight):  # [R bm, D] (or x's 1 row: bm 8) -> [R, D, bm] f32, 0: unused
        used = (tile_weight != 0)[:, None, None]  # unused tiles' outputs are never written: mask them

        def run(rows_in, w, s, config):  # -> [R, N, block_m] f32
            y_t = grouped_w4a16_mgpu_kernel(rows_in, w, s, tile_expert, tile_weight=tile_weight, config=config,
                                            interpret=interpret)
            return jnp.where(used, y_t, 0.0)

        if fused_gate_up:
            # [R, bm, I] bf16 in the down launch's row layout: no XLA launch between the two; an unused tile's rows
            # are never written, and the down launch skips the same tiles (its output is masked)
            h_rows = grouped_gate_up_mgpu_kernel(x_rows, gate_w, gate_s, up_w, up_s, tile_expert,
                                                 tile_weight=tile_weight, config=config_up,
                                                 interpret=interpret).reshape(-1, inter)  # [R bm, I]
        else:
            g = _bf16(run(x_rows, gate_w, gate_s, config_up))  # [R, I, bm]
            u = run(x_rows, up_w, up_s, config_up).astype(jnp.bfloat16)
            h = (g * jax.nn.sigmoid(g)).astype(jnp.bfloat16) * u  # [R, I, bm] bf16
            h_rows = h.transpose(0, 2, 1).reshape(-1, inter)  # [R bm, I]
        return _bf16(run(h_rows, down_w, down_s, config_down))  # [R, D, bm]

    if x.shape[0] == 1:
        # Decode (T = 1): one tile per choice, the token in its row 0; no sort, no scatter, no gathers (the
        # general grouping below costs more small XLA kernels than the bytes of 8 experts take to stream).
        # A zero-weight choice (another shard's expert) is an unused tile: the kernels read the routing weights
        # themselves (tile_weight), so no XLA launch builds a tile table. The gate and up launches read x itself
        # as every tile's token tile (its rows 1..7 the TMA's zeros), so no XLA launch pads x into k tiles either.
        y = swiglu_tiles(x, expert_ids[0], weights[0].astype(jnp.float32))[:, :, 0]  # [k, D]
        return jnp.sum(y * weights[0].astype(jnp.float32)[:, None], axis=0, keepdims=True).astype(out_dtype)

    grp = group_assignments(expert_ids, weights, num_experts, block_m)
    rows = grp.tile_expert.shape[0] * block_m
    x_rows = jnp.where(grp.row_valid[:, None], x[grp.row_token], 0).astype(jnp.bfloat16)  # [P, D]
    # the used tiles as weights (1 / 0), computed beside the tile table: without them the kernels' weight operand
    # would be a separately launched all-ones buffer
    tile_used = (grp.tile_expert >= 0).astype(jnp.float32)
    y = swiglu_tiles(x_rows, grp.tile_expert, tile_used).transpose(0, 2, 1).reshape(rows, hidden)  # [P, D] f32
    y = y * grp.row_weight[:, None]
    per_choice = jnp.where(grp.keep[..., None], y[grp.position], 0.0)  # [T, k, D]
    return jnp.sum(per_choice, axis=1).astype(out_dtype)


def interpret_configs() -> dict:
    """Keyword arguments that run `grouped_moe_w4a16_mgpu` in Mosaic GPU interpret mode on CPU (jax 0.11's
    interpreter needs the SMEM-staged A operand and block_k 64)."""
    smem = MgpuConfig(block_k=64, a_operand="smem")
    return dict(config_up=smem, config_down=smem, interpret=gpu_interpret_params())
