"""The W4A16 GEMM's public entry (pallas_kernels.w4a16.w4a16_matmul) vs an independent float64 NumPy reference
(reference/int4.py): its XLA forms in both weight layouts, the choice between them and the dense Mosaic GPU kernel,
and the model's INT4 dense linears through prepare_params. The Mosaic kernel's own interpret-mode and native tests
are in test_mosaic_gpu.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import A100, CPU, H200, SMALL

import kdtree_jax as kj
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Choice, KernelUnavailableError
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from pallas_kernels.w4a16 import w4a16_matmul, w4a16_matmul_reference, w4a16_matmul_xla
from reference import int4 as ref

ON_GPU = jax.default_backend() == "gpu"


def _problem(m, k, n, *, act_dtype=jnp.bfloat16, scale_dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    packed = ref.pack(q)
    scale = jnp.asarray(rng.uniform(0.005, 0.05, size=(n, k // 32)), scale_dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), act_dtype)
    leaf = Int4Weight.from_compressed(jnp.asarray(packed), scale)
    want = ref.matmul(np.asarray(x.astype(jnp.float32), np.float64), packed,
                      np.asarray(scale.astype(jnp.float32), np.float64))  # [M, N] float64
    return x, leaf, want


def _rel_err(got, want):
    return np.max(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)) / np.max(np.abs(want))


@pytest.mark.parametrize("layout", ["checkpoint", "mosaic"])
@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (3, 96, 48), (17, 256, 64)])
def test_xla_forms_match_numpy(m, k, n, layout):
    """float32 activations: the float32 reference (1e-6); bfloat16: W dequantized to bf16 on the tensor cores (bf16
    weights and output bound the error); both weight layouts give the same numbers."""
    for act, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
        x, leaf, want = _problem(m, k, n, act_dtype=act, seed=m + k + n)
        w = leaf if layout == "checkpoint" else leaf.to_mosaic()
        got = w4a16_matmul(x, w, impl="xla")
        assert got.shape == (m, n) and got.dtype == act
        assert _rel_err(got, want) < tol
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w4a16_matmul_xla(x, leaf)))
    x, leaf, want = _problem(m, k, n, act_dtype=jnp.float32, seed=1)
    assert _rel_err(w4a16_matmul_reference(x, leaf), want) < 1e-6


def test_bf16_xla_form_rounds_the_weight_as_the_kernel_does():
    """bf16 x: the dot runs on W rounded to bf16 ([N, K]), not on float32 W (a mutation check of the form)."""
    x, leaf, _ = _problem(4, 64, 32, act_dtype=jnp.bfloat16, seed=3)
    w_bf16 = np.asarray(leaf.to_mosaic().dequantize(jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    want = np.asarray(x.astype(jnp.float32)) @ w_bf16.T
    got = np.asarray(w4a16_matmul_xla(x, leaf).astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=1e-3)


def test_linear_rules():
    """The kernel follows the layout: a MosaicInt4Weight runs the Mosaic kernel on a Hopper GPU (or in interpret
    mode) for bf16 calls of <= 64 rows and weights of >= 1 M elements, XLA otherwise under auto; an Int4Weight runs
    XLA; explicit kernels that cannot run raise."""
    canonical = Int4Weight(jax.ShapeDtypeStruct((1024, 2048 // 4), jnp.int16),  # [N, K/4]: 2048 -> 1024
                           jax.ShapeDtypeStruct((1024, 2048 // 32), jnp.bfloat16))
    mosaic = jax.eval_shape(Int4Weight.to_mosaic, canonical)
    small = jax.eval_shape(Int4Weight.to_mosaic, Int4Weight(jax.ShapeDtypeStruct((1024, 96), jnp.int16),
                                                            jax.ShapeDtypeStruct((1024, 12), jnp.bfloat16)))
    choose = dispatch.choose_linear
    assert choose(mosaic, device=H200, act_dtype=jnp.bfloat16) == Choice("mosaic_gpu", "Hopper GPU, bf16")
    assert choose(mosaic, device=H200, act_dtype=jnp.bfloat16, rows=64).impl == "mosaic_gpu"
    assert choose(mosaic, device=H200, act_dtype=jnp.bfloat16, rows=65) == Choice(
        "xla", "65 rows > 64 (measured faster up to 64)")
    assert choose(small, device=H200, act_dtype=jnp.bfloat16) == Choice(
        "xla", "small weight (384 x 1024): XLA measured faster at one row")
    assert choose(small, device=H200, act_dtype=jnp.bfloat16, impl="mosaic_gpu") == Choice("mosaic_gpu", "asked for")
    assert choose(mosaic, device=H200, act_dtype=jnp.float32) == Choice(
        "xla", "needs bf16 activations, the model runs in float32")
    assert choose(mosaic, device=A100, act_dtype=jnp.bfloat16).reason == (
        "needs a Hopper GPU (sm_90), this is NVIDIA A100")
    assert choose(mosaic, device=CPU, interpret=True, act_dtype=jnp.bfloat16) == Choice("mosaic_gpu", "interpret mode")
    assert choose(canonical, device=H200) == Choice("xla", "checkpoint layout (Int4Weight)")
    assert choose(mosaic, device=H200, impl="xla") == Choice("xla", "asked for")
    with pytest.raises(KernelUnavailableError, match="needs the weight in the Mosaic layout"):
        choose(canonical, device=H200, impl="mosaic_gpu")
    with pytest.raises(KernelUnavailableError, match="linear impl='mosaic_gpu' cannot run: 300 rows > 64"):
        choose(mosaic, device=H200, impl="mosaic_gpu", rows=300, act_dtype=jnp.bfloat16)
    with pytest.raises(KernelUnavailableError, match="takes an Int4Weight or MosaicInt4Weight, got ShapeDtypeStruct"):
        choose(jax.ShapeDtypeStruct((128, 64), jnp.int16), device=H200)
    with pytest.raises(ValueError, match="linear impl must be one of"):
        choose(canonical, impl="triton")
    layout = lambda **kw: dispatch.choose_linear_layout(  # noqa: E731
        **{"act_dtype": jnp.bfloat16, "scale_dtype": jnp.bfloat16, "in_features": 7168, "out_features": 2048,
           "device": H200, **kw})
    assert layout() == Choice("mosaic_gpu", "Hopper GPU, bf16")
    assert layout(out_features=96) == Choice("xla", "out 96 features not a multiple of 64")
    assert layout(in_features=384, out_features=1024) == Choice(
        "xla", "small weight (384 x 1024): XLA measured faster at one row")
    assert layout(in_features=384, out_features=1024, impl="mosaic_gpu") == Choice("mosaic_gpu", "asked for")
    assert layout(scale_dtype=jnp.float32) == Choice("xla", "the INT4 scales are float32, not bfloat16")
    assert layout(device=A100).impl == "xla" and layout(impl="xla") == Choice("xla", "asked for")
    assert layout(scale_dtype=jnp.float32, impl="mosaic_gpu") == Choice("mosaic_gpu", "asked for")
    with pytest.raises(KernelUnavailableError, match="linear impl='mosaic_gpu' cannot run: needs a Hopper GPU"):
        layout(device=CPU, impl="mosaic_gpu")


def test_bad_inputs_raise_clearly():
    x, leaf, _ = _problem(2, 64, 32)
    with pytest.raises(ValueError, match="K=48 must be divisible by the group size"):
        w4a16_matmul(jnp.zeros((2, 48), jnp.bfloat16), Int4Weight(jnp.zeros((32, 12), jnp.int16),
                                                                  jnp.ones((32, 1), jnp.bfloat16)), impl="xla")
    with pytest.raises(ValueError, match="x dtype"):
        w4a16_matmul(x.astype(jnp.float16), leaf, impl="xla")
    with pytest.raises(ValueError, match="scale shape"):
        w4a16_matmul(x, Int4Weight(leaf.qweight, leaf.scale[:, :1]), impl="xla")
    with pytest.raises(ValueError, match="qweight must be int16"):
        w4a16_matmul(x, Int4Weight(leaf.qweight.astype(jnp.int32), leaf.scale), impl="xla")
    with pytest.raises(ValueError, match="must be an Int4Weight or MosaicInt4Weight"):
        w4a16_matmul(x, {"qweight": leaf.qweight, "scale": leaf.scale}, impl="xla")
    with pytest.raises(ValueError, match="the weight takes K=64"):
        w4a16_matmul(jnp.zeros((2, 96), jnp.bfloat16), leaf, impl="xla")
    with pytest.raises(ValueError, match="one unstacked weight"):
        w4a16_matmul(x, jax.tree.map(lambda a: a[None], leaf), impl="xla")
    with pytest.raises(ValueError, match="x must be \\[M, K\\]"):
        w4a16_matmul(x[0], leaf, impl="xla")
    with pytest.raises(ValueError, match="linear impl must be one of"):
        w4a16_matmul(x, leaf, impl="pallas")
    if not ON_GPU:
        with pytest.raises(KernelUnavailableError, match="linear impl='mosaic_gpu' cannot run: needs a Hopper GPU"):
            w4a16_matmul(x, leaf.to_mosaic(), impl="mosaic_gpu")


# ----------------------------------------------------------------------------------- the model's INT4 linears
def _all_mlp_model():
    cfg = SMALL  # hidden 192, dense MLP 384, shared expert 64: every dim a multiple of 64
    params = kj.quantize(kj.init_params(cfg, jax.random.key(0), jnp.bfloat16), cfg, "all_mlp")
    return cfg, params


def test_prepare_params_converts_the_dense_int4_weights():
    """prepare_params gives the dense INT4 weights (layer 0's MLP, layer 1's shared expert) the Mosaic layout where
    the linear kernel runs (interpret mode here) and leaves the rest; the forward then runs the Mosaic kernel on
    them and matches the XLA path on the checkpoint layout; the plan says so."""
    cfg, params = _all_mlp_model()
    kernels = kj.Kernels(attention="xla", linear="mosaic_gpu", moe="xla", interpret=True)
    prepared = kj.prepare_params(params, cfg, kernels)
    dense = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
        prepared, is_leaf=lambda x: isinstance(x, Int4Weight | MosaicInt4Weight))[0]
        if isinstance(leaf, Int4Weight | MosaicInt4Weight) and "experts" not in jax.tree_util.keystr(path)]
    assert len(dense) == 6 and all(isinstance(w, MosaicInt4Weight) for w in dense)
    assert isinstance(prepared["layers_1"]["moe"]["experts"]["gate"], Int4Weight)  # moe="xla": canonical
    assert kj.kernel_plan(prepared, cfg, kernels=kernels)["linear"] == (
        "mosaic_gpu", "asked for; 6 of 6 INT4 weights converted to the Mosaic layout once at load")
    tokens = jnp.asarray([[3, 17, 42, 5]], jnp.int32)
    got = kj.forward(prepared, cfg, tokens, kernels=kernels)
    want = kj.forward(params, cfg, tokens, kernels=kj.Kernels(attention="xla", linear="xla", moe="xla"))
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err < 0.05 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))), err
    auto = kj.prepare_params(params, cfg, kj.Kernels())  # auto on this machine
    if not ON_GPU:  # a CPU keeps the checkpoint layout (XLA)
        assert auto["layers_0"]["mlp"]["gate"] is params["layers_0"]["mlp"]["gate"]
        with pytest.raises(KernelUnavailableError, match="linear impl='mosaic_gpu' cannot run: needs a Hopper GPU"):
            kj.prepare_params(params, cfg, kj.Kernels(linear="mosaic_gpu"))


def test_kernel_plan_counts_weights_the_kernel_cannot_take():
    """On an H200, a shared expert 96 wide stays on XLA beside the converted dense MLP (1024 x 1024), and the plan
    says how many; SMALL's weights (192 x 384) are under the size where the kernel measured faster."""
    cfg = SMALL.replace(hidden_size=1024, intermediate_size=1024, moe_intermediate_size=96)
    params = jax.eval_shape(lambda: kj.quantize(kj.init_params(cfg, jax.random.key(0), jnp.bfloat16), cfg,
                                                "all_mlp"))
    assert kj.kernel_plan(params, cfg, device=H200)["linear"] == (
        "mosaic_gpu", "Hopper GPU, bf16; 3 of 6 INT4 weights converted to the Mosaic layout once at load, 3 on XLA "
                      "(in 96 features not a multiple of 64)")
    assert kj.kernel_plan(params, cfg, device=H200, sharded=True)["linear"] == (
        "xla", "sharded over a mesh; 6 INT4 weights")
    assert kj.kernel_plan(params, cfg, device=CPU)["linear"] == (
        "xla", "needs a Hopper GPU (sm_90), this is cpu; 6 INT4 weights")
    small = jax.eval_shape(lambda: kj.quantize(kj.init_params(SMALL, jax.random.key(0), jnp.bfloat16), SMALL,
                                               "all_mlp"))
    assert kj.kernel_plan(small, SMALL, device=H200)["linear"] == (
        "xla", "small weight (384 x 192): XLA measured faster at one row; 6 INT4 weights")


@pytest.mark.gpu
def test_model_linears_run_the_kernel_natively():
    """On a Hopper GPU linear="mosaic_gpu" converts and runs the Mosaic kernel for the dense INT4 weights (SMALL's
    are under the size auto gives the kernel), and the bf16 forward matches the XLA path's."""
    if not dispatch.is_hopper(jax.devices()[0]):
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
    cfg, params = _all_mlp_model()
    kernels = kj.Kernels(linear="mosaic_gpu")
    prepared = kj.prepare_params(params, cfg, kernels)
    assert isinstance(prepared["layers_0"]["mlp"]["gate"], MosaicInt4Weight)
    assert kj.kernel_plan(prepared, cfg, kernels=kernels)["linear"][0] == "mosaic_gpu"
    tokens = jnp.asarray([[3, 17, 42, 5, 9, 11, 2, 8]], jnp.int32)
    got = kj.forward(prepared, cfg, tokens, kernels=kernels).astype(jnp.float32)
    want = kj.forward(params, cfg, tokens, kernels=kj.Kernels(linear="xla")).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - want))) < 0.05 * float(jnp.max(jnp.abs(want)))
