"""What every benchmark shares: the run's metadata record, one timer, one writer of results.

  meta = metadata(backend="gpu", layers=2)        # device, JAX/jaxlib, date (UTC), git commit + dirty, command
  timing = Timer(iters=7)(jitted_fn, *args)        # .wall_s always; .device_s / .kernels on a GPU (CUPTI)
  write_results(out_dir / "name", meta, {"rows": rows}, markdown, plot=draw)   # name.json, name.md (+ name.png)

The commit comes from git; where the benchmark runs on a copy of the tree without its .git folder, set
BENCH_GIT_COMMIT to the commit the copy was made from (the record then says so, with no dirty flag).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# `--matmul-precision` of the float32 benchmarks: jax_default_matmul_precision for every matmul that does not name
# its own precision (the float32 attention's XLA form runs at HIGHEST whatever this says; the routed experts' XLA
# forms at HIGHEST too, unless this is an explicit dot algorithm: pallas_kernels.moe_w4a16.reference.xla_dot_precision;
# under one, vector-shaped dots stay HIGHEST: pallas_kernels.dots).
from kdtree_jax.precision import MATMUL_PRECISIONS, set_matmul_precision  # noqa: F401 - the benchmarks import them here

ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "BENCH_GIT_COMMIT"
# The metadata fields every results file carries, in the order the markdown footer names them.
RECORD_FIELDS = ("device", "platform", "devices", "jax", "jaxlib", "date", "commit", "dirty", "command")


# ------------------------------------------------------------------------------------------- metadata
def git_commit(root: Path = ROOT) -> tuple[str, bool | None, str]:
    """(commit, dirty, source) of the tree this file lives in: BENCH_GIT_COMMIT when set (dirty unknown; what
    whoever copied the tree to a device says it is: a device's copy may carry a stale .git), else git's HEAD
    and whether tracked files differ from it."""
    from_env = os.environ.get(COMMIT_ENV, "").strip()
    if from_env:
        return from_env, None, COMMIT_ENV
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
        if head.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=30, check=True)
            return head.stdout.strip(), bool(status.stdout.strip()), "git"
        why = head.stderr.strip().splitlines()[-1] if head.stderr.strip() else f"exit {head.returncode}"
    except FileNotFoundError:
        why = "git is not installed"
    raise SystemExit(f"benchmarks: no git commit for {root} ({why}); set {COMMIT_ENV}=<the commit this copy "
                     "was made from> so that the results say which code they measured")


def shown_path(path: Path | str) -> str:
    """A checkpoint path as a results file records it: relative to the repository when inside it (a results file
    names no folder of the machine it ran on), else as given."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def metadata(**extra: Any) -> dict:
    """The run's record: device kind, platform and count, JAX and jaxlib versions, date (UTC), git commit
    with a dirty flag, the exact command line, XLA_FLAGS as the process holds them; then `extra` (the script's
    own settings)."""
    import jax
    from jaxlib.version import __version__ as jaxlib_version  # jaxlib.__version__, from where it is defined

    device = jax.devices()[0]
    commit, dirty, source = git_commit()
    meta = {"device": getattr(device, "device_kind", device.platform), "platform": device.platform,
            "devices": jax.device_count(), "jax": jax.__version__, "jaxlib": jaxlib_version,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": commit, "dirty": dirty, "command": shlex.join(sys.orig_argv),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}  # kdtree_jax adds its own (kdtree_jax/xla_flags.py)
    if source != "git":
        meta["commit_source"] = source
    clash = sorted(set(extra) & set(meta))
    if clash:
        raise ValueError(f"metadata: extra fields {clash} would overwrite the record's own fields")
    return {**meta, **extra}


def record_line(meta: dict) -> str:
    """One markdown line naming the run from its record; fields an older run did not record are listed."""
    missing = [name for name in RECORD_FIELDS if meta.get(name) is None and name != "dirty"]
    parts = []
    if meta.get("device") is not None:
        where = [str(meta[k]) for k in ("platform",) if meta.get(k) is not None]
        where += [f"{meta['devices']} device(s)"] if meta.get("devices") is not None else []
        parts.append(f"device {meta['device']}" + (f" ({', '.join(where)})" if where else ""))
    versions = [f"{name} {meta[key]}" for name, key in (("JAX", "jax"), ("jaxlib", "jaxlib")) if meta.get(key)]
    if versions:
        parts.append(", ".join(versions))
    if meta.get("date") is not None:
        parts.append(str(meta["date"]))
    if meta.get("commit") is not None:
        dirty = {True: " with uncommitted changes", False: "", None: " (uncommitted changes: unknown)"}
        parts.append(f"commit {str(meta['commit'])[:12]}{dirty[meta.get('dirty')]}")
    if meta.get("command") is not None:
        parts.append(f"command `{meta['command']}`")
    line = "Run: " + "; ".join(parts) + "."
    return line + (f" Not recorded by this run: {', '.join(missing)}." if missing else "")


# ----------------------------------------------------------------------------------------------- timer
CUPTI_WINDOWS = 0  # CUPTI windows this process has opened (Timer counts them)
WALL_AFTER_CUPTI_NOTE = ("Wall clocks taken after this process's first CUPTI window are inflated (H200, 2026-12-02: "
                         "a generate call's wall per round 1.4-1.7x): this run's wall-clock figures, except each first "
                         "measurement's, compare only with each other, not with a wall-clock-only run.")


@dataclasses.dataclass(frozen=True)
class Timing:
    """One point: the last output, the median wall seconds per call (dispatch and sync included), and
    on a GPU the median CUPTI summed kernel seconds per call with the kernels of that median call."""

    out: Any
    wall_s: float
    device_s: float | None = None
    kernels: tuple[tuple[str, float], ...] = ()  # (kernel name, seconds)

    @property
    def seconds(self) -> float:
        """Device time where measured, else wall clock."""
        return self.wall_s if self.device_s is None else self.device_s

    def require_device_s(self) -> float:
        """device_s, for a caller that needs the device time: an error where the Timer took none (device=False)."""
        if self.device_s is None:
            raise ValueError("Timing: no device time measured (the Timer ran with device=False)")
        return self.device_s


class Timer:
    """Median time per call of `fn(*args)` after one compile/warm-up call.

    Wall clock (perf_counter around the call and a block_until_ready) always; with device=True (default:
    on a GPU) also CUPTI summed kernel time (`jax.experimental.mosaic.gpu.profiler.measure`), one
    profiling window per call: a multi-call window insists that every call launches the same kernels,
    which XLA's data-dependent loops do not. CUPTI sums the kernels of every device, so a multi-device
    run passes device=False.

    Once a process has opened a CUPTI window, its later wall clocks are inflated (measured on the H200,
    2026-12-02, jax 0.11.2: a batch-1 generate call's wall per round 1.4-1.7x, the same call before and after one
    window). Each call's wall clock is taken before its own CUPTI windows; CUPTI_WINDOWS counts the windows
    opened, and `write_results` of a process that opened any says so in the results (unless the script's
    metadata says wall_after_cupti=False: it took every wall clock first, as benchmarks/profile_round.py does).
    A benchmark whose wall clocks matter takes them all first or passes device=False."""

    def __init__(self, iters: int = 5, *, device: bool | None = None):
        if not isinstance(iters, int) or iters < 1:
            raise ValueError(f"Timer: iters must be a whole number >= 1, got {iters!r}")
        if device is None:
            import jax

            device = jax.default_backend() == "gpu"
        self.iters, self.device = iters, bool(device)

    @property
    def method(self) -> str:
        wall = f"wall clock per call incl. dispatch, median of {self.iters}"
        if self.device:
            return f"CUPTI summed kernel time, one window per call, median of {self.iters}; {wall}"
        return wall

    def __call__(self, fn: Callable, *args) -> Timing:
        import jax

        global CUPTI_WINDOWS
        out = jax.block_until_ready(fn(*args))  # compile + warm-up
        walls = []
        for _ in range(self.iters):
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            walls.append(time.perf_counter() - start)
        if not self.device:
            return Timing(out, statistics.median(walls))
        from jax.experimental.mosaic.gpu import profiler

        runs = []
        for _ in range(self.iters):
            CUPTI_WINDOWS += 1
            out, launched = profiler.measure(fn, aggregate=False)(*args)
            if not launched:
                raise RuntimeError(f"Timer: {getattr(fn, '__name__', fn)!r} launched no kernels")
            runs.append(tuple((name, ms * 1e-3) for name, ms in launched))
        runs.sort(key=lambda run: sum(s for _, s in run))
        median = statistics.median(sum(s for _, s in run) for run in runs)
        return Timing(out, statistics.median(walls), median, runs[(len(runs) - 1) // 2])


def _dependent_loop(fn: Callable, calls: int) -> Callable:
    """jit(one fori_loop of `calls` calls of fn), each call's first argument nudged by the last output (below)."""
    import jax
    import jax.numpy as jnp

    def body(_, carry):
        y = fn(*carry)
        x = carry[0]
        nudge = y if y.shape == x.shape else jnp.sum(y)
        return (x + (nudge * 1e-30).astype(x.dtype), *carry[1:])

    return jax.jit(lambda *a: jax.lax.fori_loop(0, calls, body, a)[0])


def loop_wall_us(fn: Callable, args: tuple, calls: int, repeats: int = 9) -> float:
    """Microseconds per call of fn(*args) in a jitted fori_loop of dependent calls (each call's first argument takes
    a negligible term of the previous output: x + 1e-30 * y, or of its sum when the shapes differ, so XLA can
    neither hoist nor drop a call): the marginal cost, (wall(2 calls) - wall(calls)) / calls, so the loop's own fixed
    cost (the executable's launch, the wait for its end) is not spread over the calls: the per-call cost inside a
    decode loop. Both loops are compiled first, then timed in turn `repeats` times each, and the fastest run of each
    is taken: a difference of two medians taken one loop after the other measured 23 us a call for a launch sequence
    whose kernels alone took 85 us (H100, 2026-12-07: drift between the two series). Raises where the longer loop was
    not slower (the calls too cheap for the clock's noise). Take it before any CUPTI window (Timer)."""
    import jax

    loops = {n: _dependent_loop(fn, n) for n in (calls, 2 * calls)}
    for loop in loops.values():
        jax.block_until_ready(loop(*args))
    walls: dict[int, list[float]] = {n: [] for n in loops}
    for _ in range(repeats):
        for n, loop in loops.items():
            start = time.perf_counter()
            jax.block_until_ready(loop(*args))
            walls[n].append(time.perf_counter() - start)
    short, long = min(walls[calls]), min(walls[2 * calls])
    if long <= short:
        raise RuntimeError(f"loop_wall_us: {2 * calls} calls took no longer than {calls} ({long * 1e6:.1f} vs "
                           f"{short * 1e6:.1f} us): too noisy to give a per-call time; use more calls")
    return (long - short) / calls * 1e6


def loop_timeline(fn: Callable | None, args: tuple, calls: int, loop: Callable | None = None) -> dict:
    """The device's own timeline of one jitted loop of `calls` dependent calls of fn(*args) (the loop loop_wall_us
    times; or `loop(*args)`, a jitted loop of `calls` calls built by the caller), from a profiler session
    (jax.profiler's XSpace: the GPU plane's stream lines, kernels and copies with their device timestamps):
    `summarize_timeline` of its events. Where the per-call wall clock of a loop exceeds the summed kernel time, this
    says whether the difference is gaps between launches (and before which) or inside them. Take it before any
    CUPTI window (the profiler and CUPTI share the device's activity API)."""
    import jax
    from jax._src.lib import _profile_data, _profiler  # pyright: ignore[reportAttributeAccessIssue] (private, untyped)

    if loop is None:
        if fn is None:
            raise ValueError("loop_timeline: give fn, or a loop of `calls` calls")
        loop = _dependent_loop(fn, calls)
    jax.block_until_ready(loop(*args))
    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    try:
        jax.block_until_ready(loop(*args))
    finally:
        space = _profile_data.ProfileData.from_serialized_xspace(session.stop())
    events, seen = [], []
    for plane in space.planes:
        seen.append(f"{plane.name}: {[line.name for line in plane.lines]}")
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                events += [(event.name, event.start_ns, event.duration_ns) for event in line.events]
    if not events:
        raise RuntimeError("loop_timeline: the profile has no GPU stream events; planes and lines: " + "; ".join(seen))
    return summarize_timeline(events, calls)


def summarize_timeline(events: list[tuple[str, float, float]], calls: int) -> dict:
    """(name, start ns, duration ns) events of `calls` loop iterations -> per call: span (first start to last end),
    busy (union of the events' intervals), gaps (span - busy), events; and the middle call's events in order with
    the idle time before each (when most calls launch the same named events, else the first events)."""
    if calls < 1 or not events:
        raise ValueError(f"summarize_timeline: need events and calls >= 1, got {len(events)} events, calls={calls}")
    events = sorted(events, key=lambda ev: ev[1])
    busy, cur_start, cur_end = 0.0, events[0][1], events[0][1] + events[0][2]
    for _, start, dur in events[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start = start
        cur_end = max(cur_end, start + dur)
    busy += cur_end - cur_start
    span = max(start + dur for _, start, dur in events) - events[0][1]
    # A call's launches repeat `calls` times; the loop may add a few events before or after them (copies in and
    # out): take the offset whose calls most often launch what the middle call launches, by name.
    per, offset, repeats = len(events) // calls, 0, 0
    names = [name for name, _, _ in events]
    for o in range(len(events) - per * calls + 1) if per else ():
        mid = names[o + per * (calls // 2):o + per * (calls // 2 + 1)]
        score = sum(names[o + per * j:o + per * (j + 1)] == mid for j in range(calls))
        if score > repeats:
            offset, repeats = o, score
    per = per if repeats * 2 > calls else 0  # no repeating call found: show the first events instead
    first = offset + per * (calls // 2) if per else 0
    shown = events[first:first + per] if per else events[:min(len(events), 24)]
    rows, prev_end = [], max((start + dur for _, start, dur in events[:first]), default=None)
    for name, start, dur in shown:
        rows.append({"name": name[:80], "gap_before_us": None if prev_end is None else (start - prev_end) / 1e3,
                     "us": dur / 1e3})
        prev_end = max(prev_end or 0.0, start + dur)
    return {"calls": calls, "events": len(events), "events_per_call": len(events) / calls,
            "span_us_per_call": span / 1e3 / calls, "busy_us_per_call": busy / 1e3 / calls,
            "gap_us_per_call": (span - busy) / 1e3 / calls, "middle_call" if per else "first_events": rows}


def timeline_events(timeline: dict) -> list[dict]:
    """The events a `summarize_timeline` result lists: the middle call's, or the first ones where no call repeats."""
    return timeline.get("middle_call", timeline.get("first_events", []))


def timeline_events_markdown(timeline: dict, label: str, note: str = "") -> list[str]:
    """Markdown lines for the events of a `summarize_timeline` result: "<label>, one call (the middle call<note>):"
    and their table (event, idle before, us), with a "what (HLO)" column where the events carry one
    (`fusion_descriptions`)."""
    events = timeline_events(timeline)
    what = any("what" in ev for ev in events)
    which = "the middle call" if "middle_call" in timeline else "the first events: no repeating call found"
    md = ["", f"{label}, one call ({which}{note}):", "", "| event | idle before (us) | us |" + " what (HLO) |" * what,
          "|---|---|---|" + "---|" * what]
    for ev in events:
        gap = "-" if ev["gap_before_us"] is None else f"{ev['gap_before_us']:.1f}"
        cells = [f"`{ev['name'][:70]}`", gap, f"{ev['us']:.1f}"] + [ev.get("what", "")[:110]] * what
        md.append("| " + " | ".join(cells) + " |")
    return md


def fusion_descriptions(hlo: str) -> dict[str, str]:
    """{kernel name: what it computes} from an optimized HLO module's text, for naming a timeline's XLA kernels (a
    fusion `%gemm_fusion_dot.20` runs as kernel `gemm_fusion_dot_20`): the jax op it came from (the end of its
    metadata op_name) and the main ops of the computation it calls (dot, reduce, sort, transpose, ...) with their
    shapes. Kernels that are not HLO fusions (Mosaic kernels, cuBLAS, copies) are absent."""
    import re

    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    main = ("dot", "reduce", "sort", "transpose", "concatenate", "scatter", "gather", "dynamic-update-slice",
            "dynamic-slice", "pad", "select", "exponential", "rsqrt")
    out = {}
    for line in hlo.splitlines():
        inst = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) fusion\(.*?calls=%?([\w.\-]+)", line)
        if not inst:
            continue
        name, shape, called = inst.groups()
        ops = []
        for body_line in bodies.get(called, []):
            op = re.search(r"= (.+?) ([\w-]+)\(", body_line)
            if op and op.group(2) in main and f"{op.group(2)} {op.group(1)}" not in ops:
                ops.append(f"{op.group(2)} {op.group(1)}")
        source = re.search(r'op_name="([^"]*)"', line)
        where = source.group(1).split("/")[-1] if source else ""
        out[name.replace(".", "_")] = (f"{where}: " if where else "") + (", ".join(ops[:4]) or shape)
    return out


def copy_bandwidth(timer: Timer, elements: int = 512 * 1024 * 1024) -> float:
    """Bytes per second of a device copy in this run (x + 1 over `elements` bf16 values: one read and one
    write each), timed by `timer`; the denominator of the memory floors. Prints it."""
    import jax
    import jax.numpy as jnp

    big = jax.random.normal(jax.random.key(0), (elements,), jnp.bfloat16)
    seconds = timer(jax.jit(lambda a: a + 1), big).seconds
    del big
    bandwidth = 2 * elements * 2 / seconds
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    return bandwidth


# ---------------------------------------------------------------------------------------------- writer
def write_json(stem: str | Path, meta: dict, data: dict) -> Path:
    """<stem>.json = {"meta": meta, **data} (also for a partial result rewritten as a run goes)."""
    _check_meta(meta)
    if "meta" in data:
        raise ValueError("write_json: data must not carry its own 'meta' (pass it as meta)")
    path = Path(f"{stem}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, **data}, indent=1, default=_jsonable))
    return path


def write_results(stem: str | Path, meta: dict, data: dict, markdown: str,
                  plot: Callable[[Path], None] | None = None) -> list[Path]:
    """<stem>.json (meta + data), <stem>.md (markdown + the metadata line) and, with `plot` and matplotlib
    importable, <stem>.png drawn by plot(path) (without matplotlib: a note says so, no png).
    Returns the paths written."""
    if CUPTI_WINDOWS and "wall_after_cupti" not in meta:  # a script that took its wall clocks first says False
        meta = {**meta, "wall_after_cupti": True}
    written = [write_json(stem, meta, data), write_markdown(stem, meta, markdown)]
    if plot is not None:
        png = write_png(stem, plot)
        if png is not None:
            written.append(png)
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return written


def write_markdown(stem: str | Path, meta: dict, markdown: str) -> Path:
    """<stem>.md: the markdown, then the run's metadata line."""
    _check_meta(meta)
    path = Path(f"{stem}.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    note = f"{WALL_AFTER_CUPTI_NOTE}\n\n" if meta.get("wall_after_cupti") else ""
    path.write_text(markdown.rstrip("\n") + "\n\n" + note + record_line(meta) + "\n")
    return path


def write_png(stem: str | Path, plot: Callable[[Path], None]) -> Path | None:
    """<stem>.png drawn by plot(path) with matplotlib's Agg backend; None (and a note) without matplotlib."""
    try:
        import matplotlib  # pyright: ignore[reportMissingImports] (the bench extra)
    except ImportError:
        print(f"note: matplotlib is not installed (pip install -e '.[bench]'): no {stem}.png; the .json and "
              ".md are written", flush=True)
        return None
    matplotlib.use("Agg")
    path = Path(f"{stem}.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(path)
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports] (the bench extra)

    plt.close("all")
    return path


def _check_meta(meta: dict) -> None:
    if not isinstance(meta, dict) or "date" not in meta or "device" not in meta:
        raise ValueError(f"results need the run's metadata record (benchmarks.common.metadata()), got {meta!r:.200}")


def _jsonable(value):
    """numpy scalars and the like in results: their Python value."""
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ---------------------------------------------------------------------------------------- weights
def random_params(abstract, key=None, shardings=None):
    """Random weights for an abstract params tree (ShapeDtypeStructs, e.g. jax.eval_shape of the model's
    init, INT4 leaves included), drawn on the device inside one jit (into `shardings` when given): no host
    ever holds them. Norms are ones, router biases zeros, INT4 scales such that q in [-8, 7] gives unit-scale
    outputs, dense weights normal / sqrt(fan-in). Values only need to be realistic in scale: timings do not
    depend on them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    key = jax.random.key(0) if key is None else key
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def make(key):
        leaves = []
        for i, (key_path, leaf) in enumerate(flat):
            name = "/".join(str(getattr(k, "key", k)) for k in key_path)
            k = jax.random.fold_in(key, i)
            if name.endswith("qweight"):  # int16 words of four nibbles: uniformly random bits
                leaves.append(jax.lax.bitcast_convert_type(jax.random.bits(k, leaf.shape, jnp.uint16), jnp.int16))
            elif name.endswith("w_i4"):
                leaves.append(jax.random.randint(k, leaf.shape, -8, 8, jnp.int8).astype(jnp.int4))
            elif name.endswith(("scale", "scale_t")):
                k_in = (leaf.shape[-1] if name.endswith("scale") else leaf.shape[-2]) * 32
                leaves.append(jnp.full(leaf.shape, 1.0 / (4.0 * np.sqrt(k_in)), leaf.dtype))
            elif name.endswith("norm"):
                leaves.append(jnp.ones(leaf.shape, leaf.dtype))
            elif name.endswith("router_bias"):
                leaves.append(jnp.zeros(leaf.shape, leaf.dtype))
            else:
                fan_in = leaf.shape[-2] if leaf.ndim >= 2 else leaf.shape[-1]
                leaves.append((jax.random.normal(k, leaf.shape, jnp.float32) / np.sqrt(fan_in)).astype(leaf.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return (jax.jit(make) if shardings is None else jax.jit(make, out_shardings=shardings))(key)
