"""The routed MoE of a small model on the H200: the grouped Triton kernel against XLA's three forms
(pallas_kernels/moe_w4a16/reference.py: "gather", "dense", "loop"), per token count, in one run; what decides
`pallas_kernels.moe_w4a16.tuned.measured_fastest` (which of kernel and XLA `impl="auto"` runs on a GPU).

  python benchmarks/bench_moe_small.py --out DIR

Shapes: the shipped pair's routed experts (E 32, D 384, I 96, top-4) in float32 at `--matmul-precision` (default
HIGHEST, the engine's float32 default; the end-to-end runs use BF16_BF16_F32_X9) and in bf16 (14 MiB as float32),
and two wider bf16 stacks of E 64, top-6: D 512, I 128 (48 MiB,
XLA's dense form still applies) and D 1024, I 256 (192 MiB, past reference.XLA_DEQUANT_BYTES: gather or loop).
Random INT4 experts (bf16 scales), each token routed to top-k distinct random experts with random weights. Every
implementation is first checked against the float32 reference (`grouped_moe_w4a16_reference`); one that disagrees
is reported and not timed.

Timing, all wall clocks before any CUPTI window (a CUPTI window inflates later wall clocks): "loop wall" = the
marginal wall clock a call of a jitted `fori_loop` whose calls each take the previous output ((wall of 2N calls -
wall of N calls) / N, N = --loop-calls: `common.loop_wall_us`; the per-call cost as inside the decode loop); then
CUPTI summed kernel time per call (median, benchmarks/common.py Timer) and the kernel count. Writes
DIR/moe_small_h200.json / .md. Compiles dominate: the shipped pair's two shapes at the default token counts take
about 3 minutes on the H200, all four shapes more."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import MATMUL_PRECISIONS  # noqa: E402

SHAPES = {  # name: (E, D, I, top_k, activation dtype)
    "shipped f32": (32, 384, 96, 4, "float32"),
    "shipped bf16": (32, 384, 96, 4, "bfloat16"),
    "mid bf16": (64, 512, 128, 6, "bfloat16"),
    "wide bf16": (64, 1024, 256, 6, "bfloat16"),
}
IMPLS = ("triton", "xla gather", "xla dense", "xla loop")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="folder for moe_small_h200.*")
    ap.add_argument("--ts", default="1,8,9,33,264", help="token counts T, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of: {', '.join(IMPLS)}")
    ap.add_argument("--iters", type=int, default=7, help="CUPTI windows per point (median)")
    ap.add_argument("--loop-calls", type=int, default=50, help="calls per timed fori_loop (loop wall)")
    ap.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest",
                    help="jax_default_matmul_precision for every point (default %(default)s, how the engine runs "
                         "float32 unless told; BF16_BF16_F32_X9 is the end-to-end benchmarks' choice on a GPU)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import Timer, loop_wall_us, metadata, set_matmul_precision, write_results
    from pallas_kernels.int4 import Int4Weight
    from pallas_kernels.moe_w4a16 import grouped_moe_w4a16, grouped_moe_w4a16_reference, moe_w4a16_xla
    from pallas_kernels.moe_w4a16.reference import xla_form

    if jax.default_backend() != "gpu":
        raise SystemExit("bench_moe_small times GPU kernels: CPU timings prove nothing")
    set_matmul_precision(args.matmul_precision)
    ts = [int(v) for v in args.ts.split(",")]
    shapes = [s.strip() for s in args.shapes.split(",")]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown --shapes {unknown}; choose from {list(SHAPES)}")
    impls = [s.strip() for s in args.impls.split(",")]
    if not set(impls) <= set(IMPLS):
        raise SystemExit(f"unknown --impls {sorted(set(impls) - set(IMPLS))}; choose from {list(IMPLS)}")
    timer = Timer(args.iters)
    meta = metadata(timing=f"loop wall: marginal wall clock a call of a jitted fori_loop of dependent calls ((2 x "
                    f"{args.loop_calls} calls - {args.loop_calls}) / {args.loop_calls}), every wall clock before any "
                    "CUPTI window; kernel: " + timer.method,
                    shapes={s: SHAPES[s] for s in shapes}, wall_after_cupti=False,
                    matmul_precision=args.matmul_precision)

    def fn_for(impl, experts):
        if impl == "triton":
            return lambda x, ids, w: grouped_moe_w4a16(x, experts, ids, w, impl="triton")
        form = impl.split()[1]
        return lambda x, ids, w: moe_w4a16_xla(x, experts, ids, w, form=form)

    points, rows = [], []
    for shape in shapes:
        e, d, inter, k, dtype = SHAPES[shape]
        keys = jax.random.split(jax.random.key(0), 4)

        def leaf(key, n, kk, e=e):
            kq, ks = jax.random.split(key)
            return Int4Weight(qweight=jax.random.randint(kq, (e, n, kk // 4), -32768, 32768, jnp.int32
                                                         ).astype(jnp.int16),
                              scale=(jax.random.uniform(ks, (e, n, kk // 32), minval=0.5, maxval=1.5) * 0.2
                                     / np.sqrt(kk)).astype(jnp.bfloat16))
        experts = {"gate": leaf(keys[0], inter, d), "up": leaf(keys[1], inter, d), "down": leaf(keys[2], d, inter)}
        for t in ts:
            kx, kr, kw = jax.random.split(jax.random.fold_in(keys[3], t), 3)
            x = jax.random.normal(kx, (t, d), jnp.dtype(dtype))
            ids = jnp.argsort(jax.random.uniform(kr, (t, e)), axis=1)[:, :k].astype(jnp.int32)
            w = jax.random.uniform(kw, (t, k), minval=0.05)
            want = np.asarray(grouped_moe_w4a16_reference(x, experts, ids, w).astype(jnp.float32), np.float64)
            for impl in impls:
                row = dict(shape=shape, experts=e, hidden=d, inter=inter, top_k=k, dtype=dtype, T=t, impl=impl,
                           auto_form=xla_form(t, k, experts))
                try:
                    raw = fn_for(impl, experts)
                    f = jax.jit(raw)
                    got = np.asarray(f(x, ids, w).astype(jnp.float32), np.float64)
                    row["rel_err"] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                    tol = 1e-4 if dtype == "float32" else 3e-2
                    if not row["rel_err"] < tol:
                        row["error"] = f"rel err {row['rel_err']:.2e} >= {tol:g}"
                except Exception as exc:  # noqa: BLE001 (reported in the results, never timed)
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                if "error" not in row:
                    points.append((row, raw, f, (x, ids, w)))
                print(row, flush=True)

    for row, raw, _, a in points:  # every wall clock first
        row["loop_wall_us"] = loop_wall_us(raw, a, args.loop_calls)
    for row, _, f, a in points:
        timing = timer(f, *a)
        row["kernel_us"] = timing.require_device_s() * 1e6
        row["kernels"] = len(timing.kernels)
        row["top_kernels"] = [(n[:50], s * 1e6) for n, s in sorted(timing.kernels, key=lambda ns: -ns[1])[:3]]
        print({k: row[k] for k in ("shape", "T", "impl", "loop_wall_us", "kernel_us", "kernels")}, flush=True)
    table = markdown(rows, ts, shapes, impls, args.matmul_precision)
    write_results(os.path.join(args.out, "moe_small_h200"), meta, {"rows": rows}, table)
    print(table)


def markdown(rows, ts, shapes, impls=IMPLS, precision: str = "highest") -> str:
    lines = ["# Routed MoE of a small model: Triton kernel vs XLA", "",
             "Per call, microseconds: loop wall (in a jitted loop, no dispatch) / CUPTI kernel time (kernel count). "
             "`auto form` = the XLA form `moe_w4a16_xla` picks; **bold** = the fastest loop wall. Float32 matmul "
             f"precision {precision}.", ""]
    for shape in shapes:
        sel = [r for r in rows if r["shape"] == shape]
        if not sel:
            continue
        e, d, inter, k = sel[0]["experts"], sel[0]["hidden"], sel[0]["inter"], sel[0]["top_k"]
        lines += [f"## {shape}: E {e}, D {d}, I {inter}, top-{k}", "",
                  "| T | auto form | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
        for t in ts:
            cells = {r["impl"]: r for r in sel if r["T"] == t}
            timed = [r for r in cells.values() if "loop_wall_us" in r]
            best = min(timed, key=lambda r: r["loop_wall_us"])["impl"] if timed else None
            out = []
            for impl in impls:
                r = cells.get(impl)
                if r is None:
                    out.append("-")
                elif "error" in r:
                    out.append("error: " + r["error"][:40])
                elif "kernel_us" not in r:
                    out.append(f"{r.get('loop_wall_us', float('nan')):.1f} / -")
                else:
                    cell = f"{r['loop_wall_us']:.1f} / {r['kernel_us']:.1f} ({r['kernels']})"
                    out.append(f"**{cell}**" if impl == best else cell)
            form = next(iter(cells.values()))["auto_form"] if cells else "-"
            lines.append(f"| {t} | {form} | " + " | ".join(out) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
