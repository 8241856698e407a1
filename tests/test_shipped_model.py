"""The shipped target + drafter pair (kdtree_jax/assets, trained by training/; docs/training.md).

Checks: the checkpoints and tokenizer load and fit together; the drafter's training forward computes
exactly what inference (`drafter_extend_context` + `drafter_forward`) computes; the training loss matches
a float64 NumPy cross-entropy; on all 32 fixed held-out prompts greedy AR == DFlash == DDTree (real
weights, INT4 experts, float32 at full matmul precision); every greedy DFlash and DDTree round commits what the
drafter, teacher-forced as in training, predicts there; sampling is deterministic for a seed; the drafter's
acceptance stays above agreed floors, greedy and at temperature 1; how many completions degenerate.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

import kdtree_jax as kj
from kdtree_jax.drafter import drafter_extend_context, drafter_forward, init_drafter_cache, shared_tables
from pallas_kernels.int4 import Int4Weight
from training import degeneracy
from training.degeneracy import top_line_share

ASSETS = kj.ASSETS
MAX_SHIPPED_BYTES = 40_000_000  # target + drafter + tokenizer + prompts (issue 17: 40 MB at most)
NEW_TOKENS = 32
# Agreed floors for the mean acceptance length (tokens committed per round, over every round of the 32
# held-out prompts, 32 new tokens, budget 32). Measured when shipped (CPU, JAX 0.11.2, 2026-12-07: the target
# fine-tuned against its own loops, training/unlikelihood.py, and the session-39 drafter, the session-18 one widened
# to a 1536-unit SwiGLU and trained on further): greedy DDTree 3.149, DFlash 2.329; temperature 1 (seed 0) DDTree
# 1.957, DFlash 1.485. The drafter before it (the session-18 one, 2026-12-05): 3.062 / 2.234 / 1.893 / 1.478; the one
# before that (2026-12-04): 2.944 / 2.120 / 1.893 / 1.457. (The pairs before, with the degenerate target: 3.090 /
# 2.234 / 2.029 / 1.476 on 2026-12-03, and earlier.) The floors leave room for float-order differences across
# machines but fail on a broken, swapped or untrained drafter (1.0) and, greedy and at temperature 1, on the
# previous drafter.
ACCEPTANCE_FLOOR = {"greedy": 3.1, "temperature 1": 1.92}
# Degeneracy (training/degeneracy.py): the share of a 64-token greedy completion's lines taken by its most frequent
# line (blank lines count); at degeneracy.DEGENERACY_LIMIT (0.5) or above the completion is one line over and over.
# Measured when shipped (CPU, 2026-12-04, the fine-tuned target): 3 of the 32 held-out prompts and 3 of the 16
# newline-ending prompts (healed) reach it (the target before the fine-tune: 13 and 5).
DEGENERATE_MEASURED = {"heldout": 3, "newline": 3}


# The module fixtures below are whole `generate` runs (on a GPU host, each program compiles for 30-50 s: XLA autotunes
# its float32 GEMMs). pytest-xdist builds a module fixture once per worker that runs one of its tests, so the tests of
# one fixture share an xdist group: `--dist loadgroup` (tests/gpu_host.sh) sends them to one worker; CI's `--dist
# loadfile` keeps the whole file on one worker anyway.
GREEDY_RUNS = pytest.mark.xdist_group("shipped_greedy_runs")
COMPLETIONS = pytest.mark.xdist_group("shipped_completions")


# --------------------------------------------------------------------- training forward == inference
def _tiny_drafter(seed=0):
    cfg = TINY
    dcfg = kj.DrafterConfig.for_target(cfg, num_layers=2, num_target_layers=2, block_size=5)
    dparams = kj.init_drafter_params(dcfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    lm_head = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.vocab_size)) / 14, jnp.float32)
    return cfg, dcfg, dparams, embed, lm_head, rng


def test_training_forward_equals_incremental_inference():
    from training.train_drafter import drafter_training_logits

    cfg, dcfg, dparams, embed, lm_head, rng = _tiny_drafter()
    B, T = 2, 12
    hidden = jnp.asarray(rng.standard_normal((B, T, dcfg.num_target_layers, cfg.hidden_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size - 1, (B, T)), jnp.int32)
    anchors = jnp.asarray([[1, 5, 11], [0, 3, 8]], jnp.int32)  # [B, K]; 0 = no context at all
    got = np.asarray(drafter_training_logits(dparams, dcfg, hidden, tokens, anchors, embed, lm_head))
    assert got.shape == (B, 3, dcfg.block_size - 1, cfg.vocab_size)
    forward = jax.jit(drafter_forward, static_argnums=1)  # one compile for every anchor (same shapes)
    extend = jax.jit(drafter_extend_context, static_argnums=1)
    for b in range(B):
        for k, a in enumerate(np.asarray(anchors[b]).tolist()):
            # inference: the context arrives in two chunks (prefill, then a round's accepted tokens)
            cache = init_drafter_cache(dcfg, 1, T)
            cut = a // 2
            for lo, hi in ((0, cut), (cut, a)):
                if hi == lo:  # nothing to add (a zero-length extend is not a case inference produces)
                    continue
                chunk = hidden[b:b + 1, lo:hi]
                pos = jnp.arange(lo, hi, dtype=jnp.int32)[None]
                cache = extend(dparams, dcfg, cache, chunk, pos, jnp.asarray([hi - lo]))
            want = forward(dparams, dcfg, cache, embed, lm_head, tokens[b, a][None].astype(jnp.int32),
                           jnp.asarray([a], jnp.int32))
            np.testing.assert_allclose(got[b, k], np.asarray(want[0]), rtol=2e-5, atol=2e-5,
                                       err_msg=f"row {b}, anchor {a}")


def test_drafter_loss_matches_float64_cross_entropy():
    from training.train_drafter import block_weights, drafter_loss, drafter_training_logits

    cfg, dcfg, dparams, embed, lm_head, rng = _tiny_drafter(1)
    B, T, L = 2, 10, dcfg.block_size - 1
    hidden = jnp.asarray(rng.standard_normal((B, T, dcfg.num_target_layers, cfg.hidden_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size - 1, (B, T)), jnp.int32)
    anchors = jnp.asarray([[2, 6], [1, 4]], jnp.int32)
    valid = np.array([10, 7])  # row 1: labels at positions >= 7 do not count
    weights = block_weights(dcfg.block_size, 3.0)
    np.testing.assert_allclose(weights, np.exp(-np.arange(L) / 3.0) / np.exp(-np.arange(L) / 3.0).sum(), rtol=1e-6)
    loss, _ = drafter_loss(dparams, dcfg, hidden, tokens, jnp.asarray(valid), anchors, embed, lm_head,
                           jnp.asarray(weights))
    logits = np.asarray(drafter_training_logits(dparams, dcfg, hidden, tokens, anchors, embed, lm_head), np.float64)
    tok = np.asarray(tokens)
    sums, counts = np.zeros(L), np.zeros(L)
    for b in range(B):
        for k, a in enumerate(np.asarray(anchors[b])):
            for j in range(L):
                pos = a + 1 + j
                if pos < valid[b]:
                    row = logits[b, k, j]
                    lse = row.max() + np.log(np.exp(row - row.max()).sum())
                    sums[j] += lse - row[tok[b, pos]]
                    counts[j] += 1
    want = float(np.dot(sums / np.maximum(counts, 1), weights))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_drafter_distillation_loss_matches_float64():
    """--distill W: each position's loss is (1 - W) x the cross-entropy against the token + W x the cross-entropy
    against the target's softmax at the position before the token (float64 NumPy truth); W = 0 is the plain loss;
    W outside [0, 1], or W > 0 without the target's logits, is an error."""
    from training.train_drafter import block_weights, drafter_loss, drafter_training_logits

    cfg, dcfg, dparams, embed, lm_head, rng = _tiny_drafter(2)
    B, T, L = 2, 10, dcfg.block_size - 1
    hidden = jnp.asarray(rng.standard_normal((B, T, dcfg.num_target_layers, cfg.hidden_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size - 1, (B, T)), jnp.int32)
    target_logits = jnp.asarray(3 * rng.standard_normal((B, T, cfg.vocab_size)), jnp.float32)
    anchors = jnp.asarray([[2, 6], [1, 4]], jnp.int32)
    valid = np.array([10, 7])
    weights = jnp.asarray(block_weights(dcfg.block_size, 3.0))
    args = (dparams, dcfg, hidden, tokens, jnp.asarray(valid), anchors, embed, lm_head, weights)
    logits = np.asarray(drafter_training_logits(dparams, dcfg, hidden, tokens, anchors, embed, lm_head), np.float64)
    teacher = np.asarray(target_logits, np.float64)
    tok = np.asarray(tokens)

    def log_softmax(x):
        return x - (x.max() + np.log(np.exp(x - x.max()).sum()))

    hard_sum, soft_sum, counts = np.zeros(L), np.zeros(L), np.zeros(L)
    for b in range(B):
        for k, a in enumerate(np.asarray(anchors[b])):
            for j in range(L):
                pos = a + 1 + j
                if pos < valid[b]:
                    logq = log_softmax(logits[b, k, j])
                    p = np.exp(log_softmax(teacher[b, pos - 1]))
                    hard_sum[j] -= logq[tok[b, pos]]
                    soft_sum[j] -= (p * logq).sum()
                    counts[j] += 1
    hard, soft = (float(np.dot(s / np.maximum(counts, 1), np.asarray(weights))) for s in (hard_sum, soft_sum))
    assert abs(hard - soft) > 0.1  # the two labels differ here, so the mix is checked, not one term twice
    for w in (0.0, 0.3, 1.0):
        loss, _ = drafter_loss(*args, target_logits, w)
        np.testing.assert_allclose(float(loss), (1 - w) * hard + w * soft, rtol=1e-5, err_msg=f"distill {w}")
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="distill must be in"):
            drafter_loss(*args, target_logits, bad)
    with pytest.raises(ValueError, match="needs target_logits"):
        drafter_loss(*args, None, 0.5)


# ------------------------------------------------------------------------------------ shipped pair
@pytest.fixture(scope="module")
def shipped():
    from tokenizers import Tokenizer

    # stored in bfloat16; the invariant is exact in float32 at full matmul precision (tests/conftest.py)
    cfg, params = kj.load_checkpoint(ASSETS / "target", expect_kind="target", dtype=jnp.float32)
    dcfg, dparams = kj.load_checkpoint(ASSETS / "drafter", expect_kind="drafter", dtype=jnp.float32)
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    prompts = json.loads((ASSETS / "heldout_prompts.json").read_text())
    return cfg, params, dcfg, dparams, tok, prompts


def test_shipped_pair_loads_and_fits(shipped):
    cfg, params, dcfg, dparams, tok, prompts = shipped
    dcfg.check_target(cfg)
    assert tok.get_vocab_size() == cfg.vocab_size
    assert tok.token_to_id("<mask>") == cfg.mask_token_id == dcfg.mask_token_id
    assert tok.token_to_id("<bos>") == cfg.bos_token_id and (tok.token_to_id("<eos>"),) == cfg.eos_token_id
    # K2.6 architecture: MLA with q/kv LoRA, YaRN, routed MoE + shared expert, first layer dense
    assert cfg.q_lora_rank and cfg.kv_lora_rank and cfg.rope_scaling is not None
    assert cfg.first_k_dense_replace == 1 and cfg.n_shared_experts == 1 and cfg.n_routed_experts >= 16
    assert 8 <= cfg.num_hidden_layers <= 12
    for layer in range(cfg.num_hidden_layers):
        block = params[f"layers_{layer}"]
        if cfg.is_moe_layer(layer):
            assert all(isinstance(block["moe"]["experts"][w], Int4Weight) for w in ("gate", "up", "down"))
            assert not isinstance(block["moe"]["shared"]["gate"], Int4Weight)
        else:
            assert "mlp" in block
    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert size <= MAX_SHIPPED_BYTES, f"shipped assets are {size / 1e6:.1f} MB > 40 MB"
    assert kj.checkpoint.read_checkpoint_meta(ASSETS / "target")["param_dtype"] == "bfloat16"
    held = prompts["prompts"]
    assert len(held) == 32 and all(len(p["ids"]) == 64 and p["ids"][0] == cfg.bos_token_id for p in held)
    assert all(tok.decode(p["ids"]) == p["text"] for p in held)
    assert len(prompts["newline_prompts"]) == 16 and all(t.endswith("\n") for t in prompts["newline_prompts"])


def _ids(prompts) -> list[list[int]]:
    return [p["ids"] for p in prompts["prompts"]]


@pytest.fixture(scope="module")
def greedy_runs(shipped):
    cfg, params, dcfg, dparams, tok, prompts = shipped
    ids = _ids(prompts)
    run = functools.partial(kj.generate, cfg, params, ids, NEW_TOKENS, stop_tokens=())
    runs = {"ar": run(), "dflash": run(method="dflash", drafter=(dcfg, dparams))}
    for budget in (4, 32):
        runs[f"ddtree{budget}"] = run(method="ddtree", drafter=(dcfg, dparams), tree_budget=budget)
    return runs


@GREEDY_RUNS
def test_greedy_invariant_on_every_heldout_prompt(greedy_runs):
    reference = greedy_runs["ar"].rows()
    assert len(reference) == 32 and all(len(r) == NEW_TOKENS for r in reference)
    for name, out in greedy_runs.items():
        assert out.rows() == reference, f"{name} greedy output differs from autoregressive"


def _mean_acceptance(out) -> float:
    return float(out.round_acceptances().mean())


@GREEDY_RUNS
def test_acceptance_floor_greedy(greedy_runs):
    """A drafter regression (untrained, swapped, mis-wired features) shows up here first."""
    got = _mean_acceptance(greedy_runs["ddtree32"])
    assert got >= ACCEPTANCE_FLOOR["greedy"], f"DDTree acceptance {got:.3f} < floor {ACCEPTANCE_FLOOR['greedy']}"
    # the tree beats the single path, which beats plain decoding's 1 token per forward
    assert got >= _mean_acceptance(greedy_runs["dflash"]) > 1.3


@GREEDY_RUNS
def test_decode_rounds_match_the_teacher_forced_drafter(shipped, greedy_runs):
    """Every greedy DFlash and DDTree round commits what the drafter as trained predicts there
    (`training.train_drafter.teacher_forced_leads`, the drafter fed the target's hidden states from one causal forward
    over the final sequence): DFlash, the leading run of its block's argmaxes that matches the sequence; DDTree, the
    deepest path of the best-first tree over the block that spells it; each plus the target's bonus token. So
    `simulated_acceptance`, the training's decode-view metric, is the decode's mean acceptance.

    The greedy invariant cannot see how the decode loop conditions the drafter (which target layers, which
    positions, which accepted rows reach its context cache) or how far a verify walks the tree: a slip there only
    lowers the acceptance. This test pins each round's count to the one the drafter was trained to achieve
    (measured, 8 prompts: the context one position late changes 52 of 102 DFlash rounds, the target layers one
    lower 40; a tree of budget 8 instead of 32 changes 32 of 75 DDTree rounds)."""
    from training.train_drafter import simulated_acceptance, target_outputs, teacher_forced_leads

    cfg, params, dcfg, dparams, tok, prompts = shipped
    prompt_len = len(_ids(prompts)[0])
    methods = {"dflash": 0, "ddtree32": 32}  # greedy run: DDTree budget (0: DFlash's chain)
    # every method's final sequence is AR's (the greedy invariant), so one target forward and one drafter pass serve all
    rows = greedy_runs["ar"].rows()
    assert all(greedy_runs[name].rows() == rows for name in methods)
    tokens = np.concatenate([np.asarray(_ids(prompts)), np.asarray(rows)], 1).astype(np.int32)
    B, T = tokens.shape
    anchors = np.arange(prompt_len, T - 1)  # every bonus position a round can start at (the first: the prefill's)

    @jax.jit  # as train_drafter runs it; eagerly, ~500 small programs each compiled (minutes on a GPU, session 43)
    def leads_of(params, dparams, tokens, anchors):
        _, hidden = target_outputs(params, cfg, tokens, dcfg.target_layer_ids)
        return teacher_forced_leads(dparams, dcfg, hidden, tokens, anchors, *shared_tables(cfg, params),
                                    tuple(methods.values()))

    all_leads = np.asarray(leads_of(params, dparams, jnp.asarray(tokens),
                                    jnp.asarray(np.broadcast_to(anchors, (B, anchors.size)), jnp.int32)))
    for name, leads in zip(methods, all_leads, strict=True):
        out = greedy_runs[name]
        counts = np.asarray(out.acceptance_lengths)
        rounds = mismatches = committed_by_drafts = 0
        for b in range(B):
            j = 0  # the bonus token's place among the new tokens (the prefill committed the first)
            for n in counts[b][counts[b] > 0].tolist():
                rounds += 1
                committed_by_drafts += n - 1
                mismatches += n != min(int(leads[b, j]) + 1, NEW_TOKENS - 1 - j)  # the last round stops at the length
                j += n
            assert j == NEW_TOKENS - 1, f"{name}, prompt {b}: the rounds commit {j} tokens, not {NEW_TOKENS - 1}"
        # another backend's summation order may flip a near-tie of the drafter's logits: 1 round in 50 is allowed
        assert mismatches <= rounds // 50, f"{name}: {mismatches} of {rounds} rounds commit other than predicted"
        assert committed_by_drafts >= rounds // 2, f"{name}: too few accepted drafts for this check to mean anything"
        if mismatches == 0:
            assert simulated_acceptance(leads, NEW_TOKENS) == pytest.approx(_mean_acceptance(out), rel=1e-12)


def test_acceptance_floor_at_temperature_1(shipped):
    cfg, params, dcfg, dparams, tok, prompts = shipped
    run = functools.partial(kj.generate, cfg, params, _ids(prompts), NEW_TOKENS, drafter=(dcfg, dparams),
                            temperature=1.0, key=jax.random.key(0), stop_tokens=())
    tree, chain = _mean_acceptance(run(method="ddtree", tree_budget=32)), _mean_acceptance(run(method="dflash"))
    assert tree >= ACCEPTANCE_FLOOR["temperature 1"] and tree > chain > 1.0, (tree, chain)


def test_sampling_is_deterministic_for_a_seed(shipped):
    cfg, params, dcfg, dparams, tok, prompts = shipped
    ids = _ids(prompts)[:1]
    run = lambda seed: kj.generate(cfg, params, ids, 24, method="ddtree", drafter=(dcfg, dparams),  # noqa: E731
                                   tree_budget=16, temperature=1.0, key=jax.random.key(seed)).rows()
    first = run(3)
    assert run(3) == first
    assert run(4) != first  # a different seed gives another sample (24 tokens at temperature 1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason=(
    "the golden was recorded on a CPU; another backend sums in another order, which can flip a near-tie (the "
    "invariant test checks DDTree == AR on this backend)"))  # a mark, not pytest.skip(): greedy_runs is not built
@GREEDY_RUNS
def test_shipped_greedy_tokens_are_pinned(greedy_runs):
    """The shipped pair's greedy tokens on the held-out prompts equal the golden recorded when the pair
    shipped (CPU, float32): engine changes must not change a single token."""
    golden = json.loads((Path(__file__).parent / "fixtures" / "shipped_greedy_tokens.json").read_text())
    assert golden["new_tokens"] == NEW_TOKENS
    assert greedy_runs["ar"].rows() == golden["greedy_tokens"]
    assert greedy_runs["ddtree32"].rows() == golden["greedy_tokens"]


# ------------------------------------------------------------------------------------- degeneracy
def test_top_line_share_measure():
    assert top_line_share("a\nb\nc\nd") == 0.25
    assert top_line_share("x = 1\nx = 1  \nx = 1\ny") == 0.75  # trailing spaces do not make a line new
    assert top_line_share("FORCE_FORCE_FORCE") == 1.0  # a single line is all one line


@pytest.fixture(scope="module")
def completion_shares(shipped):
    """Top-line shares of 64-token greedy completions: the held-out prompts, and the newline-ending prompts
    healed as the CLI heals them (training.degeneracy)."""
    cfg, params, _, _, tok, prompts = shipped
    return degeneracy.completion_shares(cfg, params, tok, prompts)


@COMPLETIONS
@pytest.mark.xfail(strict=True, reason=(
    "issue 17's target, not met by the shipped 33.9 M-parameter target (CPU, greedy, 2026-12-04): 3 of 32 held-out "
    "and 3 of 16 newline-ending 64-token completions repeat one line for half their lines or more"))
def test_no_completion_degenerates(completion_shares):
    bad = degeneracy.degenerate_counts(completion_shares)
    assert bad == {"heldout": 0, "newline": 0}, bad


@COMPLETIONS
def test_degenerate_completions_do_not_increase(completion_shares):
    bad = degeneracy.degenerate_counts(completion_shares)
    assert all(bad[k] <= DEGENERATE_MEASURED[k] for k in bad), bad
    # the measure itself separates: most completions are far from one repeated line
    assert np.median(completion_shares["heldout"]) < 0.4
