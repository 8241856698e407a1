"""The grouped INT4 MoE on the Mosaic GPU W4A16 kernel (Hopper): the routed experts' SwiGLU for T tokens
routed top-k, reading each touched expert's weights once and never an untouched one. The model's routed
MoE on Hopper GPUs for bf16 models (kdtree_jax.quantize.mosaic_moe_unsupported says when).

T > 1: the same device-side grouping as the Triton kernels (`pallas_kernels.moe_w4a16.group_assignments`:
assignments sorted by expert into block_m-row tiles, a tile -> expert table, -1 for unused tiles);
T = 1 (a decode step): one tile per choice, no sort. Then three launches of `grouped_w4a16_mgpu_kernel`
(gate, up, down; tokens are the wgmma N dimension, so block_m = 8 wastes nothing at decode sizes) with the
SwiGLU, the combine weights and the per-token sum in XLA between them. Roundings follow the Triton path
(gate/up/down outputs rounded to bf16).

`routed_moe_mosaic` is what the model calls for routed experts in this layout
(`kdtree_jax.quantize.to_mosaic_experts`): the kernel on a GPU, an XLA dequantize-then-dot of the chosen
experts elsewhere (loudly). Status and numbers: docs/w4a16_mgpu.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.int4 import MosaicInt4Weight
from pallas_kernels.moe_w4a16 import MoEW4A16FallbackWarning
from pallas_kernels.moe_w4a16.kernel import group_assignments
from pallas_kernels.w4a16_mgpu.kernel import GROUP_SIZE, MgpuConfig, grouped_w4a16_mgpu_kernel, to_mgpu_layout


def experts_to_mgpu_layout(experts: dict) -> dict:
    """INT4 expert stacks {"gate", "up", "down"} (leaves int16 [E, N, K/4] + scales [E, N, K/32]) ->
    {name: {"w_i4": jnp.int4 [E, N, K], "scale_t": bf16 [E, K/32, N]}} (the dict form of pallas_kernels.int4.MosaicInt4Weight).
    A load-time conversion, not per call (the model's is kdtree_jax.quantize.to_mosaic_experts)."""
    return {name: dict(zip(("w_i4", "scale_t"), to_mgpu_layout(leaf["qweight"], leaf["scale"])))
            for name, leaf in experts.items()}


def shape_unsupported(hidden: int, inter: int) -> str | None:
    """Why experts of hidden -> inter -> hidden cannot run on the kernel, or None (both dims are N of one
    launch, a multiple of block_n = 64, and K of another, a multiple of block_k >= 64)."""
    bad = [f"{name} {dim}" for name, dim in (("hidden", hidden), ("intermediate", inter)) if dim % 64]
    return f"{' and '.join(bad)} not a multiple of 64" if bad else None


def default_config(k: int) -> MgpuConfig:
    """block_n 64 (the wgmma M), the deepest block_k of 256 / 128 / 64 that divides K, 4 pipeline steps:
    the fastest tiling measured at K2.6 shapes (benchmarks/results/moe_mgpu.md: bk512 and bn128 were
    slower at every T, a shallower block_k for the down launch too)."""
    return MgpuConfig(block_n=64, block_k=next(bk for bk in (256, 128, 64) if k % bk == 0))


@functools.partial(jax.jit, static_argnames=("block_m", "config_up", "config_down", "interpret", "out_dtype"))
def grouped_moe_w4a16_mgpu(x: jax.Array, experts_mgpu: dict, expert_ids: jax.Array, weights: jax.Array, *,
                           block_m: int = 8, config_up: MgpuConfig | None = None,
                           config_down: MgpuConfig | None = None, interpret=None,
                           out_dtype=jnp.bfloat16) -> jax.Array:
    """sum_j weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]) -> [T, D] in out_dtype (summed in float32).

    x bf16 [T, D]; experts_mgpu from `experts_to_mgpu_layout`; expert_ids [T, k] int32 in [0, E);
    weights [T, k] float (zero-weight choices are dropped: they touch nothing). block_m: rows per tile
    (a multiple of 8, <= 256). config_up (gate and up launches) / config_down: tilings, by default
    `default_config` of their K. interpret: None natively, or InterpretGPUParams (needs a_operand="smem")."""
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [T, D], got {x.dtype} {x.shape}")
    if block_m % 8 or not 8 <= block_m <= 256:
        raise ValueError(f"block_m={block_m} must be a multiple of 8 in [8, 256] (the wgmma N dimension)")
    (gate_w, gate_s), (up_w, up_s), (down_w, down_s) = (_arrays(experts_mgpu[n]) for n in ("gate", "up", "down"))
    num_experts, inter, hidden = gate_w.shape
    if x.shape[1] != hidden or down_w.shape != (num_experts, hidden, inter) or up_w.shape != gate_w.shape:
        raise ValueError(f"expert shapes gate {gate_w.shape}, up {up_w.shape}, down {down_w.shape} do not fit "
                         f"x {x.shape}")
    if (why := shape_unsupported(hidden, inter)) is not None:
        raise ValueError(f"the Mosaic GPU MoE kernel cannot run these experts: {why}")
    config_up = config_up or default_config(hidden)
    config_down = config_down or default_config(inter)
    if expert_ids.shape != weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {expert_ids.shape} and weights {weights.shape} must both be [T, k], T={x.shape[0]}")

    def swiglu_tiles(x_rows, tile_expert):  # [R bm, D] rows -> [R, D, bm] f32 down outputs (0: unused tiles)
        used = (tile_expert >= 0)[:, None, None]  # unused tiles' outputs are never written: mask them
        rows = x_rows.shape[0]

        def run(rows_in, w, s, config):  # -> [R, N, block_m] f32
            y_t = grouped_w4a16_mgpu_kernel(rows_in, w, s, tile_expert, config=config, interpret=interpret)
            return jnp.where(used, y_t, 0.0)

        g = run(x_rows, gate_w, gate_s, config_up).astype(jnp.bfloat16).astype(jnp.float32)  # [R, I, bm]
        u = run(x_rows, up_w, up_s, config_up).astype(jnp.bfloat16)
        h = (g * jax.nn.sigmoid(g)).astype(jnp.bfloat16) * u  # [R, I, bm] bf16
        h_rows = h.transpose(0, 2, 1).reshape(rows, inter)  # [R bm, I]
        return run(h_rows, down_w, down_s, config_down).astype(jnp.bfloat16).astype(jnp.float32)  # [R, D, bm]

    if x.shape[0] == 1:
        # Decode (T = 1): one tile per choice, the token in its row 0; no sort, no scatter, no gathers (the
        # general grouping below costs more small XLA kernels than the bytes of 8 experts take to stream).
        # A zero-weight choice (another shard's expert) gets tile -1: never read.
        top_k = expert_ids.shape[1]
        tile_expert = jnp.where(weights[0] != 0, expert_ids[0], -1).astype(jnp.int32)  # [k]
        x_rows = jnp.zeros((top_k, block_m, hidden), jnp.bfloat16).at[:, 0].set(x[0]).reshape(top_k * block_m, hidden)
        y = swiglu_tiles(x_rows, tile_expert)[:, :, 0]  # [k, D]
        return jnp.sum(y * weights[0].astype(jnp.float32)[:, None], axis=0, keepdims=True).astype(out_dtype)

    grp = group_assignments(expert_ids, weights, num_experts, block_m)
    rows = grp.tile_expert.shape[0] * block_m
    x_rows = jnp.where(grp.row_valid[:, None], x[grp.row_token], 0).astype(jnp.bfloat16)  # [P, D]
    y = swiglu_tiles(x_rows, grp.tile_expert).transpose(0, 2, 1).reshape(rows, hidden)  # [P, D] f32
    y = y * grp.row_weight[:, None]
    per_choice = jnp.where(grp.keep[..., None], y[grp.position], 0.0)  # [T, k, D]
    return jnp.sum(per_choice, axis=1).astype(out_dtype)


def _arrays(leaf):
    if isinstance(leaf, MosaicInt4Weight):
        return leaf.w_i4, leaf.scale_t
    return leaf["w_i4"], leaf["scale_t"]


def routed_moe_mosaic_reference(x, experts_mgpu, expert_ids, weights) -> jax.Array:
    """Plain jnp, float32: dequantize only the chosen experts ([T, k, N, K] each) -> float32 [T, D].
    The XLA path for small models and tests; never at K2 width (it gathers T * k whole experts)."""
    def dequant(name):
        w_i4, scale_t = _arrays(experts_mgpu[name])
        w = w_i4[expert_ids].astype(jnp.float32)  # [T, k, N, K]
        s = jnp.repeat(jnp.swapaxes(scale_t[expert_ids].astype(jnp.float32), -1, -2), GROUP_SIZE, axis=-1)
        return w * s

    hp = jax.lax.Precision.HIGHEST
    xf = x.astype(jnp.float32)
    g = jnp.einsum("td,tkid->tki", xf, dequant("gate"), precision=hp)
    u = jnp.einsum("td,tkid->tki", xf, dequant("up"), precision=hp)
    y = jnp.einsum("tki,tkdi->tkd", jax.nn.silu(g) * u, dequant("down"), precision=hp)
    return jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32), precision=hp)


def routed_moe_mosaic(x, experts_mgpu, expert_ids, weights, *, impl: str = "auto", interpret: bool = False,
                      out_dtype=jnp.float32) -> jax.Array:
    """The model's routed MoE over experts in the Mosaic layout: impl "pallas" = the Mosaic GPU grouped
    kernel (bf16 x; a GPU, or CPU with interpret=True), "xla" = `routed_moe_mosaic_reference`, "auto" =
    the kernel on a GPU, else the XLA path with a MoEW4A16FallbackWarning."""
    chosen = dispatch.resolve_impl(impl, interpret=interpret, op="routed_moe_mosaic",
                                   fallback="an XLA dequantize-then-dot of the chosen experts",
                                   kernel="the Mosaic GPU grouped MoE kernel", warning=MoEW4A16FallbackWarning)
    if chosen == "xla":
        return routed_moe_mosaic_reference(x, experts_mgpu, expert_ids, weights).astype(out_dtype)
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic GPU MoE kernel takes bf16 activations, got {x.dtype}: run the model in "
                         "bf16 or keep the canonical INT4 experts (the Triton kernel also takes float32)")
    if interpret:
        from pallas_kernels.w4a16_mgpu import gpu_interpret_params  # noqa: PLC0415

        smem = MgpuConfig(block_k=64, a_operand="smem")
        return grouped_moe_w4a16_mgpu(x, experts_mgpu, expert_ids.astype(jnp.int32), weights, config_up=smem,
                                      config_down=smem, interpret=gpu_interpret_params(), out_dtype=out_dtype)
    return grouped_moe_w4a16_mgpu(x, experts_mgpu, expert_ids.astype(jnp.int32), weights, out_dtype=out_dtype)
