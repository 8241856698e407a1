"""Train the shipped DFlash drafter against the frozen (shipped, INT4-expert) target.

    python -m training.train_drafter --target OUT/target/int4 --data DIR --generate-only --data-cache D.npz
    python -m training.train_drafter --target OUT/target/int4 --data DIR --data-cache D.npz \
        --time-budget-s 100 --block-size 16 --out OUT/drafter16

1. Data (as DFlash: the target's own outputs): prompts are random windows of the training split;
   the target continues each one (`kj.generate`; greedy, or a `--greedy-fraction` of the calls greedy and
   the rest at temperature 1), so the drafter learns what this target says, not what the corpus says.
   `--data-cache FILE.npz` keeps the generated set for reruns with other training settings.
2. Loss: for `--anchors` random anchor positions a per sequence (inside the generated part; `--anchor-horizon N`:
   inside its first N tokens), the block
   [token a, mask x (block-1)] at positions a..a+block-1 attends to the drafter context features of
   tokens [0, a) and to itself; cross-entropy of the block's predictions against tokens a+1..a+block-1,
   position k weighted exp(-(k-1)/gamma) (DFlash's decaying weights), normalised to sum 1. `--distill W` mixes in
   (weight W) the cross-entropy against the target's own distribution for each label, from the target forward
   that gives the drafter its features (the logged losses then include that term; the accuracies do not change).
   The training forward IS `drafter_forward` on a cache holding the context of every anchor
   (`drafter_training_logits`; tests/test_shipped_model.py checks it against incremental inference).
3. Held-out scores every `--eval-every` steps: loss, position-1 accuracy and chain measure on greedy and
   temperature-1 continuations of held-out windows, and the decode's view (`--decode-horizon`): greedy DFlash's and
   DDTree's mean acceptance over the first new tokens, simulated from the teacher-forced drafter at every position
   (`teacher_forced_leads`, `simulated_acceptance`; tests/test_shipped_model.py checks the decode against them).
Mixed precision as in training/train_target.py: float32 master weights, the drafter's forward and backward in
`--compute-dtype`; the frozen target runs in float32 as it does at inference. `--time-budget-s` fixes the step
count from the measured step time (logged as total_steps; `--steps N` reproduces it).
Writes <out>/drafter (Orbax, weights in `--save-dtype`), <out>/log.jsonl, <out>/loss.png, <out>/summary.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kdtree_jax as kj
from kdtree_jax.ddtree import MAX_TREE_BUDGET
from kdtree_jax.drafter import (
    DrafterCache,
    check_drafter_params,
    drafter_extend_context,
    drafter_forward,
    init_drafter_cache,
    shared_tables,
)
from kdtree_jax.weights import cast_params
from training.common import (
    TOKENIZER_PATH,
    JsonLog,
    describe_device,
    load_tokenizer,
    on_one_device,
    param_count,
    plot_curves,
)
from training.data import load_streams, random_windows
from training.train_target import StepSchedule, causal_forward, check_step_args, make_optimizer, set_learning_rate


def target_outputs(params, cfg: kj.ModelConfig, tokens: jax.Array, layers: tuple[int, ...]):
    """One plain causal target forward over tokens [B, T], no gradient: (logits [B, T, V] float32, the residual
    stream after target layers `layers` [B, T, n, D])."""
    logits, hidden = causal_forward(params, cfg, tokens, params["embed_tokens"].dtype, hidden_layers=layers)
    return jax.lax.stop_gradient(logits.astype(jnp.float32)), jax.lax.stop_gradient(hidden)


def drafter_training_logits(dparams, dcfg: kj.DrafterConfig, hidden: jax.Array, tokens: jax.Array,
                            anchors: jax.Array, embed: jax.Array, lm_head: jax.Array) -> jax.Array:
    """Teacher-forced drafter logits for many anchors at once.

    hidden [B, T, n, D]: target hidden states of tokens [B, T]; anchors [B, K] int in [0, T).
    Returns float32 [B, K, block-1, V]: for anchor a, what `drafter_forward` returns when the cache
    holds the context of tokens [0, a) and the bonus token is tokens[a] at position a. It is built as
    exactly that call: one cache row per (sequence, anchor) holding the whole sequence's context
    keys/values, with `lengths` = a so only rows [0, a) are visible.
    """
    B, T = tokens.shape
    K = anchors.shape[1]
    cache = init_drafter_cache(dcfg, B, T, hidden.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = drafter_extend_context(dparams, dcfg, cache, hidden, positions, jnp.full((B,), T, jnp.int32))
    # [Ld, B, T, KVH, hd] -> [Ld, B*K, T, KVH, hd]: every anchor of a sequence shares its context rows
    repeat = lambda x: jnp.repeat(x, K, axis=1)  # noqa: E731
    flat_anchors = anchors.reshape(B * K).astype(jnp.int32)
    cache = DrafterCache(repeat(cache.keys), repeat(cache.values), flat_anchors)
    bonus = jnp.take_along_axis(tokens, anchors, axis=1).reshape(B * K)  # [B*K]
    logits = drafter_forward(dparams, dcfg, cache, embed, lm_head, bonus, flat_anchors)  # [B*K, L, V]
    return logits.reshape(B, K, dcfg.block_size - 1, -1)


def teacher_forced_leads(dparams, dcfg: kj.DrafterConfig, hidden: jax.Array, tokens: jax.Array, anchors: jax.Array,
                         embed: jax.Array, lm_head: jax.Array, budgets: tuple[int, ...] = (0,)) -> jax.Array:
    """How many drafts a greedy verify accepts at each anchor, the drafter teacher-forced as in training: for budget 0
    DFlash's, how many of the block's argmax predictions, from the first on, equal the tokens that follow; for a
    budget N DDTree's, the depth of the deepest path of the best-first tree of N drafts (`kj.build_tree` over the
    block's logits) that spells the tokens that follow. Same arguments as `drafter_training_logits`; returns
    [len(budgets), B, K] int32 (labels past the sequence's end match nothing)."""
    logits = drafter_training_logits(dparams, dcfg, hidden, tokens, anchors, embed, lm_head)  # [B, K, L, V]
    B, K, L, V = logits.shape
    T = tokens.shape[1]
    label_pos = anchors[:, :, None] + 1 + jnp.arange(L)[None, None, :]  # [B, K, L]
    labels = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(label_pos, T - 1), axis=2)
    labels = jnp.where(label_pos < T, labels, -1)  # no token id matches -1
    out = []
    for budget in budgets:
        if budget == 0:
            out.append(jnp.cumprod(jnp.argmax(logits, -1) == labels, axis=-1).sum(-1))
            continue
        tree = kj.build_tree(logits.reshape(B * K, L, V), budget)
        flat = labels.reshape(B * K, L)
        rows = jnp.arange(B * K)

        def match(node, matched, tree=tree, flat=flat, rows=rows):  # heap pop order: a parent before its children
            label = flat[rows, jnp.maximum(tree.depths[:, node] - 1, 0)]
            ok = tree.valid[:, node] & matched[rows, jnp.maximum(tree.parents[:, node], 0)]
            return matched.at[:, node].set(ok & (tree.tokens[:, node] == label))

        root = jnp.zeros(tree.tokens.shape, bool).at[:, 0].set(True)  # the root: the bonus token, committed
        matched = jax.lax.fori_loop(1, tree.tokens.shape[1], match, root)
        out.append(jnp.where(matched, tree.depths, 0).max(-1).reshape(B, K))
    return jnp.stack(out).astype(jnp.int32)


def simulated_acceptance(leads: np.ndarray, horizon: int) -> float:
    """A greedy decode's mean acceptance (tokens committed per round) over the first `horizon` new tokens of each
    sequence, from the teacher-forced leads of its anchors: leads [B, >= horizon - 1], column j the anchor j new
    tokens in (column 0: the prefill's token, the first round's bonus). A round whose bonus token is j tokens in
    commits min(lead + 1, horizon - 1 - j) tokens, the next bonus among them, as the DFlash and DDTree decode loops
    do (tests/test_shipped_model.py checks both against the teacher-forced drafter round by round)."""
    if horizon < 2 or leads.shape[1] < horizon - 1:
        raise ValueError(f"horizon {horizon} needs 2 <= horizon <= {leads.shape[1] + 1} (leads {leads.shape})")
    committed = rounds = 0
    for row in np.asarray(leads):
        j = 0
        while j < horizon - 1:
            n = min(int(row[j]) + 1, horizon - 1 - j)
            committed, rounds, j = committed + n, rounds + 1, j + n
    return committed / rounds


def grow_layers(dcfg: kj.DrafterConfig, dparams: dict, extra: int, key: jax.Array) -> tuple[kj.DrafterConfig, dict]:
    """The drafter with `extra` decoder layers appended after its last one, computing the same function: each new
    layer is freshly initialised except its residual outputs (attention o and MLP down), which are zero, so it adds
    nothing to the residual stream until training moves them (the gradient reaches o and down at once, and through
    them the rest of the layer). More capacity for a drafter that has stopped improving, without losing what it has
    learnt."""
    if extra < 1:
        raise ValueError(f"grow_layers: extra must be >= 1, got {extra}")
    grown = dcfg.replace(num_hidden_layers=dcfg.num_hidden_layers + extra)
    fresh = kj.init_drafter_params(grown, key, dtype=jax.tree.leaves(dparams)[0].dtype)
    out = dict(dparams)
    for i in range(dcfg.num_hidden_layers, grown.num_hidden_layers):
        layer = fresh[f"layers_{i}"]
        out[f"layers_{i}"] = {**layer, "attn": {**layer["attn"], "o": jnp.zeros_like(layer["attn"]["o"])},
                              "mlp": {**layer["mlp"], "down": jnp.zeros_like(layer["mlp"]["down"])}}
    check_drafter_params(grown, out)
    return grown, out


def grow_width(dcfg: kj.DrafterConfig, dparams: dict, width: int, key: jax.Array) -> tuple[kj.DrafterConfig, dict]:
    """The drafter with every layer's SwiGLU widened to `width`, computing the same function: the new gate and up
    columns freshly initialised, the new rows of the down projection zero, so they add nothing until training moves
    them (the gradient reaches those rows at once). Capacity without depth: on a GPU a wider matmul is the same
    launches, where two added layers cost a DDTree round 47 more kernels (317 against 270; a deeper drafter
    measured slower end to end, docs/training.md)."""
    if width <= dcfg.intermediate_size:
        raise ValueError(f"grow_width: width must exceed the drafter's {dcfg.intermediate_size}, got {width}")
    grown = dcfg.replace(intermediate_size=width)
    fresh = kj.init_drafter_params(grown, key, dtype=jax.tree.leaves(dparams)[0].dtype)
    old = dcfg.intermediate_size
    out = dict(dparams)
    for i in range(dcfg.num_hidden_layers):
        mlp, new = dparams[f"layers_{i}"]["mlp"], fresh[f"layers_{i}"]["mlp"]
        out[f"layers_{i}"] = {**dparams[f"layers_{i}"], "mlp": {
            "gate": jnp.concatenate([mlp["gate"], new["gate"][:, old:]], axis=1),
            "up": jnp.concatenate([mlp["up"], new["up"][:, old:]], axis=1),
            "down": jnp.concatenate([mlp["down"], jnp.zeros_like(new["down"][old:])], axis=0)}}
    check_drafter_params(grown, out)
    return grown, out


def block_weights(block_size: int, gamma: float) -> np.ndarray:
    """DFlash's decaying position weights exp(-(k-1)/gamma), k = 1..block-1, normalised to sum 1."""
    w = np.exp(-np.arange(block_size - 1) / gamma)
    return (w / w.sum()).astype(np.float32)


def drafter_loss(dparams, dcfg, hidden, tokens, valid_len, anchors, embed, lm_head, weights, target_logits=None,
                 distill: float = 0.0):
    """Weighted block cross-entropy. tokens [B, T]; valid_len [B]: labels at positions >= valid_len
    (past a stop token) are ignored. distill in [0, 1] (with target_logits [B, T, V], the target's own logits over
    tokens): each position's loss is (1 - distill) x the cross-entropy against the token plus distill x the
    cross-entropy against the target's distribution for that token (its softmax at the position before), i.e. the
    KL to it up to a constant: what a sampled verify accepts, sum_x min(p, q), grows as q nears p, and the
    distribution is a lower-variance label than one sample of it. Returns (loss, per-position accuracy [block-1])."""
    if not 0.0 <= distill <= 1.0 or (distill and target_logits is None):
        raise ValueError(f"distill must be in [0, 1] and needs target_logits, got {distill}")
    L = dcfg.block_size - 1
    logits = drafter_training_logits(dparams, dcfg, hidden, tokens, anchors, embed, lm_head)  # [B, K, L, V]
    label_pos = anchors[:, :, None] + 1 + jnp.arange(L)[None, None, :]  # [B, K, L]
    T = tokens.shape[1]
    labels = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(label_pos, T - 1), axis=2)  # [B, K, L]
    mask = (label_pos < valid_len[:, None, None]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B, K, L]
    if distill:
        assert target_logits is not None
        # the target's distribution of the token at label_pos: its logits at label_pos - 1 (a row per block slot)
        rows = jnp.minimum(label_pos - 1, T - 1).reshape(label_pos.shape[0], -1)  # [B, K*L]
        teacher = jnp.take_along_axis(target_logits, rows[:, :, None], axis=1).reshape(logits.shape)
        soft = optax.softmax_cross_entropy(logits, jax.nn.softmax(teacher, axis=-1))  # [B, K, L]
        ce = (1.0 - distill) * ce + distill * soft
    per_pos = (ce * mask).sum((0, 1)) / jnp.maximum(mask.sum((0, 1)), 1.0)  # [L]
    correct = ((jnp.argmax(logits, -1) == labels) * mask).sum((0, 1)) / jnp.maximum(mask.sum((0, 1)), 1.0)
    return jnp.dot(per_pos, weights), correct


def generate_data(cfg, params, stream, num_seqs, prompt_len, new_tokens, batch, seed, log,
                  greedy_fraction: float = 1.0) -> tuple:
    """Target continuations of random windows of `stream`: (tokens [N, prompt_len + new_tokens] int32,
    valid lengths [N], temperature of each row [N]). A `greedy_fraction` of the generate calls is greedy, the
    rest temperature 1 (spread evenly over the calls, so both kinds cover the whole stream)."""
    rng = np.random.default_rng(seed)
    seqs, lens, temps = [], [], []
    calls = -(-num_seqs // batch)
    greedy_calls = set(np.linspace(0, calls - 1, round(greedy_fraction * calls)).round().astype(int).tolist())
    for i in range(0, num_seqs, batch):
        prompts = random_windows(stream, batch, prompt_len, rng)
        t0 = time.perf_counter()
        temperature = 0.0 if i // batch in greedy_calls else 1.0
        out = kj.generate(cfg, params, prompts, max_new_tokens=new_tokens, temperature=temperature,
                          key=jax.random.key(seed * 100003 + i), stop_tokens=())
        out_tokens = np.asarray(out.tokens)
        seqs.append(np.concatenate([prompts, out_tokens], axis=1))
        lens.append(prompt_len + np.asarray(out.lengths))
        temps.append(np.full(batch, temperature, np.float32))
        log(event="generate", seqs=i + batch, temperature=temperature, seconds=round(time.perf_counter() - t0, 2))
    return (np.concatenate(seqs)[:num_seqs], np.concatenate(lens)[:num_seqs].astype(np.int32),
            np.concatenate(temps)[:num_seqs])


def sample_anchors(rng, valid_len: np.ndarray, prompt_len: int, count: int, horizon: int = 0) -> np.ndarray:
    """`count` anchors per sequence, uniform in [prompt_len, valid_len - 2] (at least one label); with a `horizon`,
    only among the first `horizon` new tokens (the bonus positions of a decode that long)."""
    hi = np.maximum(valid_len - 1, prompt_len + 1)
    if horizon:
        hi = np.minimum(hi, prompt_len + horizon)
    return rng.integers(prompt_len, hi[:, None], size=(valid_len.size, count)).astype(np.int32)


def load_caches(paths: list[Path], log) -> dict:
    """Several `--data-cache` files as one training set: their training rows concatenated in the order given, the
    held-out check sets (`ev_*`) of the first (so a drafter trained on more data is scored on the same rows)."""
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"--data-cache: {len(paths)} files given, so all must exist; missing: {', '.join(missing)}")
    parts = [dict(np.load(p)) for p in paths]
    widths = {p["seqs"].shape[1] for p in parts}
    if len(widths) != 1:
        raise SystemExit(f"--data-cache files hold sequences of different lengths {sorted(widths)}: generated with "
                         "different --prompt-len / --new-tokens, they cannot train together")
    data = {k: v for k, v in parts[0].items() if k.startswith("ev_")}
    for key in ("seqs", "valid", "temperature"):
        data[key] = np.concatenate([p[key] for p in parts])
    for path, part in zip(paths, parts, strict=True):
        log(event="data_cache", path=str(path), seqs=len(part["seqs"]))
    return data


def load_or_generate(args, cfg, params, tok, log) -> dict:
    """The training set (target continuations of training windows, `--greedy-fraction` greedy, the rest at
    temperature 1) and two held-out check sets (greedy / temperature-1 continuations of held-out windows),
    from `--data-cache` if it exists (several files: `load_caches`), else generated and saved there."""
    caches = args.data_cache or []
    if len(caches) > 1 or (caches and caches[0].is_file()):
        return load_caches(caches, log)
    train, heldout = load_streams(args.data, tok, args.tokenizer)
    t0 = time.perf_counter()
    seqs, valid, temps = generate_data(cfg, params, train, args.num_seqs, args.prompt_len, args.new_tokens,
                                       args.gen_batch, args.seed, log, args.greedy_fraction)
    data = {"seqs": seqs, "valid": valid, "temperature": temps}
    for name, fraction, seed in (("greedy", 1.0, args.seed + 7), ("sampled", 0.0, args.seed + 11)):
        ev = generate_data(cfg, params, heldout, args.gen_batch, args.prompt_len, args.new_tokens, args.gen_batch,
                           seed, log, fraction)
        data[f"ev_{name}_seqs"], data[f"ev_{name}_valid"] = ev[0], ev[1]
    log(event="generated", seqs=len(seqs), seconds=round(time.perf_counter() - t0, 1))
    if caches:
        caches[0].parent.mkdir(parents=True, exist_ok=True)
        partial = caches[0].with_name(caches[0].name + ".partial.npz")
        np.savez_compressed(partial, **data)
        partial.replace(caches[0])
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the (INT4-expert) target checkpoint")
    parser.add_argument("--data", type=Path, help="tokenized corpus folder (python -m training.data)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH, help="default: %(default)s")
    parser.add_argument("--steps", type=int, help="optimizer steps (or --time-budget-s)")
    parser.add_argument("--time-budget-s", type=float, help="train for about this long")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (default: %(default)s)")
    parser.add_argument("--anchors", type=int, default=8, help="anchors (blocks) per sequence per step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    parser.add_argument("--width", type=int, default=768, help="drafter MLP width (default: %(default)s)")
    parser.add_argument("--target-layers", type=int, default=3, help="target layers read by the drafter")
    parser.add_argument("--gamma", type=float, help="loss weight decay along the block (default: DFlash's, 7 for "
                        "block 16, 5 for 10, 4 for 8; else block / 2.3)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=8192, help="target continuations to train on")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--gen-batch", type=int, default=256)
    parser.add_argument("--greedy-fraction", type=float, default=0.5,
                        help="share of the generated training data decoded greedily (the rest: temperature 1)")
    parser.add_argument("--data-cache", type=Path, nargs="+",
                        help="an .npz to load the generated data from / save it to; several: train on all of them "
                             "(each must exist; held-out sets from the first)")
    parser.add_argument("--generate-only", action="store_true", help="generate the data into --data-cache, then stop")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--anchor-horizon", type=int, default=0,
                        help="draw the training anchors among the first N new tokens of each continuation only (the "
                        "positions a decode of N tokens starts its rounds at; the held-out sets keep every position; "
                        "default: 0, the whole continuation)")
    parser.add_argument("--decode-horizon", type=int, default=128,
                        help="score the greedy held-out set as the decode would: greedy DFlash's mean acceptance over "
                        "the first N new tokens, simulated from the drafter's teacher-forced predictions at every "
                        "position (logged as heldout_greedy_dflash_acceptance; capped at --new-tokens; 0: off; "
                        "default: %(default)s, the end-to-end benchmark's length); DDTree's too, at --decode-budget "
                        "(heldout_greedy_ddtree_acceptance)")
    parser.add_argument("--decode-budget", type=int, default=31,
                        help="the DDTree budget of that score (default: %(default)s, the end-to-end benchmark's "
                        "largest)")
    parser.add_argument("--init", type=Path, help="a drafter checkpoint to continue training from (its config is "
                        "kept: --block-size must match it; --layers, --width and --target-layers are ignored); "
                        "the held-out sets are evaluated on it before the first step (step 0)")
    parser.add_argument("--grow-layers", type=int, default=0,
                        help="with --init: append this many decoder layers to the loaded drafter, each freshly "
                             "initialised with its attention output and MLP down projection zero, so the grown "
                             "drafter starts as the same function (step 0) with more capacity")
    parser.add_argument("--grow-width", type=int, default=0,
                        help="with --init: widen every layer's SwiGLU of the loaded drafter to this many units (more "
                             "than its own), the new gate / up columns freshly initialised and the new down rows zero, "
                             "so the widened drafter starts as the same function (step 0); after --grow-layers")
    parser.add_argument("--distill", type=float, default=0.0,
                        help="weight in [0, 1] of the cross-entropy against the target's own next-token distribution "
                             "(from the same forward that gives the drafter its features) beside the one against the "
                             "generated token; 0 (default): the DFlash recipe's hard labels only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kdtree_train/drafter"))
    args = parser.parse_args()
    if args.generate_only and (args.data_cache is None or len(args.data_cache) != 1):
        parser.error("--generate-only needs one --data-cache to write")
    if not args.generate_only:
        check_step_args(parser, args)
    if args.grow_layers < 0 or (args.grow_layers and args.init is None):
        parser.error("--grow-layers needs --init (the drafter to grow) and a count >= 1")
    if args.grow_width < 0 or (args.grow_width and args.init is None):
        parser.error("--grow-width needs --init (the drafter to widen) and a width")
    if not 0.0 <= args.distill <= 1.0:
        parser.error(f"--distill must be in [0, 1], got {args.distill}")
    if args.anchor_horizon < 0:
        parser.error(f"--anchor-horizon must be 0 (off) or a token count, got {args.anchor_horizon}")
    if args.decode_horizon < 0 or args.decode_horizon == 1:
        parser.error(f"--decode-horizon must be 0 (off) or at least 2, got {args.decode_horizon}")
    if not 1 <= args.decode_budget <= MAX_TREE_BUDGET:
        parser.error(f"--decode-budget must be in [1, {MAX_TREE_BUDGET}], got {args.decode_budget}")
    dflash_gamma = {16: 7.0, 10: 5.0, 8: 4.0}
    if args.gamma:
        gamma = float(args.gamma)
    else:
        gamma = dflash_gamma[args.block_size] if args.block_size in dflash_gamma else args.block_size / 2.3

    tok = load_tokenizer(args.tokenizer)
    cfg, params = kj.load_checkpoint(args.target, expect_kind="target")
    params = cast_params(params, jnp.float32, cfg)  # the target runs in float32, as at inference
    init = None
    if args.init is not None and not args.generate_only:  # checked before the (long) data generation
        init = kj.load_checkpoint(args.init, expect_kind="drafter", dtype=jnp.float32)
        if init[0].block_size != args.block_size:
            parser.error(f"--init {args.init} has block size {init[0].block_size}, not --block-size {args.block_size}")
        init[0].check_target(cfg)
        if args.grow_width and args.grow_width <= init[0].intermediate_size:
            parser.error(f"--grow-width {args.grow_width} must exceed the drafter's SwiGLU width "
                         f"{init[0].intermediate_size}")
    log = JsonLog(args.out / "log.jsonl")
    data = load_or_generate(args, cfg, params, tok, log)
    if args.generate_only:
        return
    seqs, valid = data["seqs"], data["valid"]
    if init is not None:
        dcfg, dparams = init
        if args.grow_layers:
            dcfg, dparams = grow_layers(dcfg, dparams, args.grow_layers, jax.random.key(args.seed + 1))
        if args.grow_width:
            dcfg, dparams = grow_width(dcfg, dparams, args.grow_width, jax.random.key(args.seed + 2))
    else:
        dcfg = kj.DrafterConfig.for_target(cfg, num_layers=args.layers, num_target_layers=args.target_layers,
                                           block_size=args.block_size, intermediate_size=args.width)
        dparams = kj.init_drafter_params(dcfg, jax.random.key(args.seed + 1))
    log(event="start", device=describe_device(), jax=jax.__version__, drafter_params=param_count(dparams),
        dcfg=str(dcfg), **{k: str(v) for k, v in vars(args).items()}, gamma_used=gamma)

    embed, lm_head = shared_tables(cfg, params)
    weights = jnp.asarray(block_weights(args.block_size, gamma))
    layers = dcfg.target_layer_ids
    compute_dtype = jnp.dtype(args.compute_dtype)
    optimizer = make_optimizer(weight_decay=0.01)
    # committed like train_step's outputs, so step 2 does not compile it again (a loaded --init drafter is
    # committed, a fresh optimizer state is not: the time budget then measured the recompile)
    dparams, opt_state = on_one_device((dparams, optimizer.init(dparams)))

    def loss_fn(dparams, tokens, valid_len, anchors):
        target_logits, hidden = target_outputs(params, cfg, tokens, layers)
        return drafter_loss(cast_params(dparams, compute_dtype), dcfg, hidden.astype(compute_dtype), tokens,
                            valid_len, anchors, embed.astype(compute_dtype), lm_head.astype(compute_dtype), weights,
                            target_logits, args.distill)

    @jax.jit
    def train_step(dparams, opt_state, tokens, valid_len, anchors):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(dparams, tokens, valid_len, anchors)
        updates, opt_state = optimizer.update(grads, opt_state, dparams)
        return optax.apply_updates(dparams, updates), opt_state, loss, acc

    eval_fn = jax.jit(loss_fn)
    ev_rng = np.random.default_rng(999)
    ev_sets = {}
    for name in ("greedy", "sampled"):
        ev_seqs, ev_valid = data[f"ev_{name}_seqs"], data[f"ev_{name}_valid"]
        if not len(ev_seqs):
            raise SystemExit(f"train_drafter: the data cache's {name} held-out set is empty")
        size = min(args.batch, len(ev_seqs))  # a set smaller than a batch is one batch (not none: nothing to score)
        batches = [(ev_seqs[i:i + size], ev_valid[i:i + size]) for i in range(0, len(ev_seqs), size)
                   if i + size <= len(ev_seqs)]
        ev_sets[name] = [(s, v, sample_anchors(ev_rng, v, args.prompt_len, args.anchors))
                         for s, v in batches]

    # The decode's view (--decode-horizon): the chain measure above averages positions uniformly over the whole
    # continuation, where the target's late, repetitive tokens are easy; a decode runs a round from every bonus token
    # it reaches, from the first new token on. Up to 128 greedy held-out rows, their target features computed once.
    horizon = min(args.decode_horizon, args.new_tokens)
    decode_rows = np.flatnonzero(data["ev_greedy_valid"] >= args.prompt_len + horizon)[:128] if horizon >= 2 else []
    decode_batches = []
    for i in range(0, len(decode_rows), 64):
        tokens = jnp.asarray(data["ev_greedy_seqs"][decode_rows[i:i + 64]])
        decode_batches.append((tokens, target_outputs(params, cfg, tokens, layers)[1].astype(compute_dtype)))
    budgets = (0, args.decode_budget)  # DFlash's chain, DDTree's tree
    log(event="decode_eval", horizon=horizon, rows=len(decode_rows), ddtree_budget=args.decode_budget)
    chunk = 32  # anchors a call: the drafter's context cache is repeated per anchor
    leads_fn = jax.jit(lambda dparams, hidden, tokens, anchors: teacher_forced_leads(
        cast_params(dparams, compute_dtype), dcfg, hidden, tokens, anchors, embed.astype(compute_dtype),
        lm_head.astype(compute_dtype), budgets))

    # every bonus position of the horizon, padded to whole chunks (one compile), fixed for the run
    columns = np.arange(-(-(horizon - 1) // chunk) * chunk)
    anchors = (args.prompt_len + np.minimum(columns, horizon - 2)).astype(np.int32)
    anchor_chunks = [anchors[c:c + chunk] for c in range(0, anchors.size, chunk)]

    def decode_acceptance() -> list[float]:
        """The simulated greedy acceptance of DFlash and of DDTree at --decode-budget."""
        leads = []  # [budgets, rows, horizon - 1] a batch
        for tokens, hidden in decode_batches:
            parts = [leads_fn(dparams, hidden, tokens, jnp.asarray(np.broadcast_to(a, (tokens.shape[0], chunk))))
                     for a in anchor_chunks]
            leads.append(np.concatenate([np.asarray(p) for p in parts], axis=2)[:, :, :horizon - 1])
        return [simulated_acceptance(rows, horizon) for rows in np.concatenate(leads, axis=1)]

    def evaluate(step: int) -> dict:
        record: dict[str, float] = {"step": step}
        for name, batches in ev_sets.items():
            res = [eval_fn(dparams, s, v, a) for s, v, a in batches]
            acc = np.mean([np.asarray(r[1]) for r in res], axis=0)
            record[f"heldout_{name}_loss"] = float(np.mean([float(r[0]) for r in res]))
            record[f"heldout_{name}_acc_pos1"] = float(acc[0])
            # expected accepted drafts of one chain if position errors were independent
            record[f"heldout_{name}_chain_tokens"] = float(np.cumprod(acc).sum())
        if decode_batches:
            dflash, ddtree = decode_acceptance()
            record["heldout_greedy_dflash_acceptance"] = dflash
            record["heldout_greedy_ddtree_acceptance"] = ddtree
        log(**record)
        return record

    if init is not None:
        evaluate(0)  # the starting drafter on the same held-out sets
    rng = np.random.default_rng(args.seed)
    schedule = StepSchedule(args.steps, args.time_budget_s, args.lr, args.warmup, log)
    step = 0
    while not schedule.done(step):
        step += 1
        idx = rng.integers(0, len(seqs), args.batch)
        anchors = sample_anchors(rng, valid[idx], args.prompt_len, args.anchors, args.anchor_horizon)
        lr = schedule.lr(step)
        dparams, opt_state, loss, acc = train_step(dparams, set_learning_rate(opt_state, lr), seqs[idx], valid[idx],
                                                   anchors)
        schedule.after(step, loss)
        if step % 50 == 0 or step == 1:
            acc = np.asarray(acc)
            log(step=step, train_loss=float(loss), lr=lr, acc_pos1=float(acc[0]),
                chain_tokens=float(np.cumprod(acc).sum()))
        if step % args.eval_every == 0:
            evaluate(step)
    train_s = schedule.train_s
    final = evaluate(step)
    log(event="trained", total_steps=step, train_s=round(train_s, 1))
    kj.save_checkpoint(args.out / "drafter", dcfg, cast_params(dparams, jnp.dtype(args.save_dtype)), overwrite=True)
    summary = {"total_steps": step, "train_s": round(train_s, 1), "drafter_params": param_count(dparams),
               "dcfg": str(dcfg), "gamma": gamma, **final}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_curves(args.out / "log.jsonl", args.out / "loss.png", "DFlash drafter (weighted block CE)",
                ("train_loss", "heldout_greedy_loss", "heldout_sampled_loss"))
    print(f"saved {args.out}/drafter, {args.out}/summary.json, {args.out}/loss.png", flush=True)


if __name__ == "__main__":
    main()
