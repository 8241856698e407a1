"""The target model against the NumPy float64 reference (reference/model.py)."""

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params, rel_err

import kdtree_jax as kj
from kdtree_jax import layers, model
from kdtree_jax.weights import cast_params
from pallas_kernels import dispatch
from pallas_kernels.int4 import Int4Weight
from reference import model as ref

VARIANTS = {
    "tiny": TINY,
    "no_q_lora_no_yarn": TINY.replace(q_lora_rank=None, rope_scaling=None, num_hidden_layers=3),
    "group_routing": TINY.replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                                  num_hidden_layers=3, first_k_dense_replace=2),
    "no_shared_tied": TINY.replace(n_shared_experts=0, tie_word_embeddings=True, num_hidden_layers=3,
                                   norm_topk_prob=False),
    "kimi_k2_yarn": TINY.replace(rope_scaling=kj.YarnScaling(32.0, 64, beta_fast=1.0, beta_slow=1.0,
                                                             mscale=1.0, mscale_all_dim=1.0),
                                 num_hidden_layers=2),
}


def test_rms_norm_and_rope_match_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    assert rel_err(layers.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5),
                   ref.rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-5)) < 1e-6
    inv_freq, factor = layers.yarn_inv_freq(TINY)
    np.testing.assert_allclose(inv_freq, ref.yarn_inv_freq(TINY), rtol=1e-12)
    assert factor == pytest.approx(ref.yarn_attention_factor(TINY))
    positions = np.array([[0, 3, 7, 100, 250]] * 2)
    y = layers.apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq, factor)
    assert rel_err(y, ref.apply_rope_interleaved(x.astype(np.float64), positions[0], TINY)) < 1e-5
    assert TINY.softmax_scale == pytest.approx(ref.softmax_scale(TINY), rel=1e-12)


def test_rms_norm_matmul_is_the_norm_then_the_product():
    """layers.rms_norm_matmul (the norm's row scale after the product: one launch fewer at one row) gives
    rms_norm(x) @ w: in float32 to rounding, in bf16 within bf16's rounding of the float64 truth; out_dtype float32
    keeps the product unrounded."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 64)) * 20).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    w = (rng.standard_normal((64, 40)) / 8).astype(np.float32)
    truth = ref.rms_norm(x.astype(np.float64), norm.astype(np.float64), 1e-5) @ w.astype(np.float64)
    got = layers.rms_norm_matmul(jnp.asarray(x), jnp.asarray(norm), 1e-5, jnp.asarray(w))
    assert got.dtype == jnp.float32 and rel_err(got, truth) < 1e-6
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, norm, w)]
    truth_bf = ref.rms_norm(np.asarray(bf[0], np.float64), np.asarray(bf[1], np.float64), 1e-5) @ np.asarray(
        bf[2], np.float64)
    got_bf = layers.rms_norm_matmul(*bf[:2], 1e-5, bf[2])
    unrounded = layers.rms_norm_matmul(*bf[:2], 1e-5, bf[2], out_dtype=jnp.float32)
    assert got_bf.dtype == jnp.bfloat16 and unrounded.dtype == jnp.float32
    assert rel_err(got_bf, truth_bf) < 1e-2 and rel_err(unrounded, truth_bf) < 1e-2
    assert rel_err(got_bf, layers.rms_norm(*bf[:2], 1e-5) @ bf[2]) < 1e-2
    one = layers.rms_norm_matmul(jnp.asarray(x[:1]), jnp.asarray(norm), 1e-5, jnp.asarray(w))  # the model's use
    assert one.shape == (1, 40) and rel_err(one, truth[:1]) < 1e-6


def test_rms_scales_of_parts_are_each_parts_rms_scale():
    """layers.rms_scales_of_parts (the MLA's two latent norms at one row: one reduction of [c_q | c_kv | k_pe]'s row
    instead of one a part) gives each part's own rms_scale, and rms_norm with it the part's rms_norm; the columns
    past the parts (the RoPE keys) count in neither."""
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((2, 1, 48 + 32 + 8)) * 5).astype(np.float32)
    a[..., 80:] = 1e6  # past the parts: a scale that counted them would be far off
    s_q, s_kv = layers.rms_scales_of_parts(jnp.asarray(a), (48, 32), 1e-6)
    for got, part in ((s_q, a[..., :48]), (s_kv, a[..., 48:80])):
        want = 1 / np.sqrt(np.mean(part.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
        assert got.shape == (2, 1, 1) and rel_err(got, want) < 1e-6
    w = rng.uniform(0.5, 1.5, 32).astype(np.float32)
    np.testing.assert_allclose(np.asarray(layers.rms_norm(jnp.asarray(a[..., 48:80]), jnp.asarray(w), 1e-6,
                                                          scale=s_kv)),
                               np.asarray(layers.rms_norm(jnp.asarray(a[..., 48:80]), jnp.asarray(w), 1e-6)),
                               rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "group_routing", "no_shared_tied"])
def test_routing_matches_reference(name):
    cfg = VARIANTS[name]
    params = random_params(cfg, seed=3)
    layer = params[f"layers_{cfg.first_k_dense_replace}"]["moe"]
    x = np.random.default_rng(1).standard_normal((9, cfg.hidden_size)).astype(np.float32)
    idx, weights = model.route(cfg, jnp.asarray(x), layer["router"], layer["router_bias"])
    ref_idx, ref_w = ref.moe_route(ref.to_float64(layer), cfg, x.astype(np.float64))
    order, ref_order = np.argsort(np.asarray(idx), -1), np.argsort(ref_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(ref_idx, ref_order, -1))
    assert rel_err(np.take_along_axis(np.asarray(weights), order, -1),
                   np.take_along_axis(ref_w, ref_order, -1)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_matches_reference(name):
    cfg = VARIANTS[name]
    params = random_params(cfg, seed=1)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 11))
    logits = kj.forward(params, cfg, tokens)
    assert logits.shape == (2, 11, cfg.vocab_size) and logits.dtype == jnp.float32
    assert rel_err(logits, ref.forward(params, cfg, tokens)) <= 1e-5


def test_absorbed_cache_forward_equals_naive_forward_and_hidden_states(tiny_params):
    tokens = np.random.default_rng(4).integers(0, TINY.vocab_size, (2, 9))
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    cache = kj.init_cache(TINY, 2, 16)
    logits, hidden, new_cache = jax.jit(
        lambda p, t, c: kj.forward_with_cache(p, TINY, t, positions, c, hidden_layers=(0, 4)))(
            tiny_params, jnp.asarray(tokens), cache)
    naive = kj.forward(tiny_params, TINY, tokens)
    assert rel_err(logits, naive) <= 1e-5
    ref_logits, ref_hidden = ref.forward(tiny_params, TINY, tokens, return_hidden=(0, 4))
    assert rel_err(hidden[:, :, 0], ref_hidden[0]) <= 1e-5
    assert rel_err(hidden[:, :, 1], ref_hidden[4]) <= 1e-5
    assert np.all(np.asarray(new_cache.latent[:, :, 9:]) == 0)  # nothing written past the new rows
    assert np.any(np.asarray(new_cache.latent[:, :, :9]) != 0)


def test_prefill_then_token_by_token_decode_equals_full_forward(tiny_params):
    seq = np.random.default_rng(5).integers(0, TINY.vocab_size, (1, 12))
    full = np.asarray(kj.forward(tiny_params, TINY, seq))
    step = jax.jit(lambda p, t, pos, c: kj.forward_with_cache(p, TINY, t, pos, c))
    cache = kj.init_cache(TINY, 1, 20)
    logits, _, cache = step(tiny_params, jnp.asarray(seq[:, :5]), jnp.arange(5)[None], cache)
    cache = cache._replace(lengths=jnp.array([5], jnp.int32))
    got = [np.asarray(logits[0])]
    for t in range(5, 12):
        logits, _, cache = step(tiny_params, jnp.asarray(seq[:, t:t + 1]), jnp.array([[t]]), cache)
        cache = cache._replace(lengths=cache.lengths + 1)
        got.append(np.asarray(logits[0]))
    assert rel_err(np.concatenate(got), full[0]) <= 1e-5


@pytest.mark.parametrize("folded", [False, True], ids=["separate", "folded"])
def test_decode_loop_writes_the_cache_in_place(tiny_params, folded):
    """A loop of cached forwards (the shape of generate's while loop, the cache donated) compiles to one in-place
    dynamic-update-slice of the whole [L, B, S, C] cache per layer: no op that builds a new whole cache (until
    2026-12-06 the layers' caches were sliced out and stacked again, which XLA compiled to a concatenate and a
    copy of the whole cache every forward, 4-6x its bytes: at K2.6 width and S = 32768 about 9-14 GB a step)."""
    params = model.fold_params(tiny_params, TINY) if folded else tiny_params
    cache = kj.init_cache(TINY, 1, 256)

    def loop(params, cache):
        def body(i, c):
            _, _, c = kj.forward_with_cache(params, TINY, jnp.zeros((1, 1), jnp.int32), c.lengths[:, None], c)
            return c._replace(lengths=c.lengths + 1)

        return jax.lax.fori_loop(0, 3, body, cache)

    hlo = jax.jit(loop, donate_argnums=1).lower(params, cache).compile().as_text()
    whole = "f32[{},{},{},{}]".format(*cache.latent.shape)
    # (instruction name, opcode) of each instruction whose result is a whole cache
    writes = [(m[1], m[2]) for m in re.finditer(r"%(\S+) = " + re.escape(whole) + r"\{[\d,]*\} ([\w-]+)\(", hlo)]
    assert not [(n, op) for n, op in writes if op in ("concatenate", "copy") or "concatenate" in n], writes
    assert sum("dynamic-update-slice" in n + op or "scatter" in op for n, op in writes) >= TINY.num_hidden_layers
    latent = np.asarray(jax.jit(loop)(params, cache).latent[:, 0])  # the loop writes rows 0, 1, 2 of every layer
    assert (np.abs(latent[:, :3]).sum(-1) > 0).all() and not latent[:, 3:].any()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("layer", [None, 1])
def test_write_rows_writes_each_batch_rows_at_its_start(batch, layer):
    """write_rows puts row t of batch row b at slot start[b] + t (of `layer` in a whole [L, B, S, C] cache) and
    leaves every other slot as it was; at batch 1 as one dynamic_update_slice (no scatter: XLA runs a scatter as a
    bounds check, a read of the old rows and the write, three launches where this is one)."""
    rng = np.random.default_rng(batch)
    shape = (batch, 16, 5) if layer is None else (2, batch, 16, 5)
    latent = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((batch, 3, 5)), jnp.float32)
    start = jnp.asarray([13, 4, 0][:batch], jnp.int32)  # 13 + 3 = S: the last rows of the cache
    got = np.asarray(model.write_rows(latent, rows, start, layer))
    want = np.array(latent)
    for b in range(batch):
        target = want[b] if layer is None else want[layer, b]
        target[int(start[b]):int(start[b]) + 3] = rows[b]
    np.testing.assert_array_equal(got, want)
    jaxpr = str(jax.make_jaxpr(model.write_rows, static_argnums=3)(latent, rows, start, layer))
    assert ("scatter" in jaxpr) == (batch > 1) and ("dynamic_update_slice" in jaxpr) == (batch == 1), jaxpr


def test_cached_forward_refuses_rows_past_the_cache(tiny_params):
    """With concrete lengths, forward_with_cache refuses new rows that would not fit the cache (a batch-1 write
    would clamp onto committed rows) and runs the ones that end at its last row."""
    cache = kj.init_cache(TINY, 1, 8)._replace(lengths=jnp.asarray([6], jnp.int32))
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="3 new rows at length 6 do not fit a cache of 8 rows"):
        kj.forward_with_cache(tiny_params, TINY, tokens, 6 + jnp.arange(3)[None], cache)
    _, _, written = kj.forward_with_cache(tiny_params, TINY, tokens[:, :2], 6 + jnp.arange(2)[None], cache)
    assert np.abs(np.asarray(written.latent[:, 0, 6:])).sum() > 0 and not np.asarray(written.latent[:, 0, :6]).any()


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("name", ["tiny", "no_q_lora_no_yarn"])
def test_folded_mla_projections_match_the_separate_ones_and_the_reference(name, transposed, monkeypatch):
    """fold_params (W_UK in q_b, W_UV in o, q_a | kv_a one matrix; without a q_lora the folded query in that one
    matrix; every MLP's entry matrices one matrix): a prefill and a decode step on the folded projections match the
    separate ones and the float64 reference, write the same cache rows, and the separate path is what runs without
    the fold. With and without the transposed copies a GPU gets (a one-row decode step runs on them)."""
    monkeypatch.setattr(dispatch, "fold_transposed", lambda device=None: transposed)
    cfg = VARIANTS[name]
    params = random_params(cfg, seed=8)
    folded = model.fold_params(params, cfg)
    layer = folded["layers_0"]["attn"]["folded"]
    assert isinstance(layer, model.FoldedMLA) and (layer.q_b is None) == (cfg.q_lora_rank is None)
    assert "folded" not in params["layers_0"]["attn"]  # params themselves untouched
    d, dense = cfg.hidden_size, cfg.first_k_dense_replace
    mlp_entry, moe_entry = folded["layers_0"]["mlp"]["entry"], folded[f"layers_{dense}"]["moe"]["entry"]
    for matrix in (mlp_entry, moe_entry, layer.o, layer.proj_a):
        assert (matrix.w_t is not None) == transposed
        if transposed:
            np.testing.assert_array_equal(matrix.w_t, matrix.w.T)
    assert mlp_entry.w.shape == (d, 2 * cfg.intermediate_size)
    assert moe_entry.w.shape == (d, cfg.n_routed_experts + 2 * cfg.shared_intermediate_size)
    np.testing.assert_array_equal(moe_entry.w[:, :cfg.n_routed_experts],  # [router | shared gate | up]
                                  params[f"layers_{dense}"]["moe"]["router"])
    assert "entry" not in params[f"layers_{dense}"]["moe"]
    seq = np.random.default_rng(9).integers(0, cfg.vocab_size, (2, 10))
    step = jax.jit(lambda p, t, pos, c: kj.forward_with_cache(p, cfg, t, pos, c))
    got = {}
    for label, p in (("separate", params), ("folded", folded)):
        cache = kj.init_cache(cfg, 2, 16)
        logits, _, cache = step(p, jnp.asarray(seq[:, :9]), jnp.broadcast_to(jnp.arange(9), (2, 9)), cache)
        cache = cache._replace(lengths=jnp.array([9, 9], jnp.int32))
        last, _, cache = step(p, jnp.asarray(seq[:, 9:]), jnp.full((2, 1), 9), cache)
        got[label] = (np.concatenate([np.asarray(logits), np.asarray(last)], axis=1), np.asarray(cache.latent))
    assert rel_err(got["folded"][0], got["separate"][0]) <= 1e-5
    assert rel_err(got["folded"][1], got["separate"][1]) <= 1e-5
    assert not np.array_equal(got["folded"][0], got["separate"][0])  # really another computation
    assert rel_err(got["folded"][0], ref.forward(params, cfg, seq)) <= 1e-5
    cache = kj.init_cache(cfg, 1, 16)  # batch 1: the decode step's products have one row
    _, _, cache = step(folded, jnp.asarray(seq[:1, :9]), jnp.arange(9)[None], cache)
    one, _, _ = step(folded, jnp.asarray(seq[:1, 9:]), jnp.full((1, 1), 9), cache._replace(lengths=jnp.array([9])))
    assert rel_err(np.asarray(one)[0, 0], got["separate"][0][0, -1]) <= 1e-5


def test_folded_matrix_takes_its_transposed_copy_for_one_row_only():
    """Matrix: x @ W from w_t [N, K] for a one-row x, from w [K, N] otherwise (shown by giving the two copies
    different contents); without a copy always from w."""
    w = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    marked = model.Matrix(jnp.asarray(w), jnp.asarray(2 * w.T))  # the copy holds 2 W^T
    one, rows = jnp.ones((1, 1, 6), jnp.float32), jnp.ones((2, 3, 6), jnp.float32)
    np.testing.assert_allclose(marked(one), 2 * np.ones((1, 1, 6)) @ w, rtol=1e-6)
    np.testing.assert_allclose(marked(rows), np.ones((2, 3, 6)) @ w, rtol=1e-6)
    plain = model.Matrix.of(jnp.asarray(w), transposed=False)
    assert plain.w_t is None
    np.testing.assert_allclose(plain(one), np.ones((1, 1, 6)) @ w, rtol=1e-6)


def test_fold_keeps_mlp_entries_apart_where_one_matrix_cannot_hold_them():
    """bf16 weights beside the float32 router: the MoE entry stays separate (concatenating would round the router),
    the dense MLP's gate | up is still one matrix; an INT4 shared expert (policy experts+shared) is never
    concatenated. The folded forward still matches the separate one."""
    params = random_params(TINY, seed=4, dtype=jnp.bfloat16)
    dense = TINY.first_k_dense_replace
    folded = model.fold_params(params, TINY)
    assert "entry" not in folded[f"layers_{dense}"]["moe"] and "entry" in folded["layers_0"]["mlp"]
    quantized = model.fold_params(kj.quantize(random_params(TINY, seed=4), TINY, policy="experts+shared"), TINY)
    assert "entry" not in quantized[f"layers_{dense}"]["moe"]
    seq = jnp.asarray(np.random.default_rng(3).integers(0, TINY.vocab_size, (1, 6)))
    step = jax.jit(lambda p: kj.forward_with_cache(p, TINY, seq, jnp.arange(6)[None], kj.init_cache(TINY, 1, 8))[0])
    # bf16: the folded MLA matrices are rounded to bf16 as products (about 2% here); a wrong fold is O(1)
    assert rel_err(np.asarray(step(folded), np.float32), np.asarray(step(params), np.float32)) <= 4e-2


def test_folding_rule_follows_the_extra_bytes():
    """auto folds a small model's projections, not K2.6's (392 MiB more a layer) and never on a mesh; an explicit
    choice wins, and 'folded' on a mesh is an error."""

    abstract = {"embed_tokens": jax.ShapeDtypeStruct((1, 1), jnp.bfloat16)}
    assert model.mla_choice(TINY, abstract).impl == "folded"
    k26 = model.mla_choice(kj.ModelConfig.kimi_k26(), abstract)
    assert k26 == dispatch.Choice("separate", "folding would add 392 MiB of weights a layer")
    assert model.mla_choice(TINY, abstract, sharded=True) == dispatch.Choice("separate", "sharded over a mesh")
    assert model.mla_choice(TINY, abstract, kj.Kernels(mla="separate")).reason == "asked for"
    assert model.mla_choice(kj.ModelConfig.kimi_k26(), abstract, kj.Kernels(mla="folded")).impl == "folded"
    with pytest.raises(dispatch.KernelUnavailableError, match="mla impl='folded' cannot run: the folded"):
        model.mla_choice(TINY, abstract, kj.Kernels(mla="folded"), sharded=True)
    params = random_params(TINY, seed=0)
    assert model.fold_params(params, TINY, kj.Kernels(mla="separate"), sharded=True) is params


def test_separate_mla_runs_its_latent_maps_laid_out_by_head(tiny_params):
    """Where the MLA projections stay separate (asked for here; K2.6 by size), fold_params lays each layer's W_UK and
    W_UV out by head (attn/"per_head": kv_b's values, [H, c, n] and [H, v, c]) and the cached forward runs them: a
    per-head W_UK of twice and W_UV of three times the values give the logits of a kv_b so scaled, and the unchanged
    layout the logits of kv_b itself (float32)."""
    heads, nope, vdim, c = TINY.num_attention_heads, TINY.qk_nope_head_dim, TINY.v_head_dim, TINY.kv_lora_rank
    separate = model.fold_params(tiny_params, TINY, kj.Kernels(mla="separate"))
    per_head = separate["layers_0"]["attn"]["per_head"]
    kv_b = np.asarray(tiny_params["layers_0"]["attn"]["kv_b"]).reshape(c, heads, nope + vdim)
    np.testing.assert_array_equal(per_head.uk, kv_b[..., :nope].transpose(1, 0, 2))
    np.testing.assert_array_equal(per_head.uv, kv_b[..., nope:].transpose(1, 2, 0))
    assert "folded" not in separate["layers_0"]["attn"] and "per_head" not in tiny_params["layers_0"]["attn"]
    doubled_kv_b = kv_b.copy()
    doubled_kv_b[..., :nope] *= 2  # W_UK
    doubled_kv_b[..., nope:] *= 3  # W_UV
    doubled = {**tiny_params, "layers_0": {**tiny_params["layers_0"], "attn": {
        **tiny_params["layers_0"]["attn"], "kv_b": jnp.asarray(doubled_kv_b.reshape(c, -1))}}}
    marked = {**separate, "layers_0": {**separate["layers_0"], "attn": {
        **separate["layers_0"]["attn"], "per_head": model.PerHeadMLA(uk=2 * per_head.uk, uv=3 * per_head.uv)}}}
    seq = jnp.asarray(np.random.default_rng(2).integers(0, TINY.vocab_size, (1, 7)))
    step = jax.jit(lambda p: kj.forward_with_cache(p, TINY, seq, jnp.arange(7)[None], kj.init_cache(TINY, 1, 8))[0])
    assert rel_err(step(separate), step(tiny_params)) < 1e-5
    assert rel_err(step(marked), step(doubled)) < 1e-5 and rel_err(step(marked), step(tiny_params)) > 1e-2


def _dot_rhs_shapes(fn, *args) -> list[tuple[int, ...]]:
    """The right-hand operand shapes of every dot_general fn traces (nested jaxprs included)."""
    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                yield tuple(e.invars[1].aval.shape)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_separate_mla_projects_x_once():
    """The separate MLA multiplies x by q_a and kv_a as one matrix [q_a | kv_a] (one product; at one token XLA ran
    the narrow kv_a alone as a product and a reduction), not where one of them is INT4."""
    params = random_params(TINY, seed=1)
    joined = (TINY.hidden_size, TINY.q_lora_rank + TINY.kv_lora_rank + TINY.qk_rope_head_dim)

    def rhs_shapes(p):
        cache = kj.init_cache(TINY, 1, 4)
        one = jnp.zeros((1, 1), jnp.int32)
        return _dot_rhs_shapes(lambda p: kj.forward_with_cache(p, TINY, one, one, cache), p)

    assert rhs_shapes(params).count(joined) == TINY.num_hidden_layers
    quantized = {**params, "layers_0": {**params["layers_0"], "attn": {
        **params["layers_0"]["attn"], "kv_a": Int4Weight.from_dense(params["layers_0"]["attn"]["kv_a"])}}}
    assert rhs_shapes(quantized).count(joined) == TINY.num_hidden_layers - 1


def _checkpoint_routers(params):
    """params with every router's values rounded to bf16 and held in float32, as kdtree_jax.hf loads a K2.x
    checkpoint's (the file stores them in bf16)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(jnp.bfloat16).astype(jnp.float32)
        if jax.tree_util.keystr(path).endswith("['router']") else x, params)


def test_prepare_params_keeps_a_checkpoints_router_in_bf16():
    """prepare_params (kernels.prepare_routers) stores a float32 router that holds bf16 values (a K2.x checkpoint's,
    read into float32) in bf16 for a bf16 model; a router with float32 values, a float32 model and abstract params
    keep theirs (nothing converted: the same tree back)."""
    cfg = TINY
    params = cast_params(random_params(cfg, seed=5), jnp.bfloat16, cfg)
    moe = cfg.first_k_dense_replace
    router = params[f"layers_{moe}"]["moe"]["router"]
    assert router.dtype == jnp.float32 and not bool(jnp.all(router.astype(jnp.bfloat16).astype(jnp.float32) == router))
    assert kj.prepare_params(params, cfg) is params  # float32 values: kept
    as_loaded = _checkpoint_routers(params)
    prepared = kj.prepare_params(as_loaded, cfg)
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        got, was = prepared[f"layers_{layer}"]["moe"]["router"], as_loaded[f"layers_{layer}"]["moe"]["router"]
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(was))
        assert prepared[f"layers_{layer}"]["moe"]["router_bias"].dtype == jnp.float32
    f32 = cast_params(as_loaded, jnp.float32, cfg)
    assert kj.prepare_params(f32, cfg) is f32
    abstract = jax.eval_shape(lambda p: kj.prepare_params(p, cfg), as_loaded)
    assert abstract[f"layers_{moe}"]["moe"]["router"].dtype == jnp.float32


def test_moe_runs_router_and_shared_expert_as_one_product(monkeypatch):
    """With the router in the activations' dtype (prepare_params: a checkpoint's bf16 router) the MoE multiplies x by
    [router | shared gate | shared up] once, for one row (the post-attention norm's row scale then after the
    product), two rows of one token each and a prefill, folded or not; the router's logits stay float32 and choose
    the experts the float32 router (its own product) chooses; the outputs agree to bf16 rounding."""
    cfg = TINY
    params = _checkpoint_routers(cast_params(random_params(cfg, seed=6), jnp.bfloat16, cfg))
    prepared = kj.prepare_params(params, cfg)
    layer = f"layers_{cfg.first_k_dense_replace}"
    joined = (cfg.hidden_size, cfg.n_routed_experts + 2 * cfg.moe_intermediate_size * cfg.n_shared_experts)
    routed = []  # (logits dtype, chosen experts) of every route_logits call
    real_route_logits = model.route_logits

    def spy(cfg_, logits, bias):
        idx, weights = real_route_logits(cfg_, logits, bias)
        routed.append((logits.dtype, idx))
        return idx, weights

    monkeypatch.setattr(model, "route_logits", spy)
    rng = np.random.default_rng(3)
    norm = params[layer]["post_attn_norm"]
    for rows, steps in ((1, 1), (2, 1), (1, 4)):
        h = jnp.asarray(rng.standard_normal((rows, steps, cfg.hidden_size)) * 4, jnp.bfloat16)
        outs, chosen = [], []
        for p in (prepared, params):  # bf16 router (joined), float32 router (route's own product)
            moe = model.MoE(cfg, jnp.bfloat16)
            fn = functools.partial(moe.apply, {"params": p[layer]["moe"]})
            shapes = _dot_rhs_shapes(fn, h, norm)
            assert shapes.count(joined) == (1 if p is prepared else 0), (rows, steps, shapes)
            routed.clear()
            outs.append(fn(h, norm))
            assert [dtype for dtype, _ in routed] == [jnp.float32]
            chosen.append(np.sort(np.asarray(routed[0][1]), -1))
        np.testing.assert_array_equal(chosen[0], chosen[1])
        assert rel_err(outs[0], outs[1]) < 2e-2, (rows, steps)
    folded = model.fold_params(prepared, cfg)  # TINY folds: the joined matrix is its moe/"entry"
    assert folded[layer]["moe"]["entry"].w.shape == joined
    routed.clear()
    seq = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 3)))
    kj.forward_with_cache(folded, cfg, seq, jnp.arange(3)[None], kj.init_cache(cfg, 1, 4, jnp.bfloat16))
    assert routed and all(dtype == jnp.float32 for dtype, _ in routed)


def test_small_top_k_is_lax_top_k():
    """model.small_top_k (the router's top-k by comparing all pairs) returns lax.top_k's values and indices, ties
    to the lower index, on rows with many ties and -inf entries (the group-limited routing's), with NaN and signed
    zeros (lax.top_k's total order), on integers, with leading dims;
    a prefill's many rows run lax.top_k itself; k out of range is refused. The routing it serves lowers without a
    top_k (which XLA compiles to a sort: 5.6 us a layer on an H100 at K2.6's 384 experts) for a decode step."""
    rng = np.random.default_rng(0)
    for shape, k in (((1, 384), 8), ((9, 384), 8), ((3, 8), 2), ((2, 5, 48), 2), ((4, 16), 16), ((1, 1), 1)):
        for x in (rng.integers(-3, 3, size=shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)):
            x[..., :1] = -np.inf
            values, idx = model.small_top_k(jnp.asarray(x), k)
            want_values, want_idx = jax.lax.top_k(jnp.asarray(x), k)
            assert idx.dtype == jnp.int32
            np.testing.assert_array_equal(idx, want_idx)
            np.testing.assert_array_equal(values, want_values)
    for row, k in (([1, np.nan, 2, -np.inf, -np.inf], 3), ([-0.0, 0.0, -0.0, 0.0], 2), ([np.nan, 1, np.nan, 0], 3)):
        x = jnp.asarray([row], jnp.float32)  # NaN above everything, -0 below +0: lax.top_k's order
        np.testing.assert_array_equal(model.small_top_k(x, k)[1], jax.lax.top_k(x, k)[1])
    ints = jnp.asarray(rng.integers(-5, 5, (3, 16)), jnp.int32)
    np.testing.assert_array_equal(model.small_top_k(ints, 4)[1], jax.lax.top_k(ints, 4)[1])
    many = jnp.asarray(rng.standard_normal((200, 384)).astype(np.float32))
    assert "chlo.top_k" in jax.jit(lambda x: model.small_top_k(x, 8)).lower(many).as_text()
    np.testing.assert_array_equal(model.small_top_k(many, 8)[1], jax.lax.top_k(many, 8)[1])
    with pytest.raises(ValueError, match="k=9 must be in"):
        model.small_top_k(jnp.zeros((1, 8)), 9)
    k26 = kj.ModelConfig.kimi_k26()
    logits = jnp.zeros((1, k26.n_routed_experts), jnp.float32)
    lowered = jax.jit(lambda lg, b: model.route_logits(k26, lg, b)).lower(logits, logits[0]).as_text()
    assert "chlo.top_k" not in lowered and "stablehlo.sort" not in lowered


def test_bf16_forward_runs_and_tracks_float32(tiny_params):
    tokens = np.random.default_rng(6).integers(0, TINY.vocab_size, (1, 8))
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim and
                        a.shape != (TINY.hidden_size, TINY.n_routed_experts) and
                        a.shape != (TINY.n_routed_experts,) else a, tiny_params)
    logits = kj.forward(bf16, TINY, tokens)
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(logits)))
    assert rel_err(logits, kj.forward(tiny_params, TINY, tokens)) < 0.1


def test_forward_rejects_bad_tokens(tiny_params):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kj.forward(tiny_params, TINY, np.array([[1, TINY.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kj.forward(tiny_params, TINY, np.array([[-1, 2]]))
    with pytest.raises(ValueError, match="integer array"):
        kj.forward(tiny_params, TINY, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="integer array"):
        kj.forward(tiny_params, TINY, np.array([[1.0, 2.0]]))


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_forward_rejects_empty_tokens(tiny_params, shape):
    with pytest.raises(ValueError, match=rf"at least one token, got shape \[{shape[0]}, {shape[1]}\]"):
        kj.forward(tiny_params, TINY, np.zeros(shape, np.int32))


def test_forward_rejects_sequences_past_max_position_embeddings(tiny_params):
    limit = TINY.max_position_embeddings
    with pytest.raises(ValueError, match=f"sequence length {limit + 1} exceeds .*max_position_embeddings={limit}"):
        kj.forward(tiny_params, TINY, np.ones((1, limit + 1), np.int32))


def test_kimi_k26_preset_abstract_shapes():
    cfg = kj.ModelConfig.kimi_k26()
    abstract = jax.eval_shape(lambda: kj.init_params(cfg.replace(num_hidden_layers=2), jax.random.key(0),
                                                     jnp.bfloat16))
    attn = abstract["layers_1"]["attn"]
    assert attn["q_b"].shape == (1536, 64 * 192) and attn["kv_b"].shape == (512, 64 * 256)
    assert attn["kv_a"].shape == (7168, 576) and cfg.latent_dim == 576
    assert abstract["layers_1"]["moe"]["experts"]["gate"].shape == (384, 7168, 2048)
    assert abstract["layers_0"]["mlp"]["gate"].shape == (7168, 18432)
    assert cfg.softmax_scale == pytest.approx(0.144680, abs=1e-6)
