"""Orbax checkpoints of a config + params tree, written atomically and restored against the
abstract tree the config implies (Orbax alone would restore a partial tree silently).

Layout of a checkpoint directory (format 2):
    config.json      {"kind": "target" | "drafter", "config": {...}, "param_dtype": "...",
                      "quantization": null | {...}, "format": 2, "entries": [...]}
    params/<entry>/  one Orbax (OCDBT) item per top-level params entry (embed_tokens, layers_0, ...,
                     final_norm, lm_head), holding the tree {entry: subtree}
One item per entry lets `CheckpointWriter` write a model layer by layer (peak host memory about one
layer; `kdtree_jax.convert`) and a reader restore it entry by entry. Format 1 (params/ one Orbax tree)
is still read.

`quantization` names the INT4 weights: {"int4_leaves": {"layers_1/moe/experts/gate": "bfloat16", ...}}
(path -> scale dtype); `save_checkpoint` derives it from the params tree (`kj.quantize` output or an
HF INT4 import) when not given.

The files hold each INT4 weight as the dict {"qweight", "scale"} (`Int4Weight.to_dict`); in memory it is
an `Int4Weight`. This module converts at the boundary (`_stored` on the way out, `_typed` on the way in),
so every checkpoint written before the typed weights loads unchanged.
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
from kdtree_jax.drafter import DrafterConfig, init_drafter_params
from kdtree_jax.weights import abstract_params
from pallas_kernels.int4 import GROUP_SIZE, Int4Weight, MosaicInt4Weight

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not match its config."""


# kind -> (config class, config loader, abstract params builder (cfg, dtype, meta) -> ShapeDtypeStruct tree)
_KINDS: dict[str, tuple[type, Callable[[dict], Any], Callable[[Any, Any, dict], Any]]] = {}


def register_kind(kind: str, config_type: type, config_from_dict: Callable[[dict], Any],
                  abstract_params: Callable[[Any, Any, dict], Any]) -> None:
    """Teach save/load a new kind of config."""
    _KINDS[kind] = (config_type, config_from_dict, abstract_params)


def abstract_int4_leaves(abstract, int4_leaves: dict[str, str]):
    """Replace the dense abstract leaves named in `int4_leaves` ("a/b/c" -> scale dtype name) by an abstract
    Int4Weight: dense [..., K, N] -> qweight int16 [..., N, K/4], scale [..., N, K/32]."""
    if not isinstance(int4_leaves, dict):
        raise CheckpointError(f"quantization['int4_leaves'] must be a dict path -> scale dtype, got {int4_leaves!r}")
    abstract = jax.tree.map(lambda x: x, abstract)  # a copy we may edit
    for name, scale_dtype in int4_leaves.items():
        *parents, last = name.split("/")
        node = abstract
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                break
        if not isinstance(node, dict) or last not in node or not hasattr(node[last], "shape"):
            raise CheckpointError(f"quantization names INT4 leaf {name!r}, which is not a dense weight of this "
                                  "config")
        try:
            scale_dtype = jnp.dtype(scale_dtype)
        except TypeError:
            raise CheckpointError(f"INT4 leaf {name!r}: bad scale dtype {scale_dtype!r}") from None
        *lead, k, n = node[last].shape
        if k % GROUP_SIZE:
            raise CheckpointError(f"INT4 leaf {name!r}: input dim {k} is not a multiple of {GROUP_SIZE}")
        node[last] = Int4Weight(qweight=jax.ShapeDtypeStruct((*lead, n, k // 4), jnp.int16),
                                scale=jax.ShapeDtypeStruct((*lead, n, k // GROUP_SIZE), scale_dtype))
    return abstract


def _abstract_target(cfg: ModelConfig, dtype, meta: dict):
    abstract = abstract_params(cfg, dtype)
    quantization = meta.get("quantization")
    if quantization:
        if not isinstance(quantization, dict) or set(quantization) != {"int4_leaves"}:
            raise CheckpointError(f"quantization metadata must be {{'int4_leaves': {{path: scale dtype}}}}, "
                                  f"got {quantization!r}")
        abstract = abstract_int4_leaves(abstract, quantization["int4_leaves"])
    return abstract


def _abstract_drafter(dcfg: DrafterConfig, dtype, meta: dict):
    if meta.get("quantization"):
        raise CheckpointError("drafter checkpoints are never quantized")
    return jax.eval_shape(lambda: init_drafter_params(dcfg, jax.random.key(0), dtype))


register_kind("target", ModelConfig, ModelConfig.from_dict, _abstract_target)
register_kind("drafter", DrafterConfig, DrafterConfig.from_dict, _abstract_drafter)


def _kind_of(cfg) -> str:
    for kind, (config_type, _, _) in _KINDS.items():
        if isinstance(cfg, config_type):
            return kind
    raise TypeError(f"cannot checkpoint a config of type {type(cfg).__name__}")


def _param_dtype(params) -> str:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Weight))
    floats = {np.dtype(leaf.dtype).name for leaf in leaves
              if not isinstance(leaf, Int4Weight) and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 2
              and np.dtype(leaf.dtype) != np.float32}
    # Router weights are always float32 and INT4 scales have their own dtype; the remaining
    # matrices define the model's dtype.
    if len(floats) > 1:
        raise CheckpointError(f"params mix weight dtypes {sorted(floats)}: cast the tree to one dtype "
                              "(the router stays float32) before saving")
    return floats.pop() if floats else "float32"


def int4_leaves_of(params) -> dict | None:
    """{"int4_leaves": {"a/b/c": scale dtype}} for the Int4Weights of a params tree, None if dense."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Int4Weight))[0]
    found = {"/".join(str(getattr(k, "key", k)) for k in path): np.dtype(leaf.scale.dtype).name
             for path, leaf in leaves if isinstance(leaf, Int4Weight)}
    return {"int4_leaves": found} if found else None


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _stored(tree):
    """The tree as the files hold it: every Int4Weight as its dict {"qweight", "scale"}."""
    return jax.tree.map(lambda x: x.to_dict() if isinstance(x, Int4Weight) else x, tree,
                        is_leaf=lambda x: isinstance(x, Int4Weight))


class CheckpointWriter:
    """Writes a checkpoint entry by entry into a temporary sibling directory; `commit()` checks the
    written tensor index against the config's abstract tree, then renames it into place. Any failure
    or interrupt before that (use it as a context manager) removes the temporary directory, so a
    half-written checkpoint never appears at `path`.

        with CheckpointWriter(path, cfg, param_dtype="bfloat16") as w:
            for entry, subtree in ...:    # in any order; every entry of w.entries exactly once
                w.write(entry, subtree)
    """

    def __init__(self, path: str | os.PathLike, cfg, *, param_dtype, quantization: dict | None = None,
                 overwrite: bool = False):
        self.path = Path(path).absolute()
        if self.path.exists() and not overwrite:
            raise CheckpointError(f"{self.path} already exists (pass overwrite=True to replace it)")
        cfg.validate()
        kind = _kind_of(cfg)
        try:
            param_dtype = jnp.dtype(param_dtype).name
        except TypeError:
            raise CheckpointError(f"bad param_dtype {param_dtype!r}") from None
        self.cfg = cfg
        self.meta = {"format": FORMAT_VERSION, "kind": kind, "config": cfg.to_dict(), "param_dtype": param_dtype,
                     "quantization": quantization}
        self.expected = _KINDS[kind][2](cfg, jnp.dtype(param_dtype), self.meta)
        self.entries: tuple[str, ...] = tuple(self.expected)
        self.meta["entries"] = list(self.entries)
        self.written: list[str] = []
        self._tmp = self.path.parent / f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}"
        self._checkpointer = ocp.StandardCheckpointer()
        self._state = "open"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        (self._tmp / "params").mkdir(parents=True)

    def write(self, entry: str, subtree) -> None:
        """Check `subtree` against the config and write it as params/<entry>; blocks until on disk, so
        the caller may drop it right after."""
        if self._state != "open":
            raise CheckpointError(f"checkpoint writer for {self.path} is {self._state}")
        if entry not in self.expected:
            raise CheckpointError(f"{entry!r} is not a params entry of this config (entries: {list(self.entries)})")
        if entry in self.written:
            raise CheckpointError(f"params entry {entry!r} was already written")
        _check_tree({entry: self.expected[entry]}, {entry: _abstract(subtree)}, f"params to save at {self.path}")
        self._checkpointer.save(self._tmp / "params" / entry, _stored({entry: subtree}))
        self._checkpointer.wait_until_finished()
        self.written.append(entry)

    def commit(self) -> Path:
        """Verify what is on disk against the abstract tree and move it into place."""
        if self._state != "open":
            raise CheckpointError(f"checkpoint writer for {self.path} is {self._state}")
        missing = [e for e in self.entries if e not in self.written]
        if missing:
            raise CheckpointError(f"checkpoint {self.path} is incomplete: entries {missing} were never written")
        _check_tree(self.expected, _saved_index(self._tmp, self.meta, self.expected),
                    f"checkpoint written at {self.path}")
        (self._tmp / "config.json").write_text(json.dumps(self.meta, indent=2))
        if self.path.exists():  # overwrite: swap in the new one, then drop the old
            trash = self.path.parent / f".{self.path.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.path, trash)
            os.rename(self._tmp, self.path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(self._tmp, self.path)
        self._state = "committed"
        return self.path

    def abort(self) -> None:
        """Drop everything written so far (idempotent)."""
        if self._state == "open":
            self._state = "aborted"
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._state == "open":
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        elif self._state != "committed":
            self.abort()


def save_checkpoint(path: str | os.PathLike, cfg, params, *, quantization: dict | None = None,
                    overwrite: bool = False) -> Path:
    """Write cfg + params to `path` atomically (see CheckpointWriter): an interrupted or failed save
    leaves no checkpoint and no temporary directory."""
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists (pass overwrite=True to replace it)")
    is_mosaic = lambda x: isinstance(x, MosaicInt4Weight)  # noqa: E731
    mosaic = [leaf for leaf in jax.tree.leaves(params, is_leaf=is_mosaic) if is_mosaic(leaf)]
    if mosaic:
        raise CheckpointError(f"{len(mosaic)} leaves are in the Mosaic GPU layout (kj.to_mosaic_experts, a "
                              "device-side layout): save the canonical INT4 params they were made from")
    if quantization is None:
        quantization = int4_leaves_of(params)
    writer = CheckpointWriter(path, cfg, param_dtype=_param_dtype(params), quantization=quantization,
                              overwrite=overwrite)
    with writer:
        # Check the whole tree first, so a bad save fails before any tensor is written.
        _check_tree(writer.expected, _abstract(params), f"params to save at {path}")
        for entry in writer.entries:
            writer.write(entry, params[entry])
    return path


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The config.json of a checkpoint directory (kind, config, param_dtype, quantization, format)."""
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
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS or meta.get("kind") not in _KINDS:
        got = meta if not isinstance(meta, dict) else (meta.get("format"), meta.get("kind"))
        raise CheckpointError(f"{config_file}: unsupported checkpoint format / kind {got!r} "
                              f"(readable formats {READABLE_FORMATS}, kinds {sorted(_KINDS)})")
    return meta


def _item_metadata(directory: Path):
    try:
        return ocp.StandardCheckpointer().metadata(directory).item_metadata.tree
    except Exception as e:  # orbax raises many types for damaged directories
        raise CheckpointError(f"cannot read the tensor index of {directory}: {e}") from None


def _saved_index(path: Path, meta: dict, expected) -> dict:
    """The tensor index (shapes/dtypes) of the params on disk, as one tree."""
    if meta["format"] == 1:
        return _item_metadata(path / "params")
    params_dir = path / "params"
    if not params_dir.is_dir():
        raise CheckpointError(f"{path} has no params/ directory")
    saved: dict[str, Any] = {}
    for entry in sorted(os.listdir(params_dir)):
        if entry.startswith("."):
            continue
        item = _item_metadata(params_dir / entry)
        if not hasattr(item, "keys") or set(item.keys()) != {entry}:
            raise CheckpointError(f"{params_dir / entry} does not hold the params entry {entry!r}")
        saved[entry] = item[entry]
    return saved


def checkpoint_config(path: str | os.PathLike, *, expect_kind: str | None = None):
    """(cfg, meta) of a checkpoint without reading any tensor."""
    path = Path(path)
    meta = read_checkpoint_meta(path)
    kind = meta["kind"]
    if expect_kind is not None and kind != expect_kind:
        raise CheckpointError(f"{path} holds a {kind} checkpoint, expected a {expect_kind}")
    try:
        cfg = _KINDS[kind][1](meta["config"])
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path / 'config.json'}: bad {kind} config: {e}") from None
    return cfg, meta


def load_checkpoint(path: str | os.PathLike, *, expect_kind: str | None = None, mesh=None):
    """Restore (cfg, params). Every tensor the config implies must be present with the right shape
    and dtype, and nothing else may be there; otherwise CheckpointError names the tensors.

    mesh (a jax Mesh or a spec like "expert=2,tensor=1"): every array is restored straight into its
    NamedSharding (kdtree_jax.sharding; a drafter is replicated), each device reading only its own
    shard, so the whole model never sits on one device or the host. MeshError when the mesh does not
    divide the model."""
    path = Path(path).absolute()  # Orbax needs absolute paths
    cfg, meta = checkpoint_config(path, expect_kind=expect_kind)
    expected = _KINDS[meta["kind"]][2](cfg, jnp.dtype(meta["param_dtype"]), meta)
    _check_tree(expected, _saved_index(path, meta, expected), f"checkpoint {path}")
    # Every leaf gets an explicit sharding: Orbax otherwise rebuilds the one stored at save time (e.g.
    # "cpu:0" for the shipped pair) and refuses to restore on another platform ("Topology mismatch").
    expected = _with_shardings(cfg, meta["kind"], expected, mesh)
    checkpointer = ocp.StandardCheckpointer()
    expected = _stored(expected)
    items = ([(path / "params", expected)] if meta["format"] == 1 else
             [(path / "params" / entry, {entry: expected[entry]}) for entry in expected])
    params: dict[str, Any] = {}
    for directory, target in items:
        try:
            params.update(checkpointer.restore(directory, target))
        except Exception as e:
            raise CheckpointError(f"cannot read the tensors of {directory} (truncated or damaged?): "
                                  f"{type(e).__name__}: {e}") from None
    return cfg, _typed(params)


def _with_shardings(cfg, kind: str, abstract, mesh):
    """The abstract tree with each ShapeDtypeStruct carrying its NamedSharding on `mesh` (None: the
    default device, whatever the platform the checkpoint was written on)."""
    from kdtree_jax import sharding  # noqa: PLC0415

    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    mesh = sharding.make_mesh(mesh)
    if kind == "target":
        shardings = sharding.param_shardings(cfg, abstract, mesh)
    else:  # drafters are small and run replicated
        shardings = jax.tree.map(lambda _: sharding.NamedSharding(mesh, sharding.P()), abstract)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _typed(tree):
    """Plain dicts from Orbax's restored tree, every stored INT4 dict {"qweight", "scale"} an Int4Weight."""
    if hasattr(tree, "items"):
        plain = {k: _typed(v) for k, v in tree.items()}
        return Int4Weight.from_dict(plain) if Int4Weight.is_dict(plain) else plain
    return tree


def _flatten(tree) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in key_path): leaf for key_path, leaf in leaves}


def _check_tree(expected, actual, what: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped/mis-typed tensors."""
    exp, act = _flatten(_stored(expected)), _flatten(_stored(actual))
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
