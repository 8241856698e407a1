"""The decode pieces shared by every method (kdtree_jax.generate for AR, kdtree_jax.ddtree for DDTree /
DFlash): the output type, sampling, prompt and stop-token checks, cache sizing, prefill, emitting tokens
and running under a device mesh.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.config import ModelConfig
from kdtree_jax.model import KVCache, Params, check_tokens, forward_with_cache
from pallas_kernels.dispatch import Kernels


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32; entries past lengths[b] are pad (0)
    lengths: jax.Array  # [B] int32 new tokens per row (a stop token, when hit, is included)
    num_target_forwards: jax.Array  # [] int32, the prefill included
    rounds: jax.Array  # [] int32 decode rounds after the prefill (AR: one token per round)
    acceptance_lengths: jax.Array  # [B, max_rounds] int32 tokens committed per round, 0 once done
    tree_budgets: jax.Array | None = None  # [max_rounds] int32 drafts verified per round, 0 past the last (DFlash: L)

    def rows(self) -> list[list[int]]:
        """Each row's new tokens up to its length, as Python lists (on the host)."""
        tokens, lengths = np.asarray(self.tokens), np.asarray(self.lengths)
        return [tokens[b, :lengths[b]].tolist() for b in range(tokens.shape[0])]

    def round_acceptances(self) -> np.ndarray:
        """Tokens committed by each decode round, row after row, the padding zeros dropped (on the host)."""
        acc = np.asarray(self.acceptance_lengths)
        return acc[acc > 0]


# Temperatures above this sample as this one: uniform over the unmasked tokens for any logit spread < 1e20.
MAX_EFFECTIVE_TEMPERATURE = 1e30


class SamplingParams(NamedTuple):
    """Static sampling settings (hashable: part of the jit cache key)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    if not (isinstance(sampling.temperature, (int, float)) and 0 <= sampling.temperature < math.inf):
        raise ValueError(f"temperature must be >= 0 and finite, got {sampling.temperature!r}")
    if sampling.top_k is not None and not (is_int(sampling.top_k) and 1 <= sampling.top_k <= vocab_size):
        raise ValueError(f"top_k must be an integer in [1, {vocab_size}], got {sampling.top_k!r}")
    if sampling.top_p is not None and not (0.0 < sampling.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p!r}")


def sampling_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Temperature, top-k and top-p applied to logits [..., V]: float32 (logits - row max) / T, masked
    entries -inf.

    Correct for every T > 0: shifting by the row max first makes the best token exactly 0 and every
    other <= 0, so a tiny T (1e-39, or one that is 0 in float32) drives the others to -inf instead of
    overflowing everything to +-inf (whose softmax is nan): sampling then picks the argmax, uniformly
    among exactly tied maxima, which is the limit of softmax(logits / T) as T -> 0."""
    logits = logits.astype(jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)  # [..., V] <= 0, the best exactly 0
    # XLA divides by the constant T as a multiply by float32(1 / T). Below ~1e-38 that is inf: keep the
    # best at 0, not 0 * inf = nan. Above 1e30 T is capped: past ~1e38 the reciprocal would flush to 0
    # and turn a masked -inf into nan, and (logits - max) / T is 0 in float32 either way (uniform).
    temperature = min(sampling.temperature, MAX_EFFECTIVE_TEMPERATURE)
    logits = jnp.where(shifted == 0, 0.0, shifted / temperature)
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


def check_key(key) -> None:
    """Raise ValueError unless `key` is one PRNG key: jax.random.key(seed) (or a legacy uint32[2] key)."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if isinstance(key, (jax.Array, np.ndarray)) and shape is not None:
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and shape == ():
            return
        if dtype == np.uint32 and shape == (2,):  # jax.random.PRNGKey(seed)
            return
        got = f"an array of {dtype}{list(shape)}"
    else:
        got = f"{type(key).__name__} {key!r}"
    raise ValueError(f"key must be one PRNG key, jax.random.key(seed), got {got}")


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


def prepare_first_token_mask(cfg: ModelConfig, mask, batch: int) -> np.ndarray | None:
    """generate's `first_token_mask`: None, or a bool array [V] (every row) or [batch, V] -> bool
    [batch, V] (numpy) or None. Raises ValueError for another dtype or shape, or a row allowing nothing
    (its first token would have no candidate)."""
    if mask is None:
        return None
    if not isinstance(mask, (np.ndarray, jax.Array)):
        raise ValueError(f"first_token_mask must be a bool array [vocab] or [batch, vocab], got "
                         f"{type(mask).__name__}")
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise ValueError(f"first_token_mask must have dtype bool, got {mask.dtype}")
    vocab = cfg.vocab_size
    if mask.shape == (vocab,):
        mask = np.broadcast_to(mask, (batch, vocab))
    elif mask.shape != (batch, vocab):
        raise ValueError(f"first_token_mask must have shape [{vocab}] or [{batch}, {vocab}] (vocab_size "
                         f"{vocab}, {batch} prompts), got {list(mask.shape)}")
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise ValueError(f"first_token_mask allows no token for prompt {int(empty[0])}: every row needs at "
                         "least one True entry")
    return np.ascontiguousarray(mask)


def mask_first_logits(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The prefill's last logits [B, V] with the tokens `mask` [B, V] forbids at -inf (mask None: as
    they are). Every later step of sampling (greedy argmax, temperature, top-k, top-p) then picks among
    the allowed tokens only; prepare_first_token_mask guarantees each row allows one."""
    if mask is None:
        return logits
    return jnp.where(mask, logits, -jnp.inf)


def resolve_stop_tokens(cfg: ModelConfig, stop_tokens) -> tuple[int, ...]:
    stops = tuple(cfg.eos_token_id) if stop_tokens is None else tuple(int(t) for t in stop_tokens)
    for t in stops:
        if not 0 <= t < cfg.vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {cfg.vocab_size})")
    return stops


CACHE_ROW_MULTIPLE = 64  # cache rows allocated in whole tiles of the Mosaic GPU attention kernel (block_kv 64)


def cache_length(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, slack: int,
                 max_len: int | None) -> int:
    """Rows the cache needs: the longest prompt, every new token, and `slack` rows that a verify
    forward writes past the committed length, rounded up to a multiple of CACHE_ROW_MULTIPLE when max_len is not
    given (the Mosaic GPU attention kernel streams the cache in 64-row TMA tiles and would otherwise copy it into a
    padded one on every call; rows past a row's length are never visible). Raises when a prompt does not fit."""
    needed = prompt_len + max_new_tokens + slack
    if prompt_len + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}")
    if max_len is None:
        return -(-needed // CACHE_ROW_MULTIPLE) * CACHE_ROW_MULTIPLE
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


def on_mesh(mesh):
    """`jax.set_mesh(mesh)` (the jitted loops trace their sharded form under it), or nothing."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
