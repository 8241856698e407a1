"""Where one kernel's time goes, from an Nsight Compute source page (SASS with warp-stall samples).

    ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 --set full -o REPORT python3 one_call.py
    ncu --import REPORT.ncu-rep --page source --csv > SOURCE.csv
    python benchmarks/ncu_source_summary.py SOURCE.csv[.gz] [--top 12]

Prints three Markdown tables: the kernel cut into runs of consecutive instructions with the same execution count (a
run executed once a warp is prologue or epilogue, one executed N times a warp a loop body), each run's share of the
warp-stall samples; the opcodes with the most samples; the stall reasons over all samples. The samples are taken
per warp at a fixed interval, so a share of them is a share of the warps' time (what the warps wait on, where).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import heapq
import io
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: Path) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, one dict per SASS instruction) from `ncu --page source --csv` output (gzip or plain)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    rows = list(csv.reader(io.StringIO(raw.decode())))
    if len(rows) < 3 or rows[0][:1] != ["Kernel Name"] or SAMPLES not in rows[1]:
        raise SystemExit(f"{path}: not an ncu source page with warp-stall samples (ncu --page source --csv)")
    header = rows[1]
    return rows[0][1], [dict(zip(header, r, strict=False)) for r in rows[2:] if len(r) == len(header)]


def _opcode(source: str) -> str:
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def summarize(kernel: str, rows: list[dict[str, str]], top: int = 12) -> str:
    total = sum(_number(r[SAMPLES]) for r in rows) or 1.0
    warps = max(_number(r[EXECUTED]) for r in rows[:1]) or 1.0  # the first instruction runs once a warp
    out = [f"Kernel `{kernel}`: {len(rows)} SASS instructions, {total:.0f} warp-stall samples, "
           f"{warps:.0f} warps.", "", "Runs of instructions with one execution count (per warp = count / warps):", "",
           "| instructions | executed per warp | samples | share | first instruction |",
           "| --- | --- | --- | --- | --- |"]
    runs: list[list] = []
    for i, r in enumerate(rows):
        executed = _number(r[EXECUTED])
        if runs and runs[-1][0] == executed:
            runs[-1][2] = i
            runs[-1][3] += _number(r[SAMPLES])
        else:
            runs.append([executed, i, i, _number(r[SAMPLES]), r["Source"].strip()])
    for executed, first, last, samples, source in runs:
        if samples / total >= 0.003:
            out.append(f"| {first}-{last} | {executed / warps:.3g} | {samples:.0f} | {samples / total:.1%} | "
                       f"`{source[:48]}` |")
    # float sums (a Counter's counts are typed int), the top ones picked as Counter.most_common picks them
    by_op: collections.defaultdict[str, float] = collections.defaultdict(float)
    executed_op: collections.defaultdict[str, float] = collections.defaultdict(float)
    for r in rows:
        by_op[_opcode(r["Source"])] += _number(r[SAMPLES])
        executed_op[_opcode(r["Source"])] += _number(r[EXECUTED])
    out += ["", "| opcode | samples | share | executed (warp instructions) |", "| --- | --- | --- | --- |"]
    out += [f"| {op} | {s:.0f} | {s / total:.1%} | {executed_op[op]:.0f} |"
            for op, s in heapq.nlargest(top, by_op.items(), key=lambda kv: kv[1])]
    reasons = {k: sum(_number(r[k]) for r in rows) for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k}
    all_reasons = sum(reasons.values()) or 1.0
    out += ["", "| stall reason | share of samples |", "| --- | --- |"]
    out += [f"| {k.removeprefix('stall_')} | {v / all_reasons:.1%} |"
            for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:top] if v]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="`ncu --page source --csv` output of one kernel (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=12, help="rows of the opcode and stall-reason tables (default 12)")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"{args.source}: no such file")
    print(summarize(*read_source_page(args.source), top=args.top), end="")


if __name__ == "__main__":
    main()
