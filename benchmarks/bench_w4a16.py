"""W4A16 GEMM on the GPU: correctness vs references, then device-side timings of the Pallas kernel
against XLA bf16 `jnp.dot`, XLA dequantize-then-dot and the memory/compute floor, in one run.

  python benchmarks/bench_w4a16.py --out DIR [--deadline-s 200]

Timing: benchmarks/common.py Timer (CUPTI summed kernel time of everything the jitted call launches (for
the kernel: x padding, the Pallas kernel, the split-K sum), one window per call, median of several calls
after a warm-up), on fresh random inputs. The XLA dequantize-then-dot comparator is
benchmarks/xla_baselines.py. Writes DIR/w4a16_results.json and DIR/w4a16_results.md with the run's
metadata; `--plot JSON` (anywhere, CPU is fine) turns the JSON into the TB/s plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SHAPES = [(7168, 18432), (7168, 2048), (18432, 7168), (2048, 7168)]  # (K, N), targets first
MS = [1, 8, 16, 32, 64, 128]
COPY_TBPS = 3.4e12  # measured device copy bandwidth on the H200 (docs/kernels.md); also re-measured below
PEAK_FLOPS = 800e12


def floor_us(m, k, n, copy_bps=COPY_TBPS):
    weight_bytes = n * k // 2 + n * (k // 32) * 2  # int4 + bf16 group scales
    act_bytes = m * k * 2 + m * n * 2
    return max((weight_bytes + act_bytes) / copy_bps, 2 * m * n * k / PEAK_FLOPS) * 1e6


def candidates(m, k, n):
    from pallas_kernels.w4a16 import BlockConfig, heuristic_config

    base = heuristic_config(m, k, n)
    steps = lambda bk: k // bk  # noqa: E731
    out = [base]

    def split_for(bm, bn, bk, target=264):
        progs = -(-m // bm) * (n // bn)
        best = 1
        for s in range(1, steps(bk) + 1):
            if steps(bk) % s == 0 and steps(bk) // s >= 2:
                best = s
                if progs * s >= target:
                    break
        return best

    bm = base.block_m
    for bn, bk, warps, stages in [(64, 256, 4, 4), (128, 512, 8, 3), (256, 256, 8, 3)]:
        if n % bn or k % bk:
            continue
        out.append(BlockConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split_for(bm, bn, bk),
                               num_warps=warps, num_stages=stages))
    if m >= 64:
        out.append(BlockConfig(block_m=128 if m >= 128 else 64, block_n=128, block_k=128,
                               split_k=split_for(128, 128, 128), num_warps=8, num_stages=3))
    if m == 1:
        out.append(BlockConfig(**{**base.__dict__, "dequant": "convert"}))  # value of the bit trick
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--deadline-s", type=float, default=200.0)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--plot", default=None, help="only plot this results JSON")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)

    import jax
    import jax.numpy as jnp

    from benchmarks.common import Timer, copy_bandwidth, metadata, write_json, write_results
    from benchmarks.xla_baselines import w4a16_matmul_xla
    from pallas_kernels.int4 import Int4Weight
    from pallas_kernels.w4a16 import get_config, w4a16_matmul, w4a16_matmul_reference
    from reference import int4 as ref

    t_start = time.time()
    if jax.default_backend() != "gpu":
        raise SystemExit("bench_w4a16 needs a GPU: CPU timings prove nothing")
    timer = Timer(args.iters)
    meta = metadata(timing="CUPTI summed kernel time, median of iterations", timer=timer.method)
    print(meta, flush=True)
    stem = os.path.join(args.out, "w4a16_results")

    def measure(f, *a):  # (output, device microseconds)
        timing = timer(f, *a)
        return timing.out, timing.device_s * 1e6

    # ---- copy bandwidth, measured in this run
    copy_bps = copy_bandwidth(timer)  # 1 GiB of bf16
    meta["copy_TBps_measured"] = copy_bps / 1e12

    # ---- correctness (native), vs float64 NumPy on moderate shapes and the jnp reference on big ones
    checks = []
    rng = np.random.default_rng(0)

    def np_problem(m, k, n, act=jnp.bfloat16):
        q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
        packed = ref.pack(q)
        scale = jnp.asarray(rng.uniform(0.005, 0.05, size=(n, k // 32)), jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((m, k)), act)
        leaf = Int4Weight.from_compressed(jnp.asarray(packed), scale)
        want = ref.matmul(np.asarray(x.astype(jnp.float32), np.float64), packed,
                          np.asarray(scale.astype(jnp.float32), np.float64))
        return x, leaf, want

    for m, k, n, act in [(1, 32, 16, jnp.bfloat16), (3, 7168, 2048, jnp.bfloat16), (17, 2048, 7168, jnp.bfloat16),
                         (128, 7168, 2048, jnp.bfloat16), (256, 2048, 7168, jnp.bfloat16),
                         (5, 2048, 512, jnp.float32), (1, 7168, 2048, jnp.float32)]:
        x, leaf, want = np_problem(m, k, n, act)
        cfg = get_config(m, k, n)
        try:
            got = np.asarray(w4a16_matmul(x, leaf, impl="triton").astype(jnp.float32), np.float64)
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        except Exception as e:  # noqa: BLE001 - record and continue, the run is precious
            err = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        checks.append({"m": m, "k": k, "n": n, "act": jnp.dtype(act).name, "vs": "float64 numpy",
                       "config": str(cfg), "rel_err": err})
        print("check", checks[-1], flush=True)

    def dev_leaf(k, n, key):
        kq, ks = jax.random.split(key)
        qweight = jax.random.randint(kq, (n, k // 4), -32768, 32767, jnp.int32).astype(jnp.int16)
        scale = jax.random.uniform(ks, (n, k // 32), jnp.float32, 0.005, 0.05).astype(jnp.bfloat16)
        return qweight, scale

    # ---- timings
    rows = []
    key = jax.random.key(1)
    for k, n in SHAPES:
        key, kw, kb = jax.random.split(key, 3)
        qweight, scale = dev_leaf(k, n, kw)
        w_bf16 = jax.random.normal(kb, (k, n), jnp.bfloat16) * 0.02
        for m in MS:
            key, kx = jax.random.split(key)
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            row = {"m": m, "k": k, "n": n, "floor_us": floor_us(m, k, n, copy_bps)}
            _, row["xla_bf16_us"] = measure(jax.jit(lambda a, w: a @ w), x, w_bf16)
            _, row["xla_int4_us"] = measure(jax.jit(w4a16_matmul_xla), x, qweight, scale)
            want = np.asarray(jax.jit(w4a16_matmul_reference)(x.astype(jnp.float32), Int4Weight(qweight, scale)))
            sweep = []
            cands = candidates(m, k, n) if time.time() - t_start < args.deadline_s else [get_config(m, k, n)]
            for cfg in cands:
                try:
                    f = jax.jit(lambda a, q, s, cfg=cfg: w4a16_matmul(a, Int4Weight(q, s), impl="triton", config=cfg))
                    out, us = measure(f, x, qweight, scale)
                    got = np.asarray(out.astype(jnp.float32))
                    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    sweep.append({"config": cfg.__dict__, "us": us, "rel_err": err})
                except Exception as e:  # noqa: BLE001
                    sweep.append({"config": cfg.__dict__, "us": None, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            good = [s for s in sweep if s.get("us") is not None and s["rel_err"] < 2e-2]
            best = min(good, key=lambda s: s["us"]) if good else None
            row["sweep"] = sweep
            row["kernel_us"] = best["us"] if best else None
            row["kernel_config"] = best["config"] if best else None
            row["kernel_rel_err"] = best["rel_err"] if best else None
            wbytes = n * k // 2 + n * (k // 32) * 2
            row["kernel_TBps"] = wbytes / (row["kernel_us"] * 1e-6) / 1e12 if best else None
            rows.append(row)
            print(f"K={k:5d} N={n:5d} M={m:3d}: kernel {row['kernel_us'] or float('nan'):7.1f} us "
                  f"(err {row['kernel_rel_err']}) | xla bf16 {row['xla_bf16_us']:7.1f} | "
                  f"xla int4 {row['xla_int4_us']:7.1f} | floor {row['floor_us']:6.1f} | "
                  f"{time.time() - t_start:5.0f}s  best={best['config'] if best else None}", flush=True)
            write_json(stem, meta, {"checks": checks, "rows": rows})  # so far: a cut run keeps its points
        del qweight, scale, w_bf16

    md = [f"# W4A16 GEMM on {meta['device']}", "",
          f"JAX {meta['jax']}, {meta['date']}, {meta['timing']}; copy bandwidth measured "
          f"{meta['copy_TBps_measured']:.2f} TB/s (floor = max(bytes / copy bw, FLOPs / 800 TFLOP/s)).", "",
          "| K | N | M | kernel us | kernel TB/s (int4+scales) | XLA bf16 us | XLA dequant+dot us | floor us | "
          "kernel / floor | config |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ku = r["kernel_us"]
        cfg = r["kernel_config"] or {}
        cs = (f"bm{cfg.get('block_m')} bn{cfg.get('block_n')} bk{cfg.get('block_k')} s{cfg.get('split_k')} "
              f"w{cfg.get('num_warps')} st{cfg.get('num_stages')} {cfg.get('dequant')}")
        md.append(f"| {r['k']} | {r['n']} | {r['m']} | {ku:.1f} | {r['kernel_TBps']:.2f} | {r['xla_bf16_us']:.1f} | "
                  f"{r['xla_int4_us']:.1f} | {r['floor_us']:.1f} | {ku / r['floor_us']:.2f} | {cs} |"
                  if ku else f"| {r['k']} | {r['n']} | {r['m']} | FAILED | | {r['xla_bf16_us']:.1f} | "
                  f"{r['xla_int4_us']:.1f} | {r['floor_us']:.1f} | | |")
    md += ["", "Correctness (native, kernel vs reference, max |err| / max |ref|):", ""]
    md += [f"- M={c['m']} K={c['k']} N={c['n']} {c['act']} vs {c['vs']}: {c['rel_err']}" for c in checks]
    write_results(stem, meta, {"checks": checks, "rows": rows}, "\n".join(md))
    print("\n".join(md))


def plot(path):
    """<folder of path>/w4a16_tbps.png from a results JSON (benchmarks.common.write_png: a note without
    matplotlib)."""
    from benchmarks.common import write_png

    with open(path) as fh:
        data = json.load(fh)
    write_png(os.path.join(os.path.dirname(path), "w4a16_tbps"), lambda out: draw(data, out))


def draw(data, out):
    import matplotlib.pyplot as plt

    rows, meta = data["rows"], data["meta"]
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(4.2 * len(SHAPES), 3.8), sharey=True)
    for ax, (k, n) in zip(axes, SHAPES, strict=True):
        rs = sorted([r for r in rows if r["k"] == k and r["n"] == n], key=lambda r: r["m"])
        if not rs:
            continue
        wbytes = n * k // 2 + n * (k // 32) * 2
        ms = [r["m"] for r in rs]
        tbps = lambda key, rs=rs, wbytes=wbytes: [  # noqa: E731
            wbytes / (r[key] * 1e-6) / 1e12 if r.get(key) else np.nan for r in rs]
        ax.plot(ms, tbps("kernel_us"), "o-", label="Pallas W4A16 kernel")
        ax.plot(ms, tbps("xla_int4_us"), "s--", label="XLA dequant+dot")
        ax.plot(ms, tbps("xla_bf16_us"), "^:", label="XLA bf16 dot (int4-equivalent bytes)")
        ax.plot(ms, tbps("floor_us"), "k-", lw=1, label="floor")
        ax.set_xscale("log", base=2)
        ax.set_title(f"K={k}, N={n}")
        ax.set_xlabel("M (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("effective TB/s of int4 weights + scales")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"W4A16 on {meta['device']}, JAX {meta['jax']}, {meta['date'][:10]}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main()
