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

import argparse
import hashlib
import json
import lzma
import os
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


def lines_from_a_definition(text: str, rng: np.random.Generator) -> list[str] | None:
    """The lines of `text` (newlines kept) from a random top-level `def` / `class` line on, or None if it has
    none (the one draw from `rng` happens only when it has one)."""
    lines = text.splitlines(keepends=True)
    starts = [k for k, line in enumerate(lines) if line.startswith(("def ", "class "))]
    if not starts:
        return None
    return lines[starts[rng.integers(len(starts))]:]


def heldout_prompts(tokenizer, count: int, prompt_tokens: int, seed: int = 0,
                    source: str = "stdlib") -> list[list[int]]:
    """`count` fixed held-out prompts: [bos] + the first `prompt_tokens - 1` tokens of a function or
    class body start, taken from held-out files of `source` (deterministic for a seed). The shipped pair's
    are in kdtree_jax/assets/heldout_prompts.json (`python -m training.prompts` writes them)."""
    files = corpus_files("heldout", source=source)
    rng = np.random.default_rng(seed)
    bos = tokenizer.token_to_id("<bos>")
    prompts = []
    order = rng.permutation(len(files))
    for i in order:
        lines = lines_from_a_definition(files[i][1], rng)  # so the prompt is a real code prefix
        if lines is None:
            continue
        ids = tokenizer.encode("".join(lines), add_special_tokens=False).ids
        if len(ids) < prompt_tokens + 64:
            continue
        prompts.append([bos] + ids[: prompt_tokens - 1])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out prompts of {prompt_tokens} tokens available, asked {count}")


# ------------------------------------------------------------------------------ pre-tokenized corpus
# The H200 has no network and the working tree that travels to it is limited, so the training streams go
# there tokenized: one xz-compressed little-endian uint16 file per split (50 M + 5.5 M tokens of the shipped
# tokenizer: 25 MB) and corpus.json naming the tokenizer (sha256) and the counts.
TOKEN_DTYPE = np.dtype("<u2")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _write_token_file(out: Path, split: str, stream: np.ndarray) -> Path:
    """`stream` as out/<split>.u16.xz, written to a temporary name and then renamed (no half-written file)."""
    path = out / f"{split}.u16.xz"
    partial = path.with_name(path.name + ".partial")
    with lzma.open(partial, "wb", preset=6) as f:
        f.write(stream.astype(TOKEN_DTYPE).tobytes())
    os.replace(partial, path)
    return path


def write_token_files(tokenizer_path: Path, out: Path, source: str = "all") -> dict:
    """Tokenize both splits of `source` with the tokenizer at `tokenizer_path` into `out`/{train,heldout}.u16.xz
    (each written to a temporary name, then renamed) and `out`/corpus.json; returns the metadata."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    if tok.get_vocab_size() > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"vocabulary of {tok.get_vocab_size()} tokens does not fit uint16 token files")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"source": source, "tokenizer_sha256": file_sha256(tokenizer_path), "vocab_size": tok.get_vocab_size(),
            "splits": {}}
    for split in ("train", "heldout"):
        files = corpus_files(split, source=source)
        stream = token_stream(tok, files)
        path = _write_token_file(out, split, stream)
        meta["splits"][split] = {"files": len(files), "tokens": int(stream.size),
                                 "bytes": sum(len(text.encode("utf-8")) for _, text in files)}
        print(f"{split}: {len(files)} files, {stream.size / 1e6:.2f} M tokens -> {path} "
              f"({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    (out / "corpus.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def load_token_file(data_dir: Path, split: str, tokenizer_path: Path | None = None) -> np.ndarray:
    """The token stream of `split` from a `write_token_files` folder: int32 [N]. With `tokenizer_path`,
    ValueError unless the files were made with that tokenizer (same sha256)."""
    data_dir = Path(data_dir)
    meta = json.loads((data_dir / "corpus.json").read_text())
    if tokenizer_path is not None and meta["tokenizer_sha256"] != file_sha256(tokenizer_path):
        raise ValueError(f"{data_dir} was tokenized with another tokenizer than {tokenizer_path}: "
                         f"rebuild it with `python -m training.data --out {data_dir}`")
    with lzma.open(data_dir / f"{split}.u16.xz", "rb") as f:
        stream = np.frombuffer(f.read(), TOKEN_DTYPE)
    want = meta["splits"][split]["tokens"]
    if stream.size != want:
        raise ValueError(f"{data_dir}/{split}.u16.xz holds {stream.size} tokens, corpus.json says {want}")
    return stream.astype(np.int32)


def load_streams(data_dir: Path | None, tokenizer, tokenizer_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams of the whole corpus ("all"): from a `write_token_files` folder when
    `data_dir` is given (checked against `tokenizer_path`), else tokenized here with `tokenizer`."""
    if data_dir is not None:
        return load_token_file(data_dir, "train", tokenizer_path), load_token_file(data_dir, "heldout", tokenizer_path)
    return (token_stream(tokenizer, corpus_files("train", source="all")),
            token_stream(tokenizer, corpus_files("heldout", source="all")))


def write_subset(source_dir: Path, out: Path, keep_every: int, chunk: int = 1024) -> dict:
    """A smaller copy of a `write_token_files` folder for a device whose working-tree copy is limited: the training
    stream cut into `chunk`-token pieces of which every `keep_every`-th is kept (pieces 0, k, 2k, ...: spread over
    every source, not the first files alone), the held-out stream whole. corpus.json records the rule."""
    if keep_every < 1 or chunk < 1:
        raise ValueError(f"keep_every ({keep_every}) and chunk ({chunk}) must be >= 1")
    meta = json.loads((Path(source_dir) / "corpus.json").read_text())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        stream = load_token_file(source_dir, split)
        if split == "train":
            pieces = [stream[i: i + chunk] for i in range(0, stream.size, chunk * keep_every)]
            stream = np.concatenate(pieces)
        _write_token_file(out, split, stream)
        meta["splits"][split] = {**meta["splits"][split], "tokens": int(stream.size)}
    meta["subset"] = {"of": str(source_dir), "keep_every": keep_every, "chunk": chunk,
                      "rule": "training stream: every keep_every-th chunk of `chunk` tokens; held-out: whole"}
    (out / "corpus.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    from training.common import TOKENIZER_PATH

    parser = argparse.ArgumentParser(description="Tokenize the training corpus into compressed token files "
                                     "(what the training scripts read with --data; no network needed there).")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH,
                        help="tokenizer.json (default: the shipped one, %(default)s)")
    parser.add_argument("--source", choices=SOURCES, default="all", help="corpus (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="folder for train.u16.xz, heldout.u16.xz, corpus.json")
    parser.add_argument("--subset-of", type=Path, help="instead of tokenizing: a folder this command wrote, of which "
                        "--out gets every --keep-every-th 1024-token piece of the training stream (and the whole "
                        "held-out stream): a copy that fits a device's limited working tree")
    parser.add_argument("--keep-every", type=int, default=3, help="with --subset-of (default: %(default)s)")
    args = parser.parse_args()
    if args.subset_of is not None:
        meta = write_subset(args.subset_of, args.out, args.keep_every)
        print(f"{args.out}: {meta['splits']['train']['tokens'] / 1e6:.2f} M training tokens (1 in "
              f"{args.keep_every} pieces of {args.subset_of}), {meta['splits']['heldout']['tokens'] / 1e6:.2f} M "
              "held-out", flush=True)
        return
    write_token_files(args.tokenizer, args.out, args.source)


if __name__ == "__main__":
    main()
