"""tests/gpu_host.sh, the GPU host's test runner, driven on a CPU with a stand-in python and nvidia-smi: the three
pytest runs go one after the other (side by side they ran an 80 GB H100 out of memory, docs/kernels.md), with one
suite worker per 16 GiB of the GPU, a run the limit leaves no time for is logged as not started, and the script's exit
status is 0 only when every run passed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _stand_ins(tmp_path: Path, mib: int, pytest_s: float = 0.0) -> tuple[Path, dict]:
    """A bin/ with `nvidia-smi` (reports `mib` MiB) and `fakepy` (appends its arguments, start and end times to
    calls.txt, sleeps `pytest_s`), and the environment that puts them first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/usr/bin/env bash\necho {mib}\n")
    calls = tmp_path / "calls.txt"
    (bin_dir / "fakepy").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "start $(date +%s.%N) $*" >> {calls}\n'
        f"sleep {pytest_s}\n"
        f'echo "end $(date +%s.%N)" >> {calls}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "fakepy",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("WORKERS", None)
    return calls, env


def _run(tmp_path: Path, env: dict, **extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return subprocess.run(["bash", "tests/gpu_host.sh"], cwd=ROOT, env={**env, "OUT": str(out), **extra},
                          capture_output=True, text=True, timeout=60)


def test_runs_go_one_after_the_other_with_a_worker_per_16_gib(tmp_path):
    calls, env = _stand_ins(tmp_path, mib=81559, pytest_s=0.3)  # an 80 GB H100
    proc = _run(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    starts = [line for line in lines if line.startswith("start")]
    assert len(starts) == 3 and len(lines) == 6
    # each run ends before the next starts (start, end, start, end, ...)
    assert [line.split()[0] for line in lines] == ["start", "end"] * 3
    times = [float(line.split()[1]) for line in lines]
    assert times == sorted(times)
    gpu, shipped, interpret = starts
    assert "-m gpu tests" in gpu and "-n 4 " in gpu  # 81559 MiB // 16 GiB
    assert "tests/test_shipped_model.py" in shipped and "--dist loadgroup" in shipped
    assert "kernels and not gpu" in interpret and "-n 4 " in interpret
    suite_log = (tmp_path / "out" / "gpu_suite.log").read_text()
    assert "rc=0 (-m gpu)" in suite_log and "rc=0 (-m 'kernels and not gpu')" in suite_log
    assert (tmp_path / "out" / "shipped_gpu.log").read_text().strip().endswith("rc=0")


def test_h200_worker_count_and_a_run_left_no_time(tmp_path):
    calls, env = _stand_ins(tmp_path, mib=143771, pytest_s=0.0)  # an H200
    proc = _run(tmp_path, env, RUNS="suite", LIMIT_S="5")  # 5 s: too little for the interpret-mode run (> 10 s left)
    assert proc.returncode == 124, proc.stderr  # a run left unstarted: the whole is not a pass
    starts = [line for line in calls.read_text().splitlines() if line.startswith("start")]
    assert len(starts) == 1 and "-n 8 " in starts[0]  # 143771 MiB // 16 GiB
    suite_log = (tmp_path / "out" / "gpu_suite.log").read_text()
    assert "rc=124 (-m 'kernels and not gpu': not started, no time left)" in suite_log
    assert not (tmp_path / "out" / "shipped_gpu.log").exists()  # RUNS without "shipped"


def test_a_failing_run_fails_the_script_and_the_next_runs_still_go(tmp_path):
    calls, env = _stand_ins(tmp_path, mib=81559)
    fake = tmp_path / "bin" / "fakepy"  # the gpu-marked run fails (pytest's 1), the others pass
    fake.write_text(fake.read_text().replace("sleep 0.0\n", 'sleep 0\n[[ "$*" == *"-m gpu tests"* ]] && exit 1\n'))
    proc = _run(tmp_path, env)
    assert proc.returncode == 1, proc.stderr
    assert len([line for line in calls.read_text().splitlines() if line.startswith("start")]) == 3
    assert "rc=1 (-m gpu)" in (tmp_path / "out" / "gpu_suite.log").read_text()
