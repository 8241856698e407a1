"""Benchmark: tree-masked MLA attention kernel vs XLA vs the physical floor (H200).

Shapes (docs/kernels.md): K2 attention, H = 64, c = 512, r = 64, B = 1, S in {4096, 32768} committed
rows, T in {1, 33, 129} tree tokens (random trees). For every shape:
  1. correctness of the kernel vs `tree_mla_attention_reference` (float32, HIGHEST) on fresh inputs;
  2. device time (benchmarks/common.py Timer: CUPTI summed kernel time, all kernels of the call:
     row-mask build + Triton kernel + LSE combine) of the kernel under several tilings, and of a
     plain-jnp XLA implementation (bf16 einsums, f32 softmax) - an XLA path is never reported as
     the kernel;
  3. the floor: max(bytes / 3.4 TB/s, FLOPs / 800 TFLOP/s).
Each timed program runs the op on n_buf independent input sets in sequence (>= ~160 MB of caches
where that is <= 8 sets) so the cache is not simply L2 resident; time per op = program / n_buf;
median of 5 runs after a warm-up. Results carry the run's metadata (device, JAX, date, git commit, command).

Usage (GPU): python benchmarks/bench_tree_attention.py --out DIR [--budget-s 200] [--plan tune --skip-xla]
       shipped pair's shape (H, c, r from its config; float32 and bf16; XLA = the op's impl="xla"):
               python benchmarks/bench_tree_attention.py --out DIR --shipped
               python benchmarks/bench_tree_attention.py --summarize-shipped RUN.json   # results/ .md again
       merge:  python benchmarks/bench_tree_attention.py --summarize RUN1.json RUN2.json
               (writes benchmarks/results/tree_attention_h200.{md,png})
       Mosaic GPU kernel vs XLA and Triton at K2 shapes (CUPTI + wall clock):
               python benchmarks/bench_tree_attention.py --out DIR --mosaic [--mosaic-shapes 32768:33 ...]
               python benchmarks/bench_tree_attention.py --summarize-mosaic RUN1.json RUN2.json
       (CPU):  python benchmarks/bench_tree_attention.py --smoke   # tiny shapes, interpret mode,
               checks the script only; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import Timer, metadata, write_json, write_markdown, write_png, write_results  # noqa: E402
from pallas_kernels.tree_attention import (  # noqa: E402
    BlockConfig,
    pick_config,
    tree_mla_attention_reference,
    tree_mla_attention_xla,
)
from pallas_kernels.tree_attention.triton import tree_attention_pallas  # noqa: E402

COPY_BW = 3.4e12  # bytes/s, measured device copy on the H200 (docs/kernels.md)
PEAK_FLOPS = 800e12  # bf16 dense, measured 8192^3 matmul is 823 TFLOP/s
# --plan tune: candidates per (S, T), from the first sweep (docs/tree_attention.md).
_L = dict(rescale_threshold=8.0)
TUNE_PLAN = {
    (4096, 1): [dict(num_splits=16, **_L), dict(num_splits=8), dict(num_splits=16, partial_dtype="bfloat16")],
    (4096, 33): [dict(num_splits=8, **_L), dict(num_splits=4), dict(block_kv=128, num_stages=1, num_splits=4),
                 dict(num_splits=2)],
    (4096, 129): [dict(num_splits=2, **_L), dict(num_splits=1), dict(block_kv=128, num_stages=1, num_splits=2)],
    (32768, 1): [dict(block_kv=32, num_stages=3, num_splits=128, **_L), dict(num_splits=64),
                 dict(block_kv=32, num_stages=3, num_splits=128, partial_dtype="bfloat16"),
                 dict(block_kv=32, num_stages=3, num_splits=64)],
    (32768, 33): [dict(num_splits=8, **_L), dict(num_splits=4), dict(block_kv=128, num_stages=1, num_splits=8)],
    (32768, 129): [dict(num_splits=2, **_L), dict(num_splits=1), dict(block_kv=128, num_stages=1, num_splits=2)],
}
TARGET_US = {(32768, 1): 13, (4096, 33): 50, (4096, 129): 190, (32768, 33): 370}


def random_tree(rng, T):
    tree = np.zeros((T, T), bool)
    for t in range(T):
        tree[t, t] = True
        if t:
            tree[t] |= tree[rng.integers(0, t)]
    return tree


def make_set(rng, B, T, H, c, r, S, dtype, cache_rows=None):
    """One fresh input set: start = S committed rows, the T tree rows right after; cache_rows (default S + T, no
    spare rows) rows in all."""
    q = jnp.asarray(rng.standard_normal((B, T, H, c + r), np.float32), dtype)
    cache = jnp.asarray(rng.standard_normal((B, cache_rows or S + T, c + r), np.float32), dtype)
    start = jnp.full((B,), S, jnp.int32)
    tree = jnp.asarray(np.stack([random_tree(rng, T) for _ in range(B)]))
    return q, cache, start, tree


def floor_us(S, T, H, c, r, itemsize=2):
    bytes_ = ((S + T) * (c + r) + T * H * (c + r) + T * H * c) * itemsize
    flops = 2 * H * T * (S + T) * (c + r + c)
    return max(bytes_ / COPY_BW, flops / PEAK_FLOPS) * 1e6, bytes_, flops


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def time_program(timer, fn, sets):
    """fn over every input set in one jitted program, timed by `timer`: (Timing, microseconds per op per second
    of the program)."""
    return timer(jax.jit(lambda sets: [fn(*s) for s in sets]), sets), 1e6 / len(sets)


def time_sets(timer, fn, sets):
    """fn over every input set in one jitted program: (outputs, us per op, us per op of the attention kernel
    itself in the median call, or None without device timing)."""
    timing, per_op = time_program(timer, fn, sets)
    if timing.device_s is None:
        return timing.out, timing.wall_s * per_op, None
    kernel = sum(s for name, s in timing.kernels if "tree_mla_attention" in name)
    return timing.out, timing.device_s * per_op, kernel * per_op


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop sweeping after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="CPU script check: tiny shapes, interpret mode")
    ap.add_argument("--plan", choices=["sweep", "tune"], default="sweep",
                    help="sweep: heuristic + tile shapes + split counts; tune: the TUNE_PLAN candidates")
    ap.add_argument("--skip-xla", action="store_true", help="do not time the XLA baseline (already measured)")
    ap.add_argument("--shipped", action="store_true",
                    help="the shipped pair's attention shape instead of K2's: tree_attention_shipped.{json,md}")
    ap.add_argument("--mosaic", action="store_true",
                    help="K2 shapes: the Mosaic GPU kernel (MOSAIC_PLAN configs) beside XLA and the Triton kernel "
                         "(its tuned config), CUPTI and wall clock: tree_attention_mosaic_h200.{json,md}")
    ap.add_argument("--skip-triton", action="store_true",
                    help="with --mosaic: do not time the (deprecated) Triton kernel")
    ap.add_argument("--mosaic-shapes", nargs="+", metavar="S:T",
                    help="with --mosaic: only these (S, T) of MOSAIC_PLAN, e.g. 32768:33 32768:129")
    args = ap.parse_args()
    if args.shipped:
        return shipped_main(args)
    if args.mosaic:
        return mosaic_main(args)
    t_begin = time.time()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        sys.exit("no GPU: this benchmark only measures on the device (use --smoke to check the script)")
    interpret = args.smoke
    timer = Timer(1, device=False) if args.smoke else Timer(5)  # smoke: wall clock, meaningless
    if args.smoke:
        H, c, r, shapes, dtype = 6, 64, 16, [(100, 1), (100, 5)], jnp.float32
    else:
        H, c, r, shapes, dtype = 64, 512, 64, [(S, T) for S in (4096, 32768) for T in (1, 33, 129)], jnp.bfloat16
    scale = 1.0 / math.sqrt(192)  # K2: 1/sqrt(qk_nope + rope) (yarn mscale aside)

    meta = metadata(H=H, c=c, r=r, B=1, dtype=str(jnp.dtype(dtype)), smoke=args.smoke,
                    method=("SMOKE RUN: wall clock of one call, meaningless" if args.smoke else
                            "CUPTI profiler.measure, median of 5, n_buf input sets per program"), timer=timer.method)
    results = dict(shapes=[])
    stem = os.path.join(args.out, "tree_attention_h200")

    def dump():
        write_json(stem, meta, results)

    rng = np.random.default_rng(1234)
    entries = {}
    for S, T in shapes:
        cache_bytes = (S + T) * (c + r) * 2
        # Only T = 1 is memory bound: there L2 residency matters, elsewhere 2 sets save compile time.
        n_buf = int(min(8, max(2, math.ceil(160e6 / cache_bytes)))) if (T == 1 and not args.smoke) else 2
        sets = [make_set(rng, 1, T, H, c, r, S, dtype) for _ in range(n_buf)]
        fl_us, bytes_, flops = floor_us(S, T, H, c, r)
        ref0 = jax.jit(lambda *a: tree_mla_attention_reference(*a, scale=scale, value_dim=c))(*sets[0])
        e = dict(S=S, T=T, n_buf=n_buf, floor_us=fl_us, bytes=bytes_, flops=flops,
                 target_us=TARGET_US.get((S, T)), variants=[])
        try:
            if args.skip_xla:
                raise RuntimeError("skipped (--skip-xla)")
            out, t, _ = time_sets(timer, lambda *a: tree_mla_attention_xla(*a, scale=scale, value_dim=c), sets)
            e["xla_us"], e["xla_rel_err"] = t, rel_err(out[0], ref0)
        except Exception as ex:  # noqa: BLE001 - record and go on: one failure must not lose the run
            e["xla_error"] = repr(ex)[:300]
        results["shapes"].append(e)
        entries[(S, T)] = (e, sets, ref0)
        dump()

    def run_variant(S, T, cfg):
        e, sets, ref0 = entries[(S, T)]
        rec = dict(config=dataclasses.asdict(cfg))
        try:
            def fn(*a, cfg=cfg):
                return tree_attention_pallas(*a, scale=scale, value_dim=c, config=cfg, interpret=interpret)

            out, t, t_kernel = time_sets(timer, fn, sets)
            rec.update(us=t, kernel_only_us=t_kernel, rel_err=rel_err(out[0], ref0))
        except Exception as ex:  # noqa: BLE001
            rec["error"] = repr(ex)[:400]
        e["variants"].append(rec)
        dump()
        return rec

    def ok(rec):
        return "us" in rec and rec["rel_err"] < 2e-2

    if args.plan == "tune":
        # Round robin over the per-shape candidate lists so a budget cut loses the least.
        plans = {st: [BlockConfig(**kw) for kw in TUNE_PLAN.get(st, [])] for st in shapes}
        if args.smoke:
            plans = {st: [BlockConfig(block_kv=16, num_splits=2, rescale_threshold=8.0)] for st in shapes}
        for k in range(max(len(v) for v in plans.values())):
            for st in shapes:
                if k < len(plans[st]) and time.time() - t_begin < args.budget_s:
                    run_variant(*st, plans[st][k])
        shapes_to_sweep = []
    else:
        shapes_to_sweep = shapes
    # Phase A: the heuristic/table config everywhere (correctness + a first time).
    for S, T in shapes_to_sweep:
        run_variant(S, T, pick_config(batch=1, num_tree=T, num_heads=H, latent_dim=c, rope_dim=r, cache_rows=S + T))
    # Phase B: tile shapes at the heuristic split count; Phase C: split counts with the best tiles.
    bases = [(64, 8, 2), (32, 8, 2), (32, 8, 3), (64, 8, 1)] if not args.smoke else [(16, 8, 2)]
    for S, T in shapes_to_sweep:
        heur = pick_config(batch=1, num_tree=T, num_heads=H, latent_dim=c, rope_dim=r, cache_rows=S + T)
        for bk, w, st in bases[1:] if not args.smoke else bases:
            if time.time() - t_begin > args.budget_s:
                break
            run_variant(S, T, BlockConfig(block_kv=bk, num_warps=w, num_stages=st, num_splits=heur.num_splits))
    for S, T in shapes_to_sweep:
        e = entries[(S, T)][0]
        good = [v for v in e["variants"] if ok(v)]
        if not good:
            continue
        best = min(good, key=lambda v: v["us"])["config"]
        kv_tiles = S // best["block_kv"]
        cands = {1: [8, 16, 32, 64, 128], 33: [1, 2, 4, 8], 129: [1, 2, 4]}.get(T, [1, 2])
        tried = {v["config"]["num_splits"] for v in e["variants"] if v["config"]["block_kv"] == best["block_kv"]
                 and v["config"]["num_stages"] == best["num_stages"]}
        for ns in cands:
            if ns in tried or ns > max(1, kv_tiles // 2) or time.time() - t_begin > args.budget_s:
                continue
            run_variant(S, T, BlockConfig(**{**best, "num_splits": ns}))
        if T == 1 and time.time() - t_begin < args.budget_s:
            good = [v for v in e["variants"] if ok(v)]
            best = min(good, key=lambda v: v["us"])["config"]
            if best["num_splits"] > 1:
                run_variant(S, T, BlockConfig(**{**best, "partial_dtype": "bfloat16"}))

    # Summary table.
    lines = [f"# Tree-masked MLA attention, {meta['device']}, jax {meta['jax']}, {meta['date']}",
             "", f"H={H}, c={c}, r={r}, B=1, {meta['dtype']}; {meta['method']}.", "",
             "| S | T | floor us | target us | XLA us | kernel us (best) | kernel-only us | x vs XLA | of floor | "
             "best config | rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in results["shapes"]:
        good = [v for v in e["variants"] if ok(v)]
        if good:
            b = min(good, key=lambda v: v["us"])
            cfg = b["config"]
            cs = (f"bk{cfg['block_kv']} w{cfg['num_warps']} st{cfg['num_stages']} split{cfg['num_splits']} "
                  f"{cfg['partial_dtype']} tau{cfg.get('rescale_threshold', 0)}")
            xla = e.get("xla_us")
            lines.append(
                f"| {e['S']} | {e['T']} | {e['floor_us']:.1f} | {e['target_us'] or '-'} | "
                f"{xla:.1f} | {b['us']:.1f} | {b['kernel_only_us'] or 0:.1f} | {xla / b['us']:.2f} | "
                f"{e['floor_us'] / b['us']:.0%} | {cs} | {b['rel_err']:.1e} |" if xla else
                f"| {e['S']} | {e['T']} | {e['floor_us']:.1f} | {e['target_us'] or '-'} | - | {b['us']:.1f} | - | - | "
                f"- | {cs} | {b['rel_err']:.1e} |")
        else:
            errs = [v.get("error", f"rel_err {v.get('rel_err')}") for v in e["variants"]]
            lines.append(f"| {e['S']} | {e['T']} | {e['floor_us']:.1f} | - | {e.get('xla_us', '-')} | FAILED | | | | "
                         f"{errs[:1]} | |")
    table = "\n".join(lines)
    results["elapsed_s"] = time.time() - t_begin
    write_results(stem, meta, results, table)
    print(table)
    print(f"elapsed {time.time() - t_begin:.0f}s")


# --mosaic: split counts per (S, T) (block_kv 64 and a 2-deep ring: all that fits SMEM at c = 512). T * H / 64 row
# tiles x splits CTAs; 132 SMs.
# --mosaic: per (S, T), the Mosaic kernel variants timed (schedule, split count). "replicated" = each warpgroup its own
# QK^T (measured 2026-12-02); "shared_qk" = one QK^T handed over in SMEM (docs/tree_attention.md).
_SCHEDULES = ("replicated", "shared_qk")
MOSAIC_PLAN = {  # in the order measured (a --budget-s cut drops the last shapes)
    (32768, 33): [dict(num_splits=n, schedule=s) for n in (4, 8) for s in _SCHEDULES],
    (32768, 129): [dict(num_splits=n, schedule=s) for n in (1, 2) for s in _SCHEDULES],
    (32768, 1): [dict(num_splits=n, schedule=s) for n in (64, 128) for s in _SCHEDULES],
    (4096, 33): [dict(num_splits=n, schedule=s) for n in (2, 4) for s in _SCHEDULES],
    (4096, 1): [dict(num_splits=n, schedule=s) for n in (16, 32) for s in _SCHEDULES],
    (4096, 129): [dict(num_splits=n, schedule=s) for n in (1, 2) for s in _SCHEDULES],
    (32768, 9): [dict(num_splits=n, schedule=s) for n in (16, 32) for s in _SCHEDULES],
    (4096, 9): [dict(num_splits=n, schedule=s) for n in (4, 8) for s in _SCHEDULES],
}
MOSAIC_TARGET_US = {(32768, 1): 18, (32768, 33): 300, (32768, 129): 1100, (4096, 1): 10, (4096, 33): 45}


def mosaic_main(args):
    """K2 attention shapes: XLA (the bf16 jnp form), the Triton kernel at its tuned config and the Mosaic GPU
    kernel at each MOSAIC_PLAN split count, each checked against the float32 reference on the first input set;
    CUPTI summed kernel time and wall clock per op; the floor. Rows go out as they are measured."""
    from pallas_kernels.tree_attention.mosaic_gpu import MosaicAttentionConfig, tree_attention_mosaic

    if jax.default_backend() != "gpu":
        sys.exit("no GPU: --mosaic only measures on the device")
    t_begin = time.time()
    H, c, r = 64, 512, 64
    scale = 1.0 / math.sqrt(192)
    timer = Timer(5)
    meta = metadata(H=H, c=c, r=r, B=1, dtype="bfloat16", timer=timer.method,
                    method="CUPTI profiler.measure and wall clock, median of 5, n_buf input sets per program")
    rows: list[dict] = []
    stem = os.path.join(args.out, "tree_attention_mosaic_h200")
    rng = np.random.default_rng(1234)

    def timed(fn, sets, ref0):
        timing, per_op = time_program(timer, fn, sets)
        # the costliest kernel by name (for the Mosaic variants: the attention kernel itself) beside the call's
        # other kernels (bit-mask build, q pad, split combine)
        by_name: dict[str, float] = {}
        for name, sec in timing.kernels:
            by_name[name] = by_name.get(name, 0.0) + sec * per_op
        top = sorted(by_name.items(), key=lambda k: -k[1])
        return dict(us=timing.device_s * per_op, wall_us=timing.wall_s * per_op, rel_err=rel_err(timing.out[0], ref0),
                    kernel_us=top[0][1] if top else None, kernels=top[:6])

    plan = MOSAIC_PLAN
    if args.mosaic_shapes:
        wanted = [tuple(int(x) for x in st.split(":")) for st in args.mosaic_shapes]
        unknown = [st for st in wanted if st not in MOSAIC_PLAN]
        if unknown:
            sys.exit(f"--mosaic-shapes {unknown} not in MOSAIC_PLAN {sorted(MOSAIC_PLAN)}")
        plan = {st: MOSAIC_PLAN[st] for st in wanted}
    for (S, T), variants in plan.items():
        if time.time() - t_begin > args.budget_s:
            break
        n_buf = int(min(8, max(2, math.ceil(160e6 / ((S + T) * (c + r) * 2))))) if T == 1 else 2
        # S_max = S + T rounded up to 64 rows, as an engine allocates it (the Mosaic kernel pads other S_max, a copy)
        s_max = -(-(S + T) // 64) * 64
        sets = [make_set(rng, 1, T, H, c, r, S, jnp.bfloat16, s_max) for _ in range(n_buf)]
        ref0 = jax.jit(lambda *a: tree_mla_attention_reference(*a, scale=scale, value_dim=c))(*sets[0])
        row = dict(S=S, T=T, S_max=s_max, n_buf=n_buf, floor_us=floor_us(S, T, H, c, r)[0],
                   target_us=MOSAIC_TARGET_US.get((S, T)), mosaic=[])
        tri = pick_config(batch=1, num_tree=T, num_heads=H, latent_dim=c, rope_dim=r, cache_rows=s_max)
        impls = [("xla", lambda *a: tree_mla_attention_xla(*a, scale=scale, value_dim=c)),
                 ("triton", lambda *a, tri=tri: tree_attention_pallas(*a, scale=scale, value_dim=c, config=tri))]
        if args.skip_triton:
            impls = impls[:1]
        for name, fn in impls:
            try:
                row[name] = timed(fn, sets, ref0)
            except Exception as ex:  # noqa: BLE001 - record and go on: one failure must not lose the run
                row[name] = dict(error=repr(ex)[:300])
        for variant in variants:
            cfg = MosaicAttentionConfig(**variant)
            try:
                rec = timed(lambda *a, cfg=cfg: tree_attention_mosaic(*a, scale=scale, value_dim=c, config=cfg),
                            sets, ref0)
            except Exception as ex:  # noqa: BLE001
                rec = dict(error=repr(ex)[:400])
            row["mosaic"].append(dict(rec, **variant))
            print(S, T, variant, {k: v for k, v in rec.items() if k != "kernels"}, flush=True)
        rows.append(row)
        write_json(stem, meta, dict(rows=rows))
        print({k: v for k, v in row.items() if k != "mosaic"}, flush=True)
    write_results(stem, meta, dict(rows=rows), mosaic_table(meta, rows))
    print(mosaic_table(meta, rows))


def best_mosaic(row) -> dict | None:
    """The fastest Mosaic variant of a --mosaic row that passed its check (rel err < 2e-2), or None."""
    good = [m for m in row["mosaic"] if "us" in m and m["rel_err"] < 2e-2]
    return min(good, key=lambda m: m["us"]) if good else None


def mosaic_table(meta, rows) -> str:
    lines = [f"# Tree-masked MLA attention: the Mosaic GPU kernel, {meta['device']}, jax {meta['jax']}, {meta['date']}",
             "", f"H={meta['H']}, c={meta['c']}, r={meta['r']}, B=1, bf16, random trees, start = S, cache rows S_max = "
             f"S + T rounded up to 64; {meta['method']}. "
             "us = CUPTI summed kernel time per op (all kernels of the call), wall = wall clock per op. XLA = "
             "tree_mla_attention_xla (bf16 einsums, float32 softmax); Triton = its tuned config; Mosaic = the best "
             "variant (schedule, split count) that passed (rel err < 2e-2 vs the float32 reference). Floor = "
             "max(bytes / 3.4 TB/s, FLOPs / 800 TFLOP/s).", "",
             "| S | T | floor us | target us | XLA us (wall) | Triton us (wall) | Mosaic us (wall) | "
             "schedule, splits | Mosaic / XLA | of floor | rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(d):
        if not d:
            return "-"  # not timed
        return f"{d['us']:.1f} ({d['wall_us']:.1f})" if "us" in d else "error"

    def variant(m):
        return f"{m.get('schedule', 'replicated')}, {m['num_splits']}"

    for row in rows:
        best = best_mosaic(row)
        x = row.get("xla", {}).get("us")
        first_failure = [m.get("error", m.get("rel_err")) for m in row["mosaic"]][:1]
        lines.append(f"| {row['S']} | {row['T']} | {row['floor_us']:.1f} | {row['target_us'] or '-'} | "
                     f"{cell(row.get('xla'))} | {cell(row.get('triton'))} | {cell(best)} | "
                     f"{variant(best) if best else '-'} | {f'{best['us'] / x:.2f}' if best and x else '-'} | "
                     f"{f'{row['floor_us'] / best['us']:.0%}' if best else '-'} | "
                     f"{f'{best['rel_err']:.1e}' if best else first_failure} |")
    if any("kernel_us" in m for row in rows for m in row["mosaic"]):
        lines += ["", "Every Mosaic variant: us = the call (CUPTI, all its kernels), kernel us = the Mosaic kernel "
                  "alone (the rest: bit-mask build, q pad, split combine).", "",
                  "| S | T | schedule | splits | us | kernel us | wall us | rel err |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            for m in row["mosaic"]:
                if "us" not in m:
                    lines.append(f"| {row['S']} | {row['T']} | {m.get('schedule', 'replicated')} | {m['num_splits']} | "
                                 f"error: {m.get('error', '')[:80]} | | | |")
                    continue
                kernel = f"{m['kernel_us']:.1f}" if m.get("kernel_us") else "-"  # not recorded before 2026-12-04
                lines.append(f"| {row['S']} | {row['T']} | {m.get('schedule', 'replicated')} | {m['num_splits']} | "
                             f"{m['us']:.1f} | {kernel} | {m['wall_us']:.1f} | {m['rel_err']:.1e} |")
    return "\n".join(lines)


def summarize_mosaic(paths):
    """Merge --mosaic device runs (later runs add shapes, or replace a shape measured again) into
    benchmarks/results/tree_attention_mosaic_h200.{json,md,png}; the first run's metadata, every run's under "runs"."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = {}
    for run in runs:
        for row in run["rows"]:
            merged[(row["S"], row["T"])] = dict(row, run_date=run["meta"]["date"], run_commit=run["meta"].get("commit"))
    rows = [merged[k] for k in sorted(merged, key=lambda st: (-st[0], st[1]))]
    meta = dict(runs[0]["meta"], runs=[r["meta"] for r in runs], merged_from=[str(p) for p in paths],
                merged_by=metadata())
    stem = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tree_attention_mosaic_h200")
    table = mosaic_table(meta, rows) + "\n\nRuns: " + "; ".join(
        f"{r['meta']['date']} (commit {r['meta'].get('commit')}): "
        + ", ".join(f"S {x['S']} T {x['T']}" for x in r["rows"]) for r in runs) + "."
    write_results(stem, meta, dict(rows=rows), table, plot=lambda path: draw_mosaic(path, meta, rows))
    print(table)


def draw_mosaic(path, meta, rows):
    series = [("floor", [r["floor_us"] for r in rows]), ("target", [r["target_us"] or np.nan for r in rows]),
              ("XLA", [r.get("xla", {}).get("us", np.nan) for r in rows]),
              ("Triton kernel", [r.get("triton", {}).get("us", np.nan) for r in rows]),
              ("Mosaic GPU kernel", [(best_mosaic(r) or {}).get("us", np.nan) for r in rows])]
    bar_chart(path, [f"S={r['S']}\nT={r['T']}" for r in rows], series, "CUPTI kernel time per call (us)",
              f"Tree MLA attention, K2 H=64 c=512 r=64 bf16, B=1 - {meta['device']}, jax {meta['jax']}")


def bar_chart(path, labels, series, ylabel, title):
    """Grouped bars on a log scale: one group per label, one bar per (name, values) of `series`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        ax.bar(x + (k - (len(series) - 1) / 2) * width, np.asarray(values, float), width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(x, labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SHIPPED_SHAPES = [(S, T) for S in (256, 2048) for T in (1, 33)]
# (dtype, matmul precision the model runs under): float32 at JAX's default and at "highest" (how the float32
# engine runs: bench_e2e, the greedy invariant), bf16.
SHIPPED_VARIANTS = [("float32", None), ("float32", "highest"), ("bfloat16", None)]


def shipped_main(args):
    """The shipped pair's attention (H, c, r of its config; S_max = cache rows of a benchmark call, 256, and its
    maximum position, 2048): the two implementations the dispatcher chooses between, the Triton kernel at its
    pick_config tiling and impl="xla" (tree_mla_attention_xla), each checked against the reference first.
    Decides which one `choose_attention` may pick for such a model (tuned.measured_fastest)."""
    import kdtree_jax as kj
    from kdtree_jax.checkpoint import checkpoint_config
    from pallas_kernels.tree_attention import tree_mla_attention

    if jax.default_backend() != "gpu":
        sys.exit("no GPU: --shipped only measures on the device")
    cfg, _ = checkpoint_config(Path(kj.__file__).parent / "assets" / "target", expect_kind="target")
    H, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + r)
    timer = Timer(5)
    meta = metadata(H=H, c=c, r=r, B=1, method="CUPTI profiler.measure, median of 5, 8 input sets per program",
                    timer=timer.method)
    rows: list[dict] = []
    stem = os.path.join(args.out, "tree_attention_shipped")
    rng = np.random.default_rng(1234)
    for dtype_name, precision in SHIPPED_VARIANTS:
        dtype = jnp.dtype(dtype_name)
        for S, T in SHIPPED_SHAPES:
            sets = [make_set(rng, 1, T, H, c, r, S - T, dtype) for _ in range(8)]
            ref0 = jax.jit(lambda *a: tree_mla_attention_reference(*a, scale=scale, value_dim=c))(*sets[0])
            row = dict(dtype=dtype_name, precision=precision or "default", S=S, T=T,
                       floor_us=floor_us(S - T, T, H, c, r, dtype.itemsize)[0])
            for impl in ("xla", "triton"):
                try:
                    with jax.default_matmul_precision(precision):
                        out, t, _ = time_sets(timer, lambda *a, impl=impl: tree_mla_attention(
                            *a, scale=scale, value_dim=c, impl=impl), sets)
                    row[f"{impl}_us"], row[f"{impl}_rel_err"] = t, rel_err(out[0], ref0)
                except Exception as ex:  # noqa: BLE001 - record and go on
                    row[f"{impl}_error"] = repr(ex)[:300]
            rows.append(row)
            write_json(stem, meta, dict(rows=rows))  # a run cut short keeps its rows
            print(row, flush=True)
    write_results(stem, meta, dict(rows=rows), shipped_table(meta, rows))
    print(shipped_table(meta, rows))


def shipped_table(meta, rows) -> str:
    """The markdown of a --shipped run (also from a run cut short: --summarize-shipped JSON)."""
    done = {(r["dtype"], r["precision"]) for r in rows}
    missing = [f"{d} {p or 'default'}" for d, p in SHIPPED_VARIANTS if (d, p or "default") not in done]
    lines = [f"# Tree-masked MLA attention at the shipped pair's shape, {meta['device']}, jax {meta['jax']}, "
             f"{meta['date']}", "", f"H={meta['H']}, c={meta['c']}, r={meta['r']}, B=1, start = S_max - T; "
             f"{meta['method']}. XLA = impl='xla' (tree_mla_attention_xla: float32 HIGHEST reference, or bf16 "
             "einsums with float32 accumulation), Triton = the kernel at its pick_config tiling; precision = the "
             "matmul precision the call ran under. Floor = bytes / 3.4 TB/s."
             + (f" Not measured (the run was cut short): {', '.join(missing)}." if missing else ""), "",
             "| dtype | precision | S_max | T | floor us | XLA us | Triton us | Triton / XLA | rel err (Triton) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        x, t = row.get("xla_us"), row.get("triton_us")
        ratio = f"{t / x:.2f}" if x and t else "-"
        lines.append(f"| {row['dtype']} | {row['precision']} | {row['S']} | {row['T']} | {row['floor_us']:.2f} | "
                     f"{x or float('nan'):.1f} | {t or float('nan'):.1f} | {ratio} | "
                     f"{row.get('triton_rel_err', float('nan')):.1e} |")
    return "\n".join(lines)


def summarize_shipped(path):
    run = json.loads(Path(path).read_text())
    stem = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tree_attention_shipped")
    write_results(stem, run["meta"], {"rows": run["rows"]}, shipped_table(run["meta"], run["rows"]))


def summarize(paths, out_dir):
    """Merge device runs (JSON files of this script) into tree_attention_h200.{md,png}; the markdown carries the
    first run's metadata, with the merge's own record under "merged_by"."""
    runs = [json.load(open(p)) for p in paths]
    merged = {}
    for run in runs:
        for e in run["shapes"]:
            m = merged.setdefault((e["S"], e["T"]), dict(e, variants=[]))
            if "xla_us" in e:
                m["xla_us"] = e["xla_us"]
            m["variants"] += [dict(v, date=run["meta"]["date"]) for v in e["variants"] if "us" in v]
    meta = dict(runs[0]["meta"], merged_from=list(paths), merged_by=metadata())
    lines = [f"# Tree-masked MLA attention on the {meta['device']} (jax {meta['jax']})", "",
             f"Runs: {', '.join(r['meta']['date'] for r in runs)} (UTC). H={meta['H']}, c={meta['c']}, "
             f"r={meta['r']}, B=1, {meta['dtype']}, random trees, start = S. Device time by CUPTI "
             "(median of 5; all kernels of one call: row-mask build + Triton kernel + LSE combine). "
             "Floor = max(bytes / 3.4 TB/s, FLOPs / 800 TFLOP/s). XLA = plain jnp (bf16 einsums, f32 softmax).",
             "", "| S | T | floor us | target us | XLA us | kernel us | kernel TFLOP/s | vs XLA | floor/kernel | "
             "config | max rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    labels, rows = [], []
    for (S, T), e in sorted(merged.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        b = min(e["variants"], key=lambda v: v["us"])
        c = b["config"]
        cs = (f"bk{c['block_kv']} st{c['num_stages']} split{c['num_splits']}"
              f"{' lazy' if c.get('rescale_threshold') else ''}"
              f"{' bf16-partials' if c['partial_dtype'] == 'bfloat16' else ''}")
        xla = e.get("xla_us")
        lines.append(f"| {S} | {T} | {e['floor_us']:.1f} | {e['target_us'] or '-'} | {xla:.1f} | {b['us']:.1f} | "
                     f"{e['flops'] / b['us'] / 1e6:.0f} | {xla / b['us']:.2f}x | {e['floor_us'] / b['us']:.0%} | "
                     f"{cs} | {b['rel_err']:.1e} |")
        labels.append(f"S={S}\nT={T}")
        rows.append((e["floor_us"], e["target_us"] or np.nan, xla, b["us"]))
    stem = os.path.join(out_dir, "tree_attention_h200")
    write_markdown(stem, meta, "\n".join(lines))
    write_png(stem, lambda path: draw(path, meta, labels, rows))
    print("\n".join(lines))


def draw(path, meta, labels, rows):
    rows = np.array(rows, float)
    bar_chart(path, labels, [(name, rows[:, k]) for k, name in enumerate(["floor", "target", "XLA (jnp)",
                                                                          "Pallas kernel"])],
              "device time per call (us)",
              f"Tree MLA attention, H=64, c=512, r=64, B=1 - {meta['device']}, jax {meta['jax']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--summarize-mosaic":
        summarize_mosaic(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--summarize-shipped":
        summarize_shipped(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2:], os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    else:
        main()
