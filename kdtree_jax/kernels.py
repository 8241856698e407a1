"""Which kernel each op of a model runs, for given params, device and `Kernels` choice: one plan, asked of
pallas_kernels.dispatch (the one place that decides), and the one-time conversion it implies.

    kernels = kj.Kernels()                                # or e.g. kj.Kernels(attention="xla")
    params = kj.prepare_params(params, cfg, kernels)      # routed experts to the Mosaic layout where it runs
    kj.kernel_plan(params, cfg, kernels=kernels)          # {"attention": ("triton", "GPU"), ...}
    out = kj.generate(cfg, params, prompts, kernels=kernels)

Ops: "attention" (tree-masked MLA over the latent cache), "linear" (dense INT4 linears), "moe" (routed
experts), "tree" (the DDTree tree build), "mla" (the cached MLA's projections: folded or separate). Kernel names:
those of pallas_kernels.dispatch.IMPLS, or "none" when the model has no such op.
"""

from __future__ import annotations

from typing import Any

import jax

from kdtree_jax import sharding
from kdtree_jax.config import ModelConfig
from kdtree_jax.model import mla_choice
from kdtree_jax.quantize import to_mosaic_experts
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight, is_quantized

OPS = ("attention", "linear", "moe", "tree", "mla")
Plan = dict[str, tuple[str, str]]


def _leaves_with_paths(params: dict) -> list[tuple[tuple[str, ...], Any]]:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
    return [(tuple(str(getattr(k, "key", k)) for k in path), leaf) for path, leaf in flat]


def _moe_experts(params: dict, cfg: ModelConfig) -> dict | None:
    """The first MoE layer's routed experts as {"gate", "up", "down"} (typed), or None without MoE layers."""
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            experts = params[f"layers_{layer}"]["moe"]["experts"]
            return {name: experts[name] for name in ("gate", "up", "down")}
    return None


def _moe_layout(experts: dict, act_dtype, cfg: ModelConfig, kernels: Kernels, device) -> dispatch.Choice | None:
    """The layout choice for canonical INT4 experts, or None when they are not canonical INT4."""
    if not isinstance(experts["gate"], Int4Weight):
        return None
    return dispatch.choose_moe_layout(act_dtype=act_dtype, scale_dtype=experts["gate"].scale.dtype,
                                      hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size, impl=kernels.moe,
                                      device=device, interpret=kernels.interpret,
                                      num_experts=experts["gate"].lead_shape[0])


def kernel_plan(params: dict, cfg: ModelConfig, device=None, kernels: Kernels | None = None,
                sharded: bool | None = None) -> Plan:
    """{op: (kernel, reason)} for every op of the model, as `generate(..., kernels=kernels)` will run them on
    `device` (default the first JAX device) after `prepare_params(params, cfg, kernels, device)`.

    params may be concrete or abstract (shapes and dtypes only, e.g. a checkpoint's tensor index).
    sharded: whether generate runs the target over a device mesh (its `mesh=`), which keeps the MLA projections
    separate; None: whether a mesh is active (`kdtree_jax.sharding.active_mesh`), as inside generate.
    Raises KernelUnavailableError when `kernels` asks for a kernel that cannot run there."""
    kernels = dispatch.as_kernels(kernels)
    device = device or dispatch.default_device()
    act_dtype = params["embed_tokens"].dtype
    plan: Plan = {}

    attention = dispatch.choose_attention(latent_dim=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
                                          impl=kernels.attention, device=device, interpret=kernels.interpret,
                                          num_heads=cfg.num_attention_heads, dtype=act_dtype)
    plan["attention"] = (attention.impl, attention.reason)

    linears = [(path, leaf) for path, leaf in _leaves_with_paths(params)
               if is_quantized(leaf) and "experts" not in path]
    if not linears:
        plan["linear"] = ("none", "no INT4 dense weights")
    else:
        choices = {dispatch.choose_linear(leaf, impl=kernels.linear, device=device, interpret=kernels.interpret)
                   for _, leaf in linears}
        choice = sorted(choices, key=lambda c: c.impl)[0]  # one rule for all of them: one choice
        plan["linear"] = (choice.impl, f"{choice.reason}; {len(linears)} INT4 weights")

    experts = _moe_experts(params, cfg)
    if experts is None:
        plan["moe"] = ("none", "no MoE layers")
    elif not is_quantized(experts["gate"]):
        if kernels.moe in ("triton", "mosaic_gpu"):
            raise dispatch.KernelUnavailableError(f"moe impl={kernels.moe!r} needs INT4 routed experts; this model "
                                                  "has dense experts")
        plan["moe"] = ("xla", "dense experts (not INT4)")
    else:
        layout = _moe_layout(experts, act_dtype, cfg, kernels, device)
        note = ""
        if layout is not None and layout.impl == "mosaic_gpu":
            experts = jax.eval_shape(lambda e: {k: w.to_mosaic() for k, w in e.items()}, experts)
            note = "experts converted to the Mosaic layout once at load; "
        choice = dispatch.choose_moe(experts, act_dtype=act_dtype, impl=kernels.moe, device=device,
                                     interpret=kernels.interpret)
        if (layout is not None and layout.impl != "mosaic_gpu" and layout.reason not in ("asked for", choice.reason)
                and dispatch.is_gpu(device)):
            note = f"Mosaic GPU kernel not used: {layout.reason}; "
        plan["moe"] = (choice.impl, note + choice.reason)

    # the DDTree tree build (every budget the engine accepts fits the kernel)
    tree = dispatch.choose_tree(budget=1, depth_count=1, impl=kernels.tree, device=device, interpret=kernels.interpret)
    plan["tree"] = (tree.impl, tree.reason)
    if sharded is None:
        sharded = sharding.active_mesh() is not None
    mla = mla_choice(cfg, params, kernels, sharded)  # as generate's model.fold_params decides
    plan["mla"] = (mla.impl, mla.reason)
    return plan


def plan_summary(plan: Plan) -> str:
    """One line: 'attention triton (GPU), linear none (...), moe mosaic_gpu (...)'."""
    return ", ".join(f"{op} {kernel} ({reason})" for op, (kernel, reason) in plan.items())


def prepare_params(params: dict, cfg: ModelConfig, kernels: Kernels | None = None, device=None) -> dict:
    """The params the chosen kernels run on: canonical INT4 routed experts converted once to the Mosaic GPU
    layout where pallas_kernels.dispatch.choose_moe_layout picks it (kernels.moe "auto" on a Hopper GPU
    with bf16 params, or "mosaic_gpu", which raises KernelUnavailableError where it cannot run); otherwise
    `params` unchanged. Call once after loading; save the params you loaded, not these."""
    kernels = dispatch.as_kernels(kernels)
    device = device or dispatch.default_device()
    experts = _moe_experts(params, cfg)
    if experts is None or not isinstance(experts["gate"], Int4Weight):
        if kernels.moe == "mosaic_gpu" and (experts is None or not isinstance(experts["gate"], MosaicInt4Weight)):
            raise dispatch.KernelUnavailableError("moe impl='mosaic_gpu' needs INT4 routed experts; this model has "
                                                  + ("no MoE layers" if experts is None else "dense experts"))
        return params
    layout = _moe_layout(experts, params["embed_tokens"].dtype, cfg, kernels, device)
    assert layout is not None  # None only for experts that are not canonical INT4, returned above
    return to_mosaic_experts(params, cfg) if layout.impl == "mosaic_gpu" else params
