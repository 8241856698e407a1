"""pallas_kernels.dispatch, the one chooser: each rule, the per-call override, and a clear error when an asked-for
kernel cannot run; kj.kernel_plan on this CPU and on faked GPUs (the devices are stand-ins: only their platform,
compute capability and name are read)."""

import jax
import jax.numpy as jnp
import pytest
from helpers import A100, CPU, H200

import kdtree_jax as kj
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Choice, Kernels, KernelUnavailableError
from pallas_kernels.int4 import Int4Weight


def _experts(num_experts=4, hidden=128, inter=64, scale_dtype=jnp.bfloat16):
    """Abstract stacked INT4 experts (shapes and dtypes only: the dispatcher reads nothing else)."""
    S = jax.ShapeDtypeStruct
    weight = lambda n, k: Int4Weight(S((num_experts, n, k // 4), jnp.int16),  # noqa: E731
                                     S((num_experts, n, k // 32), scale_dtype))
    return {"gate": weight(inter, hidden), "up": weight(inter, hidden), "down": weight(hidden, inter)}


def _mosaic(experts):
    return jax.eval_shape(lambda e: {n: w.to_mosaic() for n, w in e.items()}, experts)


def test_kernels_dataclass_is_static_and_checked():
    assert hash(Kernels()) == hash(Kernels()) and Kernels(attention="xla") != Kernels()
    with pytest.raises(ValueError, match=r"Kernels.moe must be one of \('auto', 'triton', 'mosaic_gpu', 'xla'\), "
                                         r"got 'mosaic'"):
        Kernels(moe="mosaic")
    with pytest.raises(ValueError, match="Kernels.attention must be one of"):
        Kernels(attention="pallas")
    with pytest.raises(ValueError, match="interpret must be a bool"):
        Kernels(interpret="yes")


def test_attention_rules():
    choose = dispatch.choose_attention
    assert choose(latent_dim=512, rope_dim=64, device=H200) == Choice("mosaic_gpu", "Hopper GPU")
    assert choose(latent_dim=512, rope_dim=64, device=A100) == Choice(
        "xla", "needs a Hopper GPU (sm_90), this is NVIDIA A100")
    assert choose(latent_dim=512, rope_dim=64, device=CPU) == Choice("xla", "no GPU, this is cpu")
    assert choose(latent_dim=512, rope_dim=64, device=CPU, interpret=True) == Choice("mosaic_gpu", "interpret mode")
    # the Mosaic kernel's widths: auto states why it runs XLA
    assert choose(latent_dim=96, rope_dim=64, device=H200) == Choice(
        "xla", "latent width 96 not a multiple of 64 (wgmma, 128 B swizzle)")
    assert choose(latent_dim=512, rope_dim=48, device=CPU, interpret=True) == Choice(
        "xla", "RoPE width 48 not a power of two >= 16 (a TMA swizzle)")
    # natively c + r must be a multiple of 64 (the TMA tiling of the cache rows); interpret mode takes any
    assert choose(latent_dim=128, rope_dim=32, device=H200) == Choice(
        "xla", "row width c + r = 160 not a multiple of 64 (the TMA tiling of the cache rows; K2: 512 + 64)")
    assert choose(latent_dim=128, rope_dim=32, device=CPU, interpret=True) == Choice("mosaic_gpu", "interpret mode")
    with pytest.raises(KernelUnavailableError, match=r"impl='mosaic_gpu' cannot run: row width c \+ r = 80"):
        choose(latent_dim=64, rope_dim=16, device=H200, impl="mosaic_gpu")
    assert choose(latent_dim=512, rope_dim=64, device=H200, impl="xla") == Choice("xla", "asked for")
    with pytest.raises(KernelUnavailableError, match="attention impl='mosaic_gpu' cannot run: latent width 96"):
        choose(latent_dim=96, rope_dim=64, device=H200, impl="mosaic_gpu")
    with pytest.raises(KernelUnavailableError, match="attention impl='mosaic_gpu' cannot run: needs a Hopper GPU "
                                                     r"\(sm_90\), this is cpu"):
        choose(latent_dim=512, rope_dim=64, device=CPU, impl="mosaic_gpu")
    with pytest.raises(ValueError, match="attention impl must be one of"):  # the Triton kernel: deleted
        choose(latent_dim=512, rope_dim=64, device=H200, impl="triton")


def test_attention_auto_runs_what_measured_fastest():
    """On a GPU, auto runs the implementation measured fastest at the call shape (tree_attention.tuned.
    measured_fastest), the first of them that can run there: on an H200 K2's bf16 shape takes the Mosaic kernel at
    S_max >= 32768 for T = 1 and 9 and at S_max >= 4096 for T >= 33, XLA elsewhere (T = 1 and 9 below S_max 32768:
    XLA measured faster by one measure; below S_max 4096 and the other T of 2..32: not measured); never a kernel in
    float32 or at an unmeasured (H, c, r); a non-Hopper GPU skips the Mosaic kernel and says so; an explicit impl is
    obeyed; interpret mode on a CPU is unchanged."""
    def choose(device=H200, **kw):
        return dispatch.choose_attention(latent_dim=512, rope_dim=64, device=device, **kw)

    k2 = dict(num_heads=64, dtype=jnp.bfloat16)
    assert choose(**k2, num_tree=1, cache_rows=32768 + 64) == Choice(
        "mosaic_gpu", "T=1, S_max >= 32768: Mosaic measured fastest")
    assert choose(**k2, num_tree=33, cache_rows=32768 + 64) == Choice(
        "mosaic_gpu", "T=33 >= 33, S_max >= 4096: Mosaic measured fastest")
    assert choose(**k2, num_tree=129, cache_rows=65536).impl == "mosaic_gpu"
    assert choose(**k2, num_tree=33, cache_rows=4096 + 64) == Choice(
        "mosaic_gpu", "T=33 >= 33, S_max >= 4096: Mosaic measured fastest")
    assert choose(**k2, num_tree=129, cache_rows=2048) == Choice(
        "xla", "T=129, S_max=2048: XLA measured fastest (or no kernel measured here)")
    assert choose(**k2, num_tree=1, cache_rows=4096 + 64).impl == "xla"
    assert choose(**k2, num_tree=9, cache_rows=32768 + 64) == Choice(
        "mosaic_gpu", "T=9, S_max >= 32768: Mosaic measured fastest")
    assert choose(**k2, num_tree=9, cache_rows=4096 + 64).impl == "xla"  # slower by the wall clock there
    assert choose(**k2, num_tree=17, cache_rows=32768 + 64).impl == "xla"  # not measured
    assert choose(A100, **k2, num_tree=1, cache_rows=32768 + 64) == Choice(
        "xla", "T=1, S_max >= 32768: Mosaic measured fastest; not mosaic_gpu: needs a Hopper GPU (sm_90), "
               "this is NVIDIA A100")
    assert choose(A100, **k2, num_tree=33, cache_rows=32768 + 64).impl == "xla"
    assert choose(**k2) == Choice("mosaic_gpu", "per call shape, as measured")
    assert choose(num_heads=64, dtype=jnp.float32, num_tree=1, cache_rows=65536) == Choice(
        "xla", "float32: the kernel measured slower than XLA")
    assert choose(num_heads=6, dtype=jnp.bfloat16, num_tree=1, cache_rows=65536) == Choice(
        "xla", "not measured faster than XLA at H=6, c=512, r=64, bfloat16")
    assert choose(**k2, impl="mosaic_gpu") == Choice("mosaic_gpu", "asked for")
    with pytest.raises(KernelUnavailableError, match=r"impl='mosaic_gpu' cannot run: needs bf16 or f16, the model "
                                                     r"runs in float32"):
        choose(num_heads=6, dtype=jnp.float32, impl="mosaic_gpu")
    with pytest.raises(KernelUnavailableError, match=r"impl='mosaic_gpu' cannot run: needs a Hopper GPU"):
        choose(A100, **k2, impl="mosaic_gpu")
    with pytest.raises(KernelUnavailableError, match=r"impl='mosaic_gpu' cannot run: latent width 96 not a multiple"):
        dispatch.choose_attention(latent_dim=96, rope_dim=64, device=H200, impl="mosaic_gpu")
    assert dispatch.choose_attention(latent_dim=512, rope_dim=64, device=CPU, interpret=True, num_heads=6,
                                     dtype=jnp.float32, num_tree=1, cache_rows=64) == Choice(
        "xla", "needs bf16 or f16, the model runs in float32")
    assert dispatch.choose_attention(latent_dim=512, rope_dim=64, device=CPU, interpret=True, num_heads=6,
                                     dtype=jnp.bfloat16, num_tree=1, cache_rows=64) == Choice("mosaic_gpu",
                                                                                               "interpret mode")
    assert dispatch.choose_attention(latent_dim=512, rope_dim=64, device=CPU, interpret=True,
                                     impl="mosaic_gpu") == Choice("mosaic_gpu", "asked for")


def test_moe_kernel_follows_the_weight_type():
    canonical, act = _experts(num_experts=384, hidden=7168, inter=2048), jnp.bfloat16  # K2.6's routed stack
    mosaic = _mosaic(canonical)
    assert dispatch.choose_moe(canonical, act_dtype=act, device=H200) == Choice("triton", "GPU")
    assert dispatch.choose_moe(mosaic, act_dtype=act, device=H200) == Choice("mosaic_gpu", "GPU")
    assert dispatch.choose_moe(canonical, act_dtype=act, device=CPU).impl == "xla"
    assert dispatch.choose_moe(mosaic, act_dtype=act, device=CPU).impl == "xla"  # the CPU plan, either layout
    assert dispatch.choose_moe(mosaic, act_dtype=act, device=H200, impl="xla") == Choice("xla", "asked for")
    # an override that does not fit the layout, or a kernel that cannot run there: clear errors
    with pytest.raises(KernelUnavailableError, match="moe impl='triton' needs experts in the checkpoint layout"):
        dispatch.choose_moe(mosaic, act_dtype=act, device=H200, impl="triton")
    with pytest.raises(KernelUnavailableError, match="moe impl='mosaic_gpu' needs experts in the Mosaic layout"):
        dispatch.choose_moe(canonical, act_dtype=act, device=H200, impl="mosaic_gpu")
    with pytest.raises(KernelUnavailableError, match="moe impl='mosaic_gpu' cannot run: needs a Hopper GPU .*A100"):
        dispatch.choose_moe(mosaic, act_dtype=act, device=A100)  # auto, but the layout only runs on Hopper
    with pytest.raises(KernelUnavailableError, match="needs bf16 activations, the model runs in float32"):
        dispatch.choose_moe(mosaic, act_dtype=jnp.float32, device=H200)
    with pytest.raises(KernelUnavailableError, match="the grouped MoE kernels take INT4 experts"):
        dispatch.choose_moe({"gate": jnp.zeros(1), "up": jnp.zeros(1), "down": jnp.zeros(1)}, act_dtype=act)


def test_moe_small_stack_runs_xla_on_a_gpu():
    """A routed stack small enough for XLA's gather / dense forms runs XLA under auto on a GPU (measured faster than
    the kernels), at every token count; a large one the kernel; an explicit kernel is still honoured."""
    from pallas_kernels.moe_w4a16.tuned import XLA_FASTER_STACK_BYTES

    small, large = _experts(num_experts=32, hidden=384, inter=96), _experts(num_experts=384, hidden=7168, inter=2048)
    assert 32 * 3 * 384 * 96 * 4 <= XLA_FASTER_STACK_BYTES < 384 * 3 * 7168 * 2048 * 4
    for act in (jnp.float32, jnp.bfloat16):
        got = dispatch.choose_moe(small, act_dtype=act, device=H200)
        assert got == Choice("xla", "small expert stack (14 MiB as float32): XLA measured faster than the kernels")
        assert dispatch.choose_moe(large, act_dtype=act, device=H200) == Choice("triton", "GPU")
    pinned = dispatch.choose_moe(small, act_dtype=jnp.float32, device=H200, impl="triton")
    assert pinned == Choice("triton", "asked for")
    assert dispatch.choose_moe(small, act_dtype=jnp.float32, device=CPU, interpret=True).impl == "triton"
    # the layout: a small stack stays canonical (XLA reads it); a large one converts for the Mosaic kernel
    layout = lambda **kw: dispatch.choose_moe_layout(act_dtype=jnp.bfloat16, scale_dtype=jnp.bfloat16,  # noqa: E731
                                                     device=H200, **kw)
    assert layout(hidden=384, inter=128, num_experts=16).impl == "triton"  # 9 MiB as float32
    assert layout(hidden=7168, inter=2048, num_experts=384).impl == "mosaic_gpu"


def test_moe_layout_rule():
    """What prepare_params and the CLI ask: Mosaic where it can run (and, for auto, bf16 scales)."""
    layout = lambda **kw: dispatch.choose_moe_layout(  # noqa: E731
        **{"act_dtype": jnp.bfloat16, "scale_dtype": jnp.bfloat16, "hidden": 7168, "inter": 2048, **kw})
    assert layout(device=H200) == Choice("mosaic_gpu", "Hopper GPU, bf16")
    assert layout(device=A100) == Choice("triton", "needs a Hopper GPU (sm_90), this is NVIDIA A100")
    assert layout(device=H200, act_dtype=jnp.float32).reason == "needs bf16 activations, the model runs in float32"
    assert layout(device=H200, scale_dtype=jnp.float32).reason == "the INT4 scales are float32, not bfloat16"
    assert layout(device=H200, inter=96).reason == "intermediate 96 not a multiple of 64"
    assert layout(device=H200, impl="triton") == Choice("triton", "asked for")
    assert layout(device=H200, impl="xla") == Choice("triton", "asked for")  # the XLA path keeps the canonical layout
    assert layout(device=H200, impl="mosaic_gpu", scale_dtype=jnp.float32) == Choice("mosaic_gpu", "asked for")
    with pytest.raises(KernelUnavailableError, match="moe impl='mosaic_gpu' cannot run: needs a Hopper GPU"):
        layout(device=CPU, impl="mosaic_gpu")


@pytest.mark.usefixtures("kernel_moe_for_any_stack")
def test_kernel_plan_on_this_cpu_and_a_faked_h200(small_cfg):
    """The plan of a tiny INT4 model (all MLPs quantized: dense INT4 linears too) on the CPU and on an H200."""
    cfg = small_cfg
    params = jax.eval_shape(lambda: kj.quantize(kj.init_params(cfg, jax.random.key(0), jnp.bfloat16), cfg,
                                                "all_mlp"))
    on_cpu = kj.kernel_plan(params, cfg, device=CPU)
    assert on_cpu == {"attention": ("xla", "no GPU, this is cpu"),
                      # layer 0's MLP + layer 1's shared expert
                      "linear": ("xla", "needs a Hopper GPU (sm_90), this is cpu; 6 INT4 weights"),
                      "moe": ("xla", "no GPU, this is cpu"), "tree": ("xla", "no GPU, this is cpu"),
                      "mla": ("folded", "small model: 0.1 MiB more a layer, fewer launches")}
    assert kj.plan_summary(on_cpu) == ("attention xla (no GPU, this is cpu), linear xla (needs a Hopper GPU "
                                       "(sm_90), this is cpu; 6 INT4 weights), moe xla (no GPU, this is cpu), tree "
                                       "xla (no GPU, this is cpu), mla folded (small model: 0.1 MiB more a layer, "
                                       "fewer launches)")
    on_h200 = kj.kernel_plan(params, cfg, device=H200)
    assert on_h200["attention"] == ("xla", f"not measured faster than XLA at H={cfg.num_attention_heads}, "
                                    f"c={cfg.kv_lora_rank}, r={cfg.qk_rope_head_dim}, bfloat16")
    assert on_h200["linear"] == ("xla", "small weight (384 x 192): XLA measured faster at one row; 6 INT4 weights")
    assert on_h200["moe"] == ("mosaic_gpu", "experts converted to the Mosaic layout once at load; GPU")
    pinned = kj.kernel_plan(params, cfg, device=H200, kernels=Kernels(attention="xla", moe="triton"))
    assert pinned["attention"] == ("xla", "asked for") and pinned["moe"] == ("triton", "asked for")
    f32 = jax.eval_shape(lambda: kj.quantize(kj.init_params(cfg, jax.random.key(0)), cfg))
    assert kj.kernel_plan(f32, cfg, device=H200)["moe"] == (
        "triton", "Mosaic GPU kernel not used: needs bf16 activations, the model runs in float32; GPU")
    assert kj.kernel_plan(jax.eval_shape(lambda: kj.init_params(cfg, jax.random.key(0))), cfg, device=H200) == {
        "attention": ("xla", "float32: the kernel measured slower than XLA"),
        "linear": ("none", "no INT4 dense weights"), "moe": ("xla", "dense experts (not INT4)"),
        "tree": ("triton", "GPU"), "mla": ("folded", "small model: 0.1 MiB more a layer, fewer launches")}
    with pytest.raises(ValueError, match="kernels must be a kdtree_jax.Kernels, got dict"):
        kj.kernel_plan(params, cfg, kernels={"moe": "xla"})


def test_per_call_override_reaches_the_model(small_cfg, small_init_params):
    """kj.forward(..., kernels=...) decides per call: the pinned kernel runs (interpret mode here) or raises."""
    cfg = small_cfg
    params = kj.quantize(small_init_params, cfg)
    tokens = jnp.asarray([[3, 17, 42]], jnp.int32)
    want = kj.forward(params, cfg, tokens, kernels=Kernels(attention="xla", linear="xla", moe="xla"))
    got = kj.forward(params, cfg, tokens, kernels=Kernels(moe="triton", interpret=True))
    assert float(jnp.max(jnp.abs(got - want))) < 1e-4 * float(jnp.max(jnp.abs(want)))
    if jax.default_backend() == "cpu":
        with pytest.raises(KernelUnavailableError, match="moe impl='triton' cannot run: no GPU"):
            kj.forward(params, cfg, tokens, kernels=Kernels(moe="triton"))
    with pytest.raises(KernelUnavailableError, match="needs experts in the Mosaic layout"):
        kj.forward(params, cfg, tokens, kernels=Kernels(moe="mosaic_gpu"))
    with pytest.raises(ValueError, match="kernels must be a kdtree_jax.Kernels"):
        kj.generate(cfg, params, [[3, 17]], max_new_tokens=1, kernels="xla")
