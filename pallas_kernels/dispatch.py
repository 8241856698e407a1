"""Choosing between a Pallas kernel and its XLA path - loudly, never silently."""

from __future__ import annotations

import warnings

import jax

IMPLS = ("auto", "pallas", "xla")


def resolve_impl(impl: str, *, interpret: bool, op: str, fallback: str, kernel: str,
                 warning: type[Warning]) -> str:
    """"pallas" or "xla". impl="auto" is the kernel on a GPU (or in interpret mode); elsewhere it is
    the XLA path, announced with `warning` (Python shows it once per call site unless filters say
    otherwise)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if interpret or jax.default_backend() == "gpu":
        return "pallas"
    warnings.warn(f"{op}(impl='auto') on backend {jax.default_backend()!r}: running {fallback}, NOT {kernel} "
                  "(pass impl='xla' to silence, or interpret=True to run the kernel in interpret mode).",
                  warning, stacklevel=4)
    return "xla"
