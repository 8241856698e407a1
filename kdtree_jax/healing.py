"""Token healing: let a text prompt end anywhere and still continue naturally.

A BPE tokenizer encodes a prompt that ends mid-"word" with a token the model rarely saw at that boundary:
"def f(x):\\n" ends in the lone newline token, while in training text a newline almost always arrived merged
with the next line's indentation ("\\n   "), and after a lone newline the model expects unindented code;
"def fibon" ends in "on", where training text had "fibonacci" as other tokens. Conditioned on such an
ending the model continues badly.

Healing backs off the prompt's last token and makes the model regenerate it: the first new token may be
any token whose bytes START with the removed token's bytes ("\\n" -> "\\n", "\\n   ", "\\n\\n", ...).
`heal` returns the shortened prompt and that mask; `kj.generate(..., first_token_mask=mask)` applies it.
The prompt text is then a prefix of decode(shortened prompt + new tokens).

    ids = tokenizer.encode(text).ids
    ids, mask, removed = heal(tokenizer, ids, vocab_size=cfg.vocab_size)
    out = kj.generate(cfg, params, [ids], first_token_mask=mask)
    text = tokenizer.decode(ids + out.tokens[0, :out.lengths[0]].tolist())

Works with Hugging Face `tokenizers` tokenizers whose decoder is byte-level (GPT-2 style byte-level BPE:
the shipped tokenizer, DeepSeek-V3's, Llama 3's): their vocabulary spells every byte as one character,
so each token's exact bytes are known, also for tokens that are a fragment of a UTF-8 character.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class TokenTable(NamedTuple):
    """What healing needs of a tokenizer: each id's bytes (None for an id with no text: special tokens,
    holes in the id range) and the special ids (never backed off)."""

    token_bytes: tuple[bytes | None, ...]
    special: frozenset[int]


# built once per tokenizer object (3 ms for the shipped 2048 tokens, in proportion for larger vocabularies);
# dropped with the tokenizer
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_level_decoding() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the character that spells each byte -> the byte. Printable
    Latin-1 bytes spell themselves; the other 68 bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + n)
    return {char: b for b, char in spelling.items()}


def token_table(tokenizer) -> TokenTable:
    """The bytes of every token id of a byte-level `tokenizers.Tokenizer` (cached per tokenizer object).

    Raises ValueError for a tokenizer whose decoder is not byte-level: its tokens' bytes are not spelt in
    the vocabulary (a SentencePiece decoder, for one, drops a token's leading space on its own)."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):  # TypeError: an object without weak references is never cached
        pass
    decoder = getattr(tokenizer, "decoder", None)
    if type(decoder).__name__ != "ByteLevel":  # tokenizers.decoders.ByteLevel, not imported: optional package
        raise ValueError("token healing needs a byte-level BPE tokenizer (decoder ByteLevel), got decoder "
                         f"{type(decoder).__name__}")
    by_char = byte_level_decoding()
    added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}: specials and user-added tokens
    vocab = tokenizer.get_vocab(with_added_tokens=False)  # token spelt in the byte alphabet -> id
    size = max([*vocab.values(), *added.keys()], default=-1) + 1
    table: list[bytes | None] = [None] * size
    for token, i in vocab.items():
        try:
            table[i] = bytes(by_char[c] for c in token)
        except KeyError as e:
            raise ValueError(f"token {i} ({token!r}) has character {e.args[0]!r}, which is outside the "
                             "byte-level alphabet: not a byte-level BPE vocabulary") from None
    special = frozenset(i for i, tok in added.items() if tok.special)
    for i, tok in added.items():
        table[i] = None if tok.special else tok.content.encode("utf-8")  # an added token is literal text
    result = TokenTable(tuple(table), special)
    try:
        _TABLES[tokenizer] = result
    except TypeError:
        pass
    return result


def heal(tokenizer, ids: Sequence[int], vocab_size: int | None = None) -> tuple[list[int], np.ndarray, str]:
    """Back off the prompt's last token for token healing.

    ids: the encoded prompt (a special token first, such as <bos>, is fine). vocab_size: the model's
    vocabulary, the mask's length (default: the tokenizer's; ids past the tokenizer's never get True).
    Returns (ids without the last token, mask bool [vocab_size]: True exactly for the tokens whose bytes
    start with the removed token's bytes, the removed token's text). The last token stays when removing
    it would leave no prompt or when it is special (<bos>, <eos>, ...): then the ids come back whole with
    an all-True mask and removed text "". Raises ValueError for an empty prompt, an id the tokenizer does
    not know, or a tokenizer that is not byte-level (token_table)."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("cannot heal an empty prompt: give at least one token id")
    table = token_table(tokenizer)
    size = len(table.token_bytes) if vocab_size is None else int(vocab_size)
    if size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    bad = [i for i in ids if not 0 <= i < len(table.token_bytes)]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the tokenizer's vocabulary [0, {len(table.token_bytes)})")
    last = ids[-1]
    removed = table.token_bytes[last]
    if len(ids) < 2 or last in table.special or not removed:
        return ids, np.ones(size, bool), ""
    mask = np.zeros(size, bool)
    for i, token in enumerate(table.token_bytes[:size]):
        mask[i] = token is not None and token.startswith(removed)
    return ids[:-1], mask, removed.decode("utf-8", errors="replace")
