"""kdtree_jax.tree (device tree builder) against reference/tree.py (plain heapq best-first heap)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdtree_jax.tree import Tree, build_chain, build_tree, build_tree_from_log_probs, tree_size_counts
from reference.tree import chain_tree, heap_tree, heap_tree_from_logits, log_softmax64

# Shapes come from a fixed list (each new shape costs a ~1 s compile on CPU); hypothesis varies the values.
# (batch, L, V, budget): plain; V < budget; fewer possible nodes than the budget (3 + 9 < 16, unused slots);
# L = 1; budget 1 with batch 3; V = 1 (a chain plus unused slots); deeper and wider.
SHAPES = [(2, 3, 5, 12), (1, 4, 3, 20), (2, 2, 3, 16), (1, 1, 6, 4), (3, 3, 4, 1), (1, 3, 1, 5), (2, 5, 7, 24)]
FIELDS = ("tokens", "parents", "depths", "valid", "visible", "scores")

_tree_lp = jax.jit(build_tree_from_log_probs, static_argnums=1)
_tree_logits = jax.jit(build_tree, static_argnums=1)
_chain = jax.jit(build_chain)


def _roots(rng: np.random.Generator, batch: int) -> np.ndarray:
    return rng.integers(0, 1000, size=batch).astype(np.int32)


def _assert_equal_to_reference(tree: Tree, refs, scores_exact: bool = True) -> None:
    for b, ref in enumerate(refs):
        for field in FIELDS:
            got, want = np.asarray(getattr(tree, field)[b]), getattr(ref, field)
            if field == "scores" and not scores_exact:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"batch {b}")
            else:
                np.testing.assert_array_equal(got, want, err_msg=f"{field}, batch {b}")


def _assert_well_formed(tree: Tree, n_expected: int) -> None:
    """Structure checks that do not rely on the reference: a prefix-closed tree in best-first order."""
    tokens, parents, depths, valid, visible, scores = (np.asarray(x) for x in tree)
    for b in range(tokens.shape[0]):
        assert valid[b].sum() == 1 + n_expected
        assert valid[b, : 1 + n_expected].all()  # drafts are packed at the front
        assert parents[b, 0] == -1 and depths[b, 0] == 0 and scores[b, 0] == 0
        for i in range(1, tokens.shape[1]):
            row = np.zeros(tokens.shape[1], bool)
            row[i] = True
            if valid[b, i]:
                p = parents[b, i]
                assert 0 <= p < i and valid[b, p] and depths[b, i] == depths[b, p] + 1
                assert scores[b, i] <= scores[b, p] and scores[b, i] <= scores[b, i - 1]
                while p >= 0:
                    row[p] = True
                    p = parents[b, p]
            else:
                assert parents[b, i] == -1 and depths[b, i] == 0 and tokens[b, i] == 0
                assert scores[b, i] == -np.inf
            np.testing.assert_array_equal(visible[b, i], row)


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.3, 2.0, 8.0]))
def test_matches_heap_on_random_float32_log_probs(shape, seed, scale):
    """Bit-exact: the same float32 log-probs into both, so scores, ranks and tie-breaks must all agree."""
    batch, depth_count, vocab, budget = shape
    rng = np.random.default_rng(seed)
    log_probs = log_softmax64(scale * rng.normal(size=(batch, depth_count, vocab))).astype(np.float32)
    roots = _roots(rng, batch)
    tree = _tree_lp(jnp.asarray(log_probs), budget, jnp.asarray(roots))
    _assert_equal_to_reference(tree, [heap_tree(log_probs[b], budget, roots[b]) for b in range(batch)])
    _assert_well_formed(tree, tree_size_counts(budget, vocab, depth_count)[1])


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**32 - 1), levels=st.integers(1, 4))
def test_matches_heap_with_exact_ties(shape, seed, levels):
    """Log-probs on a dyadic grid (sums are exact in float32): many exact ties within and across depths,
    which must pop in lexicographic order of the rank tuple, shorter tuples first."""
    batch, depth_count, vocab, budget = shape
    rng = np.random.default_rng(seed)
    log_probs = (-0.5 * rng.integers(0, levels, size=(batch, depth_count, vocab))).astype(np.float32)
    log_probs += 0.0  # no -0.0: the heap and lax.top_k may order -0.0 and 0.0 differently
    roots = _roots(rng, batch)
    tree = _tree_lp(jnp.asarray(log_probs), budget, jnp.asarray(roots))
    _assert_equal_to_reference(tree, [heap_tree(log_probs[b], budget, roots[b]) for b in range(batch)])
    _assert_well_formed(tree, tree_size_counts(budget, vocab, depth_count)[1])


def test_all_equal_log_probs_pop_lexicographically():
    """Every score 0: the heap order is pure lexicographic order (breadth never beats a shorter prefix)."""
    tree = _tree_lp(jnp.zeros((1, 3, 2)), 6)
    # Ranks == tokens here: (0) (0,0) (0,0,0) (0,0,1) (0,1) (0,1,0)
    np.testing.assert_array_equal(tree.tokens[0], [0, 0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(tree.parents[0], [-1, 0, 1, 2, 2, 1, 5])
    np.testing.assert_array_equal(tree.depths[0], [0, 1, 2, 3, 3, 2, 3])


def _min_gap(scores: np.ndarray) -> float:
    drafts = scores[1:][np.isfinite(scores[1:])]
    return float(np.min(-np.diff(drafts))) if drafts.size > 1 else np.inf


@settings(max_examples=30, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.5, 3.0]))
def test_build_tree_from_logits_matches_float64_heap(shape, seed, scale):
    """build_tree on raw logits against the float64 heap. The structure must match whenever the float64
    order is not within float32 noise of a tie (checked on budget + 1 pops, so the cut-off counts too);
    the scores must match to float32 accuracy always."""
    batch, depth_count, vocab, budget = shape
    rng = np.random.default_rng(seed)
    logits = (scale * rng.normal(size=(batch, depth_count, vocab)) + 5.0).astype(np.float32)
    roots = _roots(rng, batch)
    tree = _tree_logits(jnp.asarray(logits), budget, jnp.asarray(roots))
    for b in range(batch):
        ref = heap_tree_from_logits(logits[b], budget, roots[b])
        np.testing.assert_allclose(np.asarray(tree.scores[b]), ref.scores, rtol=1e-5, atol=1e-5)
        if _min_gap(heap_tree_from_logits(logits[b], budget + 1, roots[b]).scores) > 1e-4:
            _assert_equal_to_reference(jax.tree.map(lambda x, b=b: x[b : b + 1], tree), [ref], scores_exact=False)
    _assert_well_formed(tree, tree_size_counts(budget, vocab, depth_count)[1])


def test_larger_vocab_and_budget_against_float64_heap():
    """Budget 64 over V = 4096 (K = 64 candidates per depth), batch 2, with a confident first depth."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(2, 5, 4096)).astype(np.float32) * 4
    logits[:, 0, 11] += 25.0  # depth 1 almost surely token 11: the tree grows deep instead of wide
    tree = _tree_logits(jnp.asarray(logits), 64)
    for b in range(2):
        ref = heap_tree_from_logits(logits[b], 64)
        assert _min_gap(heap_tree_from_logits(logits[b], 65).scores) > 1e-4  # fixed seed, no near-ties
        _assert_equal_to_reference(jax.tree.map(lambda x, b=b: x[b : b + 1], tree), [ref], scores_exact=False)
    assert np.asarray(tree.depths).max() >= 4


@pytest.mark.parametrize(
    "budget,vocab,depth_count,per_depth,n_drafts",
    [(1, 5, 3, [1, 1, 1], 1), (20, 3, 4, [3, 9, 20, 20], 20), (16, 3, 2, [3, 9], 12), (5, 1, 3, [1, 1, 1], 3),
     (256, 163840, 15, [256] * 15, 256)],
)
def test_tree_size_counts(budget, vocab, depth_count, per_depth, n_drafts):
    assert tree_size_counts(budget, vocab, depth_count) == (per_depth, n_drafts)


def test_build_chain_matches_reference_chain():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 4, 9)).astype(np.float32) * 3
    roots = np.array([5, 6, 7], np.int32)
    chain = _chain(jnp.asarray(logits), jnp.asarray(roots))
    assert chain.tokens.shape == (3, 5) and chain.visible.shape == (3, 5, 5)
    _assert_equal_to_reference(chain, [chain_tree(logits[b], roots[b]) for b in range(3)], scores_exact=False)


def test_traces_inside_jit_scan_and_while_loop():
    """The decode loop calls the builder inside lax.while_loop: it must trace with a static budget."""
    rng = np.random.default_rng(5)
    rounds = rng.normal(size=(3, 2, 3, 6)).astype(np.float32)  # [rounds, B, L, V]

    @jax.jit
    def per_round(all_logits):
        def body(carry, logits):
            tree = build_tree(logits, 8, root_tokens=carry)
            return tree.tokens[:, 1], tree  # next "bonus" = best depth-1 draft

        return jax.lax.scan(body, jnp.array([1, 2], jnp.int32), all_logits)[1]

    trees = per_round(jnp.asarray(rounds))
    roots = np.array([1, 2])
    for r in range(3):
        refs = [heap_tree_from_logits(rounds[r, b], 8, roots[b]) for b in range(2)]
        _assert_equal_to_reference(jax.tree.map(lambda x, r=r: x[r], trees), refs, scores_exact=False)
        roots = np.array([ref.tokens[1] for ref in refs])

    def cond(state):
        return state[0] < 2

    def step(state):
        i, acc = state
        tree = build_tree(jnp.asarray(rounds)[i], 8)
        return i + 1, acc + tree.valid.sum()

    _, total = jax.jit(lambda: jax.lax.while_loop(cond, step, (0, jnp.int32(0))))()
    assert int(total) == 2 * 2 * 9


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(draft_logits=np.zeros((1, 2, 3), np.float32), budget=0), "budget must be"),
        (dict(draft_logits=np.zeros((1, 2, 3), np.float32), budget=True), "budget must be"),
        (dict(draft_logits=np.zeros((1, 2, 3), np.float32), budget=2.0), "budget must be"),
        (dict(draft_logits=np.zeros((2, 3), np.float32), budget=2), r"\[B, L, V\]"),
        (dict(draft_logits=np.zeros((1, 0, 3), np.float32), budget=2), r"\[B, L, V\]"),
        (dict(draft_logits=np.zeros((1, 2, 3), np.int32), budget=2), "floating point"),
        (dict(draft_logits=np.zeros((2, 2, 3), np.float32), budget=2, root_tokens=np.zeros(3, int)), "root_tokens"),
        (dict(draft_logits=np.zeros((2, 2, 3), np.float32), budget=2, root_tokens=np.zeros(2, float)), "root_tokens"),
    ],
)
def test_bad_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        build_tree(**args)
