"""The benchmark scripts keep working on a CPU: the K2.6 slice benchmark's smoke run, and its summary code
regenerates the committed H200 tables exactly (so a change to the summary cannot silently disagree with the
results it describes). The measurements themselves only come from the GPU."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CPU = dict(os.environ, JAX_PLATFORMS="cpu")  # the CPU paths, also on a machine with a GPU
if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
    # a copy without .git (e.g. on a GPU host): benchmarks then need the commit from the environment
    CPU.setdefault("BENCH_GIT_COMMIT", "unknown (tests run outside a git checkout)")


def _run(*argv):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_k26_slice_tiny_smoke_run(tmp_path):
    _run("benchmarks/bench_k26_slice.py", "--tiny", "--ts", "1,9", "--iters", "1", "--out", str(tmp_path))
    md = (tmp_path / "k26_slice_tiny.md").read_text()
    assert "these numbers are NOT measurements" in md
    stored = json.loads((tmp_path / "k26_slice_tiny.json").read_text())
    assert {r["T"] for r in stored["rows"]} == {1, 9} and stored["meta"]["moe_impl"] == "xla"
    # the CPU smoke run names the XLA references explicitly, and its metadata says what ran
    assert stored["meta"]["kernels"].startswith("attention xla (asked for)")
    assert "moe xla (asked for)" in stored["meta"]["kernels"]


@pytest.mark.parametrize("name", ["k26_slice", "k26_timeline_h100_s31_new"])
def test_k26_slice_summary_reproduces_the_committed_tables(tmp_path, name):
    shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    _run("benchmarks/bench_k26_slice.py", "--summarize", str(tmp_path / f"{name}.json"))
    assert (tmp_path / f"{name}.md").read_text() == (RESULTS / f"{name}.md").read_text()


def test_moe_mgpu_refuses_a_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench_moe_mgpu.py", "--ts", "1", "--out", str(tmp_path)],
                          cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "needs a Hopper GPU: CPU timings prove nothing" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_gpu_invariant_refuses_the_mosaic_kernel_on_a_cpu(tmp_path):
    """An explicitly named kernel that cannot run is an error, never an XLA run reported as the kernel."""
    proc = subprocess.run([sys.executable, "benchmarks/check_gpu_invariant.py", "--attention", "mosaic_gpu",
                           "--skip-kernel", "--out", str(tmp_path)],
                          cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "KernelUnavailableError: attention impl='mosaic_gpu' cannot run" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_tree_attention_smoke_run(tmp_path):
    """bench_tree_attention's run at a tiny shape, the Mosaic kernel in interpret mode: every variant runs and
    matches the reference (the exit status covers that), through both passes (the wall clocks, then the time that
    is CUPTI's on a GPU: every record has both); its numbers say they are none."""
    _run("benchmarks/bench_tree_attention.py", "--smoke", "--shapes", "100:5", "--out", str(tmp_path))
    stored = json.loads((tmp_path / "tree_attention_mosaic_smoke.json").read_text())
    (row,) = stored["rows"]
    assert {(m["schedule"], m["num_splits"]) for m in row["mosaic"]} == {
        (s, n) for s in ("replicated", "shared_qk") for n in (1, 2)}
    assert all({"us", "wall_us", "rel_err"} <= set(m) for m in [row["xla"], *row["mosaic"]])
    # the shape's flat summary (issue 20's rows: S, T, kernel_us, xla_us, floor_us): the fastest variant, XLA's call
    best = min(row["mosaic"], key=lambda m: m["us"])
    assert (row["kernel_us"], row["kernel_wall_us"]) == (best["us"], best["wall_us"]) and row["floor_us"] > 0
    assert row["kernel_variant"] == f"{best['schedule']}, {best['num_splits']} split{'s' * (best['num_splits'] > 1)}"
    assert (row["xla_us"], row["xla_wall_us"]) == (row["xla"]["us"], row["xla"]["wall_us"])
    assert stored["meta"]["wall_after_cupti"] is False
    assert stored["meta"]["smoke"] and "these numbers are NOT measurements" in (
        tmp_path / "tree_attention_mosaic_smoke.md").read_text()


def test_tree_attention_split_sweep_and_combine_smoke_runs(tmp_path):
    """--splits / --schedules replace the plan's variants (value_block kept), and --combine times the three combine
    forms, each matching the float64 combine, into tree_attention_combine_smoke.*."""
    _run("benchmarks/bench_tree_attention.py", "--smoke", "--shapes", "100:1", "--splits", "3",
         "--schedules", "replicated", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "tree_attention_mosaic_smoke.json").read_text())["rows"]
    assert [(m["schedule"], m["num_splits"], m["value_block"]) for m in row["mosaic"]] == [("replicated", 3, 64)]
    assert all(m["rel_err"] < 2e-2 for m in row["mosaic"])  # each checked against the float32 reference
    _run("benchmarks/bench_tree_attention.py", "--smoke", "--combine", "--splits", "2", "3", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "tree_attention_combine_smoke.json").read_text())["rows"]
    assert [r["splits"] for r in rows] == [2, 3]
    for r in rows:
        assert len(r["forms"]) == 3 and all(f["rel_err"] < 1e-2 for f in r["forms"].values())


def test_tree_attention_kernel_source_ab_smoke_run(tmp_path):
    """--kernel-source LABEL=FILE times each variant again with the kernel module loaded from FILE (here a copy of
    this tree's), recorded with its label; the headline stays this tree's kernel; a bad spec is refused."""
    other = tmp_path / "other_mosaic_gpu.py"
    other.write_text((ROOT / "pallas_kernels/tree_attention/mosaic_gpu.py").read_text())
    _run("benchmarks/bench_tree_attention.py", "--smoke", "--shapes", "100:1", "--splits", "2",
         "--schedules", "replicated", "--kernel-source", f"other={other}", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "tree_attention_mosaic_smoke.json").read_text())["rows"]
    assert [m.get("source") for m in row["mosaic"]] == [None, "other"]
    assert all(m["rel_err"] < 2e-2 for m in row["mosaic"])
    table = (tmp_path / "tree_attention_mosaic_smoke.md").read_text()
    assert "| replicated | 2 |" in table and "| replicated [other] | 2 |" in table
    proc = subprocess.run([sys.executable, "benchmarks/bench_tree_attention.py", "--smoke", "--kernel-source",
                           "nolabel", "--out", str(tmp_path)], cwd=ROOT, env=CPU, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "want LABEL=FILE" in proc.stderr


def test_tree_build_smoke_run(tmp_path):
    """bench_tree_build's checks and every variant run on a CPU (interpret mode); the exit status covers them."""
    _run("benchmarks/bench_tree_build.py", "--smoke", "--out", str(tmp_path))
    stored = json.loads((tmp_path / "tree_build_smoke.json").read_text())
    assert stored["checks"] and not stored["failures"]
    assert all(c["lex_equals_heap"] and c["key_equals_heap"] and c["pop_loops_equal"] for c in stored["checks"])
    assert {(r["kind"], r["variant"]) for r in stored["rows"]} >= {
        ("launch", "lex"), ("launch", "key"), ("front", "xla"), ("front", "pallas"), ("front", "pallas_fused"),
        ("build", "before"), ("build", "engine")}
    assert "these numbers are NOT measurements" in (tmp_path / "tree_build_smoke.md").read_text()


def test_decode_quick_smoke_run_records_the_kernel_plan(tmp_path):
    _run("benchmarks/bench_decode.py", "--quick", "--out", str(tmp_path))
    stored = json.loads(next(tmp_path.glob("decode_quick_*.json")).read_text())
    assert stored["meta"]["kernels_tiny"].startswith("attention xla (no GPU")  # "auto" on a CPU
    assert {r["method"] for r in stored["rows"]} >= {"ar", "dflash", "ddtree"}
    assert all(r["matches_ar"] for r in stored["rows"] if r["model"] == "tiny")


def test_e2e_tables_render_from_a_new_run_and_the_committed_one():
    """bench_e2e's markdown from the metadata a run records now (its kernel plan) and from the committed file
    (older metadata named only the attention kernel): a renamed key must not cost a device run its results."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_e2e import markdown  # noqa: PLC0415 (benchmarks/ is not a package on the path)

    committed = json.loads((ROOT / "benchmarks" / "results" / "e2e_h200.json").read_text())
    assert "| 1 | 0 | ddtree | 32 |" in markdown(committed["meta"], committed["rows"])
    meta = {k: v for k, v in committed["meta"].items() if k not in ("attention", "dates")}
    meta["kernels"] = "attention mosaic_gpu (per call shape, as measured), tree triton (GPU)"
    assert ("kernels: attention mosaic_gpu (per call shape, as measured), tree triton (GPU)."
            in markdown(meta, committed["rows"][:2]))


def test_round_profile_table_rebuilds_from_its_json():
    """profile_round's markdown from a results json: the committed session-40 run whose md the device tool did not
    return (older json: no loop_tokens key) and the dense run whose md it did (the same table, row for row)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.profile_round import markdown  # noqa: PLC0415 (benchmarks/ is not a package on the path)

    folder = ROOT / "benchmarks" / "results" / "gpu_h100_s40"
    gather = json.loads((folder / "round_gather" / "round_profile.json").read_text())
    table = markdown(gather["meta"], gather["rows"])
    assert "| ddtree budget 31: verify (T=32) | 1706.9 | 475.9 | 202 |  |" in table
    assert "the routed experts' XLA form gather." in table and "generate calls of 128 tokens" in table
    dense = json.loads((folder / "round_dense" / "round_profile.json").read_text())
    written = (folder / "round_dense" / "round_profile.md").read_text()
    assert written.startswith(markdown(dense["meta"], dense["rows"]) + "\n\n")


def test_e2e_plot_of_a_run_cut_before_its_first_ddtree_point(tmp_path):
    """A --deadline-s that stops bench_e2e after its AR rows (a short call, a slow machine) still gets its figure: the
    plot once put a log-scale budget axis on no data, which raised after the run and failed the whole call."""
    sys.path.insert(0, str(ROOT))
    pytest.importorskip("matplotlib")
    from benchmarks.bench_e2e import plot  # noqa: PLC0415

    meta = {"device": "cpu", "jax": "0.11.2", "date": "2026-12-07T12:00:00+00:00"}
    rows = [{"batch": 1, "temperature": t, "method": "ar", "budget": "-", "mean_acceptance": 1.0, "speedup": 1.0}
            for t in (0.0, 1.0)]
    plot(tmp_path / "cut.png", meta, rows, [7, 15, 31])
    rows.append({"batch": 1, "temperature": 0.0, "method": "ddtree", "budget": 7, "mean_acceptance": 2.8,
                 "speedup": 1.9})
    plot(tmp_path / "one_point.png", meta, rows, [7, 15, 31])
    assert (tmp_path / "cut.png").stat().st_size > 0 and (tmp_path / "one_point.png").stat().st_size > 0


def test_k26_slice_loop_writes_the_cache_in_place():
    """bench_k26_slice times its layers in `slice_calls`' loop, which carries the latent cache as the engine's decode
    loop does: compiled, the loop's body writes each layer's rows into the carried cache in place and never copies a
    whole cache (a lone call on a cache it does not own copies it to write its rows: 22 us a layer at S = 32768 on an
    H100, k26_timeline_h100_s31_lone_call.md, which the slice's "glue" carried before and the engine never pays).
    Only the entry copies the caller's cache into the loop once."""
    sys.path.insert(0, str(ROOT))
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import kdtree_jax as kj  # noqa: PLC0415
    from benchmarks.bench_k26_slice import slice_calls, slice_config, slice_params  # noqa: PLC0415

    cfg, xla = slice_config(True, 2), kj.Kernels(attention="xla", linear="xla", moe="xla")
    params = slice_params(cfg, jnp.float32, jax.random.key(0))
    c, t, s = cfg.kv_lora_rank + cfg.qk_rope_head_dim, 2, 100
    args = (params, jnp.ones((1, t, cfg.hidden_size)), jnp.arange(s, s + t)[None], jnp.zeros((1, s + 17, c)),
            jnp.asarray([s]), jnp.tril(jnp.ones((t, t), bool))[None])
    hlo = slice_calls(cfg, xla, 3).lower(*args).compile().as_text()
    whole = re.escape(f"f32[1,{s + 17},{c}]") + r"\{[\d,]*\} "
    copies, writes = {}, 0  # computation -> its whole-cache copies; in-place row writes anywhere
    for comp in re.split(r"\n(?=\S)", hlo):
        copies[comp.split(" ", 1)[0]] = len(re.findall(r"= " + whole + r"copy\(", comp))
        writes += len(re.findall(r"= " + whole + r"(?:scatter|dynamic-update-slice)\(", comp))
    assert {name: n for name, n in copies.items() if n} == {"ENTRY": 1}, copies  # into the loop, once
    assert writes >= cfg.num_hidden_layers


def test_k26_auto_tiny_smoke_run(tmp_path):
    _run("benchmarks/bench_k26_auto.py", "--tiny", "--budgets", "2,8", "--targets", "4", "--overconfidence", "1,1.5",
         "--rounds", "64", "--iters", "1", "--out", str(tmp_path))
    md = (tmp_path / "k26_auto_tiny.md").read_text()
    assert "these numbers are NOT measurements" in md
    stored = json.loads((tmp_path / "k26_auto_tiny.json").read_text())
    points = stored["measured"]["points"]
    assert [p["budget"] for p in points] == [2, 8] and not stored["meta"]["skipped"]
    assert all({"switch_s", "masked_s", "moe_s", "moe_masked_s", "attention_s", "head_s", "build_s"} <= set(p)
               for p in points)
    # the masked tree computes its live rows exactly as the switch's verify of the smaller tree does
    assert [c["T"] for c in stored["measured"]["checks"]] == [3, 9]
    assert all(c["max_rel_err"] < 1e-2 for c in stored["measured"]["checks"])
    assert [(p["target"], p["overconfidence"]) for p in stored["profiles"]] == [(4.0, 1.0), (4.0, 1.5)]
    for sim in stored["profiles"]:
        assert abs(sim["chain_model"] - 4.0) < 1e-6
        for design in ("switch", "masked"):
            assert sum(sim[f"auto_{design}"]["counts"].values()) == 64
    # --summarize rebuilds the same tables from the JSON
    shutil.copy(tmp_path / "k26_auto_tiny.json", tmp_path / "again.json")
    _run("benchmarks/bench_k26_auto.py", "--summarize", str(tmp_path / "again.json"))
    assert (tmp_path / "again.md").read_text() == md


def test_k26_auto_synthetic_drafter_hits_its_chain_acceptance():
    """The profile's offset gives the argmax chain the target acceptance (Monte Carlo over the drafter the
    simulation runs), and an overconfident drafter's truth is still reached at that acceptance."""
    sys.path.insert(0, str(ROOT))
    import jax  # noqa: PLC0415

    from benchmarks.bench_k26_auto import Profile, synthetic_draft  # noqa: PLC0415

    for overconfidence in (1.0, 1.5):
        prof = Profile(4.0, overconfidence, depth=7)
        logits, truth, rank = synthetic_draft(jax.random.key(0), 8192, 64, prof.offset(), overconfidence, 7)
        chain = 1 + np.cumprod(np.asarray(rank) == 0, axis=1).sum(1)
        assert abs(chain.mean() - 4.0) < 0.08
        top = np.asarray(logits).argmax(-1)  # the drafter's top token is the truth exactly at rank 0
        assert ((top == np.asarray(truth)) == (np.asarray(rank) == 0)).all()


def test_masked_tree_slots_touch_no_expert():
    """What the grouped MoE kernels read: with the masked tree's weights only the live slots' experts count."""
    sys.path.insert(0, str(ROOT))
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from benchmarks.bench_k26_auto import masked_weights  # noqa: PLC0415
    from pallas_kernels.moe_w4a16 import group_assignments  # noqa: PLC0415

    idx = jax.random.randint(jax.random.key(0), (65, 8), 0, 384, jnp.int32)
    w = jax.random.uniform(jax.random.key(1), (65, 8), minval=0.1)
    for live in (1, 9, 33, 65):
        grouping = group_assignments(idx, masked_weights(w, live), 384, 8)
        assert int(grouping.touched) == np.unique(np.asarray(idx[:live])).size
        assert not np.asarray(grouping.keep[live:]).any()


def test_xla_flags_rows_combine_repeats_and_render():
    """bench_xla_flags: a row is the median over its setting's repeats with the spread, AR steps against the
    same setting's AR step, and the greedy check fails if any repeat failed."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_xla_flags import combine, markdown  # noqa: PLC0415

    def run(setting, stage, method, wall, same=True):
        return {"setting": setting, "stage": f"in the loop: {stage}", "method": method, "wall_us": wall,
                "greedy_equals_ar": same}

    runs = [run("none", "AR step", "ar", 1000), run("none", "ddtree budget 8 round", "ddtree", 1500),
            run("recommended", "AR step", "ar", 800), run("recommended", "ddtree budget 8 round", "ddtree", 1200),
            run("none", "AR step", "ar", 1100), run("none", "ddtree budget 8 round", "ddtree", 1700, same=False),
            run("recommended", "AR step", "ar", 700), run("recommended", "ddtree budget 8 round", "ddtree", 1000)]
    rows = {(r["setting"], r["stage"]): r for r in combine(runs)}
    dd = rows[("none", "in the loop: ddtree budget 8 round")]
    assert (dd["wall_us"], dd["wall_us_min"], dd["wall_us_max"], dd["repeats"]) == (1600, 1500, 1700, 2)
    assert dd["ar_steps"] == pytest.approx(1600 / 1050) and not dd["greedy_equals_ar"]
    assert rows[("recommended", "in the loop: ddtree budget 8 round")]["ar_steps"] == pytest.approx(1100 / 750)
    meta = {"device": "cpu", "date": "d", "jax": "j", "dtype": "float32", "prompts": 1, "tokens": 8, "iters": 1,
            "repeat": 2}
    md = markdown(meta, list(rows.values()), ["none", "recommended"])
    assert "| ddtree budget 8 round | 1600 (1500-1700; 1.52) | 1100 (1000-1200; 1.47) | NO |" in md
    assert "AR step 1.40x" in md  # 1050 / 750 over the baseline


def test_results_say_when_wall_clocks_followed_a_cupti_window(tmp_path, monkeypatch):
    """write_results notes inflated wall clocks once the process opened a CUPTI window, unless the script's
    metadata says it took every wall clock first (wall_after_cupti=False)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import common  # noqa: PLC0415

    meta = {"device": "cpu", "platform": "cpu", "devices": 1, "jax": "j", "jaxlib": "j", "date": "d",
            "commit": "c", "dirty": False, "command": "x"}
    common.write_results(tmp_path / "clean", meta, {"rows": []}, "# t")
    assert common.WALL_AFTER_CUPTI_NOTE not in (tmp_path / "clean.md").read_text()
    monkeypatch.setattr(common, "CUPTI_WINDOWS", 3)
    common.write_results(tmp_path / "after", meta, {"rows": []}, "# t")
    assert common.WALL_AFTER_CUPTI_NOTE in (tmp_path / "after.md").read_text()
    assert json.loads((tmp_path / "after.json").read_text())["meta"]["wall_after_cupti"] is True
    common.write_results(tmp_path / "first", {**meta, "wall_after_cupti": False}, {"rows": []}, "# t")
    assert common.WALL_AFTER_CUPTI_NOTE not in (tmp_path / "first.md").read_text()


@pytest.mark.parametrize("V,L", [(3, 2), (2, 3)])
def test_acceptance_bound_tree_is_the_best_tree(V, L):
    """benchmarks/acceptance_bound.oracle_trees takes, for every budget b, the prefix-closed tree of b nodes (depth
    <= L) with the largest sum of path probabilities: checked against every such tree of a random V-token model."""
    import itertools

    sys.path.insert(0, str(ROOT))
    from benchmarks.acceptance_bound import oracle_trees

    rng = np.random.default_rng(V * 10 + L)
    budget = 6
    table: dict[tuple, np.ndarray] = {}

    def logprobs(seqs):
        out = []
        for s in seqs:
            if tuple(s) not in table:
                x = rng.normal(size=V) * 2
                table[tuple(s)] = x - np.logaddexp.reduce(x)
            out.append(table[tuple(s)])
        return out

    contexts = [[7], [8, 9]]
    taken = oracle_trees(logprobs, contexts, budget, L)
    nodes = [p for d in range(1, L + 1) for p in itertools.product(range(V), repeat=d)]
    for i, ctx in enumerate(contexts):
        def prob(path, ctx=ctx):
            return float(np.exp(sum(logprobs([ctx + list(path[:k])])[0][path[k]] for k in range(len(path)))))

        for b in range(1, budget + 1):
            best = max(sum(prob(p) for p in tree) for tree in itertools.combinations(nodes, b)
                       if all(len(p) == 1 or p[:-1] in tree for p in tree))
            assert taken[i, :b].sum() == pytest.approx(best, rel=1e-9)
        assert np.all(np.diff(taken[i]) <= 1e-12)  # taken best first
    with pytest.raises(ValueError, match="exceeds"):
        oracle_trees(logprobs, contexts, len(nodes) + 1, L)


def test_h200_hlo_counts_dots_bf16_products_and_a_rounds_kernels():
    """benchmarks/h200_hlo.py's reading of an optimized HLO module: a bf16 multiply counts as a rounded product, a
    float32 one does not; dots by their precision; the loop body's kernel-running instructions, a nested loop's body
    included, buffer plumbing (parameters, tuples, bitcasts) not (instruction lines as a real H200 compile writes
    them, shortened)."""
    from benchmarks.h200_hlo import count

    text = """HloModule jit__generate_ar

%fused_add (param_0: bf16[384]) -> f32[384,4096] {
  %multiply.1967.3 = bf16[384,4096]{1,0} multiply(%broadcast.2956.9, %convert.3984.3)
  %mul.567.3 = f32[1,1,384]{2,1,0} multiply(%bitcast.2.5, %mul.566.5)
}

%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %fusion.3 = f32[8]{0} fusion(%gte.1), kind=kLoop, calls=%fused_add
  ROOT %tuple.2 = (s32[], f32[8]{0}) tuple(%gte.0, %fusion.3)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%p.1), index=0
  ROOT %dot.5 = f32[8,512,5]{2,1,0} dot(%reshape.61, %parameter_2), lhs_batch_dims={1}, algorithm=dot_bf16_bf16_f32_x6
  %dot.4 = f32[512,5]{1,0} dot(%concatenate.2, %parameter_2), operand_precision={highest,highest}
  %input_reduce_fusion.45 = f32[8]{0} fusion(%gte.0), kind=kInput, calls=%fused_add
  %bitcast.1 = f32[8]{0} bitcast(%input_reduce_fusion.45)
  %while.2 = (s32[], f32[8]{0}) while(%tuple.1), condition=%cond, body=%inner_body
  %copy.1 = f32[8]{0} copy(%bitcast.1)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %fusion.9 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_add
  %while.1 = (s32[], f32[8]{0}) while(%tuple.0), condition=%cond, body=%body
  ROOT %gte.9 = f32[8]{0} get-tuple-element(%while.1), index=1
}
"""
    assert count(text) == {"dots": 2, "dots_algorithm": 1, "dots_highest": 1, "bf16_products": 1,
                           "round_kernels": 6}  # 2 dots, the reduce fusion, the inner while + its fusion, the copy


def test_ncu_source_summary_reproduces_the_committed_t1_profile(tmp_path):
    """benchmarks/ncu_source_summary.py on the committed Nsight Compute source page gives the tables that
    tree_attention_t1_ncu_h100_s24.md quotes (loop 67.4% of the samples, the QK^T wgmma wait, the stall reasons)."""
    out = _run("benchmarks/ncu_source_summary.py", str(RESULTS / "tree_attention_t1_ncu_h100_s24_source.csv.gz"))
    assert "3952 SASS instructions, 1999 warp-stall samples, 1024 warps" in out
    assert "| 577-1225 | 4 | 1348 | 67.4% |" in out  # the loop body: 4 tiles a CTA
    assert "| WARPGROUP | 413 | 20.7% | 24624 |" in out and "| long_sb | 32.9% |" in out
    assert out in (RESULTS / "tree_attention_t1_ncu_h100_s24.md").read_text()  # the results file quotes it whole
    bad = tmp_path / "not_ncu.csv"
    bad.write_text("a,b\n1,2\n")
    proc = subprocess.run([sys.executable, "benchmarks/ncu_source_summary.py", str(bad)], cwd=ROOT, env=CPU,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "not an ncu source page" in proc.stderr


def test_moe_mgpu_table_shows_the_loop_wall_clock():
    """The routed-MoE table carries, beside CUPTI's time, the wall clock a call inside a jitted loop (issue 20's T = 1
    target is stated for both), as a multiple of the floor; a variant without it shows CUPTI alone."""
    from benchmarks.bench_moe_mgpu import summarize

    meta = {"device": "GPU", "date": "today", "jax": "0.11.2", "timing": "CUPTI", "copy_TBps": 3.0, "loop_calls": 20}
    row = {"T": 1, "touched": 8, "floor_s": 60e-6, "shared_s": 30e-6, "shared_floor_s": 25e-6,
           "variants": {"a": {"s": 80e-6, "loop_wall_s": 90e-6, "kernels": []}, "b": {"s": 85e-6, "kernels": []}}}
    md = summarize(meta, [row], ["a", "b"])
    assert "| 1 | 8 | 60.0 | 80.0 [loop 90.0, 1.50x] | 1.33 | 85.0 | 1.42 |" in md
    assert "one jitted loop of 20 calls" in md


def test_moe_mgpu_timeline_report():
    """--timeline's report: the marginal wall clock a call beside the device timeline's span / busy / gaps, one call's
    launches with the idle time before each, and a failed variant's error in its row."""
    from benchmarks.bench_moe_mgpu import summarize_timelines

    meta = {"device": "GPU", "date": "today", "jax": "0.11.2", "loop_calls": 20}
    tl = {"calls": 20, "span_us_per_call": 90.0, "busy_us_per_call": 80.0, "gap_us_per_call": 10.0,
          "events_per_call": 2.0, "middle_call": [{"name": "pad", "gap_before_us": 3.0, "us": 1.0},
                                                  {"name": "mosaic", "gap_before_us": 6.0, "us": 79.0}]}
    md = summarize_timelines(meta, [{"T": 1, "variant": "a", "loop_wall_s": 91e-6, "timeline": tl},
                                    {"T": 1, "variant": "b", "loop_wall_s": None, "error": "RuntimeError: boom"}])
    assert "| 1 | a | 91.0 | 90.0 | 80.0 | 10.0 | 2 |" in md and "| `mosaic` | 6.0 | 79.0 |" in md
    assert "| 1 | b | - | RuntimeError: boom |" in md and "the middle call" in md


def test_gpu_targets_script_names_only_options_its_benchmarks_take():
    """benchmarks/gpu_targets.sh (issue 20's measurements in one call on a GPU) is valid bash, and every option it
    passes to a benchmark is one that benchmark's --help lists: a renamed option fails here, not on the device."""
    script = ROOT / "benchmarks" / "gpu_targets.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    calls = re.findall(r"\$PY (benchmarks/\w+\.py)([^\n]*)", text)
    assert {c[0] for c in calls} == {"benchmarks/bench_tree_attention.py", "benchmarks/bench_w4a16.py",
                                     "benchmarks/bench_moe_mgpu.py", "benchmarks/bench_k26_slice.py"}
    helps = {}
    for path, args in calls:
        if path not in helps:
            helps[path] = subprocess.run([sys.executable, path, "--help"], cwd=ROOT, env=CPU, capture_output=True,
                                         text=True, timeout=300).stdout
        for option in re.findall(r"(--[a-z][a-z0-9-]*)", args):
            assert re.search(re.escape(option) + r"(?![\w-])", helps[path]), (path, option)


def _script_options(name: str, bench: str, *extra_patterns: str) -> set[str]:
    """The device script benchmarks/NAME is valid bash, and every option it passes to benchmarks/BENCH (on its `$PY
    benchmarks/BENCH` lines, and on lines matching extra_patterns) is one BENCH's --help lists: a renamed option fails
    here, not on the device. Returns those options."""
    script = ROOT / "benchmarks" / name
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    passed = re.findall(r"\$PY benchmarks/" + re.escape(bench) + r"([^\n]*)", text)
    for pattern in extra_patterns:
        passed += re.findall(pattern, text, re.M)
    options = set(re.findall(r"(--[a-z][a-z0-9-]*)", " ".join(passed)))
    help_text = subprocess.run([sys.executable, f"benchmarks/{bench}", "--help"], cwd=ROOT, env=CPU,
                               capture_output=True, text=True, timeout=300).stdout
    for option in options:
        assert re.search(re.escape(option) + r"(?![\w-])", help_text), (bench, option)
    return options


def test_k26_layer_ab_script_runs_old_then_new_and_packs_each_step(tmp_path):
    """benchmarks/k26_layer_ab.sh (the K2.6 layer, an older tree against this one on one GPU) is valid bash, passes
    bench_k26_slice.py only options its --help lists, and, driven on the CPU with a stand-in python: runs the timeline
    for old then new and the slice for new then old, each in its own tree (the old one this tree with OLD's files
    laid over it), logs each step's table rows, packs OUT/results.tgz, and refuses an OLD without kdtree_jax/."""
    import tarfile

    script = ROOT / "benchmarks" / "k26_layer_ab.sh"
    options = _script_options("k26_layer_ab.sh", "bench_k26_slice.py", r"^step \w+ [^\n]*")
    assert {"--timeline", "--no-baselines", "--deadline-s", "--out", "--ts", "--ss", "--layers"} <= options

    old = tmp_path / "old"
    (old / "kdtree_jax").mkdir(parents=True)
    (old / "kdtree_jax" / "OLD_MARKER").write_text("old")
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fakepy"
    fake.write_text("#!/usr/bin/env bash\n"
                    'out=""; prev=""; for a in "$@"; do [[ $prev == --out ]] && out=$a; prev=$a; done\n'
                    'marker=no; [[ -f kdtree_jax/OLD_MARKER ]] && marker=old\n'
                    f'echo "$(basename "$out") $marker $PYTHONPATH $*" >> {calls}\n'
                    'mkdir -p "$out"; echo "| 1 | 4096 | xla | 1.0 |" > "$out/r.md"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "OLD": str(old), "PYTHON": str(fake), "LIMIT_S": "120"}
    run = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = calls.read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [["tl_old", "old"], ["tl_new", "no"], ["sl_new", "no"],
                                                    ["sl_old", "old"]]
    assert str(ROOT) in lines[1].split()[2] and str(ROOT) not in lines[0].split()[2]
    assert "--timeline" in lines[0] and "--no-baselines" in lines[2]
    log = (out / "ab.log").read_text()
    assert log.count("rc=0") == 4 and log.count("| 1 | 4096 | xla | 1.0 |") == 4
    with tarfile.open(out / "results.tgz") as tar:
        assert {"./sl_old/r.md", "./tl_new/r.md", "./ab.log"} <= set(tar.getnames())
    env["OLD"] = str(tmp_path)
    refused = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "has no kdtree_jax/" in refused.stderr


def test_drafter_ab_script_runs_paired_then_base_then_candidate_and_unpacks_a_tar(tmp_path):
    """benchmarks/drafter_ab.sh (an end-to-end A/B of two drafters on one GPU) is valid bash, passes ab_e2e.py and
    bench_e2e.py only options their --help lists, and, driven on the CPU with a stand-in python: runs the paired A/B
    (base as A, candidate as B), then the base drafter, then the candidate, with one protocol, unpacks a candidate given
    as a .tar holding drafter/ (train_pair.sh's packing), logs each step's table rows, packs OUT/results.tgz, passes
    the candidate's dtype (CANDIDATE_DTYPE) to the candidate alone, runs only the steps STEPS names, and refuses a
    candidate that is no drafter checkpoint."""
    import tarfile

    script = ROOT / "benchmarks" / "drafter_ab.sh"
    protocol = r"^PROTOCOL=\(([^)]*)\)"  # the options both benchmarks get
    options = _script_options("drafter_ab.sh", "bench_e2e.py", r"^step e2e_candidate (.*)$", protocol)
    assert {"--drafter", "--drafter-dtype", "--matmul-precision", "--temperatures", "--budgets", "--deadline-s",
            "--out"} <= options
    paired = _script_options("drafter_ab.sh", "ab_e2e.py", protocol)
    assert {"--a", "--b", "--b-dtype", "--matmul-precision", "--repeats", "--seeds", "--deadline-s", "--out"} <= paired

    packed = tmp_path / "trained"
    (packed / "drafter").mkdir(parents=True)
    (packed / "drafter" / "config.json").write_text("{}")
    candidate = tmp_path / "candidate.tar"
    with tarfile.open(candidate, "w") as tar:
        tar.add(packed / "drafter", arcname="drafter")
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fakepy"
    fake.write_text("#!/usr/bin/env bash\n"
                    'out=""; drafter=""; prev=""\n'
                    'for a in "$@"; do\n'
                    '  [[ $prev == --out ]] && out=$a\n'
                    '  [[ $prev == --drafter || $prev == --b ]] && drafter=$a; prev=$a\n'
                    'done\n'
                    'test -f "$drafter/config.json" || exit 3\n'
                    f'echo "$(basename "$out") $drafter $*" >> {calls}\n'
                    'mkdir -p "$out"; echo "| 1 | 0 | ddtree | 15 | 3.62 |" > "$out/r.md"\n'
                    'echo "| 0 | ddtree | 15 | 3.6 | 3.6 | 1.01 |" >> "$out/r.md"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "CANDIDATE": str(candidate), "PYTHON": str(fake), "LIMIT_S": "600",
           "TAG": "h200_b1_t"}
    run = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr)
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["paired", "e2e_base", "e2e_candidate"]
    unpacked = ".devcarry/drafter_ab/candidate/drafter"  # repo-relative: no /tmp in the results
    assert "benchmarks/ab_e2e.py" in lines[0] and f"--a kdtree_jax/assets/drafter --b {unpacked}" in lines[0]
    assert lines[1].split()[1] == "kdtree_jax/assets/drafter" and lines[2].split()[1] == unpacked
    assert "--tag h200_b1_t " in lines[0]
    assert "--tag h200_b1_t_base" in lines[1] and "--tag h200_b1_t_candidate" in lines[2]
    after = [line.split(" --drafter ")[1].split(" ", 1)[1] for line in lines[1:]]  # what follows the drafter's path
    assert after[0] == after[1] and "--matmul-precision BF16_BF16_F32_X9" in after[0]
    assert "--matmul-precision BF16_BF16_F32_X9" in lines[0]
    log = (out / "ab.log").read_text()
    assert log.count("rc=0") == 3 and "e2e_candidate | 1 | 0 | ddtree | 15 | 3.62 |" in log
    assert "paired | 0 | ddtree | 15 | 3.6 | 3.6 | 1.01 |" in log
    with tarfile.open(out / "results.tgz") as tar:
        assert {"./paired/r.md", "./e2e_base/r.md", "./e2e_candidate/r.md", "./ab.log"} <= set(tar.getnames())
    assert "-dtype" not in calls.read_text()
    calls.unlink()  # the same drafter, the candidate computing in bf16 (CANDIDATE_DTYPE): only the candidate's flag
    dtype_env = {**env, "CANDIDATE": "kdtree_jax/assets/drafter", "CANDIDATE_DTYPE": "bfloat16"}
    run = subprocess.run(["bash", str(script)], cwd=ROOT, env=dtype_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr)
    lines = calls.read_text().splitlines()
    assert "--b-dtype bfloat16" in lines[0] and "--a-dtype" not in lines[0]
    assert "--drafter-dtype" not in lines[1] and lines[2].endswith("--drafter-dtype bfloat16")
    calls.unlink()  # STEPS=paired: the paired A/B alone
    run = subprocess.run(["bash", str(script)], cwd=ROOT, env={**dtype_env, "STEPS": "paired"}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["paired"]
    env["CANDIDATE"] = str(tmp_path)
    refused = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "is no drafter checkpoint" in refused.stderr


def test_device_steps_run_in_the_time_left_and_pack_after_each_step(tmp_path):
    """benchmarks/steps.sh (sourced by gpu_targets.sh and k26_layer_ab.sh): a step runs with its output in
    OUT/NAME.log and its status logged, one cut at its cap counts as status 124, one not started for lack of time is
    logged as skipped, the first failure is the exit status, and OUT/results.tgz holds every step that ran."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    script = ("source benchmarks/steps.sh; steps_init s.log\n"
              "steps_run ok 30 echo hello\n"
              "steps_run cut 21 sleep 30\n"
              "steps_run late 60 echo never\n"
              'exit "$STEPS_STATUS"\n')
    env = {**os.environ, "OUT": str(out), "LIMIT_S": "41"}  # the cut step leaves <= 20 s
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = (out / "s.log").read_text()
    assert run.returncode == 124, (run.stdout, run.stderr)
    assert "ok: rc=0" in log and "cut: rc=124" in log and "late: skipped (no time left)" in log, log
    assert (out / "ok.log").read_text() == "hello\n" and not (out / "late.log").exists()
    with tarfile.open(out / "results.tgz") as tar:
        assert {"./ok.log", "./cut.log", "./s.log"} <= set(tar.getnames())


def test_device_steps_run_only_the_selected_steps(tmp_path):
    """STEPS="a b" runs only the steps named there: the others write no log, are noted as not selected and leave
    the exit status 0 (a step left out on purpose is not a step skipped for lack of time); a name no step has (a typo,
    or names joined by a comma) runs the steps that do match, then steps_exit names it and exits 2."""
    script = ("source benchmarks/steps.sh; steps_init s.log\n"
              "steps_run one 30 echo one\n"
              "steps_run other 30 false\n"
              "steps_run two 30 echo two\n"
              "steps_exit\n")

    def run(steps):
        out = tmp_path / steps.replace(" ", "_").replace(",", "-")
        out.mkdir()
        env = {**os.environ, "OUT": str(out), "LIMIT_S": "60", "STEPS": steps}
        done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        return done, out, (out / "s.log").read_text()

    done, out, log = run("one two")
    assert done.returncode == 0, (done.stdout, done.stderr, log)
    assert "one: rc=0" in log and "two: rc=0" in log and "other: not selected" in log, log
    assert (out / "two.log").read_text() == "two\n" and not (out / "other.log").exists()
    done, out, log = run("two,one")
    assert done.returncode == 2 and "STEPS names 'two,one', which is no step" in done.stderr, (done.stdout, log)
    assert not (out / "one.log").exists() and not (out / "two.log").exists()
    done, out, log = run("one tw")
    assert done.returncode == 2 and "'tw'" in log and "one: rc=0" in log, log


@pytest.mark.slow
def test_ab_e2e_pairs_two_arms_with_a_control_row(tmp_path):
    """benchmarks/ab_e2e.py (the paired A/B of two drafters) on the CPU, the shipped pair, one prompt: the control
    row (A against itself) comes first, the same drafter in both arms accepts the same, every greedy arm equals AR,
    each B / A lies within its own range, and the results file names both arms; --repeats 1 (no B A order), no
    prompts and no seeds are refused."""
    from benchmarks.ab_e2e import main  # noqa: PLC0415 (benchmarks/ is not a package on the path)

    main(["--out", str(tmp_path), "--tag", "t", "--num-prompts", "1", "--max-new-tokens", "6", "--budgets", "3",
          "--temperatures", "0", "--repeats", "2"])
    data = json.loads((tmp_path / "ab_t.json").read_text())
    rows = data["rows"]
    assert [(r["method"], r["budget"], r["control"]) for r in rows] == [("dflash", None, True), ("dflash", None, False),
                                                                         ("ddtree", 3, False)]
    for r in rows:
        assert r["accept_a"] == r["accept_b"] and r["greedy_equals_ar_a"] and r["greedy_equals_ar_b"]
        assert r["b_over_a_min"] <= r["b_over_a"] <= r["b_over_a_max"] and r["new_tokens"] == 6
    assert data["meta"]["a"] == data["meta"]["b"] == "kdtree_jax/assets/drafter" and data["ar_tokens_per_s"]["0"] > 0
    assert "| 0 | dflash (control: A vs A) | - |" in (tmp_path / "ab_t.md").read_text()
    for bad in (["--repeats", "1"], ["--num-prompts", "0"], ["--seeds", "0"]):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path), *bad])
