"""Which kernel each op of a model runs, for given params, device and `Kernels` choice: one plan, asked of
pallas_kernels.dispatch (the one place that decides), and the one-time conversion it implies.

    kernels = kj.Kernels()                                # or e.g. kj.Kernels(attention="xla")
    params = kj.prepare_params(params, cfg, kernels)      # INT4 weights to the Mosaic layout where it runs
    kj.kernel_plan(params, cfg, kernels=kernels)          # {"attention": ("xla", "no GPU, this is cpu"), ...}
    out = kj.generate(cfg, params, prompts, kernels=kernels)

Ops: "attention" (tree-masked MLA over the latent cache), "linear" (dense INT4 linears), "moe" (routed
experts), "tree" (the DDTree tree build), "mla" (the cached MLA's projections: folded or separate). Kernel names:
those of pallas_kernels.dispatch.IMPLS, or "none" when the model has no such op.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer  # still public in jax 0.11; jax has no other concreteness test
from jax.sharding import NamedSharding

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


def _dense_int4(params: dict) -> list[tuple[tuple[str, ...], Any]]:
    """(path, leaf) of every INT4 weight outside the routed experts: the dense linears (dense-layer MLPs, shared
    experts) a policy like "experts+shared" or "all_mlp" quantized."""
    return [(path, leaf) for path, leaf in _leaves_with_paths(params) if is_quantized(leaf) and "experts" not in path]


def _linear_layout(leaf: Int4Weight, act_dtype, kernels: Kernels, device) -> dispatch.Choice:
    return dispatch.choose_linear_layout(act_dtype=act_dtype, scale_dtype=leaf.scale.dtype,
                                         in_features=leaf.in_features, out_features=leaf.out_features,
                                         impl=kernels.linear, device=device, interpret=kernels.interpret)


def _linear_plan(leaves: list, act_dtype, kernels: Kernels, device, sharded: bool) -> tuple[str, str]:
    """The dense INT4 linears' (kernel, reason) after prepare_params, for decode-size calls (a call of more than
    dispatch.LINEAR_MAX_ROWS rows, a long prefill, runs XLA). Mixed: the Mosaic kernel, with the count on each.
    sharded: the weights sit on a mesh (prepare_params keeps them canonical: XLA)."""
    runs: dict[str, list[str]] = {}
    for leaf in leaves:
        reason = None
        if isinstance(leaf, Int4Weight):
            layout = _linear_layout(leaf, act_dtype, kernels, device)
            if layout.impl == "mosaic_gpu" and sharded:
                if kernels.linear == "mosaic_gpu":
                    raise dispatch.KernelUnavailableError("linear impl='mosaic_gpu' cannot run INT4 dense weights "
                                                          "sharded over a mesh; use the XLA path (impl 'xla')")
                reason = "sharded over a mesh"
            elif layout.impl == "mosaic_gpu":
                leaf = jax.eval_shape(Int4Weight.to_mosaic, leaf)
            else:
                reason = layout.reason
        choice = dispatch.choose_linear(leaf, impl=kernels.linear, device=device, interpret=kernels.interpret,
                                        act_dtype=act_dtype)
        runs.setdefault(choice.impl, []).append(reason or choice.reason)
    total = len(leaves)
    if set(runs) == {"xla"}:
        return "xla", f"{runs['xla'][0]}; {total} INT4 weights"
    mosaic = f"{runs['mosaic_gpu'][0]}; {len(runs['mosaic_gpu'])} of {total} INT4 weights converted to the Mosaic " \
             "layout once at load"
    if "xla" in runs:
        mosaic += f", {len(runs['xla'])} on XLA ({runs['xla'][0]})"
    return "mosaic_gpu", mosaic


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

    if sharded is None:
        sharded = sharding.active_mesh() is not None
    linears = _dense_int4(params)
    if not linears:
        plan["linear"] = ("none", "no INT4 dense weights")
    else:
        plan["linear"] = _linear_plan([leaf for _, leaf in linears], act_dtype, kernels, device, sharded)

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
    mla = mla_choice(cfg, params, kernels, sharded)  # as generate's model.fold_params decides
    plan["mla"] = (mla.impl, mla.reason)
    return plan


def plan_summary(plan: Plan) -> str:
    """One line: 'attention mosaic_gpu (Hopper GPU), linear none (...), moe mosaic_gpu (...)'."""
    return ", ".join(f"{op} {kernel} ({reason})" for op, (kernel, reason) in plan.items())


def prepare_params(params: dict, cfg: ModelConfig, kernels: Kernels | None = None, device=None) -> dict:
    """The params the chosen kernels run on, converted once: canonical INT4 routed experts to the Mosaic GPU
    layout where pallas_kernels.dispatch.choose_moe_layout picks it, and INT4 dense weights (shared experts,
    dense-layer MLPs) where choose_linear_layout picks it (auto on a Hopper GPU with bf16 params; an explicit
    "mosaic_gpu" raises KernelUnavailableError where it cannot run), and float32 routers that hold bf16 values (a
    checkpoint's) in the activations' dtype (`prepare_routers`); what no rule converts stays as it is. Dense
    weights placed on a device mesh stay canonical (the Mosaic layout has no sharding rule for them: they run
    XLA). Call once after loading; save the params you loaded, not these."""
    kernels = dispatch.as_kernels(kernels)
    device = device or dispatch.default_device()
    return prepare_routers(_prepare_linears(_prepare_experts(params, cfg, kernels, device), kernels, device), cfg)


def prepare_routers(params: dict, cfg: ModelConfig) -> dict:
    """(A step of prepare_params.) Each MoE layer's float32 router in the activations' dtype where every one of its
    values is a number of that dtype: a K2.x / DeepSeek-V3 checkpoint stores its routers in bf16 (kdtree_jax.hf reads
    them into float32). The model computes its logits from the same values (products of two bf16 are exact in
    float32, summed in float32) and, on one device, as part of one product x @ [router | shared gate | shared up]
    (model.MoE; folded: its moe/"entry"). A router with float32 values (one trained here) stays as it is, as does a
    router known only by shape (abstract params)."""
    act_dtype = jnp.dtype(params["embed_tokens"].dtype)
    if act_dtype == jnp.float32 or not jnp.issubdtype(act_dtype, jnp.floating):
        return params
    out = params
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            continue
        moe: dict = params[f"layers_{layer}"]["moe"]
        router = moe["router"]
        if (isinstance(router, Tracer) or not isinstance(router, jax.Array | np.ndarray)
                or router.dtype != jnp.float32):
            continue
        rounded = router.astype(act_dtype)
        if not bool(jnp.all(rounded.astype(jnp.float32) == router)):
            continue
        if out is params:
            out = dict(params)
        out[f"layers_{layer}"] = {**params[f"layers_{layer}"], "moe": {**moe, "router": rounded}}
    return out


def _prepare_experts(params: dict, cfg: ModelConfig, kernels: Kernels, device) -> dict:
    experts = _moe_experts(params, cfg)
    if experts is None or not isinstance(experts["gate"], Int4Weight):
        if kernels.moe == "mosaic_gpu" and (experts is None or not isinstance(experts["gate"], MosaicInt4Weight)):
            raise dispatch.KernelUnavailableError("moe impl='mosaic_gpu' needs INT4 routed experts; this model has "
                                                  + ("no MoE layers" if experts is None else "dense experts"))
        return params
    layout = _moe_layout(experts, params["embed_tokens"].dtype, cfg, kernels, device)
    assert layout is not None  # None only for experts that are not canonical INT4, returned above
    return to_mosaic_experts(params, cfg) if layout.impl == "mosaic_gpu" else params


def _prepare_linears(params: dict, kernels: Kernels, device) -> dict:
    act_dtype = params["embed_tokens"].dtype
    convert = jax.jit(Int4Weight.to_mosaic)

    def prepare(path, leaf):
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        if not isinstance(leaf, Int4Weight) or "experts" in keys:
            return leaf
        if _linear_layout(leaf, act_dtype, kernels, device).impl != "mosaic_gpu":
            return leaf
        if isinstance(getattr(leaf.qweight, "sharding", None), NamedSharding):
            if kernels.linear == "mosaic_gpu":
                raise dispatch.KernelUnavailableError(f"linear impl='mosaic_gpu' cannot run {'/'.join(keys)}: it is "
                                                      "sharded over a mesh, which the dense Mosaic layout does not "
                                                      "support; use the XLA path (impl 'xla')")
            return leaf
        converted.append("/".join(keys))
        return convert(leaf)

    converted: list[str] = []
    out = jax.tree_util.tree_map_with_path(prepare, params, is_leaf=is_quantized)
    return out if converted else params  # nothing to convert: the very params given
