"""Test helpers: random models with every path exercised, and the relative-error metric."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np

import kdtree_jax as kj

# Stand-in devices for the kernel choosers (pallas_kernels.dispatch reads only platform, compute capability and name).
CPU = types.SimpleNamespace(platform="cpu", device_kind="cpu")
H200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
A100 = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")


def abstract_h200():
    """A context in which jitted functions trace and lower for an H200 without one (CUDA lowering on a CPU)."""
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


def lower_for_h200(fn, *args) -> str:
    """`fn` jitted and lowered for an abstract H200 (`abstract_h200`) at these argument shapes: the program as text."""
    with abstract_h200():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text: str) -> list[str]:
    """The custom-call targets of a lowered program's text, in order (Mosaic GPU: "mosaic_gpu_v2")."""
    return re.findall(r"custom_call @(\w+)", text)


# The one tiny config every test file starts from (conftest's `tiny_cfg` / `small_cfg` fixtures return these;
# module constants in parametrize decorators import them from here).
TINY = kj.ModelConfig.tiny()
SMALL = TINY.replace(num_hidden_layers=2)  # one dense layer, one MoE layer


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-300))


def random_params(cfg: kj.ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """init_params plus random norm weights and router biases (they init to 1 / 0, which would leave
    those code paths untested)."""
    params = kj.init_params(cfg, jax.random.key(seed), dtype=dtype)
    rng = np.random.default_rng(seed + 1000)

    def perturb(path, leaf):
        name = jax.tree_util.keystr(path)
        if name.endswith("norm']"):
            return jnp.asarray(1.0 + 0.2 * rng.standard_normal(leaf.shape), leaf.dtype)
        if name.endswith("router_bias']"):
            return jnp.asarray(0.5 * rng.standard_normal(leaf.shape), leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(perturb, params)


# generate's progress on stderr: "kdtree-jax: loading the target ... 1.2 s" (open while the step runs), or
# "kdtree-jax: loading the target ..." and later "kdtree-jax: loading the target: 1.2 s" when a note came between
PROGRESS = re.compile(r"kdtree-jax: ((?:loading|compiling|generating) [^:]*?)"
                      r"(?: \.\.\.| \.\.\. (?P<t>\d+(?:\.\d)? m?s)|: (?P<t2>\d+(?:\.\d)? m?s))")


def error_lines(err: str) -> list[str]:
    """stderr without generate's progress lines."""
    return [line for line in err.strip().splitlines() if not PROGRESS.fullmatch(line)]
