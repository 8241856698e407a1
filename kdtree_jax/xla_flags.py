"""The XLA flags the engine sets for itself, before JAX starts a backend: importing this module (which
`import kdtree_jax` does first) calls `apply()`.

A decode is one `jax.jit` whose `lax.while_loop` body launches hundreds of small kernels per round (the
shipped pair's AR step: about 460). XLA groups runs of them into CUDA graphs (command buffers), but by default
only runs of at least 5 commands, so every shorter run between two operations it cannot capture is launched
kernel by kernel. With `--xla_gpu_graph_min_graph_size=1` every run is a graph.
Measured on the H200 (2026-12-02, the shipped pair, batch 1, 128 tokens, float32; docs/kernels.md): a probe with
one process per setting (benchmarks/results/xla_flags_h200_probe_log.txt) gave an AR step 1108 -> 757 us of wall
clock, a DFlash round 1215 -> 954 us, a DDTree budget-8 round 1177 -> 1002 us, greedy outputs unchanged; a later
end-to-end run with the flag (e2e_h200_b1_flags.md) kept the AR step at 992 us, as without it, with DFlash and
DDTree 3-5% faster. No measurement found it slower; how much it gains is still being measured
(benchmarks/bench_xla_flags.py). The flag only concerns GPUs.

`apply` appends each recommended flag to XLA_FLAGS unless XLA_FLAGS already names that flag (yours wins), the
environment variable KDTREE_JAX_XLA_FLAGS is "0" (leave XLA_FLAGS alone), or a JAX backend has already started
(XLA reads its flags once, at that moment: import kdtree_jax before running anything on a device to get them).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

RECOMMENDED = ("--xla_gpu_graph_min_graph_size=1",)
OPT_OUT = "KDTREE_JAX_XLA_FLAGS"


def _name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def apply(environ: MutableMapping[str, str] | None = None, *, backends_started: bool | None = None) -> list[str]:
    """Append the RECOMMENDED flags that XLA_FLAGS does not name yet; returns the flags added (none when opted
    out or too late: a backend already started)."""
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT, "").strip() == "0":
        return []
    if backends_started is None:
        from jax._src import xla_bridge  # noqa: PLC0415 - only to ask whether it is too late

        backends_started = xla_bridge.backends_are_initialized()
    if backends_started:
        return []
    current = env.get("XLA_FLAGS", "")
    named = {_name(f) for f in current.split()}
    added = [f for f in RECOMMENDED if _name(f) not in named]
    if added:
        env["XLA_FLAGS"] = " ".join([current.strip(), *added]).strip()
    return added


apply()  # on import: see the module docstring
