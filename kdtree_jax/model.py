"""The target model: DeepSeek-V3 / Kimi K2.x (MLA + DeepSeekMoE) as a Flax linen module applied as a
pure function over a nested-dict params tree (layout: docs/params.md; every weight declared in
kdtree_jax/weights.py).

Two attention forms share one set of weights:
- naive MLA (`forward`, no cache): per-head keys/values are decompressed from the latent; used by the
  plain causal forward and as the independent check of the absorbed form;
- absorbed MLA (`forward_with_cache`): the query is folded into latent space and attends to the latent
  cache of `kv_lora_rank + qk_rope_head_dim` values per token (MQA with one 576-wide key per token),
  the form every decode, prefill-into-cache and tree-verification step uses. Its projections run either
  separate (the checkpoint's matrices: x @ [q_a | kv_a] as one product, q_b, then W_UK per head; W_UV per head, then
  o; `fold_params` lays W_UK and W_UV out by head for a large model) or folded
  (`fold_params`, which `generate` applies for a small model: W_UK pre-multiplied into q_b, W_UV into o, q_a and
  kv_a concatenated, so a layer's projections are three matmuls; same function, other rounding). The fold also
  concatenates each MLP's entry matrices (a MoE layer's router | shared gate | shared up, a dense layer's gate | up)
  into one, and on a GPU keeps a transposed copy ([N, K]) of the matrices x multiplies directly for the one-row
  products of the AR step (XLA then runs x @ W as one kernel instead of a product and a reduction; docs/kernels.md
  has the measurement).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, cast, overload

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer  # still public in jax 0.11 (not deprecated); jax has no other concreteness test
from jax.sharding import PartitionSpec as P

from kdtree_jax import attention, sharding
from kdtree_jax.config import ModelConfig
from kdtree_jax.layers import (
    apply_rope,
    rms_norm,
    rms_norm_matmul,
    rms_scales_of_parts,
    swiglu,
    swiglu_joined,
    yarn_inv_freq,
)
from kdtree_jax.linear import linear as _linear
from kdtree_jax.weights import declare
from pallas_kernels import dispatch, dots
from pallas_kernels.dispatch import Kernels, as_kernels
from pallas_kernels.int4 import is_quantized
from pallas_kernels.moe_w4a16 import grouped_moe_w4a16

Params = dict[str, Any]


class KVCache(NamedTuple):
    """The latent KV cache of every layer, preallocated to a static `max_len`."""

    latent: jax.Array  # [L, B, max_len, kv_lora_rank + qk_rope_head_dim]: c_kv (normed) ; k_pe (roped)
    lengths: jax.Array  # [B] int32: committed rows per batch row

    @property
    def max_len(self) -> int:
        return self.latent.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    latent = jnp.zeros((cfg.num_hidden_layers, batch, max_len, cfg.latent_dim), dtype)
    return KVCache(latent=latent, lengths=jnp.zeros((batch,), jnp.int32))


def write_rows(latent: jax.Array, rows: jax.Array, start: jax.Array, layer: int | None = None) -> jax.Array:
    """latent [B, S, C] (or the whole cache [L, B, S, C] and a `layer`: that layer's rows) with rows [B, T, C]
    written at slots start[b] + t. The rows must fit: start[b] + T <= S, as `decoding.cache_length` sizes every cache
    the engine writes. At batch 1 (a prefill, a decode step, a verify, the compaction) this is a
    dynamic_update_slice, one in-place launch where XLA runs a batch-1 scatter as three (a bounds check, a read of
    the rows it would overwrite, the write; docs/k26_verify_cost.md); it would clamp a start past S - T and so
    overwrite committed rows. Several batch rows are a scatter that drops the rows past S."""
    batch, steps = rows.shape[:2]
    rows = rows.astype(latent.dtype)
    if batch == 1:
        corner = (0, start[0], 0)
        if layer is not None:
            rows, corner = rows[None], (layer, *corner)
        return jax.lax.dynamic_update_slice(latent, rows, corner)
    slots = start[:, None] + jnp.arange(steps, dtype=start.dtype)[None, :]  # [B, T]
    batch_index = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, steps))
    index = (batch_index, slots) if layer is None else (layer, batch_index, slots)
    return latent.at[index].set(rows, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Matrix:
    """A dense matrix W [K, N] the fold made: `w` as is and, where `dispatch.fold_transposed` says (a GPU), also
    `w_t` = W^T [N, K] for one-row products. `matrix(x)` is x @ W either way: with one row (batch 1, one token: the
    AR step) from w_t, which XLA runs as one kernel where a [K, N] W becomes a product + a row reduction; with more
    rows from w (at 8 rows the [N, K] GEMMs measured slower). docs/kernels.md has both measurements."""

    w: Any
    w_t: Any = None

    @classmethod
    def of(cls, w: jax.Array, transposed: bool) -> Matrix:
        return cls(w, w.T if transposed else None)

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., K] -> [..., N], in out_dtype (the products' float32 sums rounded once to it; default x.dtype)."""
        if self.w_t is not None and math.prod(x.shape[:-1]) == 1:
            return jax.lax.dot_general(x, self.w_t.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                                       precision=dots.dot_precision(1, self.w_t.shape[0]),
                                       preferred_element_type=out_dtype)
        return dots.matmul(x, self.w.astype(x.dtype), preferred_element_type=out_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FoldedMLA:
    """One layer's MLA projections folded for the absorbed (cached) form (`fold_params`), in the params dtype:
    proj_a [D, A]: x's one projection, [q_a | kv_a] (A = q_lora + c + r), or [q folded | kv_a] without a q_lora
      (A = H (c + r) + c + r);
    q_b [q_lora, H (c + r)] or None: per head, W_qb_nope @ W_UK^T (the latent query) then W_qb_rope;
    o [H c, D]: per head, W_UV @ W_o (the output straight from the latent attention output)."""

    proj_a: Matrix
    q_b: Any
    o: Matrix


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerHeadMLA:
    """The separate MLA's latent maps laid out by head for the absorbed form (`fold_params`, where it does not fold),
    each with the dim its product contracts innermost: uk [H, c, n] = W_UK transposed (the latent query:
    q_latent[h] = uk[h] @ q_nope[h]), uv [H, v, c] = W_UV transposed (out[h] = uv[h] @ out_latent[h]). kv_b
    [c, H * (n + v)] holds both with c outermost, so a head's product reads a strided column slice; at one token XLA
    runs each product as a reduction (K2.6 on an H100: 7.6 and 6.3 us a layer over kv_b, for 8.4 MB each), at T = 9
    a batched GEMM over strided rows. By head, a K2.6 layer's rest at T = 9 took 155 -> 144 us (session 31, then
    [H, n, c] / [H, c, v]); with the contracted dim innermost the one-token reductions read contiguous rows: 9.9 ->
    6.9 and 5.2 -> 4.3 us (H100, docs/k26_verify_cost.md). Same values: kv_b's bytes again while a decode runs."""

    uk: jax.Array
    uv: jax.Array


def mla_choice(cfg: ModelConfig, params: Params, kernels: Kernels | None = None,
               sharded: bool = False) -> dispatch.Choice:
    """Whether `fold_params` folds this model's MLA projections (pallas_kernels.dispatch.choose_mla)."""
    kernels = as_kernels(kernels)
    extra = dispatch.mla_fold_extra_bytes(
        hidden=cfg.hidden_size, q_lora_rank=cfg.q_lora_rank, num_heads=cfg.num_attention_heads,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        kv_lora_rank=cfg.kv_lora_rank, itemsize=jnp.dtype(params["embed_tokens"].dtype).itemsize)
    return dispatch.choose_mla(extra_bytes=extra, impl=kernels.mla, sharded=sharded)


def _fold_layer(cfg: ModelConfig, attn: dict, transposed: bool) -> FoldedMLA:
    """FoldedMLA from one layer's attention weights (products in float32 at HIGHEST precision)."""
    heads, nope, rope, vdim, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                  cfg.v_head_dim, cfg.kv_lora_rank)
    dtype = attn["kv_a"].dtype
    hp, f32 = jax.lax.Precision.HIGHEST, jnp.float32
    kv_b = attn["kv_b"].astype(f32).reshape(c, heads, nope + vdim)
    w_uk, w_uv = kv_b[..., :nope], kv_b[..., nope:]  # [c, H, n], [c, H, v]
    q_w = attn["q" if cfg.q_lora_rank is None else "q_b"].astype(f32)
    q_w = q_w.reshape(q_w.shape[0], heads, nope + rope)  # [q_in, H, n+r]
    q_latent = jnp.einsum("ihn,chn->ihc", q_w[..., :nope], w_uk, precision=hp)  # [q_in, H, c]
    query = jnp.concatenate([q_latent, q_w[..., nope:]], axis=-1).reshape(q_w.shape[0], heads * (c + rope))
    w_o = attn["o"].astype(f32).reshape(heads, vdim, cfg.hidden_size)
    out = jnp.einsum("chv,hvd->hcd", w_uv, w_o, precision=hp).reshape(heads * c, cfg.hidden_size)
    out = Matrix.of(out.astype(dtype), transposed)
    if cfg.q_lora_rank is None:
        return FoldedMLA(Matrix.of(jnp.concatenate([query.astype(dtype), attn["kv_a"]], axis=1), transposed), None, out)
    return FoldedMLA(Matrix.of(jnp.concatenate([attn["q_a"], attn["kv_a"]], axis=1), transposed), query.astype(dtype),
                     out)


def _concatenable(mats) -> bool:
    """Whether matrices x multiplies ([K, N_i] each) can be one matrix [K, sum N_i]: none is INT4 and they share a
    dtype (a float32 router beside bf16 weights stays apart: concatenating would round it; a router that
    prepare_params keeps in bf16, holding bf16 values, joins them, its logits still summed in float32)."""
    return not any(is_quantized(m) for m in mats) and len({m.dtype for m in mats}) == 1


def _mlp_entry(block: dict, names: tuple[tuple[str, ...], ...], transposed: bool) -> Matrix | None:
    """The named dense matrices of one MLP block ([D, N_i] each) as one Matrix [D, sum N_i], or None where they are
    not `_concatenable`."""
    mats: list[Any] = [functools.reduce(lambda d, k: d[k], path, block) for path in names]
    if not _concatenable(mats):
        return None
    return Matrix.of(jnp.concatenate(mats, axis=1), transposed)


def fold_params(params: Params, cfg: ModelConfig, kernels: Kernels | None = None, sharded: bool = False) -> Params:
    """params with each layer's attention also holding its FoldedMLA (attn/"folded"), which the cached forward
    then runs, and each MLP its concatenated entry (moe/"entry" = [router | shared gate | shared up], mlp/"entry" =
    [gate | up], where `_mlp_entry` can), when `mla_choice` folds (else see below); the matrices x multiplies
    also get a transposed copy for one-row products where `dispatch.fold_transposed` says (`Matrix`). Traceable:
    `generate` calls it inside its jit, once per call, before the decode loop. The naive (cache-free) forward keeps
    using the separate MLA matrices. Where the projections stay separate (a large model) on one device, each layer's
    W_UK and W_UV are laid out by head instead (attn/"per_head", `PerHeadMLA`: kv_b's bytes once more); over a mesh
    params are unchanged (there the MLA's matrices stay as the checkpoint's, x @ q_a and x @ kv_a apart too)."""
    if mla_choice(cfg, params, kernels, sharded).impl != "folded":
        return params if sharded else _per_head_params(params, cfg)
    transposed = dispatch.fold_transposed()
    out = dict(params)
    for layer in range(cfg.num_hidden_layers):
        name = f"layers_{layer}"
        layer_params = dict(params[name])
        layer_params["attn"] = {**layer_params["attn"], "folded": _fold_layer(cfg, layer_params["attn"], transposed)}
        if "moe" in layer_params and cfg.n_shared_experts:
            entry = _mlp_entry(layer_params["moe"], (("router",), ("shared", "gate"), ("shared", "up")), transposed)
            if entry is not None:
                layer_params["moe"] = {**layer_params["moe"], "entry": entry}
        elif "mlp" in layer_params:
            entry = _mlp_entry(layer_params["mlp"], (("gate",), ("up",)), transposed)
            if entry is not None:
                layer_params["mlp"] = {**layer_params["mlp"], "entry": entry}
        out[name] = layer_params
    return out


def _joinable(*mats) -> bool:
    """Whether the separate MLA's matrices x multiplies run as one product x @ [W_1 | W_2 | ...]: `_concatenable`, on
    one device. XLA fuses the concatenation into the product's operand read; without it, at one row it runs kv_a's
    narrow x @ W (N = 576 at K2.6) as a product and a separate reduction. A device mesh keeps them apart (their output
    dims are sharded differently)."""
    return _concatenable(mats) and sharding.active_mesh() is None


def _row_scale_after(h: jax.Array) -> bool:
    """Whether a norm of h [..., D] applies its row scale after the product it feeds (layers.rms_norm_matmul): for
    one row (batch 1, one token: the AR step), where XLA runs an RMSNorm as two launches before the GEMM (at 9 rows
    it fuses the norm into one, and the scale after the GEMM would add one); not in float16, where the unnormed
    h * w (a residual stream of thousands) could overflow what the normed row would not."""
    return math.prod(h.shape[:-1]) == 1 and h.dtype != jnp.float16


def _per_head_params(params: Params, cfg: ModelConfig) -> Params:
    """params with each layer's attention also holding its W_UK and W_UV laid out by head (`PerHeadMLA`)."""
    heads, nope, vdim, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = dict(params)
    for layer in range(cfg.num_hidden_layers):
        name = f"layers_{layer}"
        attn = params[name]["attn"]
        kv_b = attn["kv_b"].reshape(c, heads, nope + vdim)
        per_head = PerHeadMLA(uk=jnp.transpose(kv_b[..., :nope], (1, 0, 2)),  # [H, c, n]
                              uv=jnp.transpose(kv_b[..., nope:], (1, 2, 0)))  # [H, v, c]
        out[name] = {**params[name], "attn": {**attn, "per_head": per_head}}
    return out


# ------------------------------------------------------------------------------------------ modules
def _weight(mod: nn.Module, name: str):
    """A weight leaf: at init created as declared (kdtree_jax.weights: shape, dtype, initializer); at apply
    whatever the tree holds (a dense array or a typed INT4 weight), so a quantized tree runs through the
    same module. `mod` carries `cfg` and `param_dtype`."""
    scope = mod.scope
    assert scope is not None  # called from a module method inside init/apply: the module is bound
    if mod.is_initializing():
        path = (*scope.path, name)
        spec = declare(mod.cfg).get(path)
        if spec is None:
            raise KeyError(f"the model uses {'/'.join(path)}, which kdtree_jax/weights.py does not declare")
        return mod.param(name, spec.initializer(), spec.shape, spec.dtype(mod.param_dtype))
    value = mod.get_variable("params", name)
    if value is None:
        raise KeyError(f"params are missing {'/'.join(scope.path)}/{name}")
    return value


class MLA(nn.Module):
    cfg: ModelConfig
    param_dtype: Any
    kernels: Kernels = Kernels()
    layer: int | None = None  # which layer of a whole [L, B, S, c+r] cache is this one's

    @nn.compact
    def __call__(self, h, norm, positions, latent_cache=None, start=None, visibility=None):
        """h [B, T, D] the residual stream and `norm` [D] its RMSNorm weight (x = rms_norm(h, norm) is the attention's
        input; where x's first product is one dense GEMM, the norm's row scale is applied after it:
        layers.rms_norm_matmul); positions [B, T]. Without a cache: naive causal attention over x itself.
        With latent_cache [B, S, c+r] (or the whole cache [L, B, S, c+r]: then this module's `layer` of it) and
        start [B]: writes the T new rows at start+t, attends with `visibility` [B, T, T] among the new tokens,
        returns (out [B, T, D], new latent_cache). The whole cache is written in place (`write_rows`: T rows into
        the loop-carried buffer); per-layer caches stacked again after the layers would make XLA build a new
        whole cache every forward (a concatenate and a copy, 4-6x the cache's bytes: tests/test_model.py)."""
        cfg = self.cfg
        linear = functools.partial(_linear, kernels=self.kernels)
        heads, nope, rope, vdim, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                      cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        batch, steps, _ = h.shape
        inv_freq, attention_factor = yarn_inv_freq(cfg)
        x = rms_norm(h, norm, cfg.rms_norm_eps)  # (unused where the scale goes after the product: XLA drops it)
        if latent_cache is not None and self.has_variable("params", "folded"):
            folded = cast(FoldedMLA, self.get_variable("params", "folded"))
            return self._folded(folded, x, positions, latent_cache, start, visibility)

        # (the weights are fetched in the order init created them: flax draws their random values in that order)
        scales = (None, None)  # the latent norms' row scales (c_q's, c_kv's) where computed together
        if cfg.q_lora_rank is None:
            q, kv_a = linear(x, _weight(self, "q")), linear(x, _weight(self, "kv_a"))
        else:
            q_a, q_a_norm, q_b, kv_a_w = (_weight(self, name) for name in ("q_a", "q_a_norm", "q_b", "kv_a"))
            if _joinable(q_a, kv_a_w):  # x's two projections in one product (K2.6's AR step: docs/k26_verify_cost.md)
                w_a = jnp.concatenate([q_a, kv_a_w], axis=1)
                if _row_scale_after(h):  # and both latent norms' row scales from one reduction of the product's row
                    a = rms_norm_matmul(h, norm, cfg.rms_norm_eps, w_a)
                    scales = rms_scales_of_parts(a, (cfg.q_lora_rank, c), cfg.latent_norm_eps)
                else:
                    a = dots.matmul(x, w_a.astype(x.dtype))
                c_q, kv_a = a[..., :cfg.q_lora_rank], a[..., cfg.q_lora_rank:]
            else:
                c_q, kv_a = linear(x, q_a), linear(x, kv_a_w)
            # (q_a's norm stays before q_b: with its row scale after the product XLA dropped q_b's split-K for the
            # scaled float32 output, 15.1 -> 18.6 us a layer at K2.6, H100, benchmarks/results/k26_timeline_h100_s32_*)
            q = linear(rms_norm(c_q, q_a_norm, cfg.latent_norm_eps, scale=scales[0]), q_b)
        q = q.reshape(batch, steps, heads, nope + rope)
        q_nope = q[..., :nope]  # [B, T, H, n]
        q_pe = apply_rope(q[..., nope:], positions, inv_freq, attention_factor)  # [B, T, H, r]

        c_kv, k_pe = self._latent(kv_a, positions, scales[1])
        kv_b = _weight(self, "kv_b").reshape(c, heads, nope + vdim)
        w_uk, w_uv = kv_b[..., :nope], kv_b[..., nope:]  # [c, H, n], [c, H, v]
        w_o = _weight(self, "o")

        if latent_cache is None:  # naive form: decompress per-head keys and values
            k_nope = dots.einsum("btc,chn->bthn", c_kv, w_uk.astype(c_kv.dtype))
            values = dots.einsum("btc,chv->bthv", c_kv, w_uv.astype(c_kv.dtype))
            keys = jnp.concatenate(
                [k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (batch, steps, heads, rope))], axis=-1)
            query = jnp.concatenate([q_nope, q_pe], axis=-1)
            scores = dots.einsum("bthd,bshd->bhts", query, keys,
                                 preferred_element_type=jnp.float32) * cfg.softmax_scale
            causal = jnp.tril(jnp.ones((steps, steps), bool))
            if visibility is not None:
                causal = visibility[:, None]
            scores = jnp.where(causal, scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
            out = dots.einsum("bhts,bshv->bthv", probs, values)
            return linear(out.reshape(batch, steps, heads * vdim), w_o), None

        # absorbed form over the latent cache
        assert start is not None  # Transformer passes start [B] whenever it passes a latent cache
        per_head = cast(PerHeadMLA, self.get_variable("params", "per_head")) \
            if self.has_variable("params", "per_head") else None
        if per_head is None:
            q_latent = dots.einsum("bthn,chn->bthc", q_nope, w_uk.astype(q_nope.dtype))  # [B, T, H, c]
        else:
            q_latent = dots.einsum("bthn,hcn->bthc", q_nope, per_head.uk.astype(q_nope.dtype))
        query = jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)  # [B, T, H, c+r]
        out_latent, latent_cache = self._write_and_attend(  # rows [B, T, c+r]; out [B, T, H, c]
            query, jnp.concatenate([c_kv, k_pe], axis=-1), latent_cache, start, visibility)
        if per_head is None:
            out = dots.einsum("bthc,chv->bthv", out_latent.astype(h.dtype), w_uv.astype(h.dtype))
        else:
            out = dots.einsum("bthc,hvc->bthv", out_latent.astype(h.dtype), per_head.uv.astype(h.dtype))
        return linear(out.reshape(batch, steps, heads * vdim), w_o), latent_cache

    def _latent(self, kv_a, positions, scale=None):
        """kv_a [B, T, c+r] (x's kv_a projection) -> (c_kv [B, T, c] normed, k_pe [B, T, r] roped): a token's latent
        cache row, in both absorbed forms and the naive one. scale: the norm's row scale, if already computed."""
        cfg = self.cfg
        c = cfg.kv_lora_rank
        c_kv = rms_norm(kv_a[..., :c], _weight(self, "kv_a_norm"), cfg.latent_norm_eps, scale=scale)
        return c_kv, apply_rope(kv_a[..., c:], positions, *yarn_inv_freq(cfg))

    def _write_and_attend(self, query, rows, latent_cache, start, visibility):
        """The T new latent rows [B, T, c+r] written into the cache ([B, S, c+r], or this layer's of the whole
        [L, B, S, c+r]), then the absorbed attention of query over this layer's cache: (out [B, T, H, c], cache)."""
        layer = None
        if latent_cache.ndim == 4:
            if self.layer is None:
                raise ValueError("a whole [L, B, S, C] latent cache needs the MLA's layer")
            layer = self.layer
        latent_cache = write_rows(latent_cache, rows, start, layer)
        layer_cache = latent_cache if layer is None else latent_cache[layer]
        return self._attend(query, layer_cache, start, visibility), latent_cache

    def _attend(self, query, latent_cache, start, visibility):
        """The absorbed attention over the latent cache: query [B, T, H, c+r] -> [B, T, H, c] (both forms)."""
        cfg = self.cfg
        steps = query.shape[1]
        if visibility is None:
            visibility = jnp.broadcast_to(jnp.tril(jnp.ones((steps, steps), bool)), (query.shape[0], steps, steps))
        attend = functools.partial(attention.mla_attention, scale=cfg.softmax_scale, value_dim=cfg.kv_lora_rank,
                                   kernels=self.kernels)
        mesh = sharding.active_mesh()
        if mesh is not None:  # heads split over "tensor": each shard runs the kernel on its own heads
            by_head = sharding.spec(None, None, "heads", None)
            attend = jax.shard_map(attend, mesh=mesh, in_specs=(by_head, P(), P(), P()), out_specs=by_head,
                                   check_vma=False)
        return attend(query.astype(latent_cache.dtype), latent_cache, start, visibility)

    def _folded(self, folded: FoldedMLA, x, positions, latent_cache, start, visibility):
        """The absorbed form on folded projections (FoldedMLA): x [B, T, D] -> (out [B, T, D], latent_cache)."""
        assert start is not None  # Transformer passes start [B] whenever it passes a latent cache
        cfg = self.cfg
        heads, rope, c = cfg.num_attention_heads, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        batch, steps, _ = x.shape
        inv_freq, attention_factor = yarn_inv_freq(cfg)
        a = folded.proj_a(x)  # [B, T, A]
        if cfg.q_lora_rank is None:
            q, kv_a = a[..., :-(c + rope)], a[..., -(c + rope):]
        else:
            c_q = rms_norm(a[..., :cfg.q_lora_rank], _weight(self, "q_a_norm"), cfg.latent_norm_eps)
            q, kv_a = dots.matmul(c_q, folded.q_b.astype(x.dtype)), a[..., cfg.q_lora_rank:]
        q = q.reshape(batch, steps, heads, c + rope)  # [B, T, H, c+r]: latent query, then its RoPE part
        query = jnp.concatenate([q[..., :c], apply_rope(q[..., c:], positions, inv_freq, attention_factor)], axis=-1)
        out_latent, latent_cache = self._write_and_attend(  # [B, T, H, c]
            query, jnp.concatenate(self._latent(kv_a, positions), axis=-1), latent_cache, start, visibility)
        out = folded.o(out_latent.astype(x.dtype).reshape(batch, steps, heads * c))
        return out, latent_cache


class DenseMLP(nn.Module):
    """The SwiGLU MLP of a dense layer ("mlp") or the shared expert ("shared"); shapes as declared."""

    cfg: ModelConfig
    param_dtype: Any
    kernels: Kernels = Kernels()

    @overload
    def __call__(self, x: None = None) -> dict[str, Any]: ...
    @overload
    def __call__(self, x: jax.Array) -> jax.Array: ...

    @nn.compact
    def __call__(self, x=None):
        """x [..., D] -> [..., D]; without x, the weights {"gate", "up", "down"} (for a shard_map)."""
        mlp = {"gate": _weight(self, "gate"), "up": _weight(self, "up"), "down": _weight(self, "down")}
        if x is None:
            return mlp
        linear = functools.partial(_linear, kernels=self.kernels)
        if self.has_variable("params", "entry"):  # fold_params: [gate | up], one matmul
            return swiglu_joined(cast(Matrix, self.get_variable("params", "entry"))(x), mlp["down"], linear)
        return swiglu(x, mlp["gate"], mlp["up"], mlp["down"], linear=linear)


def route(cfg: ModelConfig, x: jax.Array, router: jax.Array, router_bias: jax.Array):
    """Sigmoid no-aux-loss routing. x [N, D] -> (expert ids [N, k] int32, combine weights [N, k] f32).

    The bias only chooses experts; weights are the unbiased scores of the chosen ones, normalised
    (norm_topk_prob) and multiplied by routed_scaling_factor. Group-limited: groups are scored by
    the sum of their top-2 biased scores, only the best topk_group groups may be chosen."""
    return route_logits(cfg, dots.matmul(x.astype(jnp.float32), router.astype(jnp.float32)), router_bias)


def route_logits(cfg: ModelConfig, logits: jax.Array, router_bias: jax.Array):
    """`route` from the router's logits [N, E] (x @ router, float32)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))  # [N, E]
    choice = scores + router_bias.astype(jnp.float32)
    num_tokens, experts = choice.shape
    if cfg.n_group > 1:
        grouped = choice.reshape(num_tokens, cfg.n_group, experts // cfg.n_group)
        group_scores = small_top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = small_top_k(group_scores, cfg.topk_group)
        keep_mask = jnp.zeros((num_tokens, cfg.n_group), bool).at[
            jnp.arange(num_tokens)[:, None], keep].set(True)
        choice = jnp.where(keep_mask[:, :, None], grouped, -jnp.inf).reshape(num_tokens, experts)
    _, idx = small_top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), weights * cfg.routed_scaling_factor


SMALL_TOP_K_MAX_COMPARES = 1 << 24  # rows x n x n up to which small_top_k compares all pairs (K2.6: 113 rows)


def small_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, k) over the last axis (n entries): (values [..., k], indices [..., k] int32), the same choice and
    order (descending, ties to the lower index; floats in lax.top_k's total order: NaN above +inf, -0 below +0). For
    the router's few rows (a decode step, a verify) it ranks every entry by comparing all pairs (rank_i = #{j: x_j >
    x_i, or x_j == x_i and j < i}) and picks the entries of ranks 0..k-1: two small fusions where XLA's GPU top_k
    sorts every row (K2.6's 384 experts: a 5.5 us sort a layer on an H100, docs/k26_verify_cost.md). More rows than
    SMALL_TOP_K_MAX_COMPARES / n^2 (a prefill) keep lax.top_k."""
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"small_top_k: k={k} must be in [1, {n}]")
    if math.prod(x.shape[:-1]) * n * n > SMALL_TOP_K_MAX_COMPARES:
        values, idx = jax.lax.top_k(x, k)
        return values, idx.astype(jnp.int32)
    key = x
    if jnp.issubdtype(x.dtype, jnp.floating):  # as float32 bits turned into an int that orders as the total order
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    order = jnp.arange(n)
    ki, kj = key[..., :, None], key[..., None, :]  # [..., n (i), n (j)]
    ahead = (kj > ki) | ((kj == ki) & (order[None, :] < order[:, None]))
    rank = ahead.sum(-1, dtype=jnp.int32)  # [..., n]: a permutation of 0..n-1
    idx = jnp.argmax(rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None], axis=-1).astype(jnp.int32)
    return jnp.take_along_axis(x, idx, axis=-1), idx


class MoE(nn.Module):
    cfg: ModelConfig
    param_dtype: Any
    kernels: Kernels = Kernels()

    @nn.compact
    def __call__(self, h, norm):
        """h [..., D] the residual stream, `norm` [D] its RMSNorm weight: the block's input is rms_norm(h, norm)."""
        cfg, dt = self.cfg, self.param_dtype
        d = cfg.hidden_size
        router = _weight(self, "router")
        router_bias = _weight(self, "router_bias")
        experts = ExpertWeights(cfg, dt, name="experts")()
        lead = h.shape[:-1]
        flat = rms_norm(h, norm, cfg.rms_norm_eps).reshape(-1, d)  # [N, D]
        shared = DenseMLP(cfg, dt, self.kernels, name="shared")() if cfg.n_shared_experts else None

        def joined(y):
            """The block from y = x @ [router | shared gate | shared up], float32 [N, E + 2 I]: the router's logits
            unrounded (a bf16 router joins bf16 weights once prepare_params keeps it bf16; bf16 products are exact in
            float32), the shared expert's rounded to x's dtype."""
            assert shared is not None  # only a model with a shared expert joins it
            idx, weights = route_logits(cfg, y[:, :cfg.n_routed_experts], router_bias)
            out = routed_experts(flat, experts, idx, weights, self.kernels)
            out = out + swiglu_joined(y[:, cfg.n_routed_experts:].astype(flat.dtype), shared["down"],
                                      functools.partial(_linear, kernels=self.kernels))
            return out.reshape(*lead, d)

        if self.has_variable("params", "entry"):  # fold_params: [router | shared gate | shared up], one matmul
            return joined(cast(Matrix, self.get_variable("params", "entry"))(flat, jnp.float32))
        if shared is not None and router.dtype == flat.dtype and _joinable(router, shared["gate"], shared["up"]):
            # the same product unfolded (a router in x's dtype: prepare_params keeps a K2.x checkpoint's so). With the
            # norm's row scale after it (layers.rms_norm_matmul, as the MLA's input norm) the operand is x * w rounded
            # to x's dtype instead of the normed row, so near-ties may route differently from a multi-row call
            w = jnp.concatenate([router, shared["gate"], shared["up"]], axis=1)
            return joined(rms_norm_matmul(h.reshape(-1, d), norm, cfg.rms_norm_eps, w, jnp.float32)
                          if _row_scale_after(h) else dots.matmul(flat, w, preferred_element_type=jnp.float32))
        idx, weights = route(cfg, flat, router, router_bias)
        mesh = sharding.active_mesh()
        if mesh is not None:
            return moe_sharded(mesh, flat, idx, weights, experts, shared or {}, self.kernels).reshape(*lead, d)
        out = routed_experts(flat, experts, idx, weights, self.kernels)
        if shared is not None:
            out = out + swiglu(flat, shared["gate"], shared["up"], shared["down"],
                               linear=functools.partial(_linear, kernels=self.kernels))
        return out.reshape(*lead, d)


class ExpertWeights(nn.Module):
    """The stacked routed experts {"gate", "up", "down"} (their own sub-dict "experts")."""

    cfg: ModelConfig
    param_dtype: Any

    @nn.compact
    def __call__(self):
        return {"gate": _weight(self, "gate"), "up": _weight(self, "up"), "down": _weight(self, "down")}


def routed_experts(x: jax.Array, experts: dict, idx: jax.Array, weights: jax.Array,
                   kernels: Kernels = Kernels()) -> jax.Array:
    """sum_k weights[n, k] * SwiGLU_{idx[n, k]}(x[n]). x [N, D], idx/weights [N, k] -> [N, D].

    Dense experts: small token counts gather only the chosen experts' weights (decode reads k
    experts, not E); larger ones run every expert on every token with a dense combine matrix.
    INT4 experts: the grouped W4A16 MoE (pallas_kernels.moe_w4a16) reads only the touched experts; the
    kernel follows from their type (Int4Weight: Triton, MosaicInt4Weight: Mosaic GPU) and `kernels.moe`."""
    return _routed_experts_f32(x, experts, idx, weights, kernels).astype(x.dtype)


def _routed_experts_f32(x: jax.Array, experts: dict, idx: jax.Array, weights: jax.Array,
                        kernels: Kernels = Kernels()) -> jax.Array:
    """routed_experts before the final cast: float32 [N, D] (a shard's partial sum stays float32)."""
    if is_quantized(experts["gate"]):  # zero-weight choices (other shards' experts) are skipped
        return grouped_moe_w4a16(x, experts, idx.astype(jnp.int32), weights, impl=kernels.moe,
                                 interpret=kernels.interpret, out_dtype=jnp.float32)
    num_tokens, top_k = idx.shape
    num_experts = experts["gate"].shape[0]
    if num_tokens * top_k < num_experts:
        gate, up, down = (experts[k][idx] for k in ("gate", "up", "down"))  # [N, k, ...]
        hidden = jax.nn.silu(dots.einsum("nd,nkdi->nki", x, gate.astype(x.dtype)))
        hidden = hidden * dots.einsum("nd,nkdi->nki", x, up.astype(x.dtype))
        y = dots.einsum("nki,nkid->nkd", hidden, down.astype(x.dtype))
        return dots.einsum("nkd,nk->nd", y.astype(jnp.float32), weights)
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], idx].add(weights)  # [N, E]
    hidden = jax.nn.silu(dots.einsum("nd,edi->eni", x, experts["gate"].astype(x.dtype)))
    hidden = hidden * dots.einsum("nd,edi->eni", x, experts["up"].astype(x.dtype))
    y = dots.einsum("eni,eid->end", hidden, experts["down"].astype(x.dtype))
    return dots.einsum("end,ne->nd", y.astype(jnp.float32), combine)


def moe_sharded(mesh, x: jax.Array, idx: jax.Array, weights: jax.Array, experts: dict, shared: dict,
                kernels: Kernels = Kernels()) -> jax.Array:
    """The MoE block per shard in `shard_map`: routed experts split over "expert" (and their
    intermediate dim over "tensor"), the shared expert split over "tensor". x [N, D] and the routing
    idx/weights [N, k] come in replicated; every shard runs its local experts on every token (the
    choices of other shards get weight 0) and one psum over all devices sums the float32 partials:
    the all-gather + reduce-scatter exchange, with the gather free because decode tokens are already
    replicated. Returns [N, D] in x.dtype, replicated. shared: {} when the model has none."""
    expert_specs = {k: sharding.leaf_spec(("experts", k), v) for k, v in experts.items()}
    shared_specs = {k: sharding.leaf_spec(("shared", k), v) for k, v in shared.items()}

    def body(x, idx, weights, experts, shared):
        local = jax.tree.leaves(experts["gate"])[0].shape[0]  # experts on this shard
        shard = jax.lax.axis_index(sharding.EXPERT)
        first = shard * local
        mine = (idx >= first) & (idx < first + local)  # [N, k]
        out = _routed_experts_f32(x, experts, jnp.where(mine, idx - first, 0), jnp.where(mine, weights, 0.0),
                                  kernels)
        if shared:  # every expert shard holds the same tensor slice of it: count it once
            y = swiglu(x, shared["gate"], shared["up"], shared["down"],
                       linear=functools.partial(_linear, kernels=kernels)).astype(jnp.float32)
            out = out + jnp.where(shard == 0, y, 0.0)
        return jax.lax.psum(out, sharding.AXES)  # [N, D] float32

    out = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), expert_specs, shared_specs), out_specs=P(),
                        check_vma=False)(x, idx, weights, experts, shared)
    return out.astype(x.dtype)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    param_dtype: Any
    kernels: Kernels = Kernels()

    @nn.compact
    def __call__(self, h, positions, latent_cache=None, start=None, visibility=None):
        cfg, dt = self.cfg, self.param_dtype
        attn_out, latent_cache = MLA(cfg, dt, self.kernels, self.layer, name="attn")(
            h, _weight(self, "input_norm"), positions, latent_cache, start, visibility)
        h = h + attn_out
        norm = _weight(self, "post_attn_norm")
        if cfg.is_moe_layer(self.layer):
            h = h + MoE(cfg, dt, self.kernels, name="moe")(h, norm)
        else:
            h = h + DenseMLP(cfg, dt, self.kernels, name="mlp")(rms_norm(h, norm, cfg.rms_norm_eps))
        return h, latent_cache


class Transformer(nn.Module):
    cfg: ModelConfig
    param_dtype: Any = jnp.float32
    kernels: Kernels = Kernels()  # which kernel each op runs (pallas_kernels.dispatch); static

    @nn.compact
    def __call__(self, tokens, positions, cache_latent=None, start=None, visibility=None,
                 hidden_layers: tuple[int, ...] = ()):
        """tokens/positions [B, T] -> (logits [B, T, V] f32, hidden [B, T, len(hidden_layers), D],
        new cache_latent or None). hidden = the residual stream after each requested layer."""
        cfg, dt = self.cfg, self.param_dtype
        embed = _weight(self, "embed_tokens")
        h = sharding.constrain(jnp.take(embed, tokens, axis=0), None, None, "embed")  # [B, T, D] replicated
        if cache_latent is not None:  # the latent cache stays replicated (shared by all heads)
            cache_latent = sharding.constrain(cache_latent, None, None, None, "latent")
        saved = {}
        for layer in range(cfg.num_hidden_layers):  # each layer writes its rows into the whole cache, in place
            h, cache_latent = DecoderLayer(cfg, layer, dt, self.kernels, name=f"layers_{layer}")(
                h, positions, cache_latent, start, visibility)
            if layer in hidden_layers:
                saved[layer] = h
        h = rms_norm(h, _weight(self, "final_norm"), cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            logits = dots.matmul(h, embed.T.astype(h.dtype))
        else:
            logits = _linear(h, _weight(self, "lm_head"), self.kernels)
        hidden = (jnp.stack([saved[layer] for layer in hidden_layers], axis=2) if hidden_layers
                  else jnp.zeros(h.shape[:2] + (0, cfg.hidden_size), h.dtype))
        latent = None if cache_latent is None else sharding.constrain(cache_latent, None, None, None, "latent")
        return logits.astype(jnp.float32), hidden, latent


# ------------------------------------------------------------------------------------- entry points
def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (fan-in scaled normals, unit norms, zero router bias) as a plain dict."""
    cfg.validate()
    tokens = jnp.zeros((1, 1), jnp.int32)
    variables = jax.jit(Transformer(cfg, dtype).init)(key, tokens, tokens)
    return variables["params"]  # a plain nested dict (flax >= 0.10 returns dicts)


def _param_dtype(params: Params):
    return params["embed_tokens"].dtype


def check_tokens(cfg: ModelConfig, tokens) -> None:
    """Raise ValueError for token ids outside [0, vocab_size) (checked eagerly, outside jit)."""
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= cfg.vocab_size):
        bad = arr[(arr < 0) | (arr >= cfg.vocab_size)].ravel()[0]
        raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {cfg.vocab_size})")


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def _forward(params, cfg, tokens, kernels):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    # flax types apply's result as Any | (out, state); without mutable= it is the module's 3-tuple
    logits, _, _ = cast(tuple[jax.Array, jax.Array, None],
                        Transformer(cfg, _param_dtype(params), kernels).apply({"params": params}, tokens, positions))
    return logits


def forward(params: Params, cfg: ModelConfig, tokens, kernels: Kernels | None = None) -> jax.Array:
    """Plain causal forward (naive MLA, no cache): tokens [B, S] int32 -> logits [B, S, V] float32.
    kernels: which kernel each op runs (default Kernels(): pallas_kernels.dispatch decides)."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [batch, seq], got {tokens.dtype}{list(tokens.shape)}")
    if 0 in tokens.shape:
        raise ValueError(f"tokens must hold at least one sequence of at least one token, got shape "
                         f"{list(tokens.shape)}")
    if tokens.shape[1] > cfg.max_position_embeddings:  # the model (and its YaRN scaling) is defined up to there
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    if not isinstance(tokens, Tracer):
        check_tokens(cfg, tokens)
    return _forward(params, cfg, tokens.astype(jnp.int32), as_kernels(kernels))


def forward_with_cache(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                       cache: KVCache, visibility: jax.Array | None = None,
                       hidden_layers: tuple[int, ...] = (), kernels: Kernels | None = None):
    """One cached forward (traceable; call inside jit). tokens/positions [B, T]; the T new latent rows
    are written at cache slots lengths[b] + t, which must fit the cache: lengths[b] + T <= S (`write_rows`; the
    engine sizes its caches so, `decoding.cache_length`; called with concrete lengths that do not fit, this raises).
    New token t sees every committed row and the new rows u with visibility[b, t, u] (default causal). Returns
    (logits [B, T, V] f32, hidden [B, T, n, D], cache with the rows written; `lengths` unchanged - the caller
    commits). kernels: as in `forward`."""
    if not isinstance(cache.lengths, Tracer):  # (traced lengths, inside jit, are kept in range by the engine's sizing)
        longest = int(np.asarray(cache.lengths).max())  # numpy's max: jnp's would be traced inside a caller's trace
        if longest + tokens.shape[1] > cache.latent.shape[-2]:
            raise ValueError(f"{tokens.shape[1]} new rows at length {longest} do not fit a cache of "
                             f"{cache.latent.shape[-2]} rows")
    out = Transformer(cfg, _param_dtype(params), as_kernels(kernels)).apply(
        {"params": params}, tokens, positions, cache.latent, cache.lengths, visibility,
        hidden_layers=tuple(hidden_layers))
    # flax types apply's result as Any | (out, state); without mutable= it is the module's 3-tuple
    logits, hidden, latent = cast(tuple[jax.Array, jax.Array, jax.Array], out)
    return logits, hidden, cache._replace(latent=latent)
