"""Checkpoint storage: overwrite replaces only a checkpoint, normalised destinations, a commit that a
crash cannot lose (finished or rolled back by the next load or write), one writer at a time, no
temporaries left behind, per-tensor sha256 verified on load, and one-line read errors.

Crashes are real: a child process dies (os._exit) at the chosen step. Expected params come from the
trees that were saved; expected checksums from hashlib on those trees' bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL, error_lines

import kdtree_jax as kj
from kdtree_jax import cli, storage
from kdtree_jax.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from kdtree_jax.convert import convert_hf
from kdtree_jax.storage import CheckpointRecoveryWarning, UnverifiedCheckpointWarning

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "kdtree_jax" / "assets"
DRAFTER = kj.DrafterConfig.for_target(SMALL, block_size=4)


@pytest.fixture(autouse=True)
def python_sigint():
    """Python's own Ctrl-C handler during each test: the interrupt tests send real SIGINTs, and a run started in
    the background by a non-interactive shell inherits SIGINT ignored (then no KeyboardInterrupt would come)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def drafter_params(seed: int) -> dict:
    """Made on the CPU, as the child processes below make theirs: random init is not bit-identical across
    platforms (a GPU's normal sampler rounds differently), and the tests compare bits."""
    with jax.default_device(jax.devices("cpu")[0]):
        return kj.init_drafter_params(DRAFTER, jax.random.key(seed), jnp.float32)


def assert_same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def run_cli(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def child(code: str, *args) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python (kdtree_jax importable, CPU) with sys.argv[1:] = args."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300, check=False)


CHILD_PREAMBLE = """
import os, sys
import jax, jax.numpy as jnp
import kdtree_jax as kj
cfg = kj.DrafterConfig.for_target(kj.ModelConfig.tiny().replace(num_hidden_layers=2), block_size=4)
params = kj.init_drafter_params(cfg, jax.random.key(int(sys.argv[2])), jnp.float32)
path = sys.argv[1]
"""


# ------------------------------------------------------------------------- 1. overwrite safety
def test_overwrite_never_replaces_a_directory_of_other_files(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"refusing to overwrite .*mine: it holds files that are not part "
                       r"of a checkpoint: \['notes.txt'\]"):
        save_checkpoint(mine, DRAFTER, drafter_params(0), overwrite=True)
    monkeypatch.chdir(mine)  # `kdtree-jax init . --overwrite` in a directory of files
    rc, _, err = run_cli(["init", ".", "--overwrite"], capsys)
    assert rc == 2 and "refusing to overwrite" in err and "notes.txt" in err and len(err.splitlines()) == 1
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # no lock or temporary left next to it


def test_overwrite_refuses_files_symlink_targets_and_doctored_checkpoints(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="refusing to overwrite .*file: it is not a directory"):
        save_checkpoint(tmp_path / "file", DRAFTER, drafter_params(0), overwrite=True)
    ckpt = save_checkpoint(tmp_path / "ckpt", DRAFTER, drafter_params(0))
    (ckpt / "params" / "my_data").mkdir()
    with pytest.raises(CheckpointError, match=r"params/ holds entries the checkpoint does not name: \['my_data'\]"):
        save_checkpoint(ckpt, DRAFTER, drafter_params(1), overwrite=True)
    (ckpt / "params" / "my_data").rmdir()
    (ckpt / "config.json").write_text(json.dumps({"something": "else"}))
    with pytest.raises(CheckpointError, match="not a readable kdtree-jax checkpoint"):
        save_checkpoint(ckpt, DRAFTER, drafter_params(1), overwrite=True)
    assert (tmp_path / "file").read_text() == "x" and json.loads((ckpt / "config.json").read_text()) == {
        "something": "else"}


def test_convert_overwrite_never_touches_its_input_or_a_directory_holding_it(tmp_path, capsys):
    parent = tmp_path / "models"
    hf = parent / "hf"
    shutil.copytree(FIXTURES / "hf_dsv3_f32", hf)
    before = sorted(p.name for p in hf.iterdir())
    for out, message in [(parent, "it contains the Hugging Face directory"), (hf, "it is the Hugging Face directory"),
                         (hf / ".." / "hf", "it is the Hugging Face directory"), (tmp_path, "it contains")]:
        rc, _, err = run_cli(["convert", hf, out, "--overwrite", "--no-progress"], capsys)
        assert rc == 2 and message in err and len(err.splitlines()) == 1, err
        with pytest.raises(CheckpointError, match=message):
            convert_hf(hf, out, jnp.float32, progress=False, overwrite=True)
    assert sorted(p.name for p in hf.iterdir()) == before and os.listdir(parent) == ["hf"]


def test_init_drafter_never_replaces_its_target(tmp_path, capsys):
    target = tmp_path / "target"
    assert cli.main(["init", str(target), "--layers", "1"]) == 0
    rc, _, err = run_cli(["init", target, "--drafter", "--target", target, "--overwrite"], capsys)
    assert rc == 2 and "it is the target checkpoint" in err
    assert load_checkpoint(target)[0].num_hidden_layers == 1


# ----------------------------------------------------------------- 2. paths and recoverable commits
def test_dotdot_destination_is_the_same_directory(tmp_path, capsys):
    first, second = drafter_params(1), drafter_params(2)
    save_checkpoint(tmp_path / "X", DRAFTER, first)
    path = save_checkpoint(tmp_path / "X" / ".." / "X", DRAFTER, second, overwrite=True)
    assert path == tmp_path / "X"
    assert_same(load_checkpoint(tmp_path / "X")[1], second)
    assert os.listdir(tmp_path) == ["X"]
    rc, _, err = run_cli(["init", tmp_path / "X" / ".." / "X", "--drafter", "--overwrite"], capsys)
    assert rc == 0 and err == "" and os.listdir(tmp_path) == ["X"]
    assert load_checkpoint(tmp_path / "X")[0].block_size == 16  # the CLI's drafter replaced the one above


CRASH_AT_SECOND_RENAME = CHILD_PREAMBLE + """
real_rename = os.rename
def rename(src, dst, *a, **k):
    if os.path.basename(str(src)).startswith(".X.tmp-"):  # tmp -> X: the second rename of an overwrite
        os._exit(3)  # the process dies here: no cleanup of any kind runs
    return real_rename(src, dst, *a, **k)
os.rename = rename
kj.save_checkpoint(path, cfg, params, overwrite=True)
"""


def _crash_between_renames(tmp_path) -> Path:
    """X holds seed 1's drafter; a child overwriting it with seed 2's dies between the two renames."""
    save_checkpoint(tmp_path / "X", DRAFTER, drafter_params(1))
    done = child(CRASH_AT_SECOND_RENAME, tmp_path / "X", 2)
    assert done.returncode == 3, done.stderr
    names = sorted(os.listdir(tmp_path))
    assert "X" not in names and ".X.commit" in names  # the state the issue describes: X gone
    assert any(n.startswith(".X.old-") for n in names) and any(n.startswith(".X.tmp-") for n in names)
    return tmp_path / "X"


def test_a_crash_between_the_renames_is_finished_by_the_next_load(tmp_path):
    path = _crash_between_renames(tmp_path)
    with pytest.warns(CheckpointRecoveryWarning, match="finished the interrupted commit of .*X"):
        _, loaded = load_checkpoint(path)
    assert_same(loaded, drafter_params(2))  # the new checkpoint was complete: the commit is finished
    assert sorted(os.listdir(tmp_path)) == ["X"]


def test_a_crash_between_the_renames_is_finished_by_the_next_write(tmp_path):
    path = _crash_between_renames(tmp_path)
    with pytest.warns(CheckpointRecoveryWarning, match="finished the interrupted commit"):
        save_checkpoint(path, DRAFTER, drafter_params(3), overwrite=True)
    assert_same(load_checkpoint(path)[1], drafter_params(3))
    assert sorted(os.listdir(tmp_path)) == ["X"]


def test_an_interrupted_commit_without_the_new_copy_is_rolled_back(tmp_path):
    """On-disk state built by hand: the journal names a new copy that is gone, X was renamed away."""
    path = save_checkpoint(tmp_path / "X", DRAFTER, drafter_params(1))
    os.rename(path, tmp_path / ".X.old-0123abcd")
    (tmp_path / ".X.commit").write_text(json.dumps({"tmp": ".X.tmp-0123abcd", "old": ".X.old-0123abcd", "pid": 1}))
    with pytest.warns(CheckpointRecoveryWarning, match="rolled back .*the previous checkpoint is back in place"):
        _, loaded = load_checkpoint(path)
    assert_same(loaded, drafter_params(1))
    assert sorted(os.listdir(tmp_path)) == ["X"]
    # An older version's interrupted commit (no journal): X hidden as .X.old-*, which the next load restores.
    os.rename(path, tmp_path / ".X.old-89abcdef")
    with pytest.warns(CheckpointRecoveryWarning, match="restored .*X from .X.old-89abcdef"):
        assert_same(load_checkpoint(path)[1], drafter_params(1))


def test_a_failed_second_rename_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "X", DRAFTER, drafter_params(1))
    real_rename = os.rename

    def failing(src, dst, *args, **kwargs):
        if Path(src).name.startswith(".X.tmp-"):
            raise OSError("simulated failure of the second rename")
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="simulated failure"):
        save_checkpoint(path, DRAFTER, drafter_params(2), overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["X"]
    assert_same(load_checkpoint(path)[1], drafter_params(1))


# --------------------------------------------------------------------------- 3. one writer at a time
def test_concurrent_writers_of_one_new_path_exactly_one_wins(tmp_path):
    path, n = tmp_path / "X", 4
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def write(i):
        barrier.wait()
        try:
            save_checkpoint(path, DRAFTER, drafter_params(10 + i))
            results[i] = "ok"
        except CheckpointError as e:
            results[i] = str(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in enumerate(results) if r == "ok"]
    assert len(winners) == 1, results
    for i, r in enumerate(results):
        if i != winners[0]:
            assert "is being written by another process" in r or "already exists" in r, r
    assert_same(load_checkpoint(path)[1], drafter_params(10 + winners[0]))
    assert sorted(os.listdir(tmp_path)) == ["X"]


def test_a_second_process_cannot_write_while_the_first_does(tmp_path):
    path = tmp_path / "X"
    writer = CheckpointWriter(path, DRAFTER, param_dtype="float32")
    try:
        done = child(CHILD_PREAMBLE + "kj.save_checkpoint(path, cfg, params)", path, 5)
        assert done.returncode != 0
        assert f"is being written by another process (pid {os.getpid()})" in done.stderr
        cli_done = subprocess.run([sys.executable, "-m", "kdtree_jax.cli", "init", path, "--drafter"],
                                  capture_output=True, text=True, cwd=REPO, timeout=300, check=False,
                                  env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
        assert cli_done.returncode == 2 and "is being written by another process" in cli_done.stderr
        assert len(cli_done.stderr.splitlines()) == 1
        params = drafter_params(6)
        for entry in writer.entries:
            writer.write(entry, params[entry])
        writer.commit()
    finally:
        writer.abort()
    assert_same(load_checkpoint(path)[1], params)
    assert sorted(os.listdir(tmp_path)) == ["X"]


def test_a_destination_that_appears_meanwhile_is_never_replaced(tmp_path):
    path = tmp_path / "X"
    with pytest.raises(CheckpointError, match="appeared while the checkpoint was being written"):
        with CheckpointWriter(path, DRAFTER, param_dtype="float32") as writer:
            params = drafter_params(0)
            for entry in writer.entries:
                writer.write(entry, params[entry])
            path.mkdir()  # someone else (not a kdtree-jax writer) creates X
            (path / "theirs.txt").write_text("theirs")
    assert os.listdir(path) == ["theirs.txt"] and sorted(os.listdir(tmp_path)) == ["X"]


# ---------------------------------------------------------------------------- 4. no temporaries left
def test_ctrl_c_during_a_background_save_leaves_nothing(tmp_path, monkeypatch, small_init_params):
    """A real SIGINT lands while Orbax is still writing an entry in its background thread."""
    real = storage.checksums
    calls = []

    def interrupted(flat):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(flat)

    monkeypatch.setattr(storage, "checksums", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "X", SMALL, small_init_params)
    assert os.listdir(tmp_path) == []


def test_ctrl_c_during_the_commit_is_held_until_it_is_done(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "X", DRAFTER, drafter_params(1))
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if Path(src).name == "X":  # the first rename of the commit: Ctrl-C now
            os.kill(os.getpid(), signal.SIGINT)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, DRAFTER, drafter_params(2), overwrite=True)
    monkeypatch.undo()
    # The interrupt was raised only after both renames: the new checkpoint is in place, nothing hidden.
    assert ".X.commit" not in os.listdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no recovery needed
        assert_same(load_checkpoint(path)[1], drafter_params(2))
    assert sorted(os.listdir(tmp_path)) == ["X"]


def test_after_an_interrupt_leftovers_collected_at_shutdown_stay_quiet():
    """After a Ctrl-C the CLI's "interrupted" stays the last line on stderr: an object of the interrupted work whose
    __del__ raises when collected (an asyncio loop caught half-closed: "Exception ignored in: BaseEventLoop.__del__",
    which failed the test below in CI once) prints nothing, nor does a warning; before the interrupt both still do."""
    code = ("import sys, warnings\n"
            "from kdtree_jax import cli\n"
            "class Leftover:\n"
            "    def __del__(self):\n"
            "        raise ValueError('Invalid file descriptor: -1')\n"
            "Leftover()\n"
            "warnings.warn('before')\n"
            "print('kdtree-jax: interrupted', file=sys.stderr)\n"
            "cli._quiet_after_interrupt()\n"
            "Leftover()\n"
            "warnings.warn('after')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    before, _, after = run.stderr.partition("kdtree-jax: interrupted")
    assert "Exception ignored" in before and "before" in before, run.stderr  # the hook and the filter did something
    assert after.strip() == "", run.stderr


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_ctrl_c_during_cli_convert_leaves_nothing_half_written(tmp_path, delay):
    """The issue's scenario: SIGINT to a real `kdtree-jax convert` once its temporary exists. Three orders are
    possible, and each leaves either nothing or the whole checkpoint: finished first (exit 0), interrupted
    before the commit (130, nothing), or interrupted during or after it (130, the checkpoint whole, and said)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_jax.cli", "convert", FIXTURES / "hf_k2_int4",
                             tmp_path / "out", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not any(n.startswith(".out.tmp-") for n in os.listdir(tmp_path)) and proc.poll() is None:
            assert time.monotonic() < deadline, "the conversion never started writing"
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode == 0:  # finished before the signal arrived: the checkpoint, nothing else
        assert os.listdir(tmp_path) == ["out"]
    elif os.listdir(tmp_path) == ["out"]:  # landed after the commit (seen in CI under load, 2026-12-07)
        assert proc.returncode == 130, err
        assert err.strip().endswith(f"interrupted; {tmp_path / 'out'} had been written in full before it and is kept")
        load_checkpoint(tmp_path / "out")  # whole: loads and its checksums verify
    else:
        assert proc.returncode == 130 and err.strip().endswith("kdtree-jax: interrupted"), err
        assert os.listdir(tmp_path) == []


def test_ctrl_c_held_back_by_a_commit_says_the_checkpoint_is_kept(tmp_path, monkeypatch, capsys):
    """The order the test above meets only by chance, made certain: a Ctrl-C during the commit is held back
    and raised after it, so the CLI exits 130 with the finished checkpoint in place and says so."""
    fsync_dir = storage._fsync_dir

    def interrupted_fsync(path):
        monkeypatch.setattr(storage, "_fsync_dir", fsync_dir)  # once
        os.kill(os.getpid(), signal.SIGINT)  # held back by the commit's deferred_interrupts
        fsync_dir(path)

    monkeypatch.setattr(storage, "_fsync_dir", interrupted_fsync)
    assert cli.main(["convert", str(FIXTURES / "hf_k2_int4"), str(tmp_path / "out"), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"kdtree-jax: interrupted; {tmp_path / 'out'} had been written in full before it and is kept")
    assert os.listdir(tmp_path) == ["out"]
    load_checkpoint(tmp_path / "out")


def test_temporaries_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    # A writer that dies (SIGKILL-like) halfway through: its temporary directory stays...
    code = CHILD_PREAMBLE + """
from kdtree_jax.checkpoint import CheckpointWriter
w = CheckpointWriter(path, cfg, param_dtype="float32")
w.write(w.entries[0], params[w.entries[0]])
os._exit(9)
"""
    done = child(code, tmp_path / "X", 1)
    assert done.returncode == 9, done.stderr
    stale = [n for n in os.listdir(tmp_path) if n.startswith(".X.tmp-")]
    assert len(stale) == 1 and (tmp_path / stale[0] / "params").is_dir()
    # ...plus one built by hand, as an older version would leave it (a lock file whose pid is gone).
    (tmp_path / ".X.tmp-deadbeef" / "params").mkdir(parents=True)
    (tmp_path / ".X.lock").write_text("999999999")
    with pytest.warns(CheckpointRecoveryWarning, match=r"removed 2 temporary directories left by interrupted writes"):
        save_checkpoint(tmp_path / "X", DRAFTER, drafter_params(2))
    assert sorted(os.listdir(tmp_path)) == ["X"]
    assert_same(load_checkpoint(tmp_path / "X")[1], drafter_params(2))


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    writer = CheckpointWriter(tmp_path / "X", DRAFTER, param_dtype="float32")
    try:
        with pytest.raises(CheckpointError, match="being written by another process"):
            save_checkpoint(tmp_path / "X", DRAFTER, drafter_params(0))
        assert writer._tmp.is_dir()
    finally:
        writer.abort()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------ 5. checksums
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    params = kj.init_params(SMALL, jax.random.key(7))
    path = save_checkpoint(tmp_path_factory.mktemp("sums") / "target", SMALL, params)
    return path, params


def _flat(tree) -> dict:
    return {"/".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_checksums_are_the_sha256_of_each_tensors_bytes(target):
    path, params = target
    record = json.loads((path / "config.json").read_text())["checksums"]
    assert record["algorithm"] == "sha256"
    assert len(record["tensors"]) == len(jax.tree.leaves(params))
    want = hashlib.sha256(np.asarray(params["layers_1"]["attn"]["q_b"]).tobytes()).hexdigest()
    assert record["tensors"]["layers_1/attn/q_b"] == want


def _corrupt_copy(path: Path, dst: Path, at: str = "middle") -> Path:
    """A copy of the checkpoint with two bytes flipped in its largest tensor data file."""
    shutil.copytree(path, dst)
    data = max((f for f in dst.rglob("*") if f.is_file() and f.parent.name == "d" and "ocdbt" in str(f.parent)),
               key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    pos = len(raw) // 2 if at == "middle" else 5
    raw[pos] ^= 0xFF
    raw[pos + 1] ^= 0x55
    data.write_bytes(bytes(raw))
    return dst


def test_flipped_bytes_are_caught_and_name_the_tensor(target, tmp_path, capsys):
    path, params = target
    bad = _corrupt_copy(path, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=r"tensor (\S+) is corrupt: its bytes do not match the sha256") as info:
        load_checkpoint(bad)
    name = str(info.value).split("tensor ")[1].split(" is corrupt")[0]
    _, loaded = load_checkpoint(bad, verify=False)  # the opt-out loads the damaged values
    differ = [k for k, v in _flat(loaded).items() if not np.array_equal(np.asarray(v), np.asarray(_flat(params)[k]))]
    assert differ == [name]
    rc, out, err = run_cli(["verify", bad], capsys)
    assert rc == 2 and f"tensor {name} is corrupt" in err and len(err.splitlines()) == 1
    rc, out, err = run_cli(["verify", path], capsys)
    assert rc == 0 and f"all {len(jax.tree.leaves(params))} tensors" in out and err == ""
    rc, out, err = run_cli(["generate", "--checkpoint", bad, "--max-new-tokens", "1", "--no-warmup"], capsys)
    assert rc == 2 and f"tensor {name} is corrupt" in err
    rc, out, err = run_cli(["generate", "--checkpoint", bad, "--max-new-tokens", "1", "--no-warmup", "--no-verify"],
                           capsys)
    assert rc == 0, err


def test_checkpoints_without_checksums_still_load_with_a_note(target, tmp_path, capsys):
    """A checkpoint written before checksums were recorded (format as the first shipped pair) loads with a
    note, `verify` says it cannot check it, verify=False opts out silently; the shipped pair carries them."""
    assert "checksums" in json.loads((SHIPPED / "drafter" / "config.json").read_text())
    assert verify_checkpoint(SHIPPED / "drafter")["tensors"] > 0
    old = tmp_path / "old"
    shutil.copytree(target[0], old)
    meta = json.loads((old / "config.json").read_text())
    del meta["checksums"]
    (old / "config.json").write_text(json.dumps(meta))
    with pytest.warns(UnverifiedCheckpointWarning, match="carries no tensor checksums"):
        _, params = load_checkpoint(old)
    assert_same(params, target[1])
    rc, _, err = run_cli(["verify", old], capsys)
    assert rc == 2 and "carries no tensor checksums" in err and len(err.splitlines()) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(load_checkpoint(old, verify=False)[1], target[1])  # opted out: no note either


def test_verify_has_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    out = capsys.readouterr().out
    assert "sha256" in out and "CHECKPOINT" in out
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "--no-verify" in capsys.readouterr().out


# ------------------------------------------------------------------------- 9. one-line read errors
def test_a_corrupt_compressed_tensor_is_one_line_naming_it(target, tmp_path, capsys, caplog):
    bad = _corrupt_copy(target[0], tmp_path / "bad", at="frame header")
    caplog.set_level(logging.DEBUG)
    for _ in range(3):  # repeated loads in one process made asyncio log every failed read's traceback
        rc, out, err = run_cli(["generate", "--checkpoint", bad, "--max-new-tokens", "1", "--no-warmup"], capsys)
        assert rc == 2 and out == ""
        assert len(error_lines(err)) == 1, err  # generate's open progress line aside, one line
        assert re.match(r"kdtree-jax: error: data corruption in tensor \S+ of .*bad/params/\w+: "
                        r"ZSTD_decompressStream\(\) failed", error_lines(err)[0]), err
        assert len(err) < 400 and "TensorStore" not in err
    noisy = [r for r in caplog.records if r.name in ("asyncio", "absl") and r.levelno >= logging.WARNING]
    assert noisy == [], [r.getMessage()[:200] for r in noisy[:3]]


def test_quiet_tensor_io_drops_asyncio_and_absl_records_only_inside(caplog):
    caplog.set_level(logging.DEBUG)
    with storage.quiet_tensor_io():
        logging.getLogger("asyncio").error("unhandled exception during asyncio.run() shutdown")
        logging.getLogger("absl").warning("Failed to get item metadata")
    assert caplog.records == []
    logging.getLogger("asyncio").error("after")
    assert [r.getMessage() for r in caplog.records] == ["after"]


def test_remove_tree_settled_outlasts_a_straggling_writer(tmp_path):
    """A background writer that recreates the folder after it was removed (what Orbax's threads did after an
    interrupted convert in CI) finds it removed again: the path is gone once the call returns."""
    from kdtree_jax import storage

    target = tmp_path / ".X.tmp-0123abcd"
    (target / "params").mkdir(parents=True)

    def straggler():
        time.sleep(0.15)
        (target / "params" / "late").mkdir(parents=True, exist_ok=True)

    thread = threading.Thread(target=straggler)
    thread.start()
    storage.remove_tree_settled(target, quiet_s=0.4, limit_s=3.0)
    thread.join()
    assert not target.exists()
