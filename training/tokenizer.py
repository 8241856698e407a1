"""Train the byte-level BPE tokenizer shipped as kdtree_jax/assets/tokenizer.json.

    python -m training.tokenizer --vocab-size 2048 --out kdtree_jax/assets/tokenizer.json

Special tokens take ids 0..3: <pad>=0, <bos>=1, <eos>=2, <mask>=3 (the drafter's mask token).
`encode(text)` prepends <bos> (every training document starts with it; `add_special_tokens=False`
leaves it out); `decode` drops the specials.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from training.data import corpus_files

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the training split only (held-out files never shape the vocabulary)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (all bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((text for _, text in corpus_files("train")), trainer=trainer)
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
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("kdtree_jax/assets/tokenizer.json"))
    args = parser.parse_args()
    tok = train_tokenizer(args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    sample = "def f(x):\n    return x + 1\n"
    print(f"vocab {tok.get_vocab_size()} -> {args.out}; {sample!r} -> {len(tok.encode(sample).ids)} tokens")


if __name__ == "__main__":
    main()
