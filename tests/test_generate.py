"""Autoregressive generation against the reference's greedy decoding, batching, stops and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params

import kdtree_jax as kj
from reference import model as ref


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=7)


@pytest.mark.parametrize("seed,prompt_len", [(0, 1), (1, 5), (2, 13)])
def test_greedy_matches_reference(seed, prompt_len):
    params = random_params(TINY, seed=seed)
    prompt = list(np.random.default_rng(seed).integers(3, TINY.vocab_size, prompt_len))
    out = kj.generate(TINY, params, [prompt], max_new_tokens=8, stop_tokens=())
    expected = ref.greedy_generate(params, TINY, prompt, 8)
    assert list(np.asarray(out.tokens[0])) == expected
    assert int(out.lengths[0]) == 8 and int(out.num_target_forwards) == 8


def test_batch_rows_equal_single_runs(params):
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, TINY.vocab_size, n)) for n in (4, 1, 9)]
    batch = kj.generate(TINY, params, prompts, max_new_tokens=6, stop_tokens=())
    for i, prompt in enumerate(prompts):
        single = kj.generate(TINY, params, [prompt], max_new_tokens=6, stop_tokens=())
        np.testing.assert_array_equal(np.asarray(batch.tokens[i]), np.asarray(single.tokens[0]))


def test_stop_tokens_end_rows_cleanly(params):
    prompts = [[5, 6, 7], [9, 10]]
    free = kj.generate(TINY, params, prompts, max_new_tokens=8, stop_tokens=())
    stop = int(free.tokens[0, 2])  # row 0 hits it at its third token
    out = kj.generate(TINY, params, prompts, max_new_tokens=8, stop_tokens=[stop])
    first_hit = [list(np.asarray(free.tokens[i])).index(stop) + 1 if stop in np.asarray(free.tokens[i])
                 else 8 for i in range(2)]
    assert list(np.asarray(out.lengths)) == first_hit
    for i in range(2):
        n = first_hit[i]
        np.testing.assert_array_equal(np.asarray(out.tokens[i, :n]), np.asarray(free.tokens[i, :n]))
        assert np.all(np.asarray(out.tokens[i, n:]) == 0)
    assert int(out.num_target_forwards) == max(first_hit)


def test_sampling_is_deterministic_per_key_and_respects_top_k(params):
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_k=3, stop_tokens=())
    a = kj.generate(TINY, params, [[4, 5]], key=jax.random.key(11), **kwargs)
    b = kj.generate(TINY, params, [[4, 5]], key=jax.random.key(11), **kwargs)
    c = kj.generate(TINY, params, [[4, 5]], key=jax.random.key(12), **kwargs)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    # every sampled token is among the top-3 of the reference logits at its step
    seq = [4, 5]
    for token in np.asarray(a.tokens[0]):
        logits = ref.forward(params, TINY, np.array([seq]))[0, -1]
        assert token in np.argsort(logits)[-3:]
        seq.append(int(token))


def test_top_p_tiny_keeps_only_the_argmax(params):
    greedy = kj.generate(TINY, params, [[8, 9, 10]], max_new_tokens=5, stop_tokens=())
    nucleus = kj.generate(TINY, params, [[8, 9, 10]], max_new_tokens=5, temperature=0.7, top_p=1e-6,
                          key=jax.random.key(0), stop_tokens=())
    np.testing.assert_array_equal(np.asarray(greedy.tokens), np.asarray(nucleus.tokens))


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[1, 400]]), "outside the vocabulary"),
    (dict(prompts=[[1, -3]]), "outside the vocabulary"),
    (dict(prompts=[[]]), "non-empty"),
    (dict(prompts=[]), "empty"),
    (dict(prompts="hello"), "list of token-id lists"),
    (dict(prompts=[[1.5, 2.0]]), "non-integer"),
    (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1, 2]], max_new_tokens=300), "max_position_embeddings"),
    (dict(prompts=[[1, 2, 3]], max_new_tokens=10, max_len=8), "cannot hold"),
    (dict(prompts=[[1, 2]], temperature=-1.0), "temperature"),
    (dict(prompts=[[1, 2]], temperature=1.0), "PRNG key"),
    (dict(prompts=[[1, 2]], top_k=0, temperature=1.0, key=jax.random.key(0)), "top_k"),
    (dict(prompts=[[1, 2]], top_p=1.5, temperature=1.0, key=jax.random.key(0)), "top_p"),
    (dict(prompts=[[1, 2]], method="beam"), "method"),
    (dict(prompts=[[1, 2]], stop_tokens=[999]), "stop token"),
    (dict(prompts=[[1, 2]], tree_budget=4), "takes no drafter"),
    (dict(prompts=[[1, 2]], temperature=float("inf"), key=jax.random.key(0)), "temperature must be >= 0 and finite"),
    (dict(prompts=[[1, 2]], temperature=1.0, key=123), "key must be one PRNG key, .* got int 123"),
    (dict(prompts=[[1, 2]], key=123), "key must be one PRNG key, .* got int 123"),
    (dict(prompts=[[1, 2]], temperature=1.0, key=np.zeros(3, np.uint32)), r"got an array of uint32\[3\]"),
    (dict(prompts=[[1, 2]], temperature=1.0, key=jax.random.split(jax.random.key(0), 2)), "one PRNG key"),
])
def test_bad_inputs_get_clear_errors(params, kwargs, match):
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=match):
        kj.generate(TINY, params, **kwargs)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                     (0.9, 12, 0.6), (1.0, 3, 0.999)])
def test_sampling_filters_match_numpy(temperature, top_k, top_p):
    from kdtree_jax.decoding import SamplingParams, sampling_logits

    logits = np.random.default_rng(5).standard_normal((6, 50)) * 3
    got = np.asarray(sampling_logits(jnp.asarray(logits, jnp.float32),
                                     SamplingParams(temperature, top_k, top_p)))
    expected = (logits - logits.max(-1, keepdims=True)) / temperature  # softmax-invariant shift
    for row in expected:  # HF order: top-k, then top-p on what is left
        order = np.argsort(-row, kind="stable")
        if top_k is not None:
            row[order[top_k:]] = -np.inf
        if top_p is not None:
            probs = np.exp(row[order] - row[order][0])
            probs /= probs.sum()
            mass_before = np.cumsum(probs) - probs
            row[order[mass_before >= top_p]] = -np.inf
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    np.testing.assert_allclose(got[np.isfinite(got)], expected[np.isfinite(expected)], rtol=1e-5)


def test_legacy_uint32_key_is_accepted(params):
    out = kj.generate(TINY, params, [[4, 5]], max_new_tokens=3, temperature=1.0, key=jax.random.PRNGKey(7))
    assert int(out.lengths[0]) >= 1


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-60, 1e-30, 1e-3, 1e30])
def test_sampling_logits_are_finite_and_exact_for_every_temperature(temperature):
    """(logits - max) / T in float64 rounded to float32: no inf/nan overflow at tiny T (issue: 1e-39
    gave all-zero tokens), -inf only where float32 underflows, the best tokens exactly 0."""
    from kdtree_jax.decoding import SamplingParams, sampling_logits

    logits = np.random.default_rng(2).standard_normal((4, 30)).astype(np.float32) * 5
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1  # an exact tie for the best token
    got = np.asarray(sampling_logits(jnp.asarray(logits), SamplingParams(temperature)))
    with np.errstate(over="ignore"):
        expected = ((logits.astype(np.float64) - logits.max(-1, keepdims=True)) / temperature).astype(np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[0, [3, 7]], [0.0, 0.0])
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    np.testing.assert_allclose(got[np.isfinite(got)], expected[np.isfinite(expected)], rtol=1e-6)


@pytest.mark.parametrize("temperature", [1e-39, 1e-60])
def test_tiny_temperature_samples_the_argmax_ties_uniformly(temperature):
    """softmax(logits / T) -> the argmax as T -> 0, split evenly between exactly tied maxima."""
    from kdtree_jax.decoding import SamplingParams, sample

    logits = np.random.default_rng(3).standard_normal((2, 50)).astype(np.float32) * 4
    logits[1, 11] = logits[1, 40] = logits[1].max() + 0.5  # row 1: two tied best tokens
    keys = jax.random.split(jax.random.key(9), 400)
    tokens = np.asarray(jax.vmap(lambda k: sample(jnp.asarray(logits), k, SamplingParams(temperature)))(keys))
    assert set(tokens[:, 0]) == {int(np.argmax(logits[0]))}
    counts = np.bincount(tokens[:, 1], minlength=50)
    assert counts[11] + counts[40] == 400 and 140 < counts[11] < 260  # each tie about half of 400


@pytest.mark.parametrize("temperature", [1e31, 1e37, 1e39])
def test_huge_temperature_is_uniform_not_nan(temperature):
    """T near or past float32's range (1e39 is inf in float32): uniform, and a masked -inf stays -inf."""
    from kdtree_jax.decoding import SamplingParams, sampling_logits

    logits = jnp.asarray([[3.0, -2.0, 0.5, -jnp.inf]], jnp.float32)
    got = sampling_logits(logits, SamplingParams(temperature))
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(got)), [[1 / 3, 1 / 3, 1 / 3, 0.0]], rtol=1e-6)


def test_tiny_temperature_generates_the_greedy_tokens(params):
    prompts = [[4, 5, 6], [9]]
    greedy = kj.generate(TINY, params, prompts, max_new_tokens=8, stop_tokens=())
    tiny_t = kj.generate(TINY, params, prompts, max_new_tokens=8, stop_tokens=(), temperature=1e-39,
                         key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(tiny_t.tokens), np.asarray(greedy.tokens))


def test_cache_rows_are_whole_attention_tiles_unless_max_len_is_given(params):
    """Without max_len the cache gets what the call needs rounded up to 64 rows (whole TMA tiles of the Mosaic
    attention kernel: no per-call pad); the extra rows are never visible, so the tokens equal a run with the exact
    max_len; with max_len it is exactly max_len."""
    from kdtree_jax.decoding import CACHE_ROW_MULTIPLE, cache_length

    assert CACHE_ROW_MULTIPLE == 64
    assert cache_length(TINY, 5, 10, 3, None) == 64 and cache_length(TINY, 60, 4, 0, None) == 64
    assert cache_length(TINY, 60, 4, 1, None) == 128 and cache_length(TINY, 5, 10, 3, 18) == 18
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    auto = kj.generate(TINY, params, prompts, max_new_tokens=6)
    exact = kj.generate(TINY, params, prompts, max_new_tokens=6, max_len=11)
    np.testing.assert_array_equal(np.asarray(auto.tokens), np.asarray(exact.tokens))
