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
an `Int4Weight`. This module converts at the boundary (`to_stored` on the way out, `typed_from_stored` on the way in),
so every checkpoint written before the typed weights loads unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kdtree_jax import sharding, storage
from kdtree_jax.config import ModelConfig
from kdtree_jax.drafter import DrafterConfig, init_drafter_params
from kdtree_jax.storage import CheckpointError
from kdtree_jax.weights import abstract_params, cast_params
from pallas_kernels.int4 import GROUP_SIZE, Int4Weight, MosaicInt4Weight

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
# The float dtypes weights are written in (the router stays float32, INT4 leaves are typed nodes).
PARAM_DTYPES = ("bfloat16", "float16", "float32")


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


def to_stored(tree):
    """The tree as the files hold it: every Int4Weight as its dict {"qweight", "scale"}."""
    return jax.tree.map(lambda x: x.to_dict() if isinstance(x, Int4Weight) else x, tree,
                        is_leaf=lambda x: isinstance(x, Int4Weight))


class CheckpointWriter:
    """Writes a checkpoint entry by entry into a temporary sibling directory; `commit()` checks the
    written tensor index against the config's abstract tree, then renames it into place. Any failure
    or interrupt before that (use it as a context manager) removes the temporary directory, so a
    half-written checkpoint never appears at `path`. The writer holds an exclusive lock on `path`
    from construction to commit/abort and records a sha256 per tensor (kdtree_jax.storage).
    overwrite replaces only a kdtree-jax checkpoint; `inputs` ({description: path}) may be neither
    `path` nor inside it.

        with CheckpointWriter(path, cfg, param_dtype="bfloat16") as w:
            for entry, subtree in ...:    # in any order; every entry of w.entries exactly once
                w.write(entry, subtree)
    """

    def __init__(self, path: str | os.PathLike, cfg, *, param_dtype, quantization: dict | None = None,
                 overwrite: bool = False, inputs: Mapping[str, str | os.PathLike] = {}):
        self.path = check_destination(path, overwrite=overwrite, inputs=inputs)  # fail early, nothing touched
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
        self.checksums: dict[str, str] = {}  # tensor name -> sha256 of its bytes
        self.overwrite = overwrite
        self._tmp = storage.new_temporary(self.path)
        self._checkpointer = ocp.StandardCheckpointer()
        self._state = "open"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = storage.WriteLock(self.path)
        with storage.deferred_interrupts():  # a Ctrl-C here must not leave the lock or the temporary behind
            self._lock.acquire()
            try:
                storage.prepare_write(self.path)  # finish an interrupted commit, drop dead writers' temporaries
                check_destination(self.path, overwrite=overwrite, inputs=inputs)  # again, now under the lock
                (self._tmp / "params").mkdir(parents=True)
            except BaseException:
                self._state = "aborted"
                storage.remove_tree(self._tmp)
                self._lock.release()
                raise

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
        stored = to_stored({entry: subtree})
        self._checkpointer.save(self._tmp / "params" / entry, stored)
        self.checksums.update(storage.checksums(storage.flat_tensors(stored)))  # while Orbax writes
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
        self.meta["checksums"] = {"algorithm": storage.CHECKSUM_ALGORITHM,
                                  "tensors": dict(sorted(self.checksums.items()))}
        (self._tmp / "config.json").write_text(json.dumps(self.meta, indent=2))
        storage.commit(self._tmp, self.path, replace=self.overwrite)
        self._state = "committed"
        self._lock.release()
        return self.path

    def abort(self) -> None:
        """Drop everything written so far and release the lock (idempotent)."""
        if self._state == "open":
            self._state = "aborted"
        with storage.deferred_interrupts(), storage.quiet_tensor_io():
            # A save still running in Orbax's background threads would write into what we remove. Its
            # failure is why we abort: the caller already has the real error.
            with contextlib.suppress(Exception):
                self._checkpointer.wait_until_finished()
            storage.wait_for_background_saves()
            storage.remove_tree_settled(self._tmp)
            self._lock.release()

    def __enter__(self) -> CheckpointWriter:
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
    path = check_destination(path, overwrite=overwrite)
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


def check_destination(path: str | os.PathLike, *, overwrite: bool = False,
                      inputs: Mapping[str, str | os.PathLike] = {}) -> Path:
    """The normalised path a checkpoint would be written at, or CheckpointError when it exists (without
    overwrite), holds anything but a kdtree-jax checkpoint (with overwrite), or is or contains one of
    `inputs` ({description: path})."""
    return storage.check_destination(path, overwrite=overwrite, read_meta=read_checkpoint_meta, inputs=inputs)


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The config.json of a checkpoint directory (kind, config, param_dtype, quantization, format)."""
    config_file, meta = storage.read_config_json(path, "kdtree-jax checkpoint", CheckpointError)
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS or meta.get("kind") not in _KINDS:
        got = meta if not isinstance(meta, dict) else (meta.get("format"), meta.get("kind"))
        raise CheckpointError(f"{config_file}: unsupported checkpoint format / kind {got!r} "
                              f"(readable formats {READABLE_FORMATS}, kinds {sorted(_KINDS)})")
    return meta


def _item_metadata(directory: Path):
    try:
        with storage.quiet_tensor_io():
            item = ocp.StandardCheckpointer().metadata(directory).item_metadata
    except Exception as e:  # noqa: BLE001 (orbax raises many types for damaged directories)
        raise CheckpointError(f"cannot read the tensor index of {directory}: {e}") from None
    if item is None:  # Orbax returns None (after logging a warning) when its index files are damaged
        raise CheckpointError(f"cannot read the tensor index of {directory}: its Orbax metadata files are "
                              "missing or damaged")
    return item.tree


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
    if meta.get("param_dtype") not in PARAM_DTYPES:
        raise CheckpointError(f"{path / 'config.json'}: param_dtype {meta.get('param_dtype')!r} is not one of "
                              f"{list(PARAM_DTYPES)}")
    return cfg, meta


def checkpoint_index(path: str | os.PathLike, *, expect_kind: str | None = None):
    """(cfg, meta, index) of a checkpoint without reading any tensor data: `index` is the tree of the
    stored tensors' shapes and dtypes, checked against the config (CheckpointError names a mismatch)."""
    path = Path(path).absolute()
    cfg, meta = checkpoint_config(path, expect_kind=expect_kind)
    expected = _KINDS[meta["kind"]][2](cfg, jnp.dtype(meta["param_dtype"]), meta)
    index = _saved_index(path, meta, expected)
    _check_tree(expected, index, f"checkpoint {path}")
    return cfg, meta, index


def load_checkpoint(path: str | os.PathLike, *, expect_kind: str | None = None, mesh=None, verify: bool = True,
                    dtype=None):
    """Restore (cfg, params). Every tensor the config implies must be present with the right shape
    and dtype, and nothing else may be there; otherwise CheckpointError names the tensors.

    dtype: None keeps the dtype the checkpoint was written with; e.g. float32 runs a bf16-stored checkpoint in
    float32 (dense weights cast after the restore, kdtree_jax.weights.cast_params: the router stays float32,
    INT4 weights and their scales as stored).

    verify: check every tensor's bytes against the sha256 recorded at save (CheckpointError naming a
    corrupt tensor); False skips it (trusted storage: hashing costs about a second per GB). A checkpoint
    written before checksums were recorded loads with an UnverifiedCheckpointWarning.

    mesh (a jax Mesh or a spec like "expert=2,tensor=1"): every array is restored straight into its
    NamedSharding (kdtree_jax.sharding; a drafter is replicated), each device reading only its own
    shard, so the whole model never sits on one device or the host. MeshError when the mesh does not
    divide the model."""
    path = Path(path).absolute()  # Orbax needs absolute paths
    storage.recover(path)  # finish or roll back an interrupted commit of path (with a warning)
    cfg, meta = checkpoint_config(path, expect_kind=expect_kind)
    checksums = _recorded_checksums(path, meta) if verify else None
    if verify and checksums is None:
        warnings.warn(f"{path} carries no tensor checksums (written before kdtree-jax recorded them): its "
                      "tensors are loaded unverified", storage.UnverifiedCheckpointWarning, stacklevel=2)
    expected = _KINDS[meta["kind"]][2](cfg, jnp.dtype(meta["param_dtype"]), meta)
    _check_tree(expected, _saved_index(path, meta, expected), f"checkpoint {path}")
    # Every leaf gets an explicit sharding: Orbax otherwise rebuilds the one stored at save time (e.g.
    # "cpu:0" for the shipped pair) and refuses to restore on another platform ("Topology mismatch").
    expected = _with_shardings(cfg, meta["kind"], expected, mesh)
    params: dict[str, Any] = {}
    for restored in _restore(path, meta, expected, checksums):
        params.update(restored)
    params = typed_from_stored(params)
    if dtype is not None:
        params = cast_params(params, dtype, cfg if meta["kind"] == "target" else None)
    return cfg, params


def verify_checkpoint(path: str | os.PathLike) -> dict[str, int]:
    """Read every tensor of a checkpoint (one params entry at a time, on the default device) and check
    its bytes against the recorded sha256; {"tensors": count, "bytes": total}. CheckpointError names
    the first corrupt tensor, or says the checkpoint carries no checksums."""
    path = Path(path).absolute()
    storage.recover(path)
    cfg, meta = checkpoint_config(path)
    checksums = _recorded_checksums(path, meta)
    if checksums is None:
        raise CheckpointError(f"{path} carries no tensor checksums (written before kdtree-jax recorded them): "
                              "there is nothing to verify its tensors against")
    expected = _KINDS[meta["kind"]][2](cfg, jnp.dtype(meta["param_dtype"]), meta)
    _check_tree(expected, _saved_index(path, meta, expected), f"checkpoint {path}")
    expected = _with_shardings(cfg, meta["kind"], expected, None)
    count = nbytes = 0
    for restored in _restore(path, meta, expected, checksums):
        leaves = jax.tree.leaves(restored)
        count += len(leaves)
        nbytes += sum(leaf.nbytes for leaf in leaves)
    if count != len(checksums):  # every recorded tensor must have been read and matched
        raise CheckpointError(f"{path}: {len(checksums)} checksums recorded but {count} tensors read")
    return {"tensors": count, "bytes": nbytes}


def _recorded_checksums(path: Path, meta: dict) -> dict[str, str] | None:
    """{tensor name: sha256} from config.json, None for checkpoints written before they were recorded."""
    record = meta.get("checksums")
    if record is None:
        return None
    if (not isinstance(record, dict) or record.get("algorithm") != storage.CHECKSUM_ALGORITHM
            or not isinstance(record.get("tensors"), dict)):
        raise CheckpointError(f"{path / 'config.json'}: 'checksums' must be {{'algorithm': "
                              f"'{storage.CHECKSUM_ALGORITHM}', 'tensors': {{name: hex digest}}}}, got {record!r:.200}")
    return record["tensors"]


def _restore(path: Path, meta: dict, expected, checksums: dict[str, str] | None) -> Iterator[dict]:
    """Restore the Orbax items of a checkpoint one at a time (against `expected`, with shardings) and
    check each against `checksums` (None: unchecked)."""
    checkpointer = ocp.StandardCheckpointer()
    expected = to_stored(expected)
    items = ([(path / "params", expected)] if meta["format"] == 1 else
             [(path / "params" / entry, {entry: expected[entry]}) for entry in expected])
    for directory, target in items:
        try:
            with storage.quiet_tensor_io():  # a damaged item makes asyncio log every failed read's traceback
                restored = checkpointer.restore(directory, target)
        except Exception as e:  # noqa: BLE001 (TensorStore/Orbax raise many types for damaged data)
            raise CheckpointError(storage.read_error_message(e, directory)) from None
        if checksums is not None:
            storage.verify_checksums(storage.flat_tensors(restored), checksums, f"checkpoint {path}")
        yield restored


def _with_shardings(cfg, kind: str, abstract, mesh):
    """The abstract tree with each ShapeDtypeStruct carrying its NamedSharding on `mesh` (None: the
    default device, whatever the platform the checkpoint was written on)."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    mesh = sharding.make_mesh(mesh)
    if kind == "target":
        shardings = sharding.param_shardings(cfg, abstract, mesh)
    else:  # drafters are small and run replicated
        shardings = jax.tree.map(lambda _: sharding.NamedSharding(mesh, sharding.P()), abstract)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def typed_from_stored(tree: Any) -> Any:
    """Plain dicts from Orbax's restored tree, every stored INT4 dict {"qweight", "scale"} an Int4Weight."""
    if hasattr(tree, "items"):
        plain = {k: typed_from_stored(v) for k, v in tree.items()}
        return Int4Weight.from_dict(plain) if Int4Weight.is_dict(plain) else plain
    return tree


def _flatten(tree) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in key_path): leaf for key_path, leaf in leaves}


def _check_tree(expected, actual, what: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped/mis-typed tensors."""
    exp, act = _flatten(to_stored(expected)), _flatten(to_stored(actual))
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
