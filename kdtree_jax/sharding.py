"""Sharding the target over several devices with JAX's own SPMD machinery (docs/sharding.md).

The layout is declared once: every weight has logical axis names (declared with the weight in
kdtree_jax/weights.py, read by `param_logical_axes`), and `RULES` maps logical names to the two mesh axes

    expert  routed experts (packed INT4 weights and their scales alike) are split over it;
    tensor  MLA heads, the shared expert, the dense MLP and every expert's intermediate dim;
    both    the vocabulary of embed_tokens and lm_head is split over every device.

Everything else (norms, router, the q/kv LoRA down-projections) and the latent KV cache are
replicated: the MLA latent is shared by all heads, so splitting heads does not shrink it.

    mesh = make_mesh("expert=2,tensor=1")          # or make_mesh({"expert": 2})
    params = shard_params(cfg, params, mesh)       # or load_checkpoint(path, mesh=mesh)
    out = kj.generate(cfg, params, prompts, mesh=mesh)

Inside a jit traced under `jax.set_mesh(mesh)` (generate does that), `active_mesh()` returns the mesh
and the model runs its MoE and attention per shard in `jax.shard_map`; without one it is the plain
single-device code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kdtree_jax.config import ModelConfig
from kdtree_jax.weights import logical_axes
from pallas_kernels.int4 import GROUP_SIZE, Int4Weight, MosaicInt4Weight, is_quantized

EXPERT, TENSOR = "expert", "tensor"
AXES = (EXPERT, TENSOR)  # mesh axis order: tensor is the inner one (neighbouring devices)

# logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated)
RULES: dict[str, Any] = {
    "vocab": (EXPERT, TENSOR),
    "experts": EXPERT,
    "heads": TENSOR,
    "mlp": TENSOR,
    "embed": None,
    "q_lora": None,
    "latent": None,
    "router": None,
    "norm": None,
}

class MeshError(ValueError):
    """A mesh spec is malformed, needs more devices than exist, or does not divide the model."""


# ---------------------------------------------------------------------------------------- meshes
def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """"expert=2,tensor=1" (or a dict) -> {"expert": 2, "tensor": 1}; an axis left out has size 1."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            name, eq, size = part.partition("=")
            if not eq or not size.lstrip("+").isdigit():
                raise MeshError(f"bad mesh spec {spec!r}: want comma-separated AXIS=SIZE with axes {AXES}, "
                                f"e.g. 'expert=2,tensor=1' (got {part!r})")
            items.append((name, int(size)))
    else:
        raise MeshError(f"mesh must be a spec string like 'expert=2,tensor=1', a dict or a jax Mesh, "
                        f"got {type(spec).__name__}")
    sizes = {axis: 1 for axis in AXES}
    seen = set()
    for name, size in items:
        if name not in AXES:
            raise MeshError(f"unknown mesh axis {name!r} in {spec!r}: the axes are {AXES}")
        if name in seen:
            raise MeshError(f"mesh axis {name!r} is given twice in {spec!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh axis {name}={size!r} must be a positive integer")
        seen.add(name)
        sizes[name] = size
    return sizes


def make_mesh(spec: str | Mapping[str, int] | Mesh, devices=None) -> Mesh:
    """A `Mesh` with axes ("expert", "tensor") over the first expert*tensor of `devices` (default:
    jax.devices(), every host's devices after jax.distributed.initialize()). A Mesh passes through
    after its axis names are checked. Axis types are Auto: XLA propagates shardings from the params."""
    if isinstance(spec, Mesh):
        if set(spec.axis_names) != set(AXES):
            raise MeshError(f"the mesh must have the axes {AXES}, got {spec.axis_names}")
        return spec
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    needed = math.prod(sizes.values())
    if needed > len(devices):
        raise MeshError(f"mesh {describe(sizes)} needs {needed} devices, but only {len(devices)} are available "
                        f"({devices[0].platform if devices else 'none'})")
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices[:needed])


def describe(mesh) -> str:
    """"expert=2,tensor=4" for a Mesh, AbstractMesh or a sizes dict."""
    sizes = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
    return ",".join(f"{a}={sizes.get(a, 1)}" for a in AXES)


def active_mesh() -> AbstractMesh | None:
    """The mesh of the surrounding `jax.set_mesh` when it has our axes (at trace time), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return None
    return mesh


# ------------------------------------------------------------------------------------- logical axes
def param_logical_axes(path: tuple[str, ...], ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the dense params leaf at `path` (e.g. ("layers_1", "moe", "experts", "gate")), as
    declared in kdtree_jax/weights.py; an undeclared leaf is an error."""
    axes = logical_axes(path)
    if axes is None:
        raise MeshError(f"no sharding rule for the params leaf {'/'.join(path)}: declare the weight in "
                        "kdtree_jax/weights.py")
    if len(axes) != ndim:
        raise MeshError(f"params leaf {'/'.join(path)} has {ndim} dims, its sharding rule {axes} names {len(axes)}")
    return axes


def spec(*logical: str | None, rules: Mapping[str, Any] = RULES) -> P:
    """PartitionSpec of an array whose dims have these logical names (None: replicated dim)."""
    return P(*(None if name is None else rules[name] for name in logical))


def leaf_spec(path: tuple[str, ...], leaf) -> Any:
    """P for a dense leaf; for a typed INT4 weight the same type holding one P per array: an Int4Weight's
    [..., N, K/4] and [..., N, K/32] arrays carry the dense [..., K, N] weight's last two logical axes
    swapped; a MosaicInt4Weight's int4 [..., N, K] likewise, its scales [..., K/32, N] the dense order."""
    if isinstance(leaf, Int4Weight):
        *lead, k_axis, n_axis = param_logical_axes(path, len(leaf.dense_shape))
        swapped = spec(*lead, n_axis, k_axis)
        return Int4Weight(swapped, swapped)
    if isinstance(leaf, MosaicInt4Weight):
        *lead, k_axis, n_axis = param_logical_axes(path, len(leaf.dense_shape))
        return MosaicInt4Weight(spec(*lead, n_axis, k_axis), spec(*lead, k_axis, n_axis))
    return spec(*param_logical_axes(path, len(leaf.shape)))


def _keys(key_path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in key_path)


def param_specs(params_or_abstract) -> Any:
    """The PartitionSpec tree of a target params tree (arrays or ShapeDtypeStructs; INT4 aware)."""
    return jax.tree_util.tree_map_with_path(lambda kp, leaf: leaf_spec(_keys(kp), leaf), params_or_abstract,
                                            is_leaf=is_quantized)


def param_shardings(cfg: ModelConfig, params_or_abstract, mesh: Mesh) -> Any:
    """A NamedSharding per params leaf (same tree structure), after `check_mesh`."""
    check_mesh(cfg, mesh, params_or_abstract)
    specs = param_specs(params_or_abstract)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(cfg: ModelConfig, params, mesh: Mesh):
    """Place a params tree on the mesh (a no-op for leaves already there). For models that do not fit
    one device, restore straight into the shardings instead: load_checkpoint(path, mesh=mesh)."""
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def replicate(tree, mesh: Mesh):
    """Every array leaf of `tree` copied to all devices of the mesh (drafter params, small state)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """with_sharding_constraint by logical axis names under an active mesh; identity otherwise."""
    if active_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec(*logical))


# ------------------------------------------------------------------------------------------ checks
def _mesh_size(sizes: Mapping[str, int], axes) -> int:
    if axes is None:
        return 1
    return math.prod(sizes.get(a, 1) for a in ((axes,) if isinstance(axes, str) else axes))


def check_mesh(cfg: ModelConfig, mesh, params_or_abstract=None) -> None:
    """Raise MeshError naming the config field (or params leaf) that the mesh does not divide.
    `mesh` is a Mesh, AbstractMesh or {"expert": e, "tensor": t}."""
    sizes = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
    if set(sizes) != set(AXES):
        raise MeshError(f"the mesh must have the axes {AXES}, got {tuple(sizes)}")
    expert, tensor = sizes[EXPERT], sizes[TENSOR]
    where = f"mesh {describe(sizes)}"
    has_moe = any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    has_dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    needs = []
    if has_moe:
        needs += [("n_routed_experts", cfg.n_routed_experts, "expert", expert),
                  ("moe_intermediate_size", cfg.moe_intermediate_size, "tensor", tensor)]
        if cfg.n_shared_experts:
            needs.append(("shared_intermediate_size", cfg.shared_intermediate_size, "tensor", tensor))
    if has_dense:
        needs.append(("intermediate_size", cfg.intermediate_size, "tensor", tensor))
    needs += [("num_attention_heads", cfg.num_attention_heads, "tensor", tensor),
              ("vocab_size", cfg.vocab_size, "expert*tensor", expert * tensor)]
    for field, value, axis, size in needs:
        if value % size:
            raise MeshError(f"{where} does not divide the model: {field}={value} is not divisible by "
                            f"{axis}={size}")
    if params_or_abstract is None:
        return
    # every sharded dim of every leaf (INT4 scales hold K/32 columns: a row split needs K/32 % t == 0)
    flat = jax.tree_util.tree_flatten_with_path(params_or_abstract, is_leaf=is_quantized)[0]
    for key_path, leaf in flat:
        path = _keys(key_path)
        specs = leaf_spec(path, leaf)
        if is_quantized(leaf):  # one (array, P) per field of the typed weight
            fields = [f.name for f in dataclasses.fields(leaf)]
            arrays = {f"/{f}": (getattr(leaf, f), getattr(specs, f)) for f in fields}
        else:
            arrays = {"": (leaf, specs)}
        for suffix, (array, leaf_p) in arrays.items():
            for dim, (extent, axes) in enumerate(zip(array.shape, tuple(leaf_p) + (None,) * array.ndim, strict=False)):
                n = _mesh_size(sizes, axes)
                if extent % n:
                    hint = (f" (INT4 scales hold K/{GROUP_SIZE} groups per row)" if suffix.startswith("/scale")
                            else "")
                    raise MeshError(f"{where} does not divide the model: {'/'.join(path)}{suffix} dim {dim} of "
                                    f"size {extent} is split over {axes} = {n} devices{hint}")


def params_bytes_per_device(params_or_abstract, mesh) -> int:
    """Bytes of the params tree that one device holds under the layout (for docs and benchmarks)."""
    sizes = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
    specs = jax.tree.leaves(param_specs(params_or_abstract), is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(params_or_abstract)
    total = 0
    for leaf, leaf_p in zip(leaves, specs, strict=True):
        split = math.prod(_mesh_size(sizes, a) for a in leaf_p)
        bits = 4 if np.dtype(leaf.dtype) == np.dtype(jax.numpy.int4) else 8 * np.dtype(leaf.dtype).itemsize
        total += int(np.prod(leaf.shape, dtype=np.int64)) * bits // 8 // split
    return total
