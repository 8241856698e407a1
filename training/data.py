"""The training corpus: the Python standard library of the interpreter running the script.

Every machine with Python has it, so anyone can rebuild the exact data set for a given Python version
(the shipped pair was trained on CPython 3.12.1; another version gives a slightly different corpus).

Split rule (fixed, by file): a file is held out iff crc32(its path relative to the stdlib root, '/'
separated) % 10 == 0; about 10% of the files. Excluded everywhere: `site-packages/` (not the stdlib)
and the `test/`, `tests/` folders (huge, repetitive, unlike ordinary code) and files that are not UTF-8.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import numpy as np

HELD_OUT_MODULUS = 10
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """The split rule: crc32 of the '/'-separated path relative to the stdlib root, mod 10 == 0."""
    return zlib.crc32(relative_path.encode("utf-8")) % HELD_OUT_MODULUS == 0


def corpus_files(split: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, source text) of every stdlib .py file of `split` ("train" or "heldout"),
    sorted by path."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library folder {root} does not exist")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        if is_held_out(rel) != (split == "heldout"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    if not out:
        raise FileNotFoundError(f"no {split} .py files found under {root}")
    return out


def token_stream(tokenizer, files: list[tuple[str, str]]) -> np.ndarray:
    """All files encoded and concatenated as [bos, file tokens..., eos] documents: int32 [N]."""
    bos, eos = tokenizer.token_to_id("<bos>"), tokenizer.token_to_id("<eos>")
    encodings = tokenizer.encode_batch([text for _, text in files], add_special_tokens=False)
    pieces = []
    for enc in encodings:
        pieces.extend(([bos], enc.ids, [eos]))
    return np.concatenate([np.asarray(p, np.int32) for p in pieces])


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`batch` windows of `length` tokens at uniform random offsets of the stream: int32 [batch, length]."""
    if stream.size <= length:
        raise ValueError(f"the token stream ({stream.size} tokens) is shorter than one window ({length})")
    starts = rng.integers(0, stream.size - length, size=batch)
    return np.stack([stream[s: s + length] for s in starts]).astype(np.int32)


def heldout_prompts(tokenizer, count: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """`count` fixed held-out prompts: [bos] + the first `prompt_tokens - 1` tokens of a function or
    class body start, taken from held-out files (deterministic for a seed)."""
    files = corpus_files("heldout")
    rng = np.random.default_rng(seed)
    bos = tokenizer.token_to_id("<bos>")
    prompts = []
    order = rng.permutation(len(files))
    for i in order:
        text = files[i][1]
        # start at a random top-level `def`/`class` line so the prompt is a real code prefix
        starts = [k for k, line in enumerate(text.splitlines(keepends=True))
                  if line.startswith(("def ", "class "))]
        if not starts:
            continue
        lines = text.splitlines(keepends=True)
        first = starts[rng.integers(len(starts))]
        ids = tokenizer.encode("".join(lines[first:]), add_special_tokens=False).ids
        if len(ids) < prompt_tokens + 64:
            continue
        prompts.append([bos] + ids[: prompt_tokens - 1])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out prompts of {prompt_tokens} tokens available, asked {count}")
