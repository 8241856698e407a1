"""End-to-end benchmark of the shipped pair (or any target + drafter): AR vs DFlash vs DDTree on
held-out Python prompts.

For batch 1 and 8, greedy and temperature 1, and DDTree budgets 4..256: mean acceptance length
(tokens committed per round, the bonus included), target forwards per generated token, tokens/s and
speedup over AR at the same batch and temperature. Timing: one `kj.generate` call (one device
dispatch) per measurement, after a compile/warm-up call, median of `--repeats`; batch 1 runs every
prompt and sums. Greedy outputs of every method are checked token for token against AR (the invariant).

    python benchmarks/bench_e2e.py --out benchmarks/results --tag cpu            # ~15 min on 2 CPU cores
    python benchmarks/bench_e2e.py --out benchmarks/results --tag h200 --num-prompts 16 --max-new-tokens 128

Writes <out>/e2e_<tag>.json, .md (table + the run's metadata: device, JAX, date, git commit, command) and
.png (acceptance length and speedup against the budget), through benchmarks/common.py.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kdtree_jax as kj  # noqa: E402
from benchmarks.common import (  # noqa: E402
    MATMUL_PRECISIONS,
    Timer,
    metadata,
    set_matmul_precision,
    shown_path,
    write_results,
)
from kdtree_jax.budget import default_costs, rounds_per_budget  # noqa: E402
from kdtree_jax.ddtree import DRAFTER_DTYPES  # noqa: E402

DEFAULT_BUDGETS = (4, 8, 16, 32, 64, 128, 256)


def load_prompts(count: int, prompt_tokens: int) -> list[list[int]]:
    """The shipped held-out prompts (kdtree_jax/assets/heldout_prompts.json: the same on every machine)."""
    from training.prompts import load_prompts as shipped_prompts  # noqa: PLC0415

    return shipped_prompts(count, prompt_tokens)


def run_key(group_index: int, seed: int) -> jax.Array:
    """The PRNG key of one prompt group's calls at one sampling seed (every method, budget and arm draws the same)."""
    return jax.random.key(1000 + group_index + 100_000 * seed)


def generate_kwargs(method, budget, temperature, new_tokens, drafter, costs=None, kernels=None) -> dict:
    kwargs = dict(max_new_tokens=new_tokens, method=method, temperature=temperature, stop_tokens=(), kernels=kernels)
    if method != "ar":
        kwargs["drafter"] = drafter
    if method == "ddtree":
        kwargs["tree_budget"] = budget
    if budget == "auto":
        kwargs["budget_costs"] = costs
    return kwargs


def run_config(cfg, params, drafter, prompts, batch, method, budget, temperature, new_tokens, repeats, costs=None,
               seeds=1, kernels=None):
    """Time one (method, budget, batch, temperature) over all prompts, sampled ones once per seed (every sum of the
    row runs over the seeds). Returns (row dict, outputs per prompt: the first seed's)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    kwargs = generate_kwargs(method, budget, temperature, new_tokens, drafter, costs, kernels)
    seconds, tokens, forwards, rounds, accept, outputs = 0.0, 0, 0, 0, [], []
    chosen = collections.Counter()
    timer = Timer(repeats, device=False)  # wall clock around one dispatch (compile + warm-up call first)
    runs = [(g, group, seed) for seed in range(seeds if temperature > 0 else 1) for g, group in enumerate(groups)]
    for g, group, seed in runs:
        key = run_key(g, seed)
        timing = timer(lambda group=group, key=key: kj.generate(cfg, params, group, key=key, **kwargs))
        out = timing.out
        seconds += timing.wall_s
        lengths = np.asarray(out.lengths)
        tokens += int(lengths.sum())
        forwards += int(out.num_target_forwards) * len(group)  # a forward serves the whole batch
        rounds += int(out.rounds)
        accept.extend(out.round_acceptances().tolist())
        toks = np.asarray(out.tokens)
        if seed == 0:
            outputs.extend(toks[b, :lengths[b]].tolist() for b in range(len(group)))
        if budget == "auto":  # which budget each round verified
            chosen.update(rounds_per_budget(out))
    row = dict(method=method, budget=budget, batch=batch, temperature=temperature,
               mean_acceptance=float(np.mean(accept)) if accept else 0.0,
               forwards_per_token=forwards / tokens, tokens_per_s=tokens / seconds, seconds=seconds,
               new_tokens=tokens, rounds=rounds)
    if chosen:
        row["auto_budgets"] = {str(b): n for b, n in sorted(chosen.items())}  # budget -> rounds
    return row, outputs


def costs_from_rows(rows: list[dict], batch: int, temperature: float) -> kj.BudgetCosts:
    """tree_budget="auto"'s round costs measured in this run: wall per round of each fixed budget's row at `batch`
    and `temperature` over wall per step of AR's at the same temperature (what kj.calibrate_budget_costs
    measures, without compiling again)."""
    sel = {(r["method"], r["budget"]): r for r in rows if r["batch"] == batch and r["temperature"] == temperature}
    ar = sel.get(("ar", None))
    budgets = sorted(b for (m, b) in sel if m == "ddtree" and isinstance(b, int))
    if ar is None or not budgets:
        raise ValueError(f"auto at batch {batch}, temperature {temperature:g} needs the AR and fixed-budget rows "
                         "of this run at that batch and temperature")
    step = ar["seconds"] / ar["rounds"]
    costs = tuple(sel[("ddtree", b)]["seconds"] / sel[("ddtree", b)]["rounds"] / step for b in budgets)
    return kj.BudgetCosts(tuple(budgets), costs,
                          source=f"measured in this run (e2e), batch {batch}, temperature {temperature:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=kj.ASSETS / "target")
    parser.add_argument("--drafter", type=Path, default=kj.ASSETS / "drafter")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights cast to this dtype after loading (default %(default)s)")
    parser.add_argument("--drafter-dtype", choices=DRAFTER_DTYPES, default=None,
                        help="the dtype the drafter computes in (kj.DFlashDraft compute_dtype; default: --dtype). "
                             "The target alone decides what a greedy verify commits, so a float32 target keeps "
                             "the greedy invariant with a bfloat16 drafter")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts (a multiple of 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="*", default=list(DEFAULT_BUDGETS),
                        help="fixed DDTree budgets (none: no fixed-budget DDTree rows)")
    parser.add_argument("--methods", nargs="+", choices=("ar", "dflash", "ddtree"), default=["ar", "dflash", "ddtree"],
                        help="which methods get rows (ddtree: the fixed --budgets; --auto adds its rows anyway)")
    parser.add_argument("--auto", action="store_true", help="also run tree_budget='auto' (the budget chosen "
                        "per round; its rows record how many rounds used each budget), with the round costs of "
                        "--auto-costs")
    parser.add_argument("--auto-costs", choices=("run", "default"), default="run",
                        help="run: measured in this run (each fixed budget's wall per round over AR's wall per "
                             "step, at the auto row's batch and temperature; needs those rows); default: "
                             "kdtree_jax.budget.default_costs for this device, batch and temperature, what "
                             "kj.generate uses when no budget_costs are given")
    parser.add_argument("--auto-skip-draft", choices=("default", "on", "off"), default="default",
                        help="whether auto's rounds may skip the draft (an AR step) while drafting cannot pay "
                             "(BudgetCosts.ar_cost = 1 AR step, or None); default: as kj.generate's default costs "
                             "do on this platform (kdtree_jax.budget.SKIP_DRAFT_AR_COST)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per generate call (median)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="sampled points (temperature > 0) run every prompt group once per PRNG seed and sum: "
                             "at batch 8 the slowest of the sampled rows sets a call's rounds, a noisy maximum")
    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest",
                        help="jax_default_matmul_precision for the float32 models (default highest: on the H200 "
                             "'default' means TF32, whose rounding differs between AR and tree shapes and can "
                             "flip near-tie argmaxes, i.e. break the greedy invariant; the dot algorithms "
                             "(BF16_BF16_F32_X6 ...) keep about float32 accuracy on tensor cores; whether the "
                             "invariant holds there is what each row's check says)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no new (method, budget) point after this many seconds; the results so far "
                             "are written and marked incomplete")
    parser.add_argument("--moe", choices=("auto", "triton", "mosaic_gpu", "xla"), default="auto",
                        help="the routed experts' implementation (kj.Kernels(moe=...)); auto: what the dispatcher "
                             "picks here")
    parser.add_argument("--tag", default=jax.devices()[0].platform)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="no measuring: join the rows of earlier runs (same device and settings, e.g. one run "
                             "per batch size) into <out>/e2e_<tag>.json/.md/.png")
    args = parser.parse_args()
    if args.merge:
        return merge(args.merge, args.out / f"e2e_{args.tag}")
    if any(args.num_prompts % b for b in args.batches):
        raise SystemExit(f"--num-prompts {args.num_prompts} must be a multiple of every batch {args.batches}")
    if args.auto and args.auto_costs == "run" and not (args.budgets and {"ar", "ddtree"} <= set(args.methods)):
        raise SystemExit("--auto-costs run measures the round costs on this run's AR and fixed-budget rows: "
                         "--methods needs ar and ddtree and --budgets at least one budget (or pass "
                         "--auto-costs default)")
    set_matmul_precision(args.matmul_precision)

    kernels = kj.Kernels(moe=args.moe)
    cfg, params = kj.load_checkpoint(args.target, expect_kind="target", dtype=args.dtype)
    dcfg, dparams = kj.load_checkpoint(args.drafter, expect_kind="drafter", dtype=args.dtype)
    drafter = kj.DFlashDraft(dcfg, dparams, compute_dtype=args.drafter_dtype)
    prompts = load_prompts(args.num_prompts, args.prompt_tokens)
    meta = metadata(host=f"{platform.machine()}, {os.cpu_count()} CPU cores", target=shown_path(args.target),
                    drafter=shown_path(args.drafter), num_prompts=args.num_prompts, dtype=args.dtype,
                    prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                    seeds=args.seeds, auto_skip_draft=args.auto_skip_draft,
                    block_size=dcfg.block_size, matmul_precision=args.matmul_precision,
                    drafter_dtype=args.drafter_dtype or args.dtype,
                    kernels=kj.plan_summary(kj.kernel_plan(params, cfg, kernels=kernels)))  # what generate runs
    fixed = [(batch, temperature, method, budget, None) for batch in args.batches for temperature in args.temperatures
             for method, budget in [("ar", None), ("dflash", None)] + [("ddtree", b) for b in args.budgets]
             if method in args.methods]
    start, skipped, rows, outputs = time.perf_counter(), [], [], {}
    print(f"{'batch':>5} {'temp':>4} {'method':>7} {'budget':>6} {'accept':>7} {'fwd/tok':>8} {'tok/s':>9}", flush=True)

    def measure(points):
        for batch, temperature, method, budget, costs in points:
            if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
                skipped.append(dict(batch=batch, temperature=temperature, method=method, budget=budget))
                continue
            row, outs = run_config(cfg, params, drafter, prompts, batch, method, budget, temperature,
                                   args.max_new_tokens, args.repeats, costs, args.seeds, kernels)
            if costs is not None:
                row["budget_costs"] = dict(zip(map(str, costs.budgets), costs.costs, strict=True))
            rows.append(row)
            outputs[(batch, temperature, method, budget)] = outs
            print(f"{batch:>5} {temperature:>4g} {method:>7} {budget or '-':>6} {row['mean_acceptance']:>7.2f} "
                  f"{row['forwards_per_token']:>8.3f} {row['tokens_per_s']:>9.1f}", flush=True)

    measure(fixed)
    if args.auto:
        autos = []
        for batch in args.batches:
            for t in args.temperatures:
                try:
                    defaults = default_costs(batch, temperature=t)
                    costs = costs_from_rows(rows, batch, t) if args.auto_costs == "run" else defaults
                    skip = {"on": 1.0, "off": None}.get(args.auto_skip_draft, defaults.ar_cost)
                    costs = dataclasses.replace(costs, ar_cost=skip)
                except ValueError as e:  # a point it needs was past the deadline
                    print(f"no auto at batch {batch}, temperature {t:g}: {e}", flush=True)
                    skipped.append(dict(batch=batch, temperature=t, method="ddtree", budget="auto"))
                    continue
                autos.append((batch, t, "ddtree", "auto", costs))
        if autos:
            measure(autos)
    invariant_failures = finish_rows(rows, outputs)
    stem = args.out / f"e2e_{args.tag}"
    meta["skipped_past_deadline"] = skipped
    if skipped:
        print(f"INCOMPLETE: {len(skipped)} points not run (past --deadline-s {args.deadline_s:g})", flush=True)
    write_results(stem, meta, {"rows": rows, "invariant_failures": invariant_failures}, markdown(meta, rows),
                  plot=lambda path: plot(path, meta, rows, args.budgets))
    print(markdown(meta, rows))
    print("greedy invariant " +
          ("held everywhere" if not invariant_failures else f"FAILED for {invariant_failures}"))
    if invariant_failures:
        raise SystemExit(1)


def row_order(r: dict) -> tuple:
    """Table order: batch, temperature, AR, DFlash, the fixed budgets, auto."""
    return (r["batch"], r["temperature"], {"ar": 0, "dflash": 1, "ddtree": 2}[r["method"]],
            float("inf") if r["budget"] == "auto" else (r["budget"] or 0))


def finish_rows(rows: list[dict], outputs: dict) -> list:
    """Order the rows (batch, temperature, AR, DFlash, budgets, auto), add each row's speedup over AR at its batch
    and temperature and, greedy, whether its tokens equal AR's. Returns the points whose greedy tokens differ."""
    rows.sort(key=row_order)
    ar = {(r["batch"], r["temperature"]): r for r in rows if r["method"] == "ar"}
    failures = []
    for r in rows:
        base = ar.get((r["batch"], r["temperature"]))
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        if r["temperature"] == 0.0 and base is not None:
            point = (r["batch"], 0.0, r["method"], r["budget"])
            r["greedy_equals_ar"] = outputs[point] == outputs[(r["batch"], 0.0, "ar", None)]
            if not r["greedy_equals_ar"]:
                failures.append((r["batch"], r["method"], r["budget"]))
    return failures


def merge(paths: list[Path], stem: Path) -> None:
    """Rows of several runs in one table and plot; the first run's meta, with every run's date listed and the
    merge's own record under "merged_by"."""
    runs = [json.loads(p.read_text()) for p in paths]
    keys = ("device", "jax", "num_prompts", "prompt_tokens", "max_new_tokens", "block_size", "matmul_precision")
    for p, run in zip(paths[1:], runs[1:], strict=True):
        differ = [k for k in keys if run["meta"].get(k) != runs[0]["meta"].get(k)]
        if differ:
            raise SystemExit(f"{p} differs from {paths[0]} in {differ}: not one experiment")
    seen, rows = set(), []
    for i, run in enumerate(runs, 1):  # a point measured by several runs: the first run's row
        for r in run["rows"]:
            point = (r["batch"], r["temperature"], r["method"], r["budget"])
            if point not in seen:
                seen.add(point)
                rows.append(dict(r, run=i))
    rows.sort(key=row_order)
    meta = dict(runs[0]["meta"], merged_from=[str(p) for p in paths], dates=[r["meta"]["date"] for r in runs],
                merged_by=metadata())
    done = {(r["batch"], r["temperature"], r["method"], r["budget"]) for r in rows}
    skipped = {(q["batch"], q["temperature"], q["method"], q["budget"]): q for run in runs
               for q in run["meta"].get("skipped_past_deadline", [])}
    meta["skipped_past_deadline"] = [q for point, q in skipped.items() if point not in done]
    failures = [f for run in runs for f in run["invariant_failures"]]
    budgets = sorted({r["budget"] for r in rows if isinstance(r["budget"], int)})
    write_results(stem, meta, {"rows": rows, "invariant_failures": failures}, markdown(meta, rows),
                  plot=lambda path: plot(path, meta, rows, budgets))
    print(f"merged {len(paths)} runs, {len(rows)} points")


def markdown(meta: dict, rows: list[dict]) -> str:
    merged = bool(meta.get("dates")) and all("run" in r for r in rows)
    seeds = meta.get("seeds", 1)
    seeds_note = f"; sampled points summed over {seeds} PRNG seeds per prompt group" if seeds > 1 else ""
    lines = [f"# End-to-end decode: AR vs DFlash vs DDTree ({meta['device']})", "",
             f"{meta['date']}, JAX {meta['jax']}, host {meta['host']}; {meta['num_prompts']} held-out prompts of "
             f"{meta['prompt_tokens']} tokens, {meta['max_new_tokens']} new tokens each, block size "
             f"{meta['block_size']}, median of {meta['repeats']} timed call(s) after a warm-up, one dispatch per "
             f"generate call{seeds_note}; float32 matmul precision {meta['matmul_precision']}; kernels: "
             f"{meta.get('kernels') or 'attention ' + meta.get('attention', '?')}."
             + (f" The drafter computes in {meta['drafter_dtype']}." if meta.get("drafter_dtype") not in
                (None, meta.get("dtype")) else "")
             + (f" Joined from {len(meta['dates'])} runs ({', '.join(meta['dates'])})."
                                        if meta.get("dates") else ""), "",
             "| batch | temp | method | budget | mean accept | target fwd / token | tokens/s | speedup vs AR | "
             "greedy == AR |" + (" run |" if merged else ""), "|---|---|---|---|---|---|---|---|---|"
             + ("---|" if merged else "")]
    same_label: dict[bool | None, str] = {True: "yes", False: "NO"}  # None: a sampled point (no greedy check)
    for r in rows:
        same = same_label.get(r.get("greedy_equals_ar"), "n/a (sampling)")
        lines.append(f"| {r['batch']} | {r['temperature']:g} | {r['method']} | {r['budget'] or '-'} | "
                     f"{r['mean_acceptance']:.2f} | {r['forwards_per_token']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {same} |" + (f" {r['run']} |" if merged else ""))
    if merged:
        lines += ["", "A row's speedup and greedy check are against the AR row of its own run (column run: "
                  + "; ".join(f"{i} = {d}" for i, d in enumerate(meta["dates"], 1)) + ")."]
    autos = [r for r in rows if r.get("auto_budgets")]
    if autos:
        picks = [f"batch {r['batch']} T={r['temperature']:g}: "
                 + ", ".join(f"{'AR' if str(b) == '0' else b} x{n}" for b, n in r["auto_budgets"].items())
                 for r in autos]
        lines += ["", "Budgets `auto` verified (budget x rounds; AR: rounds that drafted nothing): " + "; ".join(picks)]
    if meta["skipped_past_deadline"]:
        lines += ["", f"INCOMPLETE: {len(meta['skipped_past_deadline'])} points not run (past the deadline): "
                  + ", ".join(f"batch {p['batch']} T={p['temperature']:g} {p['method']} {p['budget'] or ''}".strip()
                              for p in meta["skipped_past_deadline"])]
    return "\n".join(lines) + "\n"


def plot(path: Path, meta: dict, rows: list[dict], budgets) -> None:
    """Acceptance length and speedup against the budget (called by benchmarks.common.write_png)."""
    import matplotlib.pyplot as plt  # noqa: PLC0415  # pyright: ignore[reportMissingImports] (the bench extra)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    settings = sorted({(r["batch"], r["temperature"]) for r in rows})
    for i, (batch, temp) in enumerate(settings):
        sel = [r for r in rows if r["batch"] == batch and r["temperature"] == temp]
        tree = sorted((r for r in sel if r["method"] == "ddtree" and r["budget"] != "auto"), key=lambda r: r["budget"])
        dflash = next((r for r in sel if r["method"] == "dflash"), None)
        auto = next((r for r in sel if r["budget"] == "auto"), None)
        color = f"C{i}"
        label = f"batch {batch}, T={temp:g}"
        for ax, key in ((axes[0], "mean_acceptance"), (axes[1], "speedup")):
            ax.plot([r["budget"] for r in tree], [r[key] for r in tree], "o-", color=color, label=f"DDTree, {label}")
            if dflash is not None:
                ax.axhline(dflash[key], color=color, ls="--", lw=1, label=f"DFlash, {label}")
            if auto is not None:
                ax.axhline(auto[key], color=color, ls=":", lw=1.5, label=f"DDTree auto, {label}")
    axes[0].set_ylabel("mean acceptance length (tokens / round)")
    axes[1].set_ylabel("speedup over AR (tokens/s)")
    axes[1].axhline(1.0, color="k", lw=0.8)
    plotted = any(r["method"] == "ddtree" and r["budget"] != "auto" for r in rows)
    for ax in axes:
        # a budget axis only where a fixed-budget row was plotted: a run without fixed budgets (only auto rows), or one
        # whose --deadline-s stopped it before its first DDTree point, has none (a log axis with no data is an error)
        if budgets and plotted:
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(budgets), [str(b) for b in budgets])
        ax.set_xlabel("DDTree budget (draft nodes per round)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{meta['device']}, JAX {meta['jax']}, {meta['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
