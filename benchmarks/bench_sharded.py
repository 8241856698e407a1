"""The target sharded over several GPUs: the MoE token exchange per token count, decode tokens/s
(AR and DDTree) and the memory plan. Written for nvidia-h200-x2; tested on 8 fake CPU devices.

    # 2 H200s: a K2.6-width INT4 model with as many layers as fit (random weights made on the devices)
    python benchmarks/bench_sharded.py --mesh expert=2,tensor=1 --out benchmarks/results/sharded_h200x2.json
    python benchmarks/bench_sharded.py --mesh expert=1,tensor=2 --out benchmarks/results/sharded_h200x2_tp.json
    # CPU smoke test (tests/test_sharding.py)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python benchmarks/bench_sharded.py --tiny --mesh expert=2,tensor=2

MoE exchange, for T tokens entering one MoE layer (jitted alone, median of --repeats):
  all_reduce  what the model runs (kdtree_jax.model.moe_sharded): tokens replicated, every shard runs its
              local experts, one psum over all devices (= reduce-scatter + all-gather);
  all_to_all  tokens split over the expert axis, each (token, choice) sent to the shard owning the expert
              (dropless: capacity = local tokens * top-k), results sent back, then an all-gather so the
              output is replicated again like the attention input needs.
Decode: one `generate` per method on the mesh; DDTree uses an OracleDraft holding the AR continuation
(random weights have no trained drafter), i.e. the acceptance upper bound at this budget.
Timing: benchmarks/common.py Timer, wall clock only (CUPTI would sum every device's kernels). The JSON
carries the run's metadata under "meta" (device, JAX, date, git commit, command).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import kdtree_jax as kj  # noqa: E402
from benchmarks.common import Timer, metadata, random_params, write_json, write_markdown, write_png  # noqa: E402
from kdtree_jax import checkpoint, sharding  # noqa: E402
from kdtree_jax.ddtree import OracleDraft  # noqa: E402
from kdtree_jax.layers import swiglu  # noqa: E402
from kdtree_jax.linear import linear  # noqa: E402
from kdtree_jax.model import (  # noqa: E402
    _routed_experts_f32,
    init_params,  # noqa: E402
    moe_sharded,
    route,
)
from pallas_kernels.int4 import MosaicInt4Weight  # noqa: E402


# ----------------------------------------------------------------------------------------- models
def int4_expert_meta(cfg) -> dict:
    return {"quantization": {"int4_leaves": {f"layers_{i}/moe/experts/{w}": "bfloat16"
                                             for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
                                             for w in ("gate", "up", "down")}}}


def abstract_params(cfg, dtype=jnp.bfloat16, moe_layout="canonical"):
    """ShapeDtypeStructs of an INT4-expert target; moe_layout "mosaic": the routed experts in the Mosaic
    GPU kernel's layout (pallas_kernels.int4.MosaicInt4Weight), as kj.to_mosaic_experts would leave them."""
    abstract = checkpoint._abstract_target(cfg, dtype, int4_expert_meta(cfg))
    if moe_layout == "mosaic":
        for layer in range(cfg.num_hidden_layers):
            if cfg.is_moe_layer(layer):
                experts = abstract[f"layers_{layer}"]["moe"]["experts"]
                for w, leaf in experts.items():
                    lead, n, k = leaf.lead_shape, leaf.out_features, leaf.in_features
                    experts[w] = MosaicInt4Weight(jax.ShapeDtypeStruct((*lead, n, k), jnp.int4),
                                                  jax.ShapeDtypeStruct((*lead, k // 32, n), jnp.bfloat16))
    return abstract


def random_params_on_mesh(cfg, mesh, dtype=jnp.bfloat16, moe_layout="canonical"):
    """Random INT4-expert params generated inside one jit straight into their shardings: no device and
    no host ever holds the whole model. moe_layout: as in `abstract_params`."""
    abstract = abstract_params(cfg, dtype, moe_layout)
    return random_params(abstract, jax.random.key(0), sharding.param_shardings(cfg, abstract, mesh))


def k26_width(layers: int):
    cfg = kj.ModelConfig.kimi_k26()
    return cfg.replace(num_hidden_layers=layers, first_k_dense_replace=min(1, layers))


def memory_plan(cfg, mesh_sizes: dict, hbm_bytes: float, cache_dtype_bytes: int = 2) -> dict:
    """Params per device (this layout), the replicated latent cache per token, and the tokens that fit."""
    params = sharding.params_bytes_per_device(abstract_params(cfg), mesh_sizes)
    per_token = cfg.num_hidden_layers * cfg.latent_dim * cache_dtype_bytes
    usable = 0.9 * hbm_bytes  # XLA workspace, activations, fragmentation
    return {"params_bytes_per_device": params, "latent_cache_bytes_per_token": per_token,
            "hbm_bytes": hbm_bytes, "cache_tokens_that_fit": max(0, int((usable - params) // per_token))}


def layers_that_fit(mesh_sizes: dict, hbm_bytes: float, reserve_tokens: int) -> int:
    layers = 1
    while layers < 61:
        plan = memory_plan(k26_width(layers + 1), mesh_sizes, hbm_bytes)
        if plan["cache_tokens_that_fit"] < reserve_tokens:
            break
        layers += 1
    return layers


# ----------------------------------------------------------------------------------- MoE exchange
def moe_all_to_all(mesh, x, idx, weights, experts, shared):
    """Dropless all-to-all MoE over the expert axis (tensor axis: intermediate split + psum), output
    all-gathered to replicated. x [T, D] with T divisible by the expert axis size."""
    expert_specs = {k: sharding.leaf_spec(("experts", k), v) for k, v in experts.items()}
    shared_specs = {k: sharding.leaf_spec(("shared", k), v) for k, v in shared.items()}
    e_axis = sharding.EXPERT

    def body(x, idx, weights, experts, shared):  # x [t, D] local tokens, idx/weights [t, k]
        ne = jax.lax.axis_size(e_axis)
        local = jax.tree.leaves(experts["gate"])[0].shape[0]
        t, k = idx.shape
        owner = idx // local  # [t, k] destination shard of each choice
        pair_x = jnp.repeat(x, k, axis=0)  # [t*k, D] one slot per (token, choice)
        pair_owner, pair_expert = owner.reshape(-1), (idx % local).reshape(-1)
        dest = jnp.arange(ne)[:, None] == pair_owner[None, :]  # [ne, t*k]
        send = jnp.where(dest[..., None], pair_x[None], 0).astype(x.dtype)  # [ne, t*k, D]
        send_ids = jnp.where(dest, pair_expert[None], 0)
        send_on = dest.astype(jnp.float32)
        recv = jax.lax.all_to_all(send, e_axis, 0, 0, tiled=False)  # [ne, t*k, D] from each source
        recv_ids = jax.lax.all_to_all(send_ids, e_axis, 0, 0, tiled=False)
        recv_on = jax.lax.all_to_all(send_on, e_axis, 0, 0, tiled=False)
        slots = recv.reshape(-1, x.shape[-1])
        y = _routed_experts_f32(slots, experts, recv_ids.reshape(-1, 1), recv_on.reshape(-1, 1))
        y = jax.lax.psum(y, sharding.TENSOR).reshape(recv.shape)  # intermediate split over tensor
        back = jax.lax.all_to_all(y, e_axis, 0, 0, tiled=False)  # [ne, t*k, D] at the source
        per_choice = back.sum(0).reshape(t, k, -1)  # only the owner's slot is non-zero
        out = jnp.einsum("tkd,tk->td", per_choice, weights)
        if shared:
            s = swiglu(x, shared["gate"], shared["up"], shared["down"], linear=linear).astype(jnp.float32)
            out = out + jax.lax.psum(s, sharding.TENSOR)
        return jax.lax.all_gather(out, e_axis, axis=0, tiled=True)  # [T, D] replicated

    tok = P(e_axis)
    out = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, expert_specs, shared_specs), out_specs=P(),
                        check_vma=False)(x, idx, weights, experts, shared)
    return out.astype(x.dtype)


def time_fn(fn, args, repeats: int) -> float:
    """Median wall milliseconds per call (after a compile call)."""
    return Timer(repeats, device=False)(fn, *args).wall_s * 1e3


def bench_moe_exchange(cfg, params, mesh, token_counts, repeats) -> list[dict]:
    layer = next(f"layers_{i}" for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    moe = params[layer]["moe"]
    experts, shared = moe["experts"], moe.get("shared", {})
    dtype = params["embed_tokens"].dtype
    ne = mesh.shape[sharding.EXPERT]
    rows = []
    for tokens in token_counts:
        padded = -(-tokens // ne) * ne  # all-to-all splits tokens over the expert axis
        x = jax.random.normal(jax.random.key(tokens), (padded, cfg.hidden_size), jnp.float32).astype(dtype)
        valid = (jnp.arange(padded) < tokens)[:, None]

        def routed(x, moe, fn, valid=valid):
            idx, w = route(cfg, x, moe["router"], moe["router_bias"])
            return fn(mesh, x, idx, jnp.where(valid, w, 0.0), moe["experts"], moe.get("shared", {}))

        with jax.set_mesh(mesh):
            all_reduce = jax.jit(lambda x, moe: routed(x, moe, moe_sharded))
            all_to_all = jax.jit(lambda x, moe: routed(x, moe, moe_all_to_all))
            a = np.asarray(all_reduce(x, moe), np.float32)[:tokens]
            b = np.asarray(all_to_all(x, moe), np.float32)[:tokens]
            row = {"tokens": tokens, "all_reduce_ms": time_fn(all_reduce, (x, moe), repeats),
                   "all_to_all_ms": time_fn(all_to_all, (x, moe), repeats),
                   "max_abs_diff": float(np.abs(a - b).max()), "max_abs": float(np.abs(a).max())}
        row["winner"] = "all_reduce" if row["all_reduce_ms"] <= row["all_to_all_ms"] else "all_to_all"
        print(f"  MoE T={tokens:4d}: all_reduce {row['all_reduce_ms']:8.3f} ms  "
              f"all_to_all {row['all_to_all_ms']:8.3f} ms"
              f"  ({row['winner']}; max |diff| {row['max_abs_diff']:.2e})", flush=True)
        rows.append(row)
    del experts, shared
    return rows


def bench_verify(cfg, params, mesh, token_counts, context, repeats) -> list[dict]:
    """One DDTree verify forward (the model's `forward_with_cache`: T new tokens under a tree mask over
    a latent cache holding `context` committed rows), jitted alone on `mesh`; per layer = total / layers
    (the lm_head and embedding are included in the total, so this slightly overstates a layer)."""
    from kdtree_jax.model import forward_with_cache, init_cache  # noqa: PLC0415

    rng = np.random.default_rng(1)
    dtype = params["embed_tokens"].dtype
    rows = []
    for t in token_counts:
        cache = init_cache(cfg, 1, context + t, dtype)
        cache = sharding.replicate(cache._replace(lengths=jnp.full((1,), context, jnp.int32)), mesh)
        tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, t)), jnp.int32)
        positions = context + jnp.arange(t, dtype=jnp.int32)[None]
        parents = np.concatenate([[-1], rng.integers(0, np.arange(1, t))]) if t > 1 else np.array([-1])
        vis = np.eye(t, dtype=bool)
        for i in range(1, t):  # a random tree: row i sees itself and its parent's row
            vis[i] |= vis[parents[i]]
        with jax.set_mesh(mesh):
            fn = jax.jit(lambda p, tok, pos, c, v: forward_with_cache(p, cfg, tok, pos, c, v)[0])
            ms = time_fn(fn, (params, tokens, positions, cache, jnp.asarray(vis)[None]), repeats)
        row = {"tokens": t, "context": context, "layers": cfg.num_hidden_layers, "verify_ms": ms,
               "per_layer_ms": ms / cfg.num_hidden_layers}
        print(f"  verify T={t:4d} S={context}: {ms:8.3f} ms, {row['per_layer_ms']:.3f} ms/layer "
              f"({cfg.num_hidden_layers} layers)", flush=True)
        rows.append(row)
        del cache
    return rows


def bench_collective(mesh, hidden, token_counts, loops=50) -> list[dict]:
    """The MoE layer's collective alone: a psum of the [T, hidden] float32 partial outputs over every
    mesh axis (what `moe_sharded` runs once per MoE layer), `loops` of them chained inside one jit so the
    launch cost is amortised."""
    from jax import lax  # noqa: PLC0415

    axes = tuple(mesh.axis_names)
    rows = []
    for t in token_counts:
        x = sharding.replicate(jnp.ones((t, hidden), jnp.float32), mesh)

        def chained(x):
            return lax.fori_loop(0, loops, lambda i, y: lax.psum(y, axes) * 0.5, x)

        fn = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=P(), out_specs=P()))
        ms = time_fn(fn, (x,), 3) / loops
        rows.append({"tokens": t, "psum_ms": ms, "bytes": t * hidden * 4})
        print(f"  psum [{t}, {hidden}] f32 over {sharding.describe(mesh)}: {ms * 1e3:8.1f} us", flush=True)
    return rows


def bench_rounds(cfg, params, mesh, contexts, budgets, iters) -> list[dict]:
    """One DDTree round stage by stage on the mesh (benchmarks/profile_round.py: AR step; draft; per budget
    tree build, verify, accept + compact) with a random one-layer DFlash drafter at the target's width,
    from a synthetic state at each committed context (random latent cache, no prefill). Wall clock."""
    from benchmarks.profile_round import profile_stages, synthetic_state  # noqa: PLC0415
    from kdtree_jax.ddtree import DFlashDraft  # noqa: PLC0415
    from kdtree_jax.drafter import DrafterConfig, init_drafter_params  # noqa: PLC0415

    dtype = params["embed_tokens"].dtype
    dcfg = DrafterConfig.for_target(cfg, num_layers=1, block_size=16)
    dparams = jax.jit(lambda key: init_drafter_params(dcfg, key, dtype))(jax.random.key(11))
    draft_model = sharding.replicate(DFlashDraft(dcfg, dparams), mesh)
    rows = []
    for context in contexts:
        state = synthetic_state(cfg, params, draft_model, context, max(budgets) + 32, jax.random.key(context))
        cache, dstate, bonus = sharding.replicate(state, mesh)
        with jax.set_mesh(mesh):
            rows += profile_stages(cfg, params, draft_model, cache, dstate, bonus, budgets, iters=iters,
                                   label=f"S={context}")
        del cache, dstate
    return rows


def bench_decode(cfg, params, mesh, batch, new_tokens, budget, repeats) -> list[dict]:
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, 16)) for _ in range(batch)]
    kwargs = dict(max_new_tokens=new_tokens, stop_tokens=(), mesh=mesh)
    rows = []
    ar = None
    for method in ("ar", "ddtree"):
        extra = {}
        if method == "ddtree":
            assert ar is not None  # the "ar" method runs first
            seq = np.concatenate([np.asarray(prompts), np.asarray(ar.tokens)], axis=1)
            extra = dict(method="ddtree", drafter=OracleDraft(jnp.asarray(seq, jnp.int32), 16, cfg.vocab_size),
                         tree_budget=budget)
        timing = Timer(repeats, device=False)(
            lambda extra=extra: kj.generate(cfg, params, prompts, **kwargs, **extra))
        out, seconds = timing.out, timing.wall_s
        if method == "ar":
            ar = out
        assert ar is not None  # set on the first pass, "ar"
        row = {"method": method, "batch": batch, "new_tokens": new_tokens, "seconds": seconds,
               "tokens_per_s": batch * new_tokens / seconds, "target_forwards": int(out.num_target_forwards),
               "same_tokens_as_ar": bool(np.array_equal(np.asarray(out.tokens), np.asarray(ar.tokens)))}
        if method == "ddtree":
            row["budget"] = budget
        print(f"  {method:6s}: {row['tokens_per_s']:9.1f} tokens/s, {row['target_forwards']} target forwards, "
              f"same tokens as AR: {row['same_tokens_as_ar']}", flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mesh", help="e.g. expert=2,tensor=1 (default: expert=<all devices>)")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (2 layers, INT4 experts) for CPU tests")
    parser.add_argument("--layers", type=int, help="K2.6-width layers (default: as many as fit)")
    parser.add_argument("--hbm-gib", type=float, help="memory per device (default: read from the device, else 141)")
    parser.add_argument("--tokens", default="1,2,4,8,16,33,65,129", help="MoE exchange token counts")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=32, help="DDTree tree budget")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--verify-tokens", default="1,33,129", help="tree sizes T for the verify forward")
    parser.add_argument("--context", type=int, default=4096, help="committed cache rows for the verify forward")
    parser.add_argument("--single-gpu-layers", type=int, default=0,
                        help="after the mesh runs, time the verify forward on ONE device holding this many "
                             "layers (0: skip); the per-layer comparison with the sharded model")
    parser.add_argument("--skip-decode", action="store_true", help="skip the AR/DDTree generate timing")
    parser.add_argument("--round-contexts", default="",
                        help="committed contexts for the stage-by-stage DDTree round profile, e.g. 4096,32768 "
                             "(default: skip it)")
    parser.add_argument("--round-budgets", default="8,32,64,128", help="tree budgets of the round profile")
    parser.add_argument("--moe-kernel", choices=("auto", "mosaic", "triton"), default="auto",
                        help="routed experts in the Mosaic GPU kernel's layout (mosaic) or the checkpoint's "
                             "(triton: the Triton kernel); auto: mosaic where it can run (kj.mosaic_moe_unsupported: a "
                             "Hopper GPU, bf16), else triton")
    parser.add_argument("--out", help="write the results as JSON here (rewritten after every stage), and a "
                                      ".md table + .png plot beside it at the end")
    parser.add_argument("--report", metavar="JSON", help="no measuring: write the .md/.png of a stored result")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report)

    mesh = sharding.make_mesh(args.mesh or {"expert": len(jax.devices())})
    sizes = dict(mesh.shape)
    stats = jax.devices()[0].memory_stats() or {}
    hbm = args.hbm_gib * 2**30 if args.hbm_gib else float(stats.get("bytes_limit", 141e9))
    def use_mosaic(cfg, params) -> bool:  # auto: where the kernel can run (the K2.6 params are bf16, bf16 scales)
        return args.moe_kernel == "mosaic" or (args.moe_kernel == "auto" and kj.mosaic_moe_unsupported(params, cfg)
                                               is None)

    def tiny_params(cfg, on):
        params = kj.quantize(init_params(cfg, jax.random.key(0)), cfg)
        return sharding.shard_params(cfg, kj.to_mosaic_experts(params, cfg) if use_mosaic(cfg, params) else params, on)

    if args.tiny:
        cfg = kj.ModelConfig.tiny().replace(num_hidden_layers=2)
        params = tiny_params(cfg, mesh)
    else:
        reserve = args.batch * (16 + args.new_tokens + args.budget + 1) * 4  # cache rows, with slack
        layers = args.layers or layers_that_fit(sizes, hbm, reserve)
        cfg = k26_width(layers)
        moe_layout = "mosaic" if use_mosaic(cfg, abstract_params(cfg)) else "canonical"
        params = random_params_on_mesh(cfg, mesh, moe_layout=moe_layout)
    mosaic = isinstance(params[f"layers_{cfg.first_k_dense_replace}"]["moe"]["experts"]["gate"], MosaicInt4Weight)
    plan = memory_plan(cfg, sizes, hbm)
    print(f"{jax.devices()[0].device_kind} x{mesh.devices.size}, mesh {sharding.describe(mesh)}: "
          f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts; params "
          f"{plan['params_bytes_per_device'] / 2**30:.2f} GiB/device, cache {plan['latent_cache_bytes_per_token']} "
          f"B/token", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    verify_tokens = [int(t) for t in args.verify_tokens.split(",")]
    meta = metadata(timing="wall clock of one jitted call after a compile call, median of repeats")
    result = {"devices": int(mesh.devices.size), "mesh": sharding.describe(mesh), "config": cfg.to_dict(),
              "memory": plan, "moe_kernel": "mosaic" if mosaic else "triton (or its XLA fallback off GPU)"}

    def stage(name, fn, *fn_args):
        result[name] = fn(*fn_args)
        if args.out:
            write_json(Path(args.out).with_suffix(""), meta, result)

    stage("verify", bench_verify, cfg, params, mesh, verify_tokens, args.context, args.repeats)
    stage("collective", bench_collective, mesh, cfg.hidden_size, verify_tokens)
    stage("moe_exchange", bench_moe_exchange, cfg, params, mesh, tokens, args.repeats)
    if not args.skip_decode:
        stage("decode", bench_decode, cfg, params, mesh, args.batch, args.new_tokens, args.budget, args.repeats)
    if args.round_contexts:
        stage("rounds", bench_rounds, cfg, params, mesh, [int(c) for c in args.round_contexts.split(",")],
              [int(b) for b in args.round_budgets.split(",")], args.repeats)
    if args.single_gpu_layers:
        del params
        one = sharding.make_mesh({"expert": 1, "tensor": 1})
        cfg1 = kj.ModelConfig.tiny().replace(num_hidden_layers=args.single_gpu_layers) if args.tiny else \
            k26_width(args.single_gpu_layers)
        params1 = (tiny_params(cfg1, one) if args.tiny else
                   random_params_on_mesh(cfg1, one, moe_layout="mosaic" if mosaic else "canonical"))
        print(f"one device: {cfg1.num_hidden_layers} layers", flush=True)
        stage("verify_single_device", bench_verify, cfg1, params1, one, verify_tokens, args.context, args.repeats)
    if args.out:
        report(args.out)
    return {"meta": meta, **result}


def report(path) -> dict:
    """<stem>.md (tables) and <stem>.png (verify ms per layer, sharded vs one device) from a result JSON
    (its metadata under "meta"; results written before benchmarks/common.py carry it at the top level)."""
    stored = json.loads(Path(path).read_text())
    meta = stored.get("meta", stored)
    r = {**stored, **{k: meta.get(k) for k in ("device", "date", "jax", "timing")}}
    stem = str(Path(path).with_suffix(""))
    one = {v["tokens"]: v for v in r.get("verify_single_device", [])}
    psum = {c["tokens"]: c for c in r.get("collective", [])}
    gib = r["memory"]["params_bytes_per_device"] / 2**30
    lines = [f"# Sharded verify: {r['devices']} x {r['device']}, mesh {r['mesh']}", "",
             f"{r['date']}, JAX {r['jax']}; {r['timing']}. K2.6 width (hidden {r['config']['hidden_size']}, "
             f"{r['config']['n_routed_experts']} INT4 experts), {r['config']['num_hidden_layers']} layers sharded: "
             f"{gib:.1f} GiB of params per device; random weights made on the devices; routed MoE kernel: "
             f"{r.get('moe_kernel', 'triton')}.", "",
             "## Verify forward (T tree tokens over S committed rows), per layer", "",
             "| T | S | sharded: ms / layer | one device: ms / layer | sharded speedup per layer | "
             "MoE psum (us, once per MoE layer) | psum share of the sharded layer |", "|---|---|---|---|---|---|---|"]
    for v in r.get("verify", []):
        t = v["tokens"]
        o = one.get(t)
        c = psum.get(t)
        lines.append(f"| {t} | {v['context']} | {v['per_layer_ms']:.3f} | "
                     + (f"{o['per_layer_ms']:.3f} ({o['layers']} layers) | {o['per_layer_ms'] / v['per_layer_ms']:.2f}x"
                        if o else "- | -")
                     + (f" | {c['psum_ms'] * 1e3:.1f} | {c['psum_ms'] / v['per_layer_ms']:.1%} |" if c
                        else " | - | - |"))
    lines += ["", "Per layer = the whole forward (embedding and lm_head included) / layers, so the one-device "
              "figure (fewer layers) carries a larger share of the head.", "",
              "## MoE token exchange, one MoE layer jitted alone", "",
              "| T | all-reduce (what the model runs) ms | all-to-all ms | winner | max abs diff / max abs |",
              "|---|---|---|---|---|"]
    for m in r.get("moe_exchange", []):
        lines.append(f"| {m['tokens']} | {m['all_reduce_ms']:.3f} | {m['all_to_all_ms']:.3f} | {m['winner']} | "
                     f"{m['max_abs_diff']:.3g} / {m['max_abs']:.3g} |")
    if r.get("decode"):
        lines += ["", "## Decode on the mesh (batch 1; DDTree with an oracle drafter = the acceptance upper bound)",
                  "", "| method | budget | tokens/s | target forwards | same tokens as AR |", "|---|---|---|---|---|"]
        for d in r["decode"]:
            lines.append(f"| {d['method']} | {d.get('budget', '-')} | {d['tokens_per_s']:.1f} | "
                         f"{d['target_forwards']} | "
                         f"{d['same_tokens_as_ar']} |")
    if r.get("rounds"):
        lines += ["", "## One DDTree round, stage by stage (random one-layer drafter; wall us per jitted stage)", ""]
        settings = list(dict.fromkeys(x["setting"] for x in r["rounds"]))
        by = {(x["setting"], x["stage"]): x["wall_us"] for x in r["rounds"]}
        stages = list(dict.fromkeys(x["stage"] for x in r["rounds"]))
        lines += ["| stage | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
        for st in stages:
            lines.append(f"| {st} | " + " | ".join(f"{by.get((se, st), float('nan')):.0f}" for se in settings) + " |")
        lines += ["", "Round = draft + build + verify + accept/compact (each jitted alone, so each includes one "
                  "dispatch that the one-jit loop does not pay)."]
    write_markdown(stem, meta, "\n".join(lines))
    if r.get("verify"):
        write_png(stem, lambda path: draw(path, r, one))
    print("\n".join(lines))
    return r


def draw(path, r, one):
    """Verify ms per layer, sharded vs one device (called by benchmarks.common.write_png)."""
    import matplotlib.pyplot as plt  # noqa: PLC0415  # pyright: ignore[reportMissingImports] (the bench extra)

    ts = [v["tokens"] for v in r["verify"]]
    x = np.arange(len(ts))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(x - 0.2, [v["per_layer_ms"] for v in r["verify"]], 0.4, label=f"{r['devices']} GPUs, {r['mesh']}")
    if one:
        ax.bar(x + 0.2, [one[t]["per_layer_ms"] if t in one else 0 for t in ts], 0.4, label="one GPU")
    ax.set_xticks(x, [str(t) for t in ts])
    ax.set_xlabel("T (tree tokens verified)")
    ax.set_ylabel("ms per layer")
    ax.set_title(f"K2.6-width verify per layer, S={r['verify'][0]['context']}\n{r['device']}, JAX {r['jax']}, "
                 f"{r['date'][:10]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
