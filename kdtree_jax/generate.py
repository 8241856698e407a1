"""Generation: the public entry point for every method, and autoregressive decoding in one jitted program.

`generate` checks its arguments and runs AR here or DDTree / DFlash in kdtree_jax.ddtree; the decode loop
of each method is one `lax.while_loop` inside one `jax.jit`, so a whole generate call is a single device
dispatch. The pieces every method shares (sampling, prefill, ...) live in kdtree_jax.decoding.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import sharding
from kdtree_jax.budget import BudgetCosts, default_costs
from kdtree_jax.config import ModelConfig
from kdtree_jax.ddtree import generate_speculative
from kdtree_jax.decoding import (
    GenerateOutput,
    SamplingParams,
    cache_length,
    check_key,
    check_sampling,
    emit,
    is_int,
    mask_first_logits,
    on_mesh,
    prefill,
    prepare_first_token_mask,
    prepare_prompts,
    resolve_stop_tokens,
    sample,
)
from kdtree_jax.model import KVCache, Params, fold_params, forward_with_cache, init_cache
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels, as_kernels

METHODS = ("ar", "dflash", "ddtree")




# ------------------------------------------------------------------------------------ autoregressive
class _ARState(NamedTuple):
    out: jax.Array  # [B, N]
    count: jax.Array  # [B]
    done: jax.Array  # [B]
    last: jax.Array  # [B] the last emitted token, not yet in the cache
    cache: KVCache
    key: jax.Array
    rounds: jax.Array  # []
    accepted: jax.Array  # [B, N]


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "max_len", "sampling", "stop_tokens",
                                             "kernels"))
def _generate_ar(params, prompt_tokens, prompt_lengths, key, first_token_mask, *, cfg, max_new_tokens, max_len,
                 sampling, stop_tokens, kernels=None):
    batch = prompt_tokens.shape[0]
    params = fold_params(params, cfg, kernels, sharded=sharding.active_mesh() is not None)  # once, before the loop
    cache = init_cache(cfg, batch, max_len, params["embed_tokens"].dtype)
    last_logits, _, cache = prefill(params, cfg, prompt_tokens, prompt_lengths, cache, kernels=kernels)
    key, sub = jax.random.split(key)
    first = sample(mask_first_logits(last_logits, first_token_mask), sub, sampling)
    out = jnp.zeros((batch, max_new_tokens), jnp.int32)
    count = jnp.zeros((batch,), jnp.int32)
    done = jnp.zeros((batch,), bool)
    out, count, done, _ = emit(out, count, done, first[:, None], jnp.ones((batch,), jnp.int32), stop_tokens)
    state = _ARState(out, count, done, first, cache, key, jnp.int32(0),
                     jnp.zeros((batch, max_new_tokens), jnp.int32))

    def body(s: _ARState) -> _ARState:
        positions = s.cache.lengths[:, None]
        logits, _, cache = forward_with_cache(params, cfg, s.last[:, None], positions, s.cache, kernels=kernels)
        cache = cache._replace(lengths=cache.lengths + (~s.done).astype(jnp.int32))
        key, sub = jax.random.split(s.key)
        token = sample(logits[:, 0], sub, sampling)
        out, count, done, took = emit(s.out, s.count, s.done, token[:, None],
                                      jnp.ones((batch,), jnp.int32), stop_tokens)
        accepted = s.accepted.at[:, s.rounds].set(took)
        return _ARState(out, count, done, token, cache, key, s.rounds + 1, accepted)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return GenerateOutput(tokens=state.out, lengths=state.count, num_target_forwards=state.rounds + 1,
                          rounds=state.rounds, acceptance_lengths=state.accepted)


# -------------------------------------------------------------------------------------------- public
def generate(cfg: ModelConfig, params: Params, prompts, max_new_tokens: int = 64, method: str = "ar",
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             key: jax.Array | None = None, stop_tokens: Sequence[int] | None = None, drafter=None,
             tree_budget: int | str | None = None, max_len: int | None = None, mesh=None,
             kernels: Kernels | None = None, budget_costs: BudgetCosts | None = None,
             first_token_mask=None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per prompt with one device dispatch.

    prompts: a list of token-id lists (ragged) or an int array [B, P]. method: "ar" (autoregressive),
    "dflash" (single-path speculative) or "ddtree" (tree speculative; needs `drafter=(dcfg, dparams)`, or
    kj.DFlashDraft(dcfg, dparams, compute_dtype="bfloat16") for a drafter computing in another dtype than the
    target, and `tree_budget`: an int, or "auto" to choose each round's budget on device from the drafter's scores
    and `budget_costs`, a kj.BudgetCosts, default the measured kdtree_jax.budget.default_costs). temperature
    0 is greedy; any finite temperature > 0 samples (a tiny one gives the argmax: decoding.sampling_logits)
    with optional top_k / top_p and an explicit PRNG `key` (jax.random.key(seed), required). stop_tokens
    default to cfg.eos_token_id. max_len: cache rows (default: what the call needs, rounded up to 64). mesh: a jax
    Mesh or a spec like "expert=2,tensor=1" (kdtree_jax.sharding): the target runs sharded over it (params
    not yet there are placed on it, drafter and tree replicated); MeshError when the mesh does not divide
    the model. kernels: which kernel each op runs, e.g. kj.Kernels(attention="xla") (default:
    pallas_kernels.dispatch decides; routed experts run the Mosaic GPU kernel only once converted:
    kj.prepare_params). first_token_mask: a bool array [V] (every row) or [B, V]: the first new token of each
    row is drawn only among its True entries (greedy: the best allowed one), for token healing
    (kdtree_jax.healing); the later tokens are unconstrained."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if not isinstance(temperature, (int, float, np.number)) or isinstance(temperature, bool):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    sampling = SamplingParams(float(temperature), top_k, None if top_p is None else float(top_p))
    check_sampling(sampling, cfg.vocab_size)
    sampling = sampling._replace(top_k=None if top_k is None else int(top_k))  # a hashable static arg
    if key is None:
        if not sampling.greedy:
            raise ValueError("sampling (temperature > 0) needs an explicit PRNG key: key=jax.random.key(seed)")
        key = jax.random.key(0)
    check_key(key)
    tokens, lengths = prepare_prompts(cfg, prompts)
    first_mask = prepare_first_token_mask(cfg, first_token_mask, tokens.shape[0])
    stops = resolve_stop_tokens(cfg, stop_tokens)
    kernels = as_kernels(kernels)
    if mesh is not None:
        mesh = sharding.make_mesh(mesh)
        params = sharding.shard_params(cfg, params, mesh)  # checks the mesh divides the model
    if method == "ar":
        if drafter is not None or tree_budget is not None or budget_costs is not None:
            raise ValueError("method='ar' takes no drafter, tree_budget or budget_costs")
        cache_rows = cache_length(cfg, tokens.shape[1], max_new_tokens, 0, max_len)
        with on_mesh(mesh):
            return _generate_ar(params, jnp.asarray(tokens), jnp.asarray(lengths), key, first_mask, cfg=cfg,
                                max_new_tokens=max_new_tokens, max_len=cache_rows, sampling=sampling,
                                stop_tokens=stops, kernels=kernels)
    return generate_speculative(cfg, params, tokens, lengths, key, drafter=drafter, method=method,
                                tree_budget=tree_budget, max_new_tokens=max_new_tokens,
                                sampling=sampling, stop_tokens=stops, max_len=max_len, mesh=mesh,
                                kernels=kernels, budget_costs=budget_costs, first_token_mask=first_mask)


def calibrate_budget_costs(cfg: ModelConfig, params: Params, prompts, *, drafter,
                           budgets: Sequence[int] = (4, 8, 16, 32, 64), max_new_tokens: int = 64, repeats: int = 3,
                           temperature: float = 0.0, kernels: Kernels | None = None) -> BudgetCosts:
    """Measure what one DDTree round costs at each budget on this device, in AR steps, for `tree_budget="auto"`.

    Times whole `generate` calls (a warm-up call compiles; then the median of `repeats`) of AR and of DDTree at
    every budget on `prompts` (their batch size is the one the costs are for) at `temperature` (0: greedy; a
    sampled round costs more, and more so at larger budgets: calibrate at the temperature you decode with; the
    samples use the fixed key jax.random.key(0)), and divides each call's wall time by its rounds. Pass the
    result as `generate(..., temperature=..., tree_budget="auto", budget_costs=...)`."""
    if not budgets or any(not is_int(b) or not 1 <= b for b in budgets):
        raise ValueError(f"budgets must be positive integers, got {budgets!r}")
    if not is_int(repeats) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")

    def per_round(**kwargs) -> float:
        run = functools.partial(generate, cfg, params, prompts, max_new_tokens=max_new_tokens, stop_tokens=(),
                                temperature=temperature, key=jax.random.key(0), kernels=kernels, **kwargs)
        out = jax.block_until_ready(run())
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(run())
            walls.append(time.perf_counter() - start)
        return statistics.median(walls) / max(1, int(out.rounds))

    step = per_round()
    budgets = tuple(sorted({int(b) for b in budgets}))
    costs = tuple(per_round(method="ddtree", drafter=drafter, tree_budget=b) / step for b in budgets)
    device = dispatch.default_device()
    kind = f"temperature {temperature:g}" if temperature > 0 else "greedy"
    where = getattr(device, "device_kind", device.platform)
    ar_cost = default_costs(len(prompts), device, temperature=temperature).ar_cost  # skip drafts where they do
    return BudgetCosts(budgets, costs, ar_cost=ar_cost, source=f"calibrated on {where}, batch {len(prompts)}, {kind}")
