"""Where one DDTree round's time goes, stage by stage, for the shipped pair (or any target + drafter).

  python benchmarks/profile_round.py --out DIR [--budgets 8 32 128]

On a GPU the build stage is the one-launch tree kernel (pallas_kernels.tree_build) and a "(jnp builder)" row
times the XLA builder it replaced. The last rows time the round as it runs inside the one-jit loop: one
`kj.generate` call divided by its rounds (wall, and on a GPU summed kernel time and kernel count per round).

Each stage of a round (kdtree_jax/ddtree.py `_generate`'s loop body) is jitted alone on a real state
(a held-out prompt prefilled) and measured two ways: wall clock per call (median, dispatch included) and,
on one GPU, CUPTI (summed kernel time and the number of kernels launched). The AR step (one cached forward
of one token) is measured the same way. A stage whose wall time far exceeds its kernel time is bound by
launch latency, not by the GPU's work: with a model this small every stage is. Timing:
benchmarks/common.py Timer. Writes DIR/round_profile.json and DIR/round_profile.md with the run's metadata.

`profile_stages` is also what benchmarks/bench_sharded.py runs on a device mesh (random K2.6-width
weights, a random drafter, a synthetic state at a long context from `synthetic_state`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MATMUL_PRECISIONS  # noqa: E402
from kdtree_jax import ASSETS  # noqa: E402
from kdtree_jax.ddtree import DRAFTER_DTYPES  # noqa: E402


def synthetic_state(cfg, params, draft_model, context: int, slack: int, key):
    """A batch-1 decode state at committed context `context` without a prefill: random latent-cache rows
    and drafter keys/values (stage timings do not depend on the values), lengths = context. Returns
    (cache, drafter state, bonus token [1])."""
    import jax
    import jax.numpy as jnp

    from kdtree_jax.model import init_cache

    dtype = params["embed_tokens"].dtype
    max_len = context + slack
    k1, k2, k3, k4 = jax.random.split(key, 4)
    cache = init_cache(cfg, 1, max_len, dtype)
    cache = cache._replace(latent=jax.random.normal(k1, cache.latent.shape, jnp.float32).astype(dtype),
                           lengths=jnp.full((1,), context, jnp.int32))
    dstate = draft_model.init_state(1, max_len, dtype)
    if hasattr(dstate, "keys"):  # a DrafterCache (an OracleDraft's state is a position counter)
        dstate = dstate._replace(keys=jax.random.normal(k2, dstate.keys.shape, jnp.float32).astype(dtype),
                                 values=jax.random.normal(k3, dstate.values.shape, jnp.float32).astype(dtype),
                                 lengths=jnp.full((1,), context, jnp.int32))
    bonus = jax.random.randint(k4, (1,), 3, cfg.vocab_size, jnp.int32)
    return cache, dstate, bonus


def top_kernels(kernels, count: int = 6) -> list[dict]:
    """The `count` kernels (by name) that took the most of a call's summed kernel time: name, launches, us."""
    by_name: dict[str, list] = {}
    for name, seconds in kernels:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:count]
    return [{"name": name[:100], "launches": n, "us": round(s * 1e6, 1)} for name, (n, s) in ranked]


def add_kernel_times(pending: list, iters: int, top: int = 12) -> None:
    """The CUPTI pass: for each (row, fn, args, per) that a wall-clock pass left in `pending`, the median call's
    summed kernel time, its kernel count and where the time goes, each divided by `per` (one GPU only: CUPTI
    sums every device's kernels). It runs after every wall clock of the run because wall-clock times taken
    after a CUPTI window in the same process are inflated (H200, 2026-12-02: a generate call's wall per round
    1.4-1.7x; benchmarks/common.py Timer)."""
    from benchmarks.common import Timer

    timer = Timer(iters, device=True)
    for row, fn, args, per in pending:
        timing = timer(fn, *args)
        count = len(timing.kernels)
        row.update(kernel_us=timing.require_device_s() * 1e6 / per, kernels=count if per == 1 else count / per)
        tops = top_kernels(timing.kernels, top)  # where the time goes (in-loop rows: per round)
        row["top_kernels"] = tops if per == 1 else [
            {**k, "launches": round(k["launches"] / per, 2), "us": round(k["us"] / per, 2)} for k in tops]
        print({k: v for k, v in row.items() if k != "top_kernels"}, flush=True)


def write_hlo(hlo_dir: Path | None, index: int, name: str, fn, *args) -> None:
    """fn's compiled (optimized) HLO as text in hlo_dir (nothing when hlo_dir is None)."""
    if hlo_dir is None:
        return
    hlo_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")
    (hlo_dir / f"{index:02d}_{slug}.hlo.txt").write_text(fn.lower(*args).compile().as_text())


def profile_stages(cfg, params, draft_model, cache, dstate, bonus, budgets, *, iters: int,
                   pending: list | None = None, label: str = "", hlo_dir: Path | None = None,
                   kernels=None) -> list[dict]:
    """Time the AR step and, for DFlash's chain and each DDTree budget, the round's stages (draft once,
    then build / verify / accept + compact + drafter context): wall clock. Call under `jax.set_mesh` for a mesh
    run. With a `pending` list, each stage is appended to it for `add_kernel_times` (CUPTI kernel time and
    counts), to run once every wall clock of the run is taken. With `hlo_dir`, each stage's compiled
    (optimized) HLO is written there as text, to map the profile's fusion names to the ops they hold.
    kernels: the kj.Kernels every forward runs with; params (and the drafter) are folded (kdtree_jax.model.fold_params,
    DFlashDraft.prepared) as `generate` folds them with these kernels, once, outside the timed calls."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import Timer
    from kdtree_jax import sharding
    from kdtree_jax.ddtree import accept_path, compact_cache
    from kdtree_jax.model import KVCache, fold_params, forward_with_cache
    from kdtree_jax.tree import build_chain, build_tree
    from pallas_kernels.dispatch import Kernels, as_kernels

    kernels = as_kernels(kernels)
    params = jax.jit(lambda p: fold_params(p, cfg, kernels, sharded=sharding.active_mesh() is not None))(params)
    # the drafter's joined matrices (in its compute dtype, with the tables it shares), as generate has them
    draft_model = jax.jit(lambda d, p: d.prepared(cfg, p))(draft_model, params)
    timer = Timer(iters, device=False)
    depth = draft_model.block_size - 1
    layers = draft_model.hidden_layers
    rows = []

    def measure(name, fn, *a):
        timing = timer(fn, *a)
        row = {"stage": name, "wall_us": timing.wall_s * 1e6}
        if label:
            row["setting"] = label
        if pending is not None:
            pending.append((row, fn, a, 1))
        write_hlo(hlo_dir, len(rows), name, fn, *a)
        print(row, flush=True)
        rows.append(row)
        return timing.out

    ar = jax.jit(lambda p, b, c: forward_with_cache(p, cfg, b[:, None], c.lengths[:, None], c, kernels=kernels)[0])
    measure("AR step (1-token cached forward)", ar, params, bonus, cache)
    draft = jax.jit(lambda dm, s, p, b, st: dm.draft(s, cfg, p, b, st))
    logits = measure(f"draft (drafter forward, block of {draft_model.block_size})", draft, draft_model, dstate,
                     params, bonus, cache.lengths)

    def verify_fn(p, tree, c):
        pos = c.lengths[:, None] + tree.depths
        return forward_with_cache(p, cfg, tree.tokens, pos, c, visibility=tree.visible, hidden_layers=layers,
                                  kernels=kernels)

    def finish_fn(dm, s, tree, logits, hidden, c):
        posterior = jnp.argmax(logits, -1).astype(jnp.int32)
        path, length, nb = accept_path(tree, posterior, depth)
        latent = compact_cache(c.latent, c.lengths, path)
        path_hidden = jnp.take_along_axis(hidden, path[:, :, None, None], axis=1)
        path_pos = c.lengths[:, None] + jnp.arange(depth + 1, dtype=jnp.int32)[None]
        return KVCache(latent, c.lengths + length), dm.extend(s, path_hidden, path_pos, length), nb

    for name, build in [("dflash chain", lambda lg, b: build_chain(lg, root_tokens=b))] + [
            (f"ddtree budget {b}", lambda lg, bn, b=b: build_tree(lg, b, root_tokens=bn, kernels=kernels))
            for b in budgets]:
        tree = measure(f"{name}: build", jax.jit(build), logits, bonus)
        if name.startswith("ddtree"):  # the jnp builder, for comparison (what the kernel replaced on a GPU)
            b = tree.tokens.shape[1] - 1
            measure(f"{name}: build (jnp builder)",
                    jax.jit(lambda lg, bn, b=b: build_tree(lg, b, root_tokens=bn, kernels=Kernels(tree="xla"))),
                    logits, bonus)
        vlogits, hidden, vcache = measure(f"{name}: verify (T={tree.tokens.shape[1]})", jax.jit(verify_fn),
                                          params, tree, cache)
        measure(f"{name}: accept + compact + drafter context", jax.jit(finish_fn), draft_model, dstate, tree,
                vlogits, hidden, vcache)
    return rows


def profile_in_loop(cfg, params, drafter, prompts, budgets, *, max_new_tokens: int, iters: int,
                    pending: list | None = None, kernels=None, hlo_dir: Path | None = None,
                    first_index: int = 0) -> list[dict]:
    """The round as it runs: per method, one `kj.generate` call (the one-jit loop) per prompt at batch 1, the
    summed wall time (each prompt's median of `iters` calls after a warm-up) over the summed rounds (target
    forwards after the prefill; an AR step is a round of one token), and whether every prompt's tokens equal
    AR's (the greedy invariant; `drafter` methods only). With `pending`, the first prompt's call is left for
    `add_kernel_times` (summed kernel time, kernel count and the top kernels, per round). With `hlo_dir`, each
    method's whole compiled generate program (the loop) is written there, numbered from first_index."""
    import jax
    import numpy as np

    import kdtree_jax as kj
    from benchmarks.common import Timer

    timer = Timer(iters, device=False)
    rows, ar_outputs = [], []
    methods = [("ar", None), ("dflash", None)] + [("ddtree", b) for b in budgets]
    for method, budget in methods:
        extra: dict[str, Any] = ({"kernels": kernels} if method == "ar"
                                 else {"drafter": drafter, "method": method, "kernels": kernels})
        if budget is not None:
            extra["tree_budget"] = budget

        def run(p, prompt, extra=extra):
            return kj.generate(cfg, p, [prompt], max_new_tokens=max_new_tokens, stop_tokens=(), **extra)

        def rounds_of(out, method=method):
            return int(out.rounds) if method != "ar" else int(out.num_target_forwards) - 1

        wall, rounds, first_rounds, outputs = 0.0, 0, 0, []
        for prompt in prompts:
            timing = timer(run, params, prompt)
            wall += timing.wall_s
            rounds += rounds_of(timing.out)
            first_rounds = first_rounds or rounds
            outputs.append(np.asarray(timing.out.tokens)[0])
        if method == "ar":
            ar_outputs = outputs
        name = "AR step" if method == "ar" else f"{method}{'' if budget is None else f' budget {budget}'} round"
        row = {"stage": f"in the loop: {name}", "method": method, "budget": budget, "rounds": rounds,
               "prompts": len(prompts), "tokens": max_new_tokens * len(prompts), "wall_us": wall * 1e6 / rounds,
               "greedy_equals_ar": all(np.array_equal(a, b) for a, b in zip(outputs, ar_outputs, strict=True))}
        # CUPTI's measure jits the call: the params go in as arguments (as the wall-clock pass passes them; closed
        # over they would be constants, another program), the prompt stays closed over (generate takes Python ints)
        whole = jax.jit(lambda p, run=run, prompt=prompts[0]: run(p, prompt))
        if pending is not None:
            pending.append((row, whole, (params,), first_rounds))
        write_hlo(hlo_dir, first_index + len(rows), row["stage"], whole, params)
        print(row, flush=True)
        rows.append(row)
    ar_wall = rows[0]["wall_us"]
    for row in rows:
        row["ar_steps"] = row["wall_us"] / ar_wall
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--target", type=Path, default=ASSETS / "target", help="target checkpoint")
    ap.add_argument("--drafter", type=Path, default=ASSETS / "drafter", help="drafter checkpoint")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights cast to this dtype after loading, as bench_e2e.py (default %(default)s)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 32, 128], help="DDTree budgets to profile")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per stage (median reported)")
    ap.add_argument("--loop-tokens", type=int, default=128, help="tokens generated per call for the in-loop rows")
    ap.add_argument("--loop-prompts", type=int, default=4, help="held-out prompts (batch 1, one call each) the "
                    "in-loop rows average over")
    ap.add_argument("--no-loop", action="store_true", help="the stages only, without the in-the-loop rows")
    ap.add_argument("--top-kernels", type=int, default=12, help="kernels (by name) kept per stage in the JSON, "
                    "the most expensive first (default %(default)s)")
    ap.add_argument("--hlo-dir", type=Path, default=None, help="also write each stage's and each in-loop "
                    "method's compiled HLO text here")
    ap.add_argument("--moe", choices=("auto", "triton", "xla"), default="auto",
                    help="the routed experts' implementation (kj.Kernels(moe=...)); auto: what the dispatcher picks")
    ap.add_argument("--drafter-dtype", choices=DRAFTER_DTYPES, default=None,
                    help="the dtype the drafter computes in (kj.DFlashDraft compute_dtype; default: the target's)")
    ap.add_argument("--moe-xla-form", choices=("auto", "gather", "dense", "loop"), default="auto",
                    help="where the routed experts run XLA, its form (pallas_kernels/moe_w4a16/reference.py: "
                         "set_xla_form); auto: the rule of xla_form_for")
    ap.add_argument("--mla", choices=("auto", "folded", "separate"), default="auto",
                    help="the cached MLA's projections (kj.Kernels(mla=...)); auto: what the dispatcher picks")
    ap.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest",
                    help="jax_default_matmul_precision of the float32 model (benchmarks.common.MATMUL_PRECISIONS; "
                         "default %(default)s, how the engine runs float32)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import kdtree_jax as kj
    from benchmarks.common import metadata, set_matmul_precision, shown_path, write_results
    from kdtree_jax.ddtree import as_draft_model
    from kdtree_jax.decoding import prefill
    from kdtree_jax.model import init_cache
    from pallas_kernels.moe_w4a16.reference import set_xla_form
    from training.prompts import load_prompts

    set_matmul_precision(args.matmul_precision)
    set_xla_form(args.moe_xla_form)
    cfg, params = kj.load_checkpoint(args.target, expect_kind="target", dtype=args.dtype)
    dcfg, dparams = kj.load_checkpoint(args.drafter, expect_kind="drafter", dtype=args.dtype)
    drafter = kj.DFlashDraft(dcfg, dparams, compute_dtype=args.drafter_dtype)
    draft_model = as_draft_model(cfg, drafter)
    loop_prompts = load_prompts(max(1, args.loop_prompts), 64)  # the shipped held-out prompts: the same everywhere
    prompt = loop_prompts[0]
    tokens = jnp.asarray([prompt], jnp.int32)
    lengths = jnp.asarray([len(prompt)], jnp.int32)
    max_len = len(prompt) + 64 + max(args.budgets) + 1
    layers = tuple(dcfg.target_layer_ids)

    @jax.jit
    def setup(params, dparams_model, tokens, lengths):  # the real state after a held-out prompt
        cache = init_cache(cfg, 1, max_len, params["embed_tokens"].dtype)
        logits, hidden, cache = prefill(params, cfg, tokens, lengths, cache, layers)
        state = dparams_model.init_state(1, max_len, params["embed_tokens"].dtype)
        pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        state = dparams_model.extend(state, hidden, pos, lengths)
        return cache, state, jnp.argmax(logits, -1).astype(jnp.int32)

    cache, dstate, bonus = setup(params, draft_model, tokens, lengths)
    kernels = kj.Kernels(moe=args.moe, mla=args.mla)
    pending = [] if jax.default_backend() == "gpu" else None  # the CUPTI pass, after every wall clock
    rows = profile_stages(cfg, params, draft_model, cache, dstate, bonus, args.budgets, iters=args.iters,
                          pending=pending, hlo_dir=args.hlo_dir, kernels=kernels)
    if not args.no_loop:
        rows += profile_in_loop(cfg, params, drafter, loop_prompts, args.budgets,
                                max_new_tokens=args.loop_tokens, iters=max(3, args.iters // 4), pending=pending,
                                kernels=kernels, hlo_dir=args.hlo_dir, first_index=len(rows))
    if pending is not None:
        add_kernel_times(pending, args.iters, args.top_kernels)

    plan = kj.kernel_plan(params, cfg, kernels=kernels)
    meta = metadata(target=shown_path(args.target), drafter=shown_path(args.drafter), prompt_tokens=len(prompt),
                    matmul_precision=args.matmul_precision, moe_xla_form=args.moe_xla_form,
                    drafter_dtype=args.drafter_dtype or args.dtype,
                    kernels={op: list(choice) for op, choice in plan.items()},
                    timing="wall: median per jitted call incl. dispatch, every wall clock taken before the first "
                           "CUPTI window; kernel: CUPTI summed kernel time of the median call; in-the-loop rows: "
                           f"generate calls of {args.loop_prompts} prompt(s) at batch 1, summed wall over summed "
                           "rounds (kernel time and count: the first prompt's call over its rounds)",
                    wall_after_cupti=False)
    meta["loop_tokens"] = args.loop_tokens
    table = markdown(meta, rows)
    write_results(args.out / "round_profile", meta, {"rows": rows}, table)
    print(table)


def markdown(meta: dict, rows: list[dict]) -> str:
    """round_profile.md from a run's metadata and rows (what round_profile.json holds: `python -c` over it
    rebuilds the table)."""
    plan = meta["kernels"]
    lines = [f"# One DDTree round, stage by stage ({meta['device']})", "", f"{meta['date']}, JAX {meta['jax']}; "
             f"{meta['timing']}; each stage jitted alone, so each pays one dispatch that the one-jit loop does "
             f"not. The last rows are the round as run: generate calls of {meta.get('loop_tokens', 128)} tokens over "
             f"their rounds (AR steps = wall per round / wall per AR step). Float32 matmul precision "
             f"{meta['matmul_precision']}; the routed experts' XLA form {meta.get('moe_xla_form', 'auto')}"
             + (f"; the drafter computes in {meta['drafter_dtype']}" if "drafter_dtype" in meta else "") + ". "
             f"XLA_FLAGS: `{meta['xla_flags'] or 'none'}`. "
             f"Kernels: {'; '.join(f'{op} {impl} ({why})' for op, (impl, why) in plan.items())}.", "",
             "| stage | wall us | kernel us | kernels | AR steps |", "|---|---|---|---|---|"]
    for r in rows:
        kernels = r.get("kernels", "-")
        kernels = f"{kernels:.1f}" if isinstance(kernels, float) else kernels
        steps = f"{r['ar_steps']:.2f}" if "ar_steps" in r else ""
        lines.append(f"| {r['stage']} | {r['wall_us']:.1f} | {r.get('kernel_us', float('nan')):.1f} | {kernels} | "
                     f"{steps} |")
    tops = [r for r in rows if r.get("top_kernels")]
    if tops:
        lines += ["", "Where the kernel time goes (the most expensive kernels of each stage's median call):", "",
                  "| stage | kernel | launches | us |", "|---|---|---|---|"]
        lines += [f"| {r['stage']} | `{k['name']}` | {k['launches']} | {k['us']:.1f} |" for r in tops
                  for k in r["top_kernels"][:4]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
