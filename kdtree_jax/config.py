"""Model configuration: a frozen, hashable dataclass whose field names follow the Hugging Face
DeepseekV3 config, so it can be a static argument of `jax.jit` and round-trips through JSON.

The same code serves Kimi K2 / K2.5 / K2.6, DeepSeek-V3 and the tiny test models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent."""


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (`rope_scaling` / `rope_parameters` with rope_type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0  # 0 (absent) leaves the softmax scale alone

    @property
    def attention_factor(self) -> float:
        """Multiplier on cos/sin (HF `attention_factor`); 1.0 for Kimi and DeepSeek-V3."""
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """DeepSeek/HF `yarn_get_mscale`: 1 for scale <= 1, else 0.1 * mscale * ln(scale) + 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Target model hyper-parameters (DeepSeek-V3 architecture: MLA + DeepSeekMoE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense SwiGLU width (layers < first_k_dense_replace)
    moe_intermediate_size: int  # width of one routed (and one shared) expert
    num_hidden_layers: int
    first_k_dense_replace: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: plain q projection (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # eps of q_a_layernorm / kv_a_layernorm. HF (transformers and Kimi's remote code) hard-wires 1e-6
    # there whatever rms_norm_eps says; vLLM/SGLang use rms_norm_eps. We follow HF by default.
    latent_norm_eps: float = 1e-6
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    mask_token_id: int | None = None  # the drafter's [MASK] token (DFlash noise block)

    # ----------------------------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values stored per token per layer in the latent KV cache: c_kv (normed) + k_pe (roped)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim) * mscale^2 (YaRN), also in the absorbed 576-wide form."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None:
            m = yarn_get_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    # ---------------------------------------------------------------------------------- checks
    def validate(self) -> ModelConfig:
        """Raise ConfigError naming the first bad value; return self so calls can chain."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        # Types first, so the range checks below compare numbers (a config from JSON may hold anything).
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _FLOAT_FIELDS:
                if not _is_number(value) or not math.isfinite(value):
                    raise ConfigError(f"{field.name} must be a finite number, got {value!r}")
            elif field.name in _BOOL_FIELDS:
                if not isinstance(value, bool):
                    raise ConfigError(f"{field.name} must be true or false, got {value!r}")
            elif field.name in _OPTIONAL_INT_FIELDS:
                if value is not None and not _is_int(value):
                    raise ConfigError(f"{field.name} must be an integer or null, got {value!r}")
            elif field.name == "eos_token_id":
                if not isinstance(value, tuple) or not all(_is_int(t) for t in value):
                    raise ConfigError(f"eos_token_id must be a tuple of token ids, got {value!r}")
            elif field.name == "rope_scaling":
                if value is not None and not isinstance(value, YarnScaling):
                    raise ConfigError(f"rope_scaling must be a YarnScaling or None, got {value!r}")
            elif not _is_int(value):
                raise ConfigError(f"{field.name} must be an integer, got {value!r}")
        if self.rope_scaling is not None:
            for field in dataclasses.fields(YarnScaling):
                value = getattr(self.rope_scaling, field.name)
                if not _is_number(value) or not math.isfinite(value):
                    raise ConfigError(f"rope_scaling.{field.name} must be a finite number, got {value!r}")

        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "max_position_embeddings", "n_group", "topk_group",
        ):
            positive(name)
        if self.q_lora_rank is not None:
            positive("q_lora_rank")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.first_k_dense_replace < self.num_hidden_layers:  # there are MoE layers
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
                positive(name)
            if self.n_shared_experts < 0:
                raise ConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts="
                    f"{self.n_routed_experts}")
            if self.n_routed_experts % self.n_group:
                raise ConfigError(
                    f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if self.topk_group > self.n_group:
                raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
            per_group = self.n_routed_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                raise ConfigError("group-limited routing scores a group by its top-2 experts: "
                                  f"n_routed_experts/n_group must be >= 2, got {per_group}")
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in the "
                    f"topk_group={self.topk_group} kept groups ({self.topk_group * per_group})")
        for name in ("rms_norm_eps", "latent_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if not rs.factor >= 1.0:
                raise ConfigError(f"rope_scaling.factor must be >= 1, got {rs.factor}")
            if rs.original_max_position_embeddings <= 0:
                raise ConfigError("rope_scaling.original_max_position_embeddings must be positive, "
                                  f"got {rs.original_max_position_embeddings}")
        special = {"bos_token_id": self.bos_token_id, "pad_token_id": self.pad_token_id,
                   "mask_token_id": self.mask_token_id}
        special.update({f"eos_token_id[{i}]": t for i, t in enumerate(self.eos_token_id)})
        for name, token in special.items():
            if token is not None and not 0 <= token < self.vocab_size:
                raise ConfigError(f"{name}={token} is outside the vocabulary [0, {self.vocab_size})")
        return self

    # --------------------------------------------------------------------------------- presets
    @classmethod
    def tiny(cls) -> ModelConfig:
        """A small model with every feature of K2.6 present: MLA with q/kv LoRA, YaRN, routed MoE
        with bias routing and a shared expert, a dense first layer. Runs in milliseconds on a CPU."""
        return cls(
            vocab_size=400, hidden_size=192, intermediate_size=384, moe_intermediate_size=64,
            num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, num_attention_heads=6, q_lora_rank=96, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_theta=50000.0,
            rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64,
                                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
            max_position_embeddings=256, rms_norm_eps=1e-5, routed_scaling_factor=2.827,
            bos_token_id=1, eos_token_id=(2,), pad_token_id=0, mask_token_id=399,
        ).validate()

    @classmethod
    def kimi_k26(cls) -> ModelConfig:
        """Kimi K2.6 at full size (1.03 T parameters): for shapes and abstract evaluation."""
        return cls(
            vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=61, first_k_dense_replace=1, n_routed_experts=384, n_shared_experts=1,
            num_experts_per_tok=8, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=50000.0,
            rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=4096,
                                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
            max_position_embeddings=262144, rms_norm_eps=1e-5, routed_scaling_factor=2.827,
            bos_token_id=163584, eos_token_id=(163586,), pad_token_id=163839,
            mask_token_id=163838,
        ).validate()

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes).validate()

    # ------------------------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_token_id"] = list(self.eos_token_id)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Inverse of to_dict (our own serialisation, not a Hugging Face config)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a ModelConfig dict, got {type(data).__name__}")
        data = dict(data)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {sorted(unknown)}")
        rope = data.get("rope_scaling")
        if rope is not None:
            if not isinstance(rope, Mapping):
                raise ConfigError(f"rope_scaling must be a dict or null, got {rope!r}")
            try:
                data["rope_scaling"] = YarnScaling(**rope)
            except TypeError as e:
                raise ConfigError(f"bad rope_scaling fields: {e}") from None
        eos = data.get("eos_token_id", ())
        if not isinstance(eos, (list, tuple)):
            raise ConfigError(f"eos_token_id must be a list of token ids, got {eos!r}")
        data["eos_token_id"] = tuple(eos)
        try:
            return cls(**data).validate()
        except TypeError as e:
            raise ConfigError(f"bad ModelConfig fields: {e}") from None

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict: `deepseek_v3`, `kimi_k2`, or `kimi_k25` (the
        text model lives in `text_config`); rope given either as legacy `rope_theta` + `rope_scaling`
        or as transformers-5 `rope_parameters`."""
        if not isinstance(hf, Mapping):
            raise ConfigError(f"expected a config dict, got {type(hf).__name__}")
        if hf.get("model_type") == "kimi_k25" or (
                "text_config" in hf and "hidden_size" not in hf):
            if not isinstance(hf.get("text_config"), Mapping):
                raise ConfigError("a kimi_k25 config needs a `text_config` dict holding the text model")
            outer = hf
            hf = dict(hf["text_config"])
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if hf.get(key) is None and outer.get(key) is not None:
                    hf[key] = outer[key]
        model_type = hf.get("model_type", "deepseek_v3")
        if model_type not in ("deepseek_v3", "kimi_k2", "deepseek_v2"):
            raise ConfigError(f"unsupported model_type {model_type!r}: expected deepseek_v3, kimi_k2 "
                              "or kimi_k25 (with text_config)")
        if hf.get("num_key_value_heads", hf.get("num_attention_heads")) != hf.get("num_attention_heads"):
            raise ConfigError("MLA needs num_key_value_heads == num_attention_heads, got "
                              f"{hf.get('num_key_value_heads')} vs {hf.get('num_attention_heads')}")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"only sigmoid routing is supported, got scoring_func={hf['scoring_func']!r}")
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"only moe_layer_freq=1 is supported, got {hf['moe_layer_freq']}")

        rope_theta, rope_scaling = _parse_rope(hf)
        eos = hf.get("eos_token_id")
        if eos is not None and not _is_int(eos) and not (
                isinstance(eos, list) and all(_is_int(t) for t in eos)):
            raise ConfigError(f"config key 'eos_token_id' must be a token id or a list of them, got {eos!r}")
        eos_tuple = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim")
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config is missing required keys: {missing}")
        cfg = cls(
            vocab_size=_integer(hf, "vocab_size"),
            hidden_size=_integer(hf, "hidden_size"),
            intermediate_size=_integer(hf, "intermediate_size"),
            moe_intermediate_size=_integer(hf, "moe_intermediate_size", _integer(hf, "intermediate_size")),
            num_hidden_layers=_integer(hf, "num_hidden_layers"),
            first_k_dense_replace=_integer(hf, "first_k_dense_replace", 0),
            n_routed_experts=_integer(hf, "n_routed_experts", 0),
            n_shared_experts=_integer(hf, "n_shared_experts", 0),
            num_experts_per_tok=_integer(hf, "num_experts_per_tok", 0),
            num_attention_heads=_integer(hf, "num_attention_heads"),
            q_lora_rank=_integer(hf, "q_lora_rank", None),
            kv_lora_rank=_integer(hf, "kv_lora_rank"),
            qk_nope_head_dim=_integer(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=_integer(hf, "qk_rope_head_dim"),
            v_head_dim=_integer(hf, "v_head_dim"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_integer(hf, "max_position_embeddings", 4096),
            rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6),
            routed_scaling_factor=_number(hf, "routed_scaling_factor", 1.0),
            n_group=_integer(hf, "n_group", 0) or 1,  # HF writes null (or 0) for "no groups"
            topk_group=_integer(hf, "topk_group", 0) or 1,
            norm_topk_prob=_boolean(hf, "norm_topk_prob", True),
            tie_word_embeddings=_boolean(hf, "tie_word_embeddings", False),
            bos_token_id=_integer(hf, "bos_token_id", None),
            eos_token_id=eos_tuple,
            pad_token_id=_integer(hf, "pad_token_id", None),
            mask_token_id=_integer(hf, "mask_token_id", None),
        )
        return cfg.validate()


_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps", "latent_norm_eps", "routed_scaling_factor")
_BOOL_FIELDS = ("norm_topk_prob", "tie_word_embeddings")
_OPTIONAL_INT_FIELDS = ("q_lora_rank", "bos_token_id", "pad_token_id", "mask_token_id")
_REQUIRED = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED, where: str = "") -> Any:
    """hf[key] as an int; absent or null gives `default`. A float must be whole (7168.0): nothing is
    truncated. ConfigError names the key for any other JSON type."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"config is missing required key {where + key!r}")
        return default
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"config key {where + key!r} must be an integer, got {value!r}")


def _number(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED, where: str = "") -> float:
    """hf[key] as a finite float; absent or null gives `default`; ConfigError names the key otherwise."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"config is missing required key {where + key!r}")
        return default
    if not _is_number(value) or not math.isfinite(value):
        raise ConfigError(f"config key {where + key!r} must be a finite number, got {value!r}")
    return float(value)


def _boolean(hf: Mapping[str, Any], key: str, default: bool) -> bool:
    """hf[key] as a bool (absent or null: `default`); a string such as "false" is refused, not read as true."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    return value


def _parse_rope(hf: Mapping[str, Any]) -> tuple[float, YarnScaling | None]:
    """Return (rope_theta, YarnScaling or None) from either rope form."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"config key 'rope_parameters' must be a dict, got {params!r}")
    if params is not None:
        rope_theta = _number(params, "rope_theta", _number(hf, "rope_theta", 10000.0), "rope_parameters.")
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling, where = (params if rope_type != "default" else None), "rope_parameters."
    else:
        rope_theta = _number(hf, "rope_theta", 10000.0)
        scaling, where = hf.get("rope_scaling"), "rope_scaling."
        if scaling is not None and not isinstance(scaling, Mapping):
            raise ConfigError(f"config key 'rope_scaling' must be a dict or null, got {scaling!r}")
        rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if scaling is None:
        return rope_theta, None
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"unsupported rope scaling type {rope_type!r}: only yarn is implemented")
    if "factor" not in scaling:
        raise ConfigError("yarn rope scaling needs a `factor`")
    if scaling.get("original_max_position_embeddings") is None:
        raise ConfigError("yarn rope scaling needs `original_max_position_embeddings`")
    # HF treats a falsy beta as its default (32 / 1).
    return rope_theta, YarnScaling(
        factor=_number(scaling, "factor", where=where),
        original_max_position_embeddings=_integer(scaling, "original_max_position_embeddings", where=where),
        beta_fast=_number(scaling, "beta_fast", 0.0, where) or 32.0,
        beta_slow=_number(scaling, "beta_slow", 0.0, where) or 1.0,
        mscale=_number(scaling, "mscale", 0.0, where) or 1.0,
        mscale_all_dim=_number(scaling, "mscale_all_dim", 0.0, where),
    )
