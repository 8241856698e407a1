"""Generation: prompt checking, sampling, and autoregressive decoding in one jitted program.

`generate` is the public entry point for every method; the decode loop of each method is one
`lax.while_loop` inside one `jax.jit`, so a whole generate call is a single device dispatch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import sharding
from kdtree_jax.config import ModelConfig
from kdtree_jax.model import KVCache, Params, check_tokens, forward_with_cache, init_cache
from pallas_kernels.dispatch import Kernels

METHODS = ("ar", "dflash", "ddtree")


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32; entries past lengths[b] are pad (0)
    lengths: jax.Array  # [B] int32 new tokens per row (a stop token, when hit, is included)
    num_target_forwards: jax.Array  # [] int32, the prefill included
    rounds: jax.Array  # [] int32 decode rounds after the prefill (AR: one token per round)
    acceptance_lengths: jax.Array  # [B, max_rounds] int32 tokens committed per round, 0 once done


class SamplingParams(NamedTuple):
    """Static sampling settings (hashable: part of the jit cache key)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    if not (isinstance(sampling.temperature, (int, float)) and sampling.temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {sampling.temperature!r}")
    if sampling.top_k is not None and not (_is_int(sampling.top_k) and 1 <= sampling.top_k <= vocab_size):
        raise ValueError(f"top_k must be an integer in [1, {vocab_size}], got {sampling.top_k!r}")
    if sampling.top_p is not None and not (0.0 < sampling.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p!r}")


def sampling_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Temperature, top-k and top-p applied to float32 logits [..., V] (masked entries -inf)."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep_sorted = (cumulative - jax.nn.softmax(sorted_logits, axis=-1)) < sampling.top_p
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample(logits: jax.Array, key: jax.Array, sampling: SamplingParams) -> jax.Array:
    """One token per row of logits [..., V] -> int32 [...]: argmax when greedy."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, sampling_logits(logits, sampling), axis=-1).astype(jnp.int32)


# ------------------------------------------------------------------------------------------- prompts
def prepare_prompts(cfg: ModelConfig, prompts) -> tuple[np.ndarray, np.ndarray]:
    """A list of token-id lists (ragged) or an int array [B, P] -> (tokens [B, P] int32 right-padded
    with 0, lengths [B] int32). Raises ValueError for empty prompts or ids outside the vocabulary."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts must be an integer array [batch, length], got {arr.dtype}{list(arr.shape)}")
        rows = list(arr)
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        rows = [np.asarray(p) for p in prompts]
    else:
        raise ValueError(f"prompts must be a list of token-id lists or an int array, got {type(prompts).__name__}")
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D list of token ids, got shape {list(row.shape)}")
        if not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt {i} holds non-integer values ({row.dtype})")
        check_tokens(cfg, row)
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.zeros((len(rows), int(lengths.max())), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens, lengths


def resolve_stop_tokens(cfg: ModelConfig, stop_tokens) -> tuple[int, ...]:
    stops = tuple(cfg.eos_token_id) if stop_tokens is None else tuple(int(t) for t in stop_tokens)
    for t in stops:
        if not 0 <= t < cfg.vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {cfg.vocab_size})")
    return stops


def cache_length(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, slack: int,
                 max_len: int | None) -> int:
    """Rows the cache needs: the longest prompt, every new token, and `slack` rows that a verify
    forward writes past the committed length. Raises when a prompt does not fit."""
    needed = prompt_len + max_new_tokens + slack
    if prompt_len + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}")
    if max_len is None:
        return needed
    if needed > max_len:
        raise ValueError(f"the cache of max_len={max_len} rows cannot hold a prompt of {prompt_len} tokens + "
                         f"{max_new_tokens} new tokens (+{slack} verify rows): needs {needed}")
    return int(max_len)


def prefill(params: Params, cfg: ModelConfig, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
            cache: KVCache, hidden_layers: tuple[int, ...] = (), kernels: Kernels | None = None):
    """Causal forward over the padded prompts [B, P] into an empty cache. Returns (logits of each
    row's last prompt token [B, V], hidden [B, P, n, D], cache with lengths = prompt_lengths)."""
    positions = jnp.broadcast_to(jnp.arange(prompt_tokens.shape[1], dtype=jnp.int32), prompt_tokens.shape)
    logits, hidden, cache = forward_with_cache(params, cfg, prompt_tokens, positions, cache,
                                               hidden_layers=hidden_layers, kernels=kernels)
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, hidden, cache._replace(lengths=prompt_lengths)


def emit(out: jax.Array, count: jax.Array, done: jax.Array, tokens: jax.Array, accept: jax.Array,
         stop_tokens: tuple[int, ...]):
    """Append up to `accept[b]` tokens of tokens [B, A] to each not-done row of out [B, N], cutting
    at the first stop token and at N. Returns (out, count, done, emitted [B])."""
    max_new = out.shape[1]
    width = tokens.shape[1]
    index = jnp.arange(width)
    is_stop = jnp.isin(tokens, jnp.asarray(stop_tokens, jnp.int32)) if stop_tokens else \
        jnp.zeros(tokens.shape, bool)
    within = index[None, :] < accept[:, None]
    stop_at = jnp.argmax(is_stop & within, axis=1)  # first stop among the accepted tokens
    has_stop = jnp.any(is_stop & within, axis=1)
    take = jnp.where(has_stop, stop_at + 1, accept)
    take = jnp.minimum(take, max_new - count)
    take = jnp.where(done, 0, take)
    slots = count[:, None] + index[None, :]  # [B, A]
    valid = index[None, :] < take[:, None]
    rows = jnp.broadcast_to(jnp.arange(out.shape[0])[:, None], slots.shape)
    out = out.at[rows, jnp.where(valid, slots, max_new)].set(tokens, mode="drop")
    count = count + take
    done = done | (has_stop & (take > stop_at)) | (count >= max_new)
    return out, count, done, take


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
def _generate_ar(params, prompt_tokens, prompt_lengths, key, *, cfg, max_new_tokens, max_len, sampling,
                 stop_tokens, kernels=None):
    batch = prompt_tokens.shape[0]
    cache = init_cache(cfg, batch, max_len, params["embed_tokens"].dtype)
    last_logits, _, cache = prefill(params, cfg, prompt_tokens, prompt_lengths, cache, kernels=kernels)
    key, sub = jax.random.split(key)
    first = sample(last_logits, sub, sampling)
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
             tree_budget: int | None = None, max_len: int | None = None, mesh=None,
             kernels: Kernels | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per prompt with one device dispatch.

    prompts: a list of token-id lists (ragged) or an int array [B, P]. method: "ar" (autoregressive),
    "dflash" (single-path speculative) or "ddtree" (tree speculative; needs `drafter=(dcfg, dparams)`
    and `tree_budget`). temperature 0 is greedy; otherwise sampling with optional top_k / top_p and
    an explicit PRNG `key` (required). stop_tokens default to cfg.eos_token_id. max_len: cache rows
    (default: exactly what the call needs). mesh: a jax Mesh or a spec like "expert=2,tensor=1"
    (kdtree_jax.sharding): the target runs sharded over it (params not yet there are placed on it,
    drafter and tree replicated); MeshError when the mesh does not divide the model. kernels: which kernel
    each op runs, e.g. kj.Kernels(attention="xla") (default: pallas_kernels.dispatch decides; routed experts
    run the Mosaic GPU kernel only once converted: kj.prepare_params)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
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
    tokens, lengths = prepare_prompts(cfg, prompts)
    stops = resolve_stop_tokens(cfg, stop_tokens)
    if kernels is None:
        kernels = Kernels()
    if not isinstance(kernels, Kernels):
        raise ValueError(f"kernels must be a kdtree_jax.Kernels, got {type(kernels).__name__}")
    if mesh is not None:
        mesh = sharding.make_mesh(mesh)
        params = sharding.shard_params(cfg, params, mesh)  # checks the mesh divides the model
    if method == "ar":
        if drafter is not None or tree_budget is not None:
            raise ValueError("method='ar' takes no drafter or tree_budget")
        cache_rows = cache_length(cfg, tokens.shape[1], max_new_tokens, 0, max_len)
        with on_mesh(mesh):
            return _generate_ar(params, jnp.asarray(tokens), jnp.asarray(lengths), key, cfg=cfg,
                                max_new_tokens=max_new_tokens, max_len=cache_rows, sampling=sampling,
                                stop_tokens=stops, kernels=kernels)
    from kdtree_jax.ddtree import generate_speculative  # noqa: PLC0415 (avoids an import cycle)

    return generate_speculative(cfg, params, tokens, lengths, key, drafter=drafter, method=method,
                                tree_budget=tree_budget, max_new_tokens=max_new_tokens,
                                sampling=sampling, stop_tokens=stops, max_len=max_len, mesh=mesh,
                                kernels=kernels)


def on_mesh(mesh):
    """`jax.set_mesh(mesh)` (the jitted loops trace their sharded form under it), or nothing."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
