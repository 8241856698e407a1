"""Sharding: mesh specs, the layout rules and their divisibility errors (in process, any device count),
and on 8 simulated CPU devices (a subprocess, `sharded_worker.py`: the device count must be set before
jax is imported, and tests/conftest.py imports it first) that every mesh shape dividing the tiny/mid
configs gives the one-device greedy tokens for AR and DDTree, dense and INT4, that a checkpoint
restored onto a mesh equals the unsharded restore, the CLI's --mesh, and the benchmark script."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import TINY
from jax.sharding import PartitionSpec as P

import kdtree_jax as kj
from kdtree_jax import sharding
from kdtree_jax.sharding import MeshError
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight

ROOT = Path(__file__).resolve().parents[1]

WORKER_TIMEOUT_S = 900


def _load_bench_sharded():
    spec = importlib.util.spec_from_file_location("bench_sharded", ROOT / "benchmarks" / "bench_sharded.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ in process
@pytest.mark.parametrize("spec,want", [
    ("expert=2,tensor=1", {"expert": 2, "tensor": 1}),
    ("tensor=4", {"expert": 1, "tensor": 4}),
    (" expert = 8 ", {"expert": 8, "tensor": 1}),
    ("", {"expert": 1, "tensor": 1}),
    ({"expert": 2}, {"expert": 2, "tensor": 1}),
])
def test_parse_mesh_spec(spec, want):
    assert sharding.parse_mesh_spec(spec) == want


@pytest.mark.parametrize("spec,match", [
    ("expert=2,data=2", "unknown mesh axis 'data'"),
    ("expert:2", "want comma-separated AXIS=SIZE"),
    ("expert=two", "want comma-separated AXIS=SIZE"),
    ("expert=0", "must be a positive integer"),
    ("expert=2,expert=2", "given twice"),
    (3, "spec string"),
])
def test_bad_mesh_specs_are_clear(spec, match):
    with pytest.raises(MeshError, match=match):
        sharding.parse_mesh_spec(spec)


def test_make_mesh_needs_enough_devices():
    have = len(jax.devices())
    with pytest.raises(MeshError, match=f"needs {have + 1} devices, but only {have} are available"):
        sharding.make_mesh(f"expert={have + 1}")
    mesh = sharding.make_mesh("expert=1,tensor=1")
    assert mesh.axis_names == ("expert", "tensor") and mesh.devices.size == 1


@pytest.mark.parametrize("sizes,match", [
    ({"expert": 3, "tensor": 1}, "n_routed_experts=8 is not divisible by expert=3"),
    ({"expert": 1, "tensor": 4}, "num_attention_heads=6 is not divisible by tensor=4"),
    ({"expert": 1, "tensor": 3}, "moe_intermediate_size=64 is not divisible by tensor=3"),
    ({"expert": 16, "tensor": 1}, "n_routed_experts=8 is not divisible by expert=16"),
])
def test_mesh_that_does_not_divide_the_model_is_named(sizes, match):
    with pytest.raises(MeshError, match=match):
        sharding.check_mesh(TINY, sizes)


def test_heads_and_vocab_and_int4_scales_are_checked():
    cfg = TINY.replace(moe_intermediate_size=96, intermediate_size=96 * 4, num_hidden_layers=2)
    with pytest.raises(MeshError, match="num_attention_heads=6 is not divisible by tensor=4"):
        sharding.check_mesh(cfg.replace(num_attention_heads=6), {"expert": 1, "tensor": 4})
    with pytest.raises(MeshError, match="vocab_size=404 is not divisible by expert\\*tensor=8"):
        sharding.check_mesh(TINY.replace(vocab_size=404), {"expert": 8, "tensor": 1})
    # tensor=2 divides I = 96 but not its 96/32 = 3 INT4 scale groups of the row-split down projection
    abstract = jax.eval_shape(lambda: kj.quantize(kj.init_params(cfg, jax.random.key(0)), cfg))
    sharding.check_mesh(cfg, {"expert": 2, "tensor": 2})  # the config alone is fine
    with pytest.raises(MeshError, match="experts/down/scale dim 2 of size 3 .*INT4 scales"):
        sharding.check_mesh(cfg, {"expert": 2, "tensor": 2}, abstract)


def test_layout_rules_for_every_leaf_dense_and_int4():
    params = jax.eval_shape(lambda: kj.init_params(TINY, jax.random.key(0)))
    specs = sharding.param_specs(params)
    layer0, layer1 = specs["layers_0"], specs["layers_1"]
    assert specs["embed_tokens"] == P(("expert", "tensor"), None)
    assert specs["lm_head"] == P(None, ("expert", "tensor"))
    assert layer0["attn"]["q_b"] == P(None, "tensor") and layer0["attn"]["o"] == P("tensor", None)
    assert layer0["attn"]["kv_b"] == P(None, "tensor") and layer0["attn"]["kv_a"] == P(None, None)
    assert layer0["mlp"]["gate"] == P(None, "tensor") and layer0["mlp"]["down"] == P("tensor", None)
    assert layer1["moe"]["experts"]["gate"] == P("expert", None, "tensor")
    assert layer1["moe"]["experts"]["down"] == P("expert", "tensor", None)
    assert layer1["moe"]["shared"]["up"] == P(None, "tensor") and layer1["moe"]["router"] == P(None, None)
    assert layer1["input_norm"] == P(None) and specs["final_norm"] == P(None)
    # INT4 [E, N, K/4] / [E, N, K/32]: the dense [E, K, N] axes with K and N swapped
    qspecs = sharding.param_specs(jax.eval_shape(lambda: kj.quantize(kj.init_params(TINY, jax.random.key(0)),
                                                                     TINY, policy="all_mlp")))
    experts = qspecs["layers_1"]["moe"]["experts"]
    assert experts["gate"] == Int4Weight(P("expert", "tensor", None), P("expert", "tensor", None))
    assert experts["down"] == Int4Weight(P("expert", None, "tensor"), P("expert", None, "tensor"))
    assert qspecs["layers_0"]["mlp"]["down"] == Int4Weight(P(None, "tensor"), P(None, "tensor"))


def test_unknown_leaf_has_no_silent_rule():
    with pytest.raises(MeshError, match="no sharding rule for the params leaf layers_0/attn/new_proj"):
        sharding.param_logical_axes(("layers_0", "attn", "new_proj"), 2)


def test_bytes_per_device_match_hand_arithmetic():
    """K2.6 INT4 on expert=8: every leaf's bytes, counted by hand from the config, per device."""
    cfg = kj.ModelConfig.kimi_k26()
    abstract = kj.checkpoint._abstract_target(cfg, jnp.bfloat16, {"quantization": {"int4_leaves": {
        f"layers_{i}/moe/experts/{w}": "bfloat16" for i in range(1, 61) for w in ("gate", "up", "down")}}})
    got = sharding.params_bytes_per_device(abstract, {"expert": 8, "tensor": 1})
    d, v, e, i = cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    h = cfg.num_attention_heads
    attn = (d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * 192 + d * 576 + 512 + 512 * h * 256
            + h * 128 * d) * 2
    norms = 2 * d * 2
    dense_mlp = 3 * d * cfg.intermediate_size * 2
    moe = (d * e * 4 + e * 4 + 3 * d * i * 2  # router f32, bias f32, shared bf16
           + 3 * e * d * i // 2 // 8 + 3 * e * d * (i // 32) * 2 // 8)  # INT4 experts / 8 devices
    want = 2 * v * d * 2 // 8 + d * 2 + 61 * (attn + norms) + dense_mlp + 60 * moe
    assert got == want
    assert 85e9 < got < 95e9  # ~89 GB of 141 GB per H200 (docs/sharding.md)


def test_without_a_mesh_the_model_code_is_unchanged():
    assert sharding.active_mesh() is None
    x = jnp.ones((2, 3))
    assert sharding.constrain(x, None, None) is x


# ---------------------------------------------------------------------- 8 simulated CPU devices
def _start(*jobs: str) -> subprocess.Popen:
    # simulated CPU devices on any host (on a GPU host jax would otherwise pick the one GPU)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "sharded_worker.py"), *jobs], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def sharded_results():
    """Both workers run at once (one per CPU core); results keyed by (job, check)."""
    procs = [_start("tiny"), _start("mid", "checkpoint")]
    results: dict = {}
    for proc in procs:
        out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
        assert proc.returncode == 0, f"sharded worker failed:\n{err[-4000:]}"
        for line in out.splitlines():
            if line.startswith("RESULT "):
                record = json.loads(line[len("RESULT "):])
                results.setdefault((record["job"], record["check"]), []).append(record)
    return results


def test_dividing_mesh_shapes(sharded_results):
    tiny = sharded_results[("tiny", "dividing_shapes")][0]["shapes"]
    mid = sharded_results[("mid", "dividing_shapes")][0]["shapes"]
    # tiny: 8 experts, 6 heads, I = 64 (INT4 down scales: 2 groups) -> tensor <= 2
    assert tiny == [[1, 2], [2, 1], [2, 2], [4, 1], [4, 2], [8, 1]]
    assert mid == [[1, 4], [1, 8], [2, 4]]  # the tensor = 4, 8 shapes the tiny config cannot take


@pytest.mark.parametrize("job", ["tiny", "mid"])
def test_every_dividing_mesh_gives_the_one_device_greedy_tokens(sharded_results, job):
    assert sharded_results[(job, "ddtree_equals_ar_on_one_device")][0]["equal"]
    runs = sharded_results[(job, "generate")]
    shapes = {tuple(s) for s in sharded_results[(job, "dividing_shapes")][0]["shapes"]}
    if job == "mid":
        shapes = {s for s in shapes if s[1] >= 4}
    for run in runs:
        assert run["equal"], f"{job} {run['case']} on mesh expert={run['mesh'][0]},tensor={run['mesh'][1]}"
        e, t = run["mesh"]
        want = list(run["expert_shape"])  # each device holds E/e experts (and 1/t of the intermediate)
        want[0] //= e
        want[1 if run["case"].endswith("int4") else 2] //= t
        assert run["expert_shard_shape"] == want, run
    covered = {(tuple(r["mesh"]), r["case"].split("/")[0]) for r in runs}
    assert covered == {(s, m) for s in shapes for m in ("ar", "ddtree")}
    formats = {(tuple(r["mesh"]), r["case"].split("/")[1]) for r in runs}
    assert {f for _, f in formats} == {"dense", "int4"}


def test_checkpoint_restores_straight_into_shardings(sharded_results):
    restores = sharded_results[("checkpoint", "restore")]
    assert [r["mesh"] for r in restores] == [[2, 2], [8, 1]]
    for r in restores:
        assert r["same_values"] and r["same_shardings"] and r["shard_shapes"], r
    assert sharded_results[("checkpoint", "drafter_replicated")][0]["ok"]
    assert sharded_results[("checkpoint", "generate_from_sharded_restore")][0]["equal"]


def test_mosaic_expert_layout_on_a_mesh(sharded_results):
    """kj.to_mosaic_experts params shard (experts over expert, the intermediate over tensor, scale_t's
    [E, K/32, N] axes in their own order) and give the one-device tokens."""
    run = sharded_results[("checkpoint", "mosaic_on_mesh")][0]
    assert run["equal"]
    e, groups, d = run["scale_t"]  # down: [E, I/32, D] on mesh expert=2, tensor=2 (I split over tensor)
    assert run["scale_t_shard"] == [e // 2, groups // 2, d]
    kept = sharded_results[("checkpoint", "mosaic_conversion_keeps_the_mesh")][0]
    assert kept["leaves"] == 6 and kept["same_shardings"]  # gate/up/down x (w_i4, scale_t)


def test_cli_mesh(sharded_results):
    run = sharded_results[("checkpoint", "cli_mesh")][0]
    assert run["status"] == [0, 0]
    assert run["tokens_mesh"] == run["tokens_1"] and run["tokens_1"], run  # DDTree on 4 devices == AR on one
    bad = sharded_results[("checkpoint", "cli_bad_mesh")][0]
    assert bad["status"] == 2 and bad["error"] == ("kdtree-jax: error: mesh expert=8,tensor=2 needs 16 devices, "
                                                   "but only 8 are available (cpu)")
    bad = sharded_results[("checkpoint", "cli_mesh_not_dividing")][0]
    assert bad["status"] == 2 and "n_routed_experts=8 is not divisible by expert=3" in bad["error"]


def test_bench_sharded_builds_mosaic_layout_params_on_a_mesh(small_cfg):
    """bench_sharded.random_params_on_mesh(moe_layout="mosaic"): the routed experts made straight in the Mosaic
    kernel's layout, sharded by its rules; the model runs on them (bf16: the kernel on a GPU, its loud XLA
    fallback here)."""
    bench = _load_bench_sharded()
    cfg = small_cfg
    mesh = sharding.make_mesh({"expert": 1, "tensor": 1})
    params = bench.random_params_on_mesh(cfg, mesh, jnp.bfloat16, moe_layout="mosaic")
    gate = params["layers_1"]["moe"]["experts"]["gate"]
    assert isinstance(gate, MosaicInt4Weight) and gate.w_i4.dtype == jnp.int4
    assert gate.w_i4.shape == (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert gate.scale_t.shape == (cfg.n_routed_experts, cfg.hidden_size // 32, cfg.moe_intermediate_size)
    assert float(jnp.abs(gate.w_i4.astype(jnp.float32)).max()) == 8.0  # q in [-8, 7], not a constant
    assert bench.abstract_params(cfg, moe_layout="mosaic")["layers_1"]["moe"]["experts"]["down"].w_i4.shape == \
        (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = kj.forward(params, cfg, jnp.asarray([[3, 4, 5]], jnp.int32))
    assert bool(jnp.isfinite(logits).all())


def test_bench_sharded_runs_on_fake_devices(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",  # simulated CPU devices on any host
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sharded.py"), "--tiny",
                           "--mesh", "expert=2,tensor=2", "--tokens", "1,5", "--new-tokens", "4", "--budget", "3",
                           "--verify-tokens", "1,5", "--context", "32", "--single-gpu-layers", "1",
                           "--round-contexts", "24", "--round-budgets", "3",
                           "--repeats", "1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["mesh"] == "expert=2,tensor=2" and result["devices"] == 4
    assert [row["tokens"] for row in result["moe_exchange"]] == [1, 5]
    for row in result["moe_exchange"]:
        assert row["all_reduce_ms"] > 0 and row["all_to_all_ms"] > 0 and row["max_abs_diff"] < 1e-4
    assert {row["method"] for row in result["decode"]} == {"ar", "ddtree"}
    assert result["decode"][1]["same_tokens_as_ar"]
    assert math.isfinite(result["memory"]["params_bytes_per_device"])
    assert [v["tokens"] for v in result["verify"]] == [1, 5] and result["verify"][0]["layers"] == 2
    assert [v["layers"] for v in result["verify_single_device"]] == [1, 1]
    assert [c["tokens"] for c in result["collective"]] == [1, 5]
    stages = {row["stage"] for row in result["rounds"]}
    assert {"ddtree budget 3: build", "ddtree budget 3: verify (T=4)", "dflash chain: verify (T=16)"} <= stages
    assert all(row["setting"] == "S=24" and row["wall_us"] > 0 for row in result["rounds"])
    table = out.with_suffix(".md").read_text()
    assert "| 5 | 32 |" in table and "MoE token exchange" in table
