"""The Mosaic GPU W4A16 prototype (pallas_kernels/experimental/w4a16_mosaic_gpu.py) on the H200: correctness,
then device-side timings against the Triton W4A16 kernel, XLA bf16 `jnp.dot` and the memory floor, in one run.

  python benchmarks/bench_w4a16_mgpu.py --out DIR

Timing: benchmarks/common.py Timer (CUPTI summed kernel time, one window per call, median of --iters after
a warm-up). The Mosaic kernel is timed on weights already in its layout (jnp.int4 [N, K], bf16 scales
[K/32, N]); the layout conversion is a load-time step, not part of a GEMM. Every variant is checked against
the XLA dequantize-then-dot reference before it is timed; a variant that fails to compile or is wrong is
reported as such, never timed. Writes DIR/w4a16_mgpu.json and DIR/w4a16_mgpu.md with the run's metadata.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_w4a16 import floor_us  # noqa: E402

SHAPES = [(7168, 18432), (7168, 2048)]  # (K, N)
MS = [1, 16, 64]
# (block_n, block_k, max_concurrent_steps, a_operand)
VARIANTS = [(64, 64, 4, "registers"), (64, 128, 4, "registers"), (64, 256, 3, "registers"),
            (128, 128, 3, "registers"), (64, 128, 4, "smem")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results", help="folder for w4a16_mgpu.json / .md")
    ap.add_argument("--iters", type=int, default=7, help="timed iterations per point (median reported)")
    ap.add_argument("--deadline-s", type=float, default=240.0, help="start no new shape after this many seconds")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import Timer, metadata, write_results
    from pallas_kernels.experimental.w4a16_mosaic_gpu import MgpuConfig, w4a16_matmul_mgpu_kernel
    from pallas_kernels.int4 import Int4Weight
    from pallas_kernels.w4a16 import w4a16_matmul, w4a16_matmul_reference

    if jax.default_backend() != "gpu":
        raise SystemExit("bench_w4a16_mgpu needs a Hopper GPU: CPU timings prove nothing")
    t0 = time.time()
    timer = Timer(args.iters)
    meta = metadata(timing="CUPTI summed kernel time, median of iterations", timer=timer.method)
    print(meta, flush=True)

    def measure(f, *a):  # (output, device microseconds)
        timing = timer(f, *a)
        return timing.out, timing.device_s * 1e6

    rows = []
    key = jax.random.key(0)
    for k, n in SHAPES:
        if time.time() - t0 > args.deadline_s:
            print(f"deadline: skipping K={k} N={n}", flush=True)
            continue
        key, kq, ks, kb = jax.random.split(key, 4)
        leaf = Int4Weight(
            qweight=jax.random.randint(kq, (n, k // 4), -32768, 32767, jnp.int32).astype(jnp.int16),  # [N, K/4]
            scale=jax.random.uniform(ks, (n, k // 32), jnp.float32, 0.005, 0.05).astype(jnp.bfloat16))  # [N, K/32]
        mosaic = jax.jit(Int4Weight.to_mosaic)(leaf)  # w_i4 int4 [N, K], scale_t bf16 [K/32, N]
        w_i4, scale_t = mosaic.w_i4, mosaic.scale_t
        w_bf16 = jax.random.normal(kb, (k, n), jnp.bfloat16) * 0.02
        for m in MS:
            key, kx = jax.random.split(key)
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            want = np.asarray(jax.jit(w4a16_matmul_reference)(x, leaf).astype(jnp.float32))
            row = {"k": k, "n": n, "m": m, "floor_us": floor_us(m, k, n)}
            _, row["xla_bf16_us"] = measure(jax.jit(lambda x, w: x @ w), x, w_bf16)
            _, row["triton_us"] = measure(jax.jit(lambda x, leaf: w4a16_matmul(x, leaf, impl="triton")), x, leaf)
            mp = -(-m // 8) * 8
            x_p = jnp.pad(x, ((0, mp - m), (0, 0)))
            for bn, bk, steps, a_op in VARIANTS:
                name = f"mgpu bn{bn} bk{bk} s{steps} {a_op}"
                cfg = MgpuConfig(block_n=bn, block_k=bk, max_concurrent_steps=steps, a_operand=a_op)
                fn = jax.jit(lambda x_p, w, s, cfg=cfg: w4a16_matmul_mgpu_kernel(x_p, w, s, config=cfg))
                try:
                    got, us = measure(fn, x_p, w_i4, scale_t)
                    got = np.asarray(got[:, :m].T)
                    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    row[name] = us if err < 1e-2 else f"WRONG (rel err {err:.2e})"
                except Exception as e:  # noqa: BLE001 - one failing variant must not lose the run
                    row[name] = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(row, flush=True)
    names = [f"mgpu bn{bn} bk{bk} s{s} {a}" for bn, bk, s, a in VARIANTS]
    lines = [f"# Mosaic GPU W4A16 prototype vs Triton kernel vs XLA ({meta['device']})", "",
             f"{meta['date']}, JAX {meta['jax']}; {meta['timing']}; microseconds; floor = int4 weights + "
             "bf16 scales + activations at 3.4 TB/s.", "",
             "| K | N | M | floor | XLA bf16 | Triton W4A16 | " + " | ".join(names) + " |",
             "|---" * (6 + len(names)) + "|"]
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c])[:40] for c in names]
        lines.append(f"| {r['k']} | {r['n']} | {r['m']} | {r['floor_us']:.1f} | {r['xla_bf16_us']:.1f} | "
                     f"{r['triton_us']:.1f} | " + " | ".join(cells) + " |")
    write_results(os.path.join(args.out, "w4a16_mgpu"), meta, {"rows": rows}, "\n".join(lines))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
