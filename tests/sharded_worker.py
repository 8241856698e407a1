"""Runs sharded checks on 8 simulated CPU devices; `tests/test_sharding.py` starts it in a subprocess
because the device count must be set before jax is imported (tests/conftest.py imports jax first).

    python tests/sharded_worker.py JOB...     # JOB: tiny | mid | checkpoint
prints one JSON object per check on stdout, each line starting with "RESULT ". The DDTree runs use an
OracleDraft holding the one-device greedy continuation (cheap to compile; full-depth trees every
round); the checkpoint job's CLI run covers a real DFlash drafter on a mesh.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    # compile time dominates these tiny runs; the 1-device baseline is compiled with the same flags
    "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"])

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
warnings.simplefilter("ignore")  # the CPU W4A16 fallback warning, once per process

from helpers import SMALL, random_params  # noqa: E402

import kdtree_jax as kj  # noqa: E402
from kdtree_jax import cli, sharding  # noqa: E402
from kdtree_jax.ddtree import OracleDraft  # noqa: E402
from kdtree_jax.drafter import DrafterConfig, init_drafter_params  # noqa: E402

# two layers: the dense first layer (tensor-split MLP) and one MoE layer (experts + shared expert)
TINY = SMALL
# wider where the mesh splits, so tensor=4 and 8 divide it (heads, experts, INT4 scale groups)
MID = TINY.replace(num_attention_heads=8, moe_intermediate_size=256)
PROMPTS = [[5, 17, 33, 250], [7], [100, 101, 102, 103, 104, 105]]
NEW_TOKENS = 6
ALL_SHAPES = [(e, t) for e in (1, 2, 4, 8) for t in (1, 2, 4, 8) if 1 < e * t <= 8]


def emit(**record) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def dividing_shapes(cfg) -> list[tuple[int, int]]:
    out = []
    for e, t in ALL_SHAPES:
        try:
            sharding.check_mesh(cfg, {"expert": e, "tensor": t}, kj.quantize(random_params(cfg), cfg))
            out.append((e, t))
        except sharding.MeshError:
            pass
    return out


def run_cases(cfg, name: str, shapes, full: bool) -> None:
    """Every shape runs AR and DDTree; dense/INT4 alternate between shapes (each shape sees both
    formats), or with `full` every shape runs all four (KDTREE_SHARDED_FULL=1: about 2x the time)."""
    params = random_params(cfg, seed=3)
    qparams = kj.quantize(params, cfg, policy="experts")
    common = dict(max_new_tokens=NEW_TOKENS, stop_tokens=())
    cases = {"ar/dense": (params, {}), "ar/int4": (qparams, {})}
    baseline = {case: np.asarray(kj.generate(cfg, p, PROMPTS, **common).tokens) for case, (p, _) in cases.items()}
    for kind, p in (("dense", params), ("int4", qparams)):
        # the drafter proposes the right continuation; the target must still verify every token
        sequence = np.zeros((len(PROMPTS), max(map(len, PROMPTS)) + NEW_TOKENS), np.int32)
        for b, prompt in enumerate(PROMPTS):  # row b: prompt, then its continuation
            sequence[b, :len(prompt) + NEW_TOKENS] = list(prompt) + list(baseline[f"ar/{kind}"][b])
        oracle = OracleDraft(jax.numpy.asarray(sequence), 4, cfg.vocab_size)
        cases[f"ddtree/{kind}"] = (p, dict(method="ddtree", drafter=oracle, tree_budget=5))
        baseline[f"ddtree/{kind}"] = np.asarray(
            kj.generate(cfg, p, PROMPTS, **common, **cases[f"ddtree/{kind}"][1]).tokens)
    emit(job=name, check="dividing_shapes", shapes=[list(s) for s in shapes])
    emit(job=name, check="ddtree_equals_ar_on_one_device",
         equal=bool(np.array_equal(baseline["ddtree/dense"], baseline["ar/dense"])
                    and np.array_equal(baseline["ddtree/int4"], baseline["ar/int4"])))
    pairs = [("ar/dense", "ddtree/int4"), ("ar/int4", "ddtree/dense")]
    for i, (e, t) in enumerate(shapes):
        mesh = sharding.make_mesh({"expert": e, "tensor": t})
        for case in (cases if full else pairs[i % 2]):
            p, kw = cases[case]
            start = time.perf_counter()
            placed = sharding.shard_params(cfg, p, mesh)
            out = kj.generate(cfg, placed, PROMPTS, **common, **kw, mesh=mesh)
            tokens = np.asarray(out.tokens)
            gate = placed["layers_1"]["moe"]["experts"]["gate"]
            gate = jax.tree.leaves(gate)[0]  # an INT4 weight: its packed words
            emit(job=name, check="generate", case=case, mesh=[e, t], equal=bool(np.array_equal(tokens, baseline[case])),
                 expert_shard_shape=list(gate.addressable_shards[0].data.shape), expert_shape=list(gate.shape),
                 seconds=round(time.perf_counter() - start, 2))


def checkpoint_job() -> None:
    cfg = TINY
    qparams = kj.quantize(random_params(cfg, seed=5), cfg, policy="experts")
    dcfg = DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    dparams = init_drafter_params(dcfg, jax.random.key(2))
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = Path(tmp) / "target", Path(tmp) / "drafter"
        kj.save_checkpoint(target, cfg, qparams)
        kj.save_checkpoint(drafter, dcfg, dparams)
        _, plain = kj.load_checkpoint(target)
        for e, t in [(2, 2), (8, 1)]:
            mesh = sharding.make_mesh({"expert": e, "tensor": t})
            _, sharded = kj.load_checkpoint(target, mesh=mesh)
            want = sharding.param_shardings(cfg, plain, mesh)
            leaves = jax.tree_util.tree_flatten_with_path(sharded)[0]
            plain_leaves = jax.tree.leaves(plain)
            want_leaves = jax.tree.leaves(want)
            same_values = all(np.array_equal(np.asarray(a), np.asarray(b)) and a.dtype == b.dtype
                              for (_, a), b in zip(leaves, plain_leaves, strict=True))
            same_shardings = all(a.sharding == s for (_, a), s in zip(leaves, want_leaves, strict=True))
            # each device holds only its shard: shard extent = full extent / mesh axes of that dim
            shard_ok = all(tuple(a.addressable_shards[0].data.shape) == s.shard_shape(a.shape)
                           for (_, a), s in zip(leaves, want_leaves, strict=True))
            emit(job="checkpoint", check="restore", mesh=[e, t], same_values=same_values,
                 same_shardings=same_shardings, shard_shapes=shard_ok, leaves=len(leaves))
        mesh = sharding.make_mesh("expert=2,tensor=2")
        _, drafter_sharded = kj.load_checkpoint(drafter, mesh=mesh)
        emit(job="checkpoint", check="drafter_replicated",
             ok=all(a.sharding.is_fully_replicated and len(a.sharding.device_set) == 4
                    for a in jax.tree.leaves(drafter_sharded)))
        _, restored = kj.load_checkpoint(target, mesh=mesh)
        ref = kj.generate(cfg, plain, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=())
        out = kj.generate(cfg, restored, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=(), mesh=mesh)
        emit(job="checkpoint", check="generate_from_sharded_restore",
             equal=bool(np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))))
        # routed experts in the Mosaic GPU layout (on CPU its XLA path) split over the mesh like INT4 ones
        mosaic = kj.to_mosaic_experts(plain, cfg)
        one = kj.generate(cfg, mosaic, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=())
        placed = sharding.shard_params(cfg, mosaic, mesh)
        split = kj.generate(cfg, placed, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=(), mesh=mesh)
        w = placed["layers_1"]["moe"]["experts"]["down"].scale_t
        emit(job="checkpoint", check="mosaic_on_mesh",
             equal=bool(np.array_equal(np.asarray(split.tokens), np.asarray(one.tokens))),
             scale_t_shard=list(w.addressable_shards[0].data.shape), scale_t=list(w.shape))
        # converting experts that already live on the mesh keeps them there, in the layout's shardings
        converted = kj.to_mosaic_experts(restored, cfg)
        want = sharding.param_shardings(cfg, converted, mesh)
        experts = [(a, s) for a, s in zip(jax.tree.leaves(converted["layers_1"]["moe"]["experts"]),
                                          jax.tree.leaves(want["layers_1"]["moe"]["experts"]), strict=True)]
        emit(job="checkpoint", check="mosaic_conversion_keeps_the_mesh", leaves=len(experts),
             same_shardings=all(a.sharding == s for a, s in experts))

        def run_cli(*extra):
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                status = cli.main(["generate", "--checkpoint", str(target), "--prompt", "5 17 33",
                                   "--max-new-tokens", "5", "--no-warmup", *extra])
            tokens = [line.split(":", 1)[1].split() for line in stdout.getvalue().splitlines()
                      if line.strip().startswith("tokens:")]
            return status, tokens, stderr.getvalue().strip()

        status_1, tokens_1, _ = run_cli("--method", "ar")
        status_m, tokens_m, _ = run_cli("--method", "ddtree", "--drafter", str(drafter), "--budget", "3",
                                        "--mesh", "expert=2,tensor=2")
        emit(job="checkpoint", check="cli_mesh", status=[status_1, status_m], tokens_1=tokens_1, tokens_mesh=tokens_m)
        status_bad, _, error = run_cli("--mesh", "expert=8,tensor=2")
        emit(job="checkpoint", check="cli_bad_mesh", status=status_bad, error=error)
        status_bad, _, error = run_cli("--mesh", "expert=3")
        emit(job="checkpoint", check="cli_mesh_not_dividing", status=status_bad, error=error)


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    full = os.environ.get("KDTREE_SHARDED_FULL") == "1"
    for job in sys.argv[1:]:
        if job == "tiny":
            run_cases(TINY, "tiny", dividing_shapes(TINY), full)
        elif job == "mid":  # the shapes TINY does not reach (tensor = 4, 8)
            run_cases(MID, "mid", [s for s in dividing_shapes(MID) if s[1] >= 4], full)
        elif job == "checkpoint":
            checkpoint_job()
        else:
            raise SystemExit(f"unknown job {job!r}: tiny | mid | checkpoint")
