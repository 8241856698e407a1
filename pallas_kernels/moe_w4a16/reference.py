"""Plain-jnp implementations of the routed MoE over INT4 experts (Int4Weight or MosaicInt4Weight stacks).

`grouped_moe_w4a16_reference` dequantizes every expert and runs one einsum per (token, choice): the test
oracle for small shapes. `moe_w4a16_xla` is the op's "xla" implementation (what runs without a GPU, and on a
GPU where it measured faster than the kernels: pallas_kernels/moe_w4a16/tuned.py), in one of three forms
(`xla_form` picks by platform and size, every matmul a float32 dot rounded to x.dtype, at HIGHEST precision unless
the process default is an explicit XLA dot algorithm: `xla_dot_precision`):
  "gather": the T*k chosen experts' INT4 words gathered and dequantized, batched matmuls (the least compute; on
            the H200 XLA fuses it into 3-5 kernels, the fastest form at every T measured, under HIGHEST and, inside
            the shipped pair's round, under BF16_BF16_F32_X9: docs/kernels.md, session 40);
  "dense":  every expert dequantized, all T tokens through each, a combine matrix (a small expert stack);
  "loop":   a loop over the distinct touched experts, one dequantized at a time (any size, T-fold compute; the
            CPU's form: faster there than "gather").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import dots
from pallas_kernels.w4a16.reference import dequantize_any as dequantize_stack  # [E, ...] -> float32 [E, N, K]


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


def xla_dot_precision() -> lax.Precision | None:
    """The precision of the XLA forms' float32 dots: HIGHEST (so JAX's default, TF32 on NVIDIA GPUs, never lowers
    them), unless the process default (read at trace time) is an explicit dot algorithm: then None, that algorithm,
    as for every other matmul of the model, except for the vector-shaped dots (the gather form's mat-vecs, the
    combines), which `pallas_kernels.dots` keeps at HIGHEST (XLA's GPU compiler would round their products to
    bf16). Under BF16_BF16_F32_X9 the gather form's dots were 22% of the shipped pair's T = 32 verify while they
    stayed HIGHEST (benchmarks/results/round_profile_2026-12-03_s15_X9.md)."""
    return None if dots.explicit_algorithm() else lax.Precision.HIGHEST


def _dot(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """einsum(spec, x, w) in float32 (w float32) at `xla_dot_precision` (`dots.dot_precision` for a vector-shaped
    one), rounded to x.dtype."""
    y = dots.einsum(spec, x.astype(jnp.float32), w, precision=xla_dot_precision(),
                    preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _expert_swiglu(x, experts, e):
    """SwiGLU of expert e (traced index) on x [M, D] -> [M, D] in x.dtype (each matmul rounded to x.dtype)."""
    dense = {n: dequantize_stack(jax.tree.map(lambda a: a[e][None], experts[n]))[0] for n in ("gate", "up", "down")}
    h = jax.nn.silu(_dot(x, dense["gate"], "mk,nk->mn")) * _dot(x, dense["up"], "mk,nk->mn")  # [M, I] x.dtype
    return _dot(h, dense["down"], "mk,nk->mn")  # [M, D]


# The largest float32 intermediate the "gather" and "dense" forms may dequantize ([T*k | E, 3 matrices]): the
# shipped pair's 33-token verify at batch 8 gathers 467 MB, its whole routed stack is 14 MB, and K2.6's 8 experts
# of one token 1.4 GB (there the loop form runs).
XLA_DEQUANT_BYTES = 512 << 20
XLA_FORMS = ("auto", "gather", "dense", "loop")
_FORM_OVERRIDE = ["auto"]  # set_xla_form: the form every "auto" call runs ("auto": xla_form_for's rule)


def set_xla_form(form: str) -> None:
    """Make every `moe_w4a16_xla(form="auto")` call traced from now on run `form` ("auto": the rule of
    `xla_form_for` again; a function jit traced before keeps its form): what benchmarks/profile_round.py
    --moe-xla-form times the forms inside the engine with."""
    if form not in XLA_FORMS:
        raise ValueError(f"form must be one of {XLA_FORMS}, got {form!r}")
    _FORM_OVERRIDE[0] = form


def xla_form(num_tokens: int, top_k: int, experts: dict, platform: str | None = None) -> str:
    """Which form `moe_w4a16_xla` runs for T tokens of top-k choices over these experts (`xla_form_for`, or the
    form `set_xla_form` set) on `platform` (default: JAX's default backend)."""
    if _FORM_OVERRIDE[0] != "auto":
        return _FORM_OVERRIDE[0]
    gate = experts["gate"]
    return xla_form_for(num_tokens, top_k, gate.lead_shape[0], gate.in_features, gate.out_features,
                        platform or jax.default_backend())


def xla_form_for(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                 platform: str = "gpu") -> str:
    """The form for T tokens of top-k choices over E experts hidden -> inter -> hidden. On a CPU "loop" (measured:
    the shipped pair's CPU generate runs AR at 92-100 tokens/s with it, 66 with "gather"). Elsewhere "gather" when
    the T*k gathered experts fit XLA_DEQUANT_BYTES (the least compute, one formula for every T: a token's output
    does not depend on how many others share the call), else "dense" when every expert fits, else "loop"."""
    if platform == "cpu":
        return "loop"
    one = 4 * 3 * hidden * inter  # float32 bytes of one expert's gate, up and down
    if num_tokens * top_k * one <= XLA_DEQUANT_BYTES:
        return "gather"
    return "dense" if num_experts * one <= XLA_DEQUANT_BYTES else "loop"


def _moe_gather(x, experts, expert_ids, weights):
    """T*k (token, choice) pairs, each with its expert's weights gathered and dequantized -> float32 [T, D]."""
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    gate, up, down = (dequantize_stack(jax.tree.map(lambda a: a[flat], experts[n])).reshape(
        num_tokens, top_k, experts[n].out_features, experts[n].in_features)
        for n in ("gate", "up", "down"))  # [T, k, N, K] float32
    h = jax.nn.silu(_dot(x, gate, "td,tkid->tki")) * _dot(x, up, "td,tkid->tki")  # [T, k, I]
    y = _dot(h, down, "tki,tkdi->tkd").astype(jnp.float32)  # [T, k, D]
    return dots.einsum("tkd,tk->td", y, weights.astype(jnp.float32), precision=xla_dot_precision())


def _moe_dense(x, experts, combine):
    """Every expert on every token, weighted by combine [T, E] (zero where a token did not choose it)."""
    gate, up, down = (dequantize_stack(experts[n]) for n in ("gate", "up", "down"))  # [E,I,D],[E,I,D],[E,D,I]
    h = jax.nn.silu(_dot(x, gate, "td,eid->eti")) * _dot(x, up, "td,eid->eti")  # [E, T, I]
    y = _dot(h, down, "eti,edi->etd").astype(jnp.float32)  # [E, T, D]
    return dots.einsum("etd,te->td", y, combine, precision=xla_dot_precision())


def moe_w4a16_xla(x, experts, expert_ids, weights, *, out_dtype=None, form: str = "auto"):
    """XLA, in the form `xla_form` picks (or `form`: "gather" | "dense" | "loop", see the module docstring).
    "loop" runs the distinct touched experts (ascending), each on all T tokens with its combine column (zero
    for tokens that did not choose it): it reads touched experts only, T-fold compute. Zero-weight choices
    (other shards' experts) add nothing in every form ("gather" and "dense" multiply them by zero: exact for finite
    activations; "loop" skips them). -> [T, D] in out_dtype (default x.dtype)."""
    if form not in XLA_FORMS:
        raise ValueError(f"form must be one of {XLA_FORMS}, got {form!r}")
    num_tokens, top_k = expert_ids.shape
    form = xla_form(num_tokens, top_k, experts) if form == "auto" else form
    if form == "gather":
        return _moe_gather(x, experts, expert_ids, weights).astype(out_dtype or x.dtype)
    num_experts = experts["gate"].lead_shape[0]
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], expert_ids].add(weights.astype(jnp.float32))  # [T, E]
    if form == "dense":
        return _moe_dense(x, experts, combine).astype(out_dtype or x.dtype)
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
