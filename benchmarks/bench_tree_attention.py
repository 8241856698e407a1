"""Benchmark: the tree-masked MLA attention's Mosaic GPU kernel vs XLA vs the physical floor (H200).

K2 attention shapes (docs/kernels.md): H = 64, c = 512, r = 64, B = 1, bf16, random trees, S committed rows in
{4096, 32768}, T tree tokens in {1, 9, 33, 129} (MOSAIC_PLAN), cache rows S_max = S + T rounded up to 64 (as an
engine allocates them). For every shape:
  1. XLA (tree_mla_attention_xla: bf16 einsums, float32 softmax) and the Mosaic GPU kernel at each MOSAIC_PLAN
     variant (schedule, KV split count), each checked against tree_mla_attention_reference (float32, HIGHEST) on
     the first input set; a variant that fails is recorded as failed, never replaced by XLA;
  2. wall clock per op, for every shape and variant before any CUPTI window opens (a CUPTI window inflates the
     process's later wall clocks: benchmarks/common.py Timer), then device time (CUPTI summed kernel time, all
     kernels of the call: the mask-word build for T > 1, q pad, the kernel, split combine) of the same programs;
  3. the floor: max(bytes / 3.4 TB/s, FLOPs / 800 TFLOP/s).
Each timed program runs the op on n_buf independent input sets in sequence (>= ~160 MB of caches at T = 1 where
that is <= 8 sets) so the cache is not simply L2 resident; time per op = program / n_buf; median of 5 runs after a
warm-up. Results carry the run's metadata (device, JAX, date, git commit, command).

Usage (GPU): python benchmarks/bench_tree_attention.py --out DIR [--budget-s 200] [--shapes 32768:33 ...]
               (DIR/tree_attention_mosaic_<h200|h100|gpu>.{json,md}, rewritten as the shapes are measured)
             python benchmarks/bench_tree_attention.py --out DIR --shapes 32768:1 --kernel-source base=OLD.py
               (an A/B in one process: every variant also with another commit's kernel file, `git show
               C:pallas_kernels/tree_attention/mosaic_gpu.py > OLD.py`; rows say [base])
             python benchmarks/bench_tree_attention.py --summarize-mosaic RUN1.json RUN2.json
               (merged into benchmarks/results/tree_attention_mosaic_h200.{json,md,png})
       shipped pair's shape (H, c, r from its config; float32 and bf16; impl="xla", and in bf16 impl="mosaic_gpu"):
             python benchmarks/bench_tree_attention.py --out DIR --shipped
             python benchmarks/bench_tree_attention.py --summarize-shipped RUN.json   # results/ .md again
       (CPU): python benchmarks/bench_tree_attention.py --smoke --out DIR   # the same run at tiny shapes, the
             kernel in Mosaic GPU interpret mode: checks the script only; its timings mean nothing.
       the split-KV combine alone (combine_splits, two reductions, against the textbook XLA form it replaced and a
       variadic-reduction form) at a T = 1 call's partials (64 rows x 512, bf16) per split count: wall clock per
       call inside a jitted loop, then CUPTI time and kernel count; DIR/tree_attention_combine_<h200|h100|gpu>.
       {json,md} (--smoke: on a CPU):
             python benchmarks/bench_tree_attention.py --out DIR --combine [--splits 16 32 64 128]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import Timer, metadata, write_json, write_results  # noqa: E402
from pallas_kernels.tree_attention import tree_mla_attention_reference, tree_mla_attention_xla  # noqa: E402
from pallas_kernels.tree_attention.mosaic_gpu import SCHEDULES  # noqa: E402

COPY_BW = 3.4e12  # bytes/s, measured device copy on the H200 (docs/kernels.md)
PEAK_FLOPS = 800e12  # bf16 dense, measured 8192^3 matmul is 823 TFLOP/s


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


def program(fn):
    """fn over every input set (a list of argument tuples) in one jitted program."""
    return jax.jit(lambda sets: [fn(*s) for s in sets])


def timed(timer, prog, sets, ref0) -> dict:
    """`program` prog over the input sets, timed by `timer`, per op: us (CUPTI summed kernel time; the wall clock
    where the timer has no device timing), wall_us, rel_err (the first set's output vs ref0), and with device timing
    the call's kernels by name, costliest first (kernel_us: the costliest, for the Mosaic variants the attention
    kernel itself; the others are its glue: q pad, split combine, and for T > 1 the mask-word build)."""
    timing = timer(prog, sets)
    per_op = 1e6 / len(sets)
    rec: dict[str, Any] = dict(us=timing.seconds * per_op, wall_us=timing.wall_s * per_op,
                               rel_err=rel_err(timing.out[0], ref0))
    if timer.device:
        by_name: dict[str, float] = {}
        for name, sec in timing.kernels:
            by_name[name] = by_name.get(name, 0.0) + sec * per_op
        top = sorted(by_name.items(), key=lambda k: -k[1])
        rec.update(kernel_us=top[0][1] if top else None, kernels=top[:6])
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no new shape after this many seconds")
    ap.add_argument("--shapes", nargs="+", metavar="S:T",
                    help="only these (S, T) of MOSAIC_PLAN (with --smoke: of SMOKE_PLAN), e.g. 32768:33 32768:129")
    ap.add_argument("--splits", nargs="+", type=int, metavar="N",
                    help="time the Mosaic kernel at these KV split counts instead of the plan's (every selected shape; "
                         "with --schedules: those schedules only), e.g. a T = 1 sweep: --shapes 32768:1 --splits 32 64 "
                         "128 --schedules replicated")
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES,
                    help="only these Mosaic schedules (default: the plan's)")
    ap.add_argument("--kernel-source", nargs="+", default=[], metavar="LABEL=FILE",
                    help="A/B in one process: also time every Mosaic variant with the kernel module FILE (another "
                         "commit's pallas_kernels/tree_attention/mosaic_gpu.py, e.g. from `git show "
                         "C:pallas_kernels/tree_attention/mosaic_gpu.py`), recorded with source LABEL; the headline "
                         "(best variant) stays this tree's kernel")
    ap.add_argument("--shipped", action="store_true",
                    help="the shipped pair's attention shape instead of K2's: tree_attention_shipped.{json,md}")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU script check: tiny shapes, the kernel in Mosaic GPU interpret mode, wall clock")
    ap.add_argument("--combine", action="store_true",
                    help="time the split-KV combine alone (combine_splits vs two other XLA forms) at a T = 1 call's "
                         "partials per split count (--splits, default 16 32 64 128)")
    args = ap.parse_args()
    if args.combine:
        return combine_main(args)
    if args.shipped:
        return shipped_main(args)
    return mosaic_main(args)


# Per (S, T), the Mosaic kernel variants timed (schedule, split count; block_kv 64 and a 2-deep ring: all that fits
# SMEM at c = 512). T * H / 64 row tiles x splits CTAs; 132 SMs. "replicated" = each warpgroup its own QK^T
# (measured 2026-12-02); "shared_qk" = one QK^T handed over in SMEM (docs/tree_attention.md).
_SCHEDULES = ("replicated", "shared_qk")
# (S, T) -> the Mosaic variants timed there, each one's MosaicAttentionConfig keyword arguments
Plan = dict[tuple[int, int], list[dict[str, Any]]]
MOSAIC_PLAN: Plan = {  # in the order measured (a --budget-s cut drops the last shapes)
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
# --smoke (H 8, c 128, r 64: a row width the kernel also takes natively): value_block 64 gives the two value
# warpgroups of c = 512, so both schedules run as at K2; S_max 128 is two KV tiles, so 2 splits share a prefix tile
# and a tail.
SMOKE_PLAN: Plan = {(S, T): [dict(num_splits=n, schedule=s, value_block=64) for n in (1, 2) for s in _SCHEDULES]
                    for S, T in ((100, 1), (100, 5))}


def mosaic_main(args):
    """XLA (the bf16 jnp form) and the Mosaic GPU kernel at each plan variant per (S, T), each checked against the
    float32 reference on the first input set; wall clock per op (every shape and variant, before any CUPTI window),
    then CUPTI summed kernel time per op; the floor. Rows go out as they are measured."""
    from pallas_kernels.tree_attention.mosaic_gpu import tree_attention_mosaic
    from pallas_kernels.w4a16.mosaic_gpu import gpu_interpret_params

    if jax.default_backend() != "gpu" and not args.smoke:
        sys.exit("no GPU: this benchmark only measures on the device (--smoke checks the script on a CPU)")
    # "" = this tree's kernel; the others (--kernel-source) loaded from their files, each as its own module
    sources = {"": sys.modules[tree_attention_mosaic.__module__], **kernel_sources(args.kernel_source)}
    t_begin = time.time()
    if args.smoke:  # wall clock of one call in interpret mode: meaningless, but every path of a device run runs
        H, c, r, plan = 8, 128, 64, SMOKE_PLAN
        # a second wall-clock pass stands in for CUPTI, so that the smoke run goes through both passes
        wall_timer, device_timer, interpret = Timer(1, device=False), Timer(1, device=False), gpu_interpret_params()
        method = "SMOKE RUN: wall clock of one call, the kernel in Mosaic GPU interpret mode, meaningless"
    else:
        H, c, r, plan = 64, 512, 64, MOSAIC_PLAN
        wall_timer, device_timer, interpret = Timer(5, device=False), Timer(5), None
        method = ("wall clock of every shape and variant first, then CUPTI profiler.measure of the same programs; "
                  "median of 5 each, n_buf input sets per program")
    scale = 1.0 / math.sqrt(192)  # K2: 1/sqrt(qk_nope + rope) (yarn mscale aside)
    meta = metadata(H=H, c=c, r=r, B=1, dtype="bfloat16", smoke=args.smoke, method=method, wall_after_cupti=False,
                    timer=device_timer.method)
    rows: list[dict] = []
    stem = os.path.join(args.out, f"tree_attention_mosaic_{card(meta)}")
    rng = np.random.default_rng(1234)

    if args.shapes:
        wanted = [tuple(int(x) for x in st.split(":")) for st in args.shapes]
        unknown = [st for st in wanted if st not in plan]
        if unknown:
            sys.exit(f"--shapes {unknown} not in the plan {sorted(plan)}")
        plan = {(S, T): plan[S, T] for S, T in wanted}  # each a 2-tuple: a key of the plan
    if args.splits or args.schedules:
        plan = {st: [dict(variants[0], num_splits=n, schedule=sch)  # other settings (smoke: value_block) kept
                     for n in (args.splits or sorted({v["num_splits"] for v in variants}))
                     for sch in (args.schedules or dict.fromkeys(v["schedule"] for v in variants))]
                for st, variants in plan.items()}
    # Pass 1, wall clocks: every shape (until --budget-s) and variant, no CUPTI window open yet. Each record keeps its
    # jitted program and input sets for pass 2.
    measured = []  # (record, program, sets, ref0): the records live in `rows`

    def save():  # the rows so far, each with its flat summary (a run cut short keeps what it measured)
        for row in rows:
            row.update(row_summary(row))
        write_json(stem, meta, dict(rows=rows))

    for (S, T), variants in plan.items():
        if time.time() - t_begin > args.budget_s:
            break
        # Only T = 1 is memory bound: there L2 residency matters, elsewhere 2 sets save compile time (and in
        # interpret mode one set saves minutes).
        n_buf = int(min(8, max(2, math.ceil(160e6 / ((S + T) * (c + r) * 2))))) if T == 1 else 2
        n_buf = 1 if args.smoke else n_buf
        # S_max = S + T rounded up to 64 rows, as an engine allocates it (the Mosaic kernel pads other S_max, a copy)
        s_max = -(-(S + T) // 64) * 64
        sets = [make_set(rng, 1, T, H, c, r, S, jnp.bfloat16, s_max) for _ in range(n_buf)]
        ref0 = jax.jit(lambda *a: tree_mla_attention_reference(*a, scale=scale, value_dim=c))(*sets[0])
        row: dict[str, Any] = dict(S=S, T=T, S_max=s_max, n_buf=n_buf, floor_us=floor_us(S, T, H, c, r)[0],
                                   target_us=MOSAIC_TARGET_US.get((S, T)) if not args.smoke else None, xla={},
                                   mosaic=[])
        programs = [(row["xla"], program(lambda *a: tree_mla_attention_xla(*a, scale=scale, value_dim=c)))]
        for variant in variants:
            for label, module in sources.items():  # this tree's kernel (""), then each --kernel-source
                row["mosaic"].append(dict(variant, **({"source": label} if label else {})))
                programs.append((row["mosaic"][-1], program(
                    lambda *a, m=module, cfg=module.MosaicAttentionConfig(**variant):
                    m.tree_attention_mosaic(*a, scale=scale, value_dim=c, config=cfg, interpret=interpret))))
        for rec, prog in programs:
            try:
                rec.update(timed(wall_timer, prog, sets, ref0))
                del rec["us"]  # the device time, from pass 2 (a run cut before it has wall clocks only)
                measured.append((rec, prog, sets, ref0))
            except Exception as ex:  # noqa: BLE001 - record and go on: one failure must not lose the run
                rec["error"] = repr(ex)[:400]
            print(S, T, rec, flush=True)
        rows.append(row)
        save()
    # Pass 2, device time of the same programs (their wall clocks stay pass 1's).
    for rec, prog, sets, ref0 in measured:
        try:
            rec.update({k: v for k, v in timed(device_timer, prog, sets, ref0).items() if k != "wall_us"})
        except Exception as ex:  # noqa: BLE001
            rec["error"] = repr(ex)[:400]
        save()
    results = dict(rows=rows, elapsed_s=time.time() - t_begin)
    write_results(stem, meta, results, mosaic_table(meta, rows))
    print(mosaic_table(meta, rows))
    print(f"elapsed {results['elapsed_s']:.0f}s")
    if args.smoke:  # the script check: every variant must have run and passed
        failed = [(row["S"], row["T"], m) for row in rows for m in [row["xla"], *row["mosaic"]] if not passed(m)]
        if failed or len(rows) < len(plan):
            sys.exit(f"smoke run: {len(plan) - len(rows)} shape(s) not run; failed: {failed}")


def combine_textbook(o_part, lse, dtype):
    """The split-KV combine as first written (until 2026-12-05 in the kernel's wrapper), the baseline of --combine:
    max LSE, exp2 weights, their sum, the weighted sum, the division (five kernels on an H100 at 128 splits)."""
    w = jnp.exp2(lse - jnp.max(lse, axis=1, keepdims=True))
    out = jnp.sum(o_part.astype(jnp.float32) * w[..., None], axis=1) / jnp.sum(w, axis=1)[..., None]
    return out.astype(dtype)


def combine_variadic(o_part, lse, dtype):
    """A form --combine measured slower (tried 2026-12-05): one variadic reduction over the splits whose reducer
    merges (log2-sum-exp, normalized output) pairs as the online softmax does; two kernels for an H100, but an exp2,
    a log2 and a reciprocal per element of the partials."""
    from pallas_kernels.tree_attention.mosaic_gpu import NEG

    def merge(a, b):
        (ma, oa), (mb, ob) = a, b
        a_larger = ma >= mb
        e = jnp.exp2(-jnp.abs(ma - mb))  # the smaller side's weight; the larger side's is 1
        wa, wb = jnp.where(a_larger, 1.0, e), jnp.where(a_larger, e, 1.0)
        return jnp.maximum(ma, mb) + jnp.log2(1.0 + e), (oa * wa + ob * wb) * (1.0 / (1.0 + e))

    lse_rows = jnp.broadcast_to(lse[..., None], o_part.shape)
    _, out = jax.lax.reduce((lse_rows, o_part.astype(jnp.float32)), (jnp.float32(NEG), jnp.float32(0)), merge, (1,))
    return out.astype(dtype)


def card(meta: dict) -> str:
    """The results files' suffix: smoke for a smoke run, else h200 / h100 from the run's device, else gpu."""
    if meta.get("smoke"):
        return "smoke"
    return next((k.lower() for k in ("H200", "H100") if k in meta["device"]), "gpu")


def combine_main(args):
    """combine_splits against combine_variadic and combine_textbook on the partials of a T = 1 call (B 1, 64 rows,
    c 512, bf16; LSEs uniform in [-20, 20]) per split count: each checked against the float64 combine, the marginal
    wall clock a call inside a jitted loop (loops of 400 and 200 calls, every variant before any CUPTI window), then
    CUPTI summed kernel time and the kernels."""
    from benchmarks.common import loop_wall_us
    from pallas_kernels.tree_attention.mosaic_gpu import combine_splits

    if jax.default_backend() != "gpu" and not args.smoke:
        sys.exit("no GPU: this benchmark only measures on the device (--smoke checks the script on a CPU)")
    splits = args.splits or [16, 32, 64, 128]
    rows_, c = 64, 512
    calls = 50 if args.smoke else 200
    timer = Timer(1, device=False) if args.smoke else Timer(5)
    rng = np.random.default_rng(0)
    forms = {"two stages (combine_splits)": combine_splits, "one variadic reduction": combine_variadic,
             "textbook (5 ops)": combine_textbook}
    meta = metadata(B=1, rows=rows_, c=c, dtype="bfloat16", smoke=args.smoke, timer=timer.method,
                    wall=f"marginal wall clock a call inside a jitted loop ((2 x {calls} calls - {calls}) / {calls}, "
                         "medians of 5 loops), all taken before the first CUPTI window", wall_after_cupti=False)
    rows, programs = [], []
    for ns in splits:
        o = rng.standard_normal((1, ns, rows_, c)).astype(np.float32)
        lse = rng.uniform(-20, 20, (1, ns, rows_)).astype(np.float32)
        args_dev = (jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse))
        w = np.exp2(lse.astype(np.float64) - lse.max(axis=1, keepdims=True))
        o64 = np.asarray(args_dev[0].astype(jnp.float32), np.float64)
        want = (o64 * w[..., None]).sum(axis=1) / w.sum(axis=1)[..., None]
        floor = (ns * rows_ * (c * 2 + 4) + rows_ * c * 2) / COPY_BW * 1e6
        recs: dict[str, dict] = {}
        for name, form in forms.items():
            fn = jax.jit(lambda o_, l_, form=form: form(o_, l_, jnp.bfloat16))
            got = np.asarray(fn(*args_dev).astype(jnp.float32), np.float64)
            rec: dict[str, Any] = dict(rel_err=float(np.abs(got - want).max() / np.abs(want).max()))
            try:
                rec["wall_loop_us"] = loop_wall_us(fn, args_dev, calls)
            except RuntimeError as exc:  # a loop too noisy to time (a CPU smoke run): said in the table, not a number
                print(f"{ns} {name}: {exc}", flush=True)
                rec["wall_loop_us"] = None
            recs[name] = rec
            programs.append((rec, fn, args_dev))
            print(ns, name, rec, flush=True)
        rows.append(dict(splits=ns, floor_us=floor, forms=recs))
    for rec, fn, args_dev in programs:  # CUPTI after every wall clock
        timing = timer(fn, *args_dev)
        rec["us"] = timing.seconds * 1e6
        if timer.device:
            rec["kernels"] = [(name, sec * 1e6) for name, sec in timing.kernels]
    lines = [f"# The split-KV combine of a T = 1 call, {meta['device']}, jax {meta['jax']}, {meta['date']}",
             *(["", "**SMOKE RUN (CPU): these numbers are NOT measurements.**"] if args.smoke else []),
             "", f"B 1, {rows_} rows (one T = 1 row tile of 64 heads), c {c}, bf16 partials, float32 LSEs. us = "
             f"{timer.method}; loop wall = {meta['wall']}. Floor = the partials' and the output's bytes / 3.4 TB/s. "
             "rel err = max abs error / max abs value against the float64 combine.", "",
             "| splits | floor us | form | us (kernels) | loop wall us | rel err |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for name, rec in row["forms"].items():
            n = len(rec.get("kernels", []))
            lines.append(f"| {row['splits']} | {row['floor_us']:.1f} | {name} | {rec['us']:.1f}"
                         f"{f' ({n})' if n else ''} | "
                         f"{'too noisy' if rec['wall_loop_us'] is None else format(rec['wall_loop_us'], '.1f')} | "
                         f"{rec['rel_err']:.1e} |")
    table = "\n".join(lines)
    stem = os.path.join(args.out, f"tree_attention_combine_{card(meta)}")
    write_results(stem, meta, dict(rows=rows), table)
    print(table)


def passed(rec) -> bool:
    """A timed record that ran and matched the float32 reference (rel err < 2e-2: bf16 output, bf16 P)."""
    return "us" in rec and rec["rel_err"] < 2e-2


def kernel_sources(specs: list[str]) -> dict[str, Any]:
    """--kernel-source LABEL=FILE ...: each FILE imported as a module of its own (its absolute imports resolve in
    this tree), by label."""
    import importlib.util

    out = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not os.path.isfile(path):
            sys.exit(f"--kernel-source {spec!r}: want LABEL=FILE with an existing FILE")
        module_spec = importlib.util.spec_from_file_location(f"_kernel_source_{len(out)}", path)
        assert module_spec is not None and module_spec.loader is not None, path  # a .py file always has both
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # a dataclass resolves its module by name while the file executes
        module_spec.loader.exec_module(module)
        out[label] = module
    return out


def best_mosaic(row) -> dict | None:
    """The fastest Mosaic variant of this tree's kernel (not a --kernel-source) in a row that passed its check, or
    None."""
    good = [m for m in row["mosaic"] if passed(m) and "source" not in m]
    return min(good, key=lambda m: m["us"]) if good else None


def row_summary(row) -> dict:
    """A shape's result as flat numbers beside its records (issue 20 asks for rows with S, T, kernel_us, xla_us,
    floor_us): kernel_us / kernel_wall_us the call of the fastest passing Mosaic variant of this tree's kernel (CUPTI,
    all its kernels / wall clock per op; None when none passed), kernel_variant its schedule and split count,
    xla_us / xla_wall_us XLA's call (None when it failed)."""
    best, xla = best_mosaic(row), row.get("xla", {})
    xla_ok = passed(xla)
    return dict(kernel_us=best["us"] if best else None, kernel_wall_us=best.get("wall_us") if best else None,
                kernel_variant=(f"{best.get('schedule', 'replicated')}, {best['num_splits']} "
                                f"split{'s' if best['num_splits'] != 1 else ''}") if best else None,
                xla_us=xla["us"] if xla_ok else None, xla_wall_us=xla.get("wall_us") if xla_ok else None)


def mosaic_table(meta, rows) -> str:
    lines = [f"# Tree-masked MLA attention: the Mosaic GPU kernel, {meta['device']}, jax {meta['jax']}, {meta['date']}",
             *(["", "**SMOKE RUN (CPU, interpret mode, tiny shapes): these numbers are NOT measurements.**"]
               if meta.get("smoke") else []),
             "", f"H={meta['H']}, c={meta['c']}, r={meta['r']}, B=1, bf16, random trees, start = S, cache rows S_max = "
             f"S + T rounded up to 64; {meta['method']}. "
             "us = CUPTI summed kernel time per op (all kernels of the call), wall = wall clock per op. XLA = "
             "tree_mla_attention_xla (bf16 einsums, float32 softmax); Mosaic = the best "
             "variant (schedule, split count) that passed (rel err < 2e-2 vs the float32 reference). Floor = "
             "max(bytes / 3.4 TB/s, FLOPs / 800 TFLOP/s).", "",
             "| S | T | floor us | target us | XLA us (wall) | Mosaic us (wall) | "
             "schedule, splits | Mosaic / XLA | of floor | rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(d):
        if not d:
            return "-"  # not timed
        if "us" in d:
            return f"{d['us']:.1f} ({d['wall_us']:.1f})"
        if "wall_us" in d:  # a run cut before its device-time pass
            return f"- ({d['wall_us']:.1f})"
        return "error" if "error" in d else "-"

    def schedule(m):  # a --kernel-source variant names its source
        return m.get("schedule", "replicated") + (f" [{m['source']}]" if "source" in m else "")

    def variant(m):
        return f"{schedule(m)}, {m['num_splits']}"

    for row in rows:
        best = best_mosaic(row)
        x = row.get("xla", {}).get("us")
        first_failure = [m.get("error", m.get("rel_err")) for m in row["mosaic"]][:1]
        lines.append(f"| {row['S']} | {row['T']} | {row['floor_us']:.1f} | {row['target_us'] or '-'} | "
                     f"{cell(row.get('xla'))} | {cell(best)} | "
                     f"{variant(best) if best else '-'} | {f'{best['us'] / x:.2f}' if best and x else '-'} | "
                     f"{f'{row['floor_us'] / best['us']:.0%}' if best else '-'} | "
                     f"{f'{best['rel_err']:.1e}' if best else first_failure} |")
    if any("kernel_us" in m or "source" in m for row in rows for m in row["mosaic"]):
        lines += ["", "Every Mosaic variant: us = the call (CUPTI, all its kernels), kernel us = the Mosaic kernel "
                  "alone (the rest: bit-mask build, q pad, split combine).", "",
                  "| S | T | schedule | splits | us | kernel us | wall us | rel err |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            for m in row["mosaic"]:
                if "us" not in m:
                    wall = f"{m['wall_us']:.1f}" if "wall_us" in m else ""
                    what = f"error: {m['error'][:80]}" if "error" in m else "not timed"
                    lines.append(f"| {row['S']} | {row['T']} | {schedule(m)} | {m['num_splits']} | "
                                 f"{what} | | {wall} | |")
                    continue
                kernel = f"{m['kernel_us']:.1f}" if m.get("kernel_us") else "-"  # not recorded before 2026-12-04
                lines.append(f"| {row['S']} | {row['T']} | {schedule(m)} | {m['num_splits']} | "
                             f"{m['us']:.1f} | {kernel} | {m['wall_us']:.1f} | {m['rel_err']:.1e} |")
    return "\n".join(lines)


def summarize_mosaic(paths):
    """Merge device runs (later runs add shapes, or replace a shape measured again) into
    benchmarks/results/tree_attention_mosaic_h200.{json,md,png}; the first run's metadata, every run's under "runs"."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    smoke = [p for p, run in zip(paths, runs, strict=True) if run["meta"].get("smoke")]
    if smoke:
        sys.exit(f"--summarize-mosaic: {smoke} hold smoke runs (CPU, interpret mode): not measurements")
    merged = {}
    for run in runs:
        for row in run["rows"]:
            merged[(row["S"], row["T"])] = dict(row, run_date=run["meta"]["date"], run_commit=run["meta"].get("commit"))
    rows = [merged[k] for k in sorted(merged, key=lambda st: (-st[0], st[1]))]
    for row in rows:
        row.update(row_summary(row))  # the merged records' fastest variant
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
              ("Mosaic GPU kernel", [(best_mosaic(r) or {}).get("us", np.nan) for r in rows])]
    bar_chart(path, [f"S={r['S']}\nT={r['T']}" for r in rows], series, "CUPTI kernel time per call (us)",
              f"Tree MLA attention, H={meta['H']} c={meta['c']} r={meta['r']} bf16, B=1 - {meta['device']}, "
              f"jax {meta['jax']}")


def bar_chart(path, labels, series, ylabel, title):
    """Grouped bars on a log scale: one group per label, one bar per (name, values) of `series`."""
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports] (the bench extra)

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
    maximum position, 2048): the implementations the dispatcher chooses between, impl="xla" (tree_mla_attention_xla)
    and, in bf16 where the shape allows it, impl="mosaic_gpu" (the Mosaic GPU kernel takes bf16 / f16 only, and c + r a
    multiple of 64), each checked against the reference first. Decides which one `choose_attention` may pick for such
    a model (tuned.measured_fastest)."""
    import kdtree_jax as kj
    from kdtree_jax.checkpoint import checkpoint_config
    from pallas_kernels.dispatch import mosaic_attention_unsupported
    from pallas_kernels.tree_attention import tree_mla_attention

    if jax.default_backend() != "gpu":
        sys.exit("no GPU: --shipped only measures on the device")
    cfg, _ = checkpoint_config(Path(kj.__file__).parent / "assets" / "target", expect_kind="target")
    H, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + r)
    timer = Timer(5)
    # the kernel where it can run at this shape (the shipped pair's c + r = 160 is not a multiple of 64: it cannot)
    mosaic_why = mosaic_attention_unsupported(jax.devices()[0], False, c, r, jnp.bfloat16)
    meta = metadata(H=H, c=c, r=r, B=1, method="CUPTI profiler.measure, median of 5, 8 input sets per program",
                    timer=timer.method, mosaic_gpu=f"not timed: {mosaic_why}" if mosaic_why else "timed in bf16")
    rows: list[dict] = []
    stem = os.path.join(args.out, "tree_attention_shipped")
    rng = np.random.default_rng(1234)
    for dtype_name, precision in SHIPPED_VARIANTS:
        dtype = jnp.dtype(dtype_name)
        impls = ("xla", "mosaic_gpu") if dtype in (jnp.bfloat16, jnp.float16) and not mosaic_why else ("xla",)
        for S, T in SHIPPED_SHAPES:
            sets = [make_set(rng, 1, T, H, c, r, S - T, dtype) for _ in range(8)]
            ref0 = jax.jit(lambda *a: tree_mla_attention_reference(*a, scale=scale, value_dim=c))(*sets[0])
            row = dict(dtype=dtype_name, precision=precision or "default", S=S, T=T,
                       floor_us=floor_us(S - T, T, H, c, r, dtype.itemsize)[0])
            for impl in impls:
                try:
                    with jax.default_matmul_precision(precision):
                        rec = timed(timer, program(lambda *a, impl=impl: tree_mla_attention(
                            *a, scale=scale, value_dim=c, impl=impl)), sets, ref0)
                    row[f"{impl}_us"], row[f"{impl}_rel_err"] = rec["us"], rec["rel_err"]
                except Exception as ex:  # noqa: BLE001 - record and go on
                    row[f"{impl}_error"] = repr(ex)[:300]
            rows.append(row)
            write_json(stem, meta, dict(rows=rows))  # a run cut short keeps its rows
            print(row, flush=True)
    write_results(stem, meta, dict(rows=rows), shipped_table(meta, rows))
    print(shipped_table(meta, rows))


def shipped_table(meta, rows) -> str:
    """The markdown of a --shipped run (also from a run cut short: --summarize-shipped JSON): a column per
    implementation the rows name (<impl>_us / <impl>_error), XLA first, each other one with its ratio to XLA."""
    done = {(r["dtype"], r["precision"]) for r in rows}
    missing = [f"{d} {p or 'default'}" for d, p in SHIPPED_VARIANTS if (d, p or "default") not in done]
    impls = list(dict.fromkeys(k.rsplit("_", 1)[0] for row in rows for k in row
                               if k.endswith(("_us", "_error")) and k != "floor_us"))
    others = [i for i in impls if i != "xla"]
    label = {"xla": "XLA", "mosaic_gpu": "Mosaic"}.get
    lines = [f"# Tree-masked MLA attention at the shipped pair's shape, {meta['device']}, jax {meta['jax']}, "
             f"{meta['date']}", "", f"H={meta['H']}, c={meta['c']}, r={meta['r']}, B=1, start = S_max - T; "
             f"{meta['method']}. XLA = impl='xla' (tree_mla_attention_xla: float32 HIGHEST reference, or bf16 "
             "einsums with float32 accumulation)"
             + ("; Mosaic = impl='mosaic_gpu' (the Mosaic GPU kernel at the dispatcher's split count; bf16 / f16 "
                "only, so not run in float32)" if "mosaic_gpu" in others else "")
             + ("; other columns: the impl of that name as the run's commit had it" if set(others) - {"mosaic_gpu"}
                else "")
             + "; precision = the matmul precision the call ran under. Floor = bytes / 3.4 TB/s."
             + (f" Mosaic GPU kernel: {meta['mosaic_gpu']}." if "mosaic_gpu" not in others and "mosaic_gpu" in meta
                else "")
             + (f" Not measured (the run was cut short): {', '.join(missing)}." if missing else ""), "",
             "| dtype | precision | S_max | T | floor us | XLA us |"
             + "".join(f" {label(i, i)} us | {label(i, i)} / XLA | rel err ({label(i, i)}) |" for i in others),
             "| --- " * (6 + 3 * len(others)) + "|"]

    def cell(row, impl):
        return f"{row[f'{impl}_us']:.1f}" if f"{impl}_us" in row else "error" if f"{impl}_error" in row else "-"

    for row in rows:
        x = row.get("xla_us")
        line = (f"| {row['dtype']} | {row['precision']} | {row['S']} | {row['T']} | {row['floor_us']:.2f} | "
                f"{cell(row, 'xla')} | ")
        for impl in others:
            t = row.get(f"{impl}_us")
            err = row.get(f"{impl}_rel_err")
            line += (f"{cell(row, impl)} | {f'{t / x:.2f}' if x and t else '-'} | "
                     f"{f'{err:.1e}' if err is not None else '-'} | ")
        lines.append(line.rstrip())
    return "\n".join(lines)


def summarize_shipped(path):
    run = json.loads(Path(path).read_text())
    stem = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tree_attention_shipped")
    write_results(stem, run["meta"], {"rows": run["rows"]}, shipped_table(run["meta"], run["rows"]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--summarize-mosaic":
        summarize_mosaic(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--summarize-shipped":
        summarize_shipped(sys.argv[2])
    else:
        main()
