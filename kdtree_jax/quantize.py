"""Turning a dense params tree into the INT4 (W4A16 group-32) one, by an explicit policy.

Policies (which [in, out] weights become `Int4Weight`s; everything else stays dense):
  "experts"  - routed experts only: exactly what Kimi K2-Thinking / K2.5 / K2.6 ship;
  "experts+shared" - routed and shared experts;
  "all_mlp"  - routed experts, shared experts and the dense first-layer MLPs.
MLA projections, the router, norms, embeddings and lm_head always stay dense.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdtree_jax.config import ModelConfig
from kdtree_jax.sharding import leaf_spec
from pallas_kernels import dispatch
from pallas_kernels.int4 import GROUP_SIZE, SCALE_DTYPES, Int4Weight, MosaicInt4Weight

POLICIES = {
    "experts": ("experts",),
    "experts+shared": ("experts", "shared"),
    "all_mlp": ("experts", "shared", "mlp"),
}


def _targets(params: dict, cfg: ModelConfig, policy: str):
    """Yield (layer name, container key path, weight dict) for every MLP block the policy covers."""
    if policy not in POLICIES:
        raise ValueError(f"unknown quantization policy {policy!r}: choose one of {sorted(POLICIES)}")
    groups = POLICIES[policy]
    for layer in range(cfg.num_hidden_layers):
        name = f"layers_{layer}"
        block = params[name]
        if cfg.is_moe_layer(layer):
            if "experts" in groups:
                yield name, ("moe", "experts")
            if "shared" in groups and "shared" in block["moe"]:
                yield name, ("moe", "shared")
        elif "mlp" in groups:
            yield name, ("mlp",)


def quantize(params: dict, cfg: ModelConfig, policy: str = "experts", scale_dtype=jnp.bfloat16) -> dict:
    """A copy of `params` whose policy-covered gate/up/down weights are `Int4Weight`s (one scale per
    32 input columns, symmetric, scale = max|w| / 7). Input dims must be divisible by 32."""
    if jnp.dtype(scale_dtype) not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be bfloat16 or float32, got {jnp.dtype(scale_dtype).name}")
    out = jax.tree.map(lambda x: x, params)  # a fresh nested-dict copy
    for name, keys in _targets(params, cfg, policy):
        container = out[name]
        for key in keys:
            container = container[key]
        for weight in ("gate", "up", "down"):
            w = container[weight]
            where = f"{name}/{'/'.join(keys)}/{weight}"
            if isinstance(w, Int4Weight):
                raise ValueError(f"{where} is already INT4: quantize a dense params tree")
            if w.shape[-2] % GROUP_SIZE:
                raise ValueError(f"{where}: input dim {w.shape[-2]} is not divisible by the INT4 group "
                                 f"size {GROUP_SIZE}")
            container[weight] = Int4Weight.from_dense(w, scale_dtype)
    return out


def _routed_experts(params: dict, cfg: ModelConfig) -> list[tuple[str, dict]]:
    """(layer name, {"gate", "up", "down"}) of every MoE layer's routed experts."""
    return [(name, params[name]["moe"]["experts"]) for name, _ in _targets(params, cfg, "experts")]


def mosaic_moe_unsupported(params: dict, cfg: ModelConfig, device=None) -> str | None:
    """Why the routed experts should not be converted to the Mosaic GPU layout here, or None when they
    should (what kj.prepare_params and `kdtree-jax generate --moe-kernel auto` do): the rule is
    pallas_kernels.dispatch.choose_moe_layout (a Hopper GPU `device`, default the first JAX device; bf16
    activations; bf16 INT4 scales; expert dims multiples of 64; a stack too large for XLA's small-stack forms),
    asked for canonical INT4 routed experts."""
    layers = _routed_experts(params, cfg)
    if not layers:
        return "the model has no MoE layers"
    for _, experts in layers:
        for weight in ("gate", "up", "down"):
            if not isinstance(experts[weight], Int4Weight):
                return "the routed experts are not canonical INT4 weights (Int4Weight, the checkpoint layout)"
    scale_dtype = layers[0][1]["gate"].scale.dtype
    choice = dispatch.choose_moe_layout(act_dtype=params["embed_tokens"].dtype, scale_dtype=scale_dtype,
                                        hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size, device=device,
                                        num_experts=layers[0][1]["gate"].lead_shape[0])
    return None if choice.impl == "mosaic_gpu" else choice.reason


def to_mosaic_experts(params: dict, cfg: ModelConfig) -> dict:
    """A copy of INT4 `params` whose routed experts are in the Mosaic GPU kernel layout (MosaicInt4Weight):
    the dispatcher then runs the Mosaic GPU grouped kernel for them (pallas_kernels/moe_w4a16/mosaic_gpu.py;
    a Hopper GPU, bf16 activations). A one-time pass over the expert weights (same bytes: int4 [E, N, K]
    plus bf16 scales transposed to [E, K/32, N]); do it once after loading, not per call (kj.prepare_params
    decides when). Experts sharded over a mesh stay on it, placed by the Mosaic layout's sharding rules
    (kdtree_jax.sharding.leaf_spec), so no generate(mesh=...) call moves them again. Checkpoints keep the
    canonical layout: save the params you loaded, not these."""
    if (why := dispatch.mosaic_moe_shape_unsupported(cfg.hidden_size, cfg.moe_intermediate_size)) is not None:
        raise ValueError(f"the Mosaic GPU MoE kernel cannot run this model's experts: {why}")
    convert = jax.jit(Int4Weight.to_mosaic)
    out = jax.tree.map(lambda x: x, params)  # a fresh nested-dict copy
    converted = 0
    for name, experts in _routed_experts(out, cfg):
        for weight in ("gate", "up", "down"):
            leaf = experts[weight]
            where = f"{name}/moe/experts/{weight}"
            if isinstance(leaf, MosaicInt4Weight):
                raise ValueError(f"{where} is already in the Mosaic layout")
            if not isinstance(leaf, Int4Weight):
                raise ValueError(f"{where} is not INT4: quantize the experts first (kj.quantize)")
            converted_leaf = convert(leaf)
            placed = getattr(leaf.qweight, "sharding", None)
            if isinstance(placed, NamedSharding):  # keep it on its mesh, in the layout's own shardings
                specs = leaf_spec((name, "moe", "experts", weight), converted_leaf)
                shardings = jax.tree.map(lambda s, m=placed.mesh: NamedSharding(m, s), specs,
                                         is_leaf=lambda x: isinstance(x, P))
                converted_leaf = jax.device_put(converted_leaf, shardings)
            experts[weight] = converted_leaf
            converted += 1
    if not converted:
        raise ValueError("the model has no MoE layers: nothing to convert")
    return out
