"""DDTree (and DFlash) speculative decoding: the whole decode loop in one `jax.jit` (docs/ddtree.md).

One round, all shapes static (T = 1 + tree budget):
  draft    the drafter reads the context features of the committed tokens and proposes L = block-1
           positions of logits from the bonus token;
  build    best-first tree of `budget` drafts (or DFlash's argmax chain);
  verify   ONE target forward over the T tree tokens at positions start + depth, each seeing the
           committed prefix and its own ancestors; their latent rows land in cache slots start..start+T;
  accept   posterior = argmax (or an independent target sample) at every node; walk from the root
           while a child carries the posterior token of its parent: m nodes, next bonus = posterior[last];
  compact  cache rows start + a_k -> start + k; the accepted nodes' hidden states become drafter context.
Rows of a batch advance independently (own start, own acceptance); finished rows stop
committing (they ride along in the batch until every row is done).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from kdtree_jax import budget as budget_lib
from kdtree_jax import sharding
from kdtree_jax.budget import BudgetCosts
from kdtree_jax.config import ModelConfig
from kdtree_jax.decoding import (
    GenerateOutput,
    SamplingParams,
    cache_length,
    emit,
    mask_first_logits,
    on_mesh,
    prefill,
    sample,
)
from kdtree_jax.drafter import (
    DrafterCache,
    DrafterConfig,
    check_drafter_params,
    drafter_extend_context,
    drafter_forward,
    fold_drafter_params,
    init_drafter_cache,
    shared_tables,
)
from kdtree_jax.model import KVCache, Params, fold_params, forward_with_cache, init_cache, write_rows
from kdtree_jax.tree import Tree, build_chain, build_tree
from pallas_kernels.int4 import Int4Weight

# The verify forward takes 1 + budget tokens with a [T, T] tree mask, and the tree build sorts budget * K
# candidates per depth: 1024 compiles in about a minute on the tiny model (CPU), far past where a larger
# tree still pays for its verify cost (docs/k26_verify_cost.md).
MAX_TREE_BUDGET = 1024
AUTO = "auto"


# ------------------------------------------------------------------------------------- draft models
DRAFTER_DTYPES = ("float32", "bfloat16", "float16")


@flax.struct.dataclass
class DFlashDraft:
    """The block-diffusion drafter conditioned on target hidden states (kdtree_jax.drafter).

    compute_dtype: the dtype the drafter computes in (one of DRAFTER_DTYPES; None: the target's, as it always did).
    The drafter only proposes, so its numerics never change what a greedy verify commits: a float32 target can
    verify drafts of a bfloat16 drafter (the dtype it trained in) and the greedy output stays the AR output.
    `prepared` (once per `generate` call, before the loop) joins its matrices, casts them and the target's
    embedding and lm_head it shares to compute_dtype (`tables`), so the loop converts nothing."""

    dcfg: DrafterConfig = flax.struct.field(pytree_node=False)
    dparams: Any
    compute_dtype: str | None = flax.struct.field(pytree_node=False, default=None)
    tables: Any = None  # (embed [V, D], lm_head [D, V]) in compute_dtype, set by prepared()

    @property
    def block_size(self) -> int:
        return self.dcfg.block_size

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(self.dcfg.target_layer_ids)

    def init_state(self, batch: int, max_len: int, dtype) -> DrafterCache:
        return init_drafter_cache(self.dcfg, batch, max_len, dtype if self.compute_dtype is None
                                  else jnp.dtype(self.compute_dtype))

    def extend(self, state, hidden, positions, num_valid):
        return drafter_extend_context(self.dparams, self.dcfg, state, hidden.astype(state.keys.dtype), positions,
                                      num_valid)

    def _shared_tables(self, cfg: ModelConfig, params: Params) -> tuple[jax.Array, jax.Array]:
        """The target's embedding [V, D] and lm_head [D, V] the drafter shares, in compute_dtype when set."""
        embed, lm_head = shared_tables(cfg, params)
        if self.compute_dtype is None:
            return embed, lm_head
        return embed.astype(self.compute_dtype), lm_head.astype(self.compute_dtype)

    def draft(self, state, cfg: ModelConfig, params: Params, bonus, block_start):
        embed, lm_head = self.tables if self.tables is not None else self._shared_tables(cfg, params)
        return drafter_forward(self.dparams, self.dcfg, state, embed, lm_head, bonus, block_start)

    def prepared(self, cfg: ModelConfig, params: Params) -> DFlashDraft:
        """The same drafter on its joined matrices (drafter.fold_drafter_params); with a compute_dtype, those cast to
        it and the target's embedding and lm_head too (`tables`). `generate` calls it once per call."""
        if self.compute_dtype is None:
            return dataclasses.replace(self, dparams=fold_drafter_params(self.dparams, self.dcfg))
        dparams = jax.tree.map(lambda a: a.astype(self.compute_dtype), self.dparams)
        return dataclasses.replace(self, dparams=fold_drafter_params(dparams, self.dcfg),
                                   tables=self._shared_tables(cfg, params))


@flax.struct.dataclass
class OracleDraft:
    """A drafter that knows the answer: at block start s it puts all mass on `sequence[b, s+1 ..]`.

    For tests and upper-bound benchmarks: with the true greedy continuation every round accepts the
    whole block. `sequence` [B, S] int32 holds prompt + continuation (positions past S draft token 0)."""

    sequence: jax.Array
    block: int = flax.struct.field(pytree_node=False)
    vocab_size: int = flax.struct.field(pytree_node=False)

    @property
    def block_size(self) -> int:
        return self.block

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return ()

    def init_state(self, batch: int, max_len: int, dtype):
        return jnp.zeros((batch,), jnp.int32)

    def extend(self, state, hidden, positions, num_valid):
        return state + num_valid

    def draft(self, state, cfg: ModelConfig, params: Params, bonus, block_start):
        steps = block_start[:, None] + jnp.arange(1, self.block, dtype=jnp.int32)[None, :]  # [B, L]
        tokens = jnp.take_along_axis(self.sequence, jnp.minimum(steps, self.sequence.shape[1] - 1), axis=1)
        tokens = jnp.where(steps < self.sequence.shape[1], tokens, 0)
        return jnp.where(jax.nn.one_hot(tokens, self.vocab_size, dtype=bool), 0.0, -1e9)  # [B, L, V]

    def prepared(self, cfg: ModelConfig, params: Params) -> OracleDraft:
        return self


def as_draft_model(cfg: ModelConfig, drafter):
    if isinstance(drafter, OracleDraft):
        return drafter
    compute_dtype = None
    if isinstance(drafter, DFlashDraft):
        if drafter.compute_dtype is not None and drafter.compute_dtype not in DRAFTER_DTYPES:
            raise ValueError(f"DFlashDraft compute_dtype must be None or one of {DRAFTER_DTYPES}, "
                             f"got {drafter.compute_dtype!r}")
        if drafter.tables is not None:
            raise ValueError("pass the DFlashDraft itself, not a prepared() one: generate prepares it per call")
        drafter, compute_dtype = (drafter.dcfg, drafter.dparams), drafter.compute_dtype
    if isinstance(drafter, tuple) and len(drafter) == 2 and isinstance(drafter[0], DrafterConfig):
        dcfg, dparams = drafter
        dcfg.validate()
        dcfg.check_target(cfg)
        check_drafter_params(dcfg, dparams)
        return DFlashDraft(dcfg, dparams, compute_dtype)
    raise ValueError("drafter must be (DrafterConfig, drafter params), a DFlashDraft or an OracleDraft, "
                     f"got {type(drafter).__name__}")


# ------------------------------------------------------------------------------------ one round
def accept_path(tree: Tree, posterior: jax.Array, max_depth: int):
    """Greedy walk: from the root, move to the child whose token equals posterior[current].

    tree: T slots; posterior [B, T]. Returns (path [B, max_depth + 1] node ids, padded with the last
    node; m [B] nodes on the path, >= 1; next bonus token [B]).

    Computed without a walk (two dependent reductions instead of max_depth dependent steps): a node is on the
    path iff it and every ancestor carry the token their parent's posterior asks for. Children of one node
    carry distinct tokens (distinct ranks of one depth), so those nodes form one chain from the root. A child
    always has a later slot than its parent (trees list nodes in pop order), so path[k], the chain's node at
    depth min(k, its last depth), is the on-path node with the largest slot among those of depth <= k."""
    t = tree.tokens.shape[1]
    slots = jnp.arange(t, dtype=jnp.int32)
    parent_wants = jnp.take_along_axis(posterior, jnp.maximum(tree.parents, 0), axis=1)  # [B, T]
    match = tree.valid & ((tree.tokens == parent_wants) | (slots == 0)[None, :])  # root always
    on_path = jnp.all(~tree.visible | match[:, None, :], axis=2)  # [B, T]: self and all ancestors match
    steps = jnp.arange(max_depth + 1, dtype=jnp.int32)  # [K]
    upto = on_path[:, None, :] & (tree.depths[:, None, :] <= steps[None, :, None])  # [B, K, T]
    path = jnp.max(jnp.where(upto, slots, 0), axis=2)  # [B, K]; the root (slot 0) is always on the path
    last = path[:, -1:]  # [B, 1] the path's deepest node
    length = jnp.take_along_axis(tree.depths, last, axis=1)[:, 0] + 1
    bonus = jnp.take_along_axis(posterior, last, axis=1)[:, 0]
    return path, length, bonus


def compact_cache(latent: jax.Array, start: jax.Array, path: jax.Array) -> jax.Array:
    """Move cache rows start + path[b, k] to start + k (all layers). latent [L, B, S, C]; the rows
    past start + m are garbage afterwards, beyond the new committed length."""
    def one_layer(layer_cache):  # [B, S, C]
        moved = jnp.take_along_axis(layer_cache, (start[:, None] + path)[:, :, None], axis=1)  # [B, K, C]
        return write_rows(layer_cache, moved, start)

    return jax.vmap(one_layer)(latent)


def root_only(bonus: jax.Array) -> Tree:
    """The tree of no drafts: the bonus token [B] alone (T = 1). Verifying it is an AR step."""
    batch = bonus.shape[0]
    return Tree(bonus[:, None].astype(jnp.int32), jnp.full((batch, 1), -1, jnp.int32), jnp.zeros((batch, 1), jnp.int32),
                jnp.ones((batch, 1), bool), jnp.ones((batch, 1, 1), bool), jnp.zeros((batch, 1), jnp.float32))


def slice_tree(tree: Tree, budget: int) -> Tree:
    """The first `budget` drafts of a best-first tree: exactly the budget-`budget` tree (the heap's first pops;
    parents always come before their children)."""
    t = 1 + budget
    return Tree(tree.tokens[:, :t], tree.parents[:, :t], tree.depths[:, :t], tree.valid[:, :t],
                tree.visible[:, :t, :t], tree.scores[:, :t])


class _State(NamedTuple):
    out: jax.Array  # [B, N]
    count: jax.Array  # [B]
    done: jax.Array  # [B]
    bonus: jax.Array  # [B] last emitted token: not yet in the target cache
    cache: KVCache
    draft_state: Any
    key: jax.Array
    rounds: jax.Array  # []
    accepted: jax.Array  # [B, N] tokens committed per round
    budgets: jax.Array  # [N] the tree budget each round verified (tree_budget="auto" chooses it per round; 0: no draft)
    rate: jax.Array  # [] auto: the last drafted round's expected tokens per cost per row (budget.choose_with_rate)
    since: jax.Array  # [] auto: rounds since the last drafted one


@functools.partial(jax.jit, static_argnames=("cfg", "method", "budget", "max_new_tokens", "max_len",
                                             "sampling", "stop_tokens", "kernels"))
def _generate(params, draft_model, prompt_tokens, prompt_lengths, key, first_token_mask, *, cfg, method, budget,
              max_new_tokens, max_len, sampling, stop_tokens, kernels=None):
    batch = prompt_tokens.shape[0]
    dtype = params["embed_tokens"].dtype
    depth = draft_model.block_size - 1
    hidden_layers = draft_model.hidden_layers
    params = fold_params(params, cfg, kernels, sharded=sharding.active_mesh() is not None)  # once, before the loop
    draft_model = draft_model.prepared(cfg, params)

    cache = init_cache(cfg, batch, max_len, dtype)
    last_logits, hidden, cache = prefill(params, cfg, prompt_tokens, prompt_lengths, cache, hidden_layers,
                                             kernels=kernels)
    draft_state = draft_model.init_state(batch, max_len, dtype)
    positions = jnp.broadcast_to(jnp.arange(prompt_tokens.shape[1], dtype=jnp.int32), prompt_tokens.shape)
    draft_state = draft_model.extend(draft_state, hidden, positions, prompt_lengths)
    key, sub = jax.random.split(key)
    bonus = sample(mask_first_logits(last_logits, first_token_mask), sub, sampling)
    out = jnp.zeros((batch, max_new_tokens), jnp.int32)
    out, count, done, _ = emit(out, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
                               bonus[:, None], jnp.ones((batch,), jnp.int32), stop_tokens)
    state = _State(out, count, done, bonus, cache, draft_state, key, jnp.int32(0),
                   jnp.zeros((batch, max_new_tokens), jnp.int32), jnp.zeros((max_new_tokens,), jnp.int32),
                   jnp.float32(jnp.inf), jnp.int32(0))

    def verify(tree: Tree, cache: KVCache, start, key):
        """One target forward over the tree, the posterior, the accepted path and what it carries."""
        positions = start[:, None] + tree.depths  # [B, T]
        logits, hidden, cache = forward_with_cache(params, cfg, tree.tokens, positions, cache,
                                                   visibility=tree.visible, hidden_layers=hidden_layers,
                                                   kernels=kernels)
        posterior = sample(logits, key, sampling)  # [B, T]: independent per node when sampling
        path, length, next_bonus = accept_path(tree, posterior, depth)
        # emitted this round: the accepted drafts then the new bonus = posterior along the path
        new_tokens = jnp.take_along_axis(posterior, path, axis=1)  # [B, L + 1]
        path_hidden = jnp.take_along_axis(hidden, path[:, :, None, None], axis=1)  # [B, L+1, n, D]
        return path, length, next_bonus, new_tokens, cache, path_hidden

    def verify_at(tree_budget: int):
        """`verify` of the first tree_budget drafts: one compiled branch per candidate budget."""
        return lambda tree, cache, start, key: verify(slice_tree(tree, tree_budget), cache, start, key)

    def draft(s: _State, start):
        draft_logits = draft_model.draft(s.draft_state, cfg, params, s.bonus, start)  # [B, L, V]
        # the tree builder and acceptance are tiny: they run replicated on every device
        return sharding.constrain(draft_logits, None, None, None)

    def body(s: _State) -> _State:
        start = s.cache.lengths  # [B]
        key, sub = jax.random.split(s.key)
        rate, since = s.rate, s.since
        if method == "dflash":
            tree = build_chain(draft(s, start), root_tokens=s.bonus)
            used = jnp.int32(depth)
            result = verify(tree, s.cache, start, sub)
        elif isinstance(budget, BudgetCosts):  # "auto": one build at the largest budget, the verify it pays for

            def drafted(s: _State):
                tree = build_tree(draft(s, start), budget.max_budget, root_tokens=s.bonus, kernels=kernels)
                choice, rate = budget_lib.choose_with_rate(tree.scores, ~s.done, budget)
                result = jax.lax.switch(choice, [verify_at(b) for b in budget.budgets], tree, s.cache, start, sub)
                return result, jnp.asarray(budget.budgets, jnp.int32)[choice], rate, jnp.int32(0)

            def undrafted(s: _State):  # an AR step: the bonus token alone, the drafter not run
                return verify(root_only(s.bonus), s.cache, start, sub), jnp.int32(0), s.rate, s.since + 1

            if budget.ar_cost is None:
                result, used, rate, since = drafted(s)
            else:
                pays = budget_lib.draft_pays(s.rate, s.since, budget.ar_cost)
                result, used, rate, since = jax.lax.cond(pays, drafted, undrafted, s)
        else:
            tree = build_tree(draft(s, start), budget, root_tokens=s.bonus, kernels=kernels)
            used = jnp.int32(budget)
            result = verify(tree, s.cache, start, sub)
        path, length, next_bonus, new_tokens, cache, path_hidden = result
        out, count, done, took = emit(s.out, s.count, s.done, new_tokens, length, stop_tokens)
        # commit what was emitted: the m accepted nodes, fewer when a stop token or max_new_tokens
        # cut the round, none once a row is done. So lengths = prompt + emitted - 1 <= P + N - 1,
        # and the next verify (T rows) and compaction (L + 1 rows) stay inside the cache.
        advance = took
        latent = compact_cache(cache.latent, start, path)
        cache = KVCache(latent=latent, lengths=start + advance)
        path_positions = start[:, None] + jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
        draft_state = draft_model.extend(s.draft_state, path_hidden, path_positions, advance)
        accepted = s.accepted.at[:, s.rounds].set(took)
        budgets = s.budgets.at[s.rounds].set(used)
        return _State(out, count, done, next_bonus, cache, draft_state, key, s.rounds + 1, accepted, budgets, rate,
                      since)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return GenerateOutput(tokens=state.out, lengths=state.count, num_target_forwards=state.rounds + 1,
                          rounds=state.rounds, acceptance_lengths=state.accepted, tree_budgets=state.budgets)


def generate_speculative(cfg: ModelConfig, params: Params, tokens, lengths, key, *, drafter, method: str,
                         tree_budget: int | str | None, max_new_tokens: int, sampling: SamplingParams,
                         stop_tokens: tuple[int, ...], max_len: int | None, mesh=None,
                         kernels=None, budget_costs: BudgetCosts | None = None,
                         first_token_mask=None) -> GenerateOutput:
    """DDTree / DFlash generation (called by `kdtree_jax.generate`, which checks the prompts and the
    first-token mask (None or bool [B, V]) and places params on `mesh`, a jax Mesh or None)."""
    if drafter is None:
        raise ValueError(f"method={method!r} needs a drafter: drafter=(DrafterConfig, drafter params)")
    draft_model = as_draft_model(cfg, drafter)
    depth = draft_model.block_size - 1
    if method == "dflash":
        if tree_budget is not None or budget_costs is not None:
            raise ValueError("method='dflash' drafts a single chain of block_size - 1 tokens; "
                             "tree_budget and budget_costs apply to method='ddtree' only")
        tree_slots = 1 + depth
        budget = None
    elif tree_budget == AUTO:
        budget = (budget_lib.default_costs(tokens.shape[0], temperature=sampling.temperature) if budget_costs is None
                  else budget_costs)
        if not isinstance(budget, BudgetCosts):
            raise ValueError(f"budget_costs must be a kdtree_jax.BudgetCosts, got {type(budget).__name__}")
        if budget.max_budget > MAX_TREE_BUDGET:
            raise ValueError(f"budget_costs' budgets must be <= {MAX_TREE_BUDGET}, got {budget.budgets}")
        tree_slots = 1 + budget.max_budget
    else:
        if (not isinstance(tree_budget, int) or isinstance(tree_budget, bool)
                or not 1 <= tree_budget <= MAX_TREE_BUDGET):
            raise ValueError(f"method='ddtree' needs tree_budget, an integer in [1, {MAX_TREE_BUDGET}] or "
                             f"'auto', got {tree_budget!r}")
        if budget_costs is not None:
            raise ValueError("budget_costs applies to tree_budget='auto' only")
        tree_slots = 1 + tree_budget
        budget = tree_budget
    if not cfg.tie_word_embeddings and isinstance(params.get("lm_head"), Int4Weight):
        raise ValueError("the drafter shares the target's lm_head, which must be dense (never INT4)")
    # verify writes T rows past the committed length; compaction rewrites depth + 1 rows there
    cache_rows = cache_length(cfg, tokens.shape[1], max_new_tokens, max(tree_slots, depth + 1), max_len)
    if mesh is not None:  # the drafter is tiny: a full copy on every device
        draft_model = sharding.replicate(draft_model, mesh)
    with on_mesh(mesh):
        return _generate(params, draft_model, jnp.asarray(tokens), jnp.asarray(lengths), key, first_token_mask,
                         cfg=cfg, method=method, budget=budget, max_new_tokens=max_new_tokens, max_len=cache_rows,
                         sampling=sampling, stop_tokens=stop_tokens, kernels=kernels)
