"""Benchmark: the DDTree tree build, one Triton launch (pallas_kernels.tree_build) vs the jnp builder on XLA.

For drafter logits [B, L, V] (default the shipped pair's L = 15, V = 2048, and K2's V = 163840) and budgets
8..512, on one GPU:
  1. correctness: the kernel's tree against reference/tree.py's heap (the same float32 log-probs, bit for
     bit, every field) and against the jnp builder from the same logits (one program, field for field);
  2. CUPTI kernel time and kernel count (benchmarks/common.py Timer) of: `build_tree` from logits with the
     kernel ("kernel build": top_k + logsumexp + the launch), the same with the jnp builder ("jnp build"),
     the shared front end alone ("top_k + logsumexp") and the launch alone from top-K for several warp counts.
Writes DIR/tree_build.{json,md} with the run's metadata (device, JAX, date, git commit, command).

Usage (GPU): python benchmarks/bench_tree_build.py --out DIR
       (CPU):  python benchmarks/bench_tree_build.py --smoke   # interpret mode, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512], help="tree budgets")
    ap.add_argument("--vocabs", type=int, nargs="+", default=[2048, 163840], help="vocabulary sizes")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes")
    ap.add_argument("--depth", type=int, default=15, help="draft positions L (block size - 1)")
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8], help="warp counts to time the launch at")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per row (median reported)")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: interpret mode, tiny shapes")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import Timer, metadata, write_results
    from kdtree_jax.tree import build_tree, top_log_probs, tree_size_counts
    from pallas_kernels.dispatch import Kernels
    from pallas_kernels.tree_build import build_tree_from_top, pick_num_warps
    from reference.tree import heap_tree

    if args.smoke:
        args.budgets, args.vocabs, args.batches, args.depth, args.warps, args.iters = [4, 9], [16], [1, 2], 3, [1], 2
    interpret = args.smoke
    kernel = Kernels(tree="triton", interpret=interpret)
    jnp_builder = Kernels(tree="xla")
    timer = Timer(args.iters, device=jax.default_backend() == "gpu")
    rows, checks = [], []

    def measure(**row):
        fn, fargs = row.pop("fn"), row.pop("args")
        timing = timer(fn, *fargs)
        row["wall_us"] = timing.wall_s * 1e6
        if timing.device_s is not None:
            row.update(kernel_us=timing.device_s * 1e6, kernels=len(timing.kernels),
                       kernel_names=sorted({name for name, _ in timing.kernels}))
        print({k: v for k, v in row.items() if k != "kernel_names"}, flush=True)
        rows.append(row)
        return timing.out

    rng = np.random.default_rng(0)
    for vocab in args.vocabs:
        for batch in args.batches:
            logits_np = (rng.normal(size=(batch, args.depth, vocab)) * 3).astype(np.float32)
            logits_np[:, :, 5] += 8.0  # a confident drafter: deep trees, as in decoding
            logits = jnp.asarray(logits_np)
            for budget in args.budgets:
                k = min(budget, vocab)
                n_drafts = tree_size_counts(budget, vocab, args.depth)[1]
                roots = jnp.arange(batch, dtype=jnp.int32)
                # 1. correctness (batch row 0 against the heap; all rows against the jnp builder)
                top_lp, top_tok = jax.jit(top_log_probs, static_argnums=1)(logits, k)
                got = build_tree_from_top(top_lp, top_tok, roots, budget=budget, n_drafts=n_drafts,
                                          interpret=interpret)
                lp0 = np.full((args.depth, vocab), -np.inf, np.float32)  # the heap over the same K candidates
                np.put_along_axis(lp0, np.asarray(top_tok[0]), np.asarray(top_lp[0]), axis=-1)
                ref = heap_tree(lp0, budget, 0)
                heap_ok = all(np.array_equal(np.asarray(g[0]), r) for g, r in
                              zip(got, (ref.tokens, ref.parents, ref.depths, ref.scores, ref.visible), strict=True))
                both = jax.jit(lambda x, r, b=budget: (build_tree(x, b, r, kernels=kernel),
                                                       build_tree(x, b, r, kernels=jnp_builder)))
                a, b_ = both(logits, roots)
                jnp_ok = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b_, strict=True))
                checks.append({"vocab": vocab, "batch": batch, "budget": budget, "equals_heap": heap_ok,
                               "equals_jnp_builder": jnp_ok})
                print(checks[-1], flush=True)
                # 2. timing
                common = {"vocab": vocab, "batch": batch, "budget": budget}
                measure(stage=f"budget {budget}: build (kernel)", **common,
                        fn=jax.jit(lambda x, r, b=budget: build_tree(x, b, r, kernels=kernel)), args=(logits, roots))
                measure(stage=f"budget {budget}: build (jnp)", **common,
                        fn=jax.jit(lambda x, r, b=budget: build_tree(x, b, r, kernels=jnp_builder)),
                        args=(logits, roots))
                measure(stage=f"budget {budget}: top_k + logsumexp", **common,
                        fn=jax.jit(top_log_probs, static_argnums=1), args=(logits, k))
                for warps in args.warps:
                    fn = jax.jit(lambda lp, tok, r, w=warps, b=budget, n=n_drafts: build_tree_from_top(
                        lp, tok, r, budget=b, n_drafts=n, num_warps=w, interpret=interpret))
                    measure(stage=f"budget {budget}: launch, {warps} warps", **common, num_warps=warps,
                            default_warps=pick_num_warps(n_drafts), fn=fn, args=(top_lp, top_tok, roots))

    meta = metadata(timing=timer.method, depth=args.depth, smoke=args.smoke)
    lines = [f"# DDTree tree build: one Triton launch vs the jnp builder ({meta['device']})", "",
             f"{meta['date']}, JAX {meta['jax']}; {meta['timing']}; L = {args.depth} draft positions; logits "
             "N(0, 3) with one token +8 at every depth.", "",
             "Correctness: " + ("every case equals the heap and the jnp builder" if all(
                 c["equals_heap"] and c["equals_jnp_builder"] for c in checks) else
                 f"MISMATCH in {[c for c in checks if not (c['equals_heap'] and c['equals_jnp_builder'])]}"), "",
             "| V | B | stage | kernel us | kernels | wall us |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['stage']} | {r.get('kernel_us', float('nan')):.1f} | "
                     f"{r.get('kernels', '-')} | {r['wall_us']:.1f} |")
    if not args.smoke:
        write_results(args.out / "tree_build", meta, {"checks": checks, "rows": rows}, "\n".join(lines))
    print("\n".join(lines))
    if not all(c["equals_heap"] and c["equals_jnp_builder"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
