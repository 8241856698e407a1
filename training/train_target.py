"""Train the shipped target: a small K2.6-architecture model (training/common.py:target_config) on Python code.

    python -m training.train_target --data DIR --time-budget-s 230 --batch 64 --seq-len 512 --out OUT  # H200
    python -m training.train_target --data DIR --steps 5 --batch 2 --seq-len 64 --hidden 64 --layers 2 \\
        --experts 4 --moe-width 32 --out /tmp/t                                                    # CPU smoke run

`--data`: the tokenized corpus of `python -m training.data` (without it the corpus is tokenized here).
Mixed precision: float32 master weights and optimizer state, the forward and backward in `--compute-dtype`
(bfloat16 by default; logits, softmax statistics, RMSNorm and routing stay float32).

`--time-budget-s` sets the number of steps from the measured step time: after `CALIBRATION_STEPS` steps
(inside the warm-up, where the learning rate depends on the step alone) the total is fixed, and the cosine
schedule runs over it. The log records that total, so `--steps N` reproduces the run exactly.

Routing is DeepSeek-V3's auxiliary-loss-free scheme: after every step the router bias moves by
`--bias-rate` * sign(mean load - load) per expert, outside the gradient (the bias only picks experts).

Writes OUT/float (Orbax, weights in `--save-dtype`), OUT/int4 (routed experts INT4, kj.quantize(policy="experts")),
OUT/log.jsonl, OUT/loss.png and OUT/summary.json: held-out bits per byte of both, measured on
`--eval-tokens` held-out tokens in float32 at full matmul precision, on the weights as saved.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kdtree_jax as kj
from kdtree_jax.layers import rms_norm
from kdtree_jax.model import MoE, Transformer, route
from kdtree_jax.weights import cast_params
from training.common import (
    TOKENIZER_PATH,
    JsonLog,
    describe_device,
    load_tokenizer,
    on_one_device,
    param_count,
    plot_curves,
    target_config,
    token_byte_lengths,
)
from training.data import load_streams, random_windows

CALIBRATION_STEPS = 20


def causal_forward(params, cfg: kj.ModelConfig, inputs: jax.Array, compute_dtype=jnp.float32,
                   kernels: kj.Kernels | None = None, hidden_layers: tuple[int, ...] = ()):
    """The training forward over inputs [B, T] (positions 0..T-1, causal, no cache), the params cast to
    `compute_dtype` (the master copy stays as given): (logits [B, T, V], the residual stream after each of
    `hidden_layers` [B, T, n, D])."""
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    model = Transformer(cfg, compute_dtype, kernels or kj.Kernels())
    out = model.apply({"params": cast_params(params, compute_dtype, cfg)}, inputs, positions,
                      hidden_layers=tuple(hidden_layers))
    # flax types apply's result as Any | (out, state); without mutable= it is the module's 3-tuple
    logits, hidden, _ = cast(tuple[jax.Array, jax.Array, jax.Array], out)
    return logits, hidden


def causal_logits(params, cfg: kj.ModelConfig, inputs: jax.Array, compute_dtype=jnp.float32,
                  kernels: kj.Kernels | None = None) -> jax.Array:
    """The training forward's logits [B, T, V] of every position of inputs [B, T] (`causal_forward`)."""
    return causal_forward(params, cfg, inputs, compute_dtype, kernels)[0]


def lm_loss_and_loads(params, cfg: kj.ModelConfig, tokens: jax.Array, compute_dtype=jnp.float32,
                      kernels: kj.Kernels | None = None):
    """Next-token cross-entropy of tokens [B, T] (mean over B*(T-1) predictions; float32) and the fraction of
    routed slots each expert got in each MoE layer: loads [n_moe_layers, E] (no gradient). The forward runs
    in `compute_dtype` (params are cast to it: the master copy stays as given)."""
    loads = []

    def record_loads(next_fun, args, kwargs, context):
        # The bias-update rule needs each MoE layer's expert loads; the model does not return them, so
        # recompute the (cheap) routing decision on the MoE input here: MoE(h, norm) routes rms_norm(h, norm).
        if isinstance(context.module, MoE) and context.method_name == "__call__":
            p = context.module.variables["params"]
            h, norm = jax.lax.stop_gradient(args[0]), args[1]
            x = rms_norm(h, norm, cfg.rms_norm_eps).reshape(-1, cfg.hidden_size)  # [N, D]
            idx, _ = route(cfg, x, p["router"], p["router_bias"])  # [N, k]
            loads.append(jnp.zeros(cfg.n_routed_experts, jnp.float32).at[idx.ravel()].add(1.0) / idx.size)
        return next_fun(*args, **kwargs)

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with nn.intercept_methods(record_loads):
        logits = causal_logits(params, cfg, inputs, compute_dtype, kernels)
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


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to peak / 10 at `total`."""
    if step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(weight_decay: float = 0.1) -> optax.GradientTransformation:
    """AdamW (b2 0.95) with global-norm clipping 1.0 and a learning rate set from the host every step
    (`learning_rate`), weight decay on matrices only (not norms, not the router bias, which has no gradient)."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=0.0, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(1.0), adamw)


def check_step_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--steps or --time-budget-s, exactly one; a time budget measures its steps inside the warm-up."""
    if (args.steps is None) == (args.time_budget_s is None):
        parser.error("give exactly one of --steps and --time-budget-s")
    if args.time_budget_s is not None and args.warmup < CALIBRATION_STEPS:
        parser.error(f"--time-budget-s measures {CALIBRATION_STEPS} warm-up steps: --warmup must be >= that")


class StepSchedule:
    """How many steps a run takes and each step's learning rate. With `steps` the total is fixed; with
    `time_budget_s` it is set after CALIBRATION_STEPS steps from their measured time (the first step, the
    compile, not counted) and logged as total_steps, so `--steps N` reproduces the run. Call `done(step)`
    before each step and `after(step, loss)` once it is dispatched."""

    def __init__(self, steps: int | None, time_budget_s: float | None, peak_lr: float, warmup: int, log):
        self.total, self.budget, self.peak, self.warmup, self.log = steps, time_budget_s, peak_lr, warmup, log
        self.start: float | None = None

    def done(self, step: int) -> bool:
        return self.total is not None and step >= self.total

    def lr(self, step: int) -> float:  # until calibrated, only warm-up steps run: they need no total
        return learning_rate(step, self.total or 10**9, self.peak, self.warmup)

    def after(self, step: int, loss: jax.Array) -> None:
        if step == 1:
            float(loss)  # compiled and run once: the budget counts from here
            self.start = time.perf_counter()
        if self.total is None and step == CALIBRATION_STEPS:
            assert self.start is not None and self.budget is not None
            float(loss)
            step_s = (time.perf_counter() - self.start) / (CALIBRATION_STEPS - 1)
            self.total = max(CALIBRATION_STEPS, int(self.budget / step_s))
            self.log(event="calibrated", step_s=round(step_s, 5), total_steps=self.total)

    @property
    def train_s(self) -> float:
        """Seconds since the first step finished."""
        return 0.0 if self.start is None else time.perf_counter() - self.start


def set_learning_rate(opt_state, lr: float):
    clip_state, adamw_state = opt_state
    adamw_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return (clip_state, adamw_state)


def eval_windows(stream: np.ndarray, tokens: int, seq_len: int) -> np.ndarray:
    """Consecutive non-overlapping windows of seq_len + 1 tokens (each shares its last token with the next
    window's first) covering the first `tokens` predictions of the stream: int32 [n, seq_len + 1]."""
    n = min(tokens, stream.size - 1) // seq_len
    if n < 1:
        raise ValueError(f"the held-out stream ({stream.size} tokens) is shorter than one window ({seq_len + 1})")
    starts = np.arange(n) * seq_len
    return np.stack([stream[s: s + seq_len + 1] for s in starts]).astype(np.int32)


def bits_per_byte(params, cfg: kj.ModelConfig, windows: np.ndarray, byte_lengths: np.ndarray,
                  batch: int) -> dict:
    """Held-out nats per token and bits per byte of `params` over `windows` [n, T + 1] (every next-token
    prediction; a predicted special token counts its nats and 0 bytes), float32 at full matmul precision.
    The routed experts run the XLA path (Kernels(moe="xla")): plain dequantize-and-matmul for INT4."""
    kernels = kj.Kernels(moe="xla")

    @jax.jit
    def window_nats(p, toks):
        with jax.default_matmul_precision("highest"):
            inputs, labels = toks[:, :-1], toks[:, 1:]
            logits = causal_logits(p, cfg, inputs, jnp.float32, kernels)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

    p32 = cast_params(params, jnp.float32, cfg)
    nats = 0.0
    for i in range(0, len(windows) - batch + 1, batch):  # whole batches only: one compile
        nats += float(window_nats(p32, windows[i:i + batch]))
    used = windows[: (len(windows) // batch) * batch]
    predictions = used[:, 1:]
    total_bytes = int(byte_lengths[predictions].sum())
    return {"nats_per_token": nats / predictions.size, "bits_per_byte": nats / math.log(2) / total_bytes,
            "tokens": int(predictions.size), "bytes": total_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="tokenized corpus folder (python -m training.data); default: "
                        "tokenize the corpus here")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH, help="default: %(default)s")
    parser.add_argument("--steps", type=int, help="optimizer steps (or --time-budget-s)")
    parser.add_argument("--time-budget-s", type=float, help="train for about this long (steps from the measured "
                        "step time, logged as total_steps)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=384, help="hidden size (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers, the first dense (default: %(default)s)")
    parser.add_argument("--experts", type=int, default=32, help="routed experts (default: %(default)s)")
    parser.add_argument("--moe-width", type=int, default=96, help="routed / shared expert width (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=150, help="warm-up steps (default: %(default)s)")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="router-bias step (default: %(default)s)")
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="dtype of the saved dense weights (default: %(default)s)")
    parser.add_argument("--eval-every", type=int, default=500, help="held-out loss every N steps")
    parser.add_argument("--eval-tokens", type=int, default=500_000, help="held-out predictions for the final "
                        "bits per byte (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kdtree_train/target"))
    args = parser.parse_args()
    check_step_args(parser, args)

    tok = load_tokenizer(args.tokenizer)
    cfg = target_config(tok.get_vocab_size(), args.hidden, args.layers, args.experts, args.moe_width, args.top_k)
    if args.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    train, heldout = load_streams(args.data, tok, args.tokenizer)
    compute_dtype = jnp.dtype(args.compute_dtype)
    rng = np.random.default_rng(args.seed)
    eval_batches = [random_windows(heldout, args.batch, args.seq_len + 1, np.random.default_rng(1000 + i))
                    for i in range(4)]  # fixed held-out windows for the curve

    params = kj.init_params(cfg, jax.random.key(args.seed))
    optimizer = make_optimizer()
    params, opt_state = on_one_device((params, optimizer.init(params)))  # one compile of train_step

    @jax.jit
    def train_step(params, opt_state, tokens):
        (loss, loads), grads = jax.value_and_grad(lm_loss_and_loads, has_aux=True)(params, cfg, tokens, compute_dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return update_router_bias(params, loads, cfg, args.bias_rate), opt_state, loss, loads

    eval_loss = jax.jit(lambda p, t: lm_loss_and_loads(p, cfg, t, compute_dtype)[0])
    log = JsonLog(args.out / "log.jsonl")
    log(event="start", device=describe_device(), jax=jax.__version__, params=param_count(params),
        train_tokens=int(train.size), heldout_tokens=int(heldout.size), config=str(cfg),
        **{k: str(v) for k, v in vars(args).items()})
    schedule = StepSchedule(args.steps, args.time_budget_s, args.lr, args.warmup, log)
    t_last, tokens_seen, step = time.perf_counter(), 0, 0
    while not schedule.done(step):
        step += 1
        batch = random_windows(train, args.batch, args.seq_len + 1, rng)
        lr = schedule.lr(step)
        params, opt_state, loss, loads = train_step(params, set_learning_rate(opt_state, lr), batch)
        tokens_seen += batch.size
        schedule.after(step, loss)
        if step % 50 == 0 or step == 1:
            loss = float(loss)
            now = time.perf_counter()
            max_load = float(jnp.max(loads)) * cfg.n_routed_experts  # 1.0 = perfectly balanced
            log(step=step, train_loss=loss, lr=lr, max_load_over_mean=max_load,
                tokens_per_s=round(tokens_seen / (now - t_last), 1))
            t_last, tokens_seen = now, 0
        if step % args.eval_every == 0 or step == schedule.total:
            ev = float(np.mean([eval_loss(params, b) for b in eval_batches]))
            log(step=step, heldout_loss=ev)
    train_s = schedule.train_s
    log(event="trained", total_steps=step, train_s=round(train_s, 1),
        tokens=step * args.batch * args.seq_len)

    save_dtype = jnp.dtype(args.save_dtype)
    stored = cast_params(params, save_dtype, cfg)  # what ships: evaluate exactly these weights
    int4 = kj.quantize(stored, cfg, policy="experts")
    # INT4 first: the drafter's data generation (training/train_pair.sh) starts as soon as it exists
    kj.save_checkpoint(args.out / "int4", cfg, int4, overwrite=True)
    kj.save_checkpoint(args.out / "float", cfg, stored, overwrite=True)
    windows = eval_windows(heldout, args.eval_tokens, args.seq_len)
    lengths = token_byte_lengths(tok)
    eval_batch = min(32, len(windows))
    summary = {"total_steps": step, "train_s": round(train_s, 1), "train_tokens_seen": step * args.batch * args.seq_len,
               "params": param_count(params), "float": bits_per_byte(stored, cfg, windows, lengths, eval_batch),
               "int4": bits_per_byte(int4, cfg, windows, lengths, eval_batch)}
    summary["int4_cost_bits_per_byte"] = summary["int4"]["bits_per_byte"] - summary["float"]["bits_per_byte"]
    log(event="heldout", float_bpb=summary["float"]["bits_per_byte"], int4_bpb=summary["int4"]["bits_per_byte"],
        float_nats=summary["float"]["nats_per_token"], int4_nats=summary["int4"]["nats_per_token"],
        eval_tokens=summary["float"]["tokens"])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_curves(args.out / "log.jsonl", args.out / "loss.png", "target (K2.6 architecture, Python code)",
                ("train_loss", "heldout_loss"))
    print(f"saved {args.out}/float, {args.out}/int4, {args.out}/summary.json, {args.out}/loss.png", flush=True)


if __name__ == "__main__":
    main()
