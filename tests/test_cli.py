"""The kdtree-jax CLI: every command, its --help, and one clear line (exit 2) for each bad input.

Commands run in-process through `cli.main([...])`; two smoke tests run `python -m kdtree_jax.cli` in a
subprocess to check the real exit status and that no traceback reaches the terminal. Expected values
come from independent sources: load_hf / init_params trees (parameter and byte counts), kj.generate
called directly (tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PROGRESS, error_lines

import kdtree_jax as kj
from kdtree_jax import cli
from kdtree_jax.hf import load_hf
from pallas_kernels.int4 import Int4Weight

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parent.parent


def run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err




def token_lines(out: str) -> list[list[int]]:
    return [[int(t) for t in line.split(":", 1)[1].split()] for line in out.splitlines()
            if line.strip().startswith("tokens:")]


@pytest.fixture(scope="module")
def models(tmp_path_factory, small_cfg):
    """A random 2-layer tiny target + drafter (block 4), the INT4 fixture converted to float32, and a random
    2-layer tiny target with INT4 experts (float32, bf16 scales)."""
    root = tmp_path_factory.mktemp("cli")
    assert cli.main(["init", str(root / "target"), "--preset", "tiny", "--layers", "2", "--seed", "3"]) == 0
    assert cli.main(["init", str(root / "drafter"), "--drafter", "--target", str(root / "target"),
                     "--block-size", "4"]) == 0
    assert cli.main(["convert", str(FIXTURES / "hf_k2_int4"), str(root / "int4"), "--dtype", "float32",
                     "--no-progress"]) == 0
    tiny = small_cfg  # expert dims 192 / 64: the Mosaic kernel's too
    kj.save_checkpoint(root / "int4_tiny", tiny, kj.quantize(kj.init_params(tiny, jax.random.key(3)), tiny))
    return root


# ------------------------------------------------------------------------------------------ --help
def test_every_option_of_every_command_is_explained(capsys):
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(subparsers) == ["convert", "generate", "info", "init", "verify"]
    for name, sub in subparsers.items():
        with pytest.raises(SystemExit) as exit_info:
            cli.main([name, "--help"])
        assert exit_info.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        for action in sub._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
            for option in action.option_strings:
                assert option in text, f"{name} --help does not mention {option}"


# ---------------------------------------------------------------------------------------- commands
def test_init_and_info_count_parameters_and_bytes(models, small_init_params, capsys):
    rc, out, _ = run(["info", models / "target", "--json"], capsys)
    assert rc == 0
    info = json.loads(out)
    params = small_init_params
    leaves = jax.tree.leaves(params)
    assert info["kind"] == "target" and info["config"]["num_hidden_layers"] == 2
    assert info["parameters"] == sum(x.size for x in leaves)
    assert info["bytes_by_dtype"] == {"float32": sum(x.nbytes for x in leaves)}
    assert info["int4_tensors"] == {}
    rc, out, _ = run(["info", models / "target"], capsys)
    assert rc == 0 and "INT4 tensors: none" in out and f"parameters: {info['parameters']:,}" in out
    rc, out, _ = run(["info", models / "drafter", "--json"], capsys)
    assert rc == 0 and json.loads(out)["kind"] == "drafter"
    assert json.loads(out)["config"]["block_size"] == 4


def test_info_lists_int4_tensors_of_a_converted_checkpoint(models, capsys):
    rc, out, _ = run(["info", models / "int4", "--json"], capsys)
    assert rc == 0
    info = json.loads(out)
    _, params = load_hf(FIXTURES / "hf_k2_int4", jnp.float32, progress=False)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Weight))
    want_count = sum(math.prod(leaf.dense_shape) if isinstance(leaf, Int4Weight) else leaf.size for leaf in leaves)
    want_bytes: dict[str, int] = {}
    for x in jax.tree.leaves(params):
        want_bytes[jnp.dtype(x.dtype).name] = want_bytes.get(jnp.dtype(x.dtype).name, 0) + x.nbytes
    assert info["parameters"] == want_count
    assert info["bytes_by_dtype"] == dict(sorted(want_bytes.items()))
    assert sorted(info["int4_tensors"]) == sorted(
        f"layers_{i}/moe/experts/{p}" for i in (1, 2) for p in ("gate", "up", "down"))
    assert info["int4_tensors"]["layers_1/moe/experts/down"] == {"shape [.., N, K]": [8, 64, 32],
                                                                  "scale_dtype": "bfloat16"}
    rc, out, _ = run(["info", models / "int4"], capsys)
    assert "INT4 tensors (6, group 32):" in out and "layers_2/moe/experts/up: [8, 32, 64]" in out


def test_generate_from_converted_checkpoint_equals_hf_and_direct_call(models, capsys):
    prompt = [3, 17, 42, 5]
    common = ["--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "5", "--no-warmup"]
    rc, from_ckpt, _ = run(["generate", "--checkpoint", models / "int4", *common], capsys)
    assert rc == 0
    rc, from_hf, _ = run(["generate", "--hf", FIXTURES / "hf_k2_int4", "--dtype", "float32", *common], capsys)
    assert rc == 0
    cfg, params = load_hf(FIXTURES / "hf_k2_int4", jnp.float32, progress=False)
    direct = kj.generate(cfg, params, [prompt], max_new_tokens=5)
    want = np.asarray(direct.tokens)[0, : int(direct.lengths[0])].tolist()
    assert token_lines(from_ckpt) == token_lines(from_hf) == [want]
    assert "mean acceptance length 1.00" in from_ckpt


def test_generate_casts_a_checkpoint_to_dtype(models, capsys):
    """--dtype with a checkpoint casts its dense weights (INT4 experts stay INT4): the tokens are those of a
    direct call on the cast params, and the run says it cast."""
    from kdtree_jax.weights import cast_params

    prompt = [3, 17, 42, 5]
    rc, out, err = run(["generate", "--checkpoint", models / "int4", "--dtype", "bfloat16", "--prompt",
                        " ".join(map(str, prompt)), "--max-new-tokens", "5", "--no-warmup"], capsys)
    assert rc == 0, err
    assert "cast to bfloat16" in out + err
    cfg, params = kj.load_checkpoint(models / "int4")
    cast = cast_params(params, jnp.bfloat16, cfg)
    assert cast["layers_1"]["moe"]["router"].dtype == jnp.float32  # the router stays float32
    assert isinstance(cast["layers_1"]["moe"]["experts"]["gate"], Int4Weight)
    direct = kj.generate(cfg, kj.prepare_params(cast, cfg), [prompt], max_new_tokens=5)  # as the CLI runs it
    assert token_lines(out) == [np.asarray(direct.tokens)[0, : int(direct.lengths[0])].tolist()]


def test_generate_under_a_dot_algorithm(models, capsys, matmul_precision):
    """--matmul-precision BF16_BF16_F32_X6 (one the CPU has) is applied process-wide and keeps the tokens of a
    direct call under the same setting (greedy, the tiny target)."""
    prompt = [3, 17, 42, 5]
    rc, out, err = run(["generate", "--checkpoint", models / "target", "--prompt", " ".join(map(str, prompt)),
                        "--max-new-tokens", "5", "--no-warmup", "--matmul-precision", "BF16_BF16_F32_X6"], capsys)
    assert rc == 0, err
    assert jax.config.jax_default_matmul_precision == "BF16_BF16_F32_X6"
    cfg, params = kj.load_checkpoint(models / "target")
    direct = kj.generate(cfg, params, [prompt], max_new_tokens=5)
    assert token_lines(out) == [np.asarray(direct.tokens)[0, : int(direct.lengths[0])].tolist()]


def test_generate_all_methods_compares_them(models, capsys):
    rc, out, _ = run(["generate", "--checkpoint", models / "target", "--drafter", models / "drafter",
                      "--method", "all", "--budget", "3", "--prompt", "1 2 3", "--prompt", "7 8",
                      "--max-new-tokens", "4", "--no-warmup"], capsys)
    assert rc == 0, out
    table = out[out.index("same tokens as ar"):].splitlines()[1:4]
    assert [row.split()[0] for row in table] == ["ar", "dflash", "ddtree"]
    assert all(row.split()[-1] == "yes" for row in table)  # greedy speculative decoding is lossless
    if jax.default_backend() == "cpu":  # one line on why a CPU cannot show the speedup
        assert out.splitlines()[-1].startswith("note: on a CPU a verify of T tokens costs about T decode steps")
    assert "budget 3" in out
    rc, half, _ = run(["generate", "--checkpoint", models / "target", "--drafter", models / "drafter", "--method",
                       "all", "--budget", "3", "--prompt", "1 2 3", "--prompt", "7 8", "--max-new-tokens", "4",
                       "--no-warmup", "--drafter-dtype", "bfloat16"], capsys)  # a bf16 drafter for this f32 target
    assert rc == 0 and "computing in bfloat16" in half, half
    assert token_lines(half) == token_lines(out)
    rc, auto, _ = run(["generate", "--checkpoint", models / "target", "--drafter", models / "drafter", "--method",
                       "ddtree", "--prompt", "1 2 3", "--prompt", "7 8", "--max-new-tokens", "4", "--no-warmup"],
                      capsys)  # the default budget: auto, with how many rounds verified each budget
    assert rc == 0 and re.search(r"budget auto \(((AR|\d+) x\d+(, )?)+ rounds\)", auto), auto
    assert token_lines(auto) == token_lines(out)[:2]
    ar = token_lines(out)[:2]
    params = kj.load_checkpoint(models / "target")
    direct = kj.generate(*params, [[1, 2, 3], [7, 8]], max_new_tokens=4)
    assert ar == [np.asarray(direct.tokens)[b, : int(direct.lengths[b])].tolist() for b in range(2)]


def test_generate_prints_one_kernel_plan_line_and_takes_pinned_kernels(models, capsys):
    """generate states which kernel each op runs in one line (no per-call notes); --*-kernel flags pin them, the
    tokens stay those of kj.generate; a kernel that cannot run here is a one-line error."""
    common = ["--checkpoint", models / "int4_tiny", "--prompt", "3 17 42 5", "--max-new-tokens", "5", "--no-warmup"]
    rc, auto, err = run(["generate", *common], capsys)
    assert rc == 0 and "note:" not in err
    plan_lines = [line for line in auto.splitlines() if line.startswith("kernels: ")]
    assert len(plan_lines) == 1
    if jax.default_backend() == "cpu":
        assert plan_lines[0] == ("kernels: attention xla (no GPU, this is cpu), linear none (no INT4 dense weights), "
                                 "moe xla (no GPU, this is cpu), tree xla (no GPU, this is cpu), mla folded (small "
                                 "model: 0.1 MiB more a layer, fewer launches)")
    rc, pinned, err = run(["generate", *common, "--moe-kernel", "xla", "--attention-kernel", "xla"], capsys)
    assert rc == 0, err
    assert "attention xla (asked for)" in pinned and "moe xla (asked for)" in pinned
    cfg, params = kj.load_checkpoint(models / "int4_tiny")
    direct = kj.generate(cfg, params, [[3, 17, 42, 5]], max_new_tokens=5)
    assert token_lines(pinned) == token_lines(auto) == [np.asarray(direct.tokens)[0, : int(direct.lengths[0])].tolist()]
    rc, meshed, err = run(["generate", *common, "--mesh", "expert=1,tensor=1"], capsys)  # the fold is skipped there
    assert rc == 0, err
    assert "mla separate (sharded over a mesh)" in meshed and token_lines(meshed) == token_lines(auto)
    if jax.default_backend() == "cpu":
        rc, _, err = run(["generate", *common, "--moe-kernel", "triton"], capsys)
        assert rc == 2 and "moe impl='triton' cannot run: no GPU, this is cpu" in err


@pytest.mark.usefixtures("kernel_moe_for_any_stack")  # the tiny model's stack takes the kernels' path
def test_kernel_plan_on_a_faked_hopper_gpu(models, small_cfg, tmp_path, capsys, monkeypatch):
    """On an H200 (faked: the dispatcher's default device) `info` says where the routed experts run and what a
    user can do about it; a pinned flag gets a hint when auto would run something else."""
    from pallas_kernels import dispatch

    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
    monkeypatch.setattr(dispatch, "default_device", lambda: h200)
    rc, out, _ = run(["info", models / "int4_tiny"], capsys)  # float32 params: not the Mosaic kernel
    assert rc == 0
    assert ("kernels: attention xla (float32: the kernel measured slower than XLA), linear none (no INT4 dense "
            "weights), moe triton (Mosaic GPU kernel "
            "not used: needs bf16 activations, the model runs in float32; GPU), tree triton (GPU), mla folded (small "
            "model: 0.1 MiB more a layer, fewer launches); hint: a bfloat16 "
            "model runs the routed experts on the Mosaic GPU kernel (--dtype bfloat16, or 'convert --dtype bfloat16') "
            "(on this machine)") in out
    tiny = small_cfg
    bf16 = kj.quantize(kj.init_params(tiny, jax.random.key(3), jnp.bfloat16), tiny)
    kj.save_checkpoint(tmp_path / "bf16", tiny, bf16)
    rc, out, _ = run(["info", tmp_path / "bf16", "--json"], capsys)
    assert rc == 0 and json.loads(out)["kernels"]["moe"] == {
        "kernel": "mosaic_gpu", "reason": "experts converted to the Mosaic layout once at load; GPU"}
    line = cli.kernel_plan_line(bf16, tiny, kj.Kernels(moe="triton"))
    assert "moe triton (asked for)" in line and line.endswith("; hint: --moe-kernel auto would run mosaic_gpu")


def test_generate_preset_samples_reproducibly_with_a_seed(capsys):
    argv = ["generate", "--preset", "tiny", "--layers", "1", "--temperature", "0.8", "--top-k", "20",
            "--top-p", "0.9", "--seed", "4", "--max-new-tokens", "4", "--no-warmup"]
    rc, first, _ = run(argv, capsys)
    assert rc == 0 and "temperature 0.8, seed 4" in first
    rc, second, _ = run(argv, capsys)
    assert token_lines(first) == token_lines(second) and len(token_lines(first)[0]) >= 1


def test_tokenizer_text_prompts(monkeypatch, tmp_path, capsys):
    """With --tokenizer, prompts are text and outputs are decoded, prompt included (a stand-in `tokenizers`
    module; not byte-level, so a note says the prompt is not healed: tests/test_healing.py heals)."""

    class FakeTokenizer:
        @staticmethod
        def from_file(path):
            assert Path(path).read_text() == "{}"
            return FakeTokenizer()

        def encode(self, text):
            return types.SimpleNamespace(ids=[ord(c) % 300 for c in text])

        def decode(self, ids):
            return "<" + ",".join(map(str, ids)) + ">"

    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=FakeTokenizer))
    (tmp_path / "tokenizer.json").write_text("{}")
    rc, out, err = run(["generate", "--preset", "tiny", "--layers", "1", "--tokenizer", tmp_path / "tokenizer.json",
                        "--prompt", "hi there", "--max-new-tokens", "3", "--no-warmup"], capsys)
    assert rc == 0, err
    prompt_ids = ",".join(str(ord(c) % 300) for c in "hi there")
    assert f"prompt 0: {prompt_ids.replace(',', ' ')}" in out
    tokens = token_lines(out)[0]
    lines = out.splitlines()
    at = lines.index(f"prompt 0: {prompt_ids.replace(',', ' ')}")
    assert lines[at + 1: at + 4] == [f"  prompt text: '<{prompt_ids}>'",  # the prompt as text, then prompt + new
                                     f"  tokens: {' '.join(map(str, tokens))}",
                                     f"  text: '<{','.join(map(str, [*prompt_ids.split(','), *tokens]))}>'"]
    assert "kdtree-jax: note: prompts are not healed: token healing needs a byte-level BPE tokenizer" in err


def test_generate_says_what_it_is_doing_and_what_the_numbers_mean(models, capsys):
    """stderr: each step (loading, compiling, generating) with its time; stdout: what rounds and target
    forwards count, and whether tokens/s includes compilation."""
    common = ["generate", "--checkpoint", models / "target", "--drafter", models / "drafter", "--method", "ddtree",
              "--budget", "3", "--prompt", "1 2 3", "--max-new-tokens", "6"]
    rc, out, err = run(common, capsys)
    assert rc == 0, err
    progress = [PROGRESS.fullmatch(line) for line in err.splitlines() if PROGRESS.fullmatch(line)]
    started = [m.group(1) for m in progress if not m.group("t2")]
    timed = [m.group(1) for m in progress if m.group("t") or m.group("t2")]
    assert started == timed == ["loading the target", "loading the drafter", "compiling ddtree (a first, untimed call)",
                                "generating ddtree"]
    rounds = re.search(r"  (\d+) new tokens in (\d+) rounds \(draft \+ verify each\); (\d+) target forwards "
                       r"\(the rounds \+ the prompt's prefill\)", out)
    new, n_rounds, forwards = map(int, rounds.groups())
    direct = kj.generate(*kj.load_checkpoint(models / "target"), [[1, 2, 3]], max_new_tokens=6, method="ddtree",
                         drafter=kj.load_checkpoint(models / "drafter"), tree_budget=3)
    assert (new, n_rounds, forwards) == (int(direct.lengths[0]), int(direct.rounds), int(direct.rounds) + 1)
    assert re.search(r"  mean acceptance length \d\.\d\d \(tokens committed per round\); [\d.]+ tokens/s "
                     r"\(compilation excluded\)", out)

    # auto: rounds that skipped the draft (AR steps) are named, as many as generate's tree_budgets record
    rc, out, err = run([*common[:-5], "auto", *common[-4:]], capsys)
    assert rc == 0, err
    direct = kj.generate(*kj.load_checkpoint(models / "target"), [[1, 2, 3]], max_new_tokens=6, method="ddtree",
                         drafter=kj.load_checkpoint(models / "drafter"), tree_budget="auto")
    undrafted = int((np.asarray(direct.tree_budgets)[: int(direct.rounds)] == 0).sum())
    assert undrafted > 0  # the test models' random drafter cannot pay at the CPU's costs
    assert (f"  {int(direct.lengths[0])} new tokens in {int(direct.rounds)} rounds (draft + verify, or an AR step "
            f"where drafting could not pay: {undrafted} of them); ") in out

    rc, out, err = run(["generate", "--checkpoint", models / "target", "--prompt", "1 2 3", "--max-new-tokens", "2",
                        "--no-warmup"], capsys)
    assert rc == 0, err
    assert "compiling" not in err and "kdtree-jax: generating ar (compilation included: --no-warmup) ..." in err
    assert "1 rounds (one decode step each); 2 target forwards" in out
    assert "tokens/s (compilation included: --no-warmup)" in out


def test_a_note_during_a_step_gets_its_own_line(capsys):
    with cli.STATUS.step("compiling ar"):
        cli._show_warning("kernel fallback", UserWarning, "x.py", 1)
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["kdtree-jax: compiling ar ...", "kdtree-jax: note: kernel fallback"]
    assert re.fullmatch(r"kdtree-jax: compiling ar: \d+ ms", err[2]) and len(err) == 3


def test_info_of_a_relative_directory(models, capsys, monkeypatch):
    """`info DIR` with DIR relative to the working directory (Orbax needs absolute paths)."""
    rc, absolute, _ = run(["info", models / "target", "--json"], capsys)
    assert rc == 0
    monkeypatch.chdir(models)
    rc, relative, err = run(["info", "target", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(relative) == json.loads(absolute)
    rc, out, err = run(["info", "target"], capsys)
    assert rc == 0 and out.startswith(f"{models / 'target'}: target checkpoint"), err


@pytest.mark.parametrize("param_dtype", ["int8", "float99", None])
def test_checkpoint_with_a_bad_param_dtype_is_named(param_dtype, models, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(models / "target", target)
    meta = json.loads((target / "config.json").read_text())
    meta["param_dtype"] = param_dtype
    (target / "config.json").write_text(json.dumps(meta))
    for argv in (["info", target], ["generate", "--checkpoint", target, "--no-warmup"]):
        rc, _, err = run(argv, capsys)
        assert rc == 2
        want = (f"kdtree-jax: error: {target / 'config.json'}: param_dtype {param_dtype!r} is not one of "
                "['bfloat16', 'float16', 'float32']")
        assert error_lines(err) == [want]


def test_a_prompt_that_is_not_utf8_is_named(capsys):
    """The shell hands Python undecodable bytes as lone surrogates ('\udcff' for 0xff); the tokenizer
    then raised a TypeError (an "internal error"). Refused before anything is loaded."""
    rc, _, err = run(["generate", "--shipped", "--prompt", "caf\udce9 au lait"], capsys)
    assert rc == 2
    assert err.strip() == ("kdtree-jax: error: --prompt 'caf\\udce9 au lait' is not valid UTF-8: byte 0xe9 at "
                           "position 3 (convert the text to UTF-8, e.g. iconv -t utf-8)")


def test_convert_command_writes_a_loadable_checkpoint(models):
    cfg, params = kj.load_checkpoint(models / "int4")
    want_cfg, want = load_hf(FIXTURES / "hf_k2_int4", jnp.float32, progress=False)
    assert cfg == want_cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------ errors
def _hf_without_config(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    return d


def _damaged(tmp_path, models):
    d = tmp_path / "damaged"
    d.mkdir()
    (d / "config.json").write_text("{oops")
    return d


BAD = [
    ([], "no command given"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["generate"], "exactly one model source"),
    (["generate", "--preset", "tiny", "--checkpoint", "{target}"], "got --checkpoint, --preset"),
    (["generate", "--checkpoint", "{target}", "--layers", "2"], "--layers applies to --preset only"),
    (["generate", "--checkpoint", "{tmp}/nope"], "does not exist"),
    (["generate", "--checkpoint", "{drafter}"], "holds a drafter checkpoint, expected a target"),
    (["generate", "--hf", "{hfbad}"], "no config.json"),
    (["generate", "--checkpoint", "{target}", "--prompt", "hello"], "must be space-separated token ids, got 'hello'"),
    (["generate", "--checkpoint", "{target}", "--prompt", " "], "--prompt is empty"),
    (["generate", "--checkpoint", "{target}", "--prompt", "1 400"], "token id 400 is outside the vocabulary"),
    (["generate", "--checkpoint", "{target}", "--method", "ddtree"], "needs a drafter: --drafter DIR"),
    (["generate", "--checkpoint", "{target}", "--drafter", "{drafter}"], "--drafter is not used by --method ar"),
    (["generate", "--checkpoint", "{target}", "--drafter", "{target}", "--method", "dflash"],
     "holds a target checkpoint, expected a drafter"),
    (["generate", "--checkpoint", "{int4}", "--drafter", "{drafter}", "--method", "dflash"],
     "does not fit the target: drafter hidden_size=192 != target hidden_size=64"),
    (["generate", "--checkpoint", "{target}", "--budget", "4"], "--budget applies to --method ddtree / all"),
    (["generate", "--checkpoint", "{target}", "--drafter", "{drafter}", "--method", "ddtree", "--budget", "0"],
     "--budget must be in [1, 1024], got 0"),
    (["generate", "--checkpoint", "{target}", "--drafter", "{drafter}", "--method", "ddtree", "--budget", "5000"],
     "--budget must be in [1, 1024], got 5000"),
    (["generate", "--checkpoint", "{target}", "--drafter", "{drafter}", "--method", "ddtree", "--budget", "best"],
     "argument --budget: expected an integer or 'auto', got 'best'"),
    (["generate", "--preset", "tiny", "--seed", str(2**64)],
     "argument --seed: must be an integer in [0, 4294967295] (JAX keys take 32-bit seeds"),
    (["generate", "--preset", "tiny", "--seed", "-1"], "argument --seed: must be an integer in [0, 4294967295]"),
    (["init", "{tmp}/x", "--seed", str(2**32)], "got 4294967296"),
    (["generate", "--checkpoint", "{target}", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--checkpoint", "{target}", "--max-new-tokens", "many"], "invalid int value: 'many'"),
    (["generate", "--checkpoint", "{target}", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--checkpoint", "{target}", "--temperature", "1", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["generate", "--checkpoint", "{target}", "--temperature", "1", "--top-k", "0"], "top_k must be an integer"),
    (["generate", "--checkpoint", "{target}", "--stop", "999"], "stop token 999 is outside the vocabulary"),
    (["generate", "--checkpoint", "{target}", "--method", "beam"], "invalid choice: 'beam'"),
    (["generate", "--checkpoint", "{target}", "--moe-kernel", "mosaic"], "invalid choice: 'mosaic'"),
    (["generate", "--checkpoint", "{target}", "--matmul-precision", "fast"], "invalid choice: 'fast'"),
    (["generate", "--checkpoint", "{target}", "--matmul-precision", "BF16_BF16_F32_X9"],
     "--matmul-precision: matmul precision BF16_BF16_F32_X9 is not available on the CPU"),
    (["generate", "--checkpoint", "{target}", "--moe-kernel", "mosaic_gpu"],
     "moe impl='mosaic_gpu' needs INT4 routed experts; this model has dense experts"),
    (["generate", "--checkpoint", "{int4}", "--moe-kernel", "mosaic_gpu"], "moe impl='mosaic_gpu' cannot run: needs"),
    (["generate", "--preset", "tiny", "--layers", "1", "--max-new-tokens", "300"],
     "exceeds the model's max_position_embeddings"),
    (["generate", "--preset", "tiny", "--tokenizer", "{tmp}/tok.json"], "tokenizer file"),
    (["convert", "{tmp}/nope", "{tmp}/out"], "Hugging Face directory"),
    (["convert", "{hfbad}", "{tmp}/out"], "no config.json"),
    (["convert", "{hf}", "{target}"], "already exists"),
    (["convert", "{hf}"], "the following arguments are required: OUT_DIR"),
    (["init", "{target}"], "already exists"),
    (["init", "{tmp}/x", "--target", "{target}"], "--target applies to 'init --drafter' only"),
    (["init", "{tmp}/x", "--drafter", "--target", "{target}", "--preset", "tiny"], "not both"),
    (["init", "{tmp}/x", "--drafter", "--target", "{int4}"], "no mask_token_id: pass --mask-token-id"),
    (["init", "{tmp}/x", "--drafter", "--block-size", "0"], "--block-size must be >= 1"),
    (["init", "{tmp}/x", "--drafter", "--block-size", "1"], "block_size must be in [2, 64]"),
    (["init", "{tmp}/x", "--drafter", "--block-size", "2000"],
     ("block_size must be in [2, 64] (the bonus token plus at least one drafted position; larger blocks take "
      "minutes to compile), got 2000")),
    (["init", "{tmp}/x", "--layers", "0"], "--layers must be >= 1"),
    (["init", "{tmp}/x", "--preset", "kimi"], "invalid choice: 'kimi'"),
    (["info", "{tmp}/nope"], "does not exist"),
    (["info", "{hfbad}"], "is a Hugging Face checkpoint, not a kdtree-jax one: convert it first"),
    (["info", "{damaged}"], "is not valid JSON"),
    (["verify", "{tmp}/nope"], "does not exist"),
    (["verify", "{damaged}"], "is not valid JSON"),
    (["init", "{tmp}", "--overwrite"], "refusing to overwrite"),
    (["convert", "{hf}", "{hf}/..", "--overwrite"], "it contains the Hugging Face directory"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a)[:60] or "empty" for a, _ in BAD])
def test_bad_input_is_one_clear_line(argv, message, models, tmp_path, capsys):
    places = {"target": models / "target", "drafter": models / "drafter", "int4": models / "int4",
              "hf": FIXTURES / "hf_k2_int4", "hfbad": _hf_without_config(tmp_path), "tmp": tmp_path,
              "damaged": _damaged(tmp_path, models)}
    before = sorted(os.listdir(models))
    rc, out, err = run([a.format(**places) for a in argv], capsys)
    assert rc == 2
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("kdtree-jax: error: ") and "internal error" not in lines[0]
    assert message in lines[0], lines[0]
    assert "Traceback" not in err + out
    assert sorted(os.listdir(models)) == before  # nothing written or removed by a failed command
    assert not (tmp_path / "x").exists() and not (tmp_path / "out").exists()


def test_help_states_the_limits(capsys):
    """--budget, --block-size and --seed say their ranges (the values the errors above enforce)."""
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for command, option, limit in (("generate", "--budget", "1 to 1024"), ("init", "--block-size", "2 to 64"),
                                   ("generate", "--seed", "0 to 4294967295"), ("init", "--seed", "0 to 4294967295")):
        action = next(a for a in subparsers[command]._actions if option in a.option_strings)
        assert limit in action.help, (command, option)
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert limit in " ".join(capsys.readouterr().out.split())


def test_missing_tokenizers_package_is_explained(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    (tmp_path / "tok.json").write_text("{}")
    rc, _, err = run(["generate", "--preset", "tiny", "--tokenizer", tmp_path / "tok.json"], capsys)
    assert rc == 2 and "needs the 'tokenizers' package" in err and len(err.strip().splitlines()) == 1


def test_a_bug_is_reported_as_an_internal_error_and_traceback_shows_it(monkeypatch, capsys):
    def boom(args):
        raise KeyError("surprise")

    monkeypatch.setattr(cli, "cmd_info", boom)
    rc, _, err = run(["info", "x"], capsys)
    assert rc == 2 and err.startswith("kdtree-jax: error: internal error (KeyError; rerun with --traceback)")
    with pytest.raises(KeyError, match="surprise"):
        cli.main(["info", "x", "--traceback"])


def test_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    rc, _, err = run(["info", "x"], capsys)
    assert rc == 130 and err.strip() == "kdtree-jax: interrupted"


# ------------------------------------------------------------------------------ subprocess smoke
def _subprocess(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "kdtree_jax.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)


def test_subprocess_help_and_error_exit_status(models):
    done = _subprocess("--help")
    assert done.returncode == 0 and all(c in done.stdout for c in ("generate", "convert", "init", "info", "verify"))
    done = _subprocess("info", models / "missing")
    assert done.returncode == 2
    assert re.fullmatch(r"kdtree-jax: error: checkpoint directory '.*missing' does not exist\n", done.stderr)


def test_subprocess_prompt_bytes_that_are_not_utf8():
    """Raw Latin-1 bytes on the real command line (how the surrogates arise)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "LC_ALL": "C.UTF-8"}
    done = subprocess.run([sys.executable, "-m", "kdtree_jax.cli", "generate", "--shipped", "--prompt",
                           b"caf\xe9"], capture_output=True, env=env, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.decode().startswith("kdtree-jax: error: --prompt 'caf\\udce9' is not valid UTF-8: byte 0xe9")


def test_subprocess_generate_smoke(models):
    done = _subprocess("generate", "--checkpoint", models / "target", "--prompt", "1 2 3", "--max-new-tokens", "3",
                       "--no-warmup")
    assert done.returncode == 0, done.stderr
    assert len(token_lines(done.stdout)[0]) == 3 and "tokens/s" in done.stdout


def test_interrupted_is_the_last_line_even_when_interrupted_work_leaves_warnings(monkeypatch, capsys):
    """Ctrl-C during async checkpoint work leaves a never-awaited coroutine that Python reports when it is
    collected, after the interrupt is handled: it must not follow "interrupted" as a note."""
    async def pending():
        return None

    def interrupted(args):
        work = pending()  # noqa: F841 (never awaited: collected once the interrupt has been handled)
        raise KeyboardInterrupt

    namespace = argparse.Namespace(command="convert", func=interrupted)
    monkeypatch.setattr(cli, "build_parser", lambda: types.SimpleNamespace(parse_args=lambda argv: namespace))
    assert cli.main(["convert"]) == 130
    err = capsys.readouterr().err
    assert err.strip().endswith("kdtree-jax: interrupted"), err


def test_kernel_flags_offer_every_implementation_of_the_dispatcher():
    """cli.KERNEL_CHOICES is a copy of pallas_kernels.dispatch.IMPLS (the CLI does not import the kernels at start):
    the two must agree, or a flag refuses an implementation the engine has (or offers one it has not)."""
    from pallas_kernels import dispatch

    assert cli.KERNEL_CHOICES == dispatch.IMPLS
