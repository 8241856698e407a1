"""tree_budget="auto" at Kimi K2.6 width on one H200 (issue 19): the budgets auto picks and what its rounds cost.

  python benchmarks/bench_k26_auto.py --out DIR [--deadline-s 170]
  python benchmarks/bench_k26_auto.py --tiny --out DIR      # CPU smoke run (< 1 min): NOT measurements
  python benchmarks/bench_k26_auto.py --summarize DIR/k26_auto.json   # rebuild the .md/.png, no GPU

Two questions, one run.

1. Masked static tree or one compiled verify per budget (`lax.switch`, what the engine does)? On the
   K2.6-width slice of bench_k26_slice.py (its layers, params and extrapolation to 61 layers) it times, at
   every candidate budget b (live tree 1 + b inside a max tree T_max = 1 + max budget):
     switch: one jit, `lax.switch` over one slice forward per candidate (T = 1 + b), the index a runtime
             argument, compiled without command buffers so that CUPTI sees the branch's kernels (the
             masked jit too, so that their wall clocks compare);
     masked: one jit at T_max whose slots past the live count route to no expert (combine weight 0: the
             grouped MoE kernels drop zero-weight choices, so an expert only they touch is never read) and
             see only themselves; the live count a runtime argument;
   and, per component: the routed MoE at T = 1 + b against the masked MoE at T_max, the attention core at
   T = 1 + b against T_max (the attention, kernel or XLA, computes every row it is given), the lm_head.
   Kernels on a GPU: the Mosaic GPU MoE kernel, the Pallas tree build, and the attention on "auto" (the Mosaic GPU
   kernel at the call shapes where it measured fastest, XLA elsewhere; each point records which ran).
2. What auto buys at a controlled acceptance. A synthetic drafter stands in for OracleDraft degraded to a
   profile: per round a confidence z ~ N(0, SPREAD^2); at depth d the drafter spreads its mass over
   1 + ALTERNATIVES plausible tokens, rank j getting a share proportional to rho^j with
   rho = sigmoid(DECAY * d - offset - z) (a confident round puts nearly all of it on its top token, an
   unsure one spreads it evenly). The true continuation is drawn from the drafter's own distribution
   (calibrated) or a flatter one (--overconfidence > 1: the drafter is surer than it should be, so its
   scores overstate acceptance, as trained drafters' do). `offset` is solved so that the argmax
   chain (DFlash) commits `target` tokens per round on average, e.g. the 3.7-5.5 reported for the K2.5
   drafter at block 8 (docs/drafter.md). Each simulated round runs the engine's own pieces on the device:
   `build_tree` at the largest budget, `accept_path` on every candidate prefix (`slice_tree`), and
   `budget.choose` with the round costs measured in (1): so the budget auto picks per round (histogram), the
   tokens it commits, and the modelled tokens/s of auto against every fixed budget.

Round cost = draft (modelled: --draft-ms, docs/drafter.md's K2.5 drafter at K2.6 width) + tree build
(measured; auto builds at the largest budget and runs `choose`) + the 61-layer verify extrapolated from the
slice (bench_k26_slice.extrapolated_verify) + for auto the switch's own overhead (wall clock of the switch
at the largest budget over the masked jit at full size). Timing as bench_k26_slice.py: CUPTI summed kernel
time on a GPU (wall clock beside it), CPU wall clock with --tiny. Writes DIR/k26_auto.json (rewritten after
every step, so a run cut short keeps its points), DIR/k26_auto.md and DIR/k26_auto.png with the run's
metadata.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
TARGETS = (3.7, 4.0, 5.5)  # chain acceptance reported for Kimi-K2.5-DFlash, block 8 (docs/drafter.md)
OVERCONFIDENCE = (1.0, 1.5)
HEADLINE = (4.0, 1.0)  # the target: auto beats every fixed budget at acceptance 4 (calibrated drafter)
# The synthetic drafter (see the module docstring): round-to-round spread of the confidence logit, its
# decay per depth, and how many plausible tokens besides the top one share each depth's mass.
SPREAD, DECAY, ALTERNATIVES = 1.0, 0.15, 15
FLOOR_LOGIT = -30.0  # every other vocabulary entry: never in a tree that has real alternatives left
# CUPTI misses kernels that XLA launches from command buffers inside control flow (docs/k26_verify_cost.md):
# the switch is compiled without them, and the masked tree alike (their wall clocks are compared).
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


# ------------------------------------------------------------------------------ the synthetic drafter
@dataclasses.dataclass(frozen=True)
class Profile:
    """A controlled acceptance profile: the argmax chain commits `target` tokens per round on average."""

    target: float
    overconfidence: float
    depth: int  # L = block - 1 drafted positions

    @property
    def name(self) -> str:
        kind = "calibrated" if self.overconfidence == 1 else f"overconfident x{self.overconfidence:g}"
        return f"chain {self.target:g}, {kind}"

    def offset(self) -> float:
        """The confidence offset whose argmax chain commits `target` tokens per round (bisection: the
        chain grows with the offset)."""
        if not 1 < self.target < 1 + self.depth:
            raise SystemExit(f"chain acceptance {self.target} must lie in (1, {1 + self.depth}) at depth {self.depth}")
        lo, hi = -30.0, 30.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if chain_acceptance(mid, self) < self.target else (lo, mid)
        return (lo + hi) / 2


def rank_log_probs(xp, z, offset, depth: int):
    """Drafter log-probs of its ranked tokens [..., depth, 1 + ALTERNATIVES], descending, for round
    confidences z [..., 1] (xp: numpy or jax.numpy): rank j gets rho^j / sum_i rho^i."""
    log_rho = -xp.logaddexp(0.0, offset + z - DECAY * xp.arange(depth))  # log sigmoid(DECAY d - offset - z)
    unnormalised = log_rho[..., None] * np.arange(1 + ALTERNATIVES)  # rank 0 at 0: the largest
    return unnormalised - xp.log(xp.sum(xp.exp(unnormalised), axis=-1, keepdims=True))


def chain_acceptance(offset: float, profile: Profile) -> float:
    """Mean tokens per round of the argmax chain: 1 + E_z sum_d prod_{j <= d} P(truth is the top token at j)
    (Gauss-Hermite over z)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(64)
    lp = rank_log_probs(np, SPREAD * nodes[:, None], offset, profile.depth) / profile.overconfidence
    top = np.exp(lp[..., 0] - np.logaddexp.reduce(lp, axis=-1))  # [Q, L]
    return float(1 + weights @ np.cumprod(top, axis=1).sum(axis=1) / weights.sum())


def synthetic_draft(key, rounds: int, vocab: int, offset, overconfidence, depth: int):
    """(drafter logits [rounds, depth, vocab], true tokens [rounds, depth], the truth's rank [rounds, depth]):
    each depth's ranked tokens sit at a random place of the vocabulary."""
    import jax
    import jax.numpy as jnp

    kz, kt, ko = jax.random.split(key, 3)
    lp = rank_log_probs(jnp, SPREAD * jax.random.normal(kz, (rounds, 1)), offset, depth)  # [R, L, A + 1]
    rank = jax.random.categorical(kt, lp / overconfidence)  # [R, L]
    ids = (jax.random.randint(ko, (rounds, depth, 1), 0, vocab) + jnp.arange(lp.shape[-1])) % vocab
    logits = jnp.full((rounds, depth, vocab), FLOOR_LOGIT, jnp.float32).at[
        jnp.arange(rounds)[:, None, None], jnp.arange(depth)[None, :, None], ids].set(lp)
    return logits, jnp.take_along_axis(ids, rank[..., None], axis=-1)[..., 0], rank


def simulate_rounds(key, rounds: int, vocab: int, offset, overconfidence, *, depth: int, budgets, kernels):
    """One batch of independent batch-1 rounds through the engine's tree pieces: (committed tokens at every
    candidate budget [R, nb], the max-budget tree's scores [R, 1 + max], expected tokens E(n) per budget
    [R, nb], the argmax chain's committed tokens [R])."""
    import jax
    import jax.numpy as jnp

    from kdtree_jax import budget as budget_lib
    from kdtree_jax.ddtree import accept_path, slice_tree
    from kdtree_jax.tree import build_tree

    logits, truth, rank = synthetic_draft(key, rounds, vocab, offset, overconfidence, depth)
    tree = build_tree(logits, max(budgets), kernels=kernels)
    # The target's greedy token after a node at depth d is the truth at depth d + 1 (past the block: none).
    wants = jnp.concatenate([truth, jnp.full((rounds, 1), -1, truth.dtype)], axis=1)  # [R, L + 1]
    posterior = jnp.take_along_axis(wants, tree.depths, axis=1)  # [R, T]
    lengths = jnp.stack([accept_path(slice_tree(tree, b), posterior[:, :1 + b], depth)[1] for b in budgets], 1)
    one = jnp.ones((1,), bool)
    expected = jax.vmap(lambda s: budget_lib.expected_tokens(s[None], one, tuple(budgets)))(tree.scores)
    chain = 1 + jnp.sum(jnp.cumprod(rank == 0, axis=1), axis=1)
    return lengths, tree.scores, expected, chain


def budget_choose(scores, costs):
    """The engine's budget.choose for a batch whose every row is live: index into costs.budgets."""
    import jax.numpy as jnp

    from kdtree_jax import budget as budget_lib

    return budget_lib.choose(scores, jnp.ones((scores.shape[0],), bool), costs)


def auto_choices(scores, costs):
    """budget_choose for every simulated round alone (batch 1), on the device: [R] indices."""
    import jax

    return jax.jit(jax.vmap(lambda row: budget_choose(row[None], costs)))(scores)


# ---------------------------------------------------------------------------- the masked static tree
def masked_weights(weights, live):
    """Routing combine weights [T, k] with the slots from `live` on zeroed: they route to no expert."""
    import jax.numpy as jnp

    return jnp.where((jnp.arange(weights.shape[0]) < live)[:, None], weights, 0.0)


@contextlib.contextmanager
def routed_rows_masked(live):
    """While a function is traced: the model's routed experts give the tree slots from `live` on (a traced
    count) zero weight, which the grouped MoE kernels skip: the masked static tree's MoE."""
    from kdtree_jax import model

    saved = model.routed_experts

    def routed(x, experts, idx, weights, kernels):  # x [B * T, D]: batch 1, row = tree slot
        return saved(x, experts, idx, masked_weights(weights, live), kernels)

    model.routed_experts = routed
    try:
        yield
    finally:
        model.routed_experts = saved


# ---------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--layers", type=int, default=2, help="MoE layers in the slice (9.8 GB each at K2.6)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per point (the median is reported)")
    ap.add_argument("--deadline-s", type=float, default=170.0,
                    help="stop starting new measurements after this (the results keep what was measured)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="candidate budgets, comma-separated")
    ap.add_argument("--s", type=int, default=4096, help="committed context S of the verify")
    ap.add_argument("--block", type=int, default=8, help="drafter block (depth + 1): 8 for Kimi-K2.5-DFlash")
    ap.add_argument("--targets", default=",".join(map(str, TARGETS)), help="chain acceptances of the profiles")
    ap.add_argument("--overconfidence", default=",".join(map(str, OVERCONFIDENCE)),
                    help="truth temperature per profile: 1 = calibrated drafter, > 1 = overconfident")
    ap.add_argument("--rounds", type=int, default=2048, help="simulated rounds per profile")
    ap.add_argument("--draft-ms", type=float, default=4.5,
                    help="draft time per round (modelled: the K2.5 drafter at K2.6 width, docs/drafter.md)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at tiny width (XLA paths, wall clock)")
    ap.add_argument("--summarize", metavar="JSON", help="no measuring: rebuild the .md/.png from a k26_auto JSON")
    args = ap.parse_args()
    if args.summarize:
        return resummarize(args.summarize)
    t_start = time.time()

    import jax
    import jax.numpy as jnp

    import kdtree_jax as kj
    from benchmarks.bench_k26_slice import (
        attention_kernel,
        random_tree_mask,
        slice_config,
        slice_device,
        slice_forward,
        slice_params,
    )
    from benchmarks.common import Timer, copy_bandwidth, metadata, write_json
    from kdtree_jax import attention as kattention
    from kdtree_jax import model as kmodel
    from kdtree_jax.layers import rms_norm
    from kdtree_jax.linear import linear

    on_gpu, timing = slice_device("bench_k26_auto", args.tiny)
    budgets = tuple(sorted({int(v) for v in args.budgets.split(",")}))
    depth = args.block - 1
    profiles = [Profile(float(t), float(o), depth) for o in args.overconfidence.split(",")
                for t in args.targets.split(",")]
    cfg = slice_config(args.tiny, args.layers)
    # attention "auto": the dispatcher's measured choice per call shape (recorded per point as attention_kernel)
    kernels = (kj.Kernels(attention="auto", moe="mosaic_gpu", tree="triton") if on_gpu
               else kj.Kernels(attention="xla", linear="xla", moe="xla", tree="xla"))
    timer = Timer(args.iters)
    s, t_max, c, r = args.s, 1 + max(budgets), cfg.kv_lora_rank, cfg.qk_rope_head_dim
    meta = metadata(
        tiny=args.tiny, layers=args.layers, S=s, budgets=list(budgets), block=args.block, draft_ms=args.draft_ms,
        rounds=args.rounds, drafter_model={"spread": SPREAD, "decay": DECAY, "alternatives": ALTERNATIVES},
        timing=timing, timer=timer.method,
        config={k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "n_routed_experts",
                                             "num_experts_per_tok", "moe_intermediate_size", "vocab_size")})
    stem = os.path.join(args.out, "k26_auto_tiny" if args.tiny else "k26_auto")
    measured: dict = {"points": [{"budget": b, "T": 1 + b} for b in budgets]}
    sims: list[dict] = []
    skipped: list[str] = []
    meta["skipped"] = skipped
    points = {p["budget"]: p for p in measured["points"]}

    def in_time(what: str) -> bool:
        if time.time() - t_start <= args.deadline_s:
            return True
        print(f"deadline: skipping {what}", flush=True)
        skipped.append(what)
        return False

    def save():  # a run cut short keeps its points
        write_json(stem, meta, {"measured": measured, "profiles": sims})

    # ---- (2a) the simulated rounds: trees, acceptance at every budget, scores (costs come later)
    sim_fn = jax.jit(simulate_rounds, static_argnames=("rounds", "vocab", "depth", "budgets", "kernels"))
    chunk = min(args.rounds, 256)
    scores_of, lengths_of = {}, {}
    for i, prof in enumerate(profiles):
        if not in_time(f"profile {prof.name}"):
            continue
        offset = prof.offset()
        parts = [sim_fn(jax.random.fold_in(jax.random.key(7), 1000 * i + j), chunk, cfg.vocab_size, offset,
                        prof.overconfidence, depth=depth, budgets=budgets, kernels=kernels)
                 for j in range(-(-args.rounds // chunk))]
        lengths, scores, expected, chain = (jnp.concatenate(x)[:args.rounds] for x in zip(*parts, strict=True))
        scores_of[prof], lengths_of[prof] = scores, np.asarray(lengths)
        sims.append({"name": prof.name, "target": prof.target, "overconfidence": prof.overconfidence,
                     "offset": offset, "chain_model": chain_acceptance(offset, prof),
                     "chain_sim": float(chain.mean()), "rounds": int(lengths.shape[0]),
                     "expected": np.asarray(expected).mean(0).tolist(),
                     "acceptance": {str(b): float(v) for b, v in zip(budgets, lengths.mean(0), strict=True)}})
        print(f"{prof.name}: offset {offset:.3f}, chain {sims[-1]['chain_sim']:.2f} (model "
              f"{sims[-1]['chain_model']:.2f}), tree acceptance "
              + ", ".join(f"B={b} {v:.2f}" for b, v in sims[-1]["acceptance"].items()),
              flush=True)

    # ---- the slice: copy bandwidth, the model's params on the device, one set of inputs at T_max
    meta["copy_TBps"] = copy_bandwidth(timer, (512 if on_gpu else 4) * 1024 * 1024) / 1e12
    t0 = time.time()
    params = slice_params(cfg, jnp.bfloat16, jax.random.key(100))
    if on_gpu:
        params = kj.to_mosaic_experts(params, cfg)  # a load-time conversion, the model's layout on Hopper
    params = kmodel.fold_params(params, cfg, kernels)  # what generate does before its loop (K2.6: W_UK / W_UV by head)
    jax.block_until_ready(params)
    meta["build_s"] = time.time() - t0
    meta["kernels"] = kj.plan_summary(kj.kernel_plan(params, cfg, kernels=kernels))
    print(f"built {args.layers} layers on device in {meta['build_s']:.1f} s; {meta['kernels']}", flush=True)
    mask_np = random_tree_mask(np.random.default_rng(0), t_max)
    mask = jnp.asarray(mask_np)[None]  # [1, T_max, T_max]; any prefix of it is a tree too
    positions = jnp.asarray(s + mask_np.sum(1) - 1, jnp.int32)[None]  # start + depth
    h = jax.random.normal(jax.random.key(1), (1, t_max, cfg.hidden_size), jnp.bfloat16)
    cache = jax.random.normal(jax.random.key(2), (1, s + 256, c + r), jnp.bfloat16)
    start = jnp.asarray([s], jnp.int32)
    inputs = (params, h, positions, cache, start, mask)

    def verify_at(t):  # the slice's verify of the first t slots, padded back to T_max rows
        def fn(params, h, positions, cache, start, mask):
            out = slice_forward(cfg, kernels, params, h[:, :t], positions[:, :t], cache, start, mask[:, :t, :t])[0]
            return jnp.pad(out, ((0, 0), (0, t_max - t), (0, 0)))
        return fn

    def masked_verify(live, params, h, positions, cache, start, mask):
        mask = jnp.where((jnp.arange(t_max) < live)[None, :, None], mask, jnp.eye(t_max, dtype=bool)[None])
        with routed_rows_masked(live):  # masked slots: no expert, and they see only themselves
            return slice_forward(cfg, kernels, params, h, positions, cache, start, mask)[0]

    def timed(row, what, fn, *a):  # row[what_s], row[what_wall_s], row[what_kernels]; returns the output
        timing = timer(fn, *a)
        row.update({f"{what}_s": timing.seconds, f"{what}_wall_s": timing.wall_s,
                    f"{what}_kernels": len(timing.kernels) if timer.device else "-"})
        print(f"{what} T={row['T']}: {timing.seconds * 1e6:.0f} us ({row[what + '_kernels']} kernels)", flush=True)
        return timing.out

    # ---- (1) AR step, the switch per budget, the masked tree per live size
    if in_time("AR step"):
        measured["ar"] = {"T": 1}
        timed(measured["ar"], "slice", jax.jit(verify_at(1)), *inputs)
        save()
    def compiled(fn, *a):  # both designs alike: no command buffers (see NO_COMMAND_BUFFERS)
        return jax.jit(fn).lower(*a).compile(compiler_options=NO_COMMAND_BUFFERS if on_gpu else None)

    switch_out = {}
    if in_time("switch"):
        switch = compiled(lambda i, *a: jax.lax.switch(i, [verify_at(1 + b) for b in budgets], *a),
                          jnp.int32(0), *inputs)
        for i, b in enumerate(budgets):
            if in_time(f"switch B={b}"):
                switch_out[b] = timed(points[b], "switch", switch, jnp.int32(i), *inputs)
        save()
    checks = measured.setdefault("checks", [])
    if in_time("masked"):
        masked = compiled(masked_verify, jnp.int32(t_max), *inputs)
        for b in budgets:
            if in_time(f"masked B={b}"):
                out = timed(points[b], "masked", masked, jnp.int32(1 + b), *inputs)
                if b in switch_out:  # the live rows are the same forward either way
                    got, want = (v[0, :1 + b].astype(jnp.float32) for v in (out, switch_out[b]))
                    checks.append({"T": 1 + b, "what": "masked live rows vs switch",
                                   "max_rel_err": float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))})
        save()

    # ---- the lm_head and the attention core per T (the extrapolation's, and the attention comparison)
    head = jax.jit(lambda x, w: linear(x, w, kernels).astype(jnp.float32))
    attend = jax.jit(lambda q, cache, start, mask: kattention.mla_attention(
        q, cache, start, mask, scale=cfg.softmax_scale, value_dim=c, kernels=kernels))
    q = jax.random.normal(jax.random.key(3), (1, t_max, cfg.num_attention_heads, c + r), jnp.bfloat16)
    for row in [measured.get("ar")] + [points[b] for b in budgets]:
        if row is None or not in_time(f"head/attention T={row['T']}"):
            continue
        t = row["T"]
        row["head_s"] = timer(head, h[0, :t], params["lm_head"]).seconds
        row["attention_s"] = timer(attend, q[:, :t], cache, start, mask[:, :t, :t]).seconds
        row["attention_kernel"] = attention_kernel(cfg, kernels.attention, q[:, :t], cache)
        print(f"T={t}: head {row['head_s'] * 1e6:.0f} us, attention {row['attention_s'] * 1e6:.1f} us", flush=True)
    save()

    # ---- tree build (+ choose for auto) per round, on a synthetic draft of the headline profile
    logits, _, _ = synthetic_draft(jax.random.key(4), 1, cfg.vocab_size, Profile(*HEADLINE, depth).offset(),
                                   1.0, depth)
    for b in budgets:
        if in_time(f"build B={b}"):
            points[b]["build_s"] = timer(jax.jit(lambda lg, b=b: kj.build_tree(lg, b, kernels=kernels)),
                                         logits).seconds
    if in_time("build auto"):
        unit = kj.BudgetCosts(budgets, (1.0,) * len(budgets))  # choose's work does not depend on the values

        def build_and_choose(lg):
            tree = kj.build_tree(lg, max(budgets), kernels=kernels)
            return tree, budget_choose(tree.scores, unit)

        measured["build_auto_s"] = timer(jax.jit(build_and_choose), logits).seconds
    save()

    # ---- routed MoE: at T = 1 + b, and masked at T_max with 1 + b live slots
    p0 = params["layers_0"]
    x = rms_norm(h[0], p0["post_attn_norm"], cfg.rms_norm_eps)  # [T_max, D]: what the layer's MoE sees
    idx, w = kmodel.route(cfg, x, p0["moe"]["router"], p0["moe"]["router_bias"])
    experts = p0["moe"]["experts"]
    routed = jax.jit(kmodel.routed_experts, static_argnums=4)
    routed_masked = jax.jit(lambda x, e, i, w, live: kmodel.routed_experts(x, e, i, masked_weights(w, live), kernels))
    for b in budgets:
        if not in_time(f"moe B={b}"):
            continue
        t = 1 + b
        points[b]["touched"] = int(jnp.unique(idx[:t]).size)
        points[b]["moe_s"] = timer(routed, x[:t], experts, idx[:t], w[:t], kernels).seconds
        points[b]["moe_masked_s"] = timer(routed_masked, x, experts, idx, w, jnp.int32(t)).seconds
        print(f"MoE T={t} ({points[b]['touched']} experts): {points[b]['moe_s'] * 1e6:.0f} us; masked in "
              f"{t_max}: {points[b]['moe_masked_s'] * 1e6:.0f} us", flush=True)
    save()

    # ---- (2b) auto's choices with the measured round costs, on the device
    costs = round_costs(meta, measured)
    for sim, prof in zip(sims, [p for p in profiles if p in scores_of], strict=True):
        if costs is None:
            break
        lengths = lengths_of[prof]  # [R, len(budgets)]
        fixed = sorted(costs["fixed"])
        fixed_lengths = lengths[:, [budgets.index(b) for b in fixed]]
        for design, bc in costs["auto"].items():
            chosen = np.asarray(auto_choices(scores_of[prof], bc))  # [R] into bc.budgets
            picked = np.asarray(bc.budgets)[chosen]
            took = lengths[np.arange(len(chosen)), [budgets.index(b) for b in picked]]
            sim[f"auto_{design}"] = {
                "counts": {str(b): int((picked == b).sum()) for b in bc.budgets}, "accepted": float(took.mean()),
                "ci95_vs_best_fixed": bootstrap_ratio(took, np.asarray(bc.costs)[chosen], fixed_lengths,
                                                      np.asarray([costs["fixed"][b] for b in fixed]))}
    meta["total_s"] = time.time() - t_start
    write(stem, meta, {"measured": measured, "profiles": sims})
    print(f"done in {meta['total_s']:.0f} s", flush=True)


def bootstrap_ratio(auto_took, auto_cost, fixed_lengths, fixed_cost, resamples: int = 400):
    """95% interval (bootstrap over rounds) of auto's modelled tokens/s over the best fixed budget's (picked
    on the whole sample): auto_took / auto_cost [R] per round, fixed_lengths [R, nf] / fixed_cost [nf]."""
    rng = np.random.default_rng(0)
    best = int(np.argmax(fixed_lengths.mean(0) / fixed_cost))
    ratios = []
    for _ in range(resamples):
        pick = rng.integers(0, len(auto_took), len(auto_took))
        auto = auto_took[pick].sum() / auto_cost[pick].sum()
        ratios.append(auto / (fixed_lengths[pick, best].mean() / fixed_cost[best]))
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


# ------------------------------------------------------------------------------------------ summary
def round_costs(meta, measured):
    """The 61-layer round costs (seconds) from the measured slice: {"ar": AR step, "verify": {design:
    {budget: verify}}, "fixed": {budget: round}, "auto": {design: BudgetCosts}}; None before any budget has
    its switch, head, attention and build measured."""
    import kdtree_jax as kj
    from benchmarks.bench_k26_slice import extrapolated_verify, full_config
    from benchmarks.cost_model import MEASURED_H200, CostModel

    ar = measured.get("ar", {})
    if not {"slice_s", "head_s", "attention_s"} <= set(ar) or "build_auto_s" not in measured:
        return None
    # the one dense layer: modelled around the measured attention with the committed slice run's rest overhead
    model = CostModel.from_config(full_config(meta["tiny"]), bandwidth=meta["copy_TBps"] * 1e12,
                                  rest_overhead=MEASURED_H200["rest_overhead"])
    s, layers, draft = meta["S"], meta["layers"], meta["draft_ms"] * 1e-3
    by = {p["budget"]: p for p in measured["points"]}
    top = by[max(by)]  # the masked tree's size: its attention and lm_head
    out = {"ar": extrapolated_verify(model, 1, s, ar["slice_s"] / layers, ar["attention_s"], ar["head_s"]),
           "verify": {"switch": {}, "masked": {}}, "fixed": {}, "auto": {}}
    for b, p in sorted(by.items()):
        if {"switch_s", "head_s", "attention_s", "build_s"} <= set(p):
            out["verify"]["switch"][b] = extrapolated_verify(model, p["T"], s, p["switch_s"] / layers,
                                                             p["attention_s"], p["head_s"])
            out["fixed"][b] = draft + p["build_s"] + out["verify"]["switch"][b]
        if "masked_s" in p and {"head_s", "attention_s"} <= set(top):
            out["verify"]["masked"][b] = extrapolated_verify(model, top["T"], s, p["masked_s"] / layers,
                                                             top["attention_s"], top["head_s"])
    # The switch's own price: its wall clock at the largest budget over the masked jit at full size (the same
    # forward without a conditional); CUPTI's kernel time does not see it.
    if {"switch_wall_s", "masked_wall_s"} <= set(top):
        out["switch_overhead_s"] = max(0.0, top["switch_wall_s"] - top["masked_wall_s"])
    overhead = out.get("switch_overhead_s", 0.0)
    for design, extra in (("switch", overhead), ("masked", 0.0)):
        verify = out["verify"][design]
        if verify and max(verify) == max(by):  # auto builds at the largest budget: it needs that one
            cands = tuple(sorted(verify))
            out["auto"][design] = kj.BudgetCosts(cands, tuple(draft + measured["build_auto_s"] + verify[b] + extra
                                                              for b in cands), source=f"k26 slice, {design}")
    return out


def policy_rows(sim, costs):
    """[(policy, mean budget, tokens per round, round s, tokens/s)] for one profile: AR, every fixed budget,
    auto with each verify design."""
    rows = [("AR", 0.0, 1.0, costs["ar"], 1 / costs["ar"])]
    for b, rnd in costs["fixed"].items():
        tau = sim["acceptance"][str(b)]
        rows.append((f"fixed {b}", float(b), tau, rnd, tau / rnd))
    for design, bc in costs["auto"].items():
        auto = sim.get(f"auto_{design}")
        if auto is None:
            continue
        counts = np.asarray([auto["counts"][str(b)] for b in bc.budgets], float)
        rnd = float(counts @ np.asarray(bc.costs) / counts.sum())
        rows.append((f"auto ({design})", float(counts @ np.asarray(bc.budgets) / counts.sum()), auto["accepted"],
                     rnd, auto["accepted"] / rnd))
    return rows


def against_best_fixed(sim, costs) -> str:
    """One line: each auto design's modelled tokens/s over the best fixed budget's, with its interval."""
    rows = policy_rows(sim, costs)
    best = max((row for row in rows if row[0].startswith("fixed")), key=lambda row: row[4])
    said = []
    for design in costs["auto"]:
        auto = sim.get(f"auto_{design}")
        if auto is None:
            continue
        row = next(row for row in rows if row[0] == f"auto ({design})")
        lo, hi = auto["ci95_vs_best_fixed"]
        verdict = ("above every fixed budget" if lo > 1 else "below the best fixed budget" if hi < 1
                   else "not distinguishable from the best fixed budget")
        said.append(f"{row[0]} {row[4] / best[4]:.3f}x (95% interval {lo:.3f}-{hi:.3f}): {verdict}")
    return f"- {sim['name']}, against the best fixed budget ({best[0]}): " + "; ".join(said) + "."


def summarize(meta, data):
    """Markdown: what the tables say (ratios computed, no reading added), masked vs switch per live size,
    then per profile the budgets auto picks and the modelled tokens/s of every policy."""
    from benchmarks.bench_k26_slice import attention_ran

    measured, sims = data["measured"], data["profiles"]
    costs = round_costs(meta, measured)
    us = lambda v: "-" if v is None else f"{v * 1e6:.1f}"  # noqa: E731
    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
    note = "" if not meta["tiny"] else "\n**CPU smoke run at tiny width: these numbers are NOT measurements.**\n"
    pts, layers = measured["points"], meta["layers"]
    top, t_max = pts[-1], pts[-1]["T"]
    verify = costs["verify"] if costs else {"switch": {}, "masked": {}}
    ran = attention_ran([measured.get("ar") or {}, *pts], lambda p: f"T={p['T']}")
    attention = f" (attention ran {ran})" if ran else ""
    md = [f"# tree_budget=\"auto\" at K2.6 width ({meta['device']}, JAX {meta['jax']}, {meta['date']})", note,
          f"{meta['timing']}; {layers} MoE layers of the K2.6 slice (benchmarks/bench_k26_slice.py) at "
          f"S = {meta['S']}; kernels: {meta.get('kernels', '-')}{attention}. Verify = the 61-layer extrapolation of "
          f"the slice (one-H200-equivalent: the 61 INT4 layers do not fit one H200); round = verify + draft "
          f"{meta['draft_ms']:g} ms (modelled) + tree build (measured): fixed budget b builds at b and runs "
          "the switch's branch b (CUPTI kernel time, to which the conditional adds no kernels); auto (switch) "
          "builds at the largest budget, runs budget.choose and the chosen branch, plus the switch's own "
          "overhead; auto (masked) the same build and choose, then the masked verify at the chosen live size. "
          "AR: one T = 1 verify per token.", ""]
    if meta.get("skipped"):
        md += [f"**Deadline: skipped {', '.join(meta['skipped'])}.**", ""]
    span = lambda vals: "-" if not vals else f"{min(vals):.2f}-{max(vals):.2f}x"  # noqa: E731
    md += ["## In short (ratios from the tables below)", "",
           f"- Routed MoE, masked at T = {t_max} over unmasked at the live T: "
           + span([p["moe_masked_s"] / p["moe_s"] for p in pts if {"moe_s", "moe_masked_s"} <= set(p)])
           + "; MoE at the live T from the smallest to the largest: "
           + " -> ".join(us(p["moe_s"]) for p in pts if "moe_s" in p) + " us.",
           "- 61-layer verify, masked over switch: "
           + ", ".join(f"T={p['T']} {ratio(verify['masked'].get(p['budget']), verify['switch'].get(p['budget']))}x"
                       for p in pts) + "."]
    if costs:
        md += [against_best_fixed(sim, costs) for sim in sims]
    md += ["", f"## Masked static tree (T_max = {t_max}) or one verify per budget (lax.switch)", "",
           "Per layer (us): the slice forward / layers; MoE and attention alone. Masked: slots past the live "
           "count route to no expert (weight 0) and see only themselves.", "",
           "| budget | live T | touched | switch layer | masked layer | masked / switch | MoE at T | MoE masked | "
           f"masked / at T | attention at T | attention at {t_max} | verify ms switch | verify ms masked | "
           "kernels switch / masked |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pts:
        b = p["budget"]
        switch_l, masked_l = (p[k] / layers if k in p else None for k in ("switch_s", "masked_s"))
        md.append(f"| {b} | {p['T']} | {p.get('touched', '-')} | {us(switch_l)} | {us(masked_l)} | "
                  f"{ratio(masked_l, switch_l)} | {us(p.get('moe_s'))} | {us(p.get('moe_masked_s'))} | "
                  f"{ratio(p.get('moe_masked_s'), p.get('moe_s'))} | {us(p.get('attention_s'))} | "
                  f"{us(top.get('attention_s'))} | {ms(verify['switch'].get(b))} | {ms(verify['masked'].get(b))} | "
                  f"{p.get('switch_kernels', '-')} / {p.get('masked_kernels', '-')} |")
    if costs:
        md += ["", f"AR step (T = 1, 61 layers): {ms(costs['ar'])} ms. Switch overhead (wall clock, switch at the "
               f"largest budget over the masked jit at full size): {us(costs.get('switch_overhead_s'))} us per "
               "verify, added to auto (switch)'s rounds."]
    if measured.get("checks"):
        md += ["", "Checks (the masked tree's live rows against the switch's forward of the same tree): " + "; ".join(
            f"T={c['T']} {c['max_rel_err']:.1e}" for c in measured["checks"]) + "."]
    if costs is None:
        md += ["", "(No round costs: the measurements needed for them did not finish.)"]
        return "\n".join(md) + "\n"
    for sim in sims:
        rows = policy_rows(sim, costs)
        ar = rows[0][4]
        best = max((row for row in rows if row[0].startswith("fixed")), key=lambda row: row[4])
        md += ["", f"## Profile: {sim['name']} (simulated chain acceptance {sim['chain_sim']:.2f}, "
               f"{sim['rounds']} rounds)", "",
               "| policy | mean budget | tokens / round | round ms | tokens/s | x AR | x best fixed |",
               "|---|---|---|---|---|---|---|"]
        for name, mean_b, tau, rnd, tps in rows:
            md.append(f"| {name} | {mean_b:.1f} | {tau:.2f} | {rnd * 1e3:.2f} | {tps:.1f} | {tps / ar:.2f} | "
                      f"{tps / best[4]:.3f} |")
        for design in costs["auto"]:
            auto = sim.get(f"auto_{design}")
            if auto is None:
                continue
            picks = ", ".join(f"{b}: {100 * n / sim['rounds']:.0f}%" for b, n in auto["counts"].items() if n)
            lo, hi = auto["ci95_vs_best_fixed"]
            md.append(f"\nauto ({design}) picks (share of rounds): {picks}; tokens/s over the best fixed budget "
                      f"({best[0]}): 95% bootstrap interval {lo:.3f}-{hi:.3f}.")
        md.append("\nE(n) = 1 + sum exp(score) against the tokens committed, per budget: "
                  + ", ".join(f"B={b} {e:.2f} / {sim['acceptance'][str(b)]:.2f}"
                              for b, e in zip(meta["budgets"], sim["expected"], strict=True)) + ".")
    return "\n".join(md) + "\n"


def write(stem, meta, data):
    from benchmarks.common import write_results

    markdown = summarize(meta, data)
    write_results(stem, meta, data, markdown, plot=lambda path: plot(meta, data, path))
    print(markdown)


def resummarize(path):
    """Rebuild the markdown and plot of a stored result with the current summary code (CPU is fine)."""
    import json

    with open(path) as f:
        stored = json.load(f)
    write(os.path.splitext(path)[0], stored.pop("meta"), stored)


def plot(meta, data, path):
    """Per-layer time against the live tree (switch, masked, their MoE and attention), auto's budget picks
    per profile, and the modelled speedup of every policy at the headline profile."""
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports] (the bench extra)

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    pts, layers = data["measured"]["points"], meta["layers"]
    ax = axes[0]
    for key, label, scale in (("switch_s", "switch: layer", layers), ("masked_s", "masked: layer", layers),
                              ("moe_s", "MoE at T", 1), ("moe_masked_s", "MoE masked", 1),
                              ("attention_s", "attention at T", 1)):
        got = [(p["T"], p[key] / scale * 1e6) for p in pts if key in p]
        if got:
            ax.plot(*zip(*got, strict=True), "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("live tree T = 1 + budget")
    ax.set_ylabel("us per layer")
    ax.set_title(f"inside one max tree of {1 + max(meta['budgets'])}")
    ax.legend(fontsize=8)
    costs = round_costs(meta, data["measured"])
    sims = data["profiles"]
    ax = axes[1]
    width = 0.8 / max(len(sims), 1)
    for k, sim in enumerate(sims):
        counts = sim.get("auto_switch", {}).get("counts", {})
        bs = sorted(int(b) for b in counts)
        ax.bar(np.arange(len(bs)) + k * width, [counts[str(b)] / sim["rounds"] for b in bs], width, label=sim["name"])
        ax.set_xticks(np.arange(len(bs)) + width * (len(sims) - 1) / 2, [str(b) for b in bs])
    ax.set_xlabel("budget auto (switch) picks")
    ax.set_ylabel("share of rounds")
    ax.legend(fontsize=7)
    ax = axes[2]
    headline = [sim for sim in sims if (sim["target"], sim["overconfidence"]) == HEADLINE] or sims[:1]
    if costs and headline:
        rows = policy_rows(headline[0], costs)
        ax.bar([row[0] for row in rows], [row[4] / rows[0][4] for row in rows],
               color=["C2" if row[0].startswith("auto") else "C0" for row in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("modelled tokens/s, x AR")
        ax.set_title(headline[0]["name"])
        ax.tick_params(axis="x", rotation=45)
    if meta["tiny"]:
        fig.suptitle("CPU smoke run at tiny width: NOT measurements")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
