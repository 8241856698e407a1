"""Paired end-to-end A/B of two drafters (or of one drafter computing in two dtypes) for one target, in one process.

bench_e2e.py run once per drafter compares two processes, and between two processes on one GPU the same AR row moved
by up to 3% (session 41: AR, which runs no drafter, +2.9%), more than the differences a drafter change makes. Here
every prompt runs drafter A and drafter B alternately (A B, then B A, ...: `--repeats` timed calls of each, after one
warm-up call of each), so drift between the two arms cancels, and a control row times A against itself under the same
interleaving: the spread that row shows is what this protocol calls noise.

For each (temperature, method, budget) point, at batch 1 over the held-out prompts (sampled points once per PRNG seed,
both arms with the same key): a repeat's time is its calls' summed wall clock over the prompts; B / A is A's time over
B's, repeat by repeat (above 1: B faster), reported as the median with its smallest and largest value. Each arm's mean
acceptance and tokens/s, and, greedy, whether its tokens equal AR's (checked for every prompt; a mismatch fails the
run). AR is timed once per temperature as the reference for each arm's speedup.

    python benchmarks/ab_e2e.py --out OUT --tag h100_s41 --b-dtype bfloat16                 # the drafter in bf16
    python benchmarks/ab_e2e.py --out OUT --tag h100_s41 --b CANDIDATE --matmul-precision BF16_BF16_F32_X9

Writes <out>/ab_<tag>.json and .md (the table and the run's record: device, JAX, date, git commit, command).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kdtree_jax as kj  # noqa: E402
from benchmarks.bench_e2e import generate_kwargs, load_prompts, run_key  # noqa: E402
from benchmarks.common import MATMUL_PRECISIONS, metadata, set_matmul_precision, shown_path, write_results  # noqa: E402
from kdtree_jax.ddtree import DRAFTER_DTYPES  # noqa: E402


def _timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _mean_acceptance(outs) -> float:
    acc = np.concatenate([o.round_acceptances() for o in outs])
    return float(acc.mean()) if acc.size else 0.0


def _tokens(out) -> list[int]:
    return np.asarray(out.tokens)[0, :int(np.asarray(out.lengths)[0])].tolist()


def run_point(cfg, params, arms, prompts, method, budget, temperature, new_tokens, repeats, seeds, ar_tokens=None):
    """Time arms (two drafters) on one point, interleaved per prompt. Returns the row (see the module docstring);
    ar_tokens (greedy: AR's tokens per prompt) adds each arm's greedy check."""
    arm_kwargs = [generate_kwargs(method, budget, temperature, new_tokens, d) for d in arms]
    times = np.zeros((len(arms), repeats))
    outs: list[list] = [[] for _ in arms]
    for seed in range(seeds if temperature > 0 else 1):
        for p, prompt in enumerate(prompts):
            calls = [functools.partial(kj.generate, cfg, params, [prompt], key=run_key(p, seed), **kw)
                     for kw in arm_kwargs]
            for a, call in enumerate(calls):  # warm-up (the first prompt's compiles); the tokens are the timed calls'
                outs[a].append(jax.block_until_ready(call()))
            for r in range(repeats):
                for a in (range(len(arms)) if r % 2 == 0 else reversed(range(len(arms)))):
                    times[a, r] += _timed(calls[a])
    tokens = sum(int(np.asarray(o.lengths).sum()) for o in outs[0])
    ratio = times[0] / times[1]
    row = dict(method=method, budget=budget, temperature=temperature, repeats=repeats,
               accept_a=_mean_acceptance(outs[0]), accept_b=_mean_acceptance(outs[1]), new_tokens=tokens,
               seconds_a=float(np.median(times[0])), seconds_b=float(np.median(times[1])),
               b_over_a=float(np.median(ratio)), b_over_a_min=float(ratio.min()), b_over_a_max=float(ratio.max()))
    row["tokens_per_s_a"], row["tokens_per_s_b"] = tokens / row["seconds_a"], tokens / row["seconds_b"]
    if ar_tokens is not None:
        for name, arm in (("a", outs[0]), ("b", outs[1])):
            row[f"greedy_equals_ar_{name}"] = [_tokens(o) for o in arm] == ar_tokens
    return row


def time_ar(cfg, params, prompts, temperature, new_tokens, repeats, seeds):
    """AR's tokens/s on the same prompts (median of `repeats` summed passes) and, greedy, its tokens per prompt."""
    kwargs = generate_kwargs("ar", None, temperature, new_tokens, None)
    calls = [functools.partial(kj.generate, cfg, params, [prompt], key=run_key(p, seed), **kwargs)
             for seed in range(seeds if temperature > 0 else 1) for p, prompt in enumerate(prompts)]
    outs = [jax.block_until_ready(call()) for call in calls]
    seconds = float(np.median([sum(_timed(call) for call in calls) for _ in range(repeats)]))
    tokens = sum(int(np.asarray(o.lengths).sum()) for o in outs)
    return tokens / seconds, ([_tokens(o) for o in outs] if temperature == 0 else None)


def markdown(meta: dict, rows: list[dict], ar: dict) -> str:
    lines = [f"# Paired A/B of two drafters, end to end ({meta['device']})", "",
             f"{meta['date']}, JAX {meta['jax']}; A: {meta['a']} computing in {meta['a_dtype']}, B: {meta['b']} "
             f"computing in {meta['b_dtype']}; target {meta['target']}, float32 matmul precision "
             f"{meta['matmul_precision']}; batch 1, {meta['num_prompts']} held-out prompts x {meta['max_new_tokens']} "
             f"new tokens, each prompt's calls alternating A B / B A over {meta['repeats']} timed repeats after a "
             f"warm-up call of each; sampled points over {meta['seeds']} PRNG seed(s), both arms with the same key. "
             "B / A: A's time over B's per repeat (above 1: B faster), median [smallest, largest]. The control row "
             "times A against itself: its spread is this protocol's noise.", "",
             "| temp | method | budget | accept A | accept B | tokens/s A | tokens/s B | speedup vs AR A / B | "
             "B / A | greedy == AR A / B |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = (" / ".join("yes" if r[f"greedy_equals_ar_{n}"] else "NO" for n in "ab")
                if "greedy_equals_ar_a" in r else "n/a (sampling)")
        base = ar[f"{r['temperature']:g}"]
        label = f"{r['method']} (control: A vs A)" if r.get("control") else r["method"]
        lines.append(f"| {r['temperature']:g} | {label} | {r['budget'] or '-'} | {r['accept_a']:.3f} | "
                     f"{r['accept_b']:.3f} | {r['tokens_per_s_a']:.1f} | {r['tokens_per_s_b']:.1f} | "
                     f"{r['tokens_per_s_a'] / base:.2f}x / {r['tokens_per_s_b'] / base:.2f}x | "
                     f"**{r['b_over_a']:.3f}** [{r['b_over_a_min']:.3f}, {r['b_over_a_max']:.3f}] | {same} |")
    lines += ["", "AR tokens/s (the speedups' reference, the same prompts and repeats): "
              + ", ".join(f"temperature {t}: {v:.1f}" for t, v in ar.items()) + "."]
    if meta["skipped_past_deadline"]:
        lines += ["", f"INCOMPLETE: {len(meta['skipped_past_deadline'])} points not run (past the deadline): "
                  + ", ".join(meta["skipped_past_deadline"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=kj.ASSETS / "target", help="target checkpoint")
    parser.add_argument("--a", type=Path, default=kj.ASSETS / "drafter", help="drafter A (default: the shipped one)")
    parser.add_argument("--b", type=Path, default=None, help="drafter B (default: drafter A's checkpoint)")
    parser.add_argument("--a-dtype", choices=DRAFTER_DTYPES, default=None,
                        help="the dtype drafter A computes in (kj.DFlashDraft compute_dtype; default: the target's)")
    parser.add_argument("--b-dtype", choices=DRAFTER_DTYPES, default=None,
                        help="the dtype drafter B computes in (default: the target's)")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts, each at batch 1")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", choices=("dflash", "ddtree"), default=["dflash", "ddtree"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[7, 15, 31], help="DDTree budgets")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--repeats", type=int, default=6, help="timed calls of each arm per prompt (A B, B A, ...)")
    parser.add_argument("--seeds", type=int, default=1, help="PRNG seeds per prompt at temperature > 0")
    parser.add_argument("--no-control", action="store_true",
                        help="skip the control row (drafter A against itself at the first greedy point)")
    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest",
                        help="jax_default_matmul_precision of the float32 target (benchmarks.common)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no new point after this many seconds; the rows so far are written")
    parser.add_argument("--tag", default=jax.devices()[0].platform, help="results file name: ab_<tag>")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (one A B and one B A)")
    if args.num_prompts < 1 or args.seeds < 1 or args.max_new_tokens < 1:
        parser.error("--num-prompts, --seeds and --max-new-tokens must be at least 1")
    set_matmul_precision(args.matmul_precision)

    cfg, params = kj.load_checkpoint(args.target, expect_kind="target", dtype="float32")
    b_path = args.b or args.a
    arms = []
    for path, dtype in ((args.a, args.a_dtype), (b_path, args.b_dtype)):
        dcfg, dparams = kj.load_checkpoint(path, expect_kind="drafter", dtype="float32")
        arms.append(kj.DFlashDraft(dcfg, dparams, compute_dtype=dtype))
    prompts = load_prompts(args.num_prompts, args.prompt_tokens)
    meta = metadata(target=shown_path(args.target), a=shown_path(args.a), b=shown_path(b_path),
                    a_dtype=args.a_dtype or "float32", b_dtype=args.b_dtype or "float32",
                    num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
                    max_new_tokens=args.max_new_tokens, repeats=args.repeats, seeds=args.seeds,
                    matmul_precision=args.matmul_precision)
    start = time.perf_counter()
    rows, ar, skipped = [], {}, []
    points = [(t, m, b, False) for t in args.temperatures
              for m, b in [("dflash", None)] * ("dflash" in args.methods)
              + [("ddtree", b) for b in args.budgets] * ("ddtree" in args.methods)]
    if not args.no_control and 0.0 in args.temperatures and points:  # A against A at the first greedy point
        points.insert(0, (*next(p for p in points if p[0] == 0.0)[:3], True))
    ar_tokens = {}
    for temperature, method, budget, control in points:
        label = f"T={temperature:g} {method} {budget or ''}".strip() + (" (control)" if control else "")
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            skipped.append(label)
            continue
        if f"{temperature:g}" not in ar:
            ar[f"{temperature:g}"], ar_tokens[temperature] = time_ar(
                cfg, params, prompts, temperature, args.max_new_tokens, args.repeats, args.seeds)
        pair = (arms[0], arms[0]) if control else tuple(arms)
        row = run_point(cfg, params, pair, prompts, method, budget, temperature, args.max_new_tokens, args.repeats,
                        args.seeds, ar_tokens[temperature])
        row["control"] = control
        rows.append(row)
        print(f"{label}: accept {row['accept_a']:.3f} / {row['accept_b']:.3f}, tokens/s {row['tokens_per_s_a']:.1f}"
              f" / {row['tokens_per_s_b']:.1f}, B/A {row['b_over_a']:.3f} [{row['b_over_a_min']:.3f}, "
              f"{row['b_over_a_max']:.3f}]", flush=True)
    meta["skipped_past_deadline"] = skipped
    failures = [r for r in rows if r.get("greedy_equals_ar_a") is False or r.get("greedy_equals_ar_b") is False]
    text = markdown(meta, rows, ar)
    write_results(args.out / f"ab_{args.tag}", meta, {"rows": rows, "ar_tokens_per_s": ar}, text)
    print(text)
    if failures:
        raise SystemExit(f"greedy invariant FAILED at {[(r['method'], r['budget']) for r in failures]}")


if __name__ == "__main__":
    main()
