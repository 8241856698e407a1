"""The file-system side of checkpoints: where a checkpoint may be written, how a write commits
without ever losing the old or the new copy, and how the bytes read back are checked.

A write of checkpoint directory X (all names are siblings of X, in X's parent):
    .X.lock        held (flock) by the one writer of X for the whole write; a second writer fails at once
    .X.tmp-ID      the new checkpoint, written and verified here
    .X.commit      the commit journal {"tmp": ".X.tmp-ID", "old": ".X.old-ID" | null, "pid": ...}, written
                   (and synced) only once .X.tmp-ID is complete
    .X.old-ID      the replaced checkpoint, between the two renames of an overwrite
Commit: journal; X -> .X.old-ID (overwrite only); .X.tmp-ID -> X; remove .X.old-ID; remove the journal.
A crash anywhere in there leaves the journal, and the next load or write of X finishes the commit
(`recover`), with a warning. Temporaries whose writer is gone (the lock is free) are removed by the
next write of X. The lock is an flock: it dies with its process, so it can never go stale.

Each stored array gets a sha256 of its bytes (C order, as saved), recorded in config.json, and is checked
after it is read back (`verify_checksums`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

CHECKSUM_ALGORITHM = "sha256"

# Every checkpoint this process has committed, in order: a Ctrl-C that lands after a commit (it is held
# back during one, then raised) interrupts the program, but that result is whole and stays; the CLI says so.
COMMITTED: list[Path] = []


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable, corrupt or does not match its config."""


def read_config_json(path: str | os.PathLike, what: str, error: type[Exception]) -> tuple[Path, object]:
    """(config.json's path, its parsed JSON) of a checkpoint directory (kdtree-jax's or a Hugging Face one);
    `error(message)` says what is wrong, naming the directory as `what` ("kdtree-jax checkpoint", ...)."""
    path = Path(path)
    if not path.is_dir():
        raise error(f"{what} path {str(path)!r} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise error(f"no config.json in {str(path)!r}: not a {what} directory")
    try:
        return config_file, json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{config_file} is not valid JSON: {e}") from None


class CheckpointRecoveryWarning(UserWarning):
    """An interrupted commit was finished or rolled back, or stale temporaries were removed."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint written before checksums were recorded was loaded without verifying its bytes."""


# ------------------------------------------------------------------------------------ destinations
def destination(path: str | os.PathLike) -> Path:
    """The absolute, normalised path a checkpoint write of `path` lands at: symlinks and '..' resolved
    the way the kernel resolves them, so 'X/../X' is X and the temporaries sit next to the real X."""
    dest = Path(os.path.realpath(os.fspath(path)))
    if dest.parent == dest:
        raise CheckpointError(f"cannot write a checkpoint at the file-system root {dest}")
    return dest


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def checkpoint_layout_problem(path: Path, read_meta: Callable[[Path], dict]) -> str | None:
    """Why `path` is not a directory holding exactly a kdtree-jax checkpoint (None if it is one)."""
    if path.is_symlink() or not path.is_dir():
        return "it is not a directory"
    extra = sorted(set(os.listdir(path)) - {"config.json", "params"})
    if extra:
        return f"it holds files that are not part of a checkpoint: {extra[:5]}{' ...' if len(extra) > 5 else ''}"
    try:
        meta = read_meta(path)
    except CheckpointError as e:
        return f"it is not a readable kdtree-jax checkpoint ({e})"
    params = path / "params"
    if meta.get("format") == 2 and params.is_dir():
        entries = set(meta.get("entries") or [])
        stray = sorted(name for name in os.listdir(params) if name not in entries or not (params / name).is_dir())
        if stray:
            return f"its params/ holds entries the checkpoint does not name: {stray[:5]}"
    return None


def check_destination(path: str | os.PathLike, *, overwrite: bool, read_meta: Callable[[Path], dict],
                      inputs: Mapping[str, str | os.PathLike] = {}) -> Path:
    """The normalised destination, or CheckpointError when writing there could destroy anything but
    a kdtree-jax checkpoint the caller asked to replace (`overwrite`). `inputs` ({description: path},
    e.g. the Hugging Face directory being converted) may be neither the destination nor inside it."""
    dest = destination(path)
    for what, source in inputs.items():
        source = Path(os.path.realpath(os.fspath(source)))
        if _inside(source, dest):
            where = "is" if source == dest else "contains"
            raise CheckpointError(f"refusing to write a checkpoint at {dest}: it {where} the {what} {source}")
    if not os.path.lexists(dest):
        return dest
    if not overwrite:
        raise CheckpointError(f"{dest} already exists (pass overwrite=True / --overwrite to replace it)")
    problem = checkpoint_layout_problem(dest, read_meta)
    if problem:
        raise CheckpointError(f"refusing to overwrite {dest}: {problem}. Overwrite only replaces a kdtree-jax "
                              "checkpoint; move or delete it yourself if it is meant to go")
    return dest


# --------------------------------------------------------------------------------- the write lock
def _sibling(dest: Path, suffix: str) -> Path:
    return dest.parent / f".{dest.name}.{suffix}"


def _temporaries(dest: Path, kind: str) -> list[Path]:
    """The `.X.tmp-ID` / `.X.old-ID` siblings of dest (IDs are 8 hex digits)."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.{kind}-[0-9a-f]{{8}}")
    try:
        names = os.listdir(dest.parent)
    except FileNotFoundError:
        return []
    return [dest.parent / name for name in sorted(names) if pattern.fullmatch(name)]


class WriteLock:
    """Exclusive, non-blocking lock on writing `dest` (flock on `.X.lock`, released with the process)."""

    def __init__(self, dest: Path):
        self.dest = dest
        self.file = _sibling(dest, "lock")
        self._fd: int | None = None

    def try_acquire(self) -> int | None:
        """Take the lock (returns None) or return the pid of the live writer holding it (0 if unknown)."""
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    pid = int(os.read(fd, 32).decode() or 0)
                except ValueError:
                    pid = 0
                os.close(fd)
                return pid
            # The previous holder unlinks the file before unlocking: make sure ours is still the one at the path.
            try:
                same = os.stat(self.file).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
                self._fd = fd
                return None
            os.close(fd)

    def acquire(self) -> None:
        holder = self.try_acquire()
        if holder is not None:
            raise CheckpointError(f"{self.dest} is being written by another process (pid {holder or 'unknown'}); "
                                  "wait for it to finish, or stop it")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file)
        os.close(self._fd)
        self._fd = None


# ------------------------------------------------------------------------------------ the commit
def new_temporary(dest: Path) -> Path:
    """A fresh `.X.tmp-ID` path next to dest (not created)."""
    return _sibling(dest, f"tmp-{uuid.uuid4().hex[:8]}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, dest: Path, *, replace: bool) -> None:
    """Move the complete checkpoint `tmp` to `dest` (the caller holds the lock); with `replace` an
    existing checkpoint at dest is swapped out and removed. Recoverable at every step (module doc)."""
    if os.path.lexists(dest) and not replace:
        raise CheckpointError(f"{dest} appeared while the checkpoint was being written; not replacing it")
    old = _sibling(dest, f"old-{tmp.name.rsplit('-', 1)[1]}") if os.path.lexists(dest) else None
    journal = _sibling(dest, "commit")
    with deferred_interrupts():  # a Ctrl-C lands before or after the commit, never inside it
        with open(journal, "w") as f:
            json.dump({"tmp": tmp.name, "old": old.name if old else None, "pid": os.getpid()}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(dest.parent)
        moved_old = False
        try:
            if old is not None:
                os.rename(dest, old)
                moved_old = True
            os.rename(tmp, dest)
        except BaseException:
            # Still alive: put the old checkpoint back now rather than leave it to the next load. If this
            # fails too, the journal stays and the next load or write recovers.
            if moved_old and old is not None and not os.path.lexists(dest):  # moved_old implies old
                os.rename(old, dest)
            os.unlink(journal)
            raise
        COMMITTED.append(dest)
        _fsync_dir(dest.parent)
        if old is not None:
            shutil.rmtree(old)
        os.unlink(journal)


def _recover_locked(dest: Path) -> list[str]:
    """Finish or roll back an interrupted commit of dest (the caller holds the lock); what was done."""
    journal = _sibling(dest, "commit")
    done: list[str] = []
    if journal.exists():
        try:
            record = json.loads(journal.read_text())
            tmp_name, old_name = record["tmp"], record["old"]
        except (ValueError, KeyError, TypeError):
            record, tmp_name, old_name = None, None, None  # torn journal: written before any rename
        names_ok = (record is not None and isinstance(tmp_name, str)
                    and re.fullmatch(rf"\.{re.escape(dest.name)}\.tmp-[0-9a-f]{{8}}", tmp_name)
                    and (old_name is None or (isinstance(old_name, str)
                         and re.fullmatch(rf"\.{re.escape(dest.name)}\.old-[0-9a-f]{{8}}", old_name))))
        # names_ok checked both are str (or old None); the isinstance is repeated so the type checker sees it
        tmp = dest.parent / tmp_name if names_ok and isinstance(tmp_name, str) else None
        old = dest.parent / old_name if names_ok and isinstance(old_name, str) and old_name else None
        pid = record.get("pid") if isinstance(record, dict) else None
        if tmp is not None and tmp.exists():  # the new checkpoint is complete: finish the commit
            if os.path.lexists(dest):
                if old is None:
                    raise CheckpointError(f"an interrupted commit of {dest} left a complete checkpoint in {tmp}, "
                                          f"but {dest} exists now: move one of them away")
                os.rename(dest, old)
            os.rename(tmp, dest)
            done.append(f"finished the interrupted commit of {dest} (writer pid {pid}): the new checkpoint is "
                        "in place")
        elif not os.path.lexists(dest) and old is not None and old.exists():  # roll back
            os.rename(old, dest)
            done.append(f"rolled back the interrupted commit of {dest} (writer pid {pid}): the previous "
                        "checkpoint is back in place")
        elif os.path.lexists(dest):
            done.append(f"finished the clean-up of an interrupted commit of {dest} (writer pid {pid})")
        else:
            done.append(f"found an unfinished commit of {dest} (writer pid {pid}) with neither the new nor the "
                        "old checkpoint left")
        if old is not None and old.exists():
            shutil.rmtree(old)
        journal.unlink()
    if not os.path.lexists(dest):
        olds = _temporaries(dest, "old")  # left by a commit without a journal (older kdtree-jax versions)
        if olds:
            newest = max(olds, key=lambda p: p.stat().st_mtime)
            os.rename(newest, dest)
            done.append(f"restored {dest} from {newest.name}, left hidden by an interrupted commit")
    return done


def _warn(messages: list[str]) -> None:
    for message in messages:
        warnings.warn(message, CheckpointRecoveryWarning, stacklevel=3)


def recover(dest: str | os.PathLike) -> None:
    """Before a load: finish or roll back an interrupted commit of dest, with a warning. Touches nothing
    (takes no lock) unless there is something to recover, and leaves a commit by a live writer alone."""
    dest = Path(os.path.realpath(os.fspath(dest)))
    if dest.parent == dest:
        return
    if not _sibling(dest, "commit").exists() and (os.path.lexists(dest) or not _temporaries(dest, "old")):
        return
    lock = WriteLock(dest)
    if lock.try_acquire() is not None:
        return  # a live writer is committing: it finishes the job itself
    try:
        _warn(_recover_locked(dest))
    finally:
        lock.release()


def prepare_write(dest: Path) -> list[str]:
    """The writer's start (the caller holds the lock): recover an interrupted commit, then remove the
    temporaries of dead writers (no live writer can own them: the lock is ours). Returns what was done."""
    done = _recover_locked(dest)
    stale = _temporaries(dest, "tmp") + (_temporaries(dest, "old") if os.path.lexists(dest) else [])
    if stale:
        size = sum(f.stat().st_size for p in stale for f in p.rglob("*") if f.is_file())
        for path in stale:
            shutil.rmtree(path)
        done.append(f"removed {len(stale)} temporary directories left by interrupted writes of {dest} "
                    f"({size / 2**20:.1f} MiB): {[p.name for p in stale]}")
    _warn(done)
    return done


def wait_for_background_saves(timeout: float = 600.0) -> None:
    """Join Orbax's save threads that are still running: a Ctrl-C inside `save` stops the main thread
    but not them, and they would keep writing into a directory being removed (and log its errors)."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is threading.current_thread() or not thread.is_alive():
            continue
        if type(thread).__module__.startswith("orbax.") or thread.name == "async_save":
            thread.join(max(0.0, deadline - time.monotonic()))


def remove_tree(path: Path) -> None:
    """rmtree that tolerates files vanishing or appearing meanwhile (retried once)."""
    for _ in range(2):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
    shutil.rmtree(path)  # a third failure is reported


def remove_tree_settled(path: Path, *, quiet_s: float = 0.5, limit_s: float = 5.0) -> None:
    """remove_tree, then keep the path removed while a straggling background writer recreates it (Orbax's
    metadata and commit threads, which a Ctrl-C in the main thread does not stop, write into a save's folder after
    the save was abandoned: CI saw a `.X.tmp-ID` come back after an interrupted convert): done once the path has
    stayed absent for quiet_s seconds, or after limit_s."""
    deadline = time.monotonic() + limit_s
    remove_tree(path)
    absent_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if os.path.lexists(path):
            remove_tree(path)
            absent_since = time.monotonic()
        elif time.monotonic() - absent_since >= quiet_s:
            return


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C) in the main thread until the block is done, then raise it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt


# -------------------------------------------------------------------------------------- checksums
def flat_tensors(tree) -> dict[str, object]:
    """{"a/b/c": leaf} of a pytree; dict keys, dataclass fields and list indices all give plain names, so
    a tree saved with typed nodes and restored as dicts names its tensors the same."""
    def part(key) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return {"/".join(part(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _host_bytes(array) -> memoryview:
    host = np.ascontiguousarray(np.asarray(array))  # a jax Array (sharded or not) comes to the host here
    return memoryview(host.reshape(-1).view(np.uint8))


def array_checksum(array) -> str:
    """sha256 (hex) of an array's bytes in C order."""
    return hashlib.sha256(_host_bytes(array)).hexdigest()


def checksums(flat: Mapping[str, object]) -> dict[str, str]:
    """{tensor name: sha256} of a flat {name: array} (hashed in parallel: hashlib releases the GIL)."""
    names = list(flat)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: array_checksum(flat[n]), names), strict=True))


def verify_checksums(flat: Mapping[str, object], recorded: Mapping[str, str], where: str) -> None:
    """CheckpointError naming the first tensor of `flat` whose bytes do not match `recorded`."""
    got = checksums(flat)
    for name in sorted(got):
        want = recorded.get(name)
        if want is None:
            raise CheckpointError(f"{where}: tensor {name} has no recorded checksum (the checkpoint's config.json "
                                  "was edited or belongs to other tensors)")
        if got[name] != want:
            raise CheckpointError(f"{where}: tensor {name} is corrupt: its bytes do not match the {CHECKSUM_ALGORITHM} "
                                  f"recorded when it was written ({got[name][:12]}... != {want[:12]}...); restore "
                                  "the checkpoint from a good copy")


# ------------------------------------------------------------------------------------ read errors
class _Silence(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


# asyncio logs the tracebacks of every other failing read of a damaged item ("unhandled exception during
# asyncio.run() shutdown", hundreds of lines); absl logs Orbax's own notes. The error raised says it all.
_NOISY_LOGGERS = ("asyncio", "absl")


@contextlib.contextmanager
def quiet_tensor_io() -> Iterator[None]:
    """Silence the loggers that repeat a failed tensor read's traceback, for the duration."""
    silence = _Silence()
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(silence)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(silence)


def read_error_message(error: BaseException, directory: Path) -> str:
    """One line for a failed tensor read: the tensor and the cause (data corruption, a missing file...),
    dug out of the exception chain TensorStore/Orbax raise."""
    texts = []
    seen = error
    while seen is not None and len(texts) < 10:
        texts.append(" ".join(str(seen).split()))
        seen = seen.__cause__ or seen.__context__
    for text in texts:
        found = re.search(r'Error reading "([^"/]+)[^"]*"(?: in [^"]*"[^"]*")?: (.*)', text)
        if found:
            tensor = found.group(1).replace(".", "/")
            cause = found.group(2).split(" [source locations=")[0][:300]  # TensorStore's C++ trail: noise
            corrupt = re.search(r"corrupt|checksum|decompress", cause, re.IGNORECASE)
            kind = "data corruption in" if corrupt else "cannot read"
            return f"{kind} tensor {tensor} of {directory}: {cause}"
    first = texts[0].split(" See full TensorStore details")[0][:300] if texts else type(error).__name__
    return f"cannot read the tensors of {directory} (truncated or damaged?): {type(error).__name__}: {first}"
