"""The K2.6 benchmark scripts keep working on a CPU: the slice benchmark's smoke run, and its summary code
regenerates the committed H200 tables exactly (so a change to the summary cannot silently disagree with the
results it describes). The measurements themselves only come from the GPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CPU = dict(os.environ, JAX_PLATFORMS="cpu")  # the CPU paths, also on a machine with a GPU


def _run(*argv):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_k26_slice_tiny_smoke_run(tmp_path):
    _run("benchmarks/bench_k26_slice.py", "--tiny", "--ts", "1,9", "--iters", "1", "--out", str(tmp_path))
    md = (tmp_path / "k26_slice_tiny.md").read_text()
    assert "these numbers are NOT measurements" in md
    stored = json.loads((tmp_path / "k26_slice_tiny.json").read_text())
    assert {r["T"] for r in stored["rows"]} == {1, 9} and stored["meta"]["moe_impl"] == "xla_touched"


@pytest.mark.parametrize("name", ["k26_slice"])
def test_k26_slice_summary_reproduces_the_committed_tables(tmp_path, name):
    shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    _run("benchmarks/bench_k26_slice.py", "--summarize", str(tmp_path / f"{name}.json"))
    assert (tmp_path / f"{name}.md").read_text() == (RESULTS / f"{name}.md").read_text()


def test_moe_mgpu_refuses_a_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench_moe_mgpu.py", "--ts", "1", "--out", str(tmp_path)],
                          cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "needs a Hopper GPU: CPU timings prove nothing" in proc.stderr
    assert not list(tmp_path.iterdir())
