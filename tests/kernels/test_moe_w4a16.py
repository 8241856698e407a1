"""Grouped W4A16 MoE kernel vs an independent float64 NumPy MoE (reference/int4.py dequantization).

Both backends: the Triton kernels (Int4Weight experts) and the Mosaic GPU kernel (MosaicInt4Weight experts).
On CPU the kernel bodies run in interpret mode; the CUDA lowering is checked against an abstract H200; the
native tests run only on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import custom_calls, lower_for_h200

from pallas_kernels import dispatch
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from pallas_kernels.moe_w4a16 import (
    MoEBlockConfig,
    group_assignments,
    grouped_moe_w4a16,
    grouped_moe_w4a16_reference,
    moe_w4a16_xla,
)
from reference import int4 as ref

ON_GPU = jax.default_backend() == "gpu"


def _experts(rng, num_experts, hidden, inter, scale_dtype=jnp.bfloat16):
    """Random INT4 expert stacks: (jnp leaves, float64 dense [E, N, K] per projection)."""
    leaves, dense = {}, {}
    for name, (n, k) in {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}.items():
        q = rng.integers(-8, 8, size=(num_experts, n, k)).astype(np.int8)
        scale = jnp.asarray(rng.uniform(0.02, 0.08, size=(num_experts, n, k // 32)) / np.sqrt(k / 64), scale_dtype)
        leaves[name] = Int4Weight.from_compressed(jnp.asarray(ref.pack(q)), scale)
        dense[name] = ref.dequantize(q, np.asarray(scale.astype(jnp.float32), np.float64))
    return leaves, dense


def _numpy_moe(x, dense, ids, weights):
    """float64: sum_j w[t, j] * down(silu(gate x) * up x) for expert ids[t, j], one assignment at a time."""
    x = np.asarray(x.astype(jnp.float32), np.float64)
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g, u = dense["gate"][e] @ x[t], dense["up"][e] @ x[t]
            out[t] += weights[t, j] * (dense["down"][e] @ (g / (1 + np.exp(-g)) * u))
    return out


def _routing(rng, num_tokens, top_k, num_experts, *, crowd=False):
    """Distinct experts per token (top-k); crowd=True sends every token to expert 3 first."""
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    if crowd:
        for t in range(num_tokens):
            row = list(ids[t])
            if 3 in row:
                row.remove(3)
            ids[t] = [3] + row[: top_k - 1]
    weights = rng.uniform(0.05, 1.0, size=(num_tokens, top_k)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(weights)


def _rel(got, want):
    return float(np.max(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)) / np.max(np.abs(want)))


# (T, E, k, D, I, crowd): T = 1, 5, 17; E = 8, 16; k = 2, 8; D and I multiples of 32 that are not powers
# of two (96, 160); crowd = 17 tokens on one expert (two row tiles of 16 for that expert).
CASES = [
    (1, 16, 8, 64, 96, False),
    (5, 8, 2, 160, 64, False),
    (5, 16, 2, 64, 64, True),
    (17, 16, 8, 96, 64, True),
    (17, 8, 2, 64, 32, False),
]


@pytest.mark.parametrize("T,E,k,D,I,crowd", CASES)
@pytest.mark.parametrize("act_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_interpret_matches_numpy_and_reference(T, E, k, D, I, crowd, act_dtype):  # noqa: E741
    rng = np.random.default_rng(T * 100 + E + k + D)
    experts, dense = _experts(rng, E, D, I)
    ids, weights = _routing(rng, T, k, E, crowd=crowd)
    x = jnp.asarray(rng.standard_normal((T, D)), act_dtype)
    want = _numpy_moe(x, dense, ids, weights)
    tol = 1e-5 if act_dtype == jnp.float32 else 3e-2  # bf16: x, gate/up, hidden and down rounded to bf16
    got = grouped_moe_w4a16(x, experts, ids, weights, impl="triton", interpret=True)
    assert got.shape == (T, D) and got.dtype == act_dtype
    assert _rel(got, want) < tol
    reference = grouped_moe_w4a16_reference(x, experts, ids, weights)
    assert _rel(reference, want) < (1e-5 if act_dtype == jnp.float32 else 1e-2)
    assert _rel(got, np.asarray(reference.astype(jnp.float32), np.float64)) < tol


@pytest.mark.parametrize("form", ["auto", "gather", "dense", "loop"])
def test_xla_paths_match_numpy(form):
    """Every form of the XLA path (and the reference) against float64 NumPy, on both weight layouts; a repeated
    expert counts twice and a zero weight adds nothing in each."""
    rng = np.random.default_rng(7)
    experts, dense = _experts(rng, 8, 64, 32, scale_dtype=jnp.float32)
    ids, weights = _routing(rng, 5, 2, 8, crowd=True)
    ids = ids.at[1].set(jnp.asarray([4, 4], jnp.int32))
    weights = weights.at[2, 1].set(0.0)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    want = _numpy_moe(x, dense, ids, weights)
    assert _rel(moe_w4a16_xla(x, experts, ids, weights, form=form), want) < 1e-5
    assert _rel(grouped_moe_w4a16_reference(x, experts, ids, weights), want) < 1e-5
    # the same XLA path over the Mosaic layout of the same experts (bf16 scales: float32 -> bf16 rounding)
    bf16 = {n: Int4Weight(w.qweight, w.scale.astype(jnp.bfloat16)) for n, w in experts.items()}
    want_bf16 = np.asarray(moe_w4a16_xla(x, bf16, ids, weights, form=form), np.float64)
    mosaic = {n: w.to_mosaic() for n, w in bf16.items()}
    assert _rel(moe_w4a16_xla(x, mosaic, ids, weights, form=form), want_bf16) < 1e-6
    assert _rel(want_bf16, want) < 1e-2
    if form == "auto":
        assert _rel(grouped_moe_w4a16(x, experts, ids, weights, impl="xla"), want) < 1e-5


@pytest.mark.parametrize("form", ["gather", "dense", "loop"])
def test_xla_paths_follow_an_explicit_dot_algorithm(form, matmul_precision):
    """The XLA forms' dots name HIGHEST (JAX's default, TF32 on a GPU, must not lower them), but follow an explicit
    dot algorithm set as the process default (generate --matmul-precision BF16_BF16_F32_X9), like every other
    matmul, except the vector-shaped ones (the gather form's mat-vecs, the combines: pallas_kernels.dots), which
    stay HIGHEST; the result stays at float32 accuracy."""
    rng = np.random.default_rng(3)
    experts, dense = _experts(rng, 8, 64, 32, scale_dtype=jnp.float32)
    ids, weights = _routing(rng, 5, 2, 8, crowd=True)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    want = _numpy_moe(x, dense, ids, weights)
    run = jax.jit(functools.partial(moe_w4a16_xla, form=form))
    highest, algorithm = "precision = [HIGHEST, HIGHEST]", "algorithm = <lhs_precision_type = bf16"
    # (dots at the algorithm, at HIGHEST) under BF16_BF16_F32_X6: gather has only mat-vecs and a combine, dense three
    # GEMMs and a combine, loop three GEMMs (5 tokens through each touched expert)
    split = {"gather": (0, 4), "dense": (3, 1), "loop": (3, 0)}[form]
    for setting in ("highest", None, "BF16_BF16_F32_X6"):
        jax.config.update("jax_default_matmul_precision", setting)
        lowered = [line for line in run.lower(x, experts, ids, weights).as_text().splitlines() if "dot_general" in line]
        counts = (sum(algorithm in line for line in lowered), sum(highest in line for line in lowered))
        assert counts[0] + counts[1] == len(lowered), (setting, lowered)
        assert counts == (split if setting == "BF16_BF16_F32_X6" else (0, sum(split))), (setting, counts)
        assert _rel(run(x, experts, ids, weights), want) < 1e-5, setting


def test_xla_form_follows_the_size_rule():
    """Off a CPU: gather while the T*k gathered experts fit the dequantization cap, dense while the whole stack fits,
    the loop beyond both; on a CPU the loop."""
    from pallas_kernels.moe_w4a16.reference import XLA_DEQUANT_BYTES, xla_form_for

    one = 4 * 3 * 64 * 32  # float32 bytes of one expert's three matrices (D 64, I 32)
    fits = XLA_DEQUANT_BYTES // one  # gathered experts that fit
    assert [xla_form_for(t, 2, 8, 64, 32) for t in (1, 5, fits // 2)] == ["gather"] * 3
    assert xla_form_for(fits // 2 + 1, 2, 8, 64, 32) == "dense"
    assert xla_form_for(1, 2, fits + 1, 64, 32) == "gather" and xla_form_for(fits, 2, fits + 1, 64, 32) == "loop"
    assert xla_form_for(1, 2, 8, 64, 32, platform="cpu") == "loop"  # measured faster on a CPU
    rng = np.random.default_rng(0)
    experts, _ = _experts(rng, 8, 64, 32)
    with pytest.raises(ValueError, match="form must be one of"):
        moe_w4a16_xla(jnp.ones((1, 64)), experts, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), form="fast")


def test_set_xla_form_overrides_the_rule_until_reset():
    """set_xla_form (profile_round.py --moe-xla-form) makes every auto call run the set form, as the HLO shows
    (the loop form's scan is a while loop; gather and dense have none), and "auto" gives the rule back; an unknown
    form is refused and changes nothing."""
    from pallas_kernels.moe_w4a16.reference import set_xla_form, xla_form

    rng = np.random.default_rng(1)
    experts, dense = _experts(rng, 8, 64, 32, scale_dtype=jnp.float32)
    ids, weights = _routing(rng, 3, 2, 8)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    rule = xla_form(3, 2, experts)  # "loop" on a CPU, "gather" elsewhere
    other = "dense"
    try:
        set_xla_form(other)
        assert xla_form(3, 2, experts) == other
        def hlo():  # a fresh function each time: jit keeps a traced function's form in its cache
            return jax.jit(lambda *a: moe_w4a16_xla(*a)).lower(x, experts, ids, weights).as_text()

        assert "while" not in hlo()
        assert _rel(moe_w4a16_xla(x, experts, ids, weights), _numpy_moe(x, dense, ids, weights)) < 1e-5
        with pytest.raises(ValueError, match="form must be one of"):
            set_xla_form("fast")
        assert xla_form(3, 2, experts) == other
        set_xla_form("loop")
        assert "while" in hlo()
    finally:
        set_xla_form("auto")
    assert xla_form(3, 2, experts) == rule


def test_grouping_reads_each_touched_expert_once():
    """The tile table names every touched expert exactly once (T <= block_m), never an untouched one,
    and the padded rows hold each assignment's token and weight."""
    rng = np.random.default_rng(3)
    T, k, E, bm = 9, 4, 32, 16
    ids, weights = _routing(rng, T, k, E)
    ids = ids.at[2, 1].set(ids[0, 0] if ids[0, 0] not in np.asarray(ids[2]) else ids[2, 1])
    weights = weights.at[4, 3].set(0.0)  # dropped: its expert counts only if another choice hits it
    grp = group_assignments(ids, weights, E, bm)
    kept = {int(e) for e, w in zip(np.asarray(ids).ravel(), np.asarray(weights).ravel(), strict=True) if w != 0}
    tiles = [int(e) for e in np.asarray(grp.tile_expert) if e >= 0]
    assert sorted(tiles) == sorted(kept) and int(grp.touched) == len(kept)
    pos, keep = np.asarray(grp.position), np.asarray(grp.keep)
    for t in range(T):
        for j in range(k):
            if not keep[t, j]:
                assert weights[t, j] == 0
                continue
            row = pos[t, j]
            assert int(grp.row_token[row]) == t and float(grp.row_weight[row]) == float(weights[t, j])
            assert int(grp.tile_expert[row // bm]) == int(ids[t, j])
    assert int(np.sum(np.asarray(grp.row_valid))) == int(keep.sum())


def test_grouping_compiles_without_a_loop():
    """The grouping is loop-free straight-line code: an XLA while loop runs on a GPU as a launch or more a step plus
    the condition's round trip (the binary search jnp.searchsorted does by default was 36 of a T = 9 MoE call's 69
    launches at E = 384, H200, 2026-12-06). Same result as the loop's."""
    rng = np.random.default_rng(5)
    ids, weights = _routing(rng, 9, 8, 384)
    group = jax.jit(functools.partial(group_assignments, num_experts=384, block_m=8))
    assert "while" not in group.lower(ids, weights).compile().as_text()
    grp = group(ids, weights)
    padded_ends = np.cumsum(-(-np.bincount(np.asarray(ids).ravel(), minlength=384) // 8) * 8)
    starts = np.arange(grp.tile_expert.shape[0]) * 8
    want = np.where(starts < padded_ends[-1], np.searchsorted(padded_ends, starts, side="right"), -1)
    np.testing.assert_array_equal(np.asarray(grp.tile_expert), want)


@pytest.mark.parametrize("T,k,E,bm,dropped", [(1, 8, 384, 8, 0.2), (9, 8, 384, 8, 0.2), (33, 8, 384, 8, 0.2),
                                               (9, 4, 8, 16, 0.2), (40, 3, 5, 8, 0.2), (9, 8, 384, 8, 1.0)])
def test_grouping_compare_form_equals_the_sort_form(T, k, E, bm, dropped, monkeypatch):
    """A verify's few assignments are grouped by comparing all pairs (no sort, no scatter: ~9 fewer launches on a GPU
    at T = 9); a prefill's many by an argsort and scatters. Both give the same tables, values and dtypes, with dropped
    (weight 0) choices (every one, in the last case), an expert chosen twice by one token, and experts shared by many
    tokens (E = 5, 8)."""
    from pallas_kernels.moe_w4a16 import grouping

    rng = np.random.default_rng(T * 100 + E)
    ids, weights = _routing(rng, T, k, E)
    weights = jnp.where(jnp.asarray(rng.random((T, k)) < dropped), 0.0, weights)
    ids = ids.at[0, 1].set(ids[0, 0])  # one token's two choices of one expert: two rows of its group
    compare = jax.jit(functools.partial(grouping.group_assignments, num_experts=E, block_m=bm))
    hlo = compare.lower(ids, weights).compile().as_text()
    assert "scatter" not in hlo and " sort(" not in hlo
    got = compare(ids, weights)
    monkeypatch.setattr(grouping, "COMPARE_ALL_MAX", 0)  # the sort form
    want = grouping.group_assignments(ids, weights, E, bm)
    for name, g, w in zip(grouping.Grouping._fields, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
    assert int(got.touched) == len({int(e) for e, w in zip(np.asarray(ids).ravel(), np.asarray(weights).ravel(),
                                                           strict=True) if w != 0})


def test_zero_weights_and_repeated_expert():
    """A zero weight adds nothing (and is dropped); the same expert twice in a row counts twice, as the
    model's combine matrix adds both weights."""
    rng = np.random.default_rng(11)
    experts, dense = _experts(rng, 8, 64, 32)
    ids = jnp.asarray([[1, 1, 2], [5, 0, 0], [7, 6, 5]], jnp.int32)
    weights = jnp.asarray([[0.5, 0.25, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    want = _numpy_moe(x, dense, ids, weights)
    got = grouped_moe_w4a16(x, experts, ids, weights, impl="triton", interpret=True)
    assert _rel(got, want) < 1e-5
    assert np.all(np.asarray(got[2]) == 0.0)
    grp = group_assignments(ids, weights, 8, 16)
    assert sorted(int(e) for e in np.asarray(grp.tile_expert) if e >= 0) == [1, 5]


def test_model_routed_experts_uses_the_grouped_kernel_and_matches_numpy():
    """kdtree_jax.model.routed_experts on INT4 experts (the model's MoE) against float64 NumPy, with the
    default kernel choice and with the Triton kernel pinned (interpret mode)."""
    from kdtree_jax import model

    rng = np.random.default_rng(5)
    E, D, I, T, k = 8, 64, 32, 6, 2  # noqa: E741 (I: intermediate size)
    experts, dense = _experts(rng, E, D, I)
    ids, weights = _routing(rng, T, k, E, crowd=True)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        x = jnp.asarray(rng.standard_normal((T, D)), dtype)
        want = _numpy_moe(x, dense, ids, weights)
        for kernels in (dispatch.Kernels(), dispatch.Kernels(moe="triton", interpret=True)):
            got = model.routed_experts(x, experts, ids, weights, kernels)
            assert got.dtype == dtype and got.shape == (T, D)
            assert _rel(got, want) < tol, (dtype, kernels)


def test_auto_on_cpu_runs_the_xla_path_and_an_explicit_kernel_raises():
    if ON_GPU:
        pytest.skip("on a GPU impl='auto' is the kernel; covered by test_kernel_native_gpu_k26_shapes")
    rng = np.random.default_rng(2)
    experts, _ = _experts(rng, 4, 64, 64)
    assert dispatch.choose_moe(experts, act_dtype=jnp.float32).impl == "xla"
    assert dispatch.choose_moe(experts, act_dtype=jnp.float32, interpret=True).impl == "triton"
    ids, weights = _routing(rng, 2, 2, 4)
    with pytest.raises(dispatch.KernelUnavailableError, match="moe impl='triton' cannot run: no GPU"):
        grouped_moe_w4a16(jnp.ones((2, 64), jnp.float32), experts, ids, weights, impl="triton")


def test_bad_inputs_raise_clearly():
    rng = np.random.default_rng(1)
    experts, _ = _experts(rng, 4, 64, 32)
    ids, weights = _routing(rng, 2, 2, 4)
    x = jnp.ones((2, 64), jnp.float32)
    call = lambda *a, **kw: grouped_moe_w4a16(*a, impl="xla", **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"x must be \[T, D\]"):
        call(x[0], experts, ids, weights)
    with pytest.raises(ValueError, match="x dtype"):
        call(x.astype(jnp.int32), experts, ids, weights)
    with pytest.raises(ValueError, match="keys gate, up, down"):
        call(x, {"gate": experts["gate"]}, ids, weights)
    with pytest.raises(ValueError, match="must all be Int4Weight or all MosaicInt4Weight"):
        call(x, {**experts, "up": jnp.zeros((4, 64, 32))}, ids, weights)
    with pytest.raises(ValueError, match="must all be Int4Weight or all MosaicInt4Weight"):
        call(x, {**experts, "up": experts["up"].to_mosaic()}, ids, weights)
    with pytest.raises(ValueError, match=r"experts\['up'\].*scale shape"):
        call(x, {**experts, "up": Int4Weight(experts["up"].qweight, experts["up"].scale[..., :1])}, ids, weights)
    with pytest.raises(ValueError, match=r"experts\['down'\] is \(N, K\)"):
        call(x, {**experts, "down": experts["gate"]}, ids, weights)
    with pytest.raises(ValueError, match="stacked"):
        call(x, {**experts, "gate": jax.tree.map(lambda a: a[0], experts["gate"])}, ids, weights)
    with pytest.raises(ValueError, match="expert_ids must be int32"):
        call(x, experts, ids.astype(jnp.int16), weights)
    with pytest.raises(ValueError, match=r"expert_ids must be \[T, k\]"):
        call(x, experts, ids[:1], weights[:1])
    with pytest.raises(ValueError, match="weights shape"):
        call(x, experts, ids, weights[:, :1])
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got values in \[0, 4\]"):
        call(x, experts, ids.at[0, 0].set(4), weights)
    with pytest.raises(ValueError, match="moe impl must be one of"):
        grouped_moe_w4a16(x, experts, ids, weights, impl="pallas")
    with pytest.raises(dispatch.KernelUnavailableError, match="needs experts in the Mosaic layout"):
        grouped_moe_w4a16(x, experts, ids, weights, impl="mosaic_gpu", interpret=True)
    with pytest.raises(ValueError, match="must be divisible by the tile"):
        grouped_moe_w4a16(x, experts, ids, weights, impl="triton", interpret=True,
                          config=MoEBlockConfig(block_n_up=64))
    with pytest.raises(ValueError, match="power of two"):
        MoEBlockConfig(block_m=24)


def test_kernel_lowers_for_cuda_at_k26_shapes():
    """The Triton lowering of both kernels runs on CPU against an abstract H200 at K2.6 expert shapes."""
    from pallas_kernels.moe_w4a16 import default_config
    from pallas_kernels.moe_w4a16.triton import grouped_moe_w4a16_pallas

    E, D, I = 384, 7168, 2048  # noqa: E741 (I: intermediate size)
    S = jax.ShapeDtypeStruct
    leaf = lambda n, k: Int4Weight(S((E, n, k // 4), jnp.int16), S((E, n, k // 32), jnp.bfloat16))  # noqa: E731
    experts = {"gate": leaf(I, D), "up": leaf(I, D), "down": leaf(D, I)}
    for T in (1, 33, 129):
        fn = lambda x, e, i, w, T=T: grouped_moe_w4a16_pallas(x, e, i, w, cfg=default_config(T, D, I))  # noqa: E731
        text = lower_for_h200(fn, S((T, D), jnp.bfloat16), experts, S((T, 8), jnp.int32), S((T, 8), jnp.float32))
        assert text.count("xla.gpu.triton") == 2  # gate/up+SwiGLU and down+combine: two launches


def _k26_native_problem(T):
    """Random INT4 experts at K2.6 expert shapes (E reduced to 64 to keep the float32 reference small), routing,
    x, and the float32 XLA path's result."""
    E, D, I, k = 64, 7168, 2048, 8  # noqa: E741 (I: intermediate size)
    keys = jax.random.split(jax.random.key(T), 8)
    leaf = lambda key, n, kk: Int4Weight(  # noqa: E731
        qweight=jax.random.randint(key, (E, n, kk // 4), -32768, 32768, jnp.int32).astype(jnp.int16),
        scale=(jax.random.uniform(keys[7], (E, n, kk // 32), minval=0.5, maxval=1.5) * 0.2 / np.sqrt(kk))
        .astype(jnp.bfloat16))
    experts = {"gate": leaf(keys[0], I, D), "up": leaf(keys[1], I, D), "down": leaf(keys[2], D, I)}
    ids = jnp.argsort(jax.random.uniform(keys[3], (T, E)), axis=1)[:, :k].astype(jnp.int32)
    weights = jax.random.uniform(keys[4], (T, k), minval=0.05)
    x = jax.random.normal(keys[5], (T, D), jnp.bfloat16)
    want = moe_w4a16_xla(x, experts, ids, weights, out_dtype=jnp.float32)
    return x, experts, ids, weights, np.asarray(want.astype(jnp.float32), np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 9, 33, 129])
@pytest.mark.parametrize("kernel", ["triton", "mosaic_gpu"])
def test_kernel_native_gpu_k26_shapes(T, kernel):
    """Both grouped kernels natively on the GPU at K2.6 expert shapes (Triton on Int4Weight, Mosaic GPU on
    MosaicInt4Weight, needs a Hopper GPU) against the float32 XLA path."""
    x, experts, ids, weights, want = _k26_native_problem(T)
    if kernel == "mosaic_gpu":
        if not dispatch.is_hopper(jax.devices()[0]):
            pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
        experts = {n: w.to_mosaic() for n, w in experts.items()}
    got = grouped_moe_w4a16(x, experts, ids, weights, impl=kernel)
    assert _rel(got, want) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 9, 33])
def test_fused_gate_up_native_gpu_k26_shapes(T):
    """The Mosaic GPU MoE with gate and up in one launch (SwiGLU in its epilogue) natively at K2.6 expert shapes:
    against the float32 XLA path, and within bf16 rounding of the three-launch kernel."""
    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_moe_w4a16_mgpu

    if not dispatch.is_hopper(jax.devices()[0]):
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
    x, experts, ids, weights, want = _k26_native_problem(T)
    experts = {n: w.to_mosaic() for n, w in experts.items()}
    fused = grouped_moe_w4a16_mgpu(x, experts, ids, weights, fused_gate_up=True)
    three = grouped_moe_w4a16_mgpu(x, experts, ids, weights)
    assert _rel(fused, want) < 3e-2
    assert _rel(fused, np.asarray(three.astype(jnp.float32), np.float64)) < 1e-2


# ------------------------------------ the Mosaic GPU grouped MoE kernel (pallas_kernels/moe_w4a16/mosaic_gpu.py)
def _mgpu_interpret():
    from pallas_kernels.w4a16.mosaic_gpu import gpu_interpret_params

    return gpu_interpret_params(detect_races=True)


def _reset_mgpu_interpreter():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize("fused", [False, True], ids=["3-launch", "fused-gate-up"])
@pytest.mark.parametrize("T,E,k,crowd,zero", [(1, 8, 4, False, False), (1, 8, 4, False, True),
                                             (5, 8, 2, True, False)])
def test_mgpu_grouped_moe_interpret_matches_numpy(T, E, k, crowd, zero, fused):
    """Mosaic GPU interpret mode (SMEM-A; race detector on): the grouped kernel == float64 NumPy, with gate and
    up in two launches or in one (fused=True: SwiGLU in the kernel's epilogue).
    T = 1 takes the decode path (one tile per choice; zero=True: a zero-weight choice, as another shard's
    expert in moe_sharded, whose tile is marked unused); crowd=True puts 5 tokens on one expert (its rows span a
    tile of 8) and leaves experts untouched."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_moe_w4a16_mgpu
    from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig

    D, I = 128, 64  # noqa: E741 (I: intermediate size)
    rng = np.random.default_rng(T + E + k)
    experts, dense = _experts(rng, E, D, I)
    ids, weights = _routing(rng, T, k, E, crowd=crowd)
    if zero:
        weights = weights.at[0, 1].set(0.0)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    cfg = MgpuConfig(block_n=64, block_k=64, a_operand="smem")
    try:
        got = jax.block_until_ready(grouped_moe_w4a16_mgpu(  # the interpreter runs at execution (async)
            x, {n: w.to_mosaic() for n, w in experts.items()}, ids, weights, config_up=cfg, config_down=cfg,
            interpret=_mgpu_interpret(), fused_gate_up=fused))
        assert not get_races().races_found
    finally:
        _reset_mgpu_interpreter()
    assert got.shape == (T, D) and got.dtype == jnp.bfloat16
    assert _rel(got, _numpy_moe(x, dense, ids, weights)) < 3e-2  # bf16 x, gate/up, hidden, down


@pytest.mark.parametrize("block_k,weighted", [(64, False), (128, False), (64, True)])
def test_mgpu_grouped_kernel_skips_unused_tiles_and_reuses_experts(block_k, weighted):
    """grouped_w4a16_mgpu_kernel: tile t = expert tile_expert[t]; -1 tiles are skipped (never written).
    block_k 128: 4 scale groups per pipeline step, each its own register slice. weighted: the routing weights
    given as tile_weight (the decode path's form) also mark tile 2 unused (weight 0)."""
    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_w4a16_mgpu_kernel
    from pallas_kernels.w4a16 import w4a16_matmul_reference
    from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig

    rng = np.random.default_rng(3)
    experts, _ = _experts(rng, 4, 128, 64)
    leaf = experts["gate"]  # [4, 64, 128/4]: N = 64, K = 128
    tile_expert = jnp.asarray([2, -1, 2, 0], jnp.int32)
    x_rows = jnp.asarray(rng.standard_normal((4 * 8, 128)), jnp.bfloat16)
    mosaic = leaf.to_mosaic()
    w, s = mosaic.w_i4, mosaic.scale_t
    tile_weight = jnp.asarray([0.5, 1.0, 0.0, 2.0], jnp.float32) if weighted else None
    unused = (np.asarray(tile_expert) < 0) | (np.asarray(tile_weight) == 0 if weighted else False)
    try:
        y_t = jax.block_until_ready(grouped_w4a16_mgpu_kernel(  # finish before the finally resets the interpreter
            x_rows, w, s, tile_expert, tile_weight=tile_weight, interpret=_mgpu_interpret(),
            config=MgpuConfig(block_n=64, block_k=block_k, a_operand="smem")))
    finally:
        _reset_mgpu_interpreter()
    assert y_t.shape == (4, 64, 8)
    for t, e in enumerate(np.asarray(tile_expert)):
        if unused[t]:
            continue
        want = w4a16_matmul_reference(x_rows[t * 8:(t + 1) * 8].astype(jnp.float32),
                                      jax.tree.map(lambda a, e=e: a[e], leaf))  # [8, 64]
        assert _rel(y_t[t].T, np.asarray(want, np.float64)) < 1e-2


@pytest.mark.parametrize("m,fused", [(1, False), (3, False), (1, True)])
def test_mgpu_grouped_kernels_share_one_token_tile(m, fused):
    """x_rows of m < 8 rows is one token tile every row tile reads (the decode step's token, not padded into a tile a
    choice by an XLA launch): tile t's columns [0, m) are expert tile_expert[t]'s products of those rows, in the
    grouped kernel and in the gate + up kernel (its SwiGLU of them); the TMA's zero rows past m reach only the
    columns past m (the gate + up kernel's rows past m). Rows that neither fill one tile nor a whole number of tiles
    are refused."""
    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_gate_up_mgpu_kernel, grouped_w4a16_mgpu_kernel
    from pallas_kernels.w4a16 import w4a16_matmul_reference
    from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig

    rng = np.random.default_rng(11 + m)
    experts, _ = _experts(rng, 4, 128, 64)  # gate / up: N = 64, K = 128
    tile_expert = jnp.asarray([2, -1, 0, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, 128)), jnp.bfloat16)
    gate, up = experts["gate"].to_mosaic(), experts["up"].to_mosaic()
    cfg = MgpuConfig(block_n=64, block_k=64, a_operand="smem")
    try:
        if fused:
            y_t = grouped_gate_up_mgpu_kernel(x, gate.w_i4, gate.scale_t, up.w_i4, up.scale_t, tile_expert,
                                              config=cfg, interpret=_mgpu_interpret())
        else:
            y_t = grouped_w4a16_mgpu_kernel(x, gate.w_i4, gate.scale_t, tile_expert, config=cfg,
                                            interpret=_mgpu_interpret())
        y_t = jax.block_until_ready(y_t)  # finish before the finally resets the interpreter
    finally:
        _reset_mgpu_interpreter()
    # the grouped kernel: y^T [R, N, Mp] float32; the gate + up kernel: h [R, Mp, N] bf16, the down launch's rows
    assert y_t.shape == ((4, 8, 64) if fused else (4, 64, 8)) and y_t.dtype == (jnp.bfloat16 if fused else jnp.float32)
    xf = x.astype(jnp.float32)
    for t, e in enumerate(np.asarray(tile_expert)):
        if e < 0:
            continue
        g = np.asarray(w4a16_matmul_reference(xf, jax.tree.map(lambda a, e=e: a[e], experts["gate"])), np.float64)
        if fused:
            u = np.asarray(w4a16_matmul_reference(xf, jax.tree.map(lambda a, e=e: a[e], experts["up"])), np.float64)
            g = g / (1.0 + np.exp(-g)) * u  # [m, 64]
        assert _rel(y_t[t, :m] if fused else y_t[t, :, :m].T, g) < 2e-2, t
        past = np.asarray((y_t[t, m:] if fused else y_t[t, :, m:]).astype(jnp.float32))
        assert (past == 0).all(), t  # the TMA's zero rows: zero products, and silu(0) * 0 = 0
    with pytest.raises(ValueError, match="not a multiple of the 4 row tiles"):
        grouped_w4a16_mgpu_kernel(jnp.zeros((10, 128), jnp.bfloat16), gate.w_i4, gate.scale_t, tile_expert,
                                  config=cfg, interpret=_mgpu_interpret())


def test_mgpu_grouped_moe_lowers_for_cuda_at_k26_shapes():
    """The grouped MoE (register-A wgmma, the default tilings) lowers for an abstract H200 at K2.6 expert
    shapes, in three launches, or two with gate and up fused (the default)."""
    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_moe_w4a16_mgpu

    E, D, I = 384, 7168, 2048  # noqa: E741 (I: intermediate size)
    S = jax.ShapeDtypeStruct
    layout = lambda n, kk: MosaicInt4Weight(S((E, n, kk), jnp.int4), S((E, kk // 32, n), jnp.bfloat16))  # noqa: E731
    experts = {"gate": layout(I, D), "up": layout(I, D), "down": layout(D, I)}
    for T in (1, 33):
        args = (S((T, D), jnp.bfloat16), experts, S((T, 8), jnp.int32), S((T, 8), jnp.float32))
        text = lower_for_h200(functools.partial(grouped_moe_w4a16_mgpu, fused_gate_up=False), *args)
        assert custom_calls(text).count("mosaic_gpu_v2") == 3  # gate, up, down
        fused = lower_for_h200(functools.partial(grouped_moe_w4a16_mgpu, fused_gate_up=True), *args)
        assert custom_calls(fused).count("mosaic_gpu_v2") == 2  # gate + up with SwiGLU, down
        # by default gate and up share a launch at every T (measured faster at T = 1 and 9: docs/w4a16_mgpu.md), and
        # no XLA transpose runs between the launches
        default = lower_for_h200(grouped_moe_w4a16_mgpu, *args)
        assert custom_calls(default).count("mosaic_gpu_v2") == 2, T
        assert "stablehlo.transpose" not in default.split("mosaic_gpu_v2")[1], T
        if T == 1:  # the token is every tile's token tile as it is: no pad or scatter of x into a tile a choice
            assert "stablehlo.pad" not in default and "stablehlo.scatter" not in default
