"""Shared test setup: float32 matmuls at full precision on every backend, the markers, and the tiny models."""

from pathlib import Path

import jax
import pytest
from helpers import SMALL, TINY, random_params

import kdtree_jax as kj

jax.config.update("jax_default_matmul_precision", "highest")

KERNELS = Path(__file__).parent / "kernels"


def pytest_configure(config):
    # gpu and slow are declared in pyproject.toml; kernels is set here by path (see below)
    config.addinivalue_line("markers", "kernels: a kernel test (tests/kernels/); runs natively on a GPU host")


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU; this machine has none (CPU-only CI)")
    for item in items:
        # a GPU host runs `pytest -m "gpu or kernels"`: the kernel tests there run natively, not interpreted
        if KERNELS in Path(item.fspath).parents:
            item.add_marker(pytest.mark.kernels)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture
def matmul_precision():
    """jax_default_matmul_precision as the test found it, restored after it (for tests that change it process-wide,
    as `generate --matmul-precision` does)."""
    before = jax.config.jax_default_matmul_precision
    yield before
    jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="session")
def tiny_cfg():
    """ModelConfig.tiny(): 6 layers (layer 0 dense, 1-5 MoE), vocabulary 400."""
    return TINY


@pytest.fixture(scope="session")
def small_cfg():
    """tiny with 2 layers: one dense, one MoE."""
    return SMALL


@pytest.fixture(scope="session")
def tiny_params():
    """random_params(TINY, seed=0), float32; built once for every file that uses it (treat as read-only)."""
    return random_params(TINY, seed=0)


@pytest.fixture(scope="session")
def small_params():
    """random_params(SMALL, seed=0), float32 (read-only)."""
    return random_params(SMALL, seed=0)


@pytest.fixture(scope="session")
def small_init_params():
    """kj.init_params(SMALL, key(0)), float32: unit norms, zero router bias (read-only)."""
    return kj.init_params(SMALL, jax.random.key(0))


@pytest.fixture
def kernel_moe_for_any_stack(monkeypatch):
    """Under impl="auto" a GPU runs a small routed stack (every test model's) on XLA, where it measured faster
    (pallas_kernels.moe_w4a16.tuned.XLA_FASTER_STACK_BYTES); tests of the kernel choice and the Mosaic layout
    conversion set the bound below every stack, so that the tiny models take the kernels' path."""
    from pallas_kernels.moe_w4a16 import tuned

    monkeypatch.setattr(tuned, "XLA_FASTER_STACK_BYTES", -1)
