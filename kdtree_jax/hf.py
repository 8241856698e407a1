"""Import Hugging Face DeepSeek-V3 / Kimi K2 / K2-Thinking / K2.5 / K2.6 safetensors checkpoints.

`load_hf(path, dtype)` reads `config.json` and the safetensors shards (through
`model.safetensors.index.json`, or a single `model.safetensors`) with the `safetensors` library and
returns `(ModelConfig, params)` in the tree of docs/params.md. File names and layouts follow the
public checkpoints (Hugging Face transformers `models/deepseek_v3`, compressed-tensors; docs/int4.md):

- HF Linear weights are [out, in]; ours are [in, out], so every linear weight is transposed. The
  params tree keeps `kv_a` whole (columns [0, c) = latent, [c, c+r) = k_pe) and `kv_b` with HF's
  per-head column order (head h: W_UK then W_UV), so no column shuffling is needed.
- Routed experts are stacked into [E, in, out] leaves. compressed-tensors `pack-quantized` experts
  (`weight_packed` / `weight_scale` / `weight_shape`) go straight to `Int4Weight`s
  (`Int4Weight.from_compressed`); dense expert weights are never materialised for them.
- FP8 block-128 checkpoints (`weight` F8_E4M3 + `weight_scale_inv`, DeepSeek-V3 / K2-Instruct) are
  dequantized at load, block by block, into `dtype`.
- Kimi K2.5 / K2.6 (`kimi_k25`) keep the text model under `language_model.`; `vision_tower.*` and
  `mm_projector.*` are skipped, and so is every layer at or past `num_hidden_layers` (MTP modules).

Anything missing, unexpected, mis-shaped, of the wrong dtype, or unreadable (a truncated shard)
raises HFCheckpointError naming the tensor and the file. Checks run on the headers before any
tensor data is read.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, deserialize, safe_open
from tqdm.auto import tqdm

from kdtree_jax import storage
from kdtree_jax.config import ConfigError, ModelConfig
from kdtree_jax.weights import declare
from pallas_kernels.int4 import GROUP_SIZE, PACK_FACTOR, Int4Weight

Params = dict[str, Any]
logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TEXT_PREFIX_K25 = "language_model."  # Kimi K2.5 / K2.6 text-model prefix in the files
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")
FP8_BLOCK = 128

_FLOAT_DTYPES = ("BF16", "F16", "F32")
_NUMPY_DTYPES = {  # safetensors dtype string -> numpy dtype (bf16 / fp8 through ml_dtypes)
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint directory is missing files or tensors, or holds bad ones."""


# ------------------------------------------------------------------------------------------- config
def read_config_json(path: str | Path, what: str, error: type[Exception] = HFCheckpointError) -> tuple[Path, Any]:
    """(config.json's path, its parsed JSON) of a Hugging Face directory (`what`: "checkpoint", "DFlash drafter")."""
    return storage.read_config_json(path, f"Hugging Face {what}", error)


def read_hf_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, raw config.json dict) of a checkpoint directory."""
    config_file, raw = read_config_json(path, "checkpoint")
    try:
        cfg = ModelConfig.from_hf_config(raw)
    except ConfigError as e:
        raise HFCheckpointError(f"{config_file}: {e}") from None
    return cfg, raw


def _is_kimi_k25(raw: Mapping) -> bool:
    return raw.get("model_type") == "kimi_k25" or ("text_config" in raw and "hidden_size" not in raw)


def _quantization(raw: Mapping) -> dict | None:
    """The quantization_config (top level, or inside text_config for K2.5), validated."""
    quant = raw.get("quantization_config")
    if quant is None and isinstance(raw.get("text_config"), Mapping):
        quant = raw["text_config"].get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise HFCheckpointError(f"config.json: quantization_config must be a dict, got {quant!r}")
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        if block != [FP8_BLOCK, FP8_BLOCK]:  # JSON gives a list; anything else is not [128, 128]
            raise HFCheckpointError(f"FP8 weight_block_size {block!r} is not supported (only [128, 128])")
        return dict(quant)
    if method == "compressed-tensors":
        if quant.get("format") != "pack-quantized":
            raise HFCheckpointError(f"compressed-tensors format {quant.get('format')!r} is not supported "
                                    "(only 'pack-quantized', Kimi's INT4 format)")
        groups = quant.get("config_groups", {})
        if not isinstance(groups, Mapping):
            raise HFCheckpointError(f"config.json: quantization_config.config_groups must be a dict of groups, "
                                    f"got {groups!r}")
        for name, group in groups.items():
            if not isinstance(group, Mapping) or not isinstance(group.get("weights") or {}, Mapping):
                raise HFCheckpointError(f"config.json: compressed-tensors config group {name!r} must be a dict "
                                        f"with a 'weights' dict, got {group!r}")
            w = group.get("weights") or {}
            want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": GROUP_SIZE}
            bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
            if bad or w.get("actorder") or group.get("input_activations"):
                raise HFCheckpointError(
                    f"compressed-tensors config group {name!r} is not symmetric INT4 group-32 weight-only "
                    f"(W4A16): unexpected {bad or {'actorder/input_activations': 'set'}}")
        return dict(quant)
    raise HFCheckpointError(f"unsupported quantization_config quant_method {method!r} "
                            "(supported: none, 'fp8' block-128, 'compressed-tensors' pack-quantized INT4)")


# ------------------------------------------------------------------------------------ file listing
@dataclass(frozen=True)
class _TensorInfo:
    file: str  # shard file name
    dtype: str  # safetensors dtype string ("BF16", "I32", ...)
    shape: tuple[int, ...]


def _check_inside(path: Path, index_file: Path, name: str, file: str) -> None:
    """A weight_map entry must name a file inside the model directory: a hostile index could otherwise
    make the loader read any file (`../../x`, `/etc/x`, or a symlink out of the directory)."""
    relative = Path(file)
    if relative.is_absolute() or ".." in relative.parts:
        raise HFCheckpointError(f"{index_file}: weight_map entry {name!r} -> {file!r} leaves the model directory "
                                "(shards must be named relative to it, without '..')")
    target = (path / relative).resolve()
    if target.is_relative_to(path.resolve()):
        return
    # The Hugging Face hub cache links snapshots/<revision>/<file> to blobs/<hash> two levels up: allowed.
    snapshot = path.resolve()
    if snapshot.parent.name == "snapshots" and target.parent == snapshot.parent.parent / "blobs":
        return
    raise HFCheckpointError(f"{index_file}: weight_map entry {name!r} -> {file!r} is a link to {str(target)!r}, "
                            "outside the model directory")


def check_tensor_info(name: str, got: _TensorInfo, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> None:
    """HFCheckpointError unless the header of tensor `name` says `shape` and one of `dtypes`."""
    if got.shape != shape:
        raise HFCheckpointError(f"tensor {name!r} (in {got.file}) has shape {list(got.shape)}, "
                                f"expected {list(shape)} from config.json")
    if got.dtype not in dtypes:
        raise HFCheckpointError(f"tensor {name!r} (in {got.file}) has dtype {got.dtype}, "
                                f"expected one of {list(dtypes)}")


def _list_tensors(path: Path) -> dict[str, _TensorInfo]:
    """Every tensor name -> (shard, dtype, shape), read from the shard headers only."""
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index_file} is malformed (want a 'weight_map' dict): {e!r}") from None
        if not isinstance(weight_map, dict):
            raise HFCheckpointError(f"{index_file}: 'weight_map' must be a dict of tensor name -> shard file, "
                                    f"got {type(weight_map).__name__}")
        first_entry = {}  # shard file -> the first tensor naming it (for messages)
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file:
                raise HFCheckpointError(f"{index_file}: weight_map entry {name!r} must be a shard file name, "
                                        f"got {file!r}")
            first_entry.setdefault(file, name)
        for file, name in first_entry.items():  # once per shard: K2.6 maps ~10^5 tensors to 64 files
            _check_inside(path, index_file, name, file)
        files = sorted(first_entry)
    elif (path / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise HFCheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {str(path)!r}")
    infos: dict[str, _TensorInfo] = {}
    for file in files:
        shard = path / file
        if not shard.is_file():
            assert weight_map is not None  # SINGLE_FILE was found above: a missing shard is one the index names
            missing = sorted(k for k, v in weight_map.items() if v == file)
            raise HFCheckpointError(f"shard {file!r} named in {INDEX_FILE} (for {len(missing)} tensors, "
                                    f"e.g. {missing[0]!r}) does not exist in {str(path)!r}")
        try:
            with safe_open(shard, framework="flax") as f:
                keys = set(f.keys())
                wanted = keys if weight_map is None else {k for k, v in weight_map.items() if v == file}
                for name in sorted(wanted):
                    if name not in keys:
                        raise HFCheckpointError(
                            f"tensor {name!r} is mapped to shard {file!r} by {INDEX_FILE} but is not in it")
                    sl = f.get_slice(name)
                    infos[name] = _TensorInfo(file, sl.get_dtype(), tuple(sl.get_shape()))
        except SafetensorError as e:
            raise HFCheckpointError(f"cannot read shard {str(shard)!r} (truncated or corrupt?): {e}") from None
    return infos


# ---------------------------------------------------------------------------------- the name plan
@dataclass(frozen=True)
class _Linear:
    """One HF Linear `{stem}.weight` [out, in] -> params leaf at `path` ([in, out])."""

    stem: str
    path: tuple[str, ...]
    out_features: int
    in_features: int
    expert: int | None = None  # routed expert index: stacked into [E, in, out] at `path`
    num_experts: int = 0
    float32: bool = False  # the router: kept in float32


@dataclass(frozen=True)
class _Vector:
    """A 1-D / 2-D tensor copied as is (norm weights, score bias, embeddings)."""

    name: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    float32: bool = False


def _plan(cfg: ModelConfig) -> tuple[list[_Linear], list[_Vector]]:
    """Every tensor the text model needs, under canonical (un-prefixed) HF names: one per declared weight
    (kdtree_jax.weights), E per stacked expert weight."""
    linears: list[_Linear] = []
    vectors: list[_Vector] = []
    for path, spec in declare(cfg).items():
        if not spec.hf_linear:
            vectors.append(_Vector(spec.hf, path, spec.shape, float32=spec.float32))
            continue
        *lead, in_features, out_features = spec.shape
        stem = spec.hf.removesuffix(".weight")
        if spec.stacked_experts:
            (num_experts,) = lead
            linears += [_Linear(stem.format(e=e), path, out_features, in_features, e, num_experts)
                        for e in range(num_experts)]
        else:
            linears.append(_Linear(stem, path, out_features, in_features, float32=spec.float32))
    return linears, vectors


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _canonical_names(infos: dict[str, _TensorInfo], cfg: ModelConfig, kimi_k25: bool
                     ) -> tuple[dict[str, str], list[str]]:
    """(canonical name -> file name, skipped file names). Drops vision tensors and MTP layers."""
    canonical, skipped = {}, []
    for name in infos:
        if kimi_k25:
            if name.startswith(NON_TEXT_PREFIXES):
                skipped.append(name)
                continue
            if not name.startswith(TEXT_PREFIX_K25):
                raise HFCheckpointError(
                    f"unexpected tensor {name!r} in a kimi_k25 checkpoint: text weights live under "
                    f"{TEXT_PREFIX_K25!r}, vision weights under {NON_TEXT_PREFIXES}")
            short = name[len(TEXT_PREFIX_K25):]
        else:
            short = name
        layer = _LAYER_RE.match(short)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers:  # MTP / next-n prediction layers
            skipped.append(name)
            continue
        canonical[short] = name
    return canonical, skipped


# ------------------------------------------------------------------------------------ validation
@dataclass
class _Source:
    """How one _Linear is stored: 'dense', 'fp8' or 'int4', with its file tensor names."""

    kind: str
    names: dict[str, str]  # role ('weight', 'scale_inv', 'packed', 'scale', 'shape') -> file name


def _check(cfg: ModelConfig, quant: dict | None, infos: dict[str, _TensorInfo],
           canonical: dict[str, str], prefix: str) -> tuple[dict[_Linear, _Source], list[_Vector]]:
    """Match the files against the plan; raise on missing / extra / mis-shaped / wrong-dtype tensors."""
    linears, vectors = _plan(cfg)
    method = None if quant is None else quant["quant_method"]
    used: set[str] = set()
    missing: list[str] = []

    def info(short: str) -> _TensorInfo | None:
        return infos[canonical[short]] if short in canonical else None

    def expect(short: str, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> str:
        file_name = canonical[short]
        check_tensor_info(file_name, infos[file_name], shape, dtypes)
        used.add(short)
        return file_name

    def original(short: str) -> str:  # the name as it would appear in the files (for messages)
        return prefix + short

    sources: dict[_Linear, _Source] = {}
    for lin in linears:
        shape = (lin.out_features, lin.in_features)
        weight, packed = info(lin.stem + ".weight"), info(lin.stem + ".weight_packed")
        if packed is not None and weight is None:
            if lin.expert is None:
                raise HFCheckpointError(f"tensor {canonical[lin.stem + '.weight_packed']!r} is INT4-packed, but "
                                        "only routed experts may be INT4 (the model keeps this weight dense)")
            if method != "compressed-tensors":
                raise HFCheckpointError(f"tensor {canonical[lin.stem + '.weight_packed']!r} is INT4-packed but "
                                        "config.json has no compressed-tensors quantization_config")
            out, k = shape
            if k % GROUP_SIZE:
                raise HFCheckpointError(f"INT4 expert {lin.stem!r}: input dim {k} is not a multiple of {GROUP_SIZE}")
            names = {}
            for role, suffix, want, dtypes in (
                    ("packed", ".weight_packed", (out, k // PACK_FACTOR), ("I32",)),
                    ("scale", ".weight_scale", (out, k // GROUP_SIZE), _FLOAT_DTYPES),
                    ("shape", ".weight_shape", (2,), ("I32", "I64"))):
                if info(lin.stem + suffix) is None:
                    missing.append(original(lin.stem + suffix))
                    continue
                names[role] = expect(lin.stem + suffix, want, dtypes)
            sources[lin] = _Source("int4", names)
        elif weight is not None:
            if weight.dtype == "F8_E4M3":
                scale_short = lin.stem + ".weight_scale_inv"
                if info(scale_short) is None:
                    missing.append(original(scale_short))
                    continue
                blocks = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
                names = {"weight": expect(lin.stem + ".weight", shape, ("F8_E4M3",)),
                         "scale_inv": expect(scale_short, blocks, ("F32", "BF16"))}
                sources[lin] = _Source("fp8", names)
            else:
                sources[lin] = _Source("dense", {"weight": expect(lin.stem + ".weight", shape, _FLOAT_DTYPES)})
        else:
            missing.append(original(lin.stem + ".weight"))
    for vec in vectors:
        if info(vec.name) is None:
            missing.append(original(vec.name))
        else:
            expect(vec.name, vec.shape, _FLOAT_DTYPES)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise HFCheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the config needs: "
                                f"{missing[:5]}{more}")
    extra = sorted(canonical[s] for s in set(canonical) - used)
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise HFCheckpointError(f"checkpoint has {len(extra)} unexpected tensor(s) for this config: "
                                f"{extra[:5]}{more}")
    if any(s.kind == "fp8" for s in sources.values()) and method != "fp8":
        raise HFCheckpointError("checkpoint holds F8_E4M3 weights but config.json has no fp8 quantization_config")
    # A stacked expert leaf is all-INT4 or all-dense.
    kinds: dict[tuple[str, ...], set[str]] = {}
    for lin, src in sources.items():
        if lin.expert is not None:
            kinds.setdefault(lin.path, set()).add("int4" if src.kind == "int4" else "dense")
    for path, k in kinds.items():
        if len(k) > 1:
            raise HFCheckpointError(f"experts of {'/'.join(path)} mix INT4-packed and dense weights")
    return sources, vectors


# ---------------------------------------------------------------------------------------- loading
class _ShardReader:
    """Reads tensors of one shard as numpy arrays on the host (bf16 / fp8 through ml_dtypes)."""

    def __init__(self, path: Path, infos: dict[str, _TensorInfo]):
        self.path, self.infos = path, infos
        self._raw: dict[str, dict] | None = None
        self._file = None

    def __enter__(self):
        self._file = safe_open(self.path, framework="flax").__enter__()
        return self

    def __exit__(self, *exc):
        assert self._file is not None  # set by __enter__
        self._file.__exit__(*exc)
        self._raw = None

    def get(self, name: str) -> np.ndarray:
        info = self.infos[name]
        if info.dtype == "F8_E4M3":
            # safetensors' numpy/flax bindings cannot materialise F8 here; take the raw bytes through
            # safetensors.deserialize (whole shard, once) and view them with ml_dtypes.
            if self._raw is None:
                self._raw = {k: v for k, v in deserialize(self.path.read_bytes())}
            data = self._raw[name]["data"]
            return np.frombuffer(bytes(data), _NUMPY_DTYPES["F8_E4M3"]).reshape(info.shape)
        assert self._file is not None  # reads happen inside the reader's `with` block
        try:
            with jax.default_device(jax.devices("cpu")[0]):
                return np.asarray(self._file.get_tensor(name))
        except SafetensorError as e:
            raise HFCheckpointError(f"cannot read tensor {name!r} from {str(self.path)!r}: {e}") from None


def _dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """DeepSeek FP8: W = weight * scale_inv per 128x128 block (edge blocks cut). -> float32 [out, in]."""
    out, inp = weight.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:out, :inp]
    return weight.astype(np.float32) * scale


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class HFImport:
    """A checked Hugging Face checkpoint, loaded one top-level params entry at a time.

    `open_hf` runs every header check; then `load(key)` or iteration yields `(key, subtree)` for
    `entries` = embed_tokens, layers_0 .. layers_{L-1}, final_norm[, lm_head], so a converter holds about
    one layer in host memory, never the whole model. Shards stay open only while a later entry still
    needs them.
    """

    progress_bar: tqdm | None = None  # a tqdm bar that counts tensors as they are read (load_hf sets one)

    def __init__(self, path: Path, cfg: ModelConfig, raw: dict, dtype, infos: dict[str, _TensorInfo],
                 canonical: dict[str, str], sources: dict, vectors: list):
        self.path, self.cfg, self.raw, self.dtype = path, cfg, raw, jnp.dtype(dtype)
        self._infos, self._canonical = infos, canonical
        self.entries: tuple[str, ...] = ("embed_tokens", *(f"layers_{i}" for i in range(cfg.num_hidden_layers)),
                                      "final_norm", *(() if cfg.tie_word_embeddings else ("lm_head",)))
        # key -> [(kind, item, source)]: what to read for that entry
        self._items: dict[str, list[tuple[str, Any, Any]]] = {k: [] for k in self.entries}
        for lin, src in sources.items():
            self._items[lin.path[0]].append(("linear", lin, src))
        for vec in vectors:
            self._items[vec.path[0]].append(("vector", vec, None))
        # INT4 stacked experts: "layers_1/moe/experts/gate" -> scale dtype name of the params leaf
        self.int4_leaves: dict[str, str] = {}
        for lin, src in sources.items():
            if src.kind == "int4":
                self.int4_leaves["/".join(lin.path)] = self._int4_scale_dtype(src).name
        self.num_tensors = sum(len(v) for v in self._items.values())

    def _files(self, key: str) -> set[str]:
        files = set()
        for kind, item, src in self._items[key]:
            names = [self._canonical[item.name]] if kind == "vector" else list(src.names.values())
            files.update(self._infos[n].file for n in names)
        return files

    def _int4_scale_dtype(self, src) -> np.dtype:
        scale_dtype = _NUMPY_DTYPES[self._infos[src.names["scale"]].dtype]
        # an Int4Weight takes bf16 or f32 scales; f16 -> f32 is exact
        return np.dtype(np.float32) if scale_dtype == np.float16 else scale_dtype

    def __iter__(self):
        """Yield (key, subtree) in `entries` order; subtrees are jax arrays like load_hf's."""
        last_use = {}
        for i, key in enumerate(self.entries):
            for file in self._files(key):
                last_use[file] = i
        readers: dict[str, _ShardReader] = {}
        try:
            for i, key in enumerate(self.entries):
                yield key, self._load(key, readers)
                for file in [f for f, last in last_use.items() if last == i and f in readers]:
                    readers.pop(file).__exit__(None, None, None)
        finally:
            for reader in readers.values():
                reader.__exit__(None, None, None)

    def load(self, key: str):
        """The params subtree `key` (one of `entries`)."""
        if key not in self._items:
            raise KeyError(f"{key!r} is not a top-level params entry of this model (entries: {self.entries[0]} .. "
                           f"{self.entries[-1]})")
        readers: dict[str, _ShardReader] = {}
        try:
            return self._load(key, readers)
        finally:
            for reader in readers.values():
                reader.__exit__(None, None, None)

    def _load(self, key: str, readers: dict[str, _ShardReader]):
        def get(name: str) -> np.ndarray:
            file = self._infos[name].file
            if file not in readers:
                readers[file] = _ShardReader(self.path / file, self._infos).__enter__()
            return readers[file].get(name)

        np_dtype = np.dtype(self.dtype)
        params: Params = {}
        stacks: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
        for kind, item, src in self._items[key]:
            if kind == "vector":
                value = get(self._canonical[item.name]).astype(np.float32 if item.float32 else np_dtype)
                _set(params, item.path, value)
            else:
                _load_linear(get, item, src, np_dtype, stacks, params, self)
            if self.progress_bar is not None:
                self.progress_bar.update(1)
        for stack_path, buffers in stacks.items():
            if "dense" in buffers:
                _set(params, stack_path, buffers["dense"])
            else:
                _set(params, stack_path, Int4Weight.from_compressed(jnp.asarray(buffers["packed"]),
                                                                    jnp.asarray(buffers["scale"])))
        return jax.tree.map(jnp.asarray, params[key])


def float_dtype(dtype) -> jnp.dtype:
    """`dtype` as a floating jnp dtype; HFCheckpointError for anything else (the dtype an import converts to)."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise HFCheckpointError(f"dtype must be a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise HFCheckpointError(f"dtype must be a floating dtype, got {dtype}")
    return dtype


def open_hf(path: str | Path, dtype=jnp.bfloat16) -> HFImport:
    """Check a Hugging Face DeepSeek-V3 / Kimi K2.x checkpoint directory (config and every shard
    header; no tensor data is read) and return an HFImport that loads it entry by entry.
    Raises HFCheckpointError for a bad directory, config or tensor."""
    path = Path(path)
    dtype = float_dtype(dtype)
    cfg, raw = read_hf_config(path)
    quant = _quantization(raw)
    infos = _list_tensors(path)
    kimi_k25 = _is_kimi_k25(raw)
    canonical, skipped = _canonical_names(infos, cfg, kimi_k25)
    if skipped:
        logger.info("%s: skipping %d vision / MTP tensors (e.g. %s)", path, len(skipped), skipped[0])
    sources, vectors = _check(cfg, quant, infos, canonical, TEXT_PREFIX_K25 if kimi_k25 else "")
    return HFImport(path, cfg, raw, dtype, infos, canonical, sources, vectors)


def load_hf(path: str | Path, dtype=jnp.bfloat16, *, progress: bool = True) -> tuple[ModelConfig, Params]:
    """Load a Hugging Face DeepSeek-V3 / Kimi K2.x checkpoint directory.

    Returns (cfg, params): params as in docs/params.md, weights in `dtype` (router and its bias in
    float32; INT4 experts as INT4 leaves with the file's scale dtype). FP8 weights are dequantized.
    Raises HFCheckpointError for a bad directory, config or tensor.
    """
    hf = open_hf(path, dtype)
    with tqdm(total=hf.num_tensors, desc=f"loading {hf.path.name}", unit="tensor", disable=not progress) as bar:
        hf.progress_bar = bar
        try:
            params = dict(hf)
        finally:
            hf.progress_bar = None
    return hf.cfg, params


def _load_linear(get, lin: _Linear, src: _Source, np_dtype: np.dtype, stacks: dict, params: Params,
                 hf: HFImport) -> None:
    """Read one HF linear through `get(file tensor name)` into params (or into its expert stack)."""
    if lin.expert is not None and lin.path not in stacks:  # first expert of a stack: allocate it
        E, out, k = lin.num_experts, lin.out_features, lin.in_features
        if src.kind == "int4":
            stacks[lin.path] = {"packed": np.empty((E, out, k // PACK_FACTOR), np.int32),
                                "scale": np.empty((E, out, k // GROUP_SIZE), hf._int4_scale_dtype(src))}
        else:
            stacks[lin.path] = {"dense": np.empty((E, k, out), np_dtype)}
    if src.kind == "int4":
        packed = get(src.names["packed"])  # int32 [N, K/8]
        scale = get(src.names["scale"])  # [N, K/32]
        shape = get(src.names["shape"])
        want = (lin.out_features, lin.in_features)
        if tuple(int(s) for s in shape) != want:
            raise HFCheckpointError(f"tensor {src.names['shape']!r} says the weight is {shape.tolist()}, "
                                    f"expected {list(want)} from config.json")
        buffers = stacks[lin.path]
        buffers["packed"][lin.expert] = packed
        buffers["scale"][lin.expert] = scale.astype(buffers["scale"].dtype)
        return
    if src.kind == "fp8":
        weight = _dequantize_fp8(get(src.names["weight"]), get(src.names["scale_inv"]))
    else:
        weight = get(src.names["weight"])  # [out, in]
    if lin.expert is not None:
        stacks[lin.path]["dense"][lin.expert] = weight.T
    else:
        _set(params, lin.path, weight.T.astype(np.float32 if lin.float32 else np_dtype))
