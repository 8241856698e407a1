"""Tree-masked absorbed MLA attention in plain jnp: the definition the kernel is tested against
(`tree_mla_attention_reference`, float32 at HIGHEST precision) and the op's "xla" implementation
(`tree_mla_attention_xla`: the definition for float32 inputs; for bf16/f16 inputs the form production feeds
XLA, einsums in the input dtype with float32 accumulation and a float32 softmax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _masked_attention(q, cache, start, tree_mask, *, scale: float, value_dim: int, compute_dtype, precision,
                      zero_garbage: bool = True):
    """Both implementations: einsums in `compute_dtype` at `precision` with float32 accumulation, a float32
    softmax over a [B, T, S_max] mask (which the kernel never builds), probabilities cast to `compute_dtype`
    for the value einsum; the result in q.dtype. zero_garbage: read the cache with its rows past start + T zeroed
    (NaN / Inf there cannot reach the result); False reads it as it is (those rows must hold finite values)."""
    B, T, H, D = q.shape
    S_max = cache.shape[1]
    offset = jnp.arange(S_max)[None, :] - start[:, None]  # [B, S_max]: row index minus start
    in_tree = (offset >= 0) & (offset < T)  # [B, S_max]
    tree_visible = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(offset, 0, T - 1)[:, None, :], (B, T, S_max)), axis=2)
    visible = (offset < 0)[:, None, :] | (in_tree[:, None, :] & tree_visible)  # [B, T, S_max]
    dot = dict(precision=precision, preferred_element_type=jnp.float32)
    cache = cache.astype(compute_dtype)
    if zero_garbage:
        # Garbage rows (past start + T) may hold NaN/Inf, and 0 * NaN would poison the value sum: both einsums read
        # one copy of the cache with those rows zeroed (their scores become -inf below whatever they are), which XLA
        # makes in one cache-sized fusion (deviceless H100 compile, S = 4096, T = 1).
        cache = jnp.where((offset < T)[:, :, None], cache, jnp.zeros((), compute_dtype))
    scores = jnp.einsum("bthd,bsd->bths", q.astype(compute_dtype), cache, **dot) * scale
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)  # [B, T, H, S_max]
    probs = jax.nn.softmax(scores, axis=-1).astype(compute_dtype)
    # the value einsum over the whole row width, the output sliced (c of c + r): a slice of the cache operand would be
    # a cache-sized copy, as XLA's GEMM fuses neither it nor a select (deviceless H100 compile, S = 4096, T = 1)
    out = jnp.einsum("bths,bsc->bthc", probs, cache, **dot)[..., :value_dim]
    return out.astype(q.dtype)


def tree_mla_attention_reference(q, cache, start, tree_mask, *, scale: float, value_dim: int):
    """Plain-jnp definition. q [B, T, H, c+r]; cache [B, S_max, c+r]; start [B] int32;
    tree_mask [B, T, T] bool -> [B, T, H, c] in q.dtype. Computed in float32 at HIGHEST precision
    (also the XLA path of `impl="xla"` for float32 inputs)."""
    return _masked_attention(q, cache, start, tree_mask, scale=scale, value_dim=value_dim,
                             compute_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def tree_mla_attention_xla(q, cache, start, tree_mask, *, scale: float, value_dim: int):
    """The op's "xla" implementation, same arguments and result as the reference. float32 inputs: the
    reference itself (the greedy invariant is checked in float32 at full precision). bf16/f16: the einsums in
    the input dtype with float32 accumulation, float32 softmax, probabilities cast back to the input dtype for
    the value einsum (what the kernel does too), so a half-precision model does not upcast its whole latent
    cache to float32 on every call.

    bf16 reads the cache as it is, without a zeroed copy (a cache-sized fusion: 4.1 us of XLA attention's 18.6 in
    one layer at S = 4096 on an H100, session 32's timeline), so its garbage rows must hold finite values: the
    engine's cache does (zeros at first, then only rows the model wrote; bf16 has float32's range, which a row of
    normed latents and RoPE keys does not overflow). float16, whose range a residual stream can overflow, and
    float32 zero them first: NaN there cannot reach the result."""
    if q.dtype == jnp.float32:
        return tree_mla_attention_reference(q, cache, start, tree_mask, scale=scale, value_dim=value_dim)
    return _masked_attention(q, cache, start, tree_mask, scale=scale, value_dim=value_dim,
                             compute_dtype=q.dtype, precision=None, zero_garbage=q.dtype != jnp.bfloat16)
