"""benchmarks/common.py (the metadata record, the timer, the writer) and benchmarks/xla_baselines.py on CPU."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import common, xla_baselines
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight


def _head() -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.ROOT, capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    return proc.stdout.strip()


# ------------------------------------------------------------------------------------------- metadata
def test_metadata_records_the_commit_and_the_exact_command(monkeypatch):
    head = _head()  # before metadata(): outside a git checkout (a copy on a GPU host) this skips, saying why
    monkeypatch.setattr(sys, "orig_argv", ["python", "benchmarks/bench_x.py", "--out", "a dir", "--tiny"])
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    meta = common.metadata(layers=2)
    assert meta["commit"] == head and isinstance(meta["dirty"], bool)
    assert meta["command"] == "python benchmarks/bench_x.py --out 'a dir' --tiny"
    assert meta["device"] == jax.devices()[0].device_kind and meta["platform"] == jax.default_backend()
    assert meta["jax"] == jax.__version__ and meta["date"].endswith("+00:00") and meta["layers"] == 2
    assert set(common.RECORD_FIELDS) <= set(meta)


def test_metadata_refuses_extra_fields_that_would_overwrite_the_record():
    with pytest.raises(ValueError, match=r"\['commit'\]"):
        common.metadata(commit="abc")


def test_commit_outside_git_comes_from_the_environment_or_the_run_stops(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.setenv(common.COMMIT_ENV, "0123abcd")
    assert common.git_commit(tmp_path) == ("0123abcd", None, common.COMMIT_ENV)
    monkeypatch.delenv(common.COMMIT_ENV)
    with pytest.raises(SystemExit, match=common.COMMIT_ENV):
        common.git_commit(tmp_path)


def test_the_environment_commit_wins_over_a_stale_git(monkeypatch):
    """A device's copy of the tree may carry an old .git: the commit its sender names is the one recorded."""
    _head()
    monkeypatch.setenv(common.COMMIT_ENV, "feedbeef")
    assert common.git_commit() == ("feedbeef", None, common.COMMIT_ENV)


def test_shown_path_is_relative_inside_the_repository(monkeypatch):
    from benchmarks.common import ROOT, shown_path

    monkeypatch.chdir(ROOT)
    assert shown_path(ROOT / "kdtree_jax" / "assets" / "target") == "kdtree_jax/assets/target"
    assert shown_path("kdtree_jax/assets/drafter") == "kdtree_jax/assets/drafter"
    assert shown_path("/tmp/dr/drafter") == "/tmp/dr/drafter"  # outside: as given


def test_record_line_names_what_an_older_run_did_not_record():
    line = common.record_line({"device": "NVIDIA H200", "jax": "0.11.2", "date": "2026-11-30T09:29:00+00:00"})
    assert line == ("Run: device NVIDIA H200; JAX 0.11.2; 2026-11-30T09:29:00+00:00. Not recorded by this run: "
                    "platform, devices, jaxlib, commit, command.")


# ---------------------------------------------------------------------------------------------- writer
def test_writer_writes_json_and_md_with_the_metadata_and_the_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(sys, "orig_argv", ["python", "benchmarks/bench_x.py"])
    meta = common.metadata()
    drawn = []

    def plot(path):
        import matplotlib.pyplot as plt

        plt.plot([1, 2], [3, 4])
        plt.savefig(path)
        drawn.append(path)

    written = common.write_results(tmp_path / "sub" / "x", meta, {"rows": [{"T": 1, "s": np.float32(0.5)}]},
                                   "# table\n", plot=plot)
    assert [p.name for p in written] == ["x.json", "x.md", "x.png"] and drawn == [written[2]]
    stored = json.loads(written[0].read_text())
    assert stored["meta"]["commit"] == _head() and stored["meta"]["command"] == "python benchmarks/bench_x.py"
    assert stored["rows"] == [{"T": 1, "s": 0.5}]
    md = written[1].read_text()
    assert md.startswith("# table\n\nRun: device ") and f"commit {_head()[:12]}" in md
    assert md.endswith("command `python benchmarks/bench_x.py`.\n")
    assert written[2].read_bytes()[:4] == b"\x89PNG"


def test_writer_without_matplotlib_says_so_and_writes_no_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    meta = {"device": "cpu", "date": "2026-12-01T00:00:00+00:00"}
    written = common.write_results(tmp_path / "x", meta, {}, "text", plot=lambda path: pytest.fail("drawn"))
    assert [p.name for p in written] == ["x.json", "x.md"] and not (tmp_path / "x.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_writer_refuses_results_without_a_record_or_with_a_second_one(tmp_path):
    with pytest.raises(ValueError, match="metadata record"):
        common.write_json(tmp_path / "x", {"rows": []}, {})
    with pytest.raises(ValueError, match="'meta'"):
        common.write_json(tmp_path / "x", {"device": "cpu", "date": "d"}, {"meta": {}})


# ----------------------------------------------------------------------------------------------- timer
def test_timer_on_cpu_returns_positive_wall_times_and_the_output():
    timer = common.Timer(3, device=False)  # the wall-clock path (the default on a CPU; CUPTI on a GPU)
    assert not timer.device and "median of 3" in timer.method
    x = jnp.arange(64.0)
    timing = timer(jax.jit(lambda a: jnp.sum(a * a)), x)
    assert timing.wall_s > 0 and timing.device_s is None and timing.kernels == ()
    assert timing.seconds == timing.wall_s and float(timing.out) == float(np.sum(np.arange(64.0) ** 2))


def test_loop_wall_feeds_each_call_the_last_output_and_times_per_call():
    """loop_wall_us: positive, finite marginal per-call microseconds of a fori_loop whose calls depend on each other,
    for an output shaped like the first argument (fed back elementwise) and for another shape (fed back through its
    sum); more work a call costs more."""
    # calls heavy enough (~0.1 and ~1 ms on a 2-core CPU) that 40 more of them stand well above the clock's noise
    # under a loaded test run (a 256 x 256 x 8 product, ~20 us, did not: CI, 2026-12-06)
    matvec = common.loop_wall_us(lambda x, w: x @ w, (jnp.ones((512, 512)), jnp.ones((512, 64))), calls=40)
    same = common.loop_wall_us(lambda x, w: x @ w, (jnp.ones((512, 512)), jnp.ones((512, 512))), calls=40)
    assert 0 < matvec < 1e6 and 0 < same < 1e6
    assert same > matvec  # a 512-wide product per call costs more than a 64-wide one


def test_loop_wall_is_not_fooled_by_a_machine_that_slows_down_midway(monkeypatch):
    """loop_wall_us on a scripted clock: calls of 80 us, a loop's fixed cost of 100 us, and from the sixth loop run on
    every run 400 us slower (another process woke up). Timing the 20-call loop's runs first and the 40-call loop's
    after, as the clock did before, would put the slow-down into the difference (100 us a call instead of 80);
    timed in turn, the fastest run of each loop gives 80."""
    clock = {"now": 0.0, "runs": 0}

    def fake_loop(_fn, calls):
        def run(*_args):
            clock["runs"] += 1
            clock["now"] += (100 + 80 * calls + (400 if clock["runs"] > 5 else 0)) * 1e-6
        return run

    monkeypatch.setattr(common, "_dependent_loop", fake_loop)
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock["now"])
    assert common.loop_wall_us(lambda x: x, (0,), calls=20) == pytest.approx(80.0)


def test_summarize_timeline_splits_span_into_busy_and_gaps():
    """Three calls of two launches each (ns): per call span, busy (overlapping events counted once) and gaps, and the
    middle call's launches with the idle time before each (its first measured from the previous call's end)."""
    events = []
    for c in range(3):
        base = c * 10_000
        events += [("pad", base, 1_000), ("mosaic_kernel", base + 3_000, 5_000), ("overlap", base + 7_000, 500)]
    tl = common.summarize_timeline(events[::-1], calls=3)  # any order in
    assert tl["events_per_call"] == 3 and tl["span_us_per_call"] == pytest.approx(28.0 / 3)
    assert tl["busy_us_per_call"] == pytest.approx(6.0) and tl["gap_us_per_call"] == pytest.approx(28.0 / 3 - 6.0)
    assert [(e["name"], e["gap_before_us"], e["us"]) for e in tl["middle_call"]] == [
        ("pad", 2.0, 1.0), ("mosaic_kernel", 2.0, 5.0), ("overlap", -1.0, 0.5)]
    uneven = common.summarize_timeline(events[:-1], calls=3)
    assert "middle_call" not in uneven and uneven["first_events"][0]["gap_before_us"] is None
    with pytest.raises(ValueError, match="need events"):
        common.summarize_timeline([], calls=3)


def test_loop_timeline_says_loudly_when_no_gpu_events_exist():
    """On a CPU the profile has no GPU stream: an error naming the planes it saw, never an empty timeline."""
    with pytest.raises(RuntimeError, match="no GPU stream events; planes and lines: .*host"):
        common.loop_timeline(lambda x, w: x @ w, (jnp.ones((2, 64)), jnp.ones((64, 8))), calls=3)


def test_loop_timeline_takes_a_prebuilt_loop_or_a_function():
    """loop_timeline profiles fn's dependent loop or a loop the caller built (bench_k26_slice's, which carries the
    cache); with neither it says so."""
    with pytest.raises(ValueError, match="give fn, or a loop"):
        common.loop_timeline(None, (jnp.ones(3),), 2)
    with pytest.raises(RuntimeError, match="no GPU stream events"):
        common.loop_timeline(None, (jnp.ones(3),), 2, loop=jax.jit(lambda x: x + 1))


HLO = """HloModule m

%fused_reduce (p0: f32[64,384]) -> f32[384] {
  %p0 = f32[64,384]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %r = f32[384]{0} reduce(f32[64,384]{1,0} %p0, f32[] %c), dimensions={0}, to_apply=%add
}

%fused_argmax (p0: pred[8]) -> (pred[8], s32[8]) {
  %p0 = pred[8]{0} parameter(0)
  ROOT %r = (pred[8]{0}, s32[8]{0}) reduce(pred[8]{0} %p0, s32[8]{0} %p0), dimensions={0}, to_apply=%max
}

ENTRY %main (x: f32[64,384]) -> f32[384] {
  %x = f32[64,384]{1,0} parameter(0)
  %input_reduce_fusion.9 = f32[384]{0} fusion(%x), kind=kInput, calls=%fused_reduce, metadata={op_name="moe/neg"}
  %input_reduce_fusion.2 = (pred[8]{0}, s32[8]{0}) fusion(pred[8]{0} %y), kind=kInput, calls=%fused_argmax
  ROOT %out = f32[384]{0} copy(%input_reduce_fusion.9)
}
"""


def test_timeline_events_markdown_adds_the_hlo_column_only_where_events_carry_it():
    """The events' table both timeline reports share (bench_moe_mgpu --timeline, bench_k26_slice --timeline)."""
    plain = {"middle_call": [{"name": "k", "gap_before_us": None, "us": 1.25}]}
    assert common.timeline_events_markdown(plain, "T=1 v") == [
        "", "T=1 v, one call (the middle call):", "", "| event | idle before (us) | us |", "|---|---|---|",
        "| `k` | - | 1.2 |"]
    named = {"first_events": [{"name": "k", "gap_before_us": 0.3, "us": 1.0, "what": "reduce f32[]"}]}
    assert common.timeline_events_markdown(named, "T=1", "; x")[1:] == [
        "T=1, one call (the first events: no repeating call found; x):", "",
        "| event | idle before (us) | us | what (HLO) |", "|---|---|---|---|", "| `k` | 0.3 | 1.0 | reduce f32[] |"]


def test_fusion_descriptions_name_a_timelines_xla_kernels():
    """fusion_descriptions maps the kernel names a profiler shows (a fusion's HLO name with '_' for '.') to the jax op
    and the called computation's main ops, tuple-shaped ones included; non-fusions are absent."""
    what = common.fusion_descriptions(HLO)
    assert what["input_reduce_fusion_9"] == "neg: reduce f32[384]{0}"
    assert what["input_reduce_fusion_2"] == "reduce (pred[8]{0}, s32[8]{0})"
    assert "out" not in what and "input_reduce_fusion.9" not in what


def test_copy_bandwidth_on_cpu_is_positive_and_finite(capsys):
    bandwidth = common.copy_bandwidth(common.Timer(2), elements=1 << 16)
    assert 0 < bandwidth < float("inf") and "copy bandwidth" in capsys.readouterr().out


@pytest.mark.parametrize("iters", [0, 2.5])
def test_timer_refuses_a_bad_iteration_count(iters):
    with pytest.raises(ValueError, match="iters"):
        common.Timer(iters)


# --------------------------------------------------------------------------------------------- weights
def test_random_params_follow_the_abstract_tree():
    abstract = {"norm": jax.ShapeDtypeStruct((8,), jnp.float32),
                "w": jax.ShapeDtypeStruct((16, 8), jnp.bfloat16),
                "experts": Int4Weight(qweight=jax.ShapeDtypeStruct((2, 8, 16), jnp.int16),
                                      scale=jax.ShapeDtypeStruct((2, 8, 2), jnp.bfloat16)),
                "mosaic": MosaicInt4Weight(w_i4=jax.ShapeDtypeStruct((2, 8, 64), jnp.int4),
                                           scale_t=jax.ShapeDtypeStruct((2, 2, 8), jnp.bfloat16))}
    params = common.random_params(abstract, jax.random.key(1))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    assert bool((params["norm"] == 1).all()) and float(jnp.std(params["w"].astype(jnp.float32))) > 0.1
    assert isinstance(params["experts"], Int4Weight) and isinstance(params["mosaic"], MosaicInt4Weight)
    assert float(params["experts"].scale[0, 0, 0]) == pytest.approx(1 / (4 * 8), rel=1e-2)  # K = 64
    assert float(params["mosaic"].scale_t[0, 0, 0]) == pytest.approx(1 / (4 * 8), rel=1e-2)  # K = 64
    assert int(params["mosaic"].w_i4.astype(jnp.int8).min()) >= -8


# ---------------------------------------------------------------------------------------- XLA baselines
def _int4(rng, *lead, n, k):
    """A random INT4 weight: (Int4Weight, the checkpoint layout; float64 dequantized [..., N, K])."""
    q = rng.integers(-8, 8, size=(*lead, n, k))
    scale = rng.uniform(0.01, 0.1, size=(*lead, n, k // 32)).astype(np.float32)
    nibbles = (q + 8).reshape(*lead, n, k // 4, 4)
    words = (nibbles << (4 * np.arange(4))).sum(-1).astype(np.uint16).view(np.int16)
    dense = q * np.repeat(scale.astype(np.float64), 32, axis=-1)
    return Int4Weight(qweight=jnp.asarray(words), scale=jnp.asarray(scale)), dense


def test_w4a16_matmul_xla_matches_float64():
    rng = np.random.default_rng(0)
    leaf, w = _int4(rng, n=24, k=64)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    got = np.asarray(xla_baselines.w4a16_matmul_xla(jnp.asarray(x), leaf.qweight, leaf.scale))
    want = x.astype(np.float64) @ w.T
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_moe_baselines_reject_untyped_weights():
    rng = np.random.default_rng(2)
    experts = {w: _int4(rng, 2, n=32, k=32)[0] for w in ("gate", "up", "down")}
    experts["gate"] = experts["gate"].to_dict()  # the removed dict form
    with pytest.raises(ValueError, match="take an Int4Weight.*got dict"):
        xla_baselines.moe_touched_loop(jnp.ones((1, 32)), experts, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)))


@pytest.mark.parametrize("name", sorted(xla_baselines.MOE_BASELINES))
def test_moe_baselines_match_float64(name):
    rng = np.random.default_rng(1)
    e, d, inter, t, k = 6, 64, 32, 5, 2
    experts, dense = {}, {}
    for w, (n, kk) in {"gate": (inter, d), "up": (inter, d), "down": (d, inter)}.items():
        experts[w], dense[w] = _int4(rng, e, n=n, k=kk)
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    want = np.zeros((t, d))
    for i in range(t):
        for j in range(k):
            ex = ids[i, j]
            g, u = dense["gate"][ex] @ x[i], dense["up"][ex] @ x[i]
            want[i] += weights[i, j] * dense["down"][ex] @ (g / (1 + np.exp(-g)) * u)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(xla_baselines.MOE_BASELINES[name](jnp.asarray(x), experts, jnp.asarray(ids),
                                                           jnp.asarray(weights)))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_matmul_precision_names(matmul_precision):
    """--matmul-precision: every listed name is accepted by jax (a CPU float32 matmul runs under the algorithms
    the CPU has), "default" leaves JAX's setting alone, anything else is a clear error."""
    import jax
    import jax.numpy as jnp

    from kdtree_jax.precision import CPU_LACKS, MATMUL_PRECISIONS, set_matmul_precision

    before = matmul_precision
    set_matmul_precision("default")
    assert jax.config.jax_default_matmul_precision == before
    for name in MATMUL_PRECISIONS[2:]:
        set_matmul_precision(name)
        assert jax.config.jax_default_matmul_precision == name
        if name not in CPU_LACKS:  # XLA's CPU backend lacks these two
            x = jnp.arange(12.0).reshape(3, 4)
            np.testing.assert_allclose(np.asarray(x @ x.T), np.asarray(x) @ np.asarray(x).T, rtol=1e-6)
    with pytest.raises(ValueError, match="is not one of"):
        set_matmul_precision("fast")
    jax.config.update("jax_default_matmul_precision", before)
    for name in CPU_LACKS:  # refused up front on a CPU, the setting left as it was
        with pytest.raises(ValueError, match="not available on the CPU"):
            set_matmul_precision(name, platform="cpu")
        assert jax.config.jax_default_matmul_precision == before
