"""Small traceable building blocks shared by the target model and the drafter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.config import ModelConfig, YarnScaling
from kdtree_jax.linear import linear as dense_or_int4
from pallas_kernels import dots


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """1 / sqrt(mean(x^2) + eps) per row, float32 [..., 1]: RMSNorm's row scale. x [..., D]."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_scales_of_parts(x: jax.Array, widths: tuple[int, ...], eps: float) -> tuple[jax.Array, ...]:
    """rms_scale of each of x's leading parts x[..., :w0], x[..., w0:w0 + w1], ...: the same numbers up to float32
    summation order, as one reduction of x's row (each part's squares masked over the same span, sibling reductions
    XLA computes in one launch; separate slices are a launch each). x [..., D] with D >= sum(widths) -> ([..., 1]
    float32, ...)."""
    span = sum(widths)
    x32 = x[..., :span].astype(jnp.float32)
    col = jnp.arange(span)
    bounds = np.cumsum((0, *widths))
    return tuple(jax.lax.rsqrt(jnp.sum(jnp.where((col >= lo) & (col < hi), x32 * x32, 0.0), axis=-1, keepdims=True)
                               / (hi - lo) + eps) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, scale: jax.Array | None = None) -> jax.Array:
    """y = weight * x / sqrt(mean(x^2) + eps); statistics in float32, result in x.dtype. x [..., D]. scale: the row
    scale (`rms_scale(x, eps)`), if already computed."""
    scale = rms_scale(x, eps) if scale is None else scale
    return (x.astype(jnp.float32) * scale * weight.astype(jnp.float32)).astype(x.dtype)


def rms_norm_matmul(x: jax.Array, weight: jax.Array, eps: float, w: jax.Array, out_dtype=None) -> jax.Array:
    """rms_norm(x, weight, eps) @ w for a dense w [D, N], result in `out_dtype` (default x.dtype), with the norm's
    row scale applied to the product's float32 result instead of to x (a row scale commutes with the product):
    (x * weight) @ w is one GEMM that reads x * weight as its operand, and the scale rides on the product's output.
    At one row XLA otherwise runs the norm as two launches before the GEMM (the sum of squares, then the scaled
    row); so it runs one. The operand is x * weight rounded to x.dtype instead of the normed row: one rounding of
    the operand as before, at another point (so results differ from rms_norm's at that rounding's level). In
    float16 x * weight can overflow where the normed row does not (the model keeps float16 on rms_norm)."""
    xw = (x.astype(jnp.float32) * weight.astype(jnp.float32)).astype(x.dtype)
    y = dots.matmul(xw, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * rms_scale(x, eps)).astype(out_dtype or x.dtype)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, linear=dense_or_int4) -> jax.Array:
    """(silu(x @ gate) * (x @ up)) @ down for [in, out] weights; `linear(x, w)` (kdtree_jax.linear.linear: dense or
    INT4 with the default kernel choice; a model passes its own)."""
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)


def swiglu_joined(gate_up: jax.Array, down: jax.Array, linear=dense_or_int4) -> jax.Array:
    """swiglu's second half from x @ [gate | up] (gate_up [..., 2F], the two products side by side):
    (silu(gate) * up) @ down."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, down)


def rope_inv_freq(theta: float, dim: int) -> np.ndarray:
    """Plain RoPE frequencies theta^(-2i/dim), i < dim/2 (float64, static)."""
    return theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def yarn_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [r/2] float64, attention_factor) for the target's rope slice (YaRN when configured)."""
    return rope_frequencies(cfg.rope_theta, cfg.qk_rope_head_dim, cfg.rope_scaling)


def rope_frequencies(theta: float, dim: int, rs: YarnScaling | None) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float64, attention_factor): plain RoPE, or YaRN (HF `_compute_yarn_parameters`
    with truncate=True) when `rs` is given. Shared by the target and the drafter."""
    extra = rope_inv_freq(theta, dim)
    if rs is None:
        return extra, 1.0
    inter = extra / rs.factor

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inter * ramp + extra * (1.0 - ramp), rs.attention_factor


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               attention_factor: float = 1.0) -> jax.Array:
    """Rotate interleaved pairs (2i, 2i+1) of x [..., T, (heads,) r] by positions [..., T] * inv_freq[i].

    `x` is [B, T, r] or [B, T, H, r]; positions [B, T] int. Angles are computed in float32.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, r/2]
    if x.ndim == positions.ndim + 2:  # per-head input: broadcast over the head axis
        angles = angles[..., None, :]
    cos = jnp.cos(angles) * attention_factor
    sin = jnp.sin(angles) * attention_factor
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
