"""Checks of the NumPy float64 reference model against facts: published YaRN numbers, properties of
rotations, the MLA absorbed-form identity, hand-built routing examples, causality.

Nothing here compares the reference with itself: each test has an independent expectation (a number
from the public DeepSeek-V3 / Kimi K2 definitions, a hand computation, or a second formulation written out in the test).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import SMALL, TINY

from kdtree_jax.config import ModelConfig, YarnScaling
from reference import model as ref


# ----------------------------------------------------------------------------------------- helpers
def make_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Small random float64 params in the docs/params.md layout; norms and router biases random too
    (they initialise to 1 / 0 in real models, which would hide layout bugs)."""
    rng = np.random.default_rng(seed)
    D, H = cfg.hidden_size, cfg.num_attention_heads
    n, r, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    E, I, V = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.vocab_size  # noqa: E741 (I: intermediate size)

    def w(*shape):  # [.., in, out], scaled so activations stay O(1)
        return rng.standard_normal(shape) / math.sqrt(shape[-2])

    def norm(dim):
        return 1.0 + 0.2 * rng.standard_normal(dim)

    params = {"embed_tokens": rng.standard_normal((V, D)), "final_norm": norm(D)}
    for l in range(cfg.num_hidden_layers):  # noqa: E741 (l: the layer index)
        attn = {"kv_a": w(D, c + r), "kv_a_norm": norm(c), "kv_b": w(c, H * (n + v)), "o": w(H * v, D)}
        if cfg.q_lora_rank is None:
            attn["q"] = w(D, H * (n + r))
        else:
            attn.update(q_a=w(D, cfg.q_lora_rank), q_a_norm=norm(cfg.q_lora_rank),
                        q_b=w(cfg.q_lora_rank, H * (n + r)))
        layer = {"input_norm": norm(D), "post_attn_norm": norm(D), "attn": attn}
        if cfg.is_moe_layer(l):
            Is = cfg.shared_intermediate_size
            layer["moe"] = {
                "router": w(D, E).astype(np.float32),  # float32 in real trees
                "router_bias": (0.1 * rng.standard_normal(E)).astype(np.float32),
                "experts": {"gate": w(E, D, I), "up": w(E, D, I), "down": w(E, I, D)},
            }
            if cfg.n_shared_experts:
                layer["moe"]["shared"] = {"gate": w(D, Is), "up": w(D, Is), "down": w(Is, D)}
        else:
            F = cfg.intermediate_size
            layer["mlp"] = {"gate": w(D, F), "up": w(D, F), "down": w(F, D)}
        params[f"layers_{l}"] = layer
    if not cfg.tie_word_embeddings:
        params["lm_head"] = w(D, V)
    return params


# A 2-layer tiny model keeps the forward-based tests fast; it still has one dense and one MoE layer.


@pytest.fixture(scope="module")
def small_params():
    return make_params(SMALL, seed=1)


def kimi_k2_0711() -> ModelConfig:
    """K2-Instruct (0711): factor 32, beta_fast = beta_slow = 1."""
    return ModelConfig.kimi_k26().replace(rope_scaling=YarnScaling(
        factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0), max_position_embeddings=131072)


def deepseek_v3_rope() -> ModelConfig:
    """DeepSeek-V3's rope settings (base 10000, factor 40, beta 32/1) on the K2 shapes (same 128/64 dims)."""
    return ModelConfig.kimi_k26().replace(rope_theta=10000.0, rope_scaling=YarnScaling(
        factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0))


# -------------------------------------------------------------------------------------------- YaRN
def test_yarn_correction_dims_match_published_values():
    k26 = ModelConfig.kimi_k26()
    assert ref.yarn_correction_dim(k26, 1) == pytest.approx(19.1646, abs=1e-4)
    assert ref.yarn_correction_dim(k26, 32) == pytest.approx(8.9145, abs=1e-4)


@pytest.mark.parametrize("cfg_fn, low, high, scale", [
    (ModelConfig.kimi_k26, 8, 20, 0.144680),
    (kimi_k2_0711, 19, 20, 0.130861),
    (deepseek_v3_rope, 10, 23, 0.135234),
])
def test_yarn_ranges_frequencies_and_softmax_scale(cfg_fn, low, high, scale):
    cfg = cfg_fn()
    assert ref.yarn_correction_range(cfg) == (low, high)
    assert ref.softmax_scale(cfg) == pytest.approx(scale, abs=5e-7)
    assert ref.yarn_attention_factor(cfg) == 1.0  # mscale == mscale_all_dim: cos/sin unscaled

    d, s, base = 64, cfg.rope_scaling.factor, cfg.rope_theta
    extra = np.array([base ** (-2 * i / d) for i in range(d // 2)])
    inv = ref.yarn_inv_freq(cfg)
    assert inv.shape == (32,)
    np.testing.assert_allclose(inv[:low + 1], extra[:low + 1], rtol=1e-14)  # high freqs untouched
    np.testing.assert_allclose(inv[high:], extra[high:] / s, rtol=1e-14)  # low freqs interpolated
    # Between low and high the blend weight on the interpolated frequency rises linearly.
    for i in range(low + 1, high):
        ramp = (i - low) / (high - low)
        assert inv[i] == pytest.approx(extra[i] / s * ramp + extra[i] * (1 - ramp), rel=1e-14)


def test_yarn_attention_factor_scales_cos_sin():
    # mscale 1.0 vs mscale_all_dim 0.5 at factor 4: (0.1 ln4 + 1) / (0.05 ln4 + 1).
    cfg = TINY.replace(rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64,
                                                mscale=1.0, mscale_all_dim=0.5))
    expected = (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    cos, sin = ref.rope_cos_sin(cfg, np.arange(5))
    np.testing.assert_allclose(np.hypot(cos, sin), expected, rtol=1e-14)
    # softmax scale uses mscale_all_dim only
    assert ref.softmax_scale(cfg) == pytest.approx(48 ** -0.5 * (0.05 * math.log(4) + 1) ** 2, rel=1e-14)


def test_no_rope_scaling_gives_plain_rope():
    cfg = TINY.replace(rope_scaling=None)
    np.testing.assert_allclose(ref.yarn_inv_freq(cfg), 50000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-14)
    assert ref.softmax_scale(cfg) == 48 ** -0.5


# ------------------------------------------------------------------------------------------- RoPE
def test_rope_rotates_adjacent_pairs():
    cfg = TINY
    x = np.zeros(16)
    # Only pair 0: its frequency is base^0 = 1 rad / position, and YaRN never changes it (the ramp
    # is (0 - low) / (high - low) <= 0 there because low >= 0).
    x[0], x[1] = 1.0, 2.0
    p = 3
    out = ref.apply_rope_interleaved(x[None], np.array([p]), cfg)[0]
    np.testing.assert_allclose(out[:2], [math.cos(p) - 2 * math.sin(p), math.sin(p) + 2 * math.cos(p)],
                               rtol=1e-13)
    np.testing.assert_array_equal(out[2:], 0.0)  # no leakage into other pairs (NeoX would mix 0 with 8)


def test_rope_is_norm_preserving_and_relative():
    cfg = TINY  # attention_factor 1 (mscale == mscale_all_dim)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 16))
    pos = np.array([0, 5, 17, 200])
    qr = ref.apply_rope_interleaved(np.tile(q, (4, 1)), pos, cfg)  # [4, 16]
    kr = ref.apply_rope_interleaved(np.tile(k, (4, 1)), pos, cfg)
    np.testing.assert_allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q), rtol=1e-13)
    # <R(p) q, R(p') k> depends only on p - p': shift both positions by the same offset.
    for shift in (1, 33, 1000):
        qs = ref.apply_rope_interleaved(np.tile(q, (4, 1)), pos + shift, cfg)
        ks = ref.apply_rope_interleaved(np.tile(k, (4, 1)), pos + shift, cfg)
        np.testing.assert_allclose(qs @ ks.T, qr @ kr.T, rtol=1e-11, atol=1e-12)
    # and rotation at position 0 is the identity
    np.testing.assert_allclose(qr[0], q, rtol=1e-15)


def test_rope_batched_heads_broadcast():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 16))  # [H, T, r]
    pos = np.array([2, 4, 6, 8])
    out = ref.apply_rope_interleaved(x, pos, TINY)
    for h in range(3):
        np.testing.assert_allclose(out[h], ref.apply_rope_interleaved(x[h], pos, TINY), rtol=1e-15)


# ------------------------------------------------------------------------------- norms, SwiGLU
def test_rms_norm_and_swiglu_formulas():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 8))
    w = rng.standard_normal(8)
    for row in range(3):
        expected = w * x[row] / math.sqrt(sum(v * v for v in x[row]) / 8 + 1e-5)
        np.testing.assert_allclose(ref.rms_norm(x, w, 1e-5)[row], expected, rtol=1e-13)
    g, u, d = rng.standard_normal((8, 5)), rng.standard_normal((8, 5)), rng.standard_normal((5, 8))
    a, b = x @ g, x @ u
    expected = ((a / (1 + np.exp(-a))) * b) @ d
    np.testing.assert_allclose(ref.swiglu(x, g, u, d), expected, rtol=1e-13)


def test_to_float64_converts_jax_bf16_and_keeps_structure():
    import jax.numpy as jnp
    tree = {"a": jnp.ones((2, 3), jnp.bfloat16) * 1.5, "b": {"c": np.float32(2.0) * np.ones(4, np.float32)}}
    out = ref.to_float64(tree)
    assert out["a"].dtype == np.float64 and out["b"]["c"].dtype == np.float64
    np.testing.assert_array_equal(out["a"], 1.5)
    np.testing.assert_array_equal(out["b"]["c"], 2.0)


def test_dict_leaf_is_refused_by_dense_linear():
    with pytest.raises(TypeError, match="dict leaf"):
        ref.swiglu(np.ones((1, 4)), {"packed": np.zeros(1)}, np.ones((4, 2)), np.ones((2, 4)))


# ------------------------------------------------------------------------------------------- MLA
def test_mla_naive_equals_absorbed_form():
    """The absorbed form: per head, q_nope.k_nope == q_lat.c_kv with q_lat = W_UK q_nope, and the values are
    W_UV applied to the attention-weighted latent. An MQA over the 80-wide [c_kv ; k_pe] latent,
    written out here independently, must reproduce the naive MLA output."""
    cfg, p = TINY, make_params(TINY, seed=3)["layers_0"]["attn"]
    H, n, r, v, c = 6, 32, 16, 32, 64
    rng = np.random.default_rng(4)
    T = 7
    x = rng.standard_normal((T, cfg.hidden_size))
    pos = np.arange(10, 10 + T)  # non-zero start: positions matter, indices give causality

    c_q = ref.rms_norm(x @ p["q_a"], p["q_a_norm"], cfg.latent_norm_eps)
    q = (c_q @ p["q_b"]).reshape(T, H, n + r)
    a = x @ p["kv_a"]
    c_kv = ref.rms_norm(a[:, :c], p["kv_a_norm"], cfg.latent_norm_eps)  # [T, c]
    k_pe = ref.apply_rope_interleaved(a[:, c:], pos, cfg)  # [T, r]
    kv_b = p["kv_b"].reshape(c, H, n + v)
    w_uk, w_uv = kv_b[:, :, :n], kv_b[:, :, n:]  # [c, H, n], [c, H, v]
    scale = 1 / math.sqrt(n + r) * (0.1 * math.log(4.0) + 1) ** 2  # tiny: factor 4, mscale_all_dim 1
    out = np.zeros((T, H * v))
    for h in range(H):
        q_nope = q[:, h, :n]  # [T, n]
        q_lat = q_nope @ w_uk[:, h].T  # [T, c]
        # the identity itself, on this data
        np.testing.assert_allclose(q_lat @ c_kv.T, q_nope @ (c_kv @ w_uk[:, h]).T, rtol=1e-10, atol=1e-12)
        q_pe = ref.apply_rope_interleaved(q[:, h, n:], pos, cfg)
        s = (np.concatenate([q_lat, q_pe], -1) @ np.concatenate([c_kv, k_pe], -1).T) * scale  # [T, T]
        for t in range(T):
            logits = s[t, :t + 1]
            prob = np.exp(logits - logits.max())
            prob /= prob.sum()
            o_lat = prob @ c_kv[:t + 1]  # [c]
            out[t, h * v:(h + 1) * v] = o_lat @ w_uv[:, h]
    expected = out @ p["o"]
    np.testing.assert_allclose(ref.mla_naive(p, cfg, x, pos), expected, rtol=1e-10, atol=1e-12)


def test_mla_single_token_output_is_its_own_value():
    """With one token the softmax is 1: out = (c_kv W_UV per head) W_o, whatever the queries are."""
    cfg, p = TINY, make_params(TINY, seed=5)["layers_0"]["attn"]
    x = np.random.default_rng(6).standard_normal((1, cfg.hidden_size))
    c_kv = ref.rms_norm((x @ p["kv_a"])[:, :64], p["kv_a_norm"], 1e-6)
    vals = (c_kv @ p["kv_b"]).reshape(1, 6, 64)[:, :, 32:].reshape(1, 6 * 32)
    np.testing.assert_allclose(ref.mla_naive(p, cfg, x, np.array([42])), vals @ p["o"], rtol=1e-12)


def test_mla_without_q_lora_runs():
    cfg = TINY.replace(q_lora_rank=None, num_hidden_layers=1, first_k_dense_replace=1)
    p = make_params(cfg, seed=7)["layers_0"]["attn"]
    assert "q" in p and "q_a" not in p
    out = ref.mla_naive(p, cfg, np.ones((3, cfg.hidden_size)), np.arange(3))
    assert out.shape == (3, cfg.hidden_size) and np.all(np.isfinite(out))


# ------------------------------------------------------------------------------------------- MoE
def _logit(p):
    return np.log(p / (1 - p))


def _routing_case(scores, bias, cfg):
    """p_moe whose router gives exactly `scores` for the input x = e_0 (router row 0 = logit(scores))."""
    D, E = cfg.hidden_size, cfg.n_routed_experts
    router = np.zeros((D, E))
    router[0] = _logit(np.asarray(scores, dtype=np.float64))
    x = np.zeros((1, D))
    x[0, 0] = 1.0
    return {"router": router, "router_bias": np.asarray(bias, dtype=np.float64)}, x


def test_routing_bias_chooses_but_does_not_weigh():
    cfg = TINY  # E = 8, k = 2, one group, routed_scaling_factor 2.827
    scores = [0.9, 0.8, 0.7, 0.6, 0.5, 0.3, 0.2, 0.1]
    p, x = _routing_case(scores, np.zeros(8), cfg)
    idx, w = ref.moe_route(p, cfg, x)
    assert list(idx[0]) == [0, 1]
    np.testing.assert_allclose(w[0], np.array([0.9, 0.8]) / 1.7 * 2.827, rtol=1e-12)

    bias = np.zeros(8)
    bias[5] = 1.0  # 0.3 + 1.0 = 1.3 beats everything
    p, x = _routing_case(scores, bias, cfg)
    idx, w = ref.moe_route(p, cfg, x)
    assert list(idx[0]) == [5, 0]
    # weights are the UNBIASED scores 0.3 and 0.9, normalised then scaled
    np.testing.assert_allclose(w[0], np.array([0.3, 0.9]) / 1.2 * 2.827, rtol=1e-12)

    # without normalisation: raw scores times the scaling factor
    idx, w = ref.moe_route(p, cfg.replace(norm_topk_prob=False), x)
    np.testing.assert_allclose(w[0], np.array([0.3, 0.9]) * 2.827, rtol=1e-12)


def test_group_limited_routing_masks_groups():
    # 4 groups of 2 experts: group sums (top-2) are g0 1.0, g1 1.5, g2 1.45, g3 0.3.
    scores = [0.9, 0.1, 0.8, 0.7, 0.85, 0.6, 0.2, 0.1]
    grouped = TINY.replace(n_group=4, topk_group=2)
    p, x = _routing_case(scores, np.zeros(8), grouped)
    idx, w = ref.moe_route(p, grouped, x)
    # Expert 0 (0.9, the best overall) sits in a dropped group; the best two of groups 1 and 2 win.
    assert list(idx[0]) == [4, 2]
    np.testing.assert_allclose(w[0], np.array([0.85, 0.8]) / 1.65 * 2.827, rtol=1e-12)
    # one group: plain top-2
    idx, _ = ref.moe_route(p, TINY, x)
    assert list(idx[0]) == [0, 4]
    # the bias also drives the group choice: lift group 3 (experts 6, 7) above the others
    bias = np.array([0, 0, 0, 0, 0, 0, 1.0, 1.0])
    p, x = _routing_case(scores, bias, grouped)
    idx, w = ref.moe_route(p, grouped, x)
    assert list(idx[0]) == [6, 7]
    np.testing.assert_allclose(w[0], np.array([0.2, 0.1]) / 0.3 * 2.827, rtol=1e-12)


def test_moe_combines_routed_and_shared_experts():
    cfg = TINY
    rng = np.random.default_rng(8)
    p = make_params(SMALL, seed=9)["layers_1"]["moe"]
    x = rng.standard_normal((3, cfg.hidden_size))
    idx, w = ref.moe_route(p, cfg, x)

    def silu_mlp(v, g, u, d):
        a = v @ g
        return (a / (1 + np.exp(-a)) * (v @ u)) @ d

    sh = p["shared"]
    expected = silu_mlp(x, sh["gate"], sh["up"], sh["down"])
    ex = p["experts"]
    for t in range(3):
        for e, wt in zip(idx[t], w[t], strict=True):
            expected[t] += wt * silu_mlp(x[t], ex["gate"][e], ex["up"][e], ex["down"][e])
    np.testing.assert_allclose(ref.moe(p, cfg, x), expected, rtol=1e-12)
    # and the routing itself agrees with a vectorised top-k of sigmoid(x W) + bias (one group)
    s = 1 / (1 + np.exp(-(x @ p["router"].astype(np.float64))))
    top = np.argsort(-(s + p["router_bias"]), axis=-1)[:, :2]
    np.testing.assert_array_equal(np.sort(idx, -1), np.sort(top, -1))


# ------------------------------------------------------------------------------------- forward
def test_forward_is_causal(small_params):
    rng = np.random.default_rng(10)
    tokens = rng.integers(0, SMALL.vocab_size, size=(1, 9))
    full = ref.forward(small_params, SMALL, tokens)
    assert full.shape == (1, 9, SMALL.vocab_size) and full.dtype == np.float64
    prefix = ref.forward(small_params, SMALL, tokens[:, :5])
    np.testing.assert_allclose(full[:, :5], prefix, rtol=1e-12, atol=1e-12)
    changed = tokens.copy()
    changed[0, 6:] = (changed[0, 6:] + 1) % SMALL.vocab_size
    other = ref.forward(small_params, SMALL, changed)
    np.testing.assert_allclose(other[:, :6], full[:, :6], rtol=1e-12, atol=1e-12)
    assert not np.allclose(other[:, 6:], full[:, 6:])  # later positions do see the change


def test_forward_batch_rows_are_independent_and_hidden_states(small_params):
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, SMALL.vocab_size, size=(2, 4))
    logits, hidden = ref.forward(small_params, SMALL, tokens, return_hidden=(0, 1))
    assert set(hidden) == {0, 1} and hidden[1].shape == (2, 4, SMALL.hidden_size)
    for b in range(2):
        np.testing.assert_allclose(ref.forward(small_params, SMALL, tokens[b:b + 1])[0], logits[b],
                                   rtol=1e-12, atol=1e-12)
    # logits are final_norm(residual after the last layer) @ lm_head
    h = hidden[1]
    normed = small_params["final_norm"] * h / np.sqrt(np.mean(h * h, -1, keepdims=True) + SMALL.rms_norm_eps)
    np.testing.assert_allclose(logits, normed @ small_params["lm_head"], rtol=1e-12, atol=1e-12)


def test_tied_embeddings_use_embed_transpose(small_params):
    tied = SMALL.replace(tie_word_embeddings=True)
    params = {k: v for k, v in small_params.items() if k != "lm_head"}
    tokens = np.array([[3, 4, 5]])
    logits, hidden = ref.forward(params, tied, tokens, return_hidden=(1,))
    h = hidden[1]
    normed = params["final_norm"] * h / np.sqrt(np.mean(h * h, -1, keepdims=True) + tied.rms_norm_eps)
    np.testing.assert_allclose(logits, normed @ params["embed_tokens"].T, rtol=1e-12, atol=1e-12)
    with pytest.raises(KeyError, match="lm_head"):
        ref.forward(params, SMALL, tokens)


@pytest.mark.parametrize("bad, match", [
    (np.array([1, 2, 3]), r"\[B, S\]"),
    (np.array([[1, 400]]), "vocab_size"),
    (np.array([[1.0, 2.0]]), r"\[B, S\]"),
])
def test_forward_rejects_bad_tokens(small_params, bad, match):
    with pytest.raises(ValueError, match=match):
        ref.forward(small_params, SMALL, bad)


def test_forward_rejects_bad_hidden_layer(small_params):
    with pytest.raises(ValueError, match="return_hidden"):
        ref.forward(small_params, SMALL, np.array([[1]]), return_hidden=(2,))


# -------------------------------------------------------------------------------------- greedy
def test_greedy_generate_matches_argmax_rollout(small_params):
    prompt = [1, 17, 230, 5]
    new = ref.greedy_generate(small_params, SMALL, prompt, max_new_tokens=4)
    assert len(new) == 4
    # one forward over prompt + generated tokens: every generated token is the argmax at the
    # previous position (teacher forcing with its own outputs)
    logits = ref.forward(small_params, SMALL, np.array([prompt + new]))
    expected = [int(np.argmax(logits[0, len(prompt) - 1 + i])) for i in range(4)]
    assert new == expected


def test_greedy_generate_stops_on_stop_token(small_params):
    prompt = [1, 17, 230, 5]
    new = ref.greedy_generate(small_params, SMALL, prompt, max_new_tokens=4)
    stop = new[1]
    if stop == new[0]:
        pytest.skip("random params generated a repeated first token; the stop position is ambiguous")
    got = ref.greedy_generate(small_params, SMALL, prompt, max_new_tokens=4, stop_tokens=(stop,))
    assert got == new[:2]  # stop token included, nothing after it
    assert ref.greedy_generate(small_params, SMALL, prompt, max_new_tokens=0) == []
    with pytest.raises(ValueError, match="prompt"):
        ref.greedy_generate(small_params, SMALL, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ref.greedy_generate(small_params, SMALL, prompt, max_new_tokens=-1)
