"""XLA comparators the benchmarks time beside the kernels; the engine never runs them.

Every comparator dequantizes INT4 to the activations' dtype (bf16 in the benchmarks: what XLA would be
fed in production) and accumulates in float32:
  w4a16_matmul_xla:  x [M, K] @ W^T with W [N, K] dequantized by XLA, then one dot (XLA does not fuse the
                     dequantization into the GEMM: this is the "int4 through XLA" column);
  moe_touched_loop:  the routed MoE as a loop over the distinct experts the tokens chose, each run on all T
                     tokens with its combine weights (reads touched experts only; T-fold compute);
  moe_dense_all:     every expert on every token (reads all E experts);
  moe_gather:        one (token, choice) assignment at a time: gather its expert, run it on its one token
                     (reads an expert once per assignment, T * k reads).
INT4 weights: `Int4Weight`, the checkpoint layout (int16 words [..., N, K/4], four nibbles q + 8 each, low nibble first;
scales [..., N, K/group]); `_arrays` is the one place that reads a weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int4 import Int4Weight


def _arrays(leaf: Int4Weight) -> tuple[jax.Array, jax.Array]:
    """(int16 words [..., N, K/4], scales [..., N, K/group]) of an INT4 weight in the checkpoint layout."""
    if not isinstance(leaf, Int4Weight):
        raise ValueError(f"the XLA baselines take an Int4Weight (checkpoint layout), got {type(leaf).__name__}")
    return leaf.qweight, leaf.scale


def dequantize(qweight: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """INT4 words [..., N, K/4] and scales [..., N, K/group] -> W [..., N, K] in dtype."""
    *lead, n, words = qweight.shape
    k = 4 * words
    groups = scale.shape[-1]
    if k % groups:
        raise ValueError(f"dequantize: K={k} is not a multiple of the {groups} scale groups per row")
    nibbles = (qweight.astype(jnp.int32)[..., None] >> (4 * jnp.arange(4, dtype=jnp.int32))) & 0xF  # [.., N, K/4, 4]
    q = (nibbles - 8).astype(dtype).reshape(*lead, n, groups, k // groups)
    return (q * scale.astype(dtype)[..., None]).reshape(*lead, n, k)


def w4a16_matmul_xla(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] @ dequantize(W [N, K])^T -> [M, N] in x.dtype (float32 accumulation)."""
    w = dequantize(qweight, scale, x.dtype)  # [N, K]
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)


def _expert(x: jax.Array, experts: dict, e: jax.Array) -> jax.Array:
    """SwiGLU of expert e (a traced index) on x [M, D] -> [M, D] float32."""
    def project(inp, name):  # inp [M, K] through expert e's [N, K] weight -> [M, N] in x.dtype
        qweight, scale = _arrays(experts[name])
        return w4a16_matmul_xla(inp, qweight[e], scale[e])

    hidden = jax.nn.silu(project(x, "gate")) * project(x, "up")  # [M, I]
    return project(hidden, "down").astype(jnp.float32)


def _combine(num_tokens: int, num_experts: int, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
    """[T, E] float32: token t's weight for expert e (0 where t did not choose e)."""
    rows = jnp.arange(num_tokens)[:, None]
    return jnp.zeros((num_tokens, num_experts), jnp.float32).at[rows, expert_ids].add(weights.astype(jnp.float32))


def _num_experts(experts: dict) -> int:
    return _arrays(experts["gate"])[0].shape[0]


def moe_touched_loop(x: jax.Array, experts: dict, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
    """x [T, D], expert_ids/weights [T, k] -> [T, D] x.dtype: a loop over the distinct chosen experts."""
    num_tokens, top_k = expert_ids.shape
    num_experts = _num_experts(experts)
    combine = _combine(num_tokens, num_experts, expert_ids, weights)
    # Distinct experts ascending, padded with E (no expert): at most min(E, T * k) of them.
    touched = jnp.unique(expert_ids.reshape(-1), size=min(num_experts, num_tokens * top_k), fill_value=num_experts)

    def step(acc, e):
        add = lambda a: a + combine[:, e, None] * _expert(x, experts, e)  # noqa: E731
        return lax.cond(e < num_experts, add, lambda a: a, acc), None

    out, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), touched)
    return out.astype(x.dtype)


def moe_dense_all(x: jax.Array, experts: dict, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Every expert on every token, weighted by the combine matrix -> [T, D] x.dtype."""
    num_experts = _num_experts(experts)
    combine = _combine(x.shape[0], num_experts, expert_ids, weights)

    def step(acc, e):
        return acc + combine[:, e, None] * _expert(x, experts, e), None

    out, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), jnp.arange(num_experts))
    return out.astype(x.dtype)


def moe_gather(x: jax.Array, experts: dict, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
    """One assignment at a time: its expert on its token -> [T, D] x.dtype."""
    num_tokens, top_k = expert_ids.shape
    token = jnp.repeat(jnp.arange(num_tokens), top_k)  # [T * k]

    def step(acc, a):
        t, e, w = a
        y = _expert(lax.dynamic_slice_in_dim(x, t, 1), experts, e)  # [1, D]
        return acc.at[t].add(w * y[0]), None

    assignments = (token, expert_ids.reshape(-1), weights.reshape(-1).astype(jnp.float32))
    out, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), assignments)
    return out.astype(x.dtype)


MOE_BASELINES = {"xla_touched": moe_touched_loop, "xla_dense": moe_dense_all, "xla_gather": moe_gather}
