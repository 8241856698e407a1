"""Import and export DFlash drafters in z-lab's Hugging Face format (config.json + safetensors).

A published DFlash drafter (z-lab/dflash `DFlashDraftModel`, e.g. `Kimi-K2.5-DFlash`) is a Qwen3-style
model: `config.json` is a `Qwen3Config` (model_type "qwen3") plus a `dflash_config` dict with
`block_size`, `target_layer_ids` and `mask_token_id`; the tensors are `fc`, `hidden_norm`, `norm` and
`layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
mlp.{gate,up,down}_proj}` (no embedding, no lm_head: the target's are used). docs/drafter.md has the
mapping; in short:

- every Linear `weight` [out, in] is transposed to our [in, out];
- HF Qwen3 rotates halves (`rotate_half`: pair (i, i + hd/2)), this engine rotates interleaved pairs
  (2i, 2i+1): the q/k output columns of every head and the q_norm/k_norm weights are permuted from
  [x0 .. x_{hd/2-1}, y0 .. y_{hd/2-1}] to [x0, y0, x1, y1, ...]. Scores and RMSNorm are invariant under
  a permutation applied to both q and k, so the drafter computes the same function;
- config fields a file leaves out take `Qwen3Config`'s defaults (head_dim 128, rms_norm_eps 1e-6,
  rope_theta 10000, ...); a missing `target_layer_ids` follows DFlash's `build_target_layer_ids`
  (from `num_target_layers` and the drafter's layer count).

Everything else the format can express is refused by name (`DrafterFormatError`): attention biases,
activations other than silu, input embedding scale, output multiplier / logit softcap, causal or
sliding-window layers, partial rotary, RoPE types other than default and yarn, and the DFlash2 variants.
Tensor files go through the target importer's header checks (kdtree_jax.hf): missing, extra, mis-shaped
or non-float tensors and unreadable (truncated) shards fail naming the tensor and the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kdtree_jax import storage
from kdtree_jax.config import ConfigError, ModelConfig, YarnScaling
from kdtree_jax.drafter import DrafterConfig, drafter_param_names
from kdtree_jax.hf import (
    _FLOAT_DTYPES,
    SINGLE_FILE,
    HFCheckpointError,
    _list_tensors,
    _ShardReader,
    _TensorInfo,
    check_tensor_info,
    float_dtype,
    read_config_json,
)

# Qwen3Config's defaults (transformers models/qwen3/configuration_qwen3.py), used for absent fields.
QWEN3_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 28,
}
DFLASH_DEFAULT_BLOCK_SIZE = 16  # DFlashDraftModel: int(_draft_value(config, "block_size", 16))
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
ARCHITECTURES = ("DFlashDraftModel",)


class DrafterFormatError(HFCheckpointError):
    """A DFlash drafter directory uses a feature this engine does not implement, or is malformed."""


# ------------------------------------------------------------------------------------------ config
def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's placement rule for a config without `target_layer_ids`: one drafter layer reads the
    target's middle layer; otherwise one target layer per drafter layer, evenly over [1, L - 3].
    (Not `kdtree_jax.drafter.default_target_layer_ids`, which falls back differently on shallow targets.)"""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def _refuse(name: str, value: Any, why: str) -> None:
    raise DrafterFormatError(f"DFlash config {name}={value!r} is not supported: {why}")


def _rope(raw: Mapping[str, Any], head_dim: int) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN or None) from transformers v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        _refuse("rope_parameters", params, "expected a dict")
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = params["rope_theta"]
    else:
        theta = raw.get("rope_theta", QWEN3_DEFAULTS["rope_theta"])
    scaling = params if params is not None else raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        _refuse("rope_scaling", scaling, "expected a dict")
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    partial = (params or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse("partial_rotary_factor", partial, "the drafter rotates the whole head")
    if rope_type == "default" or scaling is None:
        return float(theta), None
    if rope_type != "yarn":
        _refuse("rope type", rope_type, "only 'default' and 'yarn' RoPE are implemented")
    if "factor" not in scaling:
        raise DrafterFormatError("DFlash config: yarn rope scaling has no 'factor'")
    factor = float(scaling["factor"])
    max_pos = raw.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"])
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        original = max_pos  # HF: the pre-trained length is max_position_embeddings
    elif not math.isclose(max_pos / original, factor, rel_tol=1e-9):
        # transformers versions disagree here: some take factor = max_position_embeddings / original.
        _refuse("rope_parameters.factor", factor, f"it differs from max_position_embeddings / "
                f"original_max_position_embeddings = {max_pos}/{original}, which some transformers versions "
                "use instead (ambiguous)")
    if scaling.get("truncate", True) is not True:
        _refuse("rope_parameters.truncate", scaling["truncate"], "only truncated YaRN correction ranges")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    # HF uses mscale / mscale_all_dim only when both are set, else get_mscale(factor) (mscale 1).
    yarn = (YarnScaling(factor, int(original), float(scaling.get("beta_fast") or 32.0),
                        float(scaling.get("beta_slow") or 1.0), float(mscale), float(mscale_all_dim))
            if mscale and mscale_all_dim else
            YarnScaling(factor, int(original), float(scaling.get("beta_fast") or 32.0),
                        float(scaling.get("beta_slow") or 1.0), 1.0, 0.0))
    explicit = scaling.get("attention_factor")
    if explicit is not None and not math.isclose(float(explicit), yarn.attention_factor, rel_tol=1e-12):
        _refuse("rope_parameters.attention_factor", explicit,
                f"only the default YaRN attention factor ({yarn.attention_factor}) is implemented")
    return float(theta), yarn


def drafter_config_from_hf(raw: Mapping[str, Any]) -> DrafterConfig:
    """DrafterConfig from a DFlash drafter's config.json dict; refuses unsupported features by name."""
    if not isinstance(raw, Mapping):
        raise DrafterFormatError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, Mapping):
        _refuse("dflash_config", dflash, "expected a dict")

    def value(name: str, default: Any = None) -> Any:  # DFlash's _draft_value: dflash_config, then top level
        return dflash.get(name, raw.get(name, default))

    def number(name: str, default: float) -> float:  # a numeric DFlash option; null reads as the default
        v = value(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            _refuse(name, v, "expected a number")
        return float(v)

    def field(name: str) -> Any:  # a Qwen3Config field: top level, else Qwen3Config's default
        return raw.get(name, QWEN3_DEFAULTS[name])

    archs = raw.get("architectures") or []
    if "DFlash2DraftModel" in archs or any(value(k) is not None for k in DFLASH2_KEYS):
        found = [k for k in DFLASH2_KEYS if value(k) is not None]
        _refuse("architectures", archs, f"DFlash2 (grouped dynamic convolutions and the candidate selector; "
                f"keys {found}) is not implemented, only DFlashDraftModel")
    unknown = [a for a in archs if a not in ARCHITECTURES]
    if unknown:
        _refuse("architectures", archs, f"expected {list(ARCHITECTURES)}")
    if raw.get("model_type", "qwen3") != "qwen3":
        _refuse("model_type", raw["model_type"], "DFlash drafters are Qwen3-style ('qwen3')")
    if field("attention_bias"):
        _refuse("attention_bias", raw["attention_bias"], "the drafter's q/k/v/o projections have no bias")
    if field("hidden_act") != "silu":
        _refuse("hidden_act", raw["hidden_act"], "the drafter's MLP is SwiGLU (silu)")
    if number("input_embedding_scale", 1.0) != 1.0:
        _refuse("input_embedding_scale", value("input_embedding_scale"), "the block is the target's plain embedding")
    if number("output_multiplier", 1.0) != 1.0:
        _refuse("output_multiplier", value("output_multiplier"), "the draft logits are the plain lm_head output")
    softcap = number("final_logit_softcapping", 0.0)
    if softcap > 0:
        _refuse("final_logit_softcapping", softcap, "the draft logits are not soft-capped")
    layers = field("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers <= 0:
        _refuse("num_hidden_layers", layers, "expected a positive integer")
    layer_types = raw.get("layer_types")
    if layer_types is None:  # Qwen3Config derives them: sliding from max_window_layers on, if enabled
        window = field("sliding_window") if field("use_sliding_window") else None
        layer_types = ["sliding_attention" if window is not None and i >= field("max_window_layers")
                       else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        _refuse("layer_types", layer_types, f"expected a list of {layers} layer types (num_hidden_layers)")
    bad_types = sorted({str(t) for t in layer_types if t != "full_attention"})
    if bad_types:
        _refuse("layer_types", bad_types, "only 'full_attention' drafter layers (no sliding window, which "
                "DFlash also makes causal)")
    if raw.get("is_causal"):
        _refuse("is_causal", raw["is_causal"], "the drafter's block attends to itself without a causal mask")

    block_size = value("block_size", DFLASH_DEFAULT_BLOCK_SIZE)
    mask = value("mask_token_id")
    if mask is None:
        raise DrafterFormatError("DFlash config has no dflash_config.mask_token_id (the token that fills the "
                                 "drafted positions); it has no default")
    ids = value("target_layer_ids")
    if ids is None:
        n_target = value("num_target_layers")
        if n_target is None:
            raise DrafterFormatError("DFlash config has neither dflash_config.target_layer_ids nor "
                                     "num_target_layers to place them from")
        ids = build_target_layer_ids(int(n_target), int(layers))
    if not isinstance(ids, (list, tuple)):
        _refuse("target_layer_ids", ids, "expected a list of target layer indices")
    head_dim = field("head_dim")
    rope_theta, yarn = _rope(raw, head_dim)
    try:
        return DrafterConfig(
            hidden_size=field("hidden_size"), num_hidden_layers=layers,
            num_attention_heads=field("num_attention_heads"), num_key_value_heads=field("num_key_value_heads"),
            head_dim=head_dim, intermediate_size=field("intermediate_size"), block_size=block_size,
            target_layer_ids=tuple(ids), mask_token_id=mask, rms_norm_eps=float(field("rms_norm_eps")),
            rope_theta=rope_theta, rope_scaling=yarn,
        ).validate()
    except ConfigError as e:
        raise DrafterFormatError(f"DFlash config: {e}") from None


def read_hf_drafter_config(path: str | Path) -> tuple[DrafterConfig, dict]:
    """(DrafterConfig, raw config.json dict) of a DFlash drafter directory."""
    config_file, raw = read_config_json(path, "DFlash drafter", DrafterFormatError)
    try:
        return drafter_config_from_hf(raw), raw
    except DrafterFormatError as e:
        raise DrafterFormatError(f"{config_file}: {e}") from None


def check_drafter_target(dcfg: DrafterConfig, raw: Mapping[str, Any], cfg: ModelConfig) -> None:
    """Raise ConfigError naming the mismatch if the drafter cannot run on target `cfg`."""
    dcfg.check_target(cfg)
    n_target = (raw.get("dflash_config") or {}).get("num_target_layers", raw.get("num_target_layers"))
    if n_target is not None and int(n_target) != cfg.num_hidden_layers:
        raise ConfigError(f"the drafter was made for a target with num_target_layers={n_target}, this target has "
                          f"num_hidden_layers={cfg.num_hidden_layers}")


# ------------------------------------------------------------------------------------------ tensors
def rope_halves_to_pairs(head_dim: int) -> np.ndarray:
    """Column order [hd]: ours[:, j] = hf[:, perm[j]], i.e. [0, hd/2, 1, hd/2 + 1, ...]."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def _plan(dcfg: DrafterConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], str]]:
    """HF tensor name -> (params path, HF shape, how: 'linear' | 'linear_rope' | 'vector' | 'vector_rope')."""
    D, F, hd = dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim
    H, KVH = dcfg.num_attention_heads, dcfg.num_key_value_heads
    plan = {"fc.weight": (("fc",), (D, dcfg.num_target_layers * D), "linear"),
            "hidden_norm.weight": (("hidden_norm",), (D,), "vector"),
            "norm.weight": (("final_norm",), (D,), "vector")}
    for i in range(dcfg.num_hidden_layers):
        pre, key = f"layers.{i}.", f"layers_{i}"
        plan.update({
            pre + "input_layernorm.weight": ((key, "input_norm"), (D,), "vector"),
            pre + "post_attention_layernorm.weight": ((key, "post_attn_norm"), (D,), "vector"),
            pre + "self_attn.q_proj.weight": ((key, "attn", "q"), (H * hd, D), "linear_rope"),
            pre + "self_attn.k_proj.weight": ((key, "attn", "k"), (KVH * hd, D), "linear_rope"),
            pre + "self_attn.v_proj.weight": ((key, "attn", "v"), (KVH * hd, D), "linear"),
            pre + "self_attn.o_proj.weight": ((key, "attn", "o"), (D, H * hd), "linear"),
            pre + "self_attn.q_norm.weight": ((key, "attn", "q_norm"), (hd,), "vector_rope"),
            pre + "self_attn.k_norm.weight": ((key, "attn", "k_norm"), (hd,), "vector_rope"),
            pre + "mlp.gate_proj.weight": ((key, "mlp", "gate"), (F, D), "linear"),
            pre + "mlp.up_proj.weight": ((key, "mlp", "up"), (F, D), "linear"),
            pre + "mlp.down_proj.weight": ((key, "mlp", "down"), (D, F), "linear"),
        })
    return plan


def _check_tensors(plan: dict, infos: dict[str, _TensorInfo]) -> None:
    missing = [name for name in plan if name not in infos]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise HFCheckpointError(f"DFlash drafter is missing {len(missing)} tensor(s) its config needs: "
                                f"{missing[:5]}{more}")
    extra = sorted(set(infos) - set(plan))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise HFCheckpointError(f"DFlash drafter has {len(extra)} unexpected tensor(s) for its config: "
                                f"{extra[:5]}{more}")
    for name, (_, shape, _) in plan.items():
        check_tensor_info(name, infos[name], shape, _FLOAT_DTYPES)


def _to_ours(hf: np.ndarray, how: str, dcfg: DrafterConfig) -> np.ndarray:
    perm = rope_halves_to_pairs(dcfg.head_dim)
    if how == "vector":
        return hf
    if how == "vector_rope":
        return hf[perm]
    w = hf.T  # [in, out]
    if how == "linear_rope":  # permute the rotary columns inside every head
        d_in, d_out = w.shape
        w = w.reshape(d_in, d_out // dcfg.head_dim, dcfg.head_dim)[:, :, perm].reshape(d_in, d_out)
    return w


def _to_hf(ours: np.ndarray, how: str, dcfg: DrafterConfig) -> np.ndarray:
    inv = np.argsort(rope_halves_to_pairs(dcfg.head_dim))
    if how == "vector":
        return ours
    if how == "vector_rope":
        return ours[inv]
    if how == "linear_rope":
        d_in, d_out = ours.shape
        ours = ours.reshape(d_in, d_out // dcfg.head_dim, dcfg.head_dim)[:, :, inv].reshape(d_in, d_out)
    return ours.T


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_hf_drafter(path: str | Path, dtype=jnp.bfloat16, *, target: ModelConfig | None = None
                    ) -> tuple[DrafterConfig, dict]:
    """Load a z-lab DFlash drafter directory (config.json with `dflash_config`; `model.safetensors` or
    shards with `model.safetensors.index.json`) as (DrafterConfig, params) in `dtype`.

    With `target`, the drafter is also checked against that target config (hidden size, layer ids,
    mask id, num_target_layers). Raises DrafterFormatError / HFCheckpointError (a ValueError) for a bad
    or unsupported directory, ConfigError for a drafter that does not fit `target`.
    """
    dtype = float_dtype(dtype)
    path = Path(path)
    dcfg, raw = read_hf_drafter_config(path)
    if target is not None:
        check_drafter_target(dcfg, raw, target)
    infos = _list_tensors(path)
    plan = _plan(dcfg)
    _check_tensors(plan, infos)
    params: dict = {}
    readers: dict[str, _ShardReader] = {}
    try:
        for name, (leaf_path, _, how) in plan.items():
            file = infos[name].file
            if file not in readers:
                readers[file] = _ShardReader(path / file, infos).__enter__()
            hf = readers[file].get(name)
            _set(params, leaf_path, np.ascontiguousarray(_to_ours(hf, how, dcfg)).astype(np.dtype(dtype)))
    finally:
        for reader in readers.values():
            reader.__exit__(None, None, None)
    assert set(params) == set(drafter_param_names(dcfg))
    return dcfg, jax.tree.map(jnp.asarray, params)


# ------------------------------------------------------------------------------------------- export
def hf_drafter_config(dcfg: DrafterConfig, target: ModelConfig | None = None) -> dict:
    """The config.json dict of `dcfg` in DFlash's format (every field explicit, transformers v5 rope form)."""
    dcfg.validate()
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(dcfg.rope_theta)}
    max_pos = QWEN3_DEFAULTS["max_position_embeddings"]
    rs = dcfg.rope_scaling
    if rs is not None:
        rope.update(rope_type="yarn", factor=rs.factor, beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                    original_max_position_embeddings=rs.original_max_position_embeddings,
                    attention_factor=rs.attention_factor)
        if rs.mscale and rs.mscale_all_dim:
            rope.update(mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
        # the only max_position_embeddings on which every transformers version reads the same factor
        max_pos = int(round(rs.factor * rs.original_max_position_embeddings))
    out = {
        "architectures": list(ARCHITECTURES), "model_type": "qwen3",
        "hidden_size": dcfg.hidden_size, "intermediate_size": dcfg.intermediate_size,
        "num_hidden_layers": dcfg.num_hidden_layers, "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads, "head_dim": dcfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": dcfg.rms_norm_eps, "rope_parameters": rope, "max_position_embeddings": max_pos,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "layer_types": ["full_attention"] * dcfg.num_hidden_layers, "tie_word_embeddings": False,
        "dflash_config": {"block_size": dcfg.block_size, "target_layer_ids": list(dcfg.target_layer_ids),
                          "mask_token_id": dcfg.mask_token_id},
    }
    if target is not None:
        dcfg.check_target(target)
        out["vocab_size"] = target.vocab_size
        out["num_target_layers"] = target.num_hidden_layers
    return out


def export_hf_drafter(dcfg: DrafterConfig, params: dict, out_dir: str | Path, *,
                      target: ModelConfig | None = None, overwrite: bool = False) -> Path:
    """Write `params` as a DFlash drafter directory (config.json + model.safetensors) that z-lab's
    `DFlashDraftModel` and `load_hf_drafter` read; weights keep their dtype (load_hf_drafter(out,
    dtype) == params bit for bit). `target` adds vocab_size and num_target_layers to the config."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    dest = storage.destination(out_dir)
    if os.path.lexists(dest):
        if not overwrite:
            raise HFCheckpointError(f"{dest} already exists (pass overwrite=True / --overwrite to replace it)")
        if (problem := _export_layout_problem(dest)) is not None:
            raise HFCheckpointError(f"refusing to overwrite {dest}: {problem}. Overwrite only replaces a DFlash "
                                    "drafter directory this engine exported; move or delete it yourself")
    config = hf_drafter_config(dcfg, target)
    expected = set(drafter_param_names(dcfg))
    if not isinstance(params, Mapping) or set(params) != expected:
        got = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise HFCheckpointError(f"drafter params must have entries {sorted(expected)}, got {got}")
    tensors: dict[str, np.ndarray] = {}
    for name, (leaf_path, shape, how) in _plan(dcfg).items():
        leaf: Any = params
        for key in leaf_path:
            leaf = leaf[key]
        arr = np.asarray(leaf)
        hf = np.ascontiguousarray(_to_hf(arr, how, dcfg))
        if hf.shape != shape:
            raise HFCheckpointError(f"params leaf {'/'.join(leaf_path)} has shape {list(arr.shape)}, which "
                                    f"does not give {name} {list(shape)} for this config")
        if hf.dtype not in (np.float32, np.float16, np.dtype(ml_dtypes.bfloat16)):
            raise HFCheckpointError(f"params leaf {'/'.join(leaf_path)} has dtype {hf.dtype}; DFlash files "
                                    "hold float32, float16 or bfloat16")
        tensors[name] = hf
    dest.parent.mkdir(parents=True, exist_ok=True)
    # the checkpoints' write protocol (kdtree_jax.storage): an exclusive lock, a temporary next to the
    # destination, a journaled commit; an interrupted export leaves no half directory
    lock = storage.WriteLock(dest)
    lock.acquire()
    try:
        storage.prepare_write(dest)
        tmp = storage.new_temporary(dest)
        tmp.mkdir()
        try:
            save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            storage.commit(tmp, dest, replace=overwrite)
        except BaseException:
            storage.remove_tree(tmp)
            raise
    finally:
        lock.release()
    return dest


def _export_layout_problem(path: Path) -> str | None:
    """Why `path` is not a DFlash drafter directory as `export_hf_drafter` writes it (None if it is one)."""
    if path.is_symlink() or not path.is_dir():
        return "it is not a directory"
    extra = sorted(set(os.listdir(path)) - {"config.json", SINGLE_FILE})
    if extra:
        return f"it holds files an exported drafter does not: {extra[:5]}"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"its config.json is not readable JSON ({e})"
    if not isinstance(config, dict) or "dflash_config" not in config:
        return "its config.json is not a DFlash drafter's (no dflash_config)"
    return None


__all__ = ["DrafterFormatError", "build_target_layer_ids", "check_drafter_target", "drafter_config_from_hf",
           "export_hf_drafter", "hf_drafter_config", "load_hf_drafter", "read_hf_drafter_config",
           "rope_halves_to_pairs"]
