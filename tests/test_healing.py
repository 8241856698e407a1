"""Prompts that end anywhere: `first_token_mask` in the engine (AR, DFlash, DDTree), token healing
(kdtree_jax.healing) on a hand-made tokenizer and on the shipped pair, the CLI's healing, and the
--split-lines pre-tokenizer of training/tokenizer.py.

Expected values come from independent sources: masks listed by hand from token names, the unmasked
engine run (an all-True mask changes nothing), greedy AR for DDTree / DFlash, and the prompt text itself
(decode(healed prompt + new tokens) must start with it).
"""

from __future__ import annotations

import ast
import json

import jax
import numpy as np
import pytest
from helpers import TINY

import kdtree_jax as kj
from kdtree_jax import cli
from kdtree_jax.drafter import DrafterConfig, init_drafter_params
from kdtree_jax.healing import byte_level_decoding, heal, token_table

tokenizers = pytest.importorskip("tokenizers")

ASSETS = kj.ASSETS
NEW = 12


def make_drafter(cfg, seed, block_size=4):
    dcfg = DrafterConfig.for_target(cfg, num_layers=1, block_size=block_size)
    return dcfg, init_drafter_params(dcfg, jax.random.key(seed))


# ------------------------------------------------------------------------------- first_token_mask
@pytest.fixture(scope="module")
def tiny(tiny_params):
    prompts = [[1, 17, 250, 33, 9], [1, 5], [1, 300, 301, 302, 303, 304, 305, 306]]
    plain = kj.generate(TINY, tiny_params, prompts, max_new_tokens=NEW, stop_tokens=())
    # each row may start only with tokens that greedy would NOT pick: row b allows 3 ids, none its greedy first
    mask = np.zeros((len(prompts), TINY.vocab_size), bool)
    for b, first in enumerate(np.asarray(plain.tokens[:, 0]).tolist()):
        mask[b, [(first + 7 * (b + 1) + k) % TINY.vocab_size for k in range(3)]] = True
    masked = kj.generate(TINY, tiny_params, prompts, max_new_tokens=NEW, stop_tokens=(), first_token_mask=mask)
    return tiny_params, prompts, plain, mask, masked


def test_first_token_is_the_best_allowed_one(tiny):
    params, prompts, plain, mask, masked = tiny
    # the expected first token: argmax of the prefill logits over the allowed ids (kj.forward, no cache)
    for b, prompt in enumerate(prompts):
        logits = np.asarray(kj.forward(params, TINY, np.asarray([prompt], np.int32))[0, -1])
        allowed = np.flatnonzero(mask[b])
        assert int(masked.tokens[b, 0]) == allowed[np.argmax(logits[allowed])]
        assert int(masked.tokens[b, 0]) != int(plain.tokens[b, 0])


def test_the_rest_continues_from_the_forced_token(tiny):
    """After the masked first token t the row continues exactly as the prompt + [t] does unmasked."""
    params, prompts, _, _, masked = tiny
    forced = [p + [int(masked.tokens[b, 0])] for b, p in enumerate(prompts)]
    again = kj.generate(TINY, params, forced, max_new_tokens=NEW - 1, stop_tokens=())
    assert [r[1:] for r in masked.rows()] == again.rows()


def test_all_true_mask_changes_nothing(tiny):
    params, prompts, plain, _, _ = tiny
    out = kj.generate(TINY, params, prompts, max_new_tokens=NEW, stop_tokens=(),
                      first_token_mask=np.ones(TINY.vocab_size, bool))  # [V]: every row
    assert out.rows() == plain.rows()


@pytest.mark.parametrize("method,budget", [("ddtree", 1), ("ddtree", 16), ("dflash", None)])
def test_greedy_speculative_equals_autoregressive_with_a_mask(tiny, method, budget):
    params, prompts, _, mask, masked = tiny
    out = kj.generate(TINY, params, prompts, max_new_tokens=NEW, method=method, tree_budget=budget,
                      drafter=make_drafter(TINY, seed=2), stop_tokens=(), first_token_mask=mask)
    assert out.rows() == masked.rows()


@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 8)])
def test_sampled_first_token_stays_in_the_mask(tiny, method, budget):
    params, prompts, _, _, _ = tiny
    mask = np.zeros(TINY.vocab_size, bool)
    mask[[4, 99, 123, 300]] = True
    kwargs = dict(drafter=make_drafter(TINY, seed=2), tree_budget=budget) if method != "ar" else {}
    firsts = set()
    for seed in range(4):
        out = kj.generate(TINY, params, prompts, max_new_tokens=2, method=method, temperature=5.0, top_k=50,
                          key=jax.random.key(seed), stop_tokens=(), first_token_mask=mask, **kwargs)
        firsts |= set(np.asarray(out.tokens[:, 0]).tolist())
    assert firsts <= {4, 99, 123, 300} and len(firsts) > 1  # a hot temperature: several allowed ids drawn


@pytest.mark.parametrize("mask,match", [
    ([True] * TINY.vocab_size, "bool array"),
    (np.ones(TINY.vocab_size, np.int32), "dtype bool"),
    (np.ones(TINY.vocab_size - 1, bool), r"shape \[400\] or \[3, 400\]"),
    (np.ones((2, TINY.vocab_size), bool), r"got \[2, 400\]"),
    (np.ones((3, 1, TINY.vocab_size), bool), "shape"),
    (np.eye(3, TINY.vocab_size, dtype=bool) & np.array([[True], [False], [True]]), "allows no token for prompt 1"),
])
def test_bad_masks_are_named(tiny, mask, match):
    params, prompts, _, _, _ = tiny
    for method in ("ar", "ddtree"):
        kwargs = dict(drafter=make_drafter(TINY, seed=2), tree_budget=4) if method == "ddtree" else {}
        with pytest.raises(ValueError, match=match):
            kj.generate(TINY, params, prompts, max_new_tokens=2, method=method, first_token_mask=mask, **kwargs)


# ----------------------------------------------------------------------------- hand-made tokenizer
def hand_tokenizer():
    """Byte-level BPE with all 256 bytes, <bos> (special, id 256) and a few merges: newline + spaces,
    "def", and "é" (bytes c3 a9, two byte tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ċ", "Ġ"), ("ĊĠ", "Ġ"), ("Ġ", "Ġ"), ("d", "e"), ("de", "f"), ("Ã", "©"), ("Ċ", "Ċ")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # no regex split: "\n  " stays one piece, so the newline + spaces merges apply (as they do in the shipped one)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>"])
    return tok


def ids_of(tok, *names):
    return {tok.token_to_id(n) for n in names}


def test_byte_alphabet_is_the_tokenizers_one():
    decoding = byte_level_decoding()
    assert set(decoding) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert sorted(decoding.values()) == list(range(256))
    tok = hand_tokenizer()
    for char, byte in decoding.items():  # the decoder agrees on every byte that is text by itself
        if byte < 128:
            assert tok.decode([tok.token_to_id(char)]) == chr(byte)


def test_mask_on_the_hand_made_tokenizer():
    tok = hand_tokenizer()
    bos = tok.token_to_id("<bos>")
    assert bos == tok.get_vocab_size() - 1 == 256 + 7  # after the bytes and the merges
    nl, de = tok.token_to_id("Ċ"), tok.token_to_id("de")
    cases = [  # prompt ids, removed text, the allowed tokens by name
        ([bos, nl], "\n", {"Ċ", "ĊĠ", "ĊĠĠ", "ĊĊ"}),
        ([bos, de, nl], "\n", {"Ċ", "ĊĠ", "ĊĠĠ", "ĊĊ"}),
        ([bos, tok.token_to_id("ĊĠ")], "\n ", {"ĊĠ", "ĊĠĠ"}),
        ([bos, tok.token_to_id("Ġ")], " ", {"Ġ", "ĠĠ"}),
        ([bos, de], "de", {"de", "def"}),
        ([bos, tok.token_to_id("d")], "d", {"d", "de", "def"}),
        ([bos, tok.token_to_id("Ã")], "\ufffd", {"Ã", "Ã©"}),  # byte c3 alone: half a character
    ]
    for prompt, removed, allowed in cases:
        short, mask, text = heal(tok, prompt)
        assert short == prompt[:-1] and text == removed
        assert mask.shape == (tok.get_vocab_size(),) and mask.dtype == bool
        assert set(np.flatnonzero(mask).tolist()) == ids_of(tok, *allowed), prompt
    assert tok.encode("def\n  ").tokens == ["def", "ĊĠĠ"]  # the merges are real


def test_what_is_never_backed_off():
    tok = hand_tokenizer()
    bos, nl = tok.token_to_id("<bos>"), tok.token_to_id("Ċ")
    for prompt in ([bos], [nl], [nl, bos]):  # only <bos>; one token (would leave nothing); a special at the end
        short, mask, text = heal(tok, prompt)
        assert short == prompt and text == "" and mask.all()
    short, mask, text = heal(tok, np.asarray([bos, nl], np.int64), vocab_size=300)  # model vocab > tokenizer's
    assert short == [bos] and mask.shape == (300,) and not mask[tok.get_vocab_size():].any() and mask[nl]
    assert not mask[bos]  # a special token has no text: never a continuation


@pytest.mark.parametrize("ids,match", [([], "empty prompt"), ([1, 5000], "outside the tokenizer's vocabulary"),
                                       ([1, -1], "outside")])
def test_bad_heal_input(ids, match):
    with pytest.raises(ValueError, match=match):
        heal(hand_tokenizer(), ids)


def test_a_tokenizer_that_is_not_byte_level_is_refused():
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="byte-level BPE tokenizer"):
        heal(tok, [0, 1])


def test_the_table_is_built_once_per_tokenizer():
    tok = hand_tokenizer()
    assert token_table(tok) is token_table(tok)
    assert token_table(hand_tokenizer()) is not token_table(tok)


# ------------------------------------------------------------------------------------ shipped pair
# Each ends where a BPE prompt ends badly: after a newline, inside indentation, after ':', inside a name.
ENDINGS = {
    "newline": "def fibonacci(n):\n",
    "indentation": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n  ",
    "colon": "def read_config(path):\n    with open(path) as f:",
    "identifier": "import os\n\ndef list_files(directory):\n    return [name for name in os.listd",
}
COMPLETION = 32


@pytest.fixture(scope="module")
def shipped():
    from tokenizers import Tokenizer

    # stored in bfloat16; run in float32, where greedy DDTree == AR holds exactly (as the CLI runs --shipped)
    cfg, params = kj.load_checkpoint(ASSETS / "target", expect_kind="target", dtype=np.float32)
    dcfg, dparams = kj.load_checkpoint(ASSETS / "drafter", expect_kind="drafter", dtype=np.float32)
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    texts = list(ENDINGS.values())
    healed = [heal(tok, tok.encode(t).ids, vocab_size=cfg.vocab_size) for t in texts]
    ids, mask = [h[0] for h in healed], np.stack([h[1] for h in healed])
    runs = {"healed": kj.generate(cfg, params, ids, COMPLETION, first_token_mask=mask, stop_tokens=()),
            "plain": kj.generate(cfg, params, [tok.encode(t).ids for t in texts], COMPLETION, stop_tokens=())}
    return cfg, params, (dcfg, dparams), tok, texts, healed, runs


def test_shipped_healed_first_token_extends_the_removed_text(shipped):
    cfg, _, _, tok, texts, healed, runs = shipped
    table = token_table(tok)
    for (short, _, removed), row, text in zip(healed, runs["healed"].rows(), texts, strict=True):
        assert removed and text.endswith(removed) and len(short) == len(tok.encode(text).ids) - 1
        assert table.token_bytes[row[0]].startswith(removed.encode())


def test_shipped_healed_text_keeps_the_prompt(shipped):
    _, _, _, tok, texts, healed, runs = shipped
    for (short, _, _), row, text in zip(healed, runs["healed"].rows(), texts, strict=True):
        full = tok.decode(short + row)
        assert full.startswith(text) and len(full) > len(text), (text, full)


def test_shipped_greedy_ddtree_equals_ar_with_healing(shipped):
    cfg, params, drafter, _, _, healed, runs = shipped
    ids, mask = [h[0] for h in healed], np.stack([h[1] for h in healed])
    for method, budget in (("ddtree", 32), ("dflash", None)):
        out = kj.generate(cfg, params, ids, COMPLETION, method=method, drafter=drafter, tree_budget=budget,
                          first_token_mask=mask, stop_tokens=())
        assert out.rows() == runs["healed"].rows(), method


def shipped_completions(shipped, which: str) -> dict[str, str]:
    _, _, _, tok, texts, healed, runs = shipped
    out = {}
    for name, (short, _, _), row, text in zip(ENDINGS, healed, runs[which].rows(), texts, strict=True):
        ids = short if which == "healed" else tok.encode(text).ids
        out[name] = tok.decode(ids + row)[len(text):]
    return out


def test_healing_completes_the_name_and_the_indentation(shipped):
    """What healing buys on the shipped pair, measured on CPU (greedy, 2026-12-01 and again with the fine-tuned
    target on 2026-12-04): the prompt cut inside `os.listd` continues as `os.listdir(` healed and as `os.listd(` (no
    such name) plain; the prompt cut
    inside a method body's indentation ("  " of 8) continues the 8-space line with code healed, and with a
    docstring at the wrong indentation plain. (The newline and ':' endings complete alike with and without
    healing: the split-lines tokenizer keeps newlines out of every merge.)"""
    healed, plain = shipped_completions(shipped, "healed"), shipped_completions(shipped, "plain")

    def line_being_completed(name, completion):
        return (ENDINGS[name] + completion).split("\n")[ENDINGS[name].count("\n")]

    assert line_being_completed("identifier", healed["identifier"]).endswith(
        "os.listdir(directory)]"), healed["identifier"]
    assert "os.listd(" in line_being_completed("identifier", plain["identifier"]), plain["identifier"]
    for completion, good in ((healed["indentation"], True), (plain["indentation"], False)):
        line = line_being_completed("indentation", completion)
        indent = len(line) - len(line.lstrip(" "))
        assert (indent == 8 and line[8:9].isidentifier()) is good, repr(line)


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_heals_text_prompts_by_default(capsys):
    prompt = ENDINGS["newline"]
    rc = cli.main(["generate", "--shipped", "--prompt", prompt, "--max-new-tokens", "6", "--no-warmup"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    ids = tokenizers.Tokenizer.from_file(str(ASSETS / "tokenizer.json")).encode(prompt).ids
    lines = out.splitlines()
    at = lines.index(f"prompt 0: {' '.join(map(str, ids[:-1]))}")  # the healed prompt: the newline backed off
    assert lines[at + 1] == f"  prompt text: {prompt!r}"
    assert lines[at + 2] == (f"  healed: token {ids[-1]} '\\n' removed from the prompt; the first new token "
                             "starts with it")
    text = ast.literal_eval(lines[at + 4].split("text: ", 1)[1])  # the repr the CLI printed
    assert text.startswith(prompt) and len(text) > len(prompt)

    rc = cli.main(["generate", "--shipped", "--prompt", prompt, "--max-new-tokens", "6", "--no-warmup",
                   "--no-heal"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"prompt 0: {' '.join(map(str, ids))}" in out and "healed:" not in out


def test_cli_no_heal_needs_text_prompts(capsys):
    rc = cli.main(["generate", "--preset", "tiny", "--prompt", "1 2", "--no-heal"])
    assert rc == 2 and "--no-heal applies to text prompts" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --split-lines training
@pytest.fixture(scope="module")
def few_files():
    from training.data import corpus_files

    return [text for _, text in corpus_files("train")[:6]]


def newline_tokens(tok) -> dict[str, bytes]:
    """Every vocabulary token whose bytes hold a newline, by name."""
    table = token_table(tok)
    return {tok.id_to_token(i): b for i, b in enumerate(table.token_bytes) if b is not None and b"\n" in b}


def test_split_lines_keeps_newlines_and_indentation_apart(few_files):
    from training.tokenizer import train_tokenizer

    tok = train_tokenizer(300, split_lines=True, texts=few_files)
    assert tok.get_vocab_size() == 300
    assert newline_tokens(tok) == {"Ċ": b"\n"}  # a newline never merges with anything
    # on the training text: a line's indentation is whole tokens of spaces, the code after it starts a token
    checked = 0
    for text in few_files[:2]:
        enc = tok.encode(text, add_special_tokens=False)
        starts = {start for start, _ in enc.offsets}
        offset = 0
        for line in text.split("\n"):
            indent = len(line) - len(line.lstrip(" \t"))
            if 0 < indent < len(line):
                assert offset + indent in starts, line  # indentation | code is a token boundary
                checked += 1
            offset += len(line) + 1
        for (start, end), token in zip(enc.offsets, enc.tokens, strict=True):
            piece = text[start:end]
            assert piece == "\n" or "\n" not in piece, token
            if piece[:1] in (" ", "\t") and (start == 0 or text[start - 1] == "\n"):
                assert not piece.strip(), f"indentation merged with code: {piece!r}"
    assert checked > 50
    # the default (the shipped tokenizer's) does merge them: the test above would catch a no-op option
    plain = train_tokenizer(300, texts=few_files)
    assert any(b.strip(b" ") == b"\n" and len(b) > 1 for b in newline_tokens(plain).values())


@pytest.mark.slow
def test_training_reproduces_the_shipped_tokenizer():
    """The shipped tokenizer.json comes from `python -m training.tokenizer --vocab-size 4096 --split-lines
    --source all` on CPython 3.12.1's standard library and the pinned wheels (30 s here)."""
    import sys

    from training.corpus import PACKAGES, default_cache
    from training.tokenizer import train_tokenizer

    if sys.version_info[:3] != (3, 12, 1):
        pytest.skip("the shipped tokenizer was trained on CPython 3.12.1's standard library")
    if not all((default_cache() / p.wheel).is_file() for p in PACKAGES):
        pytest.skip(f"needs the pinned wheels in {default_cache()} (python -m training.corpus downloads them, 96 MB)")
    shipped = json.loads((ASSETS / "tokenizer.json").read_text())
    trained = json.loads(train_tokenizer(4096, split_lines=True, source="all").to_str())
    assert trained == shipped
