"""Grouped W4A16 MoE: the routed experts of a DeepSeekMoE layer over INT4 expert stacks.

`grouped_moe_w4a16(x, experts, expert_ids, weights)` is the public entry: it checks shapes/dtypes
and picks the implementation.
  impl="pallas": the grouped Pallas kernels (natively on a GPU; `interpret=True` runs them on CPU).
  impl="xla":    XLA loop over the touched experts (moe_w4a16_xla_touched): correct everywhere, slow.
  impl="auto":   "pallas" on a GPU; on CPU "xla" with a one-time MoEW4A16FallbackWarning.
The model's MoE (`kdtree_jax.model.routed_experts`) calls it for INT4 experts.
Only the routed part: the shared expert stays a plain `swiglu` in the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch

from pallas_kernels.int4 import Int4Weight
from pallas_kernels.moe_w4a16.kernel import (
    Grouping,
    MoEBlockConfig,
    default_config,
    group_assignments,
    grouped_moe_w4a16_pallas,
    grouped_moe_w4a16_reference,
    max_row_tiles,
    moe_w4a16_xla_dense,
    moe_w4a16_xla_gather,
    moe_w4a16_xla_touched,
)
from pallas_kernels.w4a16 import W4A16FallbackWarning

__all__ = [
    "Grouping", "MoEBlockConfig", "MoEW4A16FallbackWarning", "default_config", "group_assignments",
    "grouped_moe_w4a16", "grouped_moe_w4a16_reference", "max_row_tiles", "moe_w4a16_xla_dense",
    "moe_w4a16_xla_gather", "moe_w4a16_xla_touched", "resolve_impl",
]

_ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


class MoEW4A16FallbackWarning(W4A16FallbackWarning):
    """impl="auto" ran the XLA touched-experts loop because no GPU is present (a W4A16FallbackWarning,
    so filters for the dense kernel's warning cover it too)."""


def resolve_impl(impl: str = "auto", *, interpret: bool = False) -> str:
    """The implementation `grouped_moe_w4a16` will run: "pallas" or "xla" (auto on CPU warns)."""
    return dispatch.resolve_impl(impl, interpret=interpret, op="grouped_moe_w4a16", fallback="the XLA touched-experts loop",
                                 kernel="the grouped Pallas MoE kernel", warning=MoEW4A16FallbackWarning)


def _check_inputs(x, experts, expert_ids, weights) -> tuple[int, int, int]:
    """Validate the API inputs; returns (E, D, I)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in _ACT_DTYPES:
        raise ValueError(f"x dtype must be bfloat16 or float32, got {x.dtype}")
    if x.shape[0] == 0:
        raise ValueError("x has T=0 tokens")
    if not isinstance(experts, dict) or set(experts) != {"gate", "up", "down"}:
        got = sorted(experts) if isinstance(experts, dict) else type(experts).__name__
        raise ValueError(f"experts must be a dict with keys gate, up, down (INT4 leaves), got {got}")
    shapes = {}
    for name in ("gate", "up", "down"):
        try:
            shapes[name] = Int4Weight.from_dict(experts[name]).check()  # (N, K)
        except ValueError as e:
            raise ValueError(f"experts[{name!r}]: {e}") from None
        if experts[name]["qweight"].ndim != 3:
            raise ValueError(f"experts[{name!r}] must be stacked [E, N, K/4], got qweight "
                             f"{experts[name]['qweight'].shape}")
    num_experts = experts["gate"]["qweight"].shape[0]
    hidden = x.shape[1]
    inter = shapes["gate"][0]
    want = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for name in ("gate", "up", "down"):
        if experts[name]["qweight"].shape[0] != num_experts:
            raise ValueError(f"experts[{name!r}] has {experts[name]['qweight'].shape[0]} experts, gate has {num_experts}")
        if shapes[name] != want[name]:
            raise ValueError(f"experts[{name!r}] is (N, K)={shapes[name]}, want {want[name]} for x of D={hidden} "
                             f"and I={inter}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be [T, k] with T={x.shape[0]}, got {expert_ids.shape}")
    if expert_ids.dtype != jnp.int32:
        raise ValueError(f"expert_ids must be int32, got {expert_ids.dtype}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights shape {weights.shape} != expert_ids shape {expert_ids.shape}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"weights must be floating point, got {weights.dtype}")
    if not isinstance(expert_ids, jax.core.Tracer):
        lo, hi = int(jnp.min(expert_ids)), int(jnp.max(expert_ids))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")
    return num_experts, hidden, inter


def grouped_moe_w4a16(x: jax.Array, experts: dict, expert_ids: jax.Array, weights: jax.Array, *,
                      impl: str = "auto", interpret: bool = False, config: MoEBlockConfig | None = None,
                      out_dtype=None) -> jax.Array:
    """sum_j weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]) -> [T, D] in out_dtype (default x.dtype).

    x [T, D] bf16|f32; experts {"gate","up"}: Int4Weight stacks (or their dict form) [E, I, D/4] / [E, I, D/32], {"down"}:
    [E, D, I/4] / [E, D, I/32]; expert_ids [T, k] int32 in [0, E) (checked when concrete; under jit an
    out-of-range id is undefined behaviour); weights [T, k] float (accumulated in float32).
    config: tiles for impl="pallas" (default: `default_config`).
    """
    # the kernels below index the arrays by name: a typed expert stack goes in as its dict form
    experts = ({k: v.to_dict() for k, v in experts.items()} if isinstance(experts, dict)
               and all(isinstance(v, Int4Weight) for v in experts.values()) else experts)
    _, hidden, inter = _check_inputs(x, experts, expert_ids, weights)
    chosen = resolve_impl(impl, interpret=interpret)
    if chosen == "xla":
        return moe_w4a16_xla_touched(x, experts, expert_ids, weights, dequant="f32", out_dtype=out_dtype)
    cfg = config or default_config(x.shape[0], hidden, inter)
    for dim, name, block in ((inter, "I", cfg.block_n_up), (hidden, "D", cfg.block_k_up),
                             (hidden, "D", cfg.block_n_down), (inter, "I", cfg.block_k_down)):
        if dim % block:
            raise ValueError(f"{name}={dim} must be divisible by the tile {block} of {cfg}")
    return grouped_moe_w4a16_pallas(x, experts, expert_ids, weights, cfg=cfg, interpret=interpret,
                                    out_dtype=None if out_dtype is None else jnp.dtype(out_dtype))
