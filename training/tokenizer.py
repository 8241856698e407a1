"""Train the byte-level BPE tokenizer shipped as kdtree_jax/assets/tokenizer.json.

    python -m training.tokenizer --vocab-size 4096 --split-lines --source all --out kdtree_jax/assets/tokenizer.json
    python -m training.tokenizer --vocab-size 2048 --out tokenizer.json   # the first shipped pair's (stdlib only)

Special tokens take ids 0..3: <pad>=0, <bos>=1, <eos>=2, <mask>=3 (the drafter's mask token).
`encode(text)` prepends <bos> (every training document starts with it; `add_special_tokens=False`
leaves it out); `decode` drops the specials.

--split-lines: byte-level BPE's pre-tokenizer keeps a run of whitespace together, so the shipped
tokenizer merges a newline with the next line's indentation ("\n   " is one token) and a prompt ending
in "\n" ends in a token the model rarely saw there. With --split-lines every "\n" is a pre-token of its
own and so is the indentation that starts a line: no token holds a newline and anything else, and none
joins indentation to the code after it (kdtree_jax/healing.py repairs such endings at generation time,
for any byte-level tokenizer).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from training.data import SOURCES, corpus_files

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")
# --split-lines: each newline, and the spaces / tabs that start a line, are pre-tokens of their own
LINE_SPLIT = r"\n|(?<=\n)[ \t]+|\A[ \t]+"


def train_tokenizer(vocab_size: int, split_lines: bool = False, texts: Iterable[str] | None = None,
                    source: str = "stdlib") -> Tokenizer:
    """Byte-level BPE on the training split of `source` (training/data.py: "stdlib", "packages", "all";
    held-out files never shape the vocabulary), or on `texts`. split_lines: newlines and leading
    indentation never merge with anything else (above)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (all bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_lines:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(LINE_SPLIT), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    if texts is None:
        texts = (text for _, text in corpus_files("train", source=source))
    tok.train_from_iterator(texts, trainer=trainer)
    add_bos(tok)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def add_bos(tok: Tokenizer) -> Tokenizer:
    """Make `encode(text)` start with <bos>, as every training document does."""
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", SPECIAL_TOKENS.index("<bos>"))])
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=2048, help="tokens in the vocabulary, specials "
                        "included (default: %(default)s; the shipped tokenizer: 4096)")
    parser.add_argument("--split-lines", action="store_true", help="keep each newline and each line's leading "
                        "indentation out of every merge (above); the shipped tokenizer uses it")
    parser.add_argument("--source", choices=SOURCES, default="stdlib", help="the corpus to train on "
                        "(training/data.py; 'packages' and 'all' download the pinned wheels of training/corpus.py "
                        "if missing; default: %(default)s; the shipped tokenizer: all)")
    parser.add_argument("--out", type=Path, default=Path("kdtree_jax/assets/tokenizer.json"),
                        help="where to write tokenizer.json (default: %(default)s)")
    args = parser.parse_args()
    tok = train_tokenizer(args.vocab_size, split_lines=args.split_lines, source=args.source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    tok.save(str(partial))
    os.replace(partial, args.out)
    sample = "def f(x):\n    return x + 1\n"
    print(f"vocab {tok.get_vocab_size()} -> {args.out}; {sample!r} -> {len(tok.encode(sample).ids)} tokens")


if __name__ == "__main__":
    main()
