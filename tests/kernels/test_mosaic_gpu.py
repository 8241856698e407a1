"""Mosaic GPU W4A16: the dense GEMM (pallas_kernels.w4a16, impl="mosaic_gpu", over the tile loop of
pallas_kernels.w4a16.mosaic_gpu, with split-K) vs the plain-jnp float32 reference (pallas_kernels.w4a16.reference),
and the tiling config the grouped MoE shares.

On CPU the kernel body runs in Mosaic GPU interpret mode (simulated threads, SMEM, TMA, barriers, with the
race detector on); the register-A path, which that interpreter cannot run, is covered by the CUDA lowering
test here and by the native test on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import abstract_h200, custom_calls, lower_for_h200

from pallas_kernels import dispatch
from pallas_kernels.int4 import Int4Weight
from pallas_kernels.w4a16 import dense_config, w4a16_matmul, w4a16_matmul_reference
from pallas_kernels.w4a16.mosaic_gpu import MgpuConfig, gpu_interpret_params, w4a16_matmul_mgpu_kernel


def w4a16_matmul_mgpu(x, w, **kw):
    """The dense Mosaic kernel through the public entry (the weight converted to its layout first)."""
    w = w.to_mosaic() if isinstance(w, Int4Weight) else w
    return w4a16_matmul(x, w, impl="mosaic_gpu", **kw)


@pytest.fixture(autouse=True)
def _reset_interpreter():
    # After an exception inside an interpreted kernel the interpreter's global state must be reset
    # before the next kernel runs (jax docs for InterpretGPUParams).
    yield
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
    reset_gpu_interpret_mode_state()


def _problem(m, n, k, seed, scale_dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.key(seed))
    leaf = Int4Weight.from_dense(jax.random.normal(kw, (k, n), jnp.float32), scale_dtype=scale_dtype)  # [N, K/4]
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)  # [M, K]
    want = w4a16_matmul_reference(x.astype(jnp.float32), leaf)  # [M, N] f32
    return x, leaf, np.asarray(want, np.float64)


def _rel_err(got, want):
    return np.max(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)) / np.max(np.abs(want))


# (M, N, K, config, split_k, whole_tiles): M not a multiple of 8 (5, 1, 3, 2: no pad, the kernel reads an 8-row
# token tile past the last row, which only reaches output columns that are dropped; 9: padded to 16), 2 N tiles x 2
# K steps with 4 groups per step, block_n 128; split-K: 2 and 4 K chunks (each its own scale rows), with 2 N tiles;
# mixed: of 3 N tiles the first 1 or 2 whole, the rest in 2 or 4 K chunks (two pipelines of different lengths).
INTERPRET_CASES = [
    (5, 64, 64, MgpuConfig(a_operand="smem"), 1, 0),
    (16, 128, 256, MgpuConfig(block_n=64, block_k=128, max_concurrent_steps=2, a_operand="smem"), 1, 0),
    (1, 128, 128, MgpuConfig(block_n=128, block_k=64, a_operand="smem"), 1, 0),
    (3, 128, 256, MgpuConfig(block_n=64, block_k=64, max_concurrent_steps=2, a_operand="smem"), 2, 0),
    (9, 64, 256, MgpuConfig(a_operand="smem"), 4, 0),
    (2, 192, 256, MgpuConfig(a_operand="smem"), 2, 2),
    (8, 192, 256, MgpuConfig(block_k=64, max_concurrent_steps=2, a_operand="smem"), 4, 1),
]


@pytest.mark.parametrize("m,n,k,cfg,split_k,whole_tiles", INTERPRET_CASES)
def test_interpret_matches_reference(m, n, k, cfg, split_k, whole_tiles):
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    x, leaf, want = _problem(m, n, k, seed=m + n + k)
    got = jax.block_until_ready(  # the interpreter runs at execution (async dispatch): wait before asking
        w4a16_matmul_mgpu(x, leaf, interpret=gpu_interpret_params(detect_races=True), config=cfg, split_k=split_k,
                          whole_tiles=whole_tiles))
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    assert not get_races().races_found
    # bf16 dequantized weights (2^-9 relative) and a bf16 output bound the error.
    assert _rel_err(got, want) < 1e-2


def test_interpret_default_config_and_f32_scales():
    """interpret=True picks a_operand="smem" and the tuned split (here K / 64 = 2 chunks: one 64-wide N tile is far
    from 132 CTAs); float32 scales are rounded to bf16 by the layout conversion."""
    x, leaf, want = _problem(3, 64, 128, seed=7, scale_dtype=jnp.float32)
    assert dense_config(128, 64) == (MgpuConfig(block_n=64, block_k=64), 2, 0)
    assert _rel_err(w4a16_matmul_mgpu(x, leaf, interpret=True), want) < 1e-2


def test_shared_memory_is_checked_up_front():
    """The formula matches what Mosaic reported on the H200 (626720 B with its barriers) for 256 rows at block_k
    256, 4 steps, and such a tiling is refused with a clear error before compiling."""
    from pallas_kernels.w4a16.mosaic_gpu import MAX_SMEM_BYTES, check_config, smem_bytes

    assert smem_bytes(MgpuConfig(block_k=256), 256) == 626688
    assert smem_bytes(MgpuConfig(block_k=256), 64) < MAX_SMEM_BYTES  # the engine's largest call
    with pytest.raises(ValueError, match="needs 626688 B of shared memory"):
        check_config(MgpuConfig(block_k=256), 7168, 7168, 256, None)


def test_dense_tiling_rule():
    """Equal work for the 132 SMs: fewer 64-wide N slices than SMs split K into the fewest chunks that make 132 CTAs;
    of more, a multiple of 132 run whole and the rest split K into the most chunks that give no SM two; the deepest
    block_k per chunk."""
    # 288 slices: 264 whole (2 an SM) + the other 24 in 4 chunks of 1792 (96 CTAs: no SM gets two), not 288 whole
    # (24 SMs with 3)
    assert dense_config(7168, 18432) == (MgpuConfig(block_n=64, block_k=256), 4, 264)
    assert dense_config(7168, 140 * 64) == (MgpuConfig(block_n=64, block_k=64), 16, 132)  # 8 x 16 = 128 <= 132
    # an H100 PCIe's 114 SMs: 228 whole + 60 x 1 (60 x 2 would give some SMs two chunks)
    assert dense_config(7168, 18432, num_sms=114) == (MgpuConfig(block_n=64, block_k=256), 1, 228)
    assert dispatch.sm_count() == 132  # no GPU here: the Hopper SXM count the plans are tuned for
    assert dense_config(7168, 2048) == (MgpuConfig(block_n=64, block_k=256), 7, 0)  # 32 tiles x 7: 1024-wide chunks
    assert dense_config(2048, 7168) == (MgpuConfig(block_n=64, block_k=256), 2, 0)  # 112 x 2
    assert dense_config(384, 1024) == (MgpuConfig(block_n=64, block_k=64), 6, 0)  # never fills: one step a split
    assert dense_config(7168, 132 * 2 * 64) == (MgpuConfig(block_n=64, block_k=256), 1, 264)  # divides: all whole


def test_lowers_for_cuda_at_k2_shapes():
    """Mosaic GPU lowering (layouts, int4 upcast, register-A wgmma) runs on CPU against an abstract H200."""
    for m, n, k, cfg, split, whole in [(8, 7168, 2048, MgpuConfig(), 1, 0),
                                       (1, 2048, 7168, *dense_config(7168, 2048)),  # one row: no pad, 8-row tile
                                       (13, 512, 1024, MgpuConfig(), 1, 0),  # padded to 16: Mosaic's TMA
                                       (16, 2048, 7168, MgpuConfig(block_n=128, block_k=128), 1, 0),
                                       (64, 512, 7168, MgpuConfig(a_operand="smem"), 1, 0),
                                       (8, 2048, 7168, *dense_config(7168, 2048)),  # split-K 7
                                       (8, 18432, 7168, *dense_config(7168, 18432))]:  # 264 whole + 24 x 4
        args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int4),
                jax.ShapeDtypeStruct((k // 32, n), jnp.bfloat16))
        f = lambda x, w, s, cfg=cfg, split=split, whole=whole: w4a16_matmul_mgpu_kernel(  # noqa: E731
            x, w, s, config=cfg, split_k=split, whole_tiles=whole)
        with abstract_h200():
            assert jax.eval_shape(f, *args).shape == (n, -(-m // 8) * 8)  # y^T [N, Mp]
        assert custom_calls(lower_for_h200(f, *args)) == ["mosaic_gpu_v2"]  # one launch, however the work splits


@pytest.mark.gpu
@pytest.mark.parametrize("a_operand", ["registers", "smem"])
@pytest.mark.parametrize("m,n,k", [(1, 7168, 2048), (16, 2048, 7168), (5, 256, 512), (13, 512, 1024)])
def test_native_gpu(m, n, k, a_operand):
    if not dispatch.is_hopper(jax.devices()[0]):
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
    x, leaf, want = _problem(m, n, k, seed=m + n + k)
    got = w4a16_matmul_mgpu(x, leaf, config=MgpuConfig(a_operand=a_operand), split_k=1)
    assert _rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 64, 256])
@pytest.mark.parametrize("k,n", [(7168, 2048), (2048, 7168), (7168, 18432), (384, 1024)])
def test_native_gpu_tuned_split_k(m, k, n):
    """The tiling and split-K the engine uses (tuned.dense_config), at K2.6 and shipped-pair shapes, M up to 64; at
    256 rows auto runs XLA (the block_k 256 tiling would need 627 KB of shared memory: refused up front)."""
    if not dispatch.is_hopper(jax.devices()[0]):
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
    x, leaf, want = _problem(m, n, k, seed=m + n + k)
    mosaic = leaf.to_mosaic()
    auto = dispatch.choose_linear(mosaic, rows=m, act_dtype=x.dtype).impl
    assert auto == ("mosaic_gpu" if m <= 64 and k * n >= dispatch.LINEAR_MIN_ELEMENTS else "xla")
    assert _rel_err(w4a16_matmul(x, mosaic), want) < 1e-2
    if m <= 64:
        assert _rel_err(w4a16_matmul(x, mosaic, impl="mosaic_gpu"), want) < 1e-2


def test_value_errors():
    x, leaf, _ = _problem(2, 64, 64, seed=0)
    with pytest.raises(ValueError, match="interpret mode"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, config=MgpuConfig(a_operand="registers"))
    with pytest.raises(ValueError, match="a_operand"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, config=MgpuConfig(a_operand="tmem"))
    with pytest.raises(ValueError, match="block_k=32"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, config=MgpuConfig(block_k=32, a_operand="smem"))
    with pytest.raises(ValueError, match="N=64 must be divisible by block_n=128"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, config=MgpuConfig(block_n=128, a_operand="smem"))
    with pytest.raises(ValueError, match=r"whole_tiles=2 must be in \[0, 1\]"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, split_k=1, whole_tiles=2)
    with pytest.raises(ValueError, match="1 when no slice is split"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, split_k=2, whole_tiles=1)
    with pytest.raises(dispatch.KernelUnavailableError, match="needs bf16 activations, the model runs in float32"):
        w4a16_matmul_mgpu(x.astype(jnp.float32), leaf, interpret=True)
    with pytest.raises(dispatch.KernelUnavailableError, match="300 rows > 64"):
        w4a16_matmul_mgpu(jnp.zeros((300, 64), jnp.bfloat16), leaf, interpret=True)
    with pytest.raises(ValueError, match="x has K=32 columns, the weight takes K=64"):
        w4a16_matmul_mgpu(x[:, :32], leaf, interpret=True)
    with pytest.raises(ValueError, match="must be an Int4Weight or MosaicInt4Weight .*got dict"):
        w4a16_matmul_mgpu(x, {"qweight": leaf.qweight}, interpret=True)
    with pytest.raises(ValueError, match="split_k=3 must be a positive divisor of K=64"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, config=MgpuConfig(a_operand="smem"), split_k=3)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 64 .* dividing K=32"):
        w4a16_matmul_mgpu(x, leaf, interpret=True, config=MgpuConfig(a_operand="smem"), split_k=2)


def test_config_parse_and_the_moe_default_tiling():
    from pallas_kernels.moe_w4a16.tuned import default_mosaic_config as default_config

    shape_unsupported = dispatch.mosaic_moe_shape_unsupported

    assert MgpuConfig.parse("bn128:bk256:s3:smem") == MgpuConfig(block_n=128, block_k=256, max_concurrent_steps=3,
                                                                a_operand="smem")
    assert MgpuConfig.parse("bk512") == MgpuConfig(block_k=512)  # unnamed fields keep their defaults
    for bad in ("bn64:bk", "bn64:select", "xx64", ""):
        with pytest.raises(ValueError, match="bad Mosaic tiling"):
            MgpuConfig.parse(bad)
    # the measured best at K2.6 shapes: block_n 64 and the deepest block_k dividing K
    assert default_config(7168) == MgpuConfig(block_n=64, block_k=256)
    assert default_config(2048).block_k == 256 and default_config(192).block_k == 64
    assert default_config(384).block_k == 128
    assert shape_unsupported(7168, 2048) is None
    assert shape_unsupported(7168, 96) == "intermediate 96 not a multiple of 64"
