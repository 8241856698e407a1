"""Grouped W4A16 MoE: the routed experts of a DeepSeekMoE layer over INT4 expert stacks.

`grouped_moe_w4a16(x, experts, expert_ids, weights)` is the public entry: it checks shapes/dtypes and asks
`pallas_kernels.dispatch.choose_moe` which implementation runs; the kernel follows from the experts' type:
  Int4Weight stacks       -> "triton"     (`triton.py`, the Pallas Triton grouped kernels);
  MosaicInt4Weight stacks -> "mosaic_gpu" (`mosaic_gpu.py`, Hopper + bf16 activations);
  either, impl="xla", no GPU, or on a GPU a small expert stack where XLA measured faster (`tuned.measured_fastest`)
                          -> "xla"   (`reference.moe_w4a16_xla`: gathered, dense or looped over touched experts).
Shared device-side grouping: `grouping.py`; tiles: `tuned.py`. Only the routed part: the shared expert
stays a plain `swiglu` in the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.core import Tracer  # still public in jax 0.11; jax has no other concreteness test

from pallas_kernels import dispatch
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from pallas_kernels.moe_w4a16.grouping import Grouping, group_assignments, max_row_tiles
from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_moe_w4a16_mgpu, interpret_configs
from pallas_kernels.moe_w4a16.reference import grouped_moe_w4a16_reference, moe_w4a16_xla
from pallas_kernels.moe_w4a16.triton import MoEBlockConfig, grouped_moe_w4a16_pallas
from pallas_kernels.moe_w4a16.tuned import default_config, default_mosaic_config

__all__ = [
    "Grouping", "MoEBlockConfig", "default_config", "default_mosaic_config", "group_assignments",
    "grouped_moe_w4a16", "grouped_moe_w4a16_mgpu", "grouped_moe_w4a16_reference", "max_row_tiles", "moe_w4a16_xla",
]

_ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


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
        raise ValueError(f"experts must be a dict with keys gate, up, down (INT4 weights), got {got}")
    kinds = {type(experts[n]) for n in ("gate", "up", "down")}
    if len(kinds) != 1 or not kinds <= {Int4Weight, MosaicInt4Weight}:
        raise ValueError("experts gate/up/down must all be Int4Weight or all MosaicInt4Weight, got "
                         f"{sorted(k.__name__ for k in kinds)}")
    shapes = {}
    for name in ("gate", "up", "down"):
        try:
            shapes[name] = experts[name].check()  # (N, K)
        except ValueError as e:
            raise ValueError(f"experts[{name!r}]: {e}") from None
        if len(experts[name].lead_shape) != 1:
            raise ValueError(f"experts[{name!r}] must be stacked over one expert axis [E, N, ...], got lead "
                             f"shape {experts[name].lead_shape}")
    num_experts = experts["gate"].lead_shape[0]
    hidden = x.shape[1]
    inter = shapes["gate"][0]
    want = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for name in ("gate", "up", "down"):
        if experts[name].lead_shape[0] != num_experts:
            raise ValueError(f"experts[{name!r}] has {experts[name].lead_shape[0]} experts, gate has {num_experts}")
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
    if not isinstance(expert_ids, Tracer):
        lo, hi = int(jnp.min(expert_ids)), int(jnp.max(expert_ids))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")
    return num_experts, hidden, inter


def grouped_moe_w4a16(x: jax.Array, experts: dict, expert_ids: jax.Array, weights: jax.Array, *,
                      impl: str = "auto", interpret: bool = False, config: MoEBlockConfig | None = None,
                      out_dtype=None) -> jax.Array:
    """sum_j weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]) -> [T, D] in out_dtype (default x.dtype).

    x [T, D] bf16|f32 (the Mosaic kernel: bf16 only); experts {"gate","up"}: [E, I, D], {"down"}: [E, D, I]
    as stacked Int4Weight or MosaicInt4Weight; expert_ids [T, k] int32 in [0, E) (checked when concrete;
    under jit an out-of-range id is undefined behaviour); weights [T, k] float (accumulated in float32).
    impl: "auto" | "triton" | "mosaic_gpu" | "xla" (pallas_kernels.dispatch; a kernel that cannot run here,
    or whose layout the experts are not in, raises KernelUnavailableError).
    config: tiles for the Triton kernel (default: `default_config`)."""
    _, hidden, inter = _check_inputs(x, experts, expert_ids, weights)
    choice = dispatch.choose_moe(experts, act_dtype=x.dtype, impl=impl, interpret=interpret)
    if choice.impl == "xla":
        return moe_w4a16_xla(x, experts, expert_ids, weights, out_dtype=out_dtype)
    if choice.impl == "mosaic_gpu":
        kwargs = interpret_configs() if interpret else {}
        return grouped_moe_w4a16_mgpu(x, experts, expert_ids, weights,
                                      out_dtype=jnp.dtype(out_dtype or x.dtype), **kwargs)
    cfg = config or default_config(x.shape[0], hidden, inter)
    for dim, name, block in ((inter, "I", cfg.block_n_up), (hidden, "D", cfg.block_k_up),
                             (hidden, "D", cfg.block_n_down), (inter, "I", cfg.block_k_down)):
        if dim % block:
            raise ValueError(f"{name}={dim} must be divisible by the tile {block} of {cfg}")
    return grouped_moe_w4a16_pallas(x, experts, expert_ids, weights, cfg=cfg, interpret=interpret,
                                    out_dtype=None if out_dtype is None else jnp.dtype(out_dtype))
