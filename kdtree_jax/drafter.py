"""The DFlash-style block-diffusion drafter (arXiv 2602.06036) used by DDTree (docs/ddtree.md, the draft stage).

One forward pass drafts `block_size - 1` future tokens at once. The block holds the target's embeddings of
[bonus token, mask, mask, ...]; its queries attend to the drafter's keys/values of
[context features of every committed token ; the block itself], with no mask inside the block. Context
features are the target's residual stream after the layers `target_layer_ids`, concatenated, projected by
`fc` and RMS-normed; every drafter layer projects the SAME features with its own k/v weights. Those
context keys/values depend only on the context, so they live in a `DrafterCache` (extended once per
committed token); the block's own keys/values are recomputed every round and never cached.

Everything is plain functions over a plain nested params dict (the tree Orbax saves; see docs/drafter.md);
`Drafter` is a thin Flax linen wrapper whose `params` collection is exactly that dict.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer  # still public in jax 0.11 (not deprecated); jax has no other concreteness test

from kdtree_jax.config import ConfigError, ModelConfig, YarnScaling
from kdtree_jax.layers import apply_rope, rms_norm, rope_frequencies, swiglu, swiglu_joined
from kdtree_jax.linear import linear as _linear  # the drafter's weights are dense
from pallas_kernels import dots

# DFlash drafters use blocks of 10-16. DDTree's tree build and accept walk unroll one step per drafted
# position, so compile time grows about quadratically with the block (tiny model on a CPU: 16 -> 7 s,
# 64 -> 23 s, 128 -> 70 s, 256 -> 200 s); 2000 compiled for many minutes.
MAX_BLOCK_SIZE = 64


# ------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Drafter hyper-parameters (Qwen3-style layers, as in DFlash). Hashable: a static jit argument.

    `target_layer_ids` are 0-based target decoder layers whose OUTPUT residual stream is read (HF
    `hidden_states[i + 1]`). `target_layer_ids` and `mask_token_id` have no usable default: set them, or
    build the config with `DrafterConfig.for_target`.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = ()
    mask_token_id: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None  # YaRN (imported DFlash drafters may carry it); None = plain RoPE

    @property
    def num_target_layers(self) -> int:
        """How many target hidden states are concatenated into one context feature."""
        return len(self.target_layer_ids)

    @property
    def num_draft_tokens(self) -> int:
        """L = block_size - 1: positions drafted per round (the bonus token is known)."""
        return self.block_size - 1

    def validate(self) -> DrafterConfig:
        """Raise ConfigError naming the first bad value; return self so calls can chain."""

        def positive_int(name: str, value: Any) -> None:
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"DrafterConfig.{name} must be a positive integer, got {value!r}")

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "block_size"):
            positive_int(name, getattr(self, name))
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"DrafterConfig.block_size must be in [2, {MAX_BLOCK_SIZE}] (the bonus token plus "
                              f"at least one drafted position; larger blocks take minutes to compile), "
                              f"got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"DrafterConfig.num_attention_heads={self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads={self.num_key_value_heads} (GQA groups)")
        if self.head_dim % 2:
            raise ConfigError(f"DrafterConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        ids = self.target_layer_ids
        if not isinstance(ids, tuple) or not ids:
            raise ConfigError(f"DrafterConfig.target_layer_ids must be a non-empty tuple of target layer "
                              f"indices, got {ids!r} (DrafterConfig.for_target picks them)")
        for i in ids:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0:
                raise ConfigError(f"DrafterConfig.target_layer_ids entries must be integers >= 0, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"DrafterConfig.target_layer_ids has duplicates: {ids!r}")
        m = self.mask_token_id
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 0:
            raise ConfigError(f"DrafterConfig.mask_token_id must be a token id >= 0, got {m!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"DrafterConfig.{name} must be a positive number, got {value!r}")
        rs = self.rope_scaling
        if rs is not None:
            if not isinstance(rs, YarnScaling):
                raise ConfigError(f"DrafterConfig.rope_scaling must be a YarnScaling or None, got {rs!r}")
            if not rs.factor >= 1.0 or rs.original_max_position_embeddings <= 0:
                raise ConfigError(f"DrafterConfig.rope_scaling needs factor >= 1 and a positive "
                                  f"original_max_position_embeddings, got {rs!r}")
        return self

    def check_target(self, cfg: ModelConfig) -> DrafterConfig:
        """Raise ConfigError if this drafter cannot run on target `cfg`; return self."""
        self.validate()
        if self.hidden_size != cfg.hidden_size:
            raise ConfigError(f"drafter hidden_size={self.hidden_size} != target hidden_size={cfg.hidden_size} "
                              "(the drafter shares the target's embedding and lm_head)")
        bad = [i for i in self.target_layer_ids if i >= cfg.num_hidden_layers]
        if bad:
            raise ConfigError(f"drafter target_layer_ids {bad} do not exist in a target with "
                              f"num_hidden_layers={cfg.num_hidden_layers}")
        assert self.mask_token_id is not None  # validate() above rejects None
        if self.mask_token_id >= cfg.vocab_size:
            raise ConfigError(f"drafter mask_token_id={self.mask_token_id} is outside the target vocabulary "
                              f"[0, {cfg.vocab_size})")
        if cfg.mask_token_id is not None and cfg.mask_token_id != self.mask_token_id:
            raise ConfigError(f"drafter mask_token_id={self.mask_token_id} differs from the target config's "
                              f"mask_token_id={cfg.mask_token_id}")
        return self

    @classmethod
    def for_target(cls, cfg: ModelConfig, *, num_layers: int = 1, block_size: int = 16,
                   target_layer_ids: tuple[int, ...] | None = None, num_target_layers: int | None = None,
                   num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                   head_dim: int | None = None, intermediate_size: int | None = None,
                   mask_token_id: int | None = None, rms_norm_eps: float | None = None,
                   rope_theta: float | None = None) -> DrafterConfig:
        """A drafter for target `cfg`: hidden size, mask id, eps and rope theta from the target.

        Defaults: `num_target_layers` = `num_layers` target layers spread over the target as DFlash
        does (`default_target_layer_ids`); heads = the target's; head_dim = the target's v_head_dim;
        KV heads = the largest divisor of the heads <= heads / 8; intermediate size = the target's dense one.
        """
        heads = cfg.num_attention_heads if num_attention_heads is None else num_attention_heads
        if num_key_value_heads is None:  # the default is derived from the heads, so they must be valid first
            if not isinstance(heads, (int, np.integer)) or isinstance(heads, bool) or heads <= 0:
                raise ConfigError(f"DrafterConfig.num_attention_heads must be a positive integer, got {heads!r}")
            num_key_value_heads = max(d for d in range(1, max(1, heads // 8) + 1) if heads % d == 0)
        if mask_token_id is None:
            if cfg.mask_token_id is None:
                raise ConfigError("the target config has no mask_token_id; pass mask_token_id= explicitly")
            mask_token_id = cfg.mask_token_id
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(
                cfg.num_hidden_layers, num_layers if num_target_layers is None else num_target_layers)
        out = cls(
            hidden_size=cfg.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=cfg.v_head_dim if head_dim is None else head_dim,
            intermediate_size=cfg.intermediate_size if intermediate_size is None else intermediate_size,
            block_size=block_size,
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            mask_token_id=int(mask_token_id),
            rms_norm_eps=cfg.rms_norm_eps if rms_norm_eps is None else rms_norm_eps,
            rope_theta=cfg.rope_theta if rope_theta is None else rope_theta,
        )
        return out.check_target(cfg)

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DrafterConfig:
        """Inverse of to_dict (our own serialisation, stored next to drafter checkpoints)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a DrafterConfig dict, got {type(data).__name__}")
        data = dict(data)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown DrafterConfig fields: {sorted(unknown)}")
        if "target_layer_ids" in data:
            if not isinstance(data["target_layer_ids"], (list, tuple)):
                raise ConfigError(f"DrafterConfig.target_layer_ids must be a list, got "
                                  f"{data['target_layer_ids']!r}")
            data["target_layer_ids"] = tuple(data["target_layer_ids"])
        if isinstance(data.get("rope_scaling"), Mapping):
            try:
                data["rope_scaling"] = YarnScaling(**data["rope_scaling"])
            except TypeError as e:
                raise ConfigError(f"bad DrafterConfig.rope_scaling fields: {e}") from None
        try:
            return cls(**data).validate()
        except TypeError as e:
            raise ConfigError(f"bad DrafterConfig fields: {e}") from None


def default_target_layer_ids(num_target_hidden_layers: int, count: int) -> tuple[int, ...]:
    """DFlash's choice of target layers: one layer -> the middle one; otherwise `count` layers evenly
    spaced over [1, L - 3] (skipping the first and the last few). Shallow targets where that range is too
    short for distinct layers use [0, L - 1] instead."""
    if not isinstance(count, int) or count <= 0:
        raise ConfigError(f"the number of target layers to read must be a positive integer, got {count!r}")
    if count > num_target_hidden_layers:
        raise ConfigError(f"cannot read {count} distinct target layers from a target with "
                          f"{num_target_hidden_layers} layers")
    if count == 1:
        return (num_target_hidden_layers // 2,)
    start, end = 1, num_target_hidden_layers - 3
    if end - start < count - 1:
        start, end = 0, num_target_hidden_layers - 1
    return tuple(int(round(start + i * (end - start) / (count - 1))) for i in range(count))


# ------------------------------------------------------------------------------------------ params
def _init_linear(key: jax.Array, fan_in: int, fan_out: int, dtype) -> jax.Array:
    return (jax.random.normal(key, (fan_in, fan_out), jnp.float32) * fan_in**-0.5).astype(dtype)


LINEAR, NORM = "linear", "norm"  # drafter initializers: N(0, 1/fan_in) [in, out] matrices; norms of ones


def declare_drafter(dcfg: DrafterConfig) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """Every drafter weight, declared once: {path: (shape, LINEAR | NORM)}; linear maps are [in, out].

    The order is the init's: each top-level entry gets one key of the split, and an entry holding several
    linear maps splits its key once more, one key per linear map in this order (norms take none)."""
    D, hd, F = dcfg.hidden_size, dcfg.head_dim, dcfg.intermediate_size
    H, KVH = dcfg.num_attention_heads, dcfg.num_key_value_heads
    out: dict[tuple[str, ...], tuple[tuple[int, ...], str]] = {
        ("fc",): ((dcfg.num_target_layers * D, D), LINEAR), ("hidden_norm",): ((D,), NORM)}
    for i in range(dcfg.num_hidden_layers):
        layer = f"layers_{i}"
        out.update({
            (layer, "input_norm"): ((D,), NORM),
            (layer, "attn", "q"): ((D, H * hd), LINEAR), (layer, "attn", "k"): ((D, KVH * hd), LINEAR),
            (layer, "attn", "v"): ((D, KVH * hd), LINEAR), (layer, "attn", "o"): ((H * hd, D), LINEAR),
            (layer, "attn", "q_norm"): ((hd,), NORM), (layer, "attn", "k_norm"): ((hd,), NORM),
            (layer, "post_attn_norm"): ((D,), NORM),
            (layer, "mlp", "gate"): ((D, F), LINEAR), (layer, "mlp", "up"): ((D, F), LINEAR),
            (layer, "mlp", "down"): ((F, D), LINEAR),
        })
    out[("final_norm",)] = ((D,), NORM)
    return out


def _init_component(dcfg: DrafterConfig, name: str, key: jax.Array, dtype) -> Any:
    """The params subtree `name` ("fc", "hidden_norm", "layers_i", "final_norm"), freshly initialised."""
    entries = [(path[1:], shape, init) for path, (shape, init) in declare_drafter(dcfg).items() if path[0] == name]
    if not entries:
        raise ValueError(f"unknown drafter params entry {name!r}")

    def make(shape, init, k):
        if init == LINEAR:
            fan_in, fan_out = shape  # linear maps are declared [in, out]
            return _init_linear(k, fan_in, fan_out, dtype)
        return jnp.ones(shape, dtype)

    if entries[0][0] == ():  # a single weight: it takes the entry's key itself
        (_, shape, init), = entries
        return make(shape, init, key)
    keys = iter(jax.random.split(key, sum(init == LINEAR for _, _, init in entries)))
    tree: dict = {}
    for sub, shape, init in entries:
        node = tree
        for part in sub[:-1]:
            node = node.setdefault(part, {})
        node[sub[-1]] = make(shape, init, next(keys) if init == LINEAR else None)
    return tree


def drafter_param_names(dcfg: DrafterConfig) -> tuple[str, ...]:
    """Top-level keys of the drafter params dict."""
    return tuple(dict.fromkeys(path[0] for path in declare_drafter(dcfg)))


def init_drafter_params(dcfg: DrafterConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random drafter params (weights ~ N(0, 1/fan_in), norms 1) as a plain nested dict; layout in
    docs/drafter.md. Linear weights are [in, out] (y = x @ W)."""
    dcfg.validate()
    return _init_drafter_params(dcfg, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))  # one compile instead of one per random op
def _init_drafter_params(dcfg: DrafterConfig, key: jax.Array, dtype) -> dict:
    names = drafter_param_names(dcfg)
    keys = jax.random.split(key, len(names))
    return {name: _init_component(dcfg, name, k, dtype) for name, k in zip(names, keys, strict=True)}


@functools.lru_cache(maxsize=16)
def _expected_shapes(dcfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """{"layers_0/attn/q": shape, ...} of the params `dcfg` implies."""
    abstract = jax.eval_shape(lambda: _init_drafter_params(dcfg, jax.random.key(0), jnp.dtype(jnp.float32)))
    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def check_drafter_params(dcfg: DrafterConfig, dparams) -> None:
    """Raise ValueError unless `dparams` is the nested dict of floating arrays `dcfg` implies (same
    entries, same shapes): a drafter tree made for another config fails here, not deep inside jit."""
    if not isinstance(dparams, Mapping):
        raise ValueError(f"drafter params must be a nested dict of arrays, got {type(dparams).__name__}")
    expected = _expected_shapes(dcfg)
    found = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
             for path, leaf in jax.tree_util.tree_flatten_with_path(dparams)[0]}
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        raise ValueError(f"drafter params do not match the DrafterConfig (num_hidden_layers="
                         f"{dcfg.num_hidden_layers}): missing {missing[:6]}, unexpected {extra[:6]}")
    for name, shape in expected.items():
        leaf = found[name]
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)):
            raise ValueError(f"drafter param {name!r} must be a floating array, got {type(leaf).__name__} "
                             f"{getattr(leaf, 'dtype', '')}")
        if tuple(leaf.shape) != shape:
            raise ValueError(f"drafter param {name!r} has shape {list(leaf.shape)}, the DrafterConfig needs "
                             f"{list(shape)} (params made for another config?)")


# ------------------------------------------------------------------------------------------- cache
class DrafterCache(NamedTuple):
    """Keys/values of the context features for every drafter layer (part of the decode state).

    Row j of batch row b holds the context token written j-th; rows >= lengths[b] are garbage.
    """

    keys: jax.Array     # [Ld, B, max_len, KVH, hd], k_norm and RoPE applied
    values: jax.Array   # [Ld, B, max_len, KVH, hd]
    lengths: jax.Array  # [B] int32: context tokens cached per row


def init_drafter_cache(dcfg: DrafterConfig, batch: int, max_len: int, dtype=jnp.float32) -> DrafterCache:
    """An empty cache with `max_len` rows per batch row."""
    dcfg.validate()
    for name, value in (("batch", batch), ("max_len", max_len)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"init_drafter_cache: {name} must be a positive integer, got {value!r}")
    shape = (dcfg.num_hidden_layers, batch, max_len, dcfg.num_key_value_heads, dcfg.head_dim)
    return DrafterCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


# ----------------------------------------------------------------------------------------- helpers
def _rope(dcfg: DrafterConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [hd/2], attention_factor): plain RoPE, or YaRN when `rope_scaling` is set."""
    return rope_frequencies(dcfg.rope_theta, dcfg.head_dim, dcfg.rope_scaling)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, Tracer)


def context_features(dparams: dict, dcfg: DrafterConfig, target_hidden: jax.Array) -> jax.Array:
    """target_hidden [B, T, n, D] (n = len(target_layer_ids), in that order) -> features [B, T, D]:
    RMSNorm(concat_n(hidden) @ fc)."""
    B, T, n, D = target_hidden.shape
    flat = target_hidden.reshape(B, T, n * D)  # [B, T, n*D]: layer target_layer_ids[0] first, as DFlash
    return rms_norm(_linear(flat, dparams["fc"]), dparams["hidden_norm"], dcfg.rms_norm_eps)  # [B, T, D]


def fold_drafter_params(dparams: dict, dcfg: DrafterConfig) -> dict:
    """dparams with the matrices a round multiplies by the same input joined, once per `generate` call before the
    decode loop (traceable; XLA otherwise concatenates them again inside the loop, or runs them apart): per layer
    attn/"qkv" = [q | k | v] and mlp/"gate_up" = [gate | up], and "kv_all" = every layer's [k | v] (the context
    update's one matmul). The forward and the context update use them when present; same function."""
    out: dict[str, Any] = {**dparams, "kv_all": _joined_kv(dparams, dcfg.num_hidden_layers)}
    for name in (f"layers_{layer}" for layer in range(dcfg.num_hidden_layers)):
        attn, mlp = dparams[name]["attn"], dparams[name]["mlp"]
        out[name] = {**dparams[name],
                     "attn": {**attn, "qkv": jnp.concatenate([attn["q"], attn["k"], attn["v"]], axis=1)},
                     "mlp": {**mlp, "gate_up": jnp.concatenate([mlp["gate"], mlp["up"]], axis=1)}}
    return out


def _joined_kv(dparams: dict, num_layers: int) -> jax.Array:
    """Every layer's [k | v], layer 0 first: [D, num_layers * 2 * KVH * hd] (the context update's one matmul)."""
    attn = [dparams[f"layers_{layer}"]["attn"] for layer in range(num_layers)]
    return jnp.concatenate([w for p in attn for w in (p["k"], p["v"])], axis=1)


def _project_qkv(p_attn: dict, dcfg: DrafterConfig, x: jax.Array, positions: jax.Array):
    """x [B, T, D] -> (queries [B, T, H, hd] (q_norm, RoPE), keys [B, T, KVH, hd] (k_norm, RoPE), values
    [B, T, KVH, hd]); one matmul on folded params (attn/"qkv"), three otherwise."""
    B, T, _ = x.shape
    H, KVH, hd = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    if "qkv" in p_attn:
        q, k, v = jnp.split(_linear(x, p_attn["qkv"]), [H * hd, (H + KVH) * hd], axis=-1)
    else:
        q, k, v = (_linear(x, p_attn[w]) for w in ("q", "k", "v"))
    rope, eps = _rope(dcfg), dcfg.rms_norm_eps
    q = apply_rope(rms_norm(q.reshape(B, T, H, hd), p_attn["q_norm"], eps), positions, *rope)
    k = apply_rope(rms_norm(k.reshape(B, T, KVH, hd), p_attn["k_norm"], eps), positions, *rope)
    return q, k, v.reshape(B, T, KVH, hd)


# ------------------------------------------------------------------------------------------ extend
def drafter_extend_context(dparams: dict, dcfg: DrafterConfig, cache: DrafterCache, target_hidden: jax.Array,
                           positions: jax.Array, num_valid: jax.Array) -> DrafterCache:
    """Append context tokens to the cache.

    target_hidden [B, T, n, D]: the target's residual stream after layers `target_layer_ids`;
    positions [B, T] int: their positions; num_valid [B] int: how many of the T are real per row.
    All T rows are written at cache rows lengths[b] + t (shape-stable; rows t >= num_valid[b] are garbage
    that later calls overwrite), then lengths += num_valid. Rows that would land at or past max_len are
    dropped: the caller must keep lengths + num_valid <= max_len (checked here when the values are
    concrete; inside jit it cannot be, so size max_len for the whole generation).
    """
    Ld, B, S, KVH, hd = cache.keys.shape
    _check_batch_hidden(dcfg, cache, target_hidden, "drafter_extend_context")
    T = target_hidden.shape[1]
    if positions.shape != (B, T) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"drafter_extend_context: positions must be int [B, T] = [{B}, {T}], "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    num_valid = jnp.asarray(num_valid)
    if num_valid.shape != (B,) or not jnp.issubdtype(num_valid.dtype, jnp.integer):
        raise ValueError(f"drafter_extend_context: num_valid must be int [B] = [{B}], "
                         f"got {num_valid.dtype} {tuple(num_valid.shape)}")
    if _is_concrete(num_valid) and _is_concrete(cache.lengths):
        nv, ln = np.asarray(num_valid), np.asarray(cache.lengths)
        if (nv < 0).any() or (nv > T).any():
            raise ValueError(f"drafter_extend_context: num_valid must be in [0, T={T}], got {nv.tolist()}")
        if (ln + nv > S).any():
            raise ValueError(f"drafter_extend_context: lengths {ln.tolist()} + num_valid {nv.tolist()} "
                             f"exceeds the cache's max_len={S}")

    if T == 0:  # nothing to append (static shape: known at trace time)
        return cache
    features = context_features(dparams, dcfg, target_hidden)  # [B, T, D]
    rows = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    batch_index = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))  # [B, T]
    # Every layer's keys and values from one dot (2 Ld dots apart), k_norm and RoPE per head; the joined matrix
    # comes from fold_drafter_params where `generate` folded, else it is joined here.
    attn = [dparams[f"layers_{layer}"]["attn"] for layer in range(Ld)]
    w_kv = dparams["kv_all"] if "kv_all" in dparams else _joined_kv(dparams, Ld)  # [D, Ld * 2 * KVH * hd]
    kv = _linear(features, w_kv).reshape(B, T, Ld, 2, KVH, hd)
    k_norm = jnp.stack([p["k_norm"] for p in attn])[:, None, :]  # [Ld, 1, hd]
    k = apply_rope(rms_norm(kv[:, :, :, 0], k_norm, dcfg.rms_norm_eps).reshape(B, T, Ld * KVH, hd), positions,
                   *_rope(dcfg)).reshape(B, T, Ld, KVH, hd)
    new_k = jnp.moveaxis(k, 2, 0).astype(cache.keys.dtype)  # [Ld, B, T, KVH, hd]
    new_v = jnp.moveaxis(kv[:, :, :, 1], 2, 0).astype(cache.values.dtype)
    # One scatter per cache for every layer, in place (per-layer scatters then a stack copied the whole
    # cache each round); a scatter, not dynamic_update_slice (which would clamp the start and shift valid
    # rows), whose out-of-range garbage rows are dropped.
    return DrafterCache(cache.keys.at[:, batch_index, rows].set(new_k, mode="drop"),
                        cache.values.at[:, batch_index, rows].set(new_v, mode="drop"),
                        cache.lengths + num_valid.astype(jnp.int32))


def _check_batch_hidden(dcfg: DrafterConfig, cache: DrafterCache, target_hidden: jax.Array | None,
                        where: str) -> None:
    Ld, B, S, KVH, hd = cache.keys.shape
    expected = (dcfg.num_hidden_layers, B, S, dcfg.num_key_value_heads, dcfg.head_dim)
    if (Ld, KVH, hd) != (expected[0], expected[3], expected[4]) or cache.values.shape != cache.keys.shape:
        raise ValueError(f"{where}: cache keys/values {tuple(cache.keys.shape)}/{tuple(cache.values.shape)} "
                         f"do not match [Ld, B, max_len, KVH, hd] = {expected}")
    if cache.lengths.shape != (B,):
        raise ValueError(f"{where}: cache.lengths must be [B] = [{B}], got {tuple(cache.lengths.shape)}")
    if target_hidden is not None:
        want = (B, dcfg.num_target_layers, dcfg.hidden_size)
        th = tuple(target_hidden.shape)
        if len(th) != 4 or (th[0], th[2], th[3]) != want:
            raise ValueError(f"{where}: target_hidden must be [B, T, n_target_layers, D] = "
                             f"[{B}, T, {want[1]}, {want[2]}], got {th}")


# ----------------------------------------------------------------------------------------- forward
def _block_attention(p_attn: dict, dcfg: DrafterConfig, x: jax.Array, positions: jax.Array,
                     ctx_keys: jax.Array, ctx_values: jax.Array, ctx_lengths: jax.Array) -> jax.Array:
    """x [B, Tb, D] (normed block states) -> attention output [B, Tb, D].

    Queries: the block. Keys/values: cached context rows j < ctx_lengths[b] (ctx_keys [B, S, KVH, hd])
    followed by the whole block (no causal mask). One softmax over both parts, statistics in float32;
    the two parts are scored separately so the cache is never copied.
    """
    B, Tb, _ = x.shape
    H, KVH, hd = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    G = H // KVH  # query heads per KV head; head h uses KV head h // G (HF repeat_kv order)
    q, k_blk, v_blk = _project_qkv(p_attn, dcfg, x, positions)  # [B, Tb, H, hd], [B, Tb, KVH, hd] x 2
    q = q.reshape(B, Tb, KVH, G, hd)  # [B, Tb, KVH, G, hd]

    scale = hd**-0.5
    f32 = jnp.float32
    s_ctx = dots.einsum("btkgd,bskd->bkgts", q, ctx_keys.astype(q.dtype), preferred_element_type=f32) * scale
    s_blk = dots.einsum("btkgd,bskd->bkgts", q, k_blk, preferred_element_type=f32) * scale
    S = ctx_keys.shape[1]
    visible = jnp.arange(S)[None, :] < ctx_lengths[:, None]  # [B, S]
    s_ctx = jnp.where(visible[:, None, None, None, :], s_ctx, -jnp.inf)  # [B, KVH, G, Tb, S]
    # The block part is always visible, so the max is finite even for rows with no context.
    m = jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))  # [B, KVH, G, Tb, 1]
    p_ctx, p_blk = jnp.exp(s_ctx - m), jnp.exp(s_blk - m)
    denom = p_ctx.sum(-1, keepdims=True) + p_blk.sum(-1, keepdims=True)
    out = (dots.einsum("bkgts,bskd->btkgd", p_ctx.astype(x.dtype), ctx_values.astype(x.dtype),
                       preferred_element_type=f32)
           + dots.einsum("bkgts,bskd->btkgd", p_blk.astype(x.dtype), v_blk, preferred_element_type=f32))
    out = out / jnp.moveaxis(denom, (1, 2, 3), (2, 3, 1))  # denom [B, Tb, KVH, G, 1]
    return _linear(out.reshape(B, Tb, H * hd).astype(x.dtype), p_attn["o"])


def shared_tables(cfg: ModelConfig, params: Mapping[str, Any]) -> tuple[jax.Array, jax.Array]:
    """The target's embedding [V, D] and lm_head [D, V] that the drafter shares (`drafter_forward`'s two tables; the
    embedding transposed when the target ties them)."""
    embed = params["embed_tokens"]
    return embed, embed.T if cfg.tie_word_embeddings else params["lm_head"]


def drafter_forward(dparams: dict, dcfg: DrafterConfig, cache: DrafterCache, embed_tokens: jax.Array,
                    lm_head: jax.Array, bonus_tokens: jax.Array, block_start: jax.Array) -> jax.Array:
    """Draft logits for one round.

    embed_tokens [V, D] and lm_head [D, V] are the target's (pass embed_tokens.T when tied);
    bonus_tokens [B] int; block_start [B] int = position of the bonus token (normally cache.lengths).
    The block is [bonus, mask * (block_size - 1)] at positions block_start + 0..block_size-1; it attends to
    context rows [0, cache.lengths[b]) and to itself. Activations run in embed_tokens.dtype.
    Returns float32 logits [B, block_size - 1, V] for positions block_start+1 .. block_start+block_size-1.
    """
    _check_batch_hidden(dcfg, cache, None, "drafter_forward")
    B = cache.lengths.shape[0]
    V, D = embed_tokens.shape
    if D != dcfg.hidden_size:
        raise ValueError(f"drafter_forward: embed_tokens must be [V, D={dcfg.hidden_size}], "
                         f"got {tuple(embed_tokens.shape)}")
    if not hasattr(lm_head, "shape"):
        raise ValueError(f"drafter_forward: lm_head must be a dense [D, V] array (lm_head is never INT4), "
                         f"got {type(lm_head).__name__}")
    if lm_head.shape != (D, V):
        raise ValueError(f"drafter_forward: lm_head must be [D, V] = [{D}, {V}], got {tuple(lm_head.shape)}")
    mask_id = dcfg.mask_token_id
    if mask_id is None:  # only a config that skipped validate() gets here
        raise ValueError("drafter_forward: dcfg.mask_token_id is None; set it (DrafterConfig.for_target does)")
    if mask_id >= V:
        raise ValueError(f"drafter_forward: mask_token_id={mask_id} is outside the vocabulary of {V}")
    for name, arr in (("bonus_tokens", bonus_tokens), ("block_start", block_start)):
        if arr.shape != (B,) or not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"drafter_forward: {name} must be int [B] = [{B}], got {arr.dtype} {tuple(arr.shape)}")

    Tb = dcfg.block_size
    tokens = jnp.concatenate(
        [bonus_tokens[:, None].astype(jnp.int32),
         jnp.full((B, Tb - 1), mask_id, jnp.int32)], axis=1)  # [B, Tb]
    positions = block_start[:, None].astype(jnp.int32) + jnp.arange(Tb, dtype=jnp.int32)[None, :]  # [B, Tb]
    h = jnp.take(embed_tokens, tokens, axis=0)  # [B, Tb, D]
    eps = dcfg.rms_norm_eps
    for layer in range(dcfg.num_hidden_layers):
        p = dparams[f"layers_{layer}"]
        h = h + _block_attention(p["attn"], dcfg, rms_norm(h, p["input_norm"], eps), positions,
                                 cache.keys[layer], cache.values[layer], cache.lengths)
        mlp, normed = p["mlp"], rms_norm(h, p["post_attn_norm"], eps)
        if "gate_up" in mlp:  # fold_drafter_params: one matmul
            h = h + swiglu_joined(_linear(normed, mlp["gate_up"]), mlp["down"])
        else:
            h = h + swiglu(normed, mlp["gate"], mlp["up"], mlp["down"])
    h = rms_norm(h[:, 1:], dparams["final_norm"], eps)  # [B, Tb-1, D]: the bonus position predicts nothing
    return dots.einsum("btd,dv->btv", h, lm_head.astype(h.dtype), preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------ linen wrapper
class Drafter(nn.Module):
    """Thin Flax linen wrapper: `variables["params"]` is exactly the `init_drafter_params` dict, and
    `apply` is pure. `Drafter(dcfg).apply({"params": dparams}, cache, embed, lm_head, bonus, start)` ==
    `drafter_forward(...)`; `method="extend_context"` == `drafter_extend_context(...)`."""

    config: DrafterConfig
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        self.config.validate()
        self.tree = {name: self.param(name, lambda key, n=name: _init_component(self.config, n, key,
                                                                               self.param_dtype))
                     for name in drafter_param_names(self.config)}

    def __call__(self, cache: DrafterCache, embed_tokens, lm_head, bonus_tokens, block_start) -> jax.Array:
        return drafter_forward(self.tree, self.config, cache, embed_tokens, lm_head, bonus_tokens, block_start)

    def extend_context(self, cache: DrafterCache, target_hidden, positions, num_valid) -> DrafterCache:
        return drafter_extend_context(self.tree, self.config, cache, target_hidden, positions, num_valid)

    def init_params(self) -> None:
        """Touch every parameter: `Drafter(dcfg).init(key, method="init_params")` builds the tree."""
        _ = self.tree  # accessing the tree runs setup(), which creates every parameter


__all__ = [
    "DrafterConfig", "DrafterCache", "Drafter", "declare_drafter", "default_target_layer_ids", "drafter_param_names",
    "init_drafter_params", "init_drafter_cache", "context_features", "drafter_extend_context",
    "drafter_forward",
]
