"""How degenerate a target's greedy completions are: the measure issue 17 states its "no degenerate completions"
target in, and the repeat rate the unlikelihood fine-tune (training/unlikelihood.py) trains against.

  top_line_share(text)      the share of a completion's lines taken by its most frequent line (1.0: one line
                            over and over); a completion at DEGENERACY_LIMIT or above is degenerate;
  greedy_completions(...)   64-token greedy completions of the shipped held-out prompts and of the newline-ending
                            prompts (healed as the CLI heals text prompts); completion_shares(...) their top-line
                            shares;
  repeat_candidates(c, n)   which tokens of continuations c [B, L] complete an n-gram that already occurred earlier
                            in the same continuation (jnp, traceable): the repeats unlikelihood training pushes down.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import kdtree_jax as kj

DEGENERACY_LIMIT = 0.5  # a completion whose most frequent line is half its lines or more is degenerate
NEW_TOKENS = 64


def top_line_share(completion: str) -> float:
    """The share of the completion's lines (split at "\\n", trailing spaces dropped, blank lines count) taken
    by its most frequent line: 1.0 is one line over and over (or a single line)."""
    lines = [line.rstrip() for line in completion.split("\n")]
    return max(lines.count(line) for line in lines) / len(lines)


def greedy_completions(cfg: kj.ModelConfig, params, tokenizer, prompts: dict,
                       new_tokens: int = NEW_TOKENS) -> dict[str, list[str]]:
    """The text of `new_tokens`-token greedy completions: "heldout" (the 32 shipped 64-token prompts, as ids) and
    "newline" (the newline-ending texts, healed: kdtree_jax.healing). `prompts` is the parsed
    kdtree_jax/assets/heldout_prompts.json. No stop tokens: every completion has `new_tokens` tokens."""
    from kdtree_jax.healing import heal

    out = kj.generate(cfg, params, [p["ids"] for p in prompts["prompts"]], new_tokens, stop_tokens=())
    heldout = [tokenizer.decode(r) for r in out.rows()]
    texts = prompts["newline_prompts"]
    healed = [heal(tokenizer, tokenizer.encode(t).ids, vocab_size=cfg.vocab_size) for t in texts]
    out = kj.generate(cfg, params, [h[0] for h in healed], new_tokens, stop_tokens=(),
                      first_token_mask=np.stack([h[1] for h in healed]))
    newline = [tokenizer.decode(h[0] + r)[len(t):] for h, r, t in zip(healed, out.rows(), texts, strict=True)]
    return {"heldout": heldout, "newline": newline}


def line_shares(texts: dict[str, list[str]]) -> dict[str, list[float]]:
    """top_line_share of every completion of every set."""
    return {name: [top_line_share(t) for t in values] for name, values in texts.items()}


def completion_shares(cfg: kj.ModelConfig, params, tokenizer, prompts: dict,
                      new_tokens: int = NEW_TOKENS) -> dict[str, list[float]]:
    """Top-line shares of the `greedy_completions`."""
    return line_shares(greedy_completions(cfg, params, tokenizer, prompts, new_tokens))


def degenerate_counts(shares: dict[str, list[float]], limit: float = DEGENERACY_LIMIT) -> dict[str, int]:
    """How many completions of each set reach `limit`."""
    return {name: sum(s >= limit for s in values) for name, values in shares.items()}


def repeat_candidates(continuation: jnp.ndarray, n: int) -> jnp.ndarray:
    """bool [B, L]: token t of continuation [B, L] ends an n-gram (tokens t-n+1 .. t, all inside the continuation)
    equal to one ending at an earlier position s < t of the same row. Welleck et al.'s sequence-level candidates
    (arXiv 1908.04319, section 5.2); their mean is the continuation's n-gram repeat rate."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    length = continuation.shape[1]
    same = continuation[:, :, None] == continuation[:, None, :]  # [B, L(t), L(s)]
    ngram = same
    for k in range(1, n):  # tokens t-k and s-k equal too: shift both axes by k
        shifted = jnp.pad(same[:, :-k, :-k], ((0, 0), (k, 0), (k, 0)), constant_values=False)
        ngram = ngram & shifted
    t = jnp.arange(length)
    earlier = t[None, :] < t[:, None]  # [L(t), L(s)]; n-grams reaching before the continuation: the shifts' padding
    return jnp.any(ngram & earlier[None], axis=2)
