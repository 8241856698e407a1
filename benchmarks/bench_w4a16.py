"""The dense W4A16 GEMM on a Hopper GPU: correctness vs float64 NumPy, then device-side timings of the Mosaic GPU
kernel the engine runs (`w4a16_matmul` on a MosaicInt4Weight: tuned tiling and split-K, pallas_kernels/w4a16/tuned.py;
and the same without split-K) against the engine's XLA form for the same INT4 weight (dequantize to bf16, one dot:
what runs where the kernel cannot), XLA's bf16 `jnp.dot` on a bf16 weight (4x the bytes: what the weight would cost
unquantized) and the memory / compute floor, in one run.

  python benchmarks/bench_w4a16.py --out DIR [--deadline-s 200]
  python benchmarks/bench_w4a16.py --out DIR --shapes 7168:18432 --ms 8 --sweep bn64:bk256:s4/1 bn64:bk256:s4/7/264
                                    # other tilings, split-K counts and whole slices of the kernel, in the same run
  python benchmarks/bench_w4a16.py --plot DIR/w4a16_results.json     # the figure again (CPU is fine)

Timing: benchmarks/common.py Timer (CUPTI summed kernel time of everything the jitted call launches: for the kernel
the Mosaic kernel, the split-K sum and the output's slice (x padded only above 8 rows, since 2026-12-06); one window
per call, median of --iters after a warm-up). The weights are already in each path's layout (the Mosaic layout is
made once at load time). Every Mosaic output is checked against the float32 reference before it is timed; a wrong or
failing variant is reported as such, never timed. Writes DIR/w4a16_results.{json,md,png} with the run's metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

# (K, N): K2.6's dense MLP (7168 x 18432, 18432 x 7168) and expert-width projections (7168 x 2048, 2048 x 7168),
# then the shipped pair's dense MLP (384 x 1024, 1024 x 384)
SHAPES = [(7168, 18432), (7168, 2048), (2048, 7168), (18432, 7168), (384, 1024), (1024, 384)]
MS = [1, 8, 16, 64, 256]
COPY_TBPS = 3.4e12  # the H200's device copy bandwidth (docs/kernels.md); re-measured in the run
PEAK_FLOPS = 800e12


def floor_us(m, k, n, copy_bps=COPY_TBPS):
    """Microseconds to move the INT4 weight + bf16 scales + bf16 activations once, or to do the FLOPs."""
    weight_bytes = n * k // 2 + n * (k // 32) * 2
    act_bytes = m * k * 2 + m * n * 2
    return max((weight_bytes + act_bytes) / copy_bps, 2 * m * n * k / PEAK_FLOPS) * 1e6


def main():
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="folder for w4a16_results.json / .md / .png")
    ap.add_argument("--iters", type=int, default=7, help="timed calls per point (median reported)")
    ap.add_argument("--deadline-s", type=float, default=200.0, help="start no new shape after this many seconds")
    ap.add_argument("--plot", metavar="JSON", help="only draw the figure from a results JSON, then exit")
    ap.add_argument("--shapes", nargs="+", metavar="K:N", default=[f"{k}:{n}" for k, n in SHAPES],
                    help="weight shapes K:N (default: K2.6's dense and expert-width projections, the shipped pair's)")
    ap.add_argument("--ms", nargs="+", type=int, default=MS, help="token rows M per shape")
    ap.add_argument("--sweep", nargs="*", default=[], metavar="TILING/SPLIT[/WHOLE]",
                    help="more kernel variants to time at every point, each a tiling, a split-K count and optionally "
                         "how many N slices run whole-K (default 0: every slice split), e.g. bn64:bk256:s4/4 or "
                         "bn64:bk256:s4/7/264 (tiling fields as MgpuConfig.parse: bnN block_n, bkN block_k, sN "
                         "pipeline steps; w4a16_matmul_mgpu_kernel's split_k / whole_tiles); a variant the shape "
                         "cannot take is reported as failed, never timed")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)

    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from benchmarks.common import Timer, copy_bandwidth, metadata, write_results
    from pallas_kernels import dispatch
    from pallas_kernels.int4 import Int4Weight
    from pallas_kernels.w4a16 import MgpuConfig, dense_config, w4a16_matmul, w4a16_matmul_reference, w4a16_matmul_xla

    shapes = [tuple(int(v) for v in text.split(":")) for text in args.shapes]
    sweep = {}
    for text in args.sweep:
        tiling, _, rest = text.partition("/")
        split, _, whole = rest.partition("/")
        sweep[f"sweep {text}"] = (MgpuConfig.parse(tiling), int(split or 1), int(whole or 0))

    if not dispatch.is_hopper(jax.devices()[0]):
        raise SystemExit("bench_w4a16 needs a Hopper GPU (the Mosaic kernel): CPU timings prove nothing")
    t0 = time.time()
    timer = Timer(args.iters)
    meta = metadata(timing="CUPTI summed kernel time, median of iterations", timer=timer.method)
    print(meta, flush=True)
    copy_bps = copy_bandwidth(timer)
    meta["copy_TBps_measured"] = copy_bps / 1e12

    def measure(f, *a):
        return timer(f, *a).require_device_s() * 1e6

    rows = []
    key = jax.random.key(0)
    for k, n in tqdm(shapes, desc="shapes"):
        if time.time() - t0 > args.deadline_s:
            print(f"deadline: skipping K={k} N={n}", flush=True)
            continue
        key, kw, kb = jax.random.split(key, 3)
        leaf = Int4Weight.from_dense(jax.random.normal(kw, (k, n), jnp.float32))  # [N, K/4] words, bf16 scales
        mosaic = jax.jit(Int4Weight.to_mosaic)(leaf)
        w_bf16 = jax.random.normal(kb, (k, n), jnp.bfloat16) * 0.02
        config, split, whole = dense_config(k, n)
        for m in args.ms:
            key, kx = jax.random.split(key)
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            want = np.asarray(jax.jit(w4a16_matmul_reference)(x.astype(jnp.float32), leaf), np.float64)
            row = {"k": k, "n": n, "m": m, "tiling": f"bn{config.block_n}:bk{config.block_k}:s"
                   f"{config.max_concurrent_steps}", "split_k": split, "whole_tiles": whole,
                   "floor_us": floor_us(m, k, n, copy_bps)}
            variants = {"kernel_us": jax.jit(lambda x, w: w4a16_matmul(x, w, impl="mosaic_gpu")),
                        "kernel_no_split_us": jax.jit(lambda x, w: w4a16_matmul(x, w, impl="mosaic_gpu", split_k=1))}
            if split == 1 and whole in (0, n // 64):
                variants.pop("kernel_no_split_us")
            for label, (cfg, sk, wt) in sweep.items():
                variants[f"{label}_us"] = jax.jit(lambda x, w, cfg=cfg, sk=sk, wt=wt: w4a16_matmul(
                    x, w, impl="mosaic_gpu", config=cfg, split_k=sk, whole_tiles=wt))
            for name, f in variants.items():
                try:
                    got = np.asarray(f(x, mosaic).astype(jnp.float32), np.float64)
                    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    row[name.replace("_us", "_rel_err")] = err
                    if err > 1e-2:
                        row[name] = None
                        row[name.replace("_us", "_status")] = f"wrong (rel err {err:.2e})"
                        continue
                    row[name] = measure(f, x, mosaic)
                except Exception as e:  # noqa: BLE001 (reported, never timed)
                    row[name] = None
                    row[name.replace("_us", "_status")] = f"failed: {type(e).__name__}: {str(e)[:160]}"
            row["xla_int4_us"] = measure(jax.jit(w4a16_matmul_xla), x, leaf)
            row["xla_bf16_us"] = measure(jax.jit(lambda x, w: x @ w), x, w_bf16)
            rows.append(row)
            print({key_: (round(v, 2) if isinstance(v, float) else v) for key_, v in row.items()}, flush=True)

    def cell(v):
        return f"{v:.1f}" if isinstance(v, float) else "-" if v is None else str(v)

    lines = ["| K x N | M | tiling, split-K, whole slices | floor | **Mosaic kernel** | kernel, no split | XLA INT4 "
             "(bf16 dequant + dot) | XLA bf16 dot | kernel / floor | kernel vs XLA INT4 |", "|" + " --- |" * 10]
    for r in rows:
        kern = r.get("kernel_us")
        lines.append(
            f"| {r['k']} x {r['n']} | {r['m']} | {r['tiling']}, {r['split_k']}, {r.get('whole_tiles', 0)} | "
            f"{cell(r['floor_us'])} | "
            f"**{cell(kern)}** | {cell(r.get('kernel_no_split_us'))} | {cell(r['xla_int4_us'])} | "
            f"{cell(r['xla_bf16_us'])} | {cell(kern / r['floor_us']) if kern else '-'} | "
            f"{cell(r['xla_int4_us'] / kern) + 'x faster' if kern else r.get('kernel_status', '-')} |")
    if sweep:
        lines += ["", "The kernel's other tilings / split-K counts (`--sweep`), microseconds and x the floor:", "",
                  "| K x N | M | " + " | ".join(sweep) + " |", "|" + " --- |" * (2 + len(sweep))]
        for r in rows:
            lines.append(f"| {r['k']} x {r['n']} | {r['m']} | " + " | ".join(
                f"{r[f'{lb}_us']:.1f} ({r[f'{lb}_us'] / r['floor_us']:.2f}x)" if r.get(f"{lb}_us")
                else r.get(f"{lb}_status", "-") for lb in sweep) + " |")
    md = "Microseconds (CUPTI summed kernel time, median of the calls); floor at the copy bandwidth measured here.\n\n"
    written = write_results(os.path.join(args.out, "w4a16_results"), meta, {"rows": rows}, md + "\n".join(lines),
                            plot=lambda path: draw({"rows": rows, "meta": meta}, path))
    print("\n".join(lines), "\nwrote", *written, flush=True)


def plot(path):
    """<folder of path>/w4a16_results.png from a results JSON."""
    from benchmarks.common import write_png

    with open(path) as fh:
        data = json.load(fh)
    write_png(os.path.join(os.path.dirname(path), "w4a16_results"), lambda out: draw(data, out))


def draw(data, out):
    """Microseconds against M for each shape: the kernel, XLA's INT4 and bf16 dots, the floor."""
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports] (the bench extra)

    rows, meta = data["rows"], data["meta"]
    shapes = list(dict.fromkeys((r["k"], r["n"]) for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.4 * len(shapes), 3.6), squeeze=False)
    for ax, (k, n) in zip(axes[0], shapes, strict=True):
        rs = sorted([r for r in rows if r["k"] == k and r["n"] == n], key=lambda r: r["m"])
        ms = [r["m"] for r in rs]
        series = [("kernel_us", "o-", "Mosaic kernel"), ("xla_int4_us", "s--", "XLA INT4 (dequant + dot)"),
                  ("xla_bf16_us", "^:", "XLA bf16 dot (bf16 weight)"), ("floor_us", "k-", "INT4 floor")]
        for name, style, label in series:
            ax.plot(ms, [r.get(name) or np.nan for r in rs], style, label=label, lw=1 if name == "floor_us" else 1.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"K={k}, N={n}", fontsize=9)
        ax.set_xlabel("M (rows)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("microseconds (CUPTI)")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"dense W4A16 on {meta['device']}, JAX {meta['jax']}, {meta['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
