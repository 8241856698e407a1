"""benchmarks/aot_resources.py: its readers of ptxas's report and of the SASS loops (always, on synthetic text), and
the deviceless compile itself where the `aot` extra is installed (its own virtual environment; skipped elsewhere)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.aot_resources import TARGETS, parse_ptxas, sass_loops

ROOT = Path(__file__).resolve().parents[1]

PTXAS = """ptxas warning : Registers are spilled to local memory in function 'k', 124 bytes spill stores, 140 bytes \
spill loads
ptxas info    : Compiling entry function 'entry_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for entry_mosaic_gpu_kernel
    128 bytes stack frame, 124 bytes spill stores, 140 bytes spill loads
ptxas info    : Used 255 registers, used 16 barriers, 128 bytes cumulative stack size, 1 bytes smem
"""


def test_parse_ptxas():
    report = parse_ptxas(PTXAS)
    assert (report.registers, report.spill_store_bytes, report.spill_load_bytes) == (255, 124, 140)
    assert (report.stack_bytes, report.barriers) == (128, 16)
    with pytest.raises(ValueError, match="not a ptxas -v report"):
        parse_ptxas("ptxas info    : Compile time = 5 ms")


def _sass(body: list[str]) -> str:
    """nvdisasm -c style text: labels on their own lines, instructions as /*addr*/ OP ... ;"""
    lines, addr = [], 0
    for item in body:
        if item.endswith(":"):
            lines.append(item)
        else:
            lines.append(f"        /*{addr:04x}*/                   {item} ;")
            addr += 0x10
    return "\n".join(lines)


SASS = _sass([
    "MOV R1, c[0x0][0x28]",
    ".L_x_1:",                           # 0x10: the outer loop (holds the inner one)
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R10",
    "@!P0 BRA `(.L_x_9)",                # the wait's out-of-line retry, after EXIT
    ".L_x_2:",                           # 0x30: the hot loop
    "HGMMA.64x8x16.F32.BF16 R24, gdesc[UR4], R24",
    "LDL R3, [R1+0x8]",
    "MUFU.EX2 R4, R4",
    "STL [R1+0x4], R5",
    "@P1 BRA `(.L_x_2)",                 # 0x70: closes the hot loop
    ".L_x_3:",                           # 0x80: a loop without wgmmas (not reported)
    "IADD3 R6, R6, 0x1, RZ",
    "@P2 BRA `(.L_x_3)",
    "HGMMA.64x8x16.F32.BF16 R24, gdesc[UR4], R24",
    "@P3 BRA `(.L_x_1)",                 # 0xb0: closes the outer loop
    "EXIT",
    ".L_x_9:",                           # 0xd0: the retry block
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R10",
    "@!P0 BRA `(.L_x_9)",
    "BRA `(.L_x_2)",                     # back into the kernel: across EXIT, not a loop
])


def test_sass_loops_finds_the_innermost_wgmma_loop():
    loops = sass_loops(SASS)
    assert [(lp.start, lp.end) for lp in loops] == [(0x30, 0x70)]
    (hot,) = loops
    assert (hot.instructions, hot.wgmma, hot.spill_loads, hot.spill_stores, hot.exp2) == (5, 1, 1, 1, 1)
    assert hot.opcodes == {"HGMMA.64x8x16.F32.BF16": 1, "LDL": 1, "MUFU.EX2": 1, "STL": 1, "BRA": 1}


def test_sass_loops_without_a_wgmma_loop():
    assert sass_loops(_sass(["IADD3 R6, R6, 0x1, RZ", "EXIT"])) == []


def test_targets_are_hopper():
    for text in TARGETS.values():
        assert "major: 9" in text and "ACCELERATED_FEATURES" in text and "core_count: 132" in text


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("nvidia") is None,
                    reason="needs the aot extra (the CUDA plugin, ptxas, nvdisasm) in a virtual environment of its "
                           "own: pip install -e '.[aot]' (benchmarks/aot_resources.py)")
def test_deviceless_compile_reports_the_dense_kernel(tmp_path):
    """The whole tool on the dense W4A16 kernels: every case compiles for the abstract H100 with a hot loop."""
    run = subprocess.run([sys.executable, "benchmarks/aot_resources.py", "--out", str(tmp_path), "--only", "w4a16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    rows = json.loads((tmp_path / "aot_resources_h100.json").read_text())["rows"]
    assert len(rows) == 4 and all("error" not in r for r in rows)
    assert all(0 < r["registers"] <= 255 and len(r["loops"]) == 1 and r["loops"][0]["wgmma"] > 0 for r in rows)
