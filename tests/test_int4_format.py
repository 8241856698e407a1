"""INT4 group-32 format: jnp functions and the typed Int4Weight against the NumPy reference (reference/int4.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.linear import linear
from pallas_kernels import int4 as quant
from pallas_kernels.dispatch import Kernels
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from reference import int4 as ref


def test_worked_example_packs_to_documented_word():
    q = np.array([[-8, -7, -1, 0, 1, 2, 3, 7]], dtype=np.int8)
    want = np.array([[0xFBA98710]], dtype=np.uint32).view(np.int32)
    np.testing.assert_array_equal(ref.pack(q), want)
    np.testing.assert_array_equal(np.asarray(quant.pack_int4(jnp.asarray(q))), want)
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(jnp.asarray(want))), q)


def test_reference_layout_by_hand():
    # Column 8j+i in bits 4i..4i+3 of word j, stored as q + 8 (checked bit by bit, not via ref.pack).
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(3, 24))
    words = ref.pack(q).view(np.uint32)
    for n in range(3):
        for col in range(24):
            j, i = divmod(col, 8)
            assert (int(words[n, j]) >> (4 * i)) & 0xF == q[n, col] + 8


@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (2, 3, 96)])
def test_pack_unpack_bit_exact_vs_reference(shape):
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, size=shape).astype(np.int8)
    packed = np.asarray(quant.pack_int4(jnp.asarray(q)))
    np.testing.assert_array_equal(packed, ref.pack(q))
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(jnp.asarray(packed))), q)
    np.testing.assert_array_equal(ref.unpack(packed), q)


def test_all_int32_bit_patterns_round_trip():
    # Any file word (random 32-bit patterns incl. sign bit) survives unpack -> pack bit for bit.
    rng = np.random.default_rng(2)
    words = rng.integers(0, 2**32, size=(4, 16), dtype=np.uint64).astype(np.uint32).view(np.int32)
    q = np.asarray(quant.unpack_int4(jnp.asarray(words)))
    np.testing.assert_array_equal(q, ref.unpack(words))
    np.testing.assert_array_equal(np.asarray(quant.pack_int4(jnp.asarray(q))), words)


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_matches_reference_and_half_step(scale_dtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 128)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # an all-zero group
    q, scale = quant.quantize_int4(jnp.asarray(w), scale_dtype)
    q, scale = np.asarray(q), np.asarray(scale.astype(jnp.float32), np.float64)
    assert q.min() >= -8 and q.max() <= 7
    deq = ref.dequantize(q, scale)
    step = np.repeat(scale, 32, axis=-1)
    assert np.all(np.abs(deq - w) <= 0.5 * step * (1 + 1e-6) + 1e-12)
    if scale_dtype == jnp.float32:
        q_ref, s_ref = ref.quantize(w)
        np.testing.assert_allclose(scale, s_ref, rtol=1e-6)
        assert np.mean(q == q_ref) > 0.999  # float32 vs float64 division may flip an exact tie
    np.testing.assert_array_equal(q[0, :32], 0)


def test_dequantize_matches_reference():
    rng = np.random.default_rng(4)
    q = rng.integers(-8, 8, size=(2, 5, 64)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, size=(2, 5, 2)).astype(np.float32)
    got = np.asarray(quant.dequantize_int4(jnp.asarray(q), jnp.asarray(s)))
    np.testing.assert_allclose(got, ref.dequantize(q, s), rtol=1e-6)


@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_leaf_round_trip_bit_exact(lead, scale_dtype):
    rng = np.random.default_rng(5)
    n, k = 16, 96
    q = rng.integers(-8, 8, size=(*lead, n, k)).astype(np.int8)
    packed = ref.pack(q)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, size=(*lead, n, k // 32)), scale_dtype)
    leaf = Int4Weight.from_compressed(jnp.asarray(packed), scale)
    assert isinstance(leaf, Int4Weight) and leaf.check() == (n, k) and leaf.lead_shape == lead
    assert leaf.qweight.shape == (*lead, n, k // 4) and leaf.qweight.dtype == jnp.int16
    # Kernel layout: int16 word w nibble i = column 4w+i as q + 8.
    words = np.asarray(leaf.qweight).view(np.uint16).astype(np.int64)
    for i in range(4):
        np.testing.assert_array_equal(((words >> (4 * i)) & 0xF) - 8, q[..., i::4])
    back_packed, back_scale = leaf.to_compressed()
    np.testing.assert_array_equal(np.asarray(back_packed), packed)
    assert back_scale.dtype == scale.dtype
    np.testing.assert_array_equal(np.asarray(back_scale), np.asarray(scale))
    np.testing.assert_allclose(np.asarray(leaf.dequantize()),
                               ref.dequantize(q, np.asarray(scale.astype(jnp.float32))), rtol=1e-6)
    # the stored (checkpoint) form round-trips; the Mosaic layout holds the same q and (bf16) scales
    assert Int4Weight.is_dict(leaf.to_dict()) and Int4Weight.from_dict(leaf.to_dict()) == leaf
    mosaic = leaf.to_mosaic()
    assert isinstance(mosaic, MosaicInt4Weight) and mosaic.check() == (n, k)
    np.testing.assert_array_equal(np.asarray(mosaic.q()), q)
    # stored in lane order: column 8t + 4e + i of a 32-column group holds column 8i + 2t + e (written out here)
    p = np.arange(k)
    t, e, i = (p % 32) // 8, (p % 8) // 4, p % 4
    np.testing.assert_array_equal(np.asarray(mosaic.w_i4.astype(jnp.int8)), q[..., p - p % 32 + 8 * i + 2 * t + e])
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(mosaic.scale_t, -1, -2)),
                                  np.asarray(scale.astype(jnp.bfloat16)))
    if scale_dtype == jnp.bfloat16:  # bf16 scales: the way back is bit-exact
        back = mosaic.to_checkpoint_layout()
        np.testing.assert_array_equal(np.asarray(back.qweight), np.asarray(leaf.qweight))


def test_leaf_passes_through_jit_as_pytree():
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32)  # stacked [E, K, N] params layout
    leaf = Int4Weight.from_dense(w)
    assert leaf.qweight.shape == (2, 32, 16) and leaf.scale.shape == (2, 32, 2)
    assert leaf.dense_shape == (2, 64, 32)
    out = jax.jit(lambda t: jax.tree.map(lambda a: a, t))(leaf)
    assert isinstance(out, Int4Weight)
    np.testing.assert_array_equal(np.asarray(out.qweight), np.asarray(leaf.qweight))
    deq = np.asarray(leaf.dequantize())  # [E, N, K]
    step = np.repeat(np.asarray(leaf.scale.astype(jnp.float32)), 32, axis=-1)
    assert np.all(np.abs(deq - np.swapaxes(np.asarray(w), -1, -2)) <= 0.5 * step * (1 + 1e-6) + 1e-7)


def test_int4_linear_xla_path_vs_reference():
    rng = np.random.default_rng(7)
    q = rng.integers(-8, 8, size=(48, 64)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, size=(48, 2)).astype(np.float32)
    weight = Int4Weight.from_compressed(jnp.asarray(ref.pack(q)), jnp.asarray(s))
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    y = linear(jnp.asarray(x), weight, Kernels(linear="xla"))
    assert y.shape == (2, 3, 48)
    np.testing.assert_allclose(np.asarray(y), ref.matmul(x, ref.pack(q), s), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clearly():
    with pytest.raises(ValueError, match="K=40"):
        quant.quantize_int4(jnp.zeros((4, 40)))
    with pytest.raises(ValueError, match="scale shape"):
        Int4Weight.from_compressed(jnp.zeros((4, 8), jnp.int32), jnp.zeros((4, 3), jnp.float32))
    with pytest.raises(ValueError, match="int32"):
        Int4Weight.from_compressed(jnp.zeros((4, 8), jnp.uint32), jnp.zeros((4, 2), jnp.float32))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        Int4Weight.from_compressed(jnp.zeros((4, 8), jnp.int32), jnp.zeros((4, 2), jnp.float16))
    with pytest.raises(ValueError, match="not a stored INT4 weight"):
        Int4Weight.from_dict({"packed": jnp.zeros((4, 8), jnp.int32)})
    with pytest.raises(ValueError, match="qweight must be int16"):
        Int4Weight(jnp.zeros((4, 8), jnp.int32), jnp.zeros((4, 1), jnp.float32)).check()
    with pytest.raises(ValueError, match="unstacked"):
        linear(jnp.zeros((1, 64)), Int4Weight.from_dense(jnp.zeros((2, 64, 32))), Kernels(linear="xla"))
    with pytest.raises(ValueError, match="q values"):
        ref.pack(np.full((1, 8), 8))
