"""The Mosaic GPU tree-attention kernel (pallas_kernels/tree_attention/mosaic_gpu.py, its two schedules) against the
float64 NumPy truth of test_tree_attention.py: Mosaic GPU interpret mode on CPU (race detector on, tiny shapes),
its CUDA lowering at K2 shapes against an abstract H200, and natively on a Hopper GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import custom_calls, lower_for_h200
from test_tree_attention import HAS_GPU, make_inputs, numpy_tree_attention, rel_err

from pallas_kernels import dispatch
from pallas_kernels.tree_attention.mosaic_gpu import MosaicAttentionConfig, tree_attention_mosaic


def _mgpu_interpret():
    from pallas_kernels.w4a16.mosaic_gpu import gpu_interpret_params

    return gpu_interpret_params(detect_races=True)


def _run_interpret(q, cache, start, tree, *, value_dim, config):
    """Runs the kernel in GPU interpret mode and checks the race detector; resets the interpreter after."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races, reset_gpu_interpret_mode_state

    try:
        out = jax.block_until_ready(tree_attention_mosaic(  # the interpreter runs at execution (async)
            q, cache, start, tree, scale=0.3 / np.sqrt(q.shape[-1]), value_dim=value_dim, config=config,
            interpret=_mgpu_interpret()))
        assert not get_races().races_found
    finally:
        reset_gpu_interpret_mode_state()
    return out


# (B, T, H, c, r, S_max, starts, config, chain). Every case has NaN in the rows >= start + T.
CASES = [
    # random tree, B = 2 with different starts, neither tile aligned; two warpgroups (value_block 64 of c 128)
    # sharing one QK^T (P handed over in SMEM)
    (2, 5, 16, 128, 32, 150, [37, 145], MosaicAttentionConfig(value_block=64, schedule="shared_qk"), False),
    # chain, start = 0 (no prefix tile: the tail alone), T * H = 80 rows: a padded second row tile
    (1, 5, 16, 64, 16, 64, [0], MosaicAttentionConfig(), True),
    # start + T == S_max, S_max not a multiple of block_kv: the last tile is moved back and overlaps
    (1, 6, 8, 64, 16, 100, [94], MosaicAttentionConfig(), False),
    # T = 1 (decode), 4 KV splits (some with no prefix tile) and the LSE combine
    (1, 1, 16, 64, 16, 300, [250], MosaicAttentionConfig(num_splits=4), True),
    # T = 1 without mask words: B = 2, one start on a tile boundary (the tail tile is the token alone), one at
    # start + 1 == S_max; two warpgroups, both schedules, splits
    (2, 1, 16, 128, 16, 300, [128, 299], MosaicAttentionConfig(num_splits=3, value_block=64, schedule="replicated"),
     False),
    (2, 1, 16, 128, 16, 300, [128, 299], MosaicAttentionConfig(num_splits=2, value_block=64, schedule="shared_qk"),
     False),
    # splits with empty shares (start 0) next to a long prefix, r = 32
    (2, 5, 8, 64, 32, 100, [0, 95], MosaicAttentionConfig(num_splits=3), False),
    # T = 40 > 32: two mask words per row; block_kv 128
    (1, 40, 8, 64, 16, 200, [100], MosaicAttentionConfig(block_kv=128), False),
    # cache shorter than a tile (padded by the wrapper)
    (2, 3, 8, 64, 16, 10, [7, 2], MosaicAttentionConfig(), False),
    # two warpgroups sharing QK^T, splits and a 3-deep ring over a 4-tile prefix
    (2, 3, 16, 128, 16, 300, [200, 5], MosaicAttentionConfig(num_splits=2, value_block=64, max_concurrent_steps=3,
                                                             schedule="shared_qk"), False),
    # the replicated schedule (each warpgroup its own QK^T): two warpgroups, a tail tile over the tree, splits
    (2, 5, 16, 128, 32, 150, [37, 145], MosaicAttentionConfig(value_block=64, schedule="replicated"), False),
    (1, 3, 16, 128, 16, 300, [200], MosaicAttentionConfig(num_splits=3, value_block=64, schedule="replicated"),
     True),
    # T = 70: three mask words (word 2 picked for tree positions 64..69), two tail tiles of which only the second
    # reaches past start + T (the only one whose garbage rows are zeroed); H = 2: 140 rows, three row tiles
    (1, 70, 2, 64, 16, 200, [37], MosaicAttentionConfig(), False),
    # shared_qk over a tree of 40 tokens (two mask words) with block_kv 128 and two warpgroups
    (1, 40, 8, 128, 16, 200, [100], MosaicAttentionConfig(block_kv=128, value_block=64, schedule="shared_qk"),
     False),
]


@pytest.mark.parametrize("B,T,H,c,r,S_max,starts,config,chain", CASES)
def test_mgpu_interpret_matches_numpy(B, T, H, c, r, S_max, starts, config, chain):
    q, cache, start, tree, truth = make_inputs(7, B=B, T=T, H=H, c=c, r=r, S_max=S_max, starts=starts,
                                               dtype=jnp.bfloat16, chain=chain)
    out = _run_interpret(q, cache, start, tree, value_dim=c, config=config)
    assert out.shape == (B, T, H, c) and out.dtype == jnp.bfloat16
    assert not np.isnan(np.asarray(out, np.float32)).any()
    # bf16 output rounding (2^-9), bf16 probabilities in the value wgmma (split partials: bf16 too)
    assert rel_err(out, truth) < 2e-2


def _growing_inputs(seed, *, T, H, c, r, S_max, start, bk=64):
    """make_inputs with the cache row j scaled by 1 + j / 4: scores grow along the cache, so some row's softmax
    maximum jumps by more than 8 in log2 units (a factor 256 on its probabilities) in at least two prefix tiles after
    the first (checked here). With the random caches of the other cases such jumps are rare after the first tile
    (where the accumulator is still zero), so an online-softmax rescale that were skipped, or applied to the wrong
    rows, after the first tile could pass them. -> (q, cache, start, tree, truth, scale)"""
    q, cache, start_j, tree, _ = make_inputs(seed, B=1, T=T, H=H, c=c, r=r, S_max=S_max, starts=[start],
                                             dtype=jnp.bfloat16)
    cache = (cache.astype(jnp.float32) * (1 + jnp.arange(S_max, dtype=jnp.float32) / 4)[None, :, None]).astype(
        jnp.bfloat16)
    scale = 0.3 / np.sqrt(c + r)
    truth = numpy_tree_attention(np.asarray(q.astype(jnp.float32)), np.asarray(cache.astype(jnp.float32)),
                                 np.asarray(start_j), np.asarray(tree), scale, c)
    logits = np.einsum("thd,sd->ths", np.asarray(q[0], np.float64), np.asarray(cache[0, :start], np.float64))
    tile_max = logits.reshape(T * H, -1)[:, :start // bk * bk].reshape(T * H, -1, bk).max(-1)
    ref, moves = tile_max[:, 0], 0
    for i in range(1, tile_max.shape[1]):
        move = (tile_max[:, i] - ref) * scale * np.log2(np.e) > 8
        moves += int(move.any())
        ref = np.where(move, tile_max[:, i], ref)
    assert moves >= 2
    return q, cache, start_j, tree, truth, scale


@pytest.mark.parametrize("T,schedule", [(1, "replicated"), (5, "shared_qk"), (5, "replicated")])
def test_mgpu_interpret_rescales_when_a_later_tile_moves_the_maximum(T, schedule):
    """The online softmax's rescale where the maximum moves after the first tile (`_growing_inputs`)."""
    q, cache, start, tree, truth, _ = _growing_inputs(10, T=T, H=16, c=128, r=16, S_max=300, start=250)
    out = _run_interpret(q, cache, start, tree, value_dim=128,
                         config=MosaicAttentionConfig(value_block=64, schedule=schedule))
    assert rel_err(out, truth) < 2e-2


def test_mgpu_interpret_float16():
    q, cache, start, tree, truth = make_inputs(8, B=1, T=4, H=16, c=64, r=16, S_max=90, starts=[70],
                                               dtype=jnp.float16)
    out = _run_interpret(q, cache, start, tree, value_dim=64, config=MosaicAttentionConfig())
    assert out.dtype == jnp.float16
    assert rel_err(out, truth) < 1e-2


def test_mgpu_argument_errors():
    kw = dict(scale=0.1, value_dim=64)
    q, cache, start, tree, _ = make_inputs(9, B=1, T=2, H=8, c=64, r=16, S_max=20, starts=[5], dtype=jnp.float32)
    with pytest.raises(ValueError, match="bf16 or f16"):
        tree_attention_mosaic(q, cache, start, tree, **kw)
    q, cache = q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        tree_attention_mosaic(q, cache, start, tree, scale=0.1, value_dim=48)
    with pytest.raises(ValueError, match="value_dim must be in"):
        tree_attention_mosaic(q, cache, start, tree, scale=0.1, value_dim=80)
    with pytest.raises(ValueError, match="cannot run in GPU interpret mode"):
        tree_attention_mosaic(q, cache, start, tree, **kw, config=MosaicAttentionConfig(p_operand="registers"),
                              interpret=_mgpu_interpret())
    with pytest.raises(ValueError, match="block_kv"):
        tree_attention_mosaic(q, cache, start, tree, **kw, config=MosaicAttentionConfig(block_kv=32))
    with pytest.raises(ValueError, match="schedule must be"):
        tree_attention_mosaic(q, cache, start, tree, **kw, config=MosaicAttentionConfig(schedule="seesaw"))
    # split_rows was built, measured slower than both on an H100 (2026-12-05) and removed: refused by name
    with pytest.raises(ValueError, match=r"schedule must be one of \('shared_qk', 'replicated'\), got 'split_rows'"):
        tree_attention_mosaic(q, cache, start, tree, **kw, config=MosaicAttentionConfig(schedule="split_rows"))
    # natively the cache rows' TMA copies are tiled by 64 columns: c + r = 80 fails to lower (as measured by the
    # lowering), so it is refused up front; interpret mode takes it (the tiny shapes above)
    with pytest.raises(ValueError, match="row width c \\+ r = 80 not a multiple of 64"):
        tree_attention_mosaic(q, cache, start, tree, **kw)
    q, cache, start, tree, _ = make_inputs(9, B=1, T=2, H=8, c=64, r=24, S_max=20, starts=[5], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="RoPE width 24 not a power of two"):
        tree_attention_mosaic(q, cache, start, tree, **kw)
    q, cache, start, tree, _ = make_inputs(9, B=1, T=2, H=8, c=192, r=16, S_max=20, starts=[5], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="value_block = 64 must"):
        tree_attention_mosaic(q, cache, start, tree, scale=0.1, value_dim=192,
                              config=MosaicAttentionConfig(value_block=64))  # 3 warpgroups
    q, cache, start, tree, _ = make_inputs(9, B=1, T=2, H=8, c=128, r=16, S_max=20, starts=[5], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="shared_qk hands P over in SMEM"):
        tree_attention_mosaic(q, cache, start, tree, scale=0.1, value_dim=128,
                              config=MosaicAttentionConfig(value_block=64, p_operand="registers",
                                                           schedule="shared_qk"))
    # the kernel keeps the running maximum of unscaled scores (the scale multiplies inside exp2): it must be > 0
    for scale in (0.0, -0.1):
        with pytest.raises(ValueError, match="scale must be a positive number"):
            tree_attention_mosaic(q, cache, start, tree, scale=scale, value_dim=128, interpret=_mgpu_interpret())


def _lowered_for_h200(B, T, H, c, r, S_max, dtype, config) -> str:
    """The call's program at these shapes lowered for an abstract H200 (no GPU needed), as text."""
    S = jax.ShapeDtypeStruct
    args = (S((B, T, H, c + r), dtype), S((B, S_max, c + r), dtype), S((B,), jnp.int32), S((B, T, T), jnp.bool_))

    def fn(q, cache, start, mask):
        return tree_attention_mosaic(q, cache, start, mask, scale=0.04, value_dim=c, config=config)

    return lower_for_h200(fn, *args)


def _mosaic_calls_lowered_for_h200(B, T, H, c, r, S_max, dtype, config) -> int:
    """The Mosaic GPU custom calls of the call lowered for an abstract H200 (`_lowered_for_h200`)."""
    return custom_calls(_lowered_for_h200(B, T, H, c, r, S_max, dtype, config)).count("mosaic_gpu_v2")


@pytest.mark.parametrize("schedule", ["shared_qk", "replicated"])
def test_mgpu_lowers_for_cuda_at_k2_shapes(schedule):
    """The native forms (block_kv 64, 2-deep ring, 2 warpgroups; shared_qk: P handed over in SMEM, replicated:
    register-A P) lower to one Mosaic GPU custom call for an abstract H200 at K2 shapes (c 512, r 64, H 64, bf16):
    both fit the 227 KiB of shared memory."""
    # S_max + T rows, not a multiple of 64: the wrapper pads (Mosaic GPU's layout inference asserts otherwise)
    for T, S_max, splits in [(1, 32768, 64), (33, 4096, 2), (129, 4096, 1), (1, 4097, 16), (33, 4129, 2)]:
        config = MosaicAttentionConfig(num_splits=splits, schedule=schedule)
        assert _mosaic_calls_lowered_for_h200(1, T, 64, 512, 64, S_max, jnp.bfloat16, config) == 1


def test_mgpu_at_t1_builds_no_mask_words():
    """An AR step (T = 1) passes the kernel no tree-mask words: no XLA op builds them (the shifts of
    tree_mask_bits are absent from the lowered program), while T = 2 has them."""
    texts = {T: _lowered_for_h200(1, T, 64, 512, 64, 4096, jnp.bfloat16, MosaicAttentionConfig(num_splits=8))
             for T in (1, 2)}
    assert "shift_left" not in texts[1] and "shift_left" in texts[2]


def test_split_combine_matches_numpy_in_two_reductions():
    """combine_splits (the split-KV combine) against the float64 NumPy softmax-weighted mean of the splits: LSEs far
    apart (2^300 would overflow float32 without the max shift), rows with some splits empty (lse NEG, output 0) and a
    row whose every split is empty (a padded row: a finite output). The lowered program has two reductions (each
    row's total LSE, the weighted sum), not the three of the textbook form it replaced (max, sum of weights,
    weighted sum: five kernels on an H100 against three, and 8.9 against 6.8 us at 128 splits)."""
    from pallas_kernels.tree_attention.mosaic_gpu import NEG, combine_splits

    rng = np.random.default_rng(7)
    B, NS, R, c = 2, 7, 5, 16
    o = rng.standard_normal((B, NS, R, c)).astype(np.float32)
    lse = rng.uniform(-300, 300, (B, NS, R)).astype(np.float32)
    lse[0, 2:, 1] = NEG  # row 1: only splits 0 and 1 saw a visible row
    o[0, 2:, 1] = 0.0
    lse[1, :, 4] = NEG  # row 4 of batch 1: a padded row, no split saw anything
    o[1, :, 4] = 0.0
    got = np.asarray(jax.jit(combine_splits, static_argnums=2)(jnp.asarray(o), jnp.asarray(lse), jnp.float32))
    w = np.exp2(lse.astype(np.float64) - lse.max(axis=1, keepdims=True))
    want = (o * w[..., None]).sum(axis=1) / w.sum(axis=1)[..., None]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    text = jax.jit(combine_splits, static_argnums=2).lower(jnp.asarray(o), jnp.asarray(lse), jnp.bfloat16).as_text()
    assert text.count("stablehlo.reduce") == 2


def test_mgpu_lowers_for_cuda_at_the_gpu_invariant_check_shapes():
    """benchmarks/check_gpu_invariant.py's kernel table (B 3, H 6, c 64, r 64, S_max 200, bf16 and f16; one value
    warpgroup, the split counts of tuned.mosaic_config) lowers for an abstract H200; r = 16 there did not (c + r = 80,
    see test_mgpu_argument_errors)."""
    from pallas_kernels.tree_attention.tuned import mosaic_config

    for dtype, T in [(jnp.bfloat16, 1), (jnp.bfloat16, 65), (jnp.float16, 5)]:
        config = mosaic_config(batch=3, num_tree=T, cache_rows=200)
        assert _mosaic_calls_lowered_for_h200(3, T, 6, 64, 64, 200, dtype, config) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["shared_qk", "replicated"])
@pytest.mark.parametrize("T,S_max,start,splits", [(1, 4096, 4000, 8), (2, 4352, 4096, 4), (33, 2048, 1500, 2),
                                                  (129, 1024, 600, 1)])
def test_mgpu_native_gpu_k2(T, S_max, start, splits, schedule):
    if not dispatch.is_hopper(jax.devices()[0]):
        pytest.skip("the Mosaic GPU attention kernel needs a Hopper GPU (sm_90)")
    q, cache, s, tree, truth = make_inputs(4, B=1, T=T, H=64, c=512, r=64, S_max=S_max, starts=[start],
                                           dtype=jnp.bfloat16)
    out = tree_attention_mosaic(q, cache, s, tree, scale=0.3 / np.sqrt(576), value_dim=512,
                                config=MosaicAttentionConfig(num_splits=splits, schedule=schedule))
    assert rel_err(out, truth) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["shared_qk", "replicated"])
@pytest.mark.parametrize("T,splits", [(1, 4), (33, 2)])
def test_mgpu_native_gpu_rescales_when_a_later_tile_moves_the_maximum(T, splits, schedule):
    """The rescale natively at K2 widths (P from registers, the accumulator carried by pl.run_state: what interpret
    mode cannot run), on scores whose maximum moves in later tiles (`_growing_inputs`)."""
    if not dispatch.is_hopper(jax.devices()[0]):
        pytest.skip("the Mosaic GPU attention kernel needs a Hopper GPU (sm_90)")
    q, cache, s, tree, truth, scale = _growing_inputs(11, T=T, H=64, c=512, r=64, S_max=1024 + 64, start=1024)
    out = tree_attention_mosaic(q, cache, s, tree, scale=scale, value_dim=512,
                                config=MosaicAttentionConfig(num_splits=splits, schedule=schedule))
    assert rel_err(out, truth) < 2e-2


def test_mgpu_interpret_through_the_public_entry():
    """tree_mla_attention(interpret=True) in bf16: auto picks this kernel in interpret mode (its split count from
    tuned.mosaic_config), Mosaic GPU interpret mode on CPU, against the float64 truth."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    from pallas_kernels.tree_attention import tree_mla_attention

    q, cache, start, tree, truth = make_inputs(11, B=2, T=3, H=16, c=64, r=16, S_max=90, starts=[40, 87],
                                               dtype=jnp.bfloat16)
    if not HAS_GPU:
        assert dispatch.choose_attention(latent_dim=64, rope_dim=16, interpret=True, num_heads=16, dtype=jnp.bfloat16,
                                         num_tree=3, cache_rows=90) == dispatch.Choice("mosaic_gpu", "interpret mode")
    try:
        out = jax.block_until_ready(tree_mla_attention(q, cache, start, tree, scale=0.3 / np.sqrt(80), value_dim=64,
                                                       interpret=True))
    finally:
        reset_gpu_interpret_mode_state()
    assert out.shape == (2, 3, 16, 64) and rel_err(out, truth) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T,S_max,start", [(1, 32768 + 64, 32700), (9, 32768 + 64, 32768), (33, 32768 + 64, 32768)])
def test_auto_runs_the_mosaic_kernel_natively_where_it_measured_fastest(T, S_max, start):
    """On an H200, tree_mla_attention's auto picks this kernel at K2 bf16 shapes where it was measured fastest, and
    its output matches the float64 truth."""
    from pallas_kernels.tree_attention import tree_mla_attention

    device = jax.devices()[0]
    if not dispatch.is_hopper(device):
        pytest.skip("the Mosaic GPU attention kernel needs a Hopper GPU (sm_90)")
    choice = dispatch.choose_attention(latent_dim=512, rope_dim=64, device=device, num_heads=64,
                                       dtype=jnp.bfloat16, num_tree=T, cache_rows=S_max)
    assert choice.impl == "mosaic_gpu", choice
    q, cache, s, tree, truth = make_inputs(5, B=1, T=T, H=64, c=512, r=64, S_max=S_max, starts=[start],
                                           dtype=jnp.bfloat16)
    out = tree_mla_attention(q, cache, s, tree, scale=0.3 / np.sqrt(576), value_dim=512)
    assert rel_err(out, truth) < 2e-2


def test_mosaic_config_follows_the_measurements():
    """tuned.mosaic_config: shared_qk where it measured faster (T = 33 and 129 at S = 32768, 2026-12-04; T = 9 on an
    H100, 2026-12-06), replicated at T = 1 (measured at 128 splits); the split counts of the B = 1 measurements,
    divided by the batch."""
    from pallas_kernels.tree_attention.tuned import mosaic_config

    assert mosaic_config(batch=1, num_tree=33, cache_rows=32832) == MosaicAttentionConfig(num_splits=4,
                                                                                           schedule="shared_qk")
    assert mosaic_config(batch=1, num_tree=129, cache_rows=32960) == MosaicAttentionConfig(schedule="shared_qk")
    assert mosaic_config(batch=1, num_tree=1, cache_rows=32832) == MosaicAttentionConfig(num_splits=128,
                                                                                          schedule="replicated")
    assert mosaic_config(batch=8, num_tree=1, cache_rows=32832).num_splits == 16
    assert mosaic_config(batch=1, num_tree=9, cache_rows=32832) == MosaicAttentionConfig(num_splits=32,
                                                                                          schedule="shared_qk")
