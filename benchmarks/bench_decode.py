"""End-to-end decode benchmark: autoregressive vs DFlash vs DDTree, one device dispatch per generate.

For each model (the tiny preset and a mid-size config) at batch 1:
  * AR as one jitted `generate` call (one dispatch) vs a Python loop of jitted single decode steps;
  * DDTree at several budgets and DFlash with a random drafter (the floor on acceptance) and with the
    drafter that knows the answer (`OracleDraft`, the upper bound on the speedup);
  * time per generate call (wall clock around ONE dispatch, block_until_ready, median of repeats after
    a compile/warm-up call), tokens/s, rounds, time per round, mean acceptance length; every
    speculative output is checked token for token against AR greedy (float32 models at matmul
    precision "highest"; bf16 models can leave the AR path at near-ties, see results/README).

Usage:  python benchmarks/bench_decode.py [--quick] [--out benchmarks/results]
Writes <out>/decode_<platform>.json and .md with the run's metadata (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kdtree_jax as kj  # noqa: E402
from benchmarks.common import Timer, metadata, write_results  # noqa: E402
from kdtree_jax.model import forward_with_cache, init_cache  # noqa: E402

MID = kj.ModelConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024,
    num_hidden_layers=8, first_k_dense_replace=1, n_routed_experts=64, n_shared_experts=1,
    num_experts_per_tok=6, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=50000.0,
    rope_scaling=kj.YarnScaling(32.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    max_position_embeddings=8192, rms_norm_eps=1e-5, routed_scaling_factor=2.827,
    bos_token_id=1, eos_token_id=(2,), mask_token_id=31999,
).validate()


def timed(fn, repeats: int) -> tuple[float, Any]:
    """(median wall seconds of fn(), its output): the wall clock around one generate dispatch."""
    timing = Timer(repeats, device=False)(fn)
    return timing.wall_s, timing.out


def python_loop_decode(cfg, params, prompt, new_tokens):
    """The baseline the one-dispatch design replaces: one jitted step per token, driven from Python."""
    max_len = len(prompt) + new_tokens + 1

    @jax.jit
    def prefill(params, tokens):
        cache = init_cache(cfg, 1, max_len, params["embed_tokens"].dtype)
        positions = jnp.arange(tokens.shape[1])[None]
        logits, _, cache = forward_with_cache(params, cfg, tokens, positions, cache)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache._replace(
            lengths=jnp.array([tokens.shape[1]], jnp.int32))

    @jax.jit
    def step(params, token, cache):
        logits, _, cache = forward_with_cache(params, cfg, token[:, None], cache.lengths[:, None], cache)
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache._replace(lengths=cache.lengths + 1)

    def run():
        token, cache = prefill(params, jnp.asarray([prompt], jnp.int32))
        out = [token]
        for _ in range(new_tokens - 1):
            token, cache = step(params, token, cache)
            out.append(token)
        return jnp.stack(out, 1)

    return run


def bench_model(name, cfg, dtype, budgets, new_tokens, repeats, block_size):
    # float32 models run float32 dots exactly (no TF32) so that the == AR column tests the invariant;
    # bf16 models keep the default (their tree-verify and AR roundings differ anyway).
    jax.config.update("jax_default_matmul_precision", "highest" if dtype == jnp.float32 else None)
    params = kj.init_params(cfg, jax.random.key(0), dtype=dtype)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size - 1, 32)]
    dcfg = kj.DrafterConfig.for_target(cfg, num_layers=1, block_size=block_size)
    dparams = kj.init_drafter_params(dcfg, jax.random.key(1), dtype=dtype)
    rows = []

    def gen(**kw):
        return lambda: kj.generate(cfg, params, [prompt], max_new_tokens=new_tokens, stop_tokens=(), **kw)

    t_ar, ar = timed(gen(method="ar"), repeats)
    reference = np.asarray(ar.tokens)
    rows.append(dict(model=name, method="ar", drafter="-", budget=0, seconds=t_ar, rounds=int(ar.rounds),
                     acceptance=1.0, matches_ar=True))
    t_loop, loop_tokens = timed(python_loop_decode(cfg, params, prompt, new_tokens), max(1, repeats // 2))
    rows.append(dict(model=name, method="ar-python-loop", drafter="-", budget=0, seconds=t_loop,
                     rounds=new_tokens - 1, acceptance=1.0,
                     matches_ar=bool(np.array_equal(np.asarray(loop_tokens), reference))))
    oracle = kj.OracleDraft(jnp.asarray(np.concatenate([[prompt], reference], 1), jnp.int32), block_size,
                            cfg.vocab_size)
    variants = [("dflash", "random", None), ("dflash", "oracle", None)]
    variants += [("ddtree", "random", b) for b in budgets] + [("ddtree", "oracle", budgets[len(budgets) // 2])]
    for method, drafter_name, budget in tqdm(variants, desc=f"{name} speculative", leave=False):
        drafter = (dcfg, dparams) if drafter_name == "random" else oracle
        seconds, out = timed(gen(method=method, drafter=drafter, tree_budget=budget), repeats)
        rounds = int(out.rounds)
        rows.append(dict(model=name, method=method, drafter=drafter_name, budget=budget or block_size - 1,
                         seconds=seconds, rounds=rounds, acceptance=(new_tokens - 1) / max(rounds, 1),
                         matches_ar=bool(np.array_equal(np.asarray(out.tokens), reference))))
    for row in rows:
        row["tokens_per_s"] = new_tokens / row["seconds"]
        row["ms_per_round"] = 1e3 * row["seconds"] / max(row["rounds"], 1)
        row["speedup_vs_ar"] = t_ar / row["seconds"]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only, few tokens (a CPU smoke run)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per call (default 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per variant (median reported)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results folder")
    args = parser.parse_args(argv)
    meta = metadata(batch=1, new_tokens=args.new_tokens)
    models = [("tiny", kj.ModelConfig.tiny(), jnp.float32, [4, 16, 64], 8)]
    if not args.quick:
        models.append(("mid", MID, jnp.bfloat16, [4, 16, 32, 64, 128], 16))
    rows = []
    for name, cfg, dtype, budgets, block in models:
        new_tokens = 16 if args.quick else args.new_tokens
        rows += bench_model(name, cfg, dtype, budgets, new_tokens, 2 if args.quick else args.repeats, block)
        # what generate's default kernels="auto" runs for this model here (abstract params: shapes only)
        abstract = jax.eval_shape(lambda c=cfg, d=dtype: kj.init_params(c, jax.random.key(0), dtype=d))
        meta[f"kernels_{name}"] = kj.plan_summary(kj.kernel_plan(abstract, cfg))
    stem = "decode_" + ("quick_" if args.quick else "") + meta["platform"]
    table = render(meta, rows)
    write_results(args.out / stem, meta, {"rows": rows}, table)
    print(table)


def render(meta, rows) -> str:
    lines = [f"# Decode benchmark ({meta['device']}, JAX {meta['jax']}, {meta['date']})", "",
             f"batch {meta['batch']}, {meta['new_tokens']} new tokens per call, greedy, kernels: "
             f"{meta.get('kernels_tiny', '?')}; wall clock around one generate dispatch (median).", "",
             "| model | method | drafter | budget | ms/call | tokens/s | rounds | ms/round | accept len | "
             "speedup vs AR | == AR |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {r['drafter']} | {r['budget']} | {1e3 * r['seconds']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['rounds']} | {r['ms_per_round']:.3f} | {r['acceptance']:.2f} | "
                     f"{r['speedup_vs_ar']:.2f}x | {'yes' if r['matches_ar'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
