"""The training corpus: the Python standard library of the interpreter running the script, and (with
`source="packages"` or `"all"`) the `.py` sources of the pinned PyPI wheels of training/corpus.py.

Every machine with Python has the standard library, so anyone can rebuild that part for a given Python
version (the shipped pair was trained on CPython 3.12.1, stdlib only; another version gives a slightly
different corpus). The package part is pinned by wheel SHA-256, so it is the same everywhere.

Split rule (fixed, by file): a file is held out iff crc32(its '/'-separated path) % 10 == 0; about 10% of
the files. The path is relative to the stdlib root for the standard library and package-prefixed for
packages (`sympy/core/add.py`). Excluded from the stdlib: `site-packages/` (not the stdlib) and the
`test/`, `tests/` folders (huge, repetitive, unlike ordinary code) and files that are not UTF-8; the
package rule is in training/corpus.py.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import numpy as np

from training.corpus import PACKAGES, Package, package_corpus

HELD_OUT_MODULUS = 10
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests"})
SOURCES = ("stdlib", "packages", "all")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """The split rule: crc32 of the '/'-separated path (stdlib: relative to its root; packages: the
    package-prefixed path) mod 10 == 0."""
    return zlib.crc32(relative_path.encode("utf-8")) % HELD_OUT_MODULUS == 0


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(path relative to the stdlib root, source text) of every stdlib .py file the rule keeps, sorted."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library folder {root} does not exist")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def source_files(source: str = "stdlib", root: Path | None = None, cache: Path | None = None,
                 packages: tuple[Package, ...] = PACKAGES) -> list[tuple[str, str]]:
    """(path, text) of every file of `source`, both splits: "stdlib" (sorted by path), "packages" (the
    pinned wheels of training/corpus.py, downloaded into `cache` if missing; sorted by path) or "all"
    (the standard library, then the packages). ValueError if a path occurs in both."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    stdlib = stdlib_files(root) if source in ("stdlib", "all") else []
    pkgs = sorted(package_corpus(packages, cache)) if source in ("packages", "all") else []
    clash = {rel for rel, _ in stdlib}.intersection(rel for rel, _ in pkgs)
    if clash:
        raise ValueError(f"paths in both the standard library and the packages: {sorted(clash)[:5]}")
    return stdlib + pkgs


def corpus_files(split: str, root: Path | None = None, source: str = "stdlib", cache: Path | None = None,
                 packages: tuple[Package, ...] = PACKAGES) -> list[tuple[str, str]]:
    """(path, source text) of every .py file of `split` ("train" or "heldout") of `source` ("stdlib",
    the default and the shipped pair's data; "packages"; "all"), in `source_files`' order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    out = [(rel, text) for rel, text in source_files(source, root, cache, packages)
           if is_held_out(rel) == (split == "heldout")]
    if not out:
        raise FileNotFoundError(f"no {split} .py files found for source {source!r}")
    return out


def token_stream(tokenizer, files: list[tuple[str, str]], chunk: int = 256) -> np.ndarray:
    """All files encoded and concatenated as [bos, file tokens..., eos] documents: int32 [N]. Encoded
    `chunk` files at a time (the tokenizer's Encoding objects are far larger than the ids)."""
    bos, eos = tokenizer.token_to_id("<bos>"), tokenizer.token_to_id("<eos>")
    pieces = []
    for i in range(0, len(files), chunk):
        encodings = tokenizer.encode_batch([text for _, text in files[i: i + chunk]], add_special_tokens=False)
        for enc in encodings:
            pieces.append(np.asarray([bos, *enc.ids, eos], np.int32))
    return np.concatenate(pieces)


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
