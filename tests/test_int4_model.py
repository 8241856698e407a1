"""INT4 goldens: the engine's W4A16 model against the float64 reference run on the dequantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params, rel_err

import kdtree_jax as kj
from kdtree_jax.drafter import DrafterConfig, init_drafter_params
from pallas_kernels.int4 import Int4Weight
from reference import model as ref

OTHER = TINY.replace(hidden_size=256, moe_intermediate_size=96, intermediate_size=320, q_lora_rank=None,
                     num_hidden_layers=3, n_routed_experts=6, num_experts_per_tok=2)
PROMPTS = [[5, 17, 33, 2 + 1, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107]]


def _int4_paths(params):
    is_int4 = lambda x: isinstance(x, Int4Weight)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_int4)[0]
    return sorted(jax.tree_util.keystr(path) for path, leaf in leaves if is_int4(leaf))


@pytest.fixture(scope="module", params=["tiny", "other"])
def models(request):
    cfg = TINY if request.param == "tiny" else OTHER
    params = random_params(cfg, seed=21)
    return cfg, params, kj.quantize(params, cfg, policy="experts")


def test_policy_quantizes_exactly_the_routed_experts(models):
    cfg, params, qparams = models
    paths = _int4_paths(qparams)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert paths == sorted(f"['layers_{i}']['moe']['experts']['{w}']" for i in moe_layers
                           for w in ("gate", "up", "down"))
    everything = _int4_paths(kj.quantize(params, cfg, policy="all_mlp"))  # which paths: the values do not matter
    assert any("['shared']" in p for p in everything) and any("['mlp']" in p for p in everything)
    assert not any("attn" in p or "router" in p or "embed" in p or "lm_head" in p for p in everything)


def test_int4_logits_match_the_reference_on_dequantized_weights(models):
    cfg, params, qparams = models
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10))
    logits = np.asarray(kj.forward(qparams, cfg, tokens))
    expected = ref.forward(qparams, cfg, tokens)
    max_abs = float(np.abs(logits - expected).max())
    print(f"INT4 logits vs float64 reference: rel {rel_err(logits, expected):.2e}, max abs {max_abs:.2e}")
    assert rel_err(logits, expected) <= 1e-5 and max_abs < 1e-3
    # quantization is really applied: the INT4 model is measurably not the float one
    assert rel_err(logits, ref.forward(params, cfg, tokens)) > 1e-3


@pytest.mark.slow
def test_int4_greedy_tokens_equal_reference_and_differ_from_float(models):
    cfg, params, qparams = models
    out = kj.generate(cfg, qparams, PROMPTS, max_new_tokens=12, stop_tokens=())
    dense = kj.generate(cfg, params, PROMPTS, max_new_tokens=12, stop_tokens=())
    for i, prompt in enumerate(PROMPTS):
        assert list(np.asarray(out.tokens[i])) == ref.greedy_generate(qparams, cfg, prompt, 12)
    assert not np.array_equal(np.asarray(out.tokens), np.asarray(dense.tokens))


@pytest.mark.slow
def test_int4_ddtree_equals_int4_autoregressive(models):
    cfg, _, qparams = models
    dcfg = DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    drafter = (dcfg, init_drafter_params(dcfg, jax.random.key(3)))
    ar = kj.generate(cfg, qparams, PROMPTS, max_new_tokens=10, stop_tokens=())
    tree = kj.generate(cfg, qparams, PROMPTS, max_new_tokens=10, method="ddtree", drafter=drafter,
                       tree_budget=8, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(ar.tokens))


def test_int4_checkpoint_round_trip(models, tmp_path):
    cfg, _, qparams = models
    kj.save_checkpoint(tmp_path / "q", cfg, qparams)
    cfg2, loaded = kj.load_checkpoint(tmp_path / "q")
    assert cfg2 == cfg and _int4_paths(loaded) == _int4_paths(qparams)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(qparams), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_policy_and_double_quantization_are_refused(tiny_params):
    params = tiny_params
    with pytest.raises(ValueError, match="policy"):
        kj.quantize(params, TINY, policy="attention")
    q = kj.quantize(params, TINY)
    with pytest.raises(ValueError, match="already INT4"):
        kj.quantize(q, TINY)
    with pytest.raises(ValueError, match="scale_dtype"):
        kj.quantize(params, TINY, scale_dtype=jnp.int8)
