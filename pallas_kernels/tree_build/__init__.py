"""The DDTree tree builder as one kernel launch: per-depth top-K log-probs in, the best-first tree out.

`build_tree_from_top` checks its inputs and runs `triton.py`'s kernel (one program per batch row). Its
ground truth is `reference/tree.py` (the heap, literally); the engine's other implementation, the
jnp builder in `kdtree_jax/tree.py`, is what `pallas_kernels.dispatch.choose_tree` picks where the kernel
cannot run (no GPU and no interpret mode). `front.py` is the kernel's front end (drafter logits to per-depth
top-K log-probs, one launch); `pick_front_end` says which front end the engine puts before the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tree_build.front import MAX_FRONT_VOCAB, top_log_probs_pallas
from pallas_kernels.tree_build.triton import MAX_DEPTH, MAX_RANK, MAX_SLOT, POP_LOOPS, next_pow2, tree_build_pallas

__all__ = ["FRONT_END", "FRONT_ENDS", "MAX_FRONT_VOCAB", "MAX_KERNEL_BUDGET", "POP_LOOP", "POP_LOOPS",
           "build_tree_from_top", "kernel_shape_unsupported", "pick_front_end", "pick_num_warps",
           "top_log_probs_pallas"]

MAX_KERNEL_BUDGET = min(MAX_SLOT, MAX_RANK + 1)  # node fields are packed in one int32


def kernel_shape_unsupported(budget: int, depth_count: int) -> str | None:
    """Why the kernel cannot build this tree, or None."""
    if budget > MAX_KERNEL_BUDGET:
        return f"budget {budget} > {MAX_KERNEL_BUDGET}"
    if depth_count > MAX_DEPTH:
        return f"{depth_count} draft positions > {MAX_DEPTH}"
    return None


# The pop loop the engine runs (triton.py's docstring describes both). "key" has two dependent redux-able
# reductions and no uncached load per pop where "lex" has three reductions (one a float shuffle chain) and
# an L2 load. Measured on the H200 (benchmarks/results/tree_build.md, V 4096, L 15, B 1): "key" 7.6 vs 9.9 us at
# budget 32, 104.6 vs 112.8 at 256; both bit-exact to the heap natively (tests/kernels/test_tree_build.py on the
# H200, 2026-12-02, benchmarks/results/gpu_tests_h200.md). The engine runs "key".
POP_LOOP = "key"


# Front ends: "xla" (kdtree_jax.tree.top_log_probs: 4-6 XLA kernels), "pallas" (front.py after XLA's
# logsumexp, 2 reduction kernels: values bit for bit top_log_probs'), "pallas_fused" (front.py alone: one
# launch, values within an ulp or so of top_log_probs', the same ranks and tokens). Measured on the H200
# (benchmarks/results/tree_build.md, V 4096, budget 32): 38.3 / 12.5 / 9.5 us; "pallas_fused" passed the native
# tests on the H200 (2026-12-02). The engine runs "pallas_fused" where the vocabulary fits it (pick_front_end).
FRONT_ENDS = ("xla", "pallas", "pallas_fused")
FRONT_END = "pallas_fused"


def pick_front_end(vocab: int) -> str:
    """The front end before the kernel: FRONT_END where a vocabulary row fits front.py's registers, else
    XLA's (at Kimi K2's 163840 a row is 640 KB)."""
    return FRONT_END if vocab <= MAX_FRONT_VOCAB else "xla"


def pick_num_warps(n_drafts: int) -> int:
    """Warps per program: the pop loop is a chain of reductions over next_pow2(n_drafts) lanes; more warps
    only pay once a warp would hold many lanes (H200, benchmarks/results/tree_build_v1.md: 1 warp is best or
    within 2 us up to budget 128, 2 warps at 256, 4 at 512)."""
    lanes = next_pow2(n_drafts)
    return 1 if lanes <= 128 else 2 if lanes <= 256 else 4


def build_tree_from_top(top_lp: jax.Array, top_tok: jax.Array, root_tokens: jax.Array, *, budget: int,
                        n_drafts: int, interpret: bool = False, num_warps: int | None = None,
                        pop: str = POP_LOOP):
    """top_lp [B, L, K] float32 per-depth log-probs in descending order (equal values: lower token id
    first, as `lax.top_k` gives them), top_tok [B, L, K] int32 their token ids, root_tokens [B] int32;
    `budget` drafts, of which `n_drafts` (<= budget, the number of rank tuples that exist) are filled.
    Returns (tokens, parents, depths, scores, visible), each [B, T] (visible [B, T, T]), T = 1 + budget,
    in the layout of `kdtree_jax.tree.Tree`. `pop` picks the pop loop (POP_LOOPS; the same tree either way)."""
    if top_lp.ndim != 3 or top_lp.shape != top_tok.shape:
        raise ValueError(f"top_lp and top_tok must be [B, L, K] of one shape, got {top_lp.shape} and {top_tok.shape}")
    if top_lp.dtype != jnp.float32 or top_tok.dtype != jnp.int32:
        raise ValueError(f"top_lp must be float32 and top_tok int32, got {top_lp.dtype} and {top_tok.dtype}")
    batch, depth_count, k = top_lp.shape
    if root_tokens.shape != (batch,) or root_tokens.dtype != jnp.int32:
        raise ValueError(f"root_tokens must be int32 [{batch}], got {root_tokens.dtype}{root_tokens.shape}")
    why = kernel_shape_unsupported(budget, depth_count)
    if why:
        raise ValueError(f"the tree-build kernel cannot build this tree: {why}")
    if not 1 <= n_drafts <= budget or k > budget:
        raise ValueError(f"need 1 <= n_drafts <= budget and K <= budget, got n_drafts={n_drafts}, K={k}, "
                         f"budget={budget}")
    warps = pick_num_warps(n_drafts) if num_warps is None else num_warps
    return tree_build_pallas(top_lp, top_tok, root_tokens, budget=budget, n_drafts=n_drafts, num_warps=warps,
                             pop=pop, interpret=interpret)
