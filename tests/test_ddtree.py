"""The central invariant - greedy DDTree == greedy autoregressive, token for token - plus deep
acceptance with a drafter that knows the answer, and lossless sampling (chi-square)."""

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params

import kdtree_jax as kj
from kdtree_jax import budget as budget_lib
from kdtree_jax.ddtree import OracleDraft, accept_path
from kdtree_jax.drafter import DrafterConfig, init_drafter_params
from kdtree_jax.tree import build_tree
from reference import model as ref

SMALL_VOCAB = TINY.replace(vocab_size=24, mask_token_id=23, num_hidden_layers=2)


def make_drafter(cfg, seed, block_size=4, layers=1):
    dcfg = DrafterConfig.for_target(cfg, num_layers=layers, block_size=block_size)
    return dcfg, init_drafter_params(dcfg, jax.random.key(seed))


def ragged_prompts(cfg, seed, lengths):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, cfg.vocab_size, n)) for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_params):
    params = tiny_params
    prompts = ragged_prompts(TINY, 0, (5, 1, 9))
    ar = kj.generate(TINY, params, prompts, max_new_tokens=14, stop_tokens=())
    return params, prompts, ar


@pytest.mark.parametrize("budget", [1, 2, 7, 32, 100])
def test_greedy_ddtree_equals_autoregressive(tiny, budget):
    params, prompts, ar = tiny
    out = kj.generate(TINY, params, prompts, max_new_tokens=14, method="ddtree",
                      drafter=make_drafter(TINY, seed=budget), tree_budget=budget, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), [14, 14, 14])
    assert int(out.num_target_forwards) == int(out.rounds) + 1
    assert np.asarray(out.acceptance_lengths).sum(axis=1).tolist() == [13, 13, 13]  # + 1 from prefill


def test_greedy_invariant_with_the_separate_mla_projections(tiny):
    """generate folds a small model's MLA projections (model.fold_params); on the checkpoint's separate matrices
    (kj.Kernels(mla="separate")) greedy DDTree equals greedy AR too, and the tokens are the folded run's."""
    params, prompts, ar = tiny
    separate = kj.Kernels(mla="separate")
    ar_separate = kj.generate(TINY, params, prompts, max_new_tokens=14, stop_tokens=(), kernels=separate)
    out = kj.generate(TINY, params, prompts, max_new_tokens=14, method="ddtree", kernels=separate,
                      drafter=make_drafter(TINY, seed=3), tree_budget=7, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar_separate.tokens))
    np.testing.assert_array_equal(np.asarray(ar_separate.tokens), np.asarray(ar.tokens))


def test_greedy_dflash_equals_autoregressive(tiny):
    params, prompts, ar = tiny
    out = kj.generate(TINY, params, prompts, max_new_tokens=14, method="dflash",
                      drafter=make_drafter(TINY, seed=5, block_size=6))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_invariant_on_more_random_models_and_the_reference(seed):
    cfg = TINY.replace(num_hidden_layers=3)
    params = random_params(cfg, seed=seed)
    prompts = ragged_prompts(cfg, seed, (3, 7))
    out = kj.generate(cfg, params, prompts, max_new_tokens=10, method="ddtree",
                      drafter=make_drafter(cfg, seed, block_size=5, layers=2), tree_budget=12, stop_tokens=())
    for i, prompt in enumerate(prompts):
        assert list(np.asarray(out.tokens[i])) == ref.greedy_generate(params, cfg, prompt, 10)


@pytest.mark.slow
def test_vocabulary_smaller_than_budget():
    params = random_params(SMALL_VOCAB, seed=4)
    prompts = ragged_prompts(SMALL_VOCAB, 4, (4, 2))
    ar = kj.generate(SMALL_VOCAB, params, prompts, max_new_tokens=12, stop_tokens=())
    out = kj.generate(SMALL_VOCAB, params, prompts, max_new_tokens=12, method="ddtree",
                      drafter=make_drafter(SMALL_VOCAB, 4), tree_budget=100, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))


def oracle_for(prompts, continuation, block_size, vocab):
    width = max(len(p) for p in prompts) + continuation.shape[1]
    seq = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        seq[i, : len(p)] = p
        seq[i, len(p): len(p) + continuation.shape[1]] = continuation[i]
    return OracleDraft(jnp.asarray(seq), block_size, vocab)


@pytest.mark.parametrize("method,budget", [("ddtree", 4), ("ddtree", 9), ("dflash", None)])
def test_drafter_that_knows_the_answer_accepts_full_blocks(tiny, method, budget):
    params, prompts, ar = tiny
    block = 5
    oracle = oracle_for(prompts, np.asarray(ar.tokens), block, TINY.vocab_size)
    out = kj.generate(TINY, params, prompts, max_new_tokens=14, method=method, drafter=oracle,
                      tree_budget=budget, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    # the prefill gives 1 token, each round `block` tokens (the last round what is left)
    assert int(out.rounds) == math.ceil((14 - 1) / block)
    acc = np.asarray(out.acceptance_lengths)[:, : int(out.rounds)]
    assert np.all(acc[:, :-1] == block) and np.all(acc[:, -1] == (14 - 1) - block * (int(out.rounds) - 1))


def test_stop_tokens_and_ragged_finish_with_oracle(tiny):
    params, prompts, ar = tiny
    stop = int(ar.tokens[1, 6])  # row 1 stops at its 7th token, inside a block
    expected = kj.generate(TINY, params, prompts, max_new_tokens=14, stop_tokens=[stop])
    oracle = oracle_for(prompts, np.asarray(ar.tokens), 4, TINY.vocab_size)
    out = kj.generate(TINY, params, prompts, max_new_tokens=14, method="ddtree", drafter=oracle,
                      tree_budget=6, stop_tokens=[stop])
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(expected.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))


def test_accept_path_walks_the_matching_children():
    # scores: [0] -0.51, [0, 0] -0.62, [1] -0.92 -> node 1 = token 0 (depth 1), node 2 = token 2 (child
    # of node 1), node 3 = token 1 (depth 1)
    logits = jnp.log(jnp.array([[[0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 0.9, 0.1]]]) + 1e-9)
    tree = build_tree(logits, 3, root_tokens=jnp.array([3]))
    assert np.asarray(tree.tokens).tolist() == [[3, 0, 2, 1]]
    assert np.asarray(tree.parents).tolist() == [[-1, 0, 1, 0]]
    posterior = jnp.array([[0, 2, 1, 3]])  # root wants 0 (node 1), node 1 wants 2 (node 2), node 2 wants 1
    path, length, bonus = accept_path(tree, posterior, max_depth=2)
    assert np.asarray(path).tolist() == [[0, 1, 2]] and int(length[0]) == 3 and int(bonus[0]) == 1
    path, length, bonus = accept_path(tree, jnp.array([[1, 2, 0, 0]]), max_depth=2)  # node 3, a leaf
    assert np.asarray(path).tolist() == [[0, 3, 3]] and int(length[0]) == 2 and int(bonus[0]) == 0
    path, length, bonus = accept_path(tree, jnp.array([[2, 2, 0, 1]]), max_depth=2)  # no child has 2
    assert int(length[0]) == 1 and int(bonus[0]) == 2


def _walk(tokens, parents, valid, posterior, max_depth):
    """The acceptance walk, literally: from the root, step to the child carrying posterior[current]."""
    path = [0]
    while len(path) <= max_depth:
        children = [i for i in range(len(tokens)) if valid[i] and parents[i] == path[-1]
                    and tokens[i] == posterior[path[-1]]]
        if not children:
            break
        path.append(children[0])
    return path + [path[-1]] * (max_depth + 1 - len(path)), len(path), posterior[path[-1]]


@pytest.mark.parametrize("seed", range(4))
def test_accept_path_equals_the_literal_walk_on_random_trees(seed):
    """The walk-free accept_path against a literal walk: random trees (unused slots included), posteriors that
    follow the tree for a random number of steps and then leave it."""
    rng = np.random.default_rng(seed)
    batch, depth, vocab, budget = 6, 4, 5, 30 if seed % 2 else 12
    tree = build_tree(jnp.asarray(rng.normal(size=(batch, depth, vocab)) * 2, jnp.float32), budget,
                      root_tokens=jnp.arange(batch, dtype=jnp.int32))
    tokens, parents, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
    posterior = rng.integers(0, vocab, size=tokens.shape).astype(np.int32)
    for b in range(batch):  # steer row b's posterior along a random branch of its tree
        node = 0
        for _ in range(rng.integers(0, depth + 1)):
            kids = [i for i in range(tokens.shape[1]) if valid[b, i] and parents[b, i] == node]
            if not kids:
                break
            node_next = kids[rng.integers(len(kids))]
            posterior[b, node] = tokens[b, node_next]
            node = node_next
    path, length, bonus = accept_path(tree, jnp.asarray(posterior), depth)
    for b in range(batch):
        want_path, want_len, want_bonus = _walk(tokens[b], parents[b], valid[b], posterior[b], depth)
        assert np.asarray(path[b]).tolist() == want_path and int(length[b]) == want_len
        assert int(bonus[b]) == int(want_bonus)


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi_square(samples: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = len(samples)
    observed = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.slow
@pytest.mark.parametrize("budget", [30, "auto"])
def test_sampling_is_lossless_chi_square(budget):
    cfg = SMALL_VOCAB
    params = random_params(cfg, seed=9)
    prompt = [5, 9, 2, 7]
    # exact distribution of the 2nd generated token: sum_t1 p(t1 | prompt) p(t2 | prompt, t1)
    p1 = _softmax(ref.forward(params, cfg, np.array([prompt]))[0, -1])
    batch = np.array([prompt + [t] for t in range(cfg.vocab_size)])
    p2 = (p1[:, None] * _softmax(ref.forward(params, cfg, batch)[:, -1])).sum(0)
    # a uniform drafter (zero final norm) with a tree holding every depth-1 token: the 2nd token is
    # always sampled at a verified tree node, so the tree path is what is tested
    dcfg, dparams = make_drafter(cfg, 0, block_size=3)
    dparams = {**dparams, "final_norm": jnp.zeros_like(dparams["final_norm"])}
    n = 3000
    kwargs = dict(max_new_tokens=2, temperature=1.0, stop_tokens=(), key=jax.random.key(123), tree_budget=budget)
    if budget == "auto":  # costs that pick the 4-draft tree: the 2nd token is a tree node's draw or a bonus draw
        kwargs["budget_costs"] = kj.BudgetCosts((4, 30), (1.0, 2.0))
    out = kj.generate(cfg, params, [prompt] * n, method="ddtree", drafter=(dcfg, dparams), **kwargs)
    if budget == "auto":
        assert int(out.tree_budgets[0]) == 4
    assert np.all(np.asarray(out.acceptance_lengths)[:, 0] >= 1)
    stat, dof = _chi_square(np.asarray(out.tokens[:, 1]), p2)
    assert stat < _chi_square_critical(dof), (stat, dof)
    # the same test must reject a biased sampler (temperature 0.7 instead of 1)
    biased = kj.generate(cfg, params, [prompt] * n, method="ddtree", drafter=(dcfg, dparams),
                         **{**kwargs, "temperature": 0.7})
    stat, dof = _chi_square(np.asarray(biased.tokens[:, 1]), p2)
    assert stat > _chi_square_critical(dof), (stat, dof)


def _softmax(logits):
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="ddtree", tree_budget=4), "needs a drafter"),
    (dict(method="ddtree", tree_budget=0, drafter="d"), "tree_budget"),
    (dict(method="ddtree", tree_budget=5000, drafter="d"), "tree_budget"),
    (dict(method="ddtree", drafter="d"), "tree_budget"),
    (dict(method="dflash", tree_budget=3, drafter="d"), "tree_budget and budget_costs apply"),
    (dict(method="ddtree", tree_budget="best", drafter="d"), "tree_budget"),
    (dict(method="ddtree", tree_budget=8, drafter="d", budget_costs="c"), "budget_costs applies to tree_budget='auto'"),
    (dict(method="ddtree", tree_budget="auto", drafter="d", budget_costs=(8, 1.0)), "must be a kdtree_jax.BudgetCosts"),
    (dict(method="ddtree", tree_budget=3, drafter=("x", "y")), "drafter must be"),
])
def test_bad_speculative_arguments(tiny, kwargs, match):
    params, prompts, _ = tiny
    if kwargs.get("drafter") == "d":
        kwargs["drafter"] = make_drafter(TINY, 0)
    with pytest.raises(ValueError, match=match):
        kj.generate(TINY, params, prompts, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("method,budget", [("ddtree", 8), ("dflash", None)])
def test_tiny_temperature_speculative_equals_greedy(tiny, method, budget):
    """T = 1e-39 samples every verified node at the argmax (it overflowed to nan: all-zero tokens)."""
    params, prompts, ar = tiny
    out = kj.generate(TINY, params, prompts, max_new_tokens=14, method=method, tree_budget=budget,
                      drafter=make_drafter(TINY, seed=3), stop_tokens=(), temperature=1e-39, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))


def test_bfloat16_drafter_on_a_float32_target_keeps_the_greedy_invariant(tiny):
    """A drafter computing in bfloat16 (kj.DFlashDraft compute_dtype: the dtype it trains in) proposes for a float32
    target: the target alone decides what a greedy verify commits, so DDTree and DFlash still equal AR token for
    token. The prepared drafter holds its matrices, its cache and the shared embedding / lm_head in bfloat16, and its
    drafts are the float32 drafter's to bfloat16 rounding, not bit-equal (the dtype took effect)."""
    params, prompts, ar = tiny
    dcfg, dparams = make_drafter(TINY, seed=5)
    bf16, f32 = kj.DFlashDraft(dcfg, dparams, compute_dtype="bfloat16"), kj.DFlashDraft(dcfg, dparams)
    for method, budget in (("ddtree", 7), ("dflash", None)):
        out = kj.generate(TINY, params, prompts, max_new_tokens=14, method=method, drafter=bf16, tree_budget=budget,
                          stop_tokens=())
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    prep16, prep32 = bf16.prepared(TINY, params), f32.prepared(TINY, params)
    assert {a.dtype for a in jax.tree.leaves((prep16.dparams, prep16.tables))} == {jnp.dtype(jnp.bfloat16)}
    assert prep32.tables is None and {a.dtype for a in jax.tree.leaves(prep32.dparams)} == {jnp.dtype(jnp.float32)}
    hidden = jax.random.normal(jax.random.key(1), (1, 6, dcfg.num_target_layers, TINY.hidden_size), jnp.float32)
    positions, drafts = jnp.arange(6, dtype=jnp.int32)[None], {}
    for name, model in (("bf16", prep16), ("f32", prep32)):
        state = model.extend(model.init_state(1, 16, jnp.float32), hidden, positions, jnp.array([6]))
        assert state.keys.dtype == (jnp.bfloat16 if name == "bf16" else jnp.float32)
        drafts[name] = np.asarray(model.draft(state, TINY, params, jnp.array([5]), jnp.array([6])), np.float64)
    gap = np.abs(drafts["bf16"] - drafts["f32"]).max()
    assert 0 < gap < 0.05 * np.abs(drafts["f32"]).max(), gap


def test_drafter_compute_dtype_is_checked(tiny):
    params, prompts, _ = tiny
    dcfg, dparams = make_drafter(TINY, 0)
    cases = [(kj.DFlashDraft(dcfg, dparams, compute_dtype="int8"), "compute_dtype must be None or one of"),
             (kj.DFlashDraft(dcfg, dparams, compute_dtype="bfloat16").prepared(TINY, params), "not a prepared")]
    for drafter, match in cases:
        with pytest.raises(ValueError, match=match):
            kj.generate(TINY, params, prompts, max_new_tokens=4, method="ddtree", drafter=drafter, tree_budget=4)


def test_mismatched_drafter_params_get_clear_errors(tiny):
    params, prompts, _ = tiny
    dcfg, dparams = make_drafter(TINY, 0)
    deeper = make_drafter(TINY, 0, layers=2)[1]  # a tree for another config: one layer too many
    wider = {**dparams, "fc": jnp.zeros((dparams["fc"].shape[0], 7))}
    cases = [(deeper, r"unexpected \['layers_1/attn/k'"), (wider, r"'fc' has shape \[\d+, 7\], .* needs"),
             ({**dparams, "fc": "w"}, "'fc' must be a floating array"), ([dparams], "nested dict")]
    for bad, match in cases:
        for drafter in ((dcfg, bad), kj.DFlashDraft(dcfg, bad)):
            with pytest.raises(ValueError, match=match):
                kj.generate(TINY, params, prompts, max_new_tokens=4, method="ddtree", drafter=drafter,
                            tree_budget=4)


def test_finished_rows_never_write_past_the_cache(tiny, monkeypatch):
    """A row cut by max_new_tokens mid-block commits only what it emitted: later verify rounds (run
    for the rows still going) write inside the cache."""
    import kdtree_jax.ddtree as ddtree_module

    params, prompts, ar = tiny
    seen = []
    real = ddtree_module.forward_with_cache

    def spy(params, cfg, tokens, positions, cache, **kw):
        jax.debug.callback(lambda ends, rows: seen.append((np.asarray(ends), rows)),
                           cache.lengths + tokens.shape[1], cache.max_len)
        return real(params, cfg, tokens, positions, cache, **kw)

    monkeypatch.setattr(ddtree_module, "forward_with_cache", spy)
    jax.clear_caches()
    # the longest prompt (row 2) gets a drafter that knows its answer and finishes in one round with
    # a full block accepted; rows 0 and 1 get wrong drafts and need three more rounds
    continuation = np.zeros_like(np.asarray(ar.tokens))
    continuation[2] = np.asarray(ar.tokens[2])
    oracle = oracle_for(prompts, continuation, 6, TINY.vocab_size)
    out = kj.generate(TINY, params, prompts, max_new_tokens=4, method="ddtree", drafter=oracle,
                      tree_budget=8, stop_tokens=())
    jax.clear_caches()
    assert int(out.rounds) == 3 and int(out.acceptance_lengths[2, 0]) == 3
    assert seen and all(int(ends.max()) <= rows for ends, rows in seen), seen
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens[:, :4]))


def test_auto_budget_keeps_the_greedy_invariant_and_follows_its_costs(tiny):
    """tree_budget="auto": greedy tokens == AR whatever budgets it picks; costs that make the largest budget
    always best reproduce that fixed budget's rounds exactly; costs that make it never pay pick the smallest."""
    params, prompts, ar = tiny
    drafter = make_drafter(TINY, seed=3)
    run = functools.partial(kj.generate, TINY, params, prompts, max_new_tokens=14, method="ddtree", drafter=drafter,
                            stop_tokens=())
    default = run(tree_budget="auto")  # the CPU's measured costs (budgets 4..16; 0: rounds that drafted nothing)
    np.testing.assert_array_equal(np.asarray(default.tokens), np.asarray(ar.tokens))
    used = np.asarray(default.tree_budgets)[: int(default.rounds)]
    assert set(used.tolist()) <= {0, 4, 8, 16} and used[0] != 0  # the first round always drafts
    assert (np.asarray(default.tree_budgets)[int(default.rounds):] == 0).all()
    largest = run(tree_budget="auto", budget_costs=kj.BudgetCosts((2, 6, 12), (1.0, 0.9, 0.8)))
    fixed = run(tree_budget=12)
    np.testing.assert_array_equal(np.asarray(largest.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(largest.acceptance_lengths), np.asarray(fixed.acceptance_lengths))
    assert (np.asarray(largest.tree_budgets)[: int(largest.rounds)] == 12).all()
    assert budget_lib.rounds_per_budget(largest) == {12: int(largest.rounds)}
    smallest = run(tree_budget="auto", budget_costs=kj.BudgetCosts((2, 6, 12), (1.0, 1e6, 1e9)))
    np.testing.assert_array_equal(np.asarray(smallest.acceptance_lengths),
                                  np.asarray(run(tree_budget=2).acceptance_lengths))
    assert (np.asarray(smallest.tree_budgets)[: int(smallest.rounds)] == 2).all()


def test_auto_skips_the_draft_when_it_cannot_pay(tiny):
    """With BudgetCosts.ar_cost, a round after a drafted round that expected fewer tokens per cost than one per
    AR step drafts nothing (an AR step, budget 0, one token), every PROBE_EVERY-th such round drafts again; greedy
    tokens still equal AR's. Costs under which drafting always pays give the rounds of auto without ar_cost."""
    params, prompts, _ = tiny
    drafter = make_drafter(TINY, seed=3)
    ar = kj.generate(TINY, params, prompts, max_new_tokens=24, stop_tokens=())
    run = functools.partial(kj.generate, TINY, params, prompts, max_new_tokens=24, method="ddtree", drafter=drafter,
                            stop_tokens=(), tree_budget="auto")
    never = run(budget_costs=kj.BudgetCosts((2, 6), (1e6, 1e9), ar_cost=1.0))
    np.testing.assert_array_equal(np.asarray(never.tokens), np.asarray(ar.tokens))
    rounds = int(never.rounds)
    used = np.asarray(never.tree_budgets)[:rounds]
    probe = budget_lib.PROBE_EVERY
    assert rounds > probe + 1
    expected = np.where(np.arange(rounds) % (probe + 1) == 0, 2, 0)  # draft, PROBE_EVERY AR steps, draft, ...
    np.testing.assert_array_equal(used, expected)
    undrafted = np.asarray(never.acceptance_lengths)[:, :rounds][:, used == 0]
    assert ((undrafted == 1) | (undrafted == 0)).all()  # one token per live row (0 once a row is done)
    always = run(budget_costs=kj.BudgetCosts((2, 6), (1.0, 0.9), ar_cost=1e6))
    plain = run(budget_costs=kj.BudgetCosts((2, 6), (1.0, 0.9)))
    np.testing.assert_array_equal(np.asarray(always.tree_budgets), np.asarray(plain.tree_budgets))
    np.testing.assert_array_equal(np.asarray(always.tokens), np.asarray(plain.tokens))
    assert (np.asarray(always.tree_budgets)[: int(always.rounds)] == 6).all()
    with pytest.raises(ValueError, match="ar_cost must be None or finite and > 0"):
        kj.BudgetCosts((2,), (1.0,), ar_cost=0.0)
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")  # stand-ins: only these fields are read
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
    assert budget_lib.default_costs(batch=1, device=cpu).ar_cost == 1.0  # measured to help there
    assert budget_lib.default_costs(batch=8, device=h200, temperature=1.0).ar_cost is None  # not yet measured there


def test_auto_default_costs_follow_the_temperature(tiny, monkeypatch):
    """Unasked, generate's auto takes the greedy table at temperature 0 and the sampled one at temperature > 0:
    with tables that disagree (greedy: the largest budget always pays; sampled: never), each picks its own."""
    params, prompts, _ = tiny
    drafter = make_drafter(TINY, seed=3)
    tables = {**budget_lib._MEASURED,
              ("cpu", 1, False): {2: 1.0, 6: 0.9}, ("cpu", 1, True): {2: 1.0, 6: 1e6}}
    monkeypatch.setattr(budget_lib, "_MEASURED", tables)
    run = functools.partial(kj.generate, TINY, params, prompts[:1], max_new_tokens=10, method="ddtree",
                            drafter=drafter, stop_tokens=(), tree_budget="auto", key=jax.random.key(5))
    for temperature, budget in [(0.0, 6), (1.0, 2)]:
        out = run(temperature=temperature)
        assert budget_lib.rounds_per_budget(out) == {budget: int(out.rounds)}, temperature


def test_budget_choice_by_hand():
    """E(n) = 1 + the sum of the first n nodes' exp(score) per live row; the budget with the best E / cost wins."""
    scores = jnp.log(jnp.array([[1.0, 0.9, 0.5, 0.1, 0.1], [1.0, 0.2, 0.1, 0.05, 0.0]]))  # root, then 4 nodes
    live = jnp.array([True, True])
    np.testing.assert_allclose(np.asarray(budget_lib.expected_tokens(scores, live, (1, 2, 4))),
                               [1.9 + 1.2, 2.4 + 1.3, 2.6 + 1.35], rtol=1e-6)
    assert int(budget_lib.choose(scores, live, kj.BudgetCosts((1, 2, 4), (1.0, 1.0, 1.0)))) == 2
    assert int(budget_lib.choose(scores, live, kj.BudgetCosts((1, 2, 4), (1.0, 1.3, 1.5)))) == 0
    only_first = budget_lib.expected_tokens(scores, jnp.array([True, False]), (1, 4))
    np.testing.assert_allclose(np.asarray(only_first), [1.9, 2.6], rtol=1e-6)
    with pytest.raises(ValueError, match="one cost per budget"):
        kj.BudgetCosts((1, 2), (1.0,))
    with pytest.raises(ValueError, match="strictly increasing"):
        kj.BudgetCosts((4, 2), (1.0, 1.0))
    with pytest.raises(ValueError, match="finite and > 0"):
        kj.BudgetCosts((2, 4), (1.0, 0.0))
    costs = budget_lib.default_costs(batch=3, device=jax.devices()[0])
    assert costs.budgets == tuple(sorted(costs.budgets)) and "batch 1" in costs.source
    assert costs.source.endswith("greedy")
    sampled = budget_lib.default_costs(batch=3, device=jax.devices()[0], temperature=0.7)
    assert sampled.budgets == costs.budgets and sampled.costs != costs.costs  # measured apart
    assert sampled.source.endswith("temperature 1")


def test_calibrated_costs_are_measured_per_budget(tiny):
    """calibrate_budget_costs times AR and each budget here and returns costs generate accepts."""
    params, prompts, ar = tiny
    drafter = make_drafter(TINY, seed=3)
    costs = kj.calibrate_budget_costs(TINY, params, prompts, drafter=drafter, budgets=(6, 2), max_new_tokens=6,
                                      repeats=1)
    assert costs.budgets == (2, 6) and all(c > 0 for c in costs.costs) and costs.source.endswith("batch 3, greedy")
    out = kj.generate(TINY, params, prompts, max_new_tokens=14, method="ddtree", drafter=drafter, stop_tokens=(),
                      tree_budget="auto", budget_costs=costs)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    sampled = kj.calibrate_budget_costs(TINY, params, prompts, drafter=drafter, budgets=(2,), max_new_tokens=6,
                                        repeats=1, temperature=1.0)
    assert sampled.budgets == (2,) and sampled.costs[0] > 0 and sampled.source.endswith("batch 3, temperature 1")
    with pytest.raises(ValueError, match="budgets must be positive integers"):
        kj.calibrate_budget_costs(TINY, params, prompts, drafter=drafter, budgets=(0,))
