"""The most a DDTree round can accept from a target at a temperature, whatever the drafter: the oracle tree.

A DDTree round commits the path of tree nodes whose tokens the target's own draws (one per node, at the round's
temperature) agree with, plus one bonus token. For a tree of nodes n with path probabilities P(n) under the target
(the product of the target's conditionals along the path), the expected tokens a round commits are
1 + sum_n P(n); a drafter only decides which nodes the tree holds. The tree that maximizes that sum under a budget of
B nodes and a depth of L is built best-first on P(n) from the target's exact conditionals (the same best-first rule
DDTree applies to the drafter's scores, `kdtree_jax/tree.py`). So its 1 + sum_n P(n) is an upper bound on any
drafter's mean acceptance at that budget and depth, and what is left between the bound and a measured acceptance
is the drafter's share.

Contexts: the states a decode at that temperature visits, i.e. each held-out prompt continued by the target itself
(AR at the same temperature, a fixed seed) and cut after 0, 16, 32, ... tokens. Temperature 0 is not run: greedy, the
oracle tree is the argmax chain and commits L + 1 tokens every round.

    python benchmarks/acceptance_bound.py --out benchmarks/results              # the shipped pair, ~5 min on 2 CPUs

Writes <out>/acceptance_bound_<tag>.{json,md} with the run's metadata (device, JAX, date, git commit, command).
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kdtree_jax as kj  # noqa: E402
from benchmarks.common import metadata, shown_path, write_results  # noqa: E402
from training.prompts import load_prompts  # noqa: E402


def oracle_trees(logprob_fn, contexts: list[list[int]], budget: int, depth: int) -> np.ndarray:
    """For each context, the path probabilities of the best-first tree of `budget` nodes and depth <= `depth` under
    the conditionals `logprob_fn(sequences) -> [len(sequences), V]` log-probabilities of the next token (a batch of
    token lists). Returns [len(contexts), budget] float64, in the order the nodes were taken (so the first b columns
    are the budget-b tree). Ties break on the lower token id, as argsort does."""
    rows = len(contexts)
    first = logprob_fn(contexts)
    vocab = len(first[0])
    if budget > sum(vocab**d for d in range(1, depth + 1)):
        raise ValueError(f"budget {budget} exceeds the {vocab}-token tree of depth {depth}")
    order = [np.argsort(-lp, kind="stable") for lp in first]  # the root's children, best first
    # heap entries: (-log P, the node's path of tokens, its rank among its parent's children)
    heaps = [[(-float(first[i][order[i][0]]), (int(order[i][0]),), 0)] for i in range(rows)]
    children = [{(): (order[i], first[i])} for i in range(rows)]  # path -> (sorted ids, log-probs) of its children
    taken = np.zeros((rows, budget))
    for step in range(budget):
        expand = []  # (row, path) whose own children are needed
        for i in range(rows):
            neg, path, rank = heapq.heappop(heaps[i])
            taken[i, step] = math.exp(-neg)
            parent = path[:-1]
            ids, lps = children[i][parent]
            parent_lp = -neg - float(lps[ids[rank]])
            if rank + 1 < len(ids):  # the next sibling
                sib = int(ids[rank + 1])
                heapq.heappush(heaps[i], (-(parent_lp + float(lps[sib])), parent + (sib,), rank + 1))
            if len(path) < depth:
                expand.append((i, path, -neg))
        if expand and step + 1 < budget:
            lps_all = logprob_fn([contexts[i] + list(path) for i, path, _ in expand])
            for (i, path, lp), lps in zip(expand, lps_all, strict=True):
                ids = np.argsort(-lps, kind="stable")
                children[i][path] = (ids, lps)
                heapq.heappush(heaps[i], (-(lp + float(lps[ids[0]])), path + (int(ids[0]),), 0))
    return taken


def target_logprobs(cfg, params, temperature: float, width: int):
    """logprob_fn for oracle_trees: the target's next-token log-probabilities at `temperature` after each token list,
    one batched causal forward (lists right-padded to `width` tokens: one compile)."""
    fwd = jax.jit(lambda toks: kj.forward(params, cfg, toks))

    def fn(seqs: list[list[int]]) -> list[np.ndarray]:
        out = []
        for lo in range(0, len(seqs), 32):
            chunk = seqs[lo:lo + 32]
            toks = np.zeros((32, width), np.int32)
            for j, s in enumerate(chunk):
                if len(s) > width:
                    raise ValueError(f"a context of {len(s)} tokens exceeds the padded width {width}")
                toks[j, :len(s)] = s
            logits = np.asarray(fwd(jnp.asarray(toks)), np.float64)
            last = logits[np.arange(len(chunk)), [len(s) - 1 for s in chunk]] / temperature
            out += list(last - np.logaddexp.reduce(last, axis=-1, keepdims=True))
        return out

    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="folder for acceptance_bound_<tag>.{json,md}")
    ap.add_argument("--tag", default="cpu", help="suffix of the results files")
    ap.add_argument("--target", type=Path, default=kj.ASSETS / "target",
                    help="the target checkpoint (default: shipped)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the decode's temperature (> 0)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[7, 15, 31], help="tree budgets (nodes) to report")
    ap.add_argument("--depth", type=int, default=7, help="tree depth: the drafter's block size - 1 (shipped: 7)")
    ap.add_argument("--num-prompts", type=int, default=32, help="held-out prompts (of the shipped 32)")
    ap.add_argument("--cuts", type=int, nargs="+", default=[0, 16, 32, 48],
                    help="continuation lengths at which each prompt's own decode is cut into a context")
    ap.add_argument("--seed", type=int, default=0, help="the contexts' sampling key")
    args = ap.parse_args()
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (greedy, the oracle commits depth + 1 tokens every round)")
    if min(args.budgets) < 1 or args.depth < 1 or min(args.cuts) < 0:
        ap.error("--budgets and --depth must be >= 1, --cuts >= 0")
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg, params = kj.load_checkpoint(args.target, expect_kind="target", dtype=jnp.float32)
    prompts = load_prompts(args.num_prompts)
    cont = kj.generate(cfg, params, prompts, max_new_tokens=max(args.cuts), temperature=args.temperature,
                       key=jax.random.key(args.seed), stop_tokens=()) if max(args.cuts) else None
    contexts = [list(p) + ([] if cut == 0 or cont is None else [int(t) for t in np.asarray(cont.tokens[i])[:cut]])
                for i, p in enumerate(prompts) for cut in args.cuts]
    width = -(-(max(len(c) for c in contexts) + args.depth) // 16) * 16
    budget = max(args.budgets)
    taken = oracle_trees(target_logprobs(cfg, params, args.temperature, width), contexts, budget, args.depth)
    rows = []
    for b in sorted(args.budgets):
        per_context = 1.0 + taken[:, :b].sum(axis=1)
        rows.append(dict(budget=b, mean=float(per_context.mean()),
                         sem=float(per_context.std(ddof=1) / math.sqrt(len(per_context))),
                         p10=float(np.percentile(per_context, 10)), p90=float(np.percentile(per_context, 90))))
    meta = metadata(target=shown_path(args.target), temperature=args.temperature, depth=args.depth,
                    contexts=len(contexts), cuts=args.cuts, seed=args.seed, matmul_precision="highest")
    lines = [f"# The oracle tree's expected acceptance at temperature {args.temperature:g}: the most any drafter can "
             f"reach ({meta['device']})", "",
             f"{len(contexts)} contexts: {len(prompts)} held-out prompts, each continued by the target itself at "
             f"temperature {args.temperature:g} and cut after {', '.join(map(str, args.cuts))} tokens. Per context, "
             f"the best-first tree of `budget` nodes and depth <= {args.depth} under the target's exact conditionals; "
             "expected tokens a round commits = 1 + the sum of the nodes' path probabilities (the bonus included, as "
             "the engine's mean acceptance counts it). Float32, matmul precision highest.", "",
             "| budget | oracle mean accept | +- s.e. | 10th / 90th percentile |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['budget']} | {r['mean']:.3f} | {r['sem']:.3f} | {r['p10']:.2f} / {r['p90']:.2f} |" for r in rows]
    write_results(Path(args.out) / f"acceptance_bound_{args.tag}", meta, dict(rows=rows), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
