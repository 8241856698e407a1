"""Kimi K2.6 at full width on one H200: a layer slice of DDTree verification, timed per component.

  python benchmarks/bench_k26_slice.py --out DIR [--layers 2] [--deadline-s 520]
  python benchmarks/bench_k26_slice.py --tiny --out DIR      # CPU smoke run (< 1 min): NOT measurements
  python benchmarks/bench_k26_slice.py --summarize DIR/k26_slice.json   # rebuild tables/plot, no GPU

Builds `--layers` MoE layers of ModelConfig.kimi_k26() (hidden 7168, 64 MLA heads, 384 INT4 experts of
7168 -> 2048 -> 7168, bf16 attention / shared expert) with random weights drawn ON THE DEVICE inside jit,
then, for every tree size T in {1, 9, 33, 65, 129} and committed context S in {4096, 32768}, times
  attention: the tree-attention kernel (absorbed MLA core over S + T latent rows, a random tree mask);
  moe:       the grouped INT4 MoE kernel the model runs (--moe: the Mosaic GPU one by default; routed
             experts, grouping included), the other grouped kernel, and XLA's alternatives in the same
             run: touched-experts loop, dense-all-experts, gather-then-dot (bf16 dequant);
  rest:      RMSNorms, q_a/q_b/kv_a, W_UK absorb, RoPE, W_UV, o_proj, router + top-8, shared expert;
  layer:     the whole slice forward divided by the number of layers (includes the glue);
  head:      the lm_head on T rows,
against floors from kdtree_jax.budget (bytes / copy bandwidth measured in this run, or FLOPs / peak;
the MoE floor from the experts actually touched). It then extrapolates to 61 layers, states the
per-round cost of DDTree verification vs one autoregressive step and the break-even acceptance
length per budget, and calibrates the budget cost model.

Timing (GPU): CUPTI summed kernel time (`jax.experimental.mosaic.gpu.profiler.measure`), median of
--iters after a warm-up. On CPU (--tiny) it is wall clock and says so: CPU numbers prove nothing.
Writes DIR/k26_slice.json, DIR/k26_slice.md and DIR/k26_slice.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

TS = (1, 9, 33, 65, 129)
SS = (4096, 32768)
BUDGET_PROFILES = {"weak (tau_max 3)": (3.0, 8.0), "medium (tau_max 6)": (6.0, 12.0),
                   "strong (tau_max 10)": (10.0, 16.0)}


def tiny_config():
    import kdtree_jax as kj

    return kj.ModelConfig.kimi_k26().replace(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=32,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, vocab_size=1024, bos_token_id=1, eos_token_id=(2,), pad_token_id=3, mask_token_id=4)


# ------------------------------------------------------------------------------------ weights on device
def make_layer(key, cfg):
    """One MoE layer's params at cfg's width, drawn on the device (call under jit)."""
    import jax
    import jax.numpy as jnp

    d, h, e, i = cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.moe_intermediate_size
    c, r, dn, dv, qr = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    keys = iter(jax.random.split(key, 32))

    def dense(*shape, fan_in=None):
        fan_in = fan_in or shape[-2]
        return (jax.random.normal(next(keys), shape, jnp.bfloat16) * (1.0 / np.sqrt(fan_in))).astype(jnp.bfloat16)

    def int4(n, k):  # random nibbles (int16 words), scales so that W has std ~ 1/sqrt(k)
        words = jax.lax.bitcast_convert_type(jax.random.bits(next(keys), (e, n, k // 4), jnp.uint16), jnp.int16)
        scale = jax.random.uniform(next(keys), (e, n, k // 32), jnp.float32, 0.5, 1.5) / (4.6 * np.sqrt(k))
        return {"qweight": words, "scale": scale.astype(jnp.bfloat16)}

    return {
        "in_norm": 1.0 + 0.1 * jax.random.normal(next(keys), (d,), jnp.float32),
        "post_norm": 1.0 + 0.1 * jax.random.normal(next(keys), (d,), jnp.float32),
        "q_a": dense(d, qr), "q_norm": jnp.ones((qr,), jnp.float32), "q_b": dense(qr, h * (dn + r)),
        "kv_a": dense(d, c + r), "kv_norm": jnp.ones((c,), jnp.float32),
        "w_uk": dense(h, dn, c, fan_in=dn), "w_uv": dense(h, c, dv, fan_in=c), "o": dense(h * dv, d),
        "router": dense(d, e).astype(jnp.float32), "router_bias": 0.01 * jax.random.normal(next(keys), (e,)),
        "shared": {"gate": dense(d, i), "up": dense(d, i), "down": dense(i, d)},
        "experts": {"gate": int4(i, d), "up": int4(i, d), "down": int4(d, i)},
    }


# ------------------------------------------------------------------------------------------ layer parts
def _rms(x, w, eps=1e-5):
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    return (xf * jnp.reciprocal(jnp.sqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)) * w).astype(x.dtype)


def _rope(x, positions, theta=50000.0):
    """Interleaved-pair RoPE on the last dim of x [..., T, (H,) r] (positions [T])."""
    import jax.numpy as jnp

    r = x.shape[-1]
    inv = theta ** (-jnp.arange(0, r, 2, dtype=jnp.float32) / r)
    ang = positions.astype(jnp.float32)[:, None] * inv  # [T, r/2]
    if x.ndim == 3:
        ang = ang[:, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape).astype(x.dtype)


def pre_attention(p, h, positions, cfg):
    """h [T, D] -> (q [1, T, H, c + r] absorbed query, new latent rows [T, c + r])."""
    import jax.numpy as jnp

    hh, c, r, dn = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    x = _rms(h, p["in_norm"])
    q = (_rms(x @ p["q_a"], p["q_norm"]) @ p["q_b"]).reshape(-1, hh, dn + r)  # [T, H, dn + r]
    q_lat = jnp.einsum("thn,hnc->thc", q[..., :dn], p["w_uk"])  # [T, H, c]
    q_full = jnp.concatenate([q_lat, _rope(q[..., dn:], positions)], -1)[None]  # [1, T, H, c + r]
    kv = x @ p["kv_a"]  # [T, c + r]
    latent = jnp.concatenate([_rms(kv[:, :c], p["kv_norm"]), _rope(kv[:, c:], positions)], -1)
    return q_full, latent


def post_attention(p, h, attn, cfg):
    """attn [1, T, H, c] -> (h after o_proj residual, normed x, routing idx/weights, shared expert out)."""
    import jax
    import jax.numpy as jnp

    o = jnp.einsum("thc,hcv->thv", attn[0], p["w_uv"]).reshape(h.shape[0], -1) @ p["o"]  # [T, D]
    h = h + o
    x = _rms(h, p["post_norm"])
    scores = jax.nn.sigmoid(x.astype(jnp.float32) @ p["router"])  # [T, E]
    _, idx = jax.lax.top_k(scores + p["router_bias"], cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, 1)
    w = w / jnp.sum(w, -1, keepdims=True) * cfg.routed_scaling_factor  # [T, k]
    s = p["shared"]
    shared = (jax.nn.silu(x @ s["gate"]) * (x @ s["up"])) @ s["down"]
    return h, x, idx.astype(jnp.int32), w, shared


def routed(experts, x, idx, w, impl):
    """The routed MoE by impl: "mosaic" (experts in the Mosaic layout), "triton", or an XLA alternative."""
    from pallas_kernels import moe_w4a16 as moe
    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_moe_w4a16_mgpu

    if impl == "mosaic":
        return grouped_moe_w4a16_mgpu(x, experts, idx, w)
    if impl == "triton":
        return moe.grouped_moe_w4a16(x, experts, idx, w, impl="pallas")
    if impl == "xla_touched":
        return moe.moe_w4a16_xla_touched(x, experts, idx, w, dequant="bf16")
    if impl == "xla_dense":
        return moe.moe_w4a16_xla_dense(x, experts, idx, w, dequant="bf16")
    if impl == "xla_gather":
        return moe.moe_w4a16_xla_gather(x, experts, idx, w, dequant="bf16")
    raise ValueError(f"unknown MoE impl {impl!r}")


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--layers", type=int, default=2, help="MoE layers in the slice (9.8 GB each at K2.6)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per point (the median is reported)")
    ap.add_argument("--deadline-s", type=float, default=520.0, help="stop starting new points after this")
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="tree sizes T (tokens verified), comma-separated")
    ap.add_argument("--ss", default=",".join(map(str, SS)), help="committed contexts S, comma-separated")
    ap.add_argument("--moe", choices=("mosaic", "triton"), default="mosaic",
                    help="the grouped MoE kernel of the slice forward and the MoE column (the other one is timed "
                         "beside it): mosaic = pallas_kernels/w4a16_mgpu (the model's on Hopper + bf16), triton = "
                         "pallas_kernels/moe_w4a16 (default: %(default)s; tilings: benchmarks/bench_moe_mgpu.py)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the XLA MoE alternatives")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at tiny width (XLA paths, wall clock)")
    ap.add_argument("--summarize", metavar="JSON",
                    help="no measuring: rebuild the .md/.png (tables, extrapolation, advice) from a k26_slice JSON")
    args = ap.parse_args()
    if args.summarize:
        return resummarize(args.summarize)
    t_start = time.time()

    import jax
    import jax.numpy as jnp

    import kdtree_jax as kj
    from kdtree_jax.budget import CostModel, evaluate_budgets, saturating_profile
    from pallas_kernels.tree_attention import tree_mla_attention

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.tiny:
        raise SystemExit("bench_k26_slice needs a GPU (use --tiny for a CPU smoke run, which measures nothing)")
    cfg = tiny_config() if args.tiny else kj.ModelConfig.kimi_k26()
    ts = [int(v) for v in args.ts.split(",")]
    ss = [int(v) for v in args.ss.split(",")]
    if args.tiny:
        ts, ss = [t for t in ts if t <= 33] or [1], [64, 256]
    attn_impl = "pallas" if on_gpu else "xla"
    moe_impl = args.moe if on_gpu else "xla_touched"
    alt_impl = {"mosaic": "triton", "triton": "mosaic"}.get(moe_impl)
    meta = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tiny": args.tiny, "layers": args.layers, "attention_impl": attn_impl, "moe_impl": moe_impl,
            "alt_moe_impl": alt_impl,
            "timing": ("CUPTI summed kernel time, median" if on_gpu
                       else "CPU WALL CLOCK, median: NOT MEASUREMENTS, proves only that the script runs"),
            "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "n_routed_experts",
                                                   "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank")}}
    print(json.dumps(meta), flush=True)
    if on_gpu:
        from jax.experimental.mosaic.gpu import profiler

    def rel_err(got, want):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))

    def wall(f, *a):
        """Median wall seconds per call of jitted f (dispatch included: an upper bound next to CUPTI's)."""
        jax.block_until_ready(f(*a))
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def measure(f, *a):
        """Median seconds per call of jitted f (CUPTI on GPU; wall clock on CPU)."""
        out = jax.block_until_ready(f(*a))  # compile + warm-up
        if on_gpu:
            # One CUPTI window per iteration: a multi-iteration window insists that every iteration
            # launches the same kernels, which XLA's data-dependent loops (xla_touched) do not.
            times = []
            for _ in range(args.iters):
                out, ms = profiler.measure(f, iterations=1)(*a)
                if ms is None:
                    raise RuntimeError("no kernels were launched")
                times.append(ms)
            return out, statistics.median(times) * 1e-3
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            times.append(time.perf_counter() - t0)
        return out, statistics.median(times)

    # ---- copy bandwidth in this run (the floors' denominator)
    n = (512 if on_gpu else 4) * 1024 * 1024
    big = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    _, copy_s = measure(jax.jit(lambda a: a + 1), big)
    bandwidth = 2 * big.size * 2 / copy_s
    del big
    meta["copy_TBps"] = bandwidth / 1e12
    model = CostModel.from_config(cfg, bandwidth=bandwidth) if on_gpu else CostModel.from_config(cfg)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)

    # ---- weights on device
    t0 = time.time()
    layers = [jax.jit(make_layer, static_argnums=1)(jax.random.key(100 + l), cfg) for l in range(args.layers)]
    jax.block_until_ready(layers)
    meta["build_s"] = time.time() - t0
    print(f"built {args.layers} layers on device in {meta['build_s']:.1f} s", flush=True)
    p0 = layers[0]
    scale = 0.3 / np.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    c = cfg.kv_lora_rank

    pre = jax.jit(lambda p, h, pos: pre_attention(p, h, pos, cfg))
    post = jax.jit(lambda p, h, a: post_attention(p, h, a, cfg))
    attend = jax.jit(lambda q, cache, start, mask: tree_mla_attention(q, cache, start, mask, scale=scale,
                                                                      value_dim=c, impl=attn_impl))
    impls = (["mosaic", "triton"] if on_gpu else []) + ["xla_touched", "xla_dense", "xla_gather"]
    moe_fns = {impl: jax.jit(lambda e, x, i, w, impl=impl: routed(e, x, i, w, impl)) for impl in impls}
    mosaic_experts = []
    if on_gpu:  # every layer's routed experts in the Mosaic kernel layout too (a load-time conversion)
        from pallas_kernels.w4a16_mgpu.moe import experts_to_mgpu_layout

        to_mgpu = jax.jit(experts_to_mgpu_layout)
        mosaic_experts = [to_mgpu(p["experts"]) for p in layers]

    def experts_for(impl, layer):
        return mosaic_experts[layer] if impl == "mosaic" else layers[layer]["experts"]

    def slice_forward(layers, experts, h, positions, cache, start, mask):
        for p, e in zip(layers, experts):  # static unroll over the slice's layers (each its own weights)
            q, _ = pre_attention(p, h, positions, cfg)
            a = tree_mla_attention(q, cache, start, mask, scale=scale, value_dim=c, impl=attn_impl)
            h, x, idx, w, shared = post_attention(p, h, a, cfg)
            h = h + shared + routed(e, x, idx, w, moe_impl)
        return h

    slice_fn = jax.jit(slice_forward)
    slice_experts = [experts_for(moe_impl, layer) for layer in range(args.layers)]
    head_w = jax.jit(lambda k: jax.random.normal(k, (cfg.hidden_size, cfg.vocab_size), jnp.bfloat16))(
        jax.random.key(7))
    head_fn = jax.jit(lambda x, w: (x @ w).astype(jnp.float32))

    rng = np.random.default_rng(0)
    rows, moe_rows, checks = [], {}, []
    for t in ts:
        if time.time() - t_start > args.deadline_s:
            print(f"deadline: skipping T={t} and later", flush=True)
            break
        h = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.bfloat16)
        # ---- MoE at this T (independent of S): the kernel, XLA alternatives, a native check
        a_rand = jax.random.normal(jax.random.key(t + 1), (1, t, cfg.num_attention_heads, c), jnp.bfloat16)
        _, x, idx, w, _ = post(p0, h, a_rand)  # routing of realistic hidden states
        touched = int(jnp.unique(idx).size)
        mrow = {"T": t, "touched": touched}
        y, mrow["moe_s"] = measure(moe_fns[moe_impl], experts_for(moe_impl, 0), x, idx, w)
        ref = moe_fns["xla_touched"](p0["experts"], x, idx, w)
        err = rel_err(y, ref)
        checks.append({"T": t, "what": f"moe {moe_impl} vs xla_touched (bf16 dequant)", "max_rel_err": err})
        if on_gpu:
            mrow["moe_wall_s"] = wall(moe_fns[moe_impl], experts_for(moe_impl, 0), x, idx, w)
            y_alt, mrow["alt_s"] = measure(moe_fns[alt_impl], experts_for(alt_impl, 0), x, idx, w)
            checks.append({"T": t, "what": f"moe {alt_impl} vs xla_touched (bf16 dequant)",
                           "max_rel_err": rel_err(y_alt, ref)})
            mrow["alt_wall_s"] = wall(moe_fns[alt_impl], experts_for(alt_impl, 0), x, idx, w)
        if not args.no_baselines:
            for impl in ("xla_touched", "xla_dense", "xla_gather"):
                if time.time() - t_start > args.deadline_s:
                    break
                _, mrow[f"{impl}_s"] = measure(moe_fns[impl], p0["experts"], x, idx, w)
                if on_gpu:
                    mrow[f"{impl}_wall_s"] = wall(moe_fns[impl], p0["experts"], x, idx, w)
        _, mrow["head_s"] = measure(head_fn, h, head_w)
        moe_rows[t] = mrow
        print(f"T={t}: touched {touched}, moe {mrow['moe_s'] * 1e6:.1f} us, err {err:.2e}, "
              + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in mrow.items()
                          if k.startswith(("xla", "alt")) and isinstance(v, float)), flush=True)

        for s in ss:
            if time.time() - t_start > args.deadline_s:
                break
            positions = jnp.arange(s, s + t, dtype=jnp.int32)
            # Rows [S, S + T) stand for the tree's freshly written latents; the rest is never read.
            cache = jax.random.normal(jax.random.key(s + t), (1, s + 256, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                      jnp.bfloat16)
            start = jnp.asarray([s], jnp.int32)
            mask = jnp.asarray(random_tree_mask(rng, t))[None]
            (q, _), pre_s = measure(pre, p0, h, positions)
            attn, attn_s = measure(attend, q, cache, start, mask)
            _, post_s = measure(post, p0, h, attn)
            _, slice_s = measure(slice_fn, layers, slice_experts, h, positions, cache, start, mask)
            row = {"T": t, "S": s, "touched": touched, "attention_s": attn_s, "moe_s": mrow["moe_s"],
                   "rest_s": pre_s + post_s, "layer_s": slice_s / args.layers, "head_s": mrow["head_s"],
                   "attention_floor_s": model.attention_floor(t, s),
                   "moe_floor_s": model.moe_floor(t, touched), "rest_floor_s": model.rest_floor(t)}
            row["glue_s"] = row["layer_s"] - row["attention_s"] - row["moe_s"] - row["rest_s"]
            rows.append(row)
            print(f"  S={s}: attention {attn_s * 1e6:.1f} us (floor {row['attention_floor_s'] * 1e6:.1f}), "
                  f"moe {row['moe_s'] * 1e6:.1f} (floor {row['moe_floor_s'] * 1e6:.1f}), rest {row['rest_s'] * 1e6:.1f} "
                  f"(floor {row['rest_floor_s'] * 1e6:.1f}), layer {row['layer_s'] * 1e6:.1f} us", flush=True)

    result = summarize(meta, rows, moe_rows, checks, model, on_gpu, evaluate_budgets, saturating_profile)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "k26_slice_tiny" if args.tiny else "k26_slice")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(result["markdown"])
    plot(result, stem + ".png")
    print(result["markdown"])
    print(f"wrote {stem}.json/.md/.png in {time.time() - t_start:.0f} s", flush=True)


def resummarize(path):
    """Rebuild the markdown and plot of a stored result with the current summary code (CPU is fine)."""
    import kdtree_jax as kj
    from kdtree_jax.budget import CostModel, evaluate_budgets, saturating_profile

    with open(path) as f:
        stored = json.load(f)
    meta = stored["meta"]
    for m in stored["moe"]:  # results written before the Mosaic kernel was the slice's: it was a side column
        if "mosaic_s" in m:
            m["alt_s"] = m.pop("mosaic_s")
            if "mosaic_wall_s" in m:
                m["alt_wall_s"] = m.pop("mosaic_wall_s")
            meta["moe_impl"], meta["alt_moe_impl"] = "triton", "mosaic (prototype)"
    cfg = tiny_config() if meta["tiny"] else kj.ModelConfig.kimi_k26()
    model = CostModel.from_config(cfg, bandwidth=meta["copy_TBps"] * 1e12)
    result = summarize(meta, stored["rows"], {m["T"]: m for m in stored["moe"]}, stored["checks"], model,
                       not meta["tiny"], evaluate_budgets, saturating_profile)
    stem = os.path.splitext(path)[0]
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(result["markdown"])
    plot(result, stem + ".png")
    print(result["markdown"])


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
    md = [f"# K2.6 layer slice, DDTree verification ({meta['device']}, JAX {meta['jax']}, {meta['date']})", note,
          f"{meta['timing']}; copy bandwidth {meta['copy_TBps']:.3g} TB/s; {meta['layers']} MoE layers; attention "
          f"{meta['attention_impl']}, MoE {meta['moe_impl']}. Floors: kdtree_jax.budget (MoE floor from the "
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
               "| S | T | budget | verify ms | AR step ms | draft ms | break-even acceptance |", "|---|---|---|---|---|---|---|"]
        by = {(r["T"], r["S"]): r for r in rows}
        for s in sorted({r["S"] for r in rows}):
            if (1, s) not in by:
                continue

            def verify(t, s=s):
                r = by[(t, s)]
                dense = calibrated.dense_layer_seconds(t, s, r["attention_s"])  # modelled around the measured attention
                return moe_layers * r["layer_s"] + model.num_dense_layers * dense + r["head_s"]

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
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed (pip install -e '.[bench]'): no plot, the .md tables are written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ss = sorted({r["S"] for r in rows})
    fig, axes = plt.subplots(1, len(ss) + 1, figsize=(5 * (len(ss) + 1), 4))
    axes = np.atleast_1d(axes)
    for ax, s in zip(axes, ss):
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
