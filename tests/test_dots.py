"""pallas_kernels.dots: under an explicit XLA dot algorithm a vector-shaped float dot runs at HIGHEST (XLA's GPU
compiler would round its products to bf16), every other dot follows the process default; and the decode loops
(AR, DDTree, the drafter, the routed experts' XLA forms) write every float dot that way."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params
from jax import lax

import kdtree_jax as kj
from kdtree_jax.drafter import DrafterConfig, init_drafter_params
from pallas_kernels import dots
from pallas_kernels.moe_w4a16 import reference as moe_reference

HIGHEST = lax.Precision.HIGHEST
ALGORITHM = "BF16_BF16_F32_X6"  # an explicit algorithm XLA's CPU backend has (X9 it lacks)


@pytest.mark.parametrize("setting", [None, "highest", "default", "tensorfloat32", ALGORITHM, "F32_F32_F32"])
def test_dot_precision_changes_only_vectors_under_an_explicit_algorithm(matmul_precision, setting):
    jax.config.update("jax_default_matmul_precision", setting)
    explicit = setting in (ALGORITHM, "F32_F32_F32")
    assert dots.explicit_algorithm() is explicit
    assert dots.dot_precision(1, 64) == (HIGHEST if explicit else None)
    assert dots.dot_precision(64, 1) == (HIGHEST if explicit else None)
    assert dots.dot_precision(2, 64) is None  # a matrix on both sides follows the default
    assert dots.dot_precision(1, 64, lax.Precision.DEFAULT) == lax.Precision.DEFAULT  # a named one is kept


@pytest.mark.parametrize("shape", [(8, 64), (1, 64)])
def test_a_16_bit_dot_runs_one_pass_under_an_explicit_algorithm(matmul_precision, shape):
    """bf16 operands (a drafter computing in bf16 beside a float32 target) under a float32-accuracy algorithm: JAX
    would convert them to float32 and run every pass of the algorithm; dots runs them at DEFAULT (one bf16 pass,
    float32 accumulation), matrix or vector, float32 operands as before; a float32 operand keeps the algorithm."""
    jax.config.update("jax_default_matmul_precision", ALGORITHM)
    x, w = jnp.ones(shape, jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
    assert dots.dot_precision(shape[0], 32, None, (x.dtype, w.dtype)) == lax.Precision.DEFAULT
    (line,) = [ln for ln in jax.jit(lambda x, w: dots.matmul(x, w, preferred_element_type=jnp.float32)).lower(
        x, w).as_text().splitlines() if "dot_general" in ln]
    assert "algorithm" not in line and "precision = [DEFAULT, DEFAULT]" in line, line
    mixed = dots.dot_precision(shape[0], 32, None, (jnp.float32, jnp.bfloat16))
    assert mixed == (HIGHEST if shape[0] == 1 else None)


@pytest.mark.parametrize(("spec", "a", "b", "vector"), [
    ("td,tkid->tki", (5, 8), (5, 2, 4, 8), True),  # batched mat-vec: a has no free dimension
    ("tkd,tk->td", (5, 2, 8), (5, 2), True),       # a weighted combine: b has none
    ("mk,nk->mn", (1, 8), (4, 8), True),           # one row
    ("mk,nk->mn", (3, 8), (4, 8), False),
    ("btc,chn->bthn", (1, 1, 8), (8, 2, 4), True),
    ("btc,chn->bthn", (2, 1, 8), (8, 2, 4), False),
])
def test_einsum_lowers_vectors_at_highest_and_matrices_at_the_algorithm(matmul_precision, spec, a, b, vector):
    x, w = jnp.ones(a, jnp.float32), jnp.ones(b, jnp.float32)
    jax.config.update("jax_default_matmul_precision", ALGORITHM)
    (line,) = [ln for ln in jax.jit(lambda x, w: dots.einsum(spec, x, w)).lower(x, w).as_text().splitlines()
               if "dot_general" in ln]
    assert ("precision = [HIGHEST, HIGHEST]" in line) is vector, line
    assert ("algorithm = <lhs_precision_type = bf16" in line) is not vector, line
    np.testing.assert_allclose(dots.einsum(spec, x, w), jnp.einsum(spec, x, w, precision=HIGHEST), rtol=1e-6)


def test_matmul_and_einsum_reject_what_they_do_not_handle():
    with pytest.raises(ValueError, match="two operands, no ellipsis"):
        dots.einsum("...k,kn->...n", jnp.ones((2, 3)), jnp.ones((3, 4)))
    with pytest.raises(ValueError, match="does not fit operand ranks"):
        dots.einsum("mk,kn->mn", jnp.ones((2, 3, 1)), jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=r"matmul wants x \[..., K\] and w \[K, N\]"):
        dots.matmul(jnp.ones((2, 3)), jnp.ones((4, 5)))
    x, w = jnp.arange(6.0).reshape(1, 2, 3), jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(dots.matmul(x, w), x @ w)


# ----------------------------------------------------------------------------------- the decode loops
def _dot_equations(jaxpr):
    """Every dot_general equation of a (closed) jaxpr and of the jaxprs inside it (jit, while, cond, scan)."""
    inner = getattr(jaxpr, "jaxpr", None)
    if inner is not None and not hasattr(jaxpr, "eqns"):
        jaxpr = inner
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        if eqn.primitive.name == "pallas_call":  # a kernel's dots are its own, not XLA's
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _dot_equations(sub)


def _free_sizes(eqn) -> tuple[int, int]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a, b = (v.aval.shape for v in eqn.invars)
    return (math.prod(n for d, n in enumerate(a) if d not in (*lc, *lb)),
            math.prod(n for d, n in enumerate(b) if d not in (*rc, *rb)))


@pytest.fixture(scope="module")
def int4_pair():
    cfg = TINY.replace(num_hidden_layers=2)  # one dense layer, one MoE layer
    params = kj.quantize(random_params(cfg, seed=3), cfg, policy="experts")
    dcfg = DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    return cfg, params, (dcfg, init_drafter_params(dcfg, jax.random.key(1)))


@pytest.mark.parametrize("form", ["gather", "dense"])
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_decode_loops_run_every_vector_dot_at_highest_under_an_explicit_algorithm(matmul_precision, monkeypatch,
                                                                                   int4_pair, method, form):
    """Batch 1, the routed experts' XLA form a GPU runs (the CPU's own, "loop", has no vector-shaped dot): the AR
    step's one-row projections, the gather form's mat-vecs and the combines name HIGHEST; every other float dot
    follows the algorithm, except products that name their precision themselves (the fold's weight products)."""
    monkeypatch.setattr(moe_reference, "xla_form", lambda *args, **kwargs: form)
    cfg, params, drafter = int4_pair
    extra = {} if method == "ar" else {"drafter": drafter, **({"tree_budget": 6} if method == "ddtree" else {})}
    jax.config.update("jax_default_matmul_precision", ALGORITHM)
    program = jax.make_jaxpr(lambda: kj.generate(cfg, params, [[5, 6, 7]], max_new_tokens=6, method=method,
                                                 **extra))()
    floats = [e for e in _dot_equations(program) if jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)]
    vectors = [e for e in floats if min(_free_sizes(e)) == 1]
    matrices = [e for e in floats if min(_free_sizes(e)) > 1]
    assert vectors and matrices, (len(vectors), len(matrices))  # both kinds are there
    assert all(e.params["precision"] == (HIGHEST, HIGHEST) for e in vectors), [
        (_free_sizes(e), e.params["precision"]) for e in vectors if e.params["precision"] != (HIGHEST, HIGHEST)]
    assert all(e.params["precision"] in (lax.DotAlgorithmPreset[ALGORITHM], (HIGHEST, HIGHEST)) for e in matrices)
    assert any(e.params["precision"] == lax.DotAlgorithmPreset[ALGORITHM] for e in matrices)


@pytest.mark.gpu
def test_the_ar_loop_compiled_for_this_gpu_has_no_bf16_products(matmul_precision, int4_pair):
    """On the GPU's own compiler: under BF16_BF16_F32_X9 the float32 AR loop's optimized HLO has no multiply with a
    bf16 result (before pallas_kernels.dots, XLA rounded the products of every strength-reduced dot to bf16)."""
    from benchmarks.h200_hlo import count  # noqa: PLC0415 - the reading of a compiled module that script reports

    cfg, params, _ = int4_pair
    jax.config.update("jax_default_matmul_precision", "BF16_BF16_F32_X9")
    text = jax.jit(lambda: kj.generate(cfg, params, [[5, 6, 7]], max_new_tokens=6)).lower().compile().as_text() or ""
    counts = count(text)
    assert counts["dots"] > 0 and counts["bf16_products"] == 0, counts
