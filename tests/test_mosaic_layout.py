"""Routed experts in the Mosaic GPU kernel layout (kj.to_mosaic_experts, chosen by kj.prepare_params): exact
conversion, the model's MoE on it (the XLA path on CPU, the kernel in interpret mode), sharding rules, and what
must refuse it. The kernel itself natively: tests/kernels/test_moe_w4a16.py::test_kernel_native_gpu_k26_shapes."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params, rel_err
from jax.sharding import PartitionSpec as P

import kdtree_jax as kj
from kdtree_jax import sharding
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight, is_quantized
from pallas_kernels.moe_w4a16 import grouped_moe_w4a16

pytestmark = pytest.mark.usefixtures("kernel_moe_for_any_stack")  # the tiny stacks take the kernels' path
CFG = TINY.replace(num_hidden_layers=3)  # layer 0 dense, layers 1-2 MoE


@pytest.fixture(scope="module")
def f32_params():
    return random_params(CFG, seed=1)


@pytest.fixture(scope="module")
def bf16_params():
    return random_params(CFG, seed=1, dtype=jnp.bfloat16)


@pytest.fixture(scope="module")
def int4_params(bf16_params):
    return kj.quantize(bf16_params, CFG)


@pytest.fixture(scope="module")
def mosaic_params(int4_params):
    return kj.to_mosaic_experts(int4_params, CFG)


def _dequant(leaf):
    """[..., N, K] float64 of either layout, written out here independently of the code under test."""
    if isinstance(leaf, MosaicInt4Weight):
        stored = np.asarray(leaf.w_i4.astype(jnp.int8), np.float64)  # lane order: column 8i + 2t + e of each
        c = np.arange(stored.shape[-1])                               # 32-column group is at 8t + 4e + i
        i, t, e = (c % 32) // 8, (c % 8) // 2, c % 2
        w = stored[..., c - c % 32 + 8 * t + 4 * e + i]
        s = np.swapaxes(np.asarray(leaf.scale_t.astype(jnp.float32), np.float64), -1, -2)
    else:
        words = np.asarray(leaf.qweight).astype(np.int64) & 0xFFFF
        nib = (words[..., None] >> (4 * np.arange(4))) & 0xF
        w = (nib - 8).reshape(*words.shape[:-1], -1).astype(np.float64)
        s = np.asarray(leaf.scale.astype(jnp.float32), np.float64)
    return w * np.repeat(s, 32, axis=-1)


def test_conversion_is_exact_and_only_touches_routed_experts(int4_params, mosaic_params):
    for layer in range(CFG.num_hidden_layers):
        name = f"layers_{layer}"
        if not CFG.is_moe_layer(layer):
            assert jax.tree.structure(mosaic_params[name]) == jax.tree.structure(int4_params[name])
            continue
        for w in ("gate", "up", "down"):
            leaf, before = mosaic_params[name]["moe"]["experts"][w], int4_params[name]["moe"]["experts"][w]
            assert isinstance(leaf, MosaicInt4Weight) and leaf.w_i4.dtype == jnp.int4
            np.testing.assert_array_equal(_dequant(leaf), _dequant(before))  # bf16 scales: bit exact
        assert isinstance(int4_params[name]["moe"]["experts"]["gate"], Int4Weight)  # the input is not modified
        shared = mosaic_params[name]["moe"]["shared"]["gate"]
        assert not is_quantized(shared)  # policy "experts": the shared expert stays dense


def test_bad_conversions_raise(int4_params, mosaic_params, f32_params):
    with pytest.raises(ValueError, match="already in the Mosaic layout"):
        kj.to_mosaic_experts(mosaic_params, CFG)
    with pytest.raises(ValueError, match="is not INT4"):
        kj.to_mosaic_experts(f32_params, CFG)
    dense_only = CFG.replace(num_hidden_layers=1)
    with pytest.raises(ValueError, match="no MoE layers"):
        kj.to_mosaic_experts({"layers_0": int4_params["layers_0"]}, dense_only)


class _FakeDevice:
    def __init__(self, platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200"):
        self.platform, self.compute_capability, self.device_kind = platform, compute_capability, device_kind


def test_mosaic_moe_unsupported_says_why(int4_params, mosaic_params, f32_params, bf16_params):
    """What `generate --moe-kernel auto` asks: None exactly for a Hopper GPU + bf16 + canonical INT4 experts
    with bf16 scales and dims that are multiples of 64; otherwise the reason."""
    why = kj.mosaic_moe_unsupported
    hopper = _FakeDevice()
    assert why(int4_params, CFG, hopper) is None
    assert "needs a Hopper GPU" in why(int4_params, CFG, _FakeDevice(compute_capability="8.0", device_kind="A100"))
    assert "needs a Hopper GPU" in why(int4_params, CFG, _FakeDevice(platform="cpu", compute_capability=None))
    if jax.default_backend() == "cpu":
        assert "needs a Hopper GPU" in why(int4_params, CFG)  # the default device: this CPU
    assert "needs bf16 activations" in why(kj.quantize(f32_params, CFG), CFG, hopper)
    f32_scales = kj.quantize(bf16_params, CFG, scale_dtype=jnp.float32)
    assert "scales are float32" in why(f32_scales, CFG, hopper)
    assert "not canonical INT4" in why(bf16_params, CFG, hopper)
    assert "not canonical INT4" in why(mosaic_params, CFG, hopper)  # already converted
    odd = CFG.replace(moe_intermediate_size=96)
    odd_params = kj.quantize(random_params(odd, seed=1, dtype=jnp.bfloat16), odd)
    assert "intermediate 96 not a multiple of 64" in why(odd_params, odd, hopper)
    with pytest.raises(ValueError, match="intermediate 96 not a multiple of 64"):
        kj.to_mosaic_experts(odd_params, odd)


def test_prepare_params_and_kernel_plan_follow_the_dispatcher(int4_params, mosaic_params):
    """kj.prepare_params converts the routed experts exactly where the dispatcher's layout rule says (auto on a
    Hopper GPU, or moe='mosaic_gpu'), and kj.kernel_plan names the kernel that then runs; an explicit kernel that
    cannot run raises."""
    hopper, cpu = _FakeDevice(), _FakeDevice(platform="cpu", compute_capability=None, device_kind="cpu")
    converted = kj.prepare_params(int4_params, CFG, device=hopper)
    for w in ("gate", "up", "down"):
        got, want = converted["layers_2"]["moe"]["experts"][w], mosaic_params["layers_2"]["moe"]["experts"][w]
        np.testing.assert_array_equal(_dequant(got), _dequant(want))
    kernel, reason = kj.kernel_plan(int4_params, CFG, device=hopper)["moe"]
    assert kernel == "mosaic_gpu" and "converted to the Mosaic layout" in reason
    assert kj.kernel_plan(converted, CFG, device=hopper)["moe"][0] == "mosaic_gpu"
    # c 64, r 16 run a kernel only where it measured faster than XLA: never at this unmeasured shape
    assert kj.kernel_plan(int4_params, CFG, device=hopper)["attention"] == (
        "xla", f"not measured faster than XLA at H={CFG.num_attention_heads}, c=64, r=16, bfloat16")
    # this CPU: nothing converted, the XLA paths are the plan
    assert kj.prepare_params(int4_params, CFG, device=cpu) is int4_params
    assert kj.kernel_plan(int4_params, CFG, device=cpu) == {
        "attention": ("xla", "no GPU, this is cpu"), "linear": ("none", "no INT4 dense weights"),
        "moe": ("xla", "no GPU, this is cpu"), "tree": ("xla", "no GPU, this is cpu"),
        "mla": ("folded", "small model: 0.1 MiB more a layer, fewer launches")}
    # over a mesh generate keeps the MLA projections separate (model.fold_params), and the plan says so: asked,
    # or from the surrounding jax.set_mesh as inside generate
    assert kj.kernel_plan(int4_params, CFG, device=cpu, sharded=True)["mla"] == ("separate", "sharded over a mesh")
    with jax.set_mesh(sharding.make_mesh("expert=1,tensor=1")):
        assert kj.kernel_plan(int4_params, CFG, device=cpu)["mla"] == ("separate", "sharded over a mesh")
    with pytest.raises(kj.KernelUnavailableError, match="folded projections have no sharding"):
        kj.kernel_plan(int4_params, CFG, device=cpu, kernels=kj.Kernels(mla="folded"), sharded=True)
    # an A100: the Triton kernel, and why not the Mosaic one
    ampere = _FakeDevice(compute_capability="8.0", device_kind="A100")
    assert kj.prepare_params(int4_params, CFG, device=ampere) is int4_params
    kernel, reason = kj.kernel_plan(int4_params, CFG, device=ampere)["moe"]
    assert kernel == "triton" and "needs a Hopper GPU (sm_90), this is A100" in reason
    # pinned per call
    triton = kj.Kernels(moe="triton")
    assert kj.prepare_params(int4_params, CFG, triton, device=hopper) is int4_params
    assert kj.kernel_plan(int4_params, CFG, device=hopper, kernels=triton)["moe"] == ("triton", "asked for")
    with pytest.raises(kj.KernelUnavailableError, match="moe impl='mosaic_gpu' cannot run: needs a Hopper GPU"):
        kj.prepare_params(int4_params, CFG, kj.Kernels(moe="mosaic_gpu"), device=cpu)
    with pytest.raises(kj.KernelUnavailableError, match="moe impl='mosaic_gpu' cannot run: needs a Hopper GPU"):
        kj.kernel_plan(int4_params, CFG, device=ampere, kernels=kj.Kernels(moe="mosaic_gpu"))
    with pytest.raises(kj.KernelUnavailableError, match="needs experts in the checkpoint layout"):
        kj.kernel_plan(converted, CFG, device=hopper, kernels=triton)


def test_model_forward_on_mosaic_experts_matches_canonical(int4_params, mosaic_params):
    """CPU: the XLA path over the Mosaic layout == the canonical INT4 path (GPU: the kernels); tokens of
    greedy DDTree == AR on the converted params."""
    tokens = jnp.asarray([[5, 17, 3, 99, 42, 7, 8]], jnp.int32)
    want = kj.forward(int4_params, CFG, tokens)
    got = kj.forward(mosaic_params, CFG, tokens)  # GPU: the Mosaic kernel itself; CPU: its XLA path
    assert rel_err(got, want) < 2e-2  # bf16 model: gate/up/down rounded to bf16 on one side only
    ar = kj.generate(CFG, mosaic_params, [[5, 17, 3]], max_new_tokens=6, stop_tokens=())
    oracle = kj.OracleDraft(jnp.concatenate([jnp.asarray([[5, 17, 3]]), ar.tokens], 1), 4, CFG.vocab_size)
    tree = kj.generate(CFG, mosaic_params, [[5, 17, 3]], max_new_tokens=6, stop_tokens=(), method="ddtree",
                       drafter=oracle, tree_budget=4)
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(ar.tokens))


def test_model_routed_experts_kernel_interpret_matches_reference():
    """grouped_moe_w4a16 on MosaicInt4Weight experts: the Mosaic kernel in interpret mode (simulated) == the
    XLA path == float64."""
    rng = np.random.default_rng(0)
    E, D, I, T, k = 4, 128, 64, 3, 2  # noqa: E741 (I: intermediate size)
    experts = {n: Int4Weight.from_dense(jnp.asarray(rng.standard_normal((E,) + shape) / np.sqrt(shape[0]),
                                                    jnp.float32))
               for n, shape in (("gate", (D, I)), ("up", (D, I)), ("down", (I, D)))}
    mosaic = {n: w.to_mosaic() for n, w in experts.items()}
    ids = jnp.asarray([[0, 2], [2, 3], [1, 2]], jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    want = np.zeros((T, D))
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g, u = _dequant(experts["gate"])[e] @ xf[t], _dequant(experts["up"])[e] @ xf[t]
            want[t] += float(weights[t, j]) * (_dequant(experts["down"])[e] @ (g / (1 + np.exp(-g)) * u))
    xla = grouped_moe_w4a16(x, mosaic, ids, weights, impl="xla", out_dtype=jnp.float32)
    assert rel_err(xla, want) < 1e-2  # x is bf16; the reference dequantizes in float32
    try:
        kernel = jax.block_until_ready(  # finish before the finally resets the interpreter
            grouped_moe_w4a16(x, mosaic, ids, weights, impl="mosaic_gpu", interpret=True, out_dtype=jnp.float32))
    finally:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

        reset_gpu_interpret_mode_state()
    assert kernel.dtype == jnp.float32 and rel_err(kernel, want) < 3e-2
    with pytest.raises(kj.KernelUnavailableError, match="needs bf16 activations, the model runs in float32"):
        grouped_moe_w4a16(x.astype(jnp.float32), mosaic, ids, weights, impl="mosaic_gpu", interpret=True)
    with pytest.raises(kj.KernelUnavailableError, match="needs experts in the checkpoint layout"):
        grouped_moe_w4a16(x, mosaic, ids, weights, impl="triton", interpret=True)


def test_sharding_rules_and_bytes(int4_params, mosaic_params):
    specs = sharding.param_specs(mosaic_params)["layers_1"]["moe"]["experts"]
    canon = sharding.param_specs(int4_params)["layers_1"]["moe"]["experts"]
    for w in ("gate", "up", "down"):
        assert specs[w].w_i4 == canon[w].qweight
        *lead, a, b = tuple(canon[w].scale)
        assert specs[w].scale_t == P(*lead, b, a)
    mesh = {"expert": 2, "tensor": 2}
    sharding.check_mesh(CFG, mesh, mosaic_params)  # every split dim divides
    assert (sharding.params_bytes_per_device(mosaic_params, mesh)
            == sharding.params_bytes_per_device(int4_params, mesh))  # int4 counted as half a byte


def test_saving_the_device_layout_is_refused(mosaic_params, tmp_path):
    with pytest.raises(kj.CheckpointError, match="Mosaic GPU layout"):
        kj.save_checkpoint(tmp_path / "ckpt", CFG, mosaic_params)
    assert not (tmp_path / "ckpt").exists()
