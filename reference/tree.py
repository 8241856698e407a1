"""DDTree tree construction, the plain way: a best-first max-heap over rank tuples (docs/ddtree.md, the build stage).

This is the ground truth for `kdtree_jax.tree`. It is deliberately naive: Python `heapq`, one example at a
time, arithmetic in the dtype of the log-probs it is given (float64 from `heap_tree_from_logits`; hand it
float32 log-probs to compare bit for bit with the float32 device builder).

A node is a tuple of per-depth ranks `(r_1, ..., r_d)`; its score is `((0 + lp[0, r_1]) + lp[1, r_2]) + ...`
(accumulated parent-first, the same order the device uses). Heap entries are `(-score, ranks)`, so equal
scores pop in lexicographic order of the rank tuple, and a tuple pops before its extensions.
"""

from __future__ import annotations

import heapq
from typing import Any, NamedTuple

import numpy as np


class ReferenceTree(NamedTuple):
    """One example's tree, T = 1 + budget slots; node 0 is the root, nodes 1..n in heap pop order."""

    tokens: np.ndarray  # [T] int64; unused slots 0
    parents: np.ndarray  # [T] int64; root and unused slots -1
    depths: np.ndarray  # [T] int64; root and unused slots 0
    valid: np.ndarray  # [T] bool
    visible: np.ndarray  # [T, T] bool; j is i or an ancestor of i (unused slots: only themselves)
    scores: np.ndarray  # [T] dtype of the log-probs; root 0, unused -inf


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """Float64 log-softmax over the last axis."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def top_ranks(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth top-k: (token ids [L, k], log-probs [L, k]); equal log-probs keep lower token id first."""
    order = np.argsort(-log_probs, axis=-1, kind="stable")[:, :k]  # [L, k]
    return order, np.take_along_axis(log_probs, order, axis=-1)


def heap_tree(log_probs: np.ndarray, budget: int, root_token: int = 0) -> ReferenceTree:
    """Best-first tree over per-depth log-probs `log_probs` [L, V] (values <= 0), `budget` drafts."""
    log_probs = np.asarray(log_probs)
    if log_probs.ndim != 2:
        raise ValueError(f"log_probs must be [L, V], got shape {log_probs.shape}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    depth_count, vocab = log_probs.shape
    k = min(budget, vocab)
    tok, lp = top_ranks(log_probs, k)  # [L, K] each
    zero = lp.dtype.type(0)

    t = 1 + budget
    tokens = np.zeros(t, np.int64)
    parents = np.full(t, -1, np.int64)
    depths = np.zeros(t, np.int64)
    valid = np.zeros(t, bool)
    scores = np.full(t, -np.inf, lp.dtype)
    tokens[0], valid[0], scores[0] = root_token, True, zero
    index_of: dict[tuple[int, ...], int] = {(): 0}  # rank tuple -> node index

    # Entry: (-score, ranks, score); the score rides along so it is not recomputed by negation.
    heap: list[tuple[Any, tuple[int, ...], Any]] = [(-(zero + lp[0, 0]), (0,), zero + lp[0, 0])]
    n = 0
    while heap and n < budget:
        _, ranks, score = heapq.heappop(heap)
        n += 1
        d = len(ranks)
        index_of[ranks] = n
        tokens[n] = tok[d - 1, ranks[-1]]
        parents[n] = index_of[ranks[:-1]]
        depths[n] = d
        valid[n] = True
        scores[n] = score
        parent_score = scores[parents[n]]
        if ranks[-1] + 1 < k:  # next sibling
            s = parent_score + lp[d - 1, ranks[-1] + 1]
            heapq.heappush(heap, (-s, ranks[:-1] + (ranks[-1] + 1,), s))
        if d < depth_count:  # first child
            s = score + lp[d, 0]
            heapq.heappush(heap, (-s, ranks + (0,), s))

    visible = np.eye(t, dtype=bool)
    for i in range(1, t):
        j = parents[i]
        while j >= 0:
            visible[i, j] = True
            j = parents[j]
    return ReferenceTree(tokens, parents, depths, valid, visible, scores)


def heap_tree_from_logits(draft_logits: np.ndarray, budget: int, root_token: int = 0) -> ReferenceTree:
    """`heap_tree` on the float64 log-softmax of drafter logits [L, V]."""
    return heap_tree(log_softmax64(draft_logits), budget, root_token)


def chain_tree(draft_logits: np.ndarray, root_token: int = 0) -> ReferenceTree:
    """DFlash's single path: root then the argmax token at each depth, T = 1 + L (float64 scores)."""
    lp = log_softmax64(draft_logits)  # [L, V]
    depth_count = lp.shape[0]
    t = 1 + depth_count
    best = np.argmax(lp, axis=-1)  # first maximum, like jnp.argmax
    tokens = np.concatenate([[root_token], best]).astype(np.int64)
    parents = np.arange(-1, t - 1, dtype=np.int64)
    depths = np.arange(t, dtype=np.int64)
    scores = np.concatenate([[0.0], np.cumsum(lp[np.arange(depth_count), best])])
    visible = np.tril(np.ones((t, t), bool))
    return ReferenceTree(tokens, parents, depths, np.ones(t, bool), visible, scores)
