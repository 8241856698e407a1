"""Kimi K2.6 at full width on one H200: a layer slice of DDTree verification, timed per component.

  python benchmarks/bench_k26_slice.py --out DIR [--layers 2] [--deadline-s 520]
  python benchmarks/bench_k26_slice.py --tiny --out DIR      # CPU smoke run (< 1 min): NOT measurements
  python benchmarks/bench_k26_slice.py --summarize DIR/k26_slice.json   # rebuild tables/plot, no GPU
  python benchmarks/bench_k26_slice.py --timeline --out DIR --ts 1,9 --ss 4096   # one layer's launches, no CUPTI

The slice is the model itself: `--layers` MoE decoder layers of ModelConfig.kimi_k26() (hidden 7168, 64 MLA
heads, 384 INT4 experts of 7168 -> 2048 -> 7168, bf16 attention / shared expert), their params shaped by the
model's own init and quantize (random values drawn ON THE DEVICE), run by kdtree_jax.model.DecoderLayer. For
every tree size T in {1, 9, 33, 65, 129} and committed context S in {4096, 32768} it times
  attention: the model's attention core (kdtree_jax.attention.mla_attention) over S + T latent rows with a
             random tree mask; on a GPU with attention="auto": the Mosaic GPU kernel at the call shapes where it
             measured fastest, XLA elsewhere (pallas_kernels.dispatch.choose_attention; each row records which);
  moe:       the model's routed experts (kdtree_jax.model.routed_experts: with the experts in the Mosaic
             layout (--moe mosaic, the default) the Mosaic GPU kernel, in the checkpoint layout the Triton
             one; the other one is timed beside it), grouping included, and XLA's alternatives in the same
             run (benchmarks/xla_baselines.py): touched-experts loop, dense-all-experts, gather-then-dot;
  rest:      the decoder layer with its attention core and routed experts stood in for by trivial functions
             (RMSNorms, q_a/q_b/kv_a, W_UK absorb, RoPE, W_UV, o_proj, router + top-8, shared expert);
  layer:     the whole slice forward divided by the number of layers (includes the glue);
  head:      the model's lm_head on T rows,
against floors from benchmarks/cost_model.py (bytes / copy bandwidth measured in this run, or FLOPs / peak;
the MoE floor from the experts actually touched). It then extrapolates to 61 layers, states the
per-round cost of DDTree verification vs one autoregressive step and the break-even acceptance
length per budget, and calibrates the budget cost model.

Timing (benchmarks/common.py Timer): on a GPU CUPTI summed kernel time, one window per call, median of
--iters after a warm-up, with the wall clock beside it for the MoE columns. On CPU (--tiny) it is wall
clock and says so: CPU numbers prove nothing. Writes DIR/k26_slice.json, DIR/k26_slice.md and
DIR/k26_slice.png, each with the run's metadata (device, JAX, date, git commit, command).

--timeline measures instead where one layer's time goes: for each T and S the whole layer (the slice's first layer,
attention "auto", the MoE kernel of --moe) runs in a jitted loop of --timeline-calls dependent calls (carrying the
latent cache, `slice_calls`) under jax's profiler (`common.loop_timeline`: the device's own timestamps, no CUPTI window
in that process), and the middle call's launches are listed in order with their device time and the idle time before
each, each XLA fusion named from the layer's optimized HLO, which goes beside it (DIR/k26_layer_T{T}_S{S}.hlo.txt).
Writes DIR/k26_timeline.json/.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

TS = (1, 9, 33, 65, 129)
SS = (4096, 32768)
BUDGET_PROFILES = {"weak (tau_max 3)": (3.0, 8.0), "medium (tau_max 6)": (6.0, 12.0),
                   "strong (tau_max 10)": (10.0, 16.0)}


def slice_device(script: str, tiny: bool) -> tuple[bool, str]:
    """(on a GPU, the run's timing note) for the slice benchmarks; a CPU run without --tiny is refused."""
    import jax

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not tiny:
        raise SystemExit(f"{script} needs a GPU (use --tiny for a CPU smoke run, which measures nothing)")
    return on_gpu, ("CUPTI summed kernel time, median" if on_gpu
                    else "CPU WALL CLOCK, median: NOT MEASUREMENTS, proves only that the script runs")


def tiny_config():
    import kdtree_jax as kj

    return kj.ModelConfig.kimi_k26().replace(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=32,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, vocab_size=1024, bos_token_id=1, eos_token_id=(2,), pad_token_id=3, mask_token_id=4)


def full_config(tiny: bool):
    """The whole model the slice stands for (the extrapolation's layer counts): K2.6, or the tiny stand-in."""
    import kdtree_jax as kj

    return tiny_config() if tiny else kj.ModelConfig.kimi_k26()


def slice_config(tiny: bool, layers: int):
    """full_config cut to `layers` decoder layers, all of them MoE layers."""
    if layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {layers}")
    return full_config(tiny).replace(num_hidden_layers=layers, first_k_dense_replace=0)


# ------------------------------------------------------------------------------------------- the slice
def slice_params(cfg, dtype, key):
    """The model's params tree for cfg (its own init's shapes, routed experts INT4 by its own quantize),
    random values drawn on the device; each router's values rounded to bf16, as a K2.6 checkpoint stores them, and
    kept in bf16 as `kj.prepare_params` keeps such a router (kdtree_jax.kernels.prepare_routers)."""
    import jax
    import jax.numpy as jnp

    import kdtree_jax as kj
    from benchmarks.common import random_params
    from kdtree_jax.kernels import prepare_routers

    abstract = jax.eval_shape(lambda k: kj.quantize(kj.init_params(cfg, k, dtype), cfg), jax.random.key(0))
    params = random_params(abstract, key)
    for layer in range(cfg.num_hidden_layers):
        moe = params[f"layers_{layer}"].get("moe")
        if moe is not None:  # the checkpoint's bf16 values, read into float32 as kdtree_jax.hf reads them
            moe["router"] = moe["router"].astype(jnp.bfloat16).astype(jnp.float32)
    return prepare_routers(params, cfg)


def decoder_layer(cfg, layer: int, kernels, params, h, positions, cache, start, visibility):
    """The model's decoder layer `layer` with `kernels` (kj.Kernels) on h [1, T, D] over the latent cache
    [1, S, c + r] (rows from start [1] on are the tree's), visibility [1, T, T] -> (h [1, T, D], the cache with the
    T rows written)."""
    from kdtree_jax.model import DecoderLayer

    module = DecoderLayer(cfg, layer, params["embed_tokens"].dtype, kernels)
    return module.apply({"params": params[f"layers_{layer}"]}, h, positions, cache, start, visibility)


def slice_forward(cfg, kernels, params, h, positions, cache, start, visibility):
    """Every decoder layer of the slice config cfg in turn (a static unroll: each layer its own weights)
    over one latent cache: h [1, T, D] -> (h [1, T, D], the cache)."""
    for layer in range(cfg.num_hidden_layers):
        h, cache = decoder_layer(cfg, layer, kernels, params, h, positions, cache, start, visibility)
    return h, cache


def slice_calls(cfg, kernels, calls: int):
    """jit(params, h, positions, cache, start, visibility) -> h: `calls` slice forwards in one fori_loop that carries
    the latent cache, as the engine's decode loop does, so each call writes its T rows in place. (A lone call on a
    cache it does not own copies the whole cache to write them: at S = 32768 a 22 us copy a layer on an H100 that
    the engine never pays, k26_timeline_h100_s31_lone_call.md.) Each call's h is the first call's plus 1e-30 x the last
    output, so no call can be hoisted or dropped and the values stay those of one call. The one copy of the cache
    into the loop is 1 / calls of the loop's time."""
    import jax

    def run(params, h, positions, cache, start, visibility):
        def body(_, carry):
            x, cache = carry
            out, cache = slice_forward(cfg, kernels, params, x, positions, cache, start, visibility)
            return h + (out * 1e-30).astype(h.dtype), cache

        return jax.lax.fori_loop(0, calls, body, (h, cache))[0]

    return jax.jit(run)


@contextlib.contextmanager
def attention_and_routed_moe_stood_in():
    """While a function is traced: the model's attention core and routed experts are replaced by functions
    that do (almost) no work but keep their inputs alive, so that XLA keeps everything around them ("rest")."""
    from kdtree_jax import attention, model

    def attend(q, cache, start, visibility, *, scale, value_dim, kernels=None):  # [B, T, H, c + r] -> latent part
        del cache, start, visibility, scale, kernels
        return q[..., :value_dim]

    def routed(x, experts, idx, weights, kernels=None):  # keeps the router's top-k alive through the weights
        del experts, idx, kernels
        return x * weights.sum(-1, keepdims=True).astype(x.dtype)

    saved = attention.mla_attention, model.routed_experts
    attention.mla_attention, model.routed_experts = attend, routed
    try:
        yield
    finally:
        attention.mla_attention, model.routed_experts = saved


def attention_kernel(cfg, impl: str, q, cache) -> str:
    """The attention implementation kdtree_jax.attention.mla_attention runs for q [B, T, H, c + r] over cache
    [B, S_max, c + r] with attention=`impl` (pallas_kernels.dispatch asked the same way)."""
    from pallas_kernels.dispatch import choose_attention

    return choose_attention(latent_dim=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, impl=impl,
                            num_heads=cfg.num_attention_heads, dtype=q.dtype, num_tree=q.shape[1],
                            cache_rows=cache.shape[1]).impl


def attention_ran(points, label) -> str:
    """'mosaic_gpu at T=1 S=32768, ...; xla at ...' from the points' recorded attention_kernel (label(point) names a
    point; each once), or '' when no point recorded one (runs from before attention="auto")."""
    ran: dict[str, list[str]] = {}
    for p in points:
        if "attention_kernel" in p and label(p) not in ran.get(p["attention_kernel"], []):
            ran.setdefault(p["attention_kernel"], []).append(label(p))
    return "; ".join(f"{k} at {', '.join(v)}" for k, v in ran.items())


def random_tree_mask(rng, t):
    """A random tree over T nodes (node 0 the root): visible[i, j] = j is i or an ancestor of i."""
    vis = np.zeros((t, t), bool)
    for n in range(t):
        parent = rng.integers(0, n) if n else -1
        vis[n] = vis[parent] if n else False
        vis[n, n] = True
    return vis


# ---------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--layers", type=int, default=2, help="MoE layers in the slice (9.8 GB each at K2.6)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per point (the median is reported)")
    ap.add_argument("--deadline-s", type=float, default=520.0, help="stop starting new points after this")
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="tree sizes T (tokens verified), comma-separated")
    ap.add_argument("--ss", default=",".join(map(str, SS)), help="committed contexts S, comma-separated")
    ap.add_argument("--moe", choices=("mosaic", "triton"), default="mosaic",
                    help="the grouped MoE kernel of the slice forward and the MoE column (the other one is timed "
                         "beside it): mosaic = the routed experts in the Mosaic GPU layout (the model's on Hopper + "
                         "bf16), triton = in the checkpoint layout (default: %(default)s; tilings: "
                         "benchmarks/bench_moe_mgpu.py)")
    ap.add_argument("--attention", choices=("auto", "xla", "mosaic_gpu"), default="auto",
                    help="the attention every layer and the attention column run on a GPU (auto: the dispatcher's "
                         "measured choice per call shape; default %(default)s; the CPU smoke run: xla)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the XLA MoE alternatives")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at tiny width (XLA paths, wall clock)")
    ap.add_argument("--slice-calls", type=int, default=8,
                    help="slice forwards in the timed loop that carries the cache (layer = its time / calls / layers; "
                         "the cache's one copy into the loop is 1 / calls of it; default %(default)s)")
    ap.add_argument("--timeline", action="store_true",
                    help="instead of the CUPTI timings: the device's timeline of one layer in a jitted loop at each T "
                         "and S (its launches in order, each with its time and the idle before it) and the layer's "
                         "optimized HLO (k26_timeline.json/.md, k26_layer_T*_S*.hlo.txt)")
    ap.add_argument("--timeline-calls", type=int, default=10, help="calls in the profiled loop (--timeline)")
    ap.add_argument("--summarize", metavar="JSON",
                    help="no measuring: rebuild the .md/.png (tables, extrapolation, advice) from a k26_slice JSON, or "
                         "the .md of a k26_timeline JSON (its kernels named from the HLO files beside it)")
    args = ap.parse_args()
    if args.summarize:
        return resummarize(args.summarize)
    if args.slice_calls < 1 or args.timeline_calls < 1:
        raise SystemExit(f"--slice-calls and --timeline-calls must be >= 1, got {args.slice_calls} and "
                         f"{args.timeline_calls}")
    t_start = time.time()

    import jax
    import jax.numpy as jnp

    import kdtree_jax as kj
    from benchmarks.common import Timer, copy_bandwidth, metadata
    from benchmarks.cost_model import CostModel, evaluate_budgets, saturating_profile
    from benchmarks.xla_baselines import MOE_BASELINES
    from kdtree_jax import attention as kattention
    from kdtree_jax import model as kmodel
    from kdtree_jax.layers import rms_norm
    from kdtree_jax.linear import linear

    on_gpu, timing = slice_device("bench_k26_slice", args.tiny)
    cfg = slice_config(args.tiny, args.layers)
    ts = [int(v) for v in args.ts.split(",")]
    ss = [int(v) for v in args.ss.split(",")]
    if args.tiny:
        ts, ss = [t for t in ts if t <= 33] or [1], [64, 256]
    # Every path names its kernels: on a GPU the MoE kernels (one that cannot run raises, never an XLA run reported
    # as the kernel) and the attention on "auto" (the dispatcher's measured choice per call shape, which each row
    # records); the CPU smoke run names the XLA references (pallas_kernels.dispatch "xla").
    moe_impl = args.moe if on_gpu else "xla"
    alt_impl = {"mosaic": "triton", "triton": "mosaic"}.get(moe_impl)
    attention_impl = args.attention if on_gpu else "xla"
    kernels_for = {"mosaic": kj.Kernels(attention=attention_impl, moe="mosaic_gpu"),
                   "triton": kj.Kernels(attention=attention_impl, moe="triton"),
                   "xla": kj.Kernels(attention="xla", linear="xla", moe="xla")}
    # "rest" stands the routed experts in, so its layer runs on the checkpoint-layout params
    rest_kernels = kernels_for["triton" if on_gpu else "xla"]
    timer = Timer(args.iters)
    meta = metadata(
        tiny=args.tiny, layers=args.layers, attention_impl=attention_impl,
        moe_impl=moe_impl, alt_moe_impl=alt_impl,
        timing=timing, timer=timer.method,
        config={k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "n_routed_experts",
                                             "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank")})
    print(meta, flush=True)

    def rel_err(got, want):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))

    # ---- copy bandwidth in this run (the floors' denominator)
    if not args.timeline:  # (a CUPTI window: the timeline's profiler must have the process alone)
        bandwidth = copy_bandwidth(timer, (512 if on_gpu else 4) * 1024 * 1024)
        meta["copy_TBps"] = bandwidth / 1e12
    full = full_config(args.tiny)
    cost = CostModel.from_config(full, bandwidth=meta["copy_TBps"] * 1e12) if on_gpu and not args.timeline \
        else CostModel.from_config(full)

    # ---- weights on device: the model's params, and its routed experts in the Mosaic layout too
    t0 = time.time()
    params = slice_params(cfg, jnp.bfloat16, jax.random.key(100))
    mosaic = kj.to_mosaic_experts(params, cfg) if on_gpu else None  # a load-time conversion
    # what generate does before its decode loop (at K2.6: W_UK and W_UV laid out by head)
    params = kmodel.fold_params(params, cfg, kernels_for[moe_impl])
    mosaic = None if mosaic is None else kmodel.fold_params(mosaic, cfg, kernels_for[moe_impl])
    jax.block_until_ready((params, mosaic))
    meta["build_s"] = time.time() - t0
    meta["kernels"] = kj.plan_summary(kj.kernel_plan(params, cfg, kernels=kernels_for[moe_impl]))
    print(f"built {args.layers} layers on device in {meta['build_s']:.1f} s", flush=True)
    if args.timeline:
        return layer_timelines(args, cfg, kernels_for[moe_impl], mosaic if moe_impl == "mosaic" else params, ts, ss,
                               meta)
    by_impl = {"mosaic": mosaic, "triton": params, "xla": params}  # whose routed experts each impl runs
    p0 = params["layers_0"]
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim

    def experts(tree):
        return tree["layers_0"]["moe"]["experts"]

    attend = jax.jit(lambda q, cache, start, mask: kattention.mla_attention(
        q, cache, start, mask, scale=cfg.softmax_scale, value_dim=c, kernels=kernels_for[moe_impl]))
    routed = jax.jit(kmodel.routed_experts, static_argnums=4)  # the model's, on the kernel named by argument 4
    baselines = {impl: jax.jit(fn) for impl, fn in MOE_BASELINES.items()}

    def rest_fn(*a):  # the first layer compiled with the stand-ins (a fresh jit: no cached real trace)
        with attention_and_routed_moe_stood_in():
            return jax.jit(lambda tree, *b: decoder_layer(cfg, 0, rest_kernels, tree, *b)[0]).lower(*a).compile()

    slice_fn = slice_calls(cfg, kernels_for[moe_impl], args.slice_calls)
    head_fn = jax.jit(lambda x, w: linear(x, w, kernels_for[moe_impl]).astype(jnp.float32))
    head_w = params["lm_head"]

    rng = np.random.default_rng(0)
    rows, moe_rows, checks = [], {}, []
    for t in ts:
        if time.time() - t_start > args.deadline_s:
            print(f"deadline: skipping T={t} and later", flush=True)
            break
        h = jax.random.normal(jax.random.key(t), (1, t, cfg.hidden_size), jnp.bfloat16)
        # ---- MoE at this T (independent of S): the kernels, XLA alternatives, a native check
        x = rms_norm(h[0], p0["post_attn_norm"], cfg.rms_norm_eps)  # [T, D]: what the layer's MoE sees
        idx, w = kmodel.route(cfg, x, p0["moe"]["router"], p0["moe"]["router_bias"])  # [T, k]
        touched = int(jnp.unique(idx).size)
        mrow: dict[str, float] = {"T": t, "touched": touched}
        timing = timer(routed, x, experts(by_impl[moe_impl]), idx, w, kernels_for[moe_impl])
        mrow["moe_s"] = timing.seconds
        ref = baselines["xla_touched"](x, experts(params), idx, w)
        err = rel_err(timing.out, ref)
        checks.append({"T": t, "what": f"moe {moe_impl} vs xla_touched (bf16 dequant)", "max_rel_err": err})
        if on_gpu:
            mrow["moe_wall_s"] = timing.wall_s
            assert alt_impl is not None  # on a GPU moe_impl is --moe's, mosaic or triton
            alt = timer(routed, x, experts(by_impl[alt_impl]), idx, w, kernels_for[alt_impl])
            mrow["alt_s"], mrow["alt_wall_s"] = alt.seconds, alt.wall_s
            checks.append({"T": t, "what": f"moe {alt_impl} vs xla_touched (bf16 dequant)",
                           "max_rel_err": rel_err(alt.out, ref)})
        if not args.no_baselines:
            for impl in MOE_BASELINES:
                if time.time() - t_start > args.deadline_s:
                    break
                base = timer(baselines[impl], x, experts(params), idx, w)
                mrow[f"{impl}_s"] = base.seconds
                if on_gpu:
                    mrow[f"{impl}_wall_s"] = base.wall_s
        mrow["head_s"] = timer(head_fn, h[0], head_w).seconds
        moe_rows[t] = mrow
        print(f"T={t}: touched {touched}, moe {mrow['moe_s'] * 1e6:.1f} us, err {err:.2e}, "
              + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in mrow.items()
                          if k.startswith(("xla", "alt")) and isinstance(v, float)), flush=True)

        for s in ss:
            if time.time() - t_start > args.deadline_s:
                break
            positions = jnp.arange(s, s + t, dtype=jnp.int32)[None]  # [1, T]
            # Rows [S, S + T) take the tree's freshly written latents; the rest is never read.
            cache = jax.random.normal(jax.random.key(s + t), (1, s + 256, c + r), jnp.bfloat16)
            start = jnp.asarray([s], jnp.int32)
            mask = jnp.asarray(random_tree_mask(rng, t))[None]  # [1, T, T]
            q = jax.random.normal(jax.random.key(s + t + 1), (1, t, cfg.num_attention_heads, c + r), jnp.bfloat16)
            attn_s = timer(attend, q, cache, start, mask).seconds
            layer_args = (params, h, positions, cache, start, mask)
            rest_s = timer(rest_fn(*layer_args), *layer_args).seconds
            slice_s = timer(slice_fn, by_impl[moe_impl], h, positions, cache, start, mask).seconds / args.slice_calls
            row = {"T": t, "S": s, "touched": touched, "attention_s": attn_s,
                   "attention_kernel": attention_kernel(cfg, attention_impl, q, cache),
                   "moe_s": mrow["moe_s"], "rest_s": rest_s, "layer_s": slice_s / args.layers, "head_s": mrow["head_s"],
                   "attention_floor_s": cost.attention_floor(t, s),
                   "moe_floor_s": cost.moe_floor(t, touched), "rest_floor_s": cost.rest_floor(t)}
            row["glue_s"] = row["layer_s"] - row["attention_s"] - row["moe_s"] - row["rest_s"]
            rows.append(row)
            print(f"  S={s}: attention {attn_s * 1e6:.1f} us (floor {row['attention_floor_s'] * 1e6:.1f}), "
                  f"moe {row['moe_s'] * 1e6:.1f} (floor {row['moe_floor_s'] * 1e6:.1f}), "
                  f"rest {row['rest_s'] * 1e6:.1f} "
                  f"(floor {row['rest_floor_s'] * 1e6:.1f}), layer {row['layer_s'] * 1e6:.1f} us", flush=True)

    result = summarize(meta, rows, moe_rows, checks, cost, on_gpu, evaluate_budgets, saturating_profile)
    write(os.path.join(args.out, "k26_slice_tiny" if args.tiny else "k26_slice"), result)
    print(f"done in {time.time() - t_start:.0f} s", flush=True)


def layer_timelines(args, cfg, kernels, params, ts, ss, meta):
    """--timeline: the device's timeline of the slice's first layer in a jitted loop at each (T, S), the middle
    call's launches, and each layer's optimized HLO beside them."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import loop_timeline, write_results

    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    rng = np.random.default_rng(0)

    loop = slice_calls(cfg.replace(num_hidden_layers=1), kernels, args.timeline_calls)  # the first layer, cache carried

    rows = []
    for t in ts:
        for s in ss:
            h = jax.random.normal(jax.random.key(t), (1, t, cfg.hidden_size), jnp.bfloat16)
            positions = jnp.arange(s, s + t, dtype=jnp.int32)[None]
            cache = jax.random.normal(jax.random.key(s + t), (1, s + 256, c + r), jnp.bfloat16)
            start = jnp.asarray([s], jnp.int32)
            mask = jnp.asarray(random_tree_mask(rng, t))[None]
            layer_args = (params, h, positions, cache, start, mask)
            compiled = loop.lower(*layer_args).compile()
            hlo = compiled.as_text() or ""
            hlo_path = os.path.join(args.out, f"k26_layer_T{t}_S{s}.hlo.txt")
            os.makedirs(args.out, exist_ok=True)
            with open(hlo_path, "w") as f:
                f.write(hlo)
            q_like = jnp.zeros((1, t, 1, 1), jnp.bfloat16)  # attention_kernel reads T and the dtype
            row = {"T": t, "S": s, "hlo": os.path.basename(hlo_path),
                   "attention_kernel": attention_kernel(cfg, kernels.attention, q_like, cache),
                   "timeline": loop_timeline(None, layer_args, args.timeline_calls, loop=compiled)}
            tl = row["timeline"]
            describe_events(tl, hlo)
            print(f"T={t} S={s}: span {tl['span_us_per_call']:.1f} us a call, busy {tl['busy_us_per_call']:.1f}, "
                  f"{tl['events_per_call']:g} events a call", flush=True)
            rows.append(row)
    meta = {**meta, "timeline_calls": args.timeline_calls, "timing": "jax profiler device timeline (no CUPTI)",
            "attention_impl": kernels.attention, "moe_impl": kernels.moe}
    markdown = timeline_markdown(meta, rows)
    write_results(os.path.join(args.out, "k26_timeline"), meta, {"rows": rows}, markdown)
    print(markdown)


def describe_events(timeline: dict, hlo: str) -> None:
    """Each listed event of a loop_timeline result gets "what": the HLO fusion's op and main ops (fusion_descriptions;
    "" for kernels that are not fusions)."""
    from benchmarks.common import fusion_descriptions, timeline_events

    what = fusion_descriptions(hlo)
    for ev in timeline_events(timeline):
        ev["what"] = what.get(ev["name"], "")


def timeline_markdown(meta, rows) -> str:
    """--timeline's report: per (T, S) span / busy / gaps a call, then one call's launches in order."""
    from benchmarks.common import timeline_events_markdown

    md = [f"# One K2.6 layer in a jitted loop: the device's timeline ({meta['device']})", "",
          f"{meta['date']}, JAX {meta['jax']}; the slice's first decoder layer (attention {meta['attention_impl']}, "
          f"routed experts {meta['moe_impl']}), a jitted loop of {meta['timeline_calls']} dependent calls carrying "
          "the latent cache (`slice_calls`: each call writes its rows in place, as in the engine's decode loop) "
          "profiled with jax's profiler (device timestamps), no CUPTI window in this process. Microseconds.", "",
          "| T | S | attention ran | span a call | busy | gaps | device events a call |", "|---" * 7 + "|"]
    for row in rows:
        tl = row["timeline"]
        md.append(f"| {row['T']} | {row['S']} | {row['attention_kernel']} | {tl['span_us_per_call']:.1f} | "
                  f"{tl['busy_us_per_call']:.1f} | {tl['gap_us_per_call']:.1f} | {tl['events_per_call']:g} |")
    for row in rows:
        tl = row["timeline"]
        md += timeline_events_markdown(tl, f"T={row['T']} S={row['S']}", f"; the fusions' HLO: `{row['hlo']}`")
    return "\n".join(md) + "\n"


def write(stem, result):
    from benchmarks.common import write_results

    data = {k: v for k, v in result.items() if k != "meta"}
    write_results(stem, result["meta"], data, result["markdown"], plot=lambda path: plot(result, path))
    print(result["markdown"])


def resummarize(path):
    """Rebuild the markdown and plot of a stored result with the current summary code (CPU is fine); the
    stored run's metadata stays the run's."""
    import json

    from benchmarks.cost_model import CostModel, evaluate_budgets, saturating_profile

    with open(path) as f:
        stored = json.load(f)
    meta = stored["meta"]
    if "timeline_calls" in meta:  # a --timeline result: name its kernels from the HLO files beside it, if there
        from benchmarks.common import write_results

        for row in stored["rows"]:
            hlo = os.path.join(os.path.dirname(path), row["hlo"])
            if os.path.exists(hlo):
                with open(hlo) as f:
                    describe_events(row["timeline"], f.read())
        return write_results(os.path.splitext(path)[0], meta, {"rows": stored["rows"]},
                             timeline_markdown(meta, stored["rows"]))
    for m in stored["moe"]:  # results written before the Mosaic kernel was the slice's: it was a side column
        if "mosaic_s" in m:
            m["alt_s"] = m.pop("mosaic_s")
            if "mosaic_wall_s" in m:
                m["alt_wall_s"] = m.pop("mosaic_wall_s")
            meta["moe_impl"], meta["alt_moe_impl"] = "triton", "mosaic (prototype)"
    cost = CostModel.from_config(full_config(meta["tiny"]), bandwidth=meta["copy_TBps"] * 1e12)
    result = summarize(meta, stored["rows"], {m["T"]: m for m in stored["moe"]}, stored["checks"], cost,
                       not meta["tiny"], evaluate_budgets, saturating_profile)
    write(os.path.splitext(path)[0], result)


def extrapolated_verify(model, t, s, layer_s, attention_s, head_s):
    """The whole model's verify of T tokens at context S from one measured MoE layer (layer_s, its attention
    core attention_s) and the measured lm_head (head_s): every MoE layer costs the measured one, the dense
    layers are modelled by `model` (a CostModel) around the measured attention."""
    moe_layers = model.num_layers - model.num_dense_layers
    dense = model.dense_layer_seconds(t, s, attention_s)
    return moe_layers * layer_s + model.num_dense_layers * dense + head_s


HBM_PEAK_BPS = 4.8e12  # H200 HBM3e specification: no kernel reads faster


def implausible(model, t, touched, seconds, t_fold):
    """Why a routed-MoE time cannot be real, or "". t_fold: the implementation runs every touched expert
    on all T tokens (the XLA touched loop), else only the T * k routed rows."""
    rows = t * touched if t_fold else t * model.top_k
    flops = 2 * rows * 3 * model.hidden * model.moe_intermediate
    nbytes = touched * model.expert_bytes
    why = []
    if flops / seconds > model.peak_flops:
        why.append(f"{flops / seconds / 1e12:.0f} TFLOP/s > peak")
    if nbytes / seconds > HBM_PEAK_BPS:
        why.append(f"{nbytes / seconds / 1e12:.1f} TB/s > HBM peak")
    return ", ".join(why)


def summarize(meta, rows, moe_rows, checks, model, on_gpu, evaluate_budgets, saturating_profile):
    """Tables, the 61-layer extrapolation, break-even acceptance and budget advice (markdown + json)."""
    note = "" if on_gpu else "\n**CPU smoke run at tiny width: these numbers are NOT measurements.**\n"
    us = lambda v: f"{v * 1e6:.1f}"  # noqa: E731
    ran = attention_ran(rows, lambda p: f"T={p['T']} S={p['S']}")
    attention = meta["attention_impl"] + (f" (ran {ran})" if ran else "")
    md = [f"# K2.6 layer slice, DDTree verification ({meta['device']}, JAX {meta['jax']}, {meta['date']})", note,
          f"{meta['timing']}; copy bandwidth {meta['copy_TBps']:.3g} TB/s; {meta['layers']} MoE layers; attention "
          f"{attention}, MoE {meta['moe_impl']}. Floors: benchmarks/cost_model.py (MoE floor from the "
          "experts actually touched).", "",
          "## Per layer (us)", "",
          "| T | S | touched | attention | floor | x | MoE | floor | x | rest | floor | layer (slice/L) | glue |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['T']} | {r['S']} | {r['touched']} | {us(r['attention_s'])} | {us(r['attention_floor_s'])} | "
                  f"{r['attention_s'] / r['attention_floor_s']:.2f} | {us(r['moe_s'])} | {us(r['moe_floor_s'])} | "
                  f"{r['moe_s'] / r['moe_floor_s']:.2f} | {us(r['rest_s'])} | {us(r['rest_floor_s'])} | "
                  f"{us(r['layer_s'])} | {us(r['glue_s'])} |")
    alt = meta.get("alt_moe_impl")
    md += ["", "## Routed MoE: grouped kernels vs XLA alternatives (us, same run)", "",
           f"| T | touched | floor | {meta['moe_impl']} (the slice's) | x floor | target | {alt or '-'} | x floor "
           "| XLA touched loop | XLA dense all | XLA gather |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    flagged = []
    for t, m in moe_rows.items():
        floor = model.moe_floor(t, m["touched"])
        target = 1.5 if t == 1 else 1.3
        cells = []
        for key, t_fold in (("moe_s", False), ("alt_s", False), ("xla_touched_s", True), ("xla_dense_s", None),
                            ("xla_gather_s", False)):
            if key not in m:
                cells.append("-")
                continue
            why = "" if t_fold is None else implausible(model, t, m["touched"], m[key], t_fold)
            if why:
                flagged.append(f"T={t} {key[:-2]}: {why}")
            wall_key = key[:-2] + "_wall_s"
            cells.append(us(m[key]) + (" (!)" if why else "") + (f" [wall {us(m[wall_key])}]" if wall_key in m else ""))
        alt_x = f"{m['alt_s'] / floor:.2f}" if "alt_s" in m else "-"
        md.append(f"| {t} | {m['touched']} | {us(floor)} | {cells[0]} | {m['moe_s'] / floor:.2f} | <= {target} | "
                  f"{cells[1]} | {alt_x} | " + " | ".join(cells[2:]) + " |")
    if flagged:
        md += ["", "(!) physically impossible, so NOT a valid measurement: " + "; ".join(flagged) + ". CUPTI "
               "summed kernel time misses kernels here (most likely those XLA launches from command buffers / CUDA "
               "graphs inside its while loops and conditionals); such times are lower bounds at best."]
    if any("moe_wall_s" in m for m in moe_rows.values()):
        md += ["", "[wall ...]: median wall clock of the same jitted call (one dispatch included): an upper bound "
               "beside CUPTI's summed kernel time."]
    md += ["", "Checks: " + "; ".join(f"T={c['T']} {c['what']}: {c['max_rel_err']:.2e}" for c in checks), ""]

    extrap, advice = [], {}
    if rows:
        calibrated = model.calibrated(rows)
        moe_layers = model.num_layers - model.num_dense_layers
        md += [f"## Extrapolation to {model.num_layers} layers", "",
               f"verify(T, S) = {moe_layers} x layer(T, S) (measured slice) + {model.num_dense_layers} dense layer "
               "(modelled) + lm_head(T) (measured). Draft time per round: "
               f"{model.draft_estimate_seconds(1) * 1e3:.2f} ms (modelled, no K2.6 drafter here: to be measured). "
               "Break-even acceptance = (draft + verify(1 + B)) / AR step.", "",
               "| S | T | budget | verify ms | AR step ms | draft ms | break-even acceptance |",
               "|---|---|---|---|---|---|---|"]
        by = {(r["T"], r["S"]): r for r in rows}
        for s in sorted({r["S"] for r in rows}):
            if (1, s) not in by:
                continue

            def verify(t, s=s):
                r = by[(t, s)]
                return extrapolated_verify(calibrated, t, s, r["layer_s"], r["attention_s"], r["head_s"])

            ar = verify(1)
            for t in sorted(t for (t, s2) in by if s2 == s):
                v = verify(t)
                draft = model.draft_estimate_seconds(max(t - 1, 1))
                be = (draft + v) / ar if t > 1 else 1.0
                extrap.append({"S": s, "T": t, "budget": t - 1, "verify_s": v, "ar_s": ar, "draft_s": draft,
                               "break_even": be})
                md.append(f"| {s} | {t} | {t - 1} | {v * 1e3:.2f} | {ar * 1e3:.2f} | {draft * 1e3:.2f} | {be:.2f} |"
                          if t > 1 else f"| {s} | 1 | AR | {v * 1e3:.2f} | {ar * 1e3:.2f} | - | - |")
        for label, cost in (("calibrated on this run's measurements", calibrated),
                            ("kernels at the issue's targets (CostModel defaults), for comparison", model)):
            md += ["", f"## Budget advice: {label}; illustrative saturating acceptance profiles", "",
                   "| profile | " + " | ".join(f"S={s}" for s in (4096, 32768, 131072)) + " |", "|---|---|---|---|"]
            for name, (tau_max, half) in BUDGET_PROFILES.items():
                prof = saturating_profile(tau_max, half)
                cells = []
                for s in (4096, 32768, 131072):
                    best = max(evaluate_budgets(s, prof, cost), key=lambda e: (e.tokens_per_second, -e.budget))
                    cells.append(f"B={best.budget} ({best.speedup:.2f}x)")
                    advice.setdefault(label, {}).setdefault(name, {})[s] = {"budget": best.budget,
                                                                            "speedup": best.speedup}
                md.append(f"| {name} | " + " | ".join(cells) + " |")
        md += ["", "Calibrated overheads (measured / floor, median): "
               f"attention {calibrated.attention_overhead:.2f}, MoE {calibrated.moe_overhead:.2f}, "
               f"rest {calibrated.rest_overhead:.2f}.", ""]
        meta["calibrated"] = {"attention_overhead": calibrated.attention_overhead,
                              "moe_overhead": calibrated.moe_overhead, "rest_overhead": calibrated.rest_overhead}
    return {"meta": meta, "rows": rows, "moe": list(moe_rows.values()), "checks": checks,
            "extrapolation": extrap, "advice": advice, "markdown": "\n".join(md) + "\n"}


def plot(result, path):
    """Stacked per-layer bars against the floors, and the break-even line (called by benchmarks.common)."""
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports] (the bench extra)

    rows = result["rows"]
    ss = sorted({r["S"] for r in rows})
    fig, axes = plt.subplots(1, len(ss) + 1, figsize=(5 * (len(ss) + 1), 4))
    axes = np.atleast_1d(axes)
    for ax, s in zip(axes, ss, strict=False):  # the last axis is not an S
        rs = [r for r in rows if r["S"] == s]
        x = np.arange(len(rs))
        bottom = np.zeros(len(rs))
        for key, color in (("attention_s", "C0"), ("moe_s", "C1"), ("rest_s", "C2")):
            vals = np.array([r[key] * 1e6 for r in rs])
            ax.bar(x, vals, bottom=bottom, color=color, label=key[:-2])
            floors = np.array([r[key.replace("_s", "_floor_s")] * 1e6 for r in rs])
            ax.scatter(x, bottom + floors, marker="_", s=300, color="k")
            bottom += vals
        ax.set_xticks(x, [str(r["T"]) for r in rs])
        ax.set_xlabel("T (tree tokens)")
        ax.set_ylabel("us per layer")
        ax.set_title(f"S = {s} (bars: measured; ticks: floors)")
        ax.legend()
    ax = axes[-1]
    for s in ss:
        ex = [e for e in result["extrapolation"] if e["S"] == s and e["budget"] > 0]
        ax.plot([e["budget"] for e in ex], [e["break_even"] for e in ex], "o-", label=f"S = {s}")
    ax.set_xlabel("tree budget B")
    ax.set_ylabel("break-even acceptance length")
    ax.set_title("DDTree pays off above the line")
    ax.legend()
    if result["meta"]["tiny"]:
        fig.suptitle("CPU smoke run at tiny width: NOT measurements")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
