"""Benchmark: the DDTree tree build's variants on one GPU: pop loops (pallas_kernels.tree_build POP_LOOPS), front
ends (FRONT_ENDS), the build as it was (XLA front end + pop "lex") against the build the engine now runs.

For drafter logits [B, L, V] (default L = 15; V = 2048 and 4096, the shipped pairs' range, and K2's 163840) and
budgets 8..256:
  1. correctness, before any timing: every front end against kdtree_jax.tree.top_log_probs (tokens equal;
     values equal, or for "pallas_fused" the largest difference); every pop loop's tree from the same top-K
     against reference/tree.py's heap (batch row 0, bit for bit, every field) and against each other (all
     rows); the engine's build_tree on the kernel against the jnp builder in one program (first batch size);
  2. CUPTI kernel time and kernel count (benchmarks/common.py Timer) of each front end, of the build before
     and after, and (first vocabulary only: the launch sees only K = min(budget, V)) of each pop loop's
     launch at several warp counts.
A variant that fails to compile or run is recorded with its error and the run goes on; the exit status is 1
if anything failed or mismatched. Writes DIR/tree_build.{json,md} with the run's metadata.

Usage (GPU): python benchmarks/bench_tree_build.py --out DIR
       (CPU):  python benchmarks/bench_tree_build.py --smoke --out DIR   # interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 32, 128, 256], help="tree budgets")
    ap.add_argument("--vocabs", type=int, nargs="+", default=[2048, 4096, 163840], help="vocabulary sizes")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes")
    ap.add_argument("--depth", type=int, default=15, help="draft positions L (block size - 1)")
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4], help="warp counts to time the launches at")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per row (median reported)")
    ap.add_argument("--smoke", "--quick", action="store_true",
                    help="CPU check of the script: interpret mode, tiny shapes (not measurements)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import Timer, metadata, write_results
    from kdtree_jax.tree import build_tree, top_log_probs, tree_size_counts
    from pallas_kernels import tree_build
    from pallas_kernels.dispatch import Kernels
    from reference.tree import heap_tree

    if args.smoke:  # 16385: one vocabulary past the Pallas front end's limit
        args.budgets, args.vocabs, args.batches = [4, 9], [16, 16385], [1, 2]
        args.depth, args.warps, args.iters = 3, [1], 2
    interpret = args.smoke
    kernel, jnp_builder = Kernels(tree="triton", interpret=interpret), Kernels(tree="xla")
    timer = Timer(args.iters, device=jax.default_backend() == "gpu")
    rows, checks, failures = [], [], []
    lse_of = jax.jit(lambda x: jax.nn.logsumexp(x.astype(jnp.float32), axis=-1))

    def attempt(what: dict, fn, *fargs):
        """fn(*fargs) or None; a failure is recorded (with what was being done) and the run goes on."""
        try:
            return fn(*fargs)
        except Exception as e:  # noqa: BLE001 (a variant that does not compile must not cost the others)
            failures.append({**what, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"FAILED {what}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            return None

    def measure(fn, fargs, **row):
        def run():
            timing = timer(fn, *fargs)
            row["wall_us"] = timing.wall_s * 1e6
            if timing.device_s is not None:
                row.update(kernel_us=timing.device_s * 1e6, kernels=len(timing.kernels),
                           kernel_names=sorted({name for name, _ in timing.kernels}))
            print({k: v for k, v in row.items() if k != "kernel_names"}, flush=True)
            rows.append(row)
        attempt({k: row[k] for k in ("vocab", "batch", "budget", "stage")}, run)

    def launch(pop, warps, budget, n_drafts):
        return jax.jit(lambda lp, tok, r: tree_build.build_tree_from_top(
            lp, tok, r, budget=budget, n_drafts=n_drafts, num_warps=warps, pop=pop, interpret=interpret))

    def before(budget, n_drafts):
        """The build as the engine ran it before the variants: XLA's front end, pop loop "lex"."""
        def build(x, r):
            top_lp, top_tok = top_log_probs(x, min(budget, x.shape[-1]))
            return tree_build.build_tree_from_top(top_lp, top_tok, r, budget=budget, n_drafts=n_drafts, pop="lex",
                                                  interpret=interpret)
        return jax.jit(build)

    def fused_key(budget, n_drafts):
        def build(x, r):
            top_lp, top_tok = tree_build.top_log_probs_pallas(x, min(budget, x.shape[-1]), interpret=interpret)
            return tree_build.build_tree_from_top(top_lp, top_tok, r, budget=budget, n_drafts=n_drafts, pop="key",
                                                  interpret=interpret)
        return jax.jit(build)

    rng = np.random.default_rng(0)
    for vocab in args.vocabs:
        for batch in args.batches:
            logits_np = (rng.normal(size=(batch, args.depth, vocab)) * 3).astype(np.float32)
            logits_np[:, :, 5] += 8.0  # a confident drafter: deep trees, as in decoding
            logits = jnp.asarray(logits_np)
            roots = jnp.arange(batch, dtype=jnp.int32)
            for budget in args.budgets:
                k = min(budget, vocab)
                n_drafts = tree_size_counts(budget, vocab, args.depth)[1]
                common = {"vocab": vocab, "batch": batch, "budget": budget}
                check = dict(common)
                # 1. correctness
                fronts = {"xla": jax.jit(lambda x, k=k: top_log_probs(x, k))}
                if vocab <= tree_build.MAX_FRONT_VOCAB:
                    fronts["pallas"] = jax.jit(lambda x, k=k: tree_build.top_log_probs_pallas(
                        x, k, lse_of(x), interpret=interpret))
                    fronts["pallas_fused"] = jax.jit(lambda x, k=k: tree_build.top_log_probs_pallas(
                        x, k, interpret=interpret))
                top_lp, top_tok = fronts["xla"](logits)
                for name, fn in fronts.items():
                    out = attempt({**common, "stage": f"front {name}"}, fn, logits)
                    if out is None:
                        continue
                    got_lp, want_lp = np.asarray(out[0]), np.asarray(top_lp)
                    check[f"front_{name}_tokens_equal"] = bool(np.array_equal(np.asarray(out[1]), np.asarray(top_tok)))
                    check[f"front_{name}_values_max_diff"] = float(np.max(np.abs(got_lp - want_lp), initial=0.0,
                                                                          where=np.isfinite(want_lp)))
                    if name != "pallas_fused":
                        check[f"front_{name}_values_equal"] = bool(np.array_equal(got_lp, want_lp))
                lp0 = np.full((args.depth, vocab), -np.inf, np.float32)  # the heap over the same K candidates
                np.put_along_axis(lp0, np.asarray(top_tok[0]), np.asarray(top_lp[0]), axis=-1)
                ref = heap_tree(lp0, budget, 0)
                trees = {}
                for pop in tree_build.POP_LOOPS:
                    got = attempt({**common, "stage": f"tree {pop}"}, launch(
                        pop, tree_build.pick_num_warps(n_drafts), budget, n_drafts), top_lp, top_tok, roots)
                    if got is None:
                        continue
                    trees[pop] = [np.asarray(g) for g in got]
                    check[f"{pop}_equals_heap"] = all(np.array_equal(g[0], r) for g, r in zip(
                        trees[pop], (ref.tokens, ref.parents, ref.depths, ref.scores, ref.visible), strict=True))
                if len(trees) == len(tree_build.POP_LOOPS):
                    first, *others = trees.values()
                    check["pop_loops_equal"] = all(np.array_equal(a, b) for t in others
                                                   for a, b in zip(first, t, strict=True))
                if batch == args.batches[0]:
                    both = attempt({**common, "stage": "engine vs jnp builder"}, jax.jit(
                        lambda x, r, b=budget: (build_tree(x, b, r, kernels=kernel),
                                                build_tree(x, b, r, kernels=jnp_builder))), logits, roots)
                    if both is not None:
                        check["engine_equals_jnp_builder"] = all(
                            np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(*both, strict=True))
                checks.append(check)
                print(check, flush=True)
                # 2. timing
                for name, fn in fronts.items():
                    measure(fn, (logits,), stage=f"front {name}", kind="front", variant=name, **common)
                measure(before(budget, n_drafts), (logits, roots), stage="build before (front xla, pop lex)",
                        kind="build", variant="before", **common)
                measure(jax.jit(lambda x, r, b=budget: build_tree(x, b, r, kernels=kernel)), (logits, roots),
                        stage=f"build engine (front {tree_build.pick_front_end(vocab)}, pop {tree_build.POP_LOOP})",
                        kind="build", variant="engine", **common)
                if vocab <= tree_build.MAX_FRONT_VOCAB:
                    measure(fused_key(budget, n_drafts), (logits, roots), stage="build front pallas_fused, pop key",
                            kind="build", variant="pallas_fused+key", **common)
                if vocab == args.vocabs[0]:
                    for pop in tree_build.POP_LOOPS:
                        for warps in args.warps:
                            measure(launch(pop, warps, budget, n_drafts), (top_lp, top_tok, roots),
                                    stage=f"launch {pop}, {warps} warps", kind="launch", variant=pop, num_warps=warps,
                                    default_warps=tree_build.pick_num_warps(n_drafts), **common)

    bad = [c for c in checks if not all(v for key, v in c.items() if key.endswith(("_equal", "_heap", "_builder")))]
    meta = metadata(timing=timer.method, depth=args.depth, smoke=args.smoke, pop_loop=tree_build.POP_LOOP,
                    front_end=tree_build.FRONT_END)
    markdown = _markdown(meta, args, rows, checks, bad, failures)
    write_results(args.out / ("tree_build_smoke" if args.smoke else "tree_build"), meta,
                  {"checks": checks, "rows": rows, "failures": failures}, markdown)
    print(markdown)
    if bad or failures:
        sys.exit(1)


def _markdown(meta, args, rows, checks, bad, failures) -> str:
    def us(row):
        if row is None:
            return "-"
        return f"{row['kernel_us']:.1f} ({row['kernels']})" if "kernel_us" in row else f"{row['wall_us']:.0f} wall"

    def find(vocab, batch, budget, kind, variant, warps=None):
        for r in rows:
            if (r["vocab"], r["batch"], r["budget"], r["kind"], r["variant"]) == (vocab, batch, budget, kind, variant) \
                    and (warps is None or r.get("num_warps") == warps):
                return r
        return None

    def best_launch(batch, budget, pop):
        got = [r for r in rows if (r["batch"], r["budget"], r["kind"], r["variant"]) == (batch, budget, "launch", pop)]
        if not got:
            return "-"
        r = min(got, key=lambda r: r.get("kernel_us", r["wall_us"]))
        return f"{us(r)}, {r['num_warps']} w"

    lines = [f"# DDTree tree build variants ({meta['device']})", "",
             f"{meta['date']}, JAX {meta['jax']}; {meta['timing']}; L = {args.depth} draft positions; logits N(0, 3) "
             "with one token +8 at every depth. Engine defaults: front end "
             f"{meta['front_end']!r} (XLA above V = 16384), pop loop {meta['pop_loop']!r}."
             + (" SMOKE RUN (CPU, interpret mode): these numbers are NOT measurements." if args.smoke else ""), "",
             "Correctness: " + ("every check passed (fronts vs top_log_probs, pop loops vs the heap and each other, "
                                "engine vs the jnp builder)" if not bad else f"MISMATCH in {bad}"), ""]
    if failures:
        lines += ["Failures: " + "; ".join(f"{f['stage']} at V {f['vocab']} B {f['batch']} budget {f['budget']}: "
                                            f"{f['error'][:300]}" for f in failures), ""]
    lines += ["Kernel us (kernels) per call; launch: the fastest warp count.", "",
              "| V | B | budget | front xla | front pallas | front fused | build before | build engine | "
              "build fused+key | launch lex | launch key |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        v, b, n = c["vocab"], c["batch"], c["budget"]
        lines.append(" | ".join([f"| {v}", str(b), str(n)]
                                + [us(find(v, b, n, "front", f)) for f in ("xla", "pallas", "pallas_fused")]
                                + [us(find(v, b, n, "build", f)) for f in ("before", "engine", "pallas_fused+key")]
                                + [best_launch(b, n, p) if v == args.vocabs[0] else "" for p in ("lex", "key")]) + " |")
    lines += ["", "All rows:", "", "| V | B | budget | stage | kernel us | kernels | wall us |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['budget']} | {r['stage']} | "
                     f"{r.get('kernel_us', float('nan')):.1f} | {r.get('kernels', '-')} | {r['wall_us']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
