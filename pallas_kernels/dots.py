"""Float dots in XLA under the process matmul precision, with vector-shaped ones kept at float32 accuracy on a GPU.

`jax_default_matmul_precision` may name an explicit XLA dot algorithm (`generate --matmul-precision
BF16_BF16_F32_X9`: float32 accuracy from several bf16 tensor-core passes). XLA's GPU compiler splits such a dot into
bf16 pieces and then rewrites a dot one of whose operands is a vector (no free element beyond one: the one-row
products of a batch-1 AR step, the batched mat-vecs and the weighted combines of the routed experts' XLA forms) into
multiply + reduce, with each product of bf16 pieces rounded to bf16: such a dot then carries bf16 products, not the
algorithm's float32 accuracy, and runs nine (X9) elementwise passes where one would do. Seen in the optimized HLO of
the shipped pair's decode loops compiled for an H200 (jax 0.11.2; `benchmarks/h200_hlo.py`,
benchmarks/results/h200_hlo_s21*.md): before this module the batch-1 AR loop under X9 held 873 bf16 multiplies (the
DFlash and DDTree loops 504), none after. Under HIGHEST the same rewrite multiplies in float32 (exact products,
float32 sums): so a vector-shaped dot runs at HIGHEST under an explicit algorithm, every other dot follows the process
default as before. A dot of 16-bit float operands runs at DEFAULT under an explicit algorithm (one bf16 pass,
float32 accumulation: what the algorithm would compute from them, in one pass instead of nine).

  y = einsum("td,tkid->tki", x, w)        # jnp.einsum, that precision chosen
  y = matmul(x, w)                         # x [..., K] @ w [K, N]
  precision = dot_precision(free_a, free_b, precision)   # for a dot written by hand
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# The explicit XLA dot algorithms (lax.DotAlgorithmPreset names, e.g. BF16_BF16_F32_X9) a process may set as its
# jax_default_matmul_precision (kdtree_jax.precision, `generate --matmul-precision`).
DOT_ALGORITHMS = frozenset(p.name for p in lax.DotAlgorithmPreset if p.name != "DEFAULT")


def explicit_algorithm() -> bool:
    """Whether the process default matmul precision (read at trace time) is an explicit XLA dot algorithm."""
    default = jax.config.jax_default_matmul_precision
    return default is not None and str(default).upper() in DOT_ALGORITHMS


def dot_precision(free_a: int, free_b: int, precision=None, dtypes: tuple = ()):
    """The precision of a dot whose operands have `free_a` / `free_b` free elements (the product of the sizes of
    the dimensions that are neither contracted nor batch) and dtypes `dtypes`, under an explicit dot algorithm:
    DEFAULT where every operand is a 16-bit float (the algorithms buy float32 accuracy for float32 operands; on
    bf16 ones JAX would convert them to float32 and run all the algorithm's passes for the one that is not zero:
    a drafter computing in bf16 beside a float32 target), else HIGHEST where one of them is a vector (1; the module
    docstring says why). Otherwise, or with a named `precision`, `precision` (None: the process default)."""
    if precision is None and explicit_algorithm():
        if dtypes and all(jnp.issubdtype(d, jnp.floating) and jnp.dtype(d).itemsize == 2 for d in dtypes):
            return lax.Precision.DEFAULT
        if min(free_a, free_b) == 1:
            return lax.Precision.HIGHEST
    return precision


def _free_sizes(spec: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, int]:
    """(free elements of a, of b) of a two-operand einsum spec without ellipsis."""
    inputs = spec.replace(" ", "").split("->")[0]
    la, lb = inputs.split(",")
    if "." in la + lb or len(la) != len(a_shape) or len(lb) != len(b_shape):
        raise ValueError(f"einsum spec {spec!r} does not fit operand ranks {len(a_shape)} and {len(b_shape)} "
                         f"(two operands, no ellipsis)")
    free_a = math.prod(n for label, n in zip(la, a_shape, strict=True) if label not in lb)
    free_b = math.prod(n for label, n in zip(lb, b_shape, strict=True) if label not in la)
    return free_a, free_b


def einsum(spec: str, a: jax.Array, b: jax.Array, *, precision=None, preferred_element_type=None) -> jax.Array:
    """jnp.einsum(spec, a, b) at `dot_precision` (two operands, no ellipsis)."""
    free_a, free_b = _free_sizes(spec, a.shape, b.shape)
    return jnp.einsum(spec, a, b, precision=dot_precision(free_a, free_b, precision, (a.dtype, b.dtype)),
                      preferred_element_type=preferred_element_type)


def matmul(x: jax.Array, w: jax.Array, *, precision=None, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] at `dot_precision`."""
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"matmul wants x [..., K] and w [K, N], got {list(x.shape)} and {list(w.shape)}")
    precision = dot_precision(math.prod(x.shape[:-1]), w.shape[1], precision, (x.dtype, w.dtype))
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type)
