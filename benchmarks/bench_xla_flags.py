"""The decode loop's wall clock under XLA flag settings: what kdtree_jax.xla_flags sets, measured.

  python benchmarks/bench_xla_flags.py --out DIR [--settings none recommended ...] [--budgets 8 32]

Each setting runs in a fresh process (XLA reads its flags once, when the backend starts) with exactly the
named XLA_FLAGS and KDTREE_JAX_XLA_FLAGS=0, so the engine adds nothing; `--repeat N` runs the list of settings N
times in turn (A B A B: a drift of the machine over the run then shows as a spread, not as a setting's effect),
and a row reports the median over its repeats with the spread. The process times the round as it runs
inside the one-jit loop for AR, DFlash and DDTree at each budget (benchmarks/profile_round.py
`profile_in_loop`: batch-1 generate calls over held-out prompts, wall per round, the greedy tokens checked
against AR's), wall clock only (no CUPTI window: it would inflate later wall clocks). Writes
DIR/xla_flags_<tag>.json/.md/.png with the run's metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdtree_jax import ASSETS, xla_flags  # noqa: E402

# Named settings: the XLA_FLAGS each child process gets.
WHILE = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"  # loops and conditionals inside CUDA graphs too
# The GEMMs on cuBLAS (cuBLASLt) instead of XLA's Triton GEMM fusions: a float32 verify's GEMMs at "highest"
# precision grow with T (round_profile_2026-12-03_s14.md: T = 8 / 32 415 / 591 us of kernels) far faster than
# their FLOPs, which is what this setting asks about.
CUBLAS = "--xla_gpu_enable_triton_gemm=false"
CUBLASLT = "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true"
SETTINGS = {
    "none": "",
    "recommended": " ".join(xla_flags.RECOMMENDED),
    "while": WHILE,
    "recommended+while": " ".join((*xla_flags.RECOMMENDED, WHILE)),
    "recommended+cublas": " ".join((*xla_flags.RECOMMENDED, CUBLAS)),
    "recommended+cublaslt": " ".join((*xla_flags.RECOMMENDED, CUBLASLT)),
}
CHILD_MARK = "XLA_FLAGS_ROWS "


def child(args) -> None:
    """One setting: the in-loop rows under this process's XLA_FLAGS, printed as one JSON line."""
    import jax

    import kdtree_jax as kj
    from benchmarks.profile_round import profile_in_loop
    from training.prompts import load_prompts

    jax.config.update("jax_default_matmul_precision", "highest")
    cfg, params = kj.load_checkpoint(args.target, expect_kind="target", dtype=args.dtype)
    dcfg, dparams = kj.load_checkpoint(args.drafter, expect_kind="drafter", dtype=args.dtype)
    prompts = load_prompts(args.prompts, 64)
    rows = profile_in_loop(cfg, params, (dcfg, dparams), prompts, args.budgets, max_new_tokens=args.tokens,
                           iters=args.iters)
    print(CHILD_MARK + json.dumps(rows), flush=True)


def combine(runs: list[dict]) -> list[dict]:
    """One row per (setting, stage): the median wall per round over the setting's repeats, its min and max, its
    AR steps against the setting's median AR step, and the greedy check over every repeat."""
    rows = []
    for key in dict.fromkeys((r["setting"], r["stage"]) for r in runs):
        walls = [r["wall_us"] for r in runs if (r["setting"], r["stage"]) == key]
        first = next(r for r in runs if (r["setting"], r["stage"]) == key)
        rows.append({**first, "wall_us": statistics.median(walls), "wall_us_min": min(walls),
                     "wall_us_max": max(walls), "repeats": len(walls),
                     "greedy_equals_ar": all(r["greedy_equals_ar"] for r in runs
                                             if (r["setting"], r["stage"]) == key)})
    for row in rows:
        ar = next(r for r in rows if r["setting"] == row["setting"] and r["method"] == "ar")
        row["ar_steps"] = row["wall_us"] / ar["wall_us"]
    return rows


def markdown(meta: dict, rows: list[dict], settings: list[str]) -> str:
    lines = [f"# The decode loop under XLA flags ({meta['device']})", "",
             f"{meta['date']}, JAX {meta['jax']}; the shipped pair ({meta['dtype']}, matmul precision highest), batch "
             f"1, {meta['prompts']} held-out prompts x {meta['tokens']} new tokens, one generate call per prompt "
             f"(median of {meta['iters']} after a warm-up); wall clock per round = summed wall / summed rounds (an AR "
             "step is a round); each setting in a fresh process with exactly its XLA_FLAGS, the list of settings run "
             f"{meta.get('repeat', 1)} time(s) in turn; a cell: the median over the repeats (min-max), AR steps "
             "against the same setting's AR step.", "",
             "Settings: " + "; ".join(f"`{s}` = `{SETTINGS[s] or '(none)'}`" for s in settings), "",
             "| round | " + " | ".join(f"{s}: us (min-max; AR steps)" for s in settings) + " | greedy == AR |",
             "|---|" + "---|" * (len(settings) + 1)]
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    for stage in stages:
        by = {r["setting"]: r for r in rows if r["stage"] == stage}
        cells = [f"{by[s]['wall_us']:.0f} ({by[s]['wall_us_min']:.0f}-{by[s]['wall_us_max']:.0f}; "
                 f"{by[s]['ar_steps']:.2f})" if s in by else "-" for s in settings]
        same = all(r["greedy_equals_ar"] for r in by.values())
        name = stage.removeprefix("in the loop: ")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    base = {r["stage"]: r["wall_us"] for r in rows if r["setting"] == settings[0]}
    if len(settings) > 1 and base:
        lines += ["", f"Speed-up of each round over `{settings[0]}`: " + "; ".join(
            f"{s}: " + ", ".join(f"{r['stage'].removeprefix('in the loop: ')} {base[r['stage']] / r['wall_us']:.2f}x"
                                 for r in rows if r["setting"] == s and r["stage"] in base)
            for s in settings[1:])]
    return "\n".join(lines)


def plot(path: Path, meta: dict, rows: list[dict], settings: list[str]) -> None:
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports] (the bench extra)
    import numpy as np

    stages = list(dict.fromkeys(r["stage"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(stages))
    width = 0.8 / len(settings)
    for k, s in enumerate(settings):
        by = {r["stage"]: r["wall_us"] for r in rows if r["setting"] == s}
        ax.bar(x + (k - (len(settings) - 1) / 2) * width, [by.get(st, np.nan) for st in stages], width, label=s)
    ax.set_xticks(x, [st.removeprefix("in the loop: ") for st in stages], fontsize=8)
    ax.set_ylabel("wall clock per round (us)")
    ax.set_title(f"Decode loop rounds under XLA flags - shipped pair, batch 1 - {meta['device']}, jax {meta['jax']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--target", type=Path, default=ASSETS / "target", help="target checkpoint")
    ap.add_argument("--drafter", type=Path, default=ASSETS / "drafter", help="drafter checkpoint")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights cast to this dtype")
    ap.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=["none", "recommended"],
                    help="flag settings to compare (the first is the baseline of the speed-ups)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[7, 31], help="DDTree budgets")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts, one batch-1 call each")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per call")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per prompt (median)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the whole list of settings, in turn")
    ap.add_argument("--timeout-s", type=float, default=300, help="limit per setting's process (compiling included: "
                    "about a minute on the H200 for the default methods)")
    ap.add_argument("--tag", default="h200", help="results file name: xla_flags_<tag>")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    from benchmarks.common import metadata, shown_path, write_results

    runs, failed = [], {}
    for setting in [s for _ in range(args.repeat) for s in args.settings]:
        if setting in failed:
            continue
        env = {**os.environ, "XLA_FLAGS": SETTINGS[setting], xla_flags.OPT_OUT: "0"}
        cmd = [sys.executable, __file__, "--child", "--target", str(args.target), "--drafter", str(args.drafter),
               "--dtype", args.dtype, "--prompts", str(args.prompts), "--tokens", str(args.tokens),
               "--iters", str(args.iters), "--budgets", *map(str, args.budgets)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            failed[setting] = f"past --timeout-s {args.timeout_s:g}"
            print(f"{setting}: {failed[setting]}", flush=True)
            continue
        found = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_MARK)]
        if proc.returncode != 0 or not found:
            failed[setting] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            print(f"{setting}: FAILED: {failed[setting]}", flush=True)
            continue
        for row in json.loads(found[-1].removeprefix(CHILD_MARK)):
            runs.append({**row, "setting": setting, "xla_flags": SETTINGS[setting]})
            print({k: runs[-1][k] for k in ("setting", "stage", "wall_us", "ar_steps", "greedy_equals_ar")}, flush=True)
    settings = [s for s in args.settings if s not in failed]
    rows = combine(runs)
    meta = metadata(target=shown_path(args.target), drafter=shown_path(args.drafter), dtype=args.dtype,
                    prompts=args.prompts, tokens=args.tokens, iters=args.iters, repeat=args.repeat,
                    budgets=args.budgets, settings=dict(SETTINGS), failed=failed, wall_after_cupti=False)
    text = markdown(meta, rows, settings) + "".join(f"\n\nNot measured: `{s}` ({why})." for s, why in failed.items())
    write_results(args.out / f"xla_flags_{args.tag}", meta, {"rows": rows, "runs": runs}, text,
                  plot=lambda path: plot(path, meta, rows, settings))
    print(text)


if __name__ == "__main__":
    main()
