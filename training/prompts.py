"""Write kdtree_jax/assets/heldout_prompts.json: the shipped pair's fixed held-out prompts.

    python -m training.prompts            # needs the pinned wheels (python -m training.corpus)

Tests and benchmarks read the prompts from that file, so every machine uses the same ones (the standard
library part of the corpus depends on the Python version; the package part needs the wheels):
  "prompts":          64-token prompts ([bos] + 63 tokens from the start of a top-level def / class of a
                      held-out file: training/data.py heldout_prompts, source "all", seed 0), as ids and text;
  "newline_prompts":  held-out code cut right after a newline (the most common place to stop typing), as
                      text: whole lines from a top-level def / class start, at least 120 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from training.common import ASSETS, TOKENIZER_PATH, load_tokenizer
from training.data import corpus_files, heldout_prompts, lines_from_a_definition

PROMPTS_PATH = ASSETS / "heldout_prompts.json"


def load_prompts(count: int, prompt_tokens: int = 64, path: Path = PROMPTS_PATH) -> list[list[int]]:
    """The first `count` shipped 64-token prompts as token ids, each cut to `prompt_tokens` (<= 64)."""
    prompts = [p["ids"] for p in json.loads(Path(path).read_text())["prompts"]]
    if count > len(prompts) or not 1 <= prompt_tokens <= min(len(p) for p in prompts):
        raise ValueError(f"{path} holds {len(prompts)} prompts of {min(len(p) for p in prompts)} tokens, asked "
                         f"{count} of {prompt_tokens}")
    return [p[:prompt_tokens] for p in prompts[:count]]


def newline_prompts(count: int, seed: int = 0, min_bytes: int = 120, max_lines: int = 8) -> list[str]:
    """`count` held-out texts ending in a newline: 3 to `max_lines` whole lines from a top-level def / class
    line of distinct held-out files (source "all"), at least `min_bytes` long."""
    files = corpus_files("heldout", source="all")
    rng = np.random.default_rng(seed)
    out = []
    for i in rng.permutation(len(files)):
        lines = lines_from_a_definition(files[i][1], rng)
        if lines is None:
            continue
        take = int(rng.integers(3, max_lines + 1))
        text = "".join(lines[:take])
        if len(text.encode("utf-8")) >= min_bytes and text.endswith("\n") and text.strip():
            out.append(text)
            if len(out) == count:
                return out
    raise ValueError(f"only {len(out)} newline prompts found, asked {count}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH, help="default: %(default)s")
    parser.add_argument("--count", type=int, default=32, help="64-token prompts (default: %(default)s)")
    parser.add_argument("--newline-count", type=int, default=16, help="newline-ending prompts (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=PROMPTS_PATH, help="default: %(default)s")
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer)
    ids = heldout_prompts(tok, args.count, 64, seed=0, source="all")
    record = {
        "about": "Fixed held-out prompts of the shipped pair, written by `python -m training.prompts` "
                 "(training/prompts.py says how they are chosen); code from files the split rule holds out.",
        "prompts": [{"ids": p, "text": tok.decode(p)} for p in ids],
        "newline_prompts": newline_prompts(args.newline_count),
    }
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, args.out)
    print(f"{len(ids)} prompts + {len(record['newline_prompts'])} newline prompts -> {args.out}")


if __name__ == "__main__":
    main()
