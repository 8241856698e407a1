"""Plain-jnp implementations of the routed MoE over INT4 experts (Int4Weight or MosaicInt4Weight stacks).

`grouped_moe_w4a16_reference` dequantizes every expert and runs one einsum per (token, choice): the test
oracle for small shapes. `moe_w4a16_xla` loops over the touched experts only: the op's "xla"
implementation (what runs without a GPU), term for term a per-expert W4A16 reference matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from pallas_kernels.w4a16.reference import dequantize_words


def dequantize_stack(w: Int4Weight | MosaicInt4Weight) -> jax.Array:
    """A stacked INT4 weight [E, ...] -> float32 W [E, N, K]."""
    if isinstance(w, Int4Weight):
        return dequantize_words(w.qweight, w.scale)
    return w.dequantize(jnp.float32)


def grouped_moe_w4a16_reference(x, experts, expert_ids, weights):
    """Plain jnp in float32: dequantize every expert, then einsum per (token, choice) -> [T, D] x.dtype.

    x [T, D]; experts {"gate","up","down"} stacked INT4 weights; expert_ids/weights [T, k].
    Materializes [E, N, K] float32: never use at K2 width."""
    hp = lax.Precision.HIGHEST
    gate, up, down = (dequantize_stack(experts[n]) for n in ("gate", "up", "down"))  # [E,I,D],[E,I,D],[E,D,I]
    xf = x.astype(jnp.float32)
    g = jnp.einsum("td,tkid->tki", xf, gate[expert_ids], precision=hp)  # [T, k, I]
    u = jnp.einsum("td,tkid->tki", xf, up[expert_ids], precision=hp)
    y = jnp.einsum("tki,tkdi->tkd", jax.nn.silu(g) * u, down[expert_ids], precision=hp)  # [T, k, D]
    return jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32), precision=hp).astype(x.dtype)


def _matmul(x: jax.Array, w_dense: jax.Array) -> jax.Array:
    """x [M, K] @ W^T (W float32 [N, K]) at HIGHEST precision -> [M, N] in x.dtype."""
    y = lax.dot_general(x.astype(jnp.float32), w_dense, (((1,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _expert_swiglu(x, experts, e):
    """SwiGLU of expert e (traced index) on x [M, D] -> [M, D] in x.dtype (each matmul rounded to x.dtype)."""
    dense = {n: dequantize_stack(jax.tree.map(lambda a: a[e][None], experts[n]))[0] for n in ("gate", "up", "down")}
    h = jax.nn.silu(_matmul(x, dense["gate"])) * _matmul(x, dense["up"])  # [M, I] x.dtype
    return _matmul(h, dense["down"])  # [M, D]


def moe_w4a16_xla(x, experts, expert_ids, weights, *, out_dtype=None):
    """XLA: loop over the distinct touched experts (ascending), each on all T tokens with its combine
    column (zero for tokens that did not choose it). Reads touched experts only; T-fold compute.
    Zero-weight choices (other shards' experts) touch nothing. -> [T, D] in out_dtype (default x.dtype)."""
    num_tokens, top_k = expert_ids.shape
    num_experts = experts["gate"].lead_shape[0]
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], expert_ids].add(weights.astype(jnp.float32))  # [T, E]
    flat = jnp.where(weights != 0, expert_ids, num_experts).reshape(-1)
    size = min(num_experts, num_tokens * top_k)
    touched = jnp.unique(flat, size=size, fill_value=num_experts)  # [U] ascending, E = unused slot

    def step(out, e):
        def run(out):
            y = _expert_swiglu(x, experts, e)  # [T, D]
            return out + combine[:, e, None] * y.astype(jnp.float32)
        return lax.cond(e < num_experts, run, lambda o: o, out), None

    out, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), touched)
    return out.astype(out_dtype or x.dtype)
