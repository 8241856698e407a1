"""How XLA runs a model's matvecs on the GPU: y = x @ W for one token (an AR step) and a few (a verify).

  python benchmarks/probe_matvec.py --out DIR
  python benchmarks/probe_matvec.py --out DIR --k26 --dtype bfloat16 --tag k26_bf16   # K2.6's bf16 projections

At one token XLA rewrites a float32 dot with a vector operand into an elementwise multiply and a reduction (its
dot strength reduction); in the shipped pair's compiled AR step that is two kernels per matvec (a loop fusion that
writes the whole x * W product, then a reduction over K: benchmarks/results/round_profile.md's HLO). This probe
times, at the shipped pair's matvec shapes (K x N; --k26: Kimi K2.6's bf16 projections; --shapes: any), three
forms of the same product:
  "dot"        x @ W, W [K, N] (what the model writes);
  "dot_nt"     the same dot with W stored transposed, [N, K] (contracting both operands' last dim);
  "row_reduce" sum(x[:, None, :] * W^T[None], -1), W^T [N, K]: a reduction over the minor dim, the form XLA fuses
               with its elementwise producer.
Each form is checked against a float64 NumPy product first. Timing: loop wall = the marginal wall clock a call of a
jitted fori_loop of dependent calls ((2N - N calls) / N, N = --loop-calls; every wall clock first), then CUPTI
summed kernel time per call, the kernel count and the weight's bytes over that time (GB/s). float32 at HIGHEST
precision, as the engine runs the shipped pair, or --dtype bfloat16 (default precision, as the engine runs K2.6).
Writes DIR/matvec_h200.json / .md (DIR/matvec_TAG.* with --tag). A weight smaller than the GPU's L2 (50 MB on an H100)
stays there between the timed calls, so its GB/s are L2's, not HBM's (K2.6's 7168 x 1536 read "3.3-4.5 TB/s" on an
H100 this way, benchmarks/results/matvec_h100_s31_k26_bf16.md): inside a model's layer it is read from HBM."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (K, N) of the shipped pair's dense matvecs: folded q_a|kv_a, folded q_b, folded o, router|shared gate|up,
# shared down, lm_head
SHAPES = ((384, 352), (192, 960), (768, 384), (384, 224), (96, 384), (384, 4096))
# Kimi K2.6's bf16 matvecs a layer: q_a, kv_a, [q_a | kv_a], q_b, o, shared gate (= up), [shared gate | up], shared
# down, router
K26_SHAPES = ((7168, 1536), (7168, 576), (7168, 2112), (1536, 12288), (8192, 7168), (7168, 2048), (7168, 4096),
              (2048, 7168), (7168, 384))
FORMS = ("dot", "dot_nt", "row_reduce")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="folder for matvec_h200.*")
    ap.add_argument("--ms", default="1,9,33", help="token counts M, comma-separated")
    ap.add_argument("--iters", type=int, default=5, help="CUPTI windows per point (median)")
    ap.add_argument("--loop-calls", type=int, default=50, help="calls per timed fori_loop (loop wall)")
    ap.add_argument("--k26", action="store_true",
                    help="Kimi K2.6's bf16 projection shapes instead of the shipped pair's")
    ap.add_argument("--shapes", nargs="+", metavar="K:N", help="these K x N shapes instead")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="x and W dtype: float32 at HIGHEST precision (the shipped pair), bfloat16 at the default "
                         "precision (K2.6); default %(default)s")
    ap.add_argument("--tag", default="h200", help="results file stem: matvec_TAG (default %(default)s)")
    args = ap.parse_args()
    shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes] if args.shapes
              else K26_SHAPES if args.k26 else SHAPES)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import Timer, loop_wall_us, metadata, write_results

    if jax.default_backend() != "gpu":
        raise SystemExit("probe_matvec times GPU kernels: CPU timings prove nothing")
    f32 = args.dtype == "float32"
    if f32:
        jax.config.update("jax_default_matmul_precision", "highest")
    hp = jax.lax.Precision.HIGHEST if f32 else None
    dtype, tol = (jnp.float32, 1e-5) if f32 else (jnp.bfloat16, 1e-2)
    fns = {
        "dot": lambda x, w, wt: x @ w,
        "dot_nt": lambda x, w, wt: jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())), precision=hp),
        "row_reduce": lambda x, w, wt: jnp.sum(x[:, None, :] * wt[None], axis=-1),
    }

    timer = Timer(args.iters)
    meta = metadata(timing=f"loop wall: marginal wall clock a call of a jitted fori_loop of dependent calls ((2 x "
                    f"{args.loop_calls} calls - {args.loop_calls}) / {args.loop_calls}), every wall clock before any "
                    "CUPTI window; kernel: " + timer.method, wall_after_cupti=False,
                    matmul_precision="highest" if f32 else "default", dtype=args.dtype)
    rows, points = [], []
    key = jax.random.key(0)
    for k, n in shapes:
        for m in (int(v) for v in args.ms.split(",")):
            key, kx, kw = jax.random.split(key, 3)
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
            w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
            wt = jnp.asarray(w.T)
            want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
            for form in FORMS:
                f = jax.jit(fns[form])
                got = np.asarray(f(x, w, wt).astype(jnp.float32), np.float64)
                row = {"K": k, "N": n, "M": m, "form": form,
                       "rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want))}
                rows.append(row)
                if row["rel_err"] < tol:
                    points.append((row, fns[form], f, (x, w, wt)))
                else:
                    row["error"] = f"rel err {row['rel_err']:.2e}"
    for row, raw, _, a in points:  # every wall clock first
        row["loop_wall_us"] = loop_wall_us(raw, a, args.loop_calls)
    for row, _, f, a in points:
        timing = timer(f, *a)
        row.update(kernel_us=timing.require_device_s() * 1e6, kernels=len(timing.kernels))
        row["GBps"] = row["K"] * row["N"] * jnp.dtype(dtype).itemsize / row["kernel_us"] / 1e3
        print(row, flush=True)
    lines = [f"# Matvecs on the GPU: dot vs transposed dot vs row reduction ({meta['device']})", "",
             "Per call, us: loop wall (in a jitted loop) / CUPTI kernel time (kernels) [the weight's bytes over the "
             f"kernel time, GB/s]. {args.dtype}, {'HIGHEST' if f32 else 'default'} precision.", "",
             "| K x N | M | " + " | ".join(FORMS) + " |", "|---|---|" + "---|" * len(FORMS)]
    for k, n in shapes:
        for m in sorted({r["M"] for r in rows}):
            cells = {r["form"]: r for r in rows if (r["K"], r["N"], r["M"]) == (k, n, m)}
            out = [f"{c['loop_wall_us']:.1f} / {c['kernel_us']:.1f} ({c['kernels']}) [{c['GBps']:.0f}]"
                   if "kernel_us" in c
                   else c.get("error", "-") for c in (cells[f] for f in FORMS)]
            lines.append(f"| {k} x {n} | {m} | " + " | ".join(out) + " |")
    write_results(os.path.join(args.out, f"matvec_{args.tag}"), meta, {"rows": rows}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
