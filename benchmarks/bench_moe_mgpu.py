"""The Mosaic GPU grouped INT4 MoE (pallas_kernels/moe_w4a16/mosaic_gpu.py) on one K2.6 layer's routed experts,
on the H200: correctness against the XLA reference, then device-side time per variant against the
touched-expert floor, with each variant's per-kernel breakdown, in one run.

  python benchmarks/bench_moe_mgpu.py --ts 1,9,33,129 --variants bn64:bk256:s4,bn64:bk512:s4 --out DIR

A variant is a tiling for the gate/up launches, optionally "/" a tiling for the down launch (`MgpuConfig.parse`:
e.g. "bn64:bk256:s4/bn64:bk128:s6"), optionally "+fused": gate and up in one launch with the SwiGLU in its
epilogue (`fused_gate_up=True`), e.g. "bn64:bk256:s4+fused". The experts (E = 384, D = 7168, I = 2048) are
random INT4 made on the device straight in the kernel layout; each token routes to 8 distinct uniformly random
experts. Timing: benchmarks/common.py Timer (CUPTI summed kernel time, one window per iteration, median), the
whole routed MoE including its XLA grouping and glue; the floor is the touched experts' INT4 + bf16-scale bytes
at the copy bandwidth measured in this run (benchmarks/cost_model.py). Issue 7's T = 1 target counts the shared
expert too: its bf16 XLA time and bytes are measured and added in the "layer" columns. With --loop-calls N (default
20) each variant is also timed by wall clock inside one jitted loop of N dependent calls (`common.loop_wall_us`: the
per-call cost in a decode loop, launch gaps included, no dispatch), before any CUPTI window: issue 20's T = 1 target
asks for both. --timeline runs instead the device's own timeline of that loop (`common.loop_timeline`: per call
the span, the busy time and the gaps, and one call's launches with the idle time before each) beside its wall clock,
and no CUPTI window (jax's profiler and CUPTI's windows cannot share a process: Mosaic's CUPTI profiler then aborts
on dropped activity records, H100, 2026-12-06); it writes DIR/moe_mgpu_timeline.json/.md.
A variant that fails to compile or disagrees with the reference is reported, never timed.
Writes DIR/moe_mgpu.json and DIR/moe_mgpu.md with the run's metadata.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="folder for moe_mgpu.json/.md")
    ap.add_argument("--ts", default="1,9,33,129", help="tokens T routed through the layer, comma-separated")
    ap.add_argument("--variants", default="bn64:bk256:s4",
                    help="comma-separated variants: UP_TILING[/DOWN_TILING][+fused] (MgpuConfig.parse; +fused: gate "
                         "and up in one launch), e.g. bn64:bk256:s4,bn64:bk256:s4+fused,bn64:bk256:s4/bn64:bk128:s6")
    ap.add_argument("--iters", type=int, default=7, help="timed iterations per point (median reported)")
    ap.add_argument("--deadline-s", type=float, default=400.0, help="start no new T after this many seconds")
    ap.add_argument("--loop-calls", type=int, default=20,
                    help="calls in the jitted loop of the wall-clock column (0: no wall clock in a loop)")
    ap.add_argument("--timeline", action="store_true",
                    help="instead of the CUPTI rows, profile that loop (jax's profiler): per call span, busy time, "
                         "gaps, and one call's launches with the idle time before each (moe_mgpu_timeline.json/.md)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import kdtree_jax as kj
    from benchmarks.common import Timer, copy_bandwidth, loop_timeline, loop_wall_us, metadata, write_results
    from benchmarks.cost_model import BF16_BYTES, CostModel
    from pallas_kernels.int4 import MosaicInt4Weight
    from pallas_kernels.moe_w4a16 import grouped_moe_w4a16_mgpu, grouped_moe_w4a16_reference
    from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig

    if jax.default_backend() != "gpu":
        raise SystemExit("bench_moe_mgpu needs a Hopper GPU: CPU timings prove nothing")
    t_start = time.time()
    ts = [int(v) for v in args.ts.split(",")]
    variants = {}
    for spec in args.variants.split(","):
        tilings, plus, flag = spec.partition("+")
        if plus and flag != "fused":
            raise SystemExit(f"variant {spec!r}: the only option after '+' is 'fused'")
        up, _, down = tilings.partition("/")
        variants[spec] = (MgpuConfig.parse(up), MgpuConfig.parse(down or up), bool(plus))
    cfg = kj.ModelConfig.kimi_k26()
    e, d, inter, top_k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    timer = Timer(args.iters)
    meta = metadata(timing="CUPTI summed kernel time, one window per iteration, median", timer=timer.method,
                    shape={"experts": e, "hidden": d, "intermediate": inter, "top_k": top_k})
    print(meta, flush=True)

    def measure(f, *a):  # (output, device seconds, [(kernel name, us)] of the median call)
        timing = timer(f, *a)
        return timing.out, timing.device_s, [(name[:60], s * 1e6) for name, s in timing.kernels]

    @jax.jit
    def make_experts(key):
        def leaf(k, n_out, k_in):
            kw, ks = jax.random.split(k)
            return MosaicInt4Weight(
                w_i4=jax.random.randint(kw, (e, n_out, k_in), -8, 8, jnp.int8).astype(jnp.int4),  # [E, N, K]
                scale_t=jax.random.uniform(ks, (e, k_in // 32, n_out), jnp.float32, 0.004, 0.02
                                           ).astype(jnp.bfloat16))  # [E, K/32, N]
        kg, ku, kd = jax.random.split(key, 3)
        return {"gate": leaf(kg, inter, d), "up": leaf(ku, inter, d), "down": leaf(kd, d, inter)}

    experts = jax.block_until_ready(make_experts(jax.random.key(1)))
    shared = jax.jit(lambda k: [jax.random.normal(kk, shp, jnp.bfloat16) * 0.02 for kk, shp in zip(
        jax.random.split(k, 3), [(d, inter), (d, inter), (inter, d)], strict=True)])(jax.random.key(2))
    shared_fn = jax.jit(lambda x, w: (jax.nn.silu(x @ w[0]) * (x @ w[1])) @ w[2])
    def token_reference(ex, x_t, ids_t, w_t):  # one token: its k experts dequantized, [k, N, K] f32
        chosen = jax.tree.map(lambda a: a[ids_t], ex)
        return grouped_moe_w4a16_reference(x_t[None].astype(jnp.float32), chosen,
                                           jnp.arange(top_k, dtype=jnp.int32)[None], w_t[None])[0]  # [D] f32

    reference = jax.jit(lambda x, ex, ids, w: jax.lax.map(lambda a: token_reference(ex, *a), (x, ids, w)))
    fns = {name: jax.jit(lambda x, ex, ids, w, up=up, down=down, fused=fused: grouped_moe_w4a16_mgpu(
        x, ex, ids, w, config_up=up, config_down=down, fused_gate_up=fused))
        for name, (up, down, fused) in variants.items()}

    def routing(t):  # the same random tokens and routing for the loop walls and the CUPTI rows
        kx, kr, kw = jax.random.split(jax.random.key(100 + t), 3)
        x = jax.random.normal(kx, (t, d), jnp.bfloat16)
        ids = jax.lax.top_k(jax.random.uniform(kr, (t, e)), top_k)[1].astype(jnp.int32)  # distinct per token
        w = jax.random.uniform(kw, (t, top_k), jnp.float32, 0.1, 1.0)
        return x, ids, w / jnp.sum(w, -1, keepdims=True) * cfg.routed_scaling_factor

    walls = {}  # (T, variant) -> seconds a call in a jitted loop; before the first CUPTI window (it inflates walls)
    for t in ts if args.loop_calls else ():
        x, ids, w = routing(t)
        for name, fn in fns.items():
            try:
                walls[t, name] = loop_wall_us(fn, (x, experts, ids, w), args.loop_calls) * 1e-6
            except Exception as exc:  # noqa: BLE001 - reported with the variant's CUPTI row below
                print(f"T={t} {name}: loop wall failed: {type(exc).__name__}", flush=True)
    if args.timeline:
        if not args.loop_calls:
            raise SystemExit("--timeline profiles the loop of --loop-calls calls: give it a positive count")
        rows = []
        for t in ts:
            x, ids, w = routing(t)
            for name, fn in fns.items():
                row = {"T": t, "variant": name, "loop_wall_s": walls.get((t, name))}
                try:
                    row["timeline"] = loop_timeline(fn, (x, experts, ids, w), args.loop_calls)
                except Exception as exc:  # noqa: BLE001 - the other variants still run
                    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                rows.append(row)
        meta["loop_calls"] = args.loop_calls
        markdown = summarize_timelines(meta, rows)
        write_results(os.path.join(args.out, "moe_mgpu_timeline"), meta, {"rows": rows, "markdown": markdown},
                      markdown)
        print(markdown, flush=True)
        return
    bandwidth = copy_bandwidth(timer)
    model = CostModel.from_config(cfg, bandwidth=bandwidth)
    meta["copy_TBps"] = bandwidth / 1e12
    meta["loop_calls"] = args.loop_calls
    shared_floor = 3 * d * inter * BF16_BYTES / bandwidth

    rows = []
    for t in ts:
        if time.time() - t_start > args.deadline_s:
            print(f"deadline: skipping T={t} and later", flush=True)
            break
        x, ids, w = routing(t)
        touched = int(np.unique(np.asarray(ids)).size)
        want = reference(x, experts, ids, w)
        _, shared_s, _ = measure(shared_fn, x, shared)
        row = {"T": t, "touched": touched, "floor_s": model.moe_floor(t, touched), "shared_s": shared_s,
               "shared_floor_s": shared_floor, "variants": {}}
        for name, fn in fns.items():
            try:
                got, sec, kernels = measure(fn, x, experts, ids, w)
                got, ref = got.astype(jnp.float32), want
                err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                row["variants"][name] = ({"s": sec, "rel_err": err, "kernels": kernels,
                                          "loop_wall_s": walls.get((t, name))} if err < 3e-2
                                         else {"error": f"WRONG (rel err {err:.2e})"})
            except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the run
                row["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            v = row["variants"][name]
            print(f"T={t} touched={touched} {name}: "
                  + (f"{v['s'] * 1e6:.1f} us = {v['s'] / row['floor_s']:.2f}x floor, err {v['rel_err']:.1e}; "
                     + ", ".join(f"{k} {us:.1f}" for k, us in v["kernels"]) if "s" in v else v["error"]), flush=True)
        rows.append(row)

    markdown = summarize(meta, rows, list(variants))
    write_results(os.path.join(args.out, "moe_mgpu"), meta, {"rows": rows, "markdown": markdown}, markdown)
    print(markdown, flush=True)


def summarize(meta, rows, names) -> str:
    us = lambda v: f"{v * 1e6:.1f}"  # noqa: E731
    md = [f"# Mosaic GPU grouped INT4 MoE, one K2.6 layer ({meta['device']})", "",
          f"{meta['date']}, JAX {meta['jax']}; {meta['timing']}; copy bandwidth {meta['copy_TBps']:.2f} TB/s. "
          "Microseconds, routed experts with their grouping and glue; floor = touched experts' INT4 + scale "
          "bytes. layer = routed + the shared expert (bf16 XLA), against routed + shared bytes. [loop ...]: wall "
          f"clock a call inside one jitted loop of {meta.get('loop_calls', 0)} calls (launch gaps included), x floor.",
          "", "| T | touched | floor | " + " | ".join(f"{n} | x floor" for n in names) + " | shared (floor) | "
          "best layer x floor |", "|---" * (4 + 2 * len(names) + 1) + "|"]
    for r in rows:
        cells, best = [], None
        for n in names:
            v = r["variants"].get(n, {"error": "not run"})
            if "s" in v:
                loop = (f" [loop {us(v['loop_wall_s'])}, {v['loop_wall_s'] / r['floor_s']:.2f}x]"
                        if v.get("loop_wall_s") else "")
                cells += [us(v["s"]) + loop, f"{v['s'] / r['floor_s']:.2f}"]
                best = v["s"] if best is None else min(best, v["s"])
            else:
                cells += [v["error"][:40], "-"]
        layer = (f"{(best + r['shared_s']) / (r['floor_s'] + r['shared_floor_s']):.2f}" if best is not None else "-")
        md.append(f"| {r['T']} | {r['touched']} | {us(r['floor_s'])} | " + " | ".join(cells)
                  + f" | {us(r['shared_s'])} ({us(r['shared_floor_s'])}) | {layer} |")
    md += ["", "Per-kernel breakdown (us, one call):", ""]
    for r in rows:
        for n in names:
            v = r["variants"].get(n, {})
            if "kernels" in v:
                md.append(f"- T={r['T']} {n}: " + ", ".join(f"{k} {t:.1f}" for k, t in v["kernels"]))
    return "\n".join(md) + "\n"


def summarize_timelines(meta, rows) -> str:
    """--timeline's report: per (T, variant) the loop's marginal wall clock a call, the device timeline's span / busy /
    gaps a call, and one call's launches with the idle time before each."""
    from benchmarks.common import timeline_events_markdown

    md = [f"# Mosaic GPU grouped INT4 MoE in a jitted loop: the device's timeline ({meta['device']})", "",
          f"{meta['date']}, JAX {meta['jax']}; one K2.6 layer's routed experts; a jitted loop of "
          f"{meta['loop_calls']} dependent calls profiled with jax's profiler (device timestamps), no CUPTI window "
          "in this process. wall: the marginal wall clock a call (common.loop_wall_us). Microseconds.", "",
          "| T | variant | wall a call | span a call | busy | gaps | device events a call |", "|---" * 7 + "|"]
    for r in rows:
        tl, wall = r.get("timeline"), r.get("loop_wall_s")
        wall_cell = f"{wall * 1e6:.1f}" if wall else "-"
        if tl is None:
            md.append(f"| {r['T']} | {r['variant']} | {wall_cell} | {r.get('error', 'not run')[:60]} | | | |")
            continue
        md.append(f"| {r['T']} | {r['variant']} | {wall_cell} | {tl['span_us_per_call']:.1f} | "
                  f"{tl['busy_us_per_call']:.1f} | {tl['gap_us_per_call']:.1f} | {tl['events_per_call']:g} |")
    for r in rows:
        tl = r.get("timeline")
        if not tl:
            continue
        md += timeline_events_markdown(tl, f"T={r['T']} {r['variant']}")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
