"""benchmarks/aot_resources.py: its readers of ptxas's report and of the SASS loops (always, on synthetic text), and
the deviceless compile itself where the `aot` extra is installed (its own virtual environment; skipped elsewhere)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.aot_resources import TARGETS, launches, parse_ptxas, sass_loops

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


HLO = """HloModule jit_f, is_scheduled=true

%fused_computation (param_0: f32[64]) -> f32[64] {
  %x = f32[64]{0} fusion(f32[64]{0} %param_0), kind=kLoop, calls=%inner
}

ENTRY %main (p0: bf16[1,64,576], p1: f32[1,128,64]) -> bf16[1,64,512] {
  %input_reduce_fusion.1 = f32[64]{0} fusion(f32[1,128,64]{2,1,0} %p1), kind=kInput, calls=%fused_computation
  %mpmd_map = (bf16[1,128,64,512]{3,2,1,0}, f32[1,128,64]{2,1,0}) custom-call(bf16[1,64,576]{2,1,0} %p0), \
custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
  %gte = f32[1,128,64]{2,1,0} get-tuple-element((bf16[1,128,64,512]{3,2,1,0}, f32[1,128,64]{2,1,0}) %mpmd_map), index=1
  %while.3 = (s32[], f32[64]{0}) while((s32[], f32[64]{0}) %tuple), condition=%cond, body=%body
  ROOT %input_reduce_fusion = bf16[1,64,512]{2,1,0} fusion(f32[64]{0} %input_reduce_fusion.1), kind=kInput, calls=%c2
}
"""


def test_launches_lists_the_entry_computations_kernels():
    """Fusions, custom calls and while loops of the entry computation only (not those inside fused computations),
    tuple shapes and ROOT included, in order."""
    assert launches(HLO) == ["fusion input_reduce_fusion.1 (kInput)", "custom-call mosaic_gpu_v2", "while while.3",
                             "fusion input_reduce_fusion (kInput)"]


def test_targets_are_hopper():
    for text in TARGETS.values():
        assert "major: 9" in text and "ACCELERATED_FEATURES" in text and "core_count: 132" in text


# The routed MoE's grouped path at T = 9, deviceless compile for an H100 (2026-12-06): 21 XLA fusions (the grouping:
# counts, cumulative sums, sort, scatters, the row gather; the SwiGLU and its transpose; the per-choice gather and
# sum) and the three kernels; since session 33 10 XLA fusions: a verify's few assignments grouped by compares,
# without the sort, the scatters and their zeroed buffers, and their padded rows computed once (left to itself XLA
# recomputed them inside two consumers, one launch more and a final gather 7.2 -> 13.9 us on an H100), and the
# kernels' tile weights computed beside the tile table instead of an all-ones buffer of their own.
MOE_T9_LAUNCHES = 13

AOT = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("nvidia") is None,
    reason="needs the aot extra (the CUDA plugin, ptxas, nvdisasm) in a virtual environment of its own: "
    "pip install -e '.[aot,test]' there (the README's test command runs this file in .venv-aot)",
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[dict]]:
    """The whole tool, once: every kernel case compiled for the abstract H100 (~1 min on 2 cores), by kernel."""
    out = tmp_path_factory.mktemp("aot")
    run = subprocess.run([sys.executable, "benchmarks/aot_resources.py", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env={**os.environ})
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((out / "aot_resources_h100.json").read_text())
    by_kernel: dict[str, list[dict]] = {"census": data["census"]}
    for row in data["rows"]:
        by_kernel.setdefault(row["kernel"], []).append(row)
    return by_kernel


@pytest.mark.slow
@AOT
def test_every_kernel_compiles_for_hopper(compiled):
    """Every Mosaic GPU kernel at the engine's K2 / K2.6 shapes gets through Mosaic, LLVM and ptxas for sm_90a
    (what no interpret-mode test sees: SMEM over the 227 KiB, a ptxas error), each with a hot loop of wgmmas."""
    assert sorted(compiled) == ["census", "moe", "tree_attention", "w4a16"]
    assert [len(compiled[k]) for k in ("tree_attention", "w4a16", "moe")] == [6, 4, 3]
    for kernel in ("tree_attention", "w4a16", "moe"):
        for row in compiled[kernel]:
            assert "error" not in row, row
            assert row["loops"] and all(loop["wgmma"] > 0 for loop in row["loops"]), row["case"]
            assert 0 < row["registers"] <= 255 and row["smem_bytes"] <= 232448, row["case"]


@pytest.mark.slow
@AOT
def test_attention_streaming_loop_stays_lean(compiled):
    """The tree attention's unmasked loop (the one that streams the cache; the first hot loop) spills nothing and
    stays within its instruction budget: 591-639 SASS instructions a tile on 2026-12-05 (aot_resources_h100.md),
    727-775 before that day's changes. A change that makes it spill or grow past 660 fails here."""
    for row in compiled["tree_attention"]:
        loop = row["loops"][0]
        assert loop["spill_loads"] == 0 and loop["spill_stores"] == 0, (row["case"], loop)
        assert loop["instructions"] <= 660, (row["case"], loop["instructions"])
        assert loop["wgmma"] == 40 and loop["exp2"] == 34, (row["case"], loop)  # 36 + 4 wgmmas, 32 + 2 exp2s


@pytest.mark.slow
@AOT
def test_w4a16_tile_loop_fits_four_ctas_an_sm_without_spills(compiled):
    """The W4A16 tile loop (dense GEMM and the grouped MoE): no spills, at most 128 registers a thread (4 CTAs of
    one warpgroup fit an SM's 64 K registers), and at most 400 instructions a 256-column step: 322-387 with the
    lane-order cast (2026-12-06), 418-483 with Mosaic's relayout and cast of column-order int4 (2026-12-05), which
    fails here."""
    for row in compiled["w4a16"] + compiled["moe"]:
        assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, row["case"]
        assert row["registers"] <= 128, (row["case"], row["registers"])
        assert all(loop["instructions"] <= 400 and loop["wgmma"] == 16 for loop in row["loops"]), row["case"]


@pytest.mark.slow
@AOT
def test_decode_calls_launch_no_more_glue(compiled):
    """The launches of one engine call at T = 1 (an AR step), XLA glue included: the attention is one Mosaic kernel
    and three XLA fusions (the split combine: total log2-sum-exp, weights, weighted sum); the routed MoE three Mosaic
    kernels and two XLA fusions (SwiGLU / transpose, weighted sum), or, with gate / up fused (the default), two
    kernels and the weighted sum alone (the fused launch writes h in the down launch's row layout); until 2026-12-06
    one more, a tile-table fusion, and until 2026-12-07 the token's pad into a tile a choice and the fused path's
    transpose. More glue fails here; less is an improvement to record."""
    calls = {(row["call"], row["case"]): row["launches"] for row in compiled["census"]}

    def count(launch_list, prefix):
        return sum(1 for launch in launch_list if launch.startswith(prefix))

    t1 = calls[("attention call", "T=1 S=32768")]
    assert count(t1, "custom-call mosaic_gpu_v2") == 1 and count(t1, "fusion") <= 3, t1
    t33 = calls[("attention call", "T=33 S=32768")]
    assert count(t33, "custom-call mosaic_gpu_v2") == 1 and count(t33, "fusion") <= 4, t33
    # XLA's attention over one layer of the whole cache: the score GEMM, the softmax, the value GEMM, its split-K sum
    # with the output's slice (one fusion); 6 before 2026-12-06 (two cache-sized copies: the garbage rows zeroed for
    # each GEMM), 5 until 2026-12-07 (one), 4 since (bf16 reads the cache as it is: its garbage rows are finite)
    xla = calls[("attention call", "XLA, T=1 S=4096, layer 1 of 2")]
    assert count(xla, "fusion") <= 4 and count(xla, "custom-call") == 0, xla
    # the routed MoE at T = 1: since 2026-12-06 the kernels read the routing weights themselves (no tile-table
    # fusion), since 2026-12-07 the token itself as every choice's token tile (no pad fusion) and the fused launch's h
    # as the down launch's rows (no transpose)
    for case, kernels, fusions in (("T=1, three launches", 3, 2), ("T=1, gate+up fused", 2, 1)):
        moe = calls[("routed MoE call", case)]
        assert count(moe, "custom-call mosaic_gpu_v2") == kernels and count(moe, "fusion") <= fusions, (case, moe)
    # the dense W4A16 call at one row (a decode step's INT4 linear): the kernel and the output's slice, no pad of x to
    # the 8-row token tile (3 launches before 2026-12-06: the kernel reads the tile past the last row instead)
    for m in (1, 8):
        dense = calls[("dense W4A16 call", f"K=7168 N=2048 M={m}")]
        assert count(dense, "custom-call mosaic_gpu_v2") == 1 and len(dense) <= 2, (m, dense)
    # the grouped path at T = 9: no while loop (jnp.searchsorted's default binary search was one, 36 of a call's 69
    # launches on the device, H200, 2026-12-06; now compare_all) and the three kernels
    moe9 = calls[("routed MoE call", "T=9, three launches, the grouped path")]
    assert count(moe9, "while") == 0 and count(moe9, "custom-call mosaic_gpu_v2") == 3, moe9
    assert len(moe9) <= MOE_T9_LAUNCHES, (len(moe9), moe9)
    # gate + up fused (the default since 2026-12-07): one kernel fewer and no transpose between the launches
    moe9_fused = calls[("routed MoE call", "T=9, gate+up fused, the grouped path")]
    assert count(moe9_fused, "custom-call mosaic_gpu_v2") == 2, moe9_fused
    assert len(moe9_fused) <= MOE_T9_LAUNCHES - 2, (len(moe9_fused), moe9_fused)
    # a whole K2.6 MoE decoder layer at T = 1, S = 4096 as the engine runs it on Hopper (2026-12-06: 41 launches, the
    # two Mosaic MoE kernels and 39 XLA fusions: norms, bf16 projections, RoPE, the cache row write, XLA's attention,
    # the router and top-k, the shared expert, the MoE's pad and transpose; the weighted sum fused into the residual;
    # 37 since session 31: x @ [q_a | kv_a] one product, the top-k without a sort, W_UK with the query's RoPE;
    # 33 since session 32: the input and post-attention norms with their row scale after the product, one launch
    # each instead of two, and the router, a checkpoint's bf16, in the shared expert's gate | up product; 31 since
    # session 33: batch 1 writes its cache row by a dynamic_update_slice, where the scatter was three launches; still
    # 31 when the MoE's pad went in session 36 (the pad fusion was also where XLA wrote the post-attention norm's
    # normed row, which the MoE kernels now read from a launch of its own); 30 with the MoE's transpose gone, 29 with
    # XLA's attention reading the cache without a zeroed copy, 28 since both latent norms' row scales are one
    # reduction)
    layer = calls[("decoder layer", "K2.6 MoE layer, T=1 S=4096, as the engine runs it on Hopper")]
    assert count(layer, "custom-call mosaic_gpu_v2") == 2 and len(layer) <= 28, layer
    # the same layer at T = 9 (a budget-8 verify): 53 launches before session 33, 40 since (the cache rows written by
    # one dynamic_update_slice; the expert grouping by compares, its padded rows computed once, the tile weights beside
    # the tile table), 39 since session 36 (XLA's attention without the cache's zeroed copy), 37 since session 37
    # (gate + up fused at T >= 9 too: one MoE kernel and the transpose fewer); XLA's attention, the two MoE kernels
    verify = calls[("decoder layer", "K2.6 MoE layer, T=9 S=4096, as the engine runs it on Hopper")]
    assert count(verify, "custom-call mosaic_gpu_v2") == 2 and count(verify, "while") == 0, verify
    assert len(verify) <= 37, (len(verify), verify)
