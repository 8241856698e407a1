"""The one-launch tree builder (pallas_kernels.tree_build; natively on a GPU, interpret mode on a CPU) against
reference/tree.py's heap: bit-exact in every field, including the tie order, for float32 and bf16 logits, with
either pop loop; its one-launch front end against kdtree_jax.tree.top_log_probs; and inside the decode loop."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY
from hypothesis import given, settings
from hypothesis import strategies as st

import kdtree_jax as kj
from kdtree_jax.tree import (
    Tree,
    build_tree,
    build_tree_from_log_probs,
    front_end_top_log_probs,
    top_log_probs,
    tree_size_counts,
)
from pallas_kernels import dispatch, tree_build
from pallas_kernels.dispatch import Choice, Kernels, KernelUnavailableError
from pallas_kernels.tree_build import POP_LOOPS
from reference.tree import heap_tree

ON_GPU = jax.default_backend() == "gpu"
KERNEL = Kernels(tree="triton", interpret=not ON_GPU)  # natively on a GPU host, else the CPU simulation
JNP = Kernels(tree="xla")
FIELDS = ("tokens", "parents", "depths", "valid", "visible", "scores")
# (batch, L, V, budget): plain; V < budget; fewer nodes than the budget (unused slots); L = 1; budget 1;
# V = 1; a budget that is not a power of two over a wider vocabulary.
# Then trees of exactly a power of two of drafts (every frontier lane in use), and a wide one.
SHAPES = [(2, 3, 5, 12), (1, 4, 3, 20), (2, 2, 3, 16), (1, 1, 6, 4), (3, 3, 4, 1), (1, 3, 1, 5), (2, 5, 9, 33),
          (1, 3, 8, 32), (2, 4, 5, 64), (1, 6, 300, 200)]

_from_lp = jax.jit(build_tree_from_log_probs, static_argnames=("budget", "kernels"))
_from_logits = jax.jit(build_tree, static_argnames=("budget", "kernels"))


@functools.partial(jax.jit, static_argnames=("budget", "pop"))
def _kernel_from_lp(log_probs, roots, *, budget: int, pop: str) -> Tree:
    """The kernel with a given pop loop over `lax.top_k` of float32 log-probs [B, L, V]."""
    _, depth_count, vocab = log_probs.shape
    top_lp, top_tok = jax.lax.top_k(log_probs.astype(jnp.float32), min(budget, vocab))
    n_drafts = tree_size_counts(budget, vocab, depth_count)[1]
    tokens, parents, depths, scores, visible = tree_build.build_tree_from_top(
        top_lp, top_tok, roots, budget=budget, n_drafts=n_drafts, pop=pop, interpret=not ON_GPU)
    valid = jnp.broadcast_to(jnp.arange(1 + budget) <= n_drafts, tokens.shape)
    return Tree(tokens, parents, depths, valid, visible, scores)


def _assert_matches_heap(tree: Tree, log_probs: np.ndarray, budget: int, roots: np.ndarray) -> None:
    for b in range(log_probs.shape[0]):
        ref = heap_tree(log_probs[b], budget, int(roots[b]))
        for field in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(tree, field)[b]), getattr(ref, field),
                                          err_msg=f"{field}, batch {b}")


def _roots(rng, batch):
    return rng.integers(0, 1000, size=batch).astype(np.int32)


@pytest.mark.parametrize("pop", POP_LOOPS)
@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.3, 2.0, 8.0]))
def test_kernel_matches_heap_on_float32_log_probs(pop, shape, seed, scale):
    batch, depth_count, vocab, budget = shape
    rng = np.random.default_rng(seed)
    x = scale * rng.normal(size=(batch, depth_count, vocab))
    log_probs = (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)
    roots = _roots(rng, batch)
    tree = _kernel_from_lp(jnp.asarray(log_probs), jnp.asarray(roots), budget=budget, pop=pop)
    _assert_matches_heap(tree, log_probs, budget, roots)


@pytest.mark.parametrize("pop", POP_LOOPS)
@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**32 - 1), levels=st.integers(1, 4))
def test_kernel_matches_heap_with_exact_ties(pop, shape, seed, levels):
    """Dyadic log-probs: exact ties within and across depths pop in lexicographic order of the rank tuple."""
    batch, depth_count, vocab, budget = shape
    rng = np.random.default_rng(seed)
    log_probs = (-0.5 * rng.integers(0, levels, size=(batch, depth_count, vocab))).astype(np.float32) + 0.0
    roots = _roots(rng, batch)
    tree = _kernel_from_lp(jnp.asarray(log_probs), jnp.asarray(roots), budget=budget, pop=pop)
    _assert_matches_heap(tree, log_probs, budget, roots)


def test_engine_path_matches_heap():
    """build_tree_from_log_probs on the kernel (the engine's pop loop) gives the heap's tree."""
    rng = np.random.default_rng(5)
    x = 2.0 * rng.normal(size=(2, 5, 9))
    log_probs = (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)
    roots = _roots(rng, 2)
    tree = _from_lp(jnp.asarray(log_probs), budget=33, root_tokens=jnp.asarray(roots), kernels=KERNEL)
    _assert_matches_heap(tree, log_probs, 33, roots)


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**32 - 1))
def test_kernel_on_bf16_matches_heap_and_the_jnp_builder(shape, seed):
    """bf16 values (coarse: many ties). Log-probs: the heap over the same values in float32, bit for bit.
    Logits: the kernel and the jnp builder in one program, field for field; the scores bit for bit where one
    logsumexp feeds both (front ends "xla", "pallas"), within a few ulps where the fused front end computes its
    own (natively on a GPU its reduction order differs; equal logits stay equal, so the ranks cannot move)."""
    batch, depth_count, vocab, budget = shape
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(batch, depth_count, vocab)) * 3, jnp.bfloat16)
    roots = jnp.asarray(_roots(rng, batch))
    log_probs = logits - jnp.max(logits, axis=-1, keepdims=True)  # bf16, <= 0
    tree = _from_lp(log_probs, budget=budget, root_tokens=roots, kernels=KERNEL)
    _assert_matches_heap(tree, np.asarray(log_probs.astype(jnp.float32)), budget, np.asarray(roots))
    both = jax.jit(lambda x, r: (build_tree(x, budget, r, kernels=KERNEL), build_tree(x, budget, r, kernels=JNP)))
    kernel_tree, jnp_tree = both(logits, roots)
    own_lse = tree_build.pick_front_end(vocab) == "pallas_fused"
    for field in FIELDS:
        got, want = np.asarray(getattr(kernel_tree, field)), np.asarray(getattr(jnp_tree, field))
        if field == "scores" and own_lse:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=field)
        else:
            np.testing.assert_array_equal(got, want, err_msg=field)


@pytest.mark.parametrize("pop", POP_LOOPS)
def test_kernel_at_the_largest_budgets(pop):
    """Budget 512 (and 1024, the engine's maximum) over L = 15, V = 4096: many pops, deep and wide."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 15, 4096)).astype(np.float32) * 3
    logits[:, :, 7] += 14.0  # a confident token at every depth: the tree grows deep as well as wide
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True), dtype=np.float32)
    for budget in (512, 1024):
        tree = _kernel_from_lp(jnp.asarray(log_probs), jnp.asarray([1, 2], jnp.int32), budget=budget, pop=pop)
        _assert_matches_heap(tree, log_probs, budget, np.array([1, 2]))
        assert int(np.asarray(tree.depths).max()) >= 8


# (batch, L, V, K): V not a power of two, K = V, K = 1, K a power of two, the shipped vocabulary
FRONT_SHAPES = [(1, 3, 7, 3), (2, 2, 40, 32), (1, 2, 300, 256), (1, 1, 5, 5), (2, 3, 100, 1), (1, 2, 2048, 128)]


def _front_logits(rng, shape, kind):
    batch, depth_count, vocab = shape
    if kind == "ties":  # few values, both zeros (lax.top_k's total order puts +0.0 first) and -inf
        values = np.array([0.0, -0.0, -0.5, -1.0, -np.inf], np.float32)
        logits = values[rng.integers(0, len(values), size=shape)]
        logits[..., 0] = -0.5  # a finite logit in every row: a finite logsumexp
        return jnp.asarray(logits)
    logits = rng.normal(size=shape) * 3
    return jnp.asarray(logits, jnp.bfloat16 if kind == "bf16" else jnp.float32)


@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from(FRONT_SHAPES), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["float32", "bf16", "ties"]))
def test_front_end_matches_top_log_probs(shape, seed, kind):
    """front.py with XLA's logsumexp: top_log_probs bit for bit (ranks, ties, tokens, values); with its own
    logsumexp: the same ranks and tokens, values within a few ulps."""
    batch, depth_count, vocab, k = shape
    logits = _front_logits(np.random.default_rng(seed), (batch, depth_count, vocab), kind)
    ref_lp, ref_tok = jax.jit(top_log_probs, static_argnums=1)(logits, k)
    lse = jax.jit(lambda x: jax.nn.logsumexp(x.astype(jnp.float32), axis=-1))(logits)
    lp, tok = tree_build.top_log_probs_pallas(logits, k, lse, interpret=not ON_GPU)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(ref_lp))
    lp, tok = tree_build.top_log_probs_pallas(logits, k, interpret=not ON_GPU)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("front", tree_build.FRONT_ENDS)
def test_every_front_end_feeds_the_kernel(front, monkeypatch):
    """build_tree on the kernel with each front end: the heap's tree over the values that front end gave."""
    monkeypatch.setattr(tree_build, "FRONT_END", front)
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.normal(size=(2, 4, 50)) * 3, jnp.float32)
    roots = jnp.asarray([3, 4], jnp.int32)
    tree = jax.jit(lambda x, r: build_tree(x, 24, r, kernels=KERNEL))(logits, roots)  # a fresh trace per front end
    # The heap gets the values this front end gives, computed as build_tree computes them: one jitted program
    # (on a GPU, XLA's fused logsumexp inside a jit and op by op can differ in the last bit).
    top_lp, top_tok = jax.jit(lambda x: front_end_top_log_probs(x, 24, front, interpret=not ON_GPU))(logits)
    log_probs = np.full(logits.shape, -np.inf, np.float32)  # the heap over the same K candidates
    np.put_along_axis(log_probs, np.asarray(top_tok), np.asarray(top_lp), axis=-1)
    _assert_matches_heap(tree, log_probs, 24, np.asarray(roots))
    assert tree_build.pick_front_end(tree_build.MAX_FRONT_VOCAB) == front
    assert tree_build.pick_front_end(tree_build.MAX_FRONT_VOCAB + 1) == "xla"


def test_greedy_ddtree_with_the_kernel_equals_autoregressive(tiny_params):
    """The central invariant with the tree built by the kernel (the other ops on XLA to keep it fast)."""
    from test_ddtree import make_drafter, ragged_prompts  # noqa: PLC0415 (a sibling test module's fixtures)

    prompts = ragged_prompts(TINY, 0, (5, 1, 9))
    ar = kj.generate(TINY, tiny_params, prompts, max_new_tokens=12, stop_tokens=())
    kernels = Kernels(attention="xla", linear="xla", moe="xla", tree="triton", interpret=not ON_GPU)
    out = kj.generate(TINY, tiny_params, prompts, max_new_tokens=12, method="ddtree",
                      drafter=make_drafter(TINY, seed=4), tree_budget=12, stop_tokens=(), kernels=kernels)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))


def test_dispatch_rules_and_the_plan():
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")  # stand-ins: only these fields are read
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
    choose = dispatch.choose_tree
    assert choose(budget=32, depth_count=15, device=h200) == Choice("triton", "GPU")
    assert choose(budget=32, depth_count=15, device=cpu) == Choice("xla", "no GPU, this is cpu")
    assert choose(budget=32, depth_count=15, device=cpu, interpret=True) == Choice("triton", "interpret mode")
    assert choose(budget=2000, depth_count=15, device=h200) == Choice("xla", "budget 2000 > 1024")
    with pytest.raises(KernelUnavailableError, match="tree impl='triton' cannot run: no GPU, this is cpu"):
        choose(budget=32, depth_count=15, device=cpu, impl="triton")
    if not ON_GPU:
        with pytest.raises(KernelUnavailableError, match="tree impl='triton' cannot run"):
            _from_lp(jnp.zeros((1, 2, 3)), budget=4, kernels=Kernels(tree="triton"))
    params = jax.eval_shape(lambda: kj.init_params(TINY, jax.random.key(0)))
    assert kj.kernel_plan(params, TINY, device=h200)["tree"] == ("triton", "GPU")
    assert kj.kernel_plan(params, TINY, device=cpu)["tree"] == ("xla", "no GPU, this is cpu")


@pytest.mark.parametrize("args,match", [
    ((np.zeros((1, 2, 3), np.float16), np.zeros((1, 2, 3), np.int32), np.zeros(1, np.int32)), "float32"),
    ((np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 4), np.int32), np.zeros(1, np.int32)), "one shape"),
    ((np.zeros((2, 2, 3), np.float32), np.zeros((2, 2, 3), np.int32), np.zeros(1, np.int32)), "root_tokens"),
])
def test_kernel_wrapper_rejects_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        tree_build.build_tree_from_top(*(jnp.asarray(a) for a in args), budget=3, n_drafts=3, interpret=not ON_GPU)
    with pytest.raises(ValueError, match="n_drafts"):
        tree_build.build_tree_from_top(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 3), jnp.int32),
                                       jnp.zeros(1, jnp.int32), budget=3, n_drafts=4, interpret=True)
    assert tree_size_counts(3, 3, 2)[1] == 3
    with pytest.raises(ValueError, match="pop must be one of"):
        tree_build.build_tree_from_top(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 3), jnp.int32),
                                       jnp.zeros(1, jnp.int32), budget=3, n_drafts=3, interpret=True, pop="heap")
    with pytest.raises(ValueError, match="k <= V"):
        tree_build.top_log_probs_pallas(jnp.zeros((1, 2, 3)), 4, interpret=True)
