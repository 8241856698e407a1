"""Train the shipped target: a small K2.6-architecture model on the Python standard library.

    python -m training.train_target --steps 550 --batch 16 --seq-len 256 --warmup 50 --out /tmp/kdtree_train/target

Writes <out>/float (Orbax, float32), <out>/int4 (routed experts INT4, `kj.quantize(policy="experts")`),
<out>/log.jsonl and <out>/loss.png. Runs unchanged on CPU or GPU (`--steps`, `--batch` scale it).

Routing is DeepSeek-V3's auxiliary-loss-free scheme: after every step the router bias moves by
`--bias-rate` * sign(mean load - load) per expert, outside the gradient (the bias only picks experts).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kdtree_jax as kj
from kdtree_jax.model import MoE, Transformer, route
from training.common import JsonLog, describe_device, load_tokenizer, param_count, plot_curves, target_config
from training.data import corpus_files, random_windows, token_stream


def lm_loss_and_loads(params, cfg: kj.ModelConfig, tokens: jax.Array):
    """Next-token cross-entropy of tokens [B, T] (mean over B*(T-1) predictions) and the fraction of
    routed slots each expert got in each MoE layer: loads [n_moe_layers, E] (no gradient)."""
    loads = []

    def record_loads(next_fun, args, kwargs, context):
        # The bias-update rule needs each MoE layer's expert loads; the model does not return them, so
        # recompute the (cheap) routing decision on the MoE input here.
        if isinstance(context.module, MoE) and context.method_name == "__call__":
            p = context.module.variables["params"]
            x = jax.lax.stop_gradient(args[0]).reshape(-1, cfg.hidden_size)  # [N, D]
            idx, _ = route(cfg, x, p["router"], p["router_bias"])  # [N, k]
            loads.append(jnp.zeros(cfg.n_routed_experts, jnp.float32).at[idx.ravel()].add(1.0) / idx.size)
        return next_fun(*args, **kwargs)

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    with nn.intercept_methods(record_loads):
        logits, _, _ = Transformer(cfg).apply({"params": params}, inputs, positions)  # [B, T-1, V]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, jnp.stack(loads) if loads else jnp.zeros((0, cfg.n_routed_experts))


def update_router_bias(params, loads: jax.Array, cfg: kj.ModelConfig, rate: float):
    """DeepSeek-V3 aux-free balancing: bias_e += rate * sign(mean load - load_e), per MoE layer."""
    params = dict(params)
    moe_layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)]
    for row, layer in enumerate(moe_layers):
        name = f"layers_{layer}"
        load = loads[row]
        bias = params[name]["moe"]["router_bias"] + rate * jnp.sign(load.mean() - load)
        params[name] = {**params[name], "moe": {**params[name]["moe"], "router_bias": bias}}
    return params


def make_optimizer(steps: int, lr: float, warmup: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    # Weight decay on matrices only (not norms, not the router bias, which has no gradient anyway).
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=550)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--bias-rate", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kdtree_train/target"))
    args = parser.parse_args()

    tok = load_tokenizer()
    cfg = target_config(tok.get_vocab_size(), args.hidden, args.layers)
    if args.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    train = token_stream(tok, corpus_files("train"))
    heldout = token_stream(tok, corpus_files("heldout"))
    rng = np.random.default_rng(args.seed)
    eval_batches = [random_windows(heldout, args.batch, args.seq_len + 1, np.random.default_rng(1000 + i))
                    for i in range(4)]  # fixed held-out windows

    params = kj.init_params(cfg, jax.random.key(args.seed))
    optimizer = make_optimizer(args.steps, args.lr, args.warmup)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens):
        (loss, loads), grads = jax.value_and_grad(lm_loss_and_loads, has_aux=True)(params, cfg, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return update_router_bias(params, loads, cfg, args.bias_rate), opt_state, loss, loads

    eval_loss = jax.jit(lambda p, t: lm_loss_and_loads(p, cfg, t)[0])
    log = JsonLog(args.out / "log.jsonl")
    log(event="start", device=describe_device(), jax=jax.__version__, params=param_count(params),
        train_tokens=int(train.size), heldout_tokens=int(heldout.size), **{k: str(v) for k, v in vars(args).items()})
    t_last, tokens_seen = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        batch = random_windows(train, args.batch, args.seq_len + 1, rng)
        params, opt_state, loss, loads = train_step(params, opt_state, batch)
        tokens_seen += batch.size
        if step % 25 == 0 or step == 1:
            loss = float(loss)
            now = time.perf_counter()
            max_load = float(jnp.max(loads)) * cfg.n_routed_experts  # 1.0 = perfectly balanced
            log(step=step, train_loss=loss, max_load_over_mean=max_load,
                tokens_per_s=round(tokens_seen / (now - t_last), 1))
            t_last, tokens_seen = now, 0
        if step % args.eval_every == 0 or step == args.steps:
            ev = float(np.mean([eval_loss(params, b) for b in eval_batches]))
            log(step=step, heldout_loss=ev)

    int4 = kj.quantize(params, cfg, policy="experts")
    ev4 = float(np.mean([eval_loss(int4, b) for b in eval_batches]))
    log(step=args.steps, heldout_loss_int4=ev4)
    kj.save_checkpoint(args.out / "float", cfg, params, overwrite=True)
    kj.save_checkpoint(args.out / "int4", cfg, int4, overwrite=True)
    plot_curves(args.out / "log.jsonl", args.out / "loss.png", "target (K2.6 architecture, stdlib Python)",
                ("train_loss", "heldout_loss", "heldout_loss_int4"))
    print(f"saved {args.out}/float, {args.out}/int4, {args.out}/loss.png")


if __name__ == "__main__":
    main()
