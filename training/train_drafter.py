"""Train the shipped DFlash drafter against the frozen (shipped, INT4-expert) target.

    python -m training.train_drafter --target /tmp/kdtree_train/target/int4 --steps 1200 --batch 16 \
        --out /tmp/kdtree_train/drafter

1. Data (as DFlash: the target's own outputs): prompts are random windows of the training split;
   the target continues each one (`kj.generate`; greedy, or a `--greedy-fraction` of the calls greedy and
   the rest at temperature 1), so the drafter learns what this target says, not what the corpus says.
   `--data-cache FILE.npz` keeps the generated set for reruns with other training settings.
2. Loss: for `--anchors` random anchor positions a per sequence (inside the generated part), the block
   [token a, mask x (block-1)] at positions a..a+block-1 attends to the drafter context features of
   tokens [0, a) and to itself; cross-entropy of the block's predictions against tokens a+1..a+block-1,
   position k weighted exp(-(k-1)/gamma) (DFlash's decaying weights), normalised to sum 1.
   The training forward IS `drafter_forward` on a cache holding the context of every anchor
   (`drafter_training_logits`; tests/test_shipped_model.py checks it against incremental inference).
Writes <out>/drafter (Orbax), <out>/log.jsonl, <out>/loss.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kdtree_jax as kj
from kdtree_jax.drafter import DrafterCache, drafter_extend_context, drafter_forward, init_drafter_cache
from kdtree_jax.model import Transformer
from training.common import JsonLog, describe_device, load_tokenizer, param_count, plot_curves
from training.data import corpus_files, random_windows, token_stream


def target_hidden(params, cfg: kj.ModelConfig, tokens: jax.Array, layers: tuple[int, ...]) -> jax.Array:
    """Residual stream after target layers `layers` for tokens [B, T] (plain causal forward):
    [B, T, n, D], no gradient."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    _, hidden, _ = Transformer(cfg, params["embed_tokens"].dtype).apply(
        {"params": params}, tokens, positions, hidden_layers=layers)
    return jax.lax.stop_gradient(hidden)


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


def block_weights(block_size: int, gamma: float) -> np.ndarray:
    """DFlash's decaying position weights exp(-(k-1)/gamma), k = 1..block-1, normalised to sum 1."""
    w = np.exp(-np.arange(block_size - 1) / gamma)
    return (w / w.sum()).astype(np.float32)


def drafter_loss(dparams, dcfg, hidden, tokens, valid_len, anchors, embed, lm_head, weights):
    """Weighted block cross-entropy. tokens [B, T]; valid_len [B]: labels at positions >= valid_len
    (past a stop token) are ignored. Returns (loss, per-position accuracy [block-1])."""
    L = dcfg.block_size - 1
    logits = drafter_training_logits(dparams, dcfg, hidden, tokens, anchors, embed, lm_head)  # [B, K, L, V]
    label_pos = anchors[:, :, None] + 1 + jnp.arange(L)[None, None, :]  # [B, K, L]
    T = tokens.shape[1]
    labels = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(label_pos, T - 1), axis=2)  # [B, K, L]
    mask = (label_pos < valid_len[:, None, None]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B, K, L]
    per_pos = (ce * mask).sum((0, 1)) / jnp.maximum(mask.sum((0, 1)), 1.0)  # [L]
    correct = ((jnp.argmax(logits, -1) == labels) * mask).sum((0, 1)) / jnp.maximum(mask.sum((0, 1)), 1.0)
    return jnp.dot(per_pos, weights), correct


def generate_data(cfg, params, stream, num_seqs, prompt_len, new_tokens, batch, seed, log,
                  greedy_fraction: float = 1.0) -> tuple:
    """Target continuations of random windows of `stream`: (tokens [N, prompt_len + new_tokens] int32,
    valid lengths [N]). A `greedy_fraction` of the generate calls is greedy, the rest temperature 1."""
    rng = np.random.default_rng(seed)
    seqs, lens = [], []
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
        log(event="generate", seqs=i + batch, temperature=temperature, seconds=round(time.perf_counter() - t0, 2))
    return np.concatenate(seqs)[:num_seqs], np.concatenate(lens)[:num_seqs].astype(np.int32)


def sample_anchors(rng, valid_len: np.ndarray, prompt_len: int, count: int, block: int) -> np.ndarray:
    """`count` anchors per sequence, uniform in [prompt_len, valid_len - 2] (at least one label)."""
    hi = np.maximum(valid_len - 1, prompt_len + 1)
    return rng.integers(prompt_len, hi[:, None], size=(valid_len.size, count)).astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("/tmp/kdtree_train/target/int4"))
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=8, help="anchors (blocks) per sequence per step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    parser.add_argument("--target-layers", type=int, default=3, help="target layers read by the drafter")
    parser.add_argument("--gamma", type=float, default=7.0, help="loss weight decay along the block")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--num-seqs", type=int, default=2048, help="target continuations to train on")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--gen-batch", type=int, default=128)
    parser.add_argument("--greedy-fraction", type=float, default=1.0,
                        help="share of the generated training data decoded greedily (the rest: temperature 1)")
    parser.add_argument("--data-cache", type=Path, help="an .npz to load the generated data from / save it to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kdtree_train/drafter"))
    args = parser.parse_args()

    tok = load_tokenizer()
    cfg, params = kj.load_checkpoint(args.target, expect_kind="target")
    dcfg = kj.DrafterConfig.for_target(cfg, num_layers=args.layers, num_target_layers=args.target_layers,
                                       block_size=args.block_size)
    dparams = kj.init_drafter_params(dcfg, jax.random.key(args.seed + 1))
    log = JsonLog(args.out / "log.jsonl")
    log(event="start", device=describe_device(), jax=jax.__version__, drafter_params=param_count(dparams),
        dcfg=str(dcfg), **{k: str(v) for k, v in vars(args).items()})

    train = token_stream(tok, corpus_files("train"))
    heldout = token_stream(tok, corpus_files("heldout"))
    if args.data_cache is not None and args.data_cache.is_file():
        data = np.load(args.data_cache)
        seqs, valid, ev_seqs, ev_valid = (data[k] for k in ("seqs", "valid", "ev_seqs", "ev_valid"))
        log(event="data_cache", path=str(args.data_cache), seqs=len(seqs))
    else:
        seqs, valid = generate_data(cfg, params, train, args.num_seqs, args.prompt_len, args.new_tokens,
                                    args.gen_batch, args.seed, log, args.greedy_fraction)
        # held-out check set: greedy continuations of held-out windows (what greedy acceptance measures)
        ev_seqs, ev_valid = generate_data(cfg, params, heldout, args.gen_batch, args.prompt_len,
                                          args.new_tokens, args.gen_batch, args.seed + 7, log, 1.0)
        if args.data_cache is not None:
            np.savez_compressed(args.data_cache, seqs=seqs, valid=valid, ev_seqs=ev_seqs, ev_valid=ev_valid)

    embed = params["embed_tokens"]
    lm_head = embed.T if cfg.tie_word_embeddings else params["lm_head"]
    weights = jnp.asarray(block_weights(args.block_size, args.gamma))
    layers = dcfg.target_layer_ids
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  args.lr * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95,
                                                                        weight_decay=0.01))
    opt_state = optimizer.init(dparams)

    def loss_fn(dparams, tokens, valid_len, anchors):
        hidden = target_hidden(params, cfg, tokens, layers)
        return drafter_loss(dparams, dcfg, hidden, tokens, valid_len, anchors, embed, lm_head, weights)

    @jax.jit
    def train_step(dparams, opt_state, tokens, valid_len, anchors):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(dparams, tokens, valid_len, anchors)
        updates, opt_state = optimizer.update(grads, opt_state, dparams)
        return optax.apply_updates(dparams, updates), opt_state, loss, acc

    eval_fn = jax.jit(loss_fn)
    ev_rng = np.random.default_rng(999)
    ev_anchors = [sample_anchors(ev_rng, ev_valid[i:i + args.batch], args.prompt_len, args.anchors, args.block_size)
                  for i in range(0, len(ev_seqs), args.batch)]
    rng = np.random.default_rng(args.seed)
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, len(seqs), args.batch)
        anchors = sample_anchors(rng, valid[idx], args.prompt_len, args.anchors, args.block_size)
        dparams, opt_state, loss, acc = train_step(dparams, opt_state, seqs[idx], valid[idx], anchors)
        if step % 25 == 0 or step == 1:
            acc = np.asarray(acc)
            # expected accepted drafts of one chain if position errors were independent: sum_k prod_{j<=k} acc_j
            log(step=step, train_loss=float(loss), acc_pos1=float(acc[0]),
                chain_tokens=float(np.cumprod(acc).sum()))
        if step % 100 == 0 or step == args.steps:
            res = [eval_fn(dparams, ev_seqs[i * args.batch:(i + 1) * args.batch],
                           ev_valid[i * args.batch:(i + 1) * args.batch], a) for i, a in enumerate(ev_anchors)]
            acc = np.mean([np.asarray(r[1]) for r in res], axis=0)
            log(step=step, heldout_loss=float(np.mean([float(r[0]) for r in res])), heldout_acc_pos1=float(acc[0]),
                heldout_chain_tokens=float(np.cumprod(acc).sum()))
    kj.save_checkpoint(args.out / "drafter", dcfg, dparams, overwrite=True)
    plot_curves(args.out / "log.jsonl", args.out / "loss.png", "DFlash drafter (weighted block CE)",
                ("train_loss", "heldout_loss"))
    print(f"saved {args.out}/drafter, {args.out}/loss.png")


if __name__ == "__main__":
    main()
