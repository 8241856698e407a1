"""Orbax checkpoints of a config + params tree, written atomically and restored against the
abstract tree the config implies (Orbax alone would restore a partial tree silently).

Layout of a checkpoint directory:
    config.json      {"kind": "target" | "drafter", "config": {...}, "param_dtype": "...",
                      "quantization": null | {...}, "format": 1}
    params/          the Orbax (OCDBT) tree
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kdtree_jax.config import ModelConfig

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not match its config."""


# kind -> (config class, config loader, abstract params builder (cfg, dtype, meta) -> ShapeDtypeStruct tree)
_KINDS: dict[str, tuple[type, Callable[[dict], Any], Callable[[Any, Any, dict], Any]]] = {}


def register_kind(kind: str, config_type: type, config_from_dict: Callable[[dict], Any],
                  abstract_params: Callable[[Any, Any, dict], Any]) -> None:
    """Teach save/load a new kind of config (the drafter registers itself)."""
    _KINDS[kind] = (config_type, config_from_dict, abstract_params)


def _abstract_target(cfg: ModelConfig, dtype, meta: dict):
    from kdtree_jax.model import init_params  # noqa: PLC0415

    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))
    quantization = meta.get("quantization")
    if quantization:
        from kdtree_jax.quant import abstract_quantized  # noqa: PLC0415

        abstract = abstract_quantized(abstract, cfg, quantization)
    return abstract


register_kind("target", ModelConfig, ModelConfig.from_dict, _abstract_target)


def _kind_of(cfg) -> str:
    for kind, (config_type, _, _) in _KINDS.items():
        if isinstance(cfg, config_type):
            return kind
    raise TypeError(f"cannot checkpoint a config of type {type(cfg).__name__}")


def _param_dtype(params) -> str:
    floats = {np.dtype(leaf.dtype).name for leaf in jax.tree.leaves(params)
              if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 2
              and np.dtype(leaf.dtype) != np.float32}
    # Router weights are always float32; the remaining matrices define the model's dtype.
    return floats.pop() if len(floats) == 1 else "float32"


def save_checkpoint(path: str | os.PathLike, cfg, params, *, quantization: dict | None = None,
                    overwrite: bool = False) -> Path:
    """Write cfg + params to `path` atomically: everything goes to a temporary sibling directory
    that is renamed into place only once complete, so an interrupted save leaves no checkpoint."""
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists (pass overwrite=True to replace it)")
    cfg.validate()
    kind = _kind_of(cfg)
    meta = {"format": FORMAT_VERSION, "kind": kind, "config": cfg.to_dict(),
            "param_dtype": _param_dtype(params), "quantization": quantization}
    expected = _KINDS[kind][2](cfg, jnp.dtype(meta["param_dtype"]), meta)
    _check_tree(expected, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
                f"params to save at {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", params)
        checkpointer.wait_until_finished()
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        if path.exists():  # overwrite: swap in the new one, then drop the old
            trash = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)
            os.rename(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} is not a kdtree-jax checkpoint: config.json is missing")
    try:
        meta = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT_VERSION or meta.get("kind") not in _KINDS:
        raise CheckpointError(f"{config_file}: unsupported checkpoint format {meta.get('format')!r} / "
                              f"kind {meta.get('kind')!r}")
    return meta


def load_checkpoint(path: str | os.PathLike, *, expect_kind: str | None = None):
    """Restore (cfg, params). Every tensor the config implies must be present with the right shape
    and dtype, and nothing else may be there; otherwise CheckpointError names the tensors."""
    path = Path(path)
    meta = read_checkpoint_meta(path)
    kind = meta["kind"]
    if expect_kind is not None and kind != expect_kind:
        raise CheckpointError(f"{path} holds a {kind} checkpoint, expected a {expect_kind}")
    _, from_dict, abstract_fn = _KINDS[kind]
    cfg = from_dict(meta["config"])
    expected = abstract_fn(cfg, jnp.dtype(meta["param_dtype"]), meta)
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = checkpointer.metadata(path / "params").item_metadata.tree
    except Exception as e:  # orbax raises many types for damaged directories
        raise CheckpointError(f"cannot read the tensor index of {path / 'params'}: {e}") from None
    _check_tree(expected, saved, f"checkpoint {path}")
    try:
        params = checkpointer.restore(path / "params", expected)
    except Exception as e:
        raise CheckpointError(f"cannot read the tensors of {path / 'params'} (truncated or damaged?): "
                              f"{type(e).__name__}: {e}") from None
    return cfg, _plain(params)


def _plain(tree):
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _flatten(tree) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in key_path): leaf for key_path, leaf in leaves}


def _check_tree(expected, actual, what: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped/mis-typed tensors."""
    exp, act = _flatten(expected), _flatten(actual)
    problems = []
    missing = sorted(set(exp) - set(act))
    extra = sorted(set(act) - set(exp))
    if missing:
        problems.append(f"missing tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if extra:
        problems.append(f"unexpected tensors: {extra[:10]}{' ...' if len(extra) > 10 else ''}")
    for name in sorted(set(exp) & set(act)):
        e, a = exp[name], act[name]
        if tuple(e.shape) != tuple(a.shape) or np.dtype(e.dtype) != np.dtype(a.dtype):
            problems.append(f"{name}: expected {np.dtype(e.dtype).name}{list(e.shape)}, "
                            f"found {np.dtype(a.dtype).name}{list(a.shape)}")
    if problems:
        raise CheckpointError(f"{what} does not match its config: " + "; ".join(problems[:12]))
