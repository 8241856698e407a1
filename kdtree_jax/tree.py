"""DDTree draft-tree construction on device (docs/ddtree.md, the build stage): traceable, static budget, batched.

`build_tree` returns the same nodes in the same order as the best-first heap of `reference/tree.py`:
the `budget` highest-scoring rank tuples, ordered by score (descending), exact ties by lexicographic
order of the rank tuple (a tuple before its extensions). The heap pops in exactly that total order
because a node's key is never better than the key of the node that pushed it (its left sibling or its
parent), even after float32 rounding, so "heap order" == "sort every node by (-score, rank tuple)".

How it runs without a heap (all sizes static, L + 1 `lax.top_k` calls on at most budget * K entries):
1. top-K tokens per depth (one `lax.top_k` over the vocabulary), K = min(budget, V);
2. depth by depth, keep the best n_d = min(budget, K^d) nodes of depth d, chosen among the children of
   the n_{d-1} kept nodes of depth d-1 (a dropped parent has n_{d-1} better same-depth nodes whose
   rank-0 children beat all its children, so no child of it can be in the best n_d). Each depth's
   kept set is stored in lexicographic order, so the flat candidate index (parent position * K + rank)
   is lexicographic and `lax.top_k`'s stable tie-break (lower index first) is exactly the heap's;
3. number the kept nodes of all depths in global lexicographic order (= preorder of the kept forest,
   from subtree sizes), lay the scores out in that order and take one stable `lax.top_k` of
   min(budget, possible nodes): that is the heap's pop order.
The one theoretical gap: step 2's pruning argument uses "better parent => better rank-0 child", which
float32 rounding can break only when two parents are within an ulp of each other AND the budget-th
boundary depends on it; scores are the heap's own float32 sums, so this never shows up in practice.

On a GPU the per-depth steps above (about 5 XLA kernels per depth) give way to one kernel launch,
`pallas_kernels.tree_build`, which runs the heap itself (chosen by `pallas_kernels.dispatch.choose_tree`;
`kernels=Kernels(tree="xla")` keeps this jnp builder). The kernel's front end is `top_log_probs` in one
Pallas launch where the vocabulary fits it (`tree_build.pick_front_end`; after XLA's logsumexp, so the
values are bit for bit `top_log_probs`'), else `top_log_probs` itself.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import dispatch, tree_build


class Tree(NamedTuple):
    """A batch of draft trees, T = 1 + budget slots; node 0 is the root, nodes 1..n in heap pop order."""

    tokens: jax.Array  # [B, T] int32; node 0 = root token (the bonus token), unused slots 0
    parents: jax.Array  # [B, T] int32; root -1, unused slots -1
    depths: jax.Array  # [B, T] int32; root 0, unused slots 0
    valid: jax.Array  # [B, T] bool; root True
    visible: jax.Array  # [B, T, T] bool; j is i or an ancestor of i (an unused slot sees only itself)
    scores: jax.Array  # [B, T] float32 cumulative draft log-prob; root 0, unused -inf


def tree_size_counts(budget: int, vocab: int, depth_count: int) -> tuple[list[int], int]:
    """Static sizes: ([n_1..n_L] kept nodes per depth, number of drafts in the tree)."""
    k = min(budget, vocab)
    per_depth, level, possible = [], 1, 0
    for _ in range(depth_count):
        level = min(level * k, budget)  # min(budget, K^d) without big integers
        per_depth.append(level)
        possible = min(possible + level, budget)
    return per_depth, possible


def _check_args(draft: jax.Array, budget: int, root_tokens, name: str) -> jax.Array:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be a Python int >= 1 (it is static), got {budget!r}")
    if draft.ndim != 3 or draft.shape[1] < 1 or draft.shape[2] < 1:
        raise ValueError(f"{name} must be [B, L, V] with L, V >= 1, got shape {draft.shape}")
    if not jnp.issubdtype(draft.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got dtype {draft.dtype}")
    batch = draft.shape[0]
    if root_tokens is None:
        return jnp.zeros((batch,), jnp.int32)
    root_tokens = jnp.asarray(root_tokens)
    if root_tokens.shape != (batch,) or not jnp.issubdtype(root_tokens.dtype, jnp.integer):
        raise ValueError(
            f"root_tokens must be an integer array of shape ({batch},), got {root_tokens.dtype}{root_tokens.shape}"
        )
    return root_tokens.astype(jnp.int32)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _one_tree(top_lp: jax.Array, top_tok: jax.Array, root_token: jax.Array, budget: int) -> Tree:
    """One example. top_lp [L, K] float32 (descending per depth), top_tok [L, K] int32."""
    depth_count, k = top_lp.shape
    per_depth, n_drafts = tree_size_counts(budget, k, depth_count)  # K <= budget, so min(budget, K) = K

    # Step 2: per-depth best nodes, each depth kept in lexicographic order of rank tuples.
    scores, parent_pos, tokens = [], [], []
    prev = jnp.zeros((1,), jnp.float32)  # [n_{d-1}] scores of the kept parents; the root scores 0
    for d in range(depth_count):
        cand = (prev[:, None] + top_lp[d][None, :]).reshape(-1)  # [n_{d-1} * K], lexicographic
        _, idx = lax.top_k(cand, per_depth[d])  # stable: equal scores keep lexicographic order
        idx = jnp.sort(idx)  # [n_d] back to lexicographic order
        prev = cand[idx]
        scores.append(prev)
        parent_pos.append(idx // k)
        tokens.append(top_tok[d][idx % k])

    # Step 3a: subtree sizes inside the kept forest, bottom-up.
    sizes = [jnp.ones((per_depth[-1],), jnp.int32)]  # built deepest first, then reversed
    for d in range(depth_count - 2, -1, -1):
        sizes.append(1 + jnp.zeros((per_depth[d],), jnp.int32).at[parent_pos[d + 1]].add(sizes[-1]))
    sizes.reverse()
    # Step 3b: preorder index (root excluded) = parent's + 1 + sizes of earlier siblings. Children are
    # grouped by parent in parent order, so "earlier siblings" = all earlier nodes of this depth minus
    # the subtrees below earlier parents (sum of their size - 1).
    preorder = [_exclusive_cumsum(sizes[0])]
    for d in range(1, depth_count):
        p = parent_pos[d]
        below_earlier_parents = _exclusive_cumsum(sizes[d - 1] - 1)  # [n_{d-1}]
        preorder.append(preorder[d - 1][p] + 1 + _exclusive_cumsum(sizes[d]) - below_earlier_parents[p])

    # Step 3c: global order. Flat node id = depth offset + position within depth.
    offsets = [0]
    for n in per_depth:
        offsets.append(offsets[-1] + n)
    n_kept = offsets[-1]
    all_scores = jnp.concatenate(scores)  # [N]
    all_pre = jnp.concatenate(preorder)  # [N] a permutation of 0..N-1
    all_tokens = jnp.concatenate(tokens)  # [N]
    all_depths = jnp.concatenate([jnp.full((n,), d + 1, jnp.int32) for d, n in enumerate(per_depth)])
    all_parents = jnp.concatenate(
        [jnp.full((per_depth[0],), -1, jnp.int32)]
        + [parent_pos[d].astype(jnp.int32) + offsets[d - 1] for d in range(1, depth_count)]
    )  # [N] flat id of the parent, -1 = root
    node_ids = jnp.arange(n_kept, dtype=jnp.int32)
    scores_lex = jnp.zeros((n_kept,), jnp.float32).at[all_pre].set(all_scores)  # [N] in preorder
    node_lex = jnp.zeros((n_kept,), jnp.int32).at[all_pre].set(node_ids)  # [N]
    top_scores, top_pos = lax.top_k(scores_lex, n_drafts)  # [n] heap pop order
    chosen = node_lex[top_pos]  # [n] flat ids in pop order
    slot_of = jnp.zeros((n_kept,), jnp.int32).at[chosen].set(jnp.arange(1, n_drafts + 1, dtype=jnp.int32))
    chosen_parent = all_parents[chosen]
    # The chosen set is prefix-closed (a parent's key beats its child's), so slot_of[parent] is set.
    parent_slot = jnp.where(chosen_parent < 0, 0, slot_of[jnp.maximum(chosen_parent, 0)])

    t = 1 + budget
    pad = t - 1 - n_drafts
    out_tokens = jnp.concatenate([root_token[None], all_tokens[chosen], jnp.zeros((pad,), jnp.int32)])
    out_parents = jnp.concatenate([jnp.array([-1], jnp.int32), parent_slot, jnp.full((pad,), -1, jnp.int32)])
    out_depths = jnp.concatenate([jnp.zeros((1,), jnp.int32), all_depths[chosen], jnp.zeros((pad,), jnp.int32)])
    valid = jnp.arange(t) <= n_drafts
    out_scores = jnp.concatenate(
        [jnp.zeros((1,), jnp.float32), top_scores, jnp.full((pad,), -jnp.inf, jnp.float32)]
    )
    return Tree(out_tokens, out_parents, out_depths, valid, _visibility(out_parents, depth_count), out_scores)


def _visibility(parents: jax.Array, depth_count: int) -> jax.Array:
    """[T, T] bool, row i = i and its ancestors; parents [T] with -1 for root/unused (depth <= L)."""
    t = parents.shape[0]
    eye = jnp.eye(t, dtype=bool)
    visible = eye
    safe = jnp.maximum(parents, 0)
    has_parent = (parents >= 0)[:, None]
    for _ in range(depth_count):  # row i |= row parent(i); after L rounds every ancestor is in
        visible = eye | (has_parent & visible[safe])
    return visible


def _choose(kernels: dispatch.Kernels | None, budget: int, depth_count: int) -> tuple[dispatch.Kernels, bool]:
    """(kernels checked, whether the tree-build kernel runs)."""
    kernels = dispatch.as_kernels(kernels)
    choice = dispatch.choose_tree(budget=budget, depth_count=depth_count, impl=kernels.tree,
                                  interpret=kernels.interpret)
    return kernels, choice.impl == "triton"


def _tree_from_top(top_lp: jax.Array, top_tok: jax.Array, budget: int, root_tokens: jax.Array,
                   kernels: dispatch.Kernels, on_kernel: bool, vocab: int) -> Tree:
    """top_lp [B, L, K] float32 descending per depth, top_tok [B, L, K] from `lax.top_k` over the vocab."""
    depth_count = top_lp.shape[1]
    if on_kernel:
        _, n_drafts = tree_size_counts(budget, vocab, depth_count)
        tokens, parents, depths, scores, visible = tree_build.build_tree_from_top(
            top_lp, top_tok.astype(jnp.int32), root_tokens, budget=budget, n_drafts=n_drafts,
            interpret=kernels.interpret)
        valid = jnp.broadcast_to(jnp.arange(1 + budget) <= n_drafts, tokens.shape)
        return Tree(tokens, parents, depths, valid, visible, scores)
    # XLA merges the per-depth slices below into the slice that ends its sort-based top_k, then no longer
    # recognises the TopK pattern and sorts the whole vocabulary (0.8 s instead of 8 ms at V = 163840 on
    # CPU). The barrier keeps the top_k a top_k.
    top_lp, top_tok = lax.optimization_barrier((top_lp, top_tok))
    return jax.vmap(_one_tree, in_axes=(0, 0, 0, None))(top_lp, top_tok.astype(jnp.int32), root_tokens, budget)


def build_tree_from_log_probs(log_probs: jax.Array, budget: int, root_tokens=None, *,
                              kernels: dispatch.Kernels | None = None) -> Tree:
    """Tree over per-depth log-probs `log_probs` [B, L, V] (float, every value <= 0, finite or -inf).

    The values need not be normalised (the tree only adds and compares them); float32 arithmetic.
    """
    root_tokens = _check_args(log_probs, budget, root_tokens, "log_probs")
    kernels, on_kernel = _choose(kernels, budget, log_probs.shape[1])
    k = min(budget, log_probs.shape[-1])
    top_lp, top_tok = lax.top_k(log_probs.astype(jnp.float32), k)  # [B, L, K]
    return _tree_from_top(top_lp, top_tok, budget, root_tokens, kernels, on_kernel, log_probs.shape[-1])


def build_tree(draft_logits: jax.Array, budget: int, root_tokens=None, *,
               kernels: dispatch.Kernels | None = None) -> Tree:
    """Best-first DDTree tree of `budget` drafts from drafter logits [B, L, V] (depths 1..L).

    `budget` is a static Python int; T = 1 + budget. `root_tokens` [B] int (the bonus tokens, default 0)
    fill node 0. Scores are float32 sums of `log_softmax(draft_logits)`. If fewer than `budget` nodes
    exist (sum_d min(budget, V)^d < budget), the tail slots are unused (valid False). DFlash's single
    path is `build_chain`, not a budget choice here. `kernels.tree` picks the builder (module docstring).
    """
    root_tokens = _check_args(draft_logits, budget, root_tokens, "draft_logits")
    kernels, on_kernel = _choose(kernels, budget, draft_logits.shape[1])
    vocab = draft_logits.shape[-1]
    k = min(budget, vocab)
    front = tree_build.pick_front_end(vocab) if on_kernel else "xla"
    top_lp, top_tok = front_end_top_log_probs(draft_logits, k, front, interpret=kernels.interpret)
    return _tree_from_top(top_lp, top_tok, budget, root_tokens, kernels, on_kernel, vocab)


def front_end_top_log_probs(draft_logits: jax.Array, k: int, front: str, *,
                            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`top_log_probs` as front end `front` computes it (one of tree_build.FRONT_ENDS): "xla" is
    `top_log_probs` itself; "pallas" / "pallas_fused" the kernel's one-launch front end
    (pallas_kernels/tree_build/front.py) after XLA's logsumexp / with its own."""
    if front == "xla":
        return top_log_probs(draft_logits, k)
    lse = None if front == "pallas_fused" else jax.nn.logsumexp(draft_logits.astype(jnp.float32), axis=-1)
    return tree_build.top_log_probs_pallas(draft_logits, k, lse, interpret=interpret)


def top_log_probs(draft_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The front end both builders share: per-depth top-k of drafter logits [B, L, V] as float32 log-softmax
    values [B, L, K] (descending, equal values lower token id first) and their token ids [B, L, K].

    top_k on the logits, then only the K winners are shifted by the logsumexp: the same ranks, log-softmax
    values, and no [B, L, V] log-prob array."""
    logits = draft_logits.astype(jnp.float32)  # [B, L, V]
    top_logits, top_tok = lax.top_k(logits, k)  # [B, L, K]
    return top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True), top_tok


def build_chain(draft_logits: jax.Array, root_tokens=None) -> Tree:
    """DFlash's single path: root then the argmax token of each depth, T = 1 + L, a chain tree.

    Equal to the heap tree with only rank-0 tokens (K = 1) and budget L.
    """
    root_tokens = _check_args(draft_logits, 1, root_tokens, "draft_logits")
    batch, depth_count, _ = draft_logits.shape
    t = 1 + depth_count
    log_probs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)  # [B, L, V]
    best = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)  # [B, L] first maximum on ties
    best_lp = jnp.take_along_axis(log_probs, best[..., None], axis=-1)[..., 0]  # [B, L]
    tokens = jnp.concatenate([root_tokens[:, None], best], axis=1)  # [B, T]
    parents = jnp.broadcast_to(jnp.arange(-1, t - 1, dtype=jnp.int32), (batch, t))
    depths = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    scores = jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), jnp.cumsum(best_lp, axis=1)], axis=1)
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))
    return Tree(tokens, parents, depths, jnp.ones((batch, t), bool), visible, scores)
