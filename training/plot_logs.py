"""Held-out curves of several training runs on one figure, one panel a metric.

    python -m training.plot_logs --run "control=training/figures/drafter8_s25_control_log.jsonl" \
        --run "distill 0.5=training/figures/drafter8_s25_distill_log.jsonl" \
        --keys heldout_greedy_chain_tokens heldout_sampled_chain_tokens heldout_sampled_acc_pos1 \
        --title "TITLE" --out training/figures/drafter_loss_s25_distill.png

Each log is a train_*.py log.jsonl (one JSON record a line with a "step"); a metric a run never logged is an error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from training.common import read_log


def plot_runs(runs: dict[str, Path], keys: list[str], png_path: Path, title: str) -> None:
    """One panel per key, one line per run (the key against the step)."""
    logs = {label: read_log(path) for label, path in runs.items()}
    for label, records in logs.items():
        missing = [k for k in keys if not any(k in r for r in records)]
        if missing:
            raise ValueError(f"run {label!r} ({runs[label]}) never logged {missing}")
    import matplotlib  # noqa: PLC0415  # pyright: ignore[reportMissingImports] (the train / bench extras)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415  # pyright: ignore[reportMissingImports]

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for label, records in logs.items():
            xs, ys = zip(*[(r["step"], r[key]) for r in records if key in r], strict=True)
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 40 else None)
        ax.set_xlabel("step")
        ax.set_title(key, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=LOG",
                    help="a run's legend label and its log.jsonl (repeat for each run)")
    ap.add_argument("--keys", nargs="+", required=True, help="the logged metrics to plot, one panel each")
    ap.add_argument("--title", default="", help="the figure's title")
    ap.add_argument("--out", type=Path, required=True, help="the .png to write")
    args = ap.parse_args(argv)
    runs: dict[str, Path] = {}
    for spec in args.run:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            sys.exit(f"--run {spec!r}: expected LABEL=LOG")
        if not Path(path).is_file():
            sys.exit(f"--run {spec!r}: no file {path}")
        runs[label] = Path(path)
    try:
        plot_runs(runs, args.keys, args.out, args.title)
    except ValueError as e:
        sys.exit(str(e))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
