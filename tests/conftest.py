"""Shared test setup: float32 matmuls at full precision on every backend, and small helpers."""

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU; this machine has none (CPU-only CI)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
