"""W4A16 Pallas kernel vs an independent float64 NumPy reference (reference/int4.py).

On CPU the very kernel body runs in Pallas interpret mode; on a GPU the native test runs it compiled.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4 import Int4Weight
from pallas_kernels import w4a16
from pallas_kernels.w4a16 import BlockConfig, w4a16_matmul, w4a16_matmul_reference
from reference import int4 as ref

ON_GPU = jax.default_backend() == "gpu"


def _problem(m, k, n, *, act_dtype=jnp.bfloat16, scale_dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    packed = ref.pack(q)
    scale = jnp.asarray(rng.uniform(0.005, 0.05, size=(n, k // 32)), scale_dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), act_dtype)
    leaf = Int4Weight.from_compressed(jnp.asarray(packed), scale).to_dict()
    want = ref.matmul(np.asarray(x.astype(jnp.float32), np.float64), packed,
                      np.asarray(scale.astype(jnp.float32), np.float64))  # [M, N] float64
    return x, leaf, want


def _rel_err(got, want):
    return np.max(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)) / np.max(np.abs(want))


# (M, K, N, config): awkward M (1, 3, 17), K = 32, split-K, both dequant methods, M tiles > 1.
CASES = [
    (1, 32, 16, BlockConfig(block_n=16, block_k=32)),
    (3, 64, 32, BlockConfig(block_n=32, block_k=32, split_k=2)),
    (17, 256, 64, BlockConfig(block_m=16, block_n=64, block_k=64, split_k=2)),
    (8, 512, 128, BlockConfig(block_n=128, block_k=128, dequant="convert")),
    (33, 128, 32, BlockConfig(block_m=32, block_n=32, block_k=128)),
]


@pytest.mark.parametrize("m,k,n,cfg", CASES)
@pytest.mark.parametrize("act_dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_interpret_matches_reference(m, k, n, cfg, act_dtype):
    x, leaf, want = _problem(m, k, n, act_dtype=act_dtype, seed=m + k + n)
    got = w4a16_matmul(x, leaf, impl="pallas", interpret=True, config=cfg)
    assert got.shape == (m, n) and got.dtype == act_dtype
    # bf16 dequantized weights (2^-9 relative) and a bf16 output bound the error.
    assert _rel_err(got, want) < (2e-2 if act_dtype == jnp.bfloat16 else 1e-5)


def test_float32_scales_interpret():
    x, leaf, want = _problem(5, 128, 64, scale_dtype=jnp.float32)
    got = w4a16_matmul(x, leaf, impl="pallas", interpret=True, config=BlockConfig(block_n=64, block_k=64))
    assert _rel_err(got, want) < 2e-2


def test_heuristic_config_interpret():
    x, leaf, want = _problem(2, 1024, 64)
    cfg = w4a16.heuristic_config(2, 1024, 64)
    assert cfg.split_k > 1  # few N tiles -> split K to fill the SMs
    got = w4a16_matmul(x, leaf, impl="pallas", interpret=True)
    assert _rel_err(got, want) < 2e-2


def test_xla_reference_path_matches_numpy():
    x, leaf, want = _problem(3, 96, 48, act_dtype=jnp.float32)
    got = w4a16_matmul_reference(x, leaf["qweight"], leaf["scale"])
    assert _rel_err(got, want) < 1e-6


@pytest.mark.skipif(ON_GPU, reason="checks the CPU fallback of impl='auto'; on a GPU auto runs the kernel")
def test_auto_on_cpu_is_loud_and_recorded():
    x, leaf, want = _problem(2, 64, 32)
    with pytest.warns(w4a16.W4A16FallbackWarning, match="NOT the Pallas"):
        got = w4a16_matmul(x, leaf)
    assert _rel_err(got, want) < 2e-2
    assert w4a16.resolve_impl("auto") == "xla"
    assert w4a16.resolve_impl("auto", interpret=True) == "pallas"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w4a16_matmul(x, leaf, impl="xla")  # explicit choice: no warning


def test_bad_inputs_raise_clearly():
    x, leaf, _ = _problem(2, 64, 32)
    with pytest.raises(ValueError, match="divisible by the group size"):
        w4a16_matmul(jnp.zeros((2, 48), jnp.bfloat16), leaf, impl="xla")
    with pytest.raises(ValueError, match="x dtype"):
        w4a16_matmul(x.astype(jnp.float16), leaf, impl="xla")
    with pytest.raises(ValueError, match="scale shape"):
        w4a16_matmul(x, {"qweight": leaf["qweight"], "scale": leaf["scale"][:, :1]}, impl="xla")
    with pytest.raises(ValueError, match="qweight must be int16"):
        w4a16_matmul(x, (leaf["qweight"].astype(jnp.int32), leaf["scale"]), impl="xla")
    with pytest.raises(ValueError, match="holds K="):
        w4a16_matmul(jnp.zeros((2, 96), jnp.bfloat16), leaf, impl="xla")
    with pytest.raises(ValueError, match="divisible by block_n"):
        w4a16_matmul(x, leaf, impl="pallas", interpret=True, config=BlockConfig(block_n=64, block_k=32))
    with pytest.raises(ValueError, match="impl must be"):
        w4a16_matmul(x, leaf, impl="triton")


@pytest.mark.skipif(not ON_GPU, reason="native kernel test needs a GPU (CPU runs the interpret-mode tests)")
@pytest.mark.parametrize("m", [1, 3, 17, 64, 128, 256])
@pytest.mark.parametrize("k,n", [(7168, 2048), (2048, 7168)])
def test_kernel_native_gpu(m, k, n):
    x, leaf, want = _problem(m, k, n, seed=m)
    got = w4a16_matmul(x, leaf, impl="pallas")
    assert _rel_err(got, want) < 2e-2
