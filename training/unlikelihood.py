"""Fine-tune a trained target against greedy degeneration: sequence-level unlikelihood training (Welleck et al.,
"Neural Text Generation with Unlikelihood Training", arXiv 1908.04319, section 5.2), beside the usual next-token
loss.

    python -m training.unlikelihood --target kdtree_jax/assets/target --data DIR --time-budget-s 150 --out OUT  # H200
    python -m training.unlikelihood --target kdtree_jax/assets/target --data DIR --steps 3 --batch 2 --seq-len 64 \\
        --ul-batch 2 --prefix-len 16 --cont-len 16 --eval-tokens 2048 --degeneracy-prompts 2 --out /tmp/ul  # CPU smoke

Every step:
  * MLE: next-token cross-entropy on `--batch` random training windows of `--seq-len` tokens (as
    training.train_target, router bias updated the same way);
  * UL-seq: `--ul-batch` random training windows of `--prefix-len` tokens are continued greedily for `--cont-len`
    tokens by the current weights (kj.generate, one jitted call); each continuation token that completes an
    n-gram (`--ngram`) already present earlier in the same continuation (training.degeneracy.repeat_candidates) is
    a negative candidate, and the loss -log(1 - p(token | its context)) summed over the candidates and divided by
    the continuation tokens pushes the model off its own loops.
  loss = MLE + `--ul-weight` * UL-seq. The log's `repeat_rate` is the candidates' share of the continuation tokens:
  how often the model's own greedy text repeats itself, step by step.

The start is the INT4 target as shipped (routed experts dequantized to float32, the other weights as stored);
float32 master weights, the forward in `--compute-dtype`; AdamW as training.train_target, peak `--lr` after
`--warmup` steps, cosine to a tenth. The result is stored like the shipped target (dense weights bfloat16, routed
experts INT4 again: kj.quantize(policy="experts")) in OUT/int4, with OUT/summary.json: held-out bits per byte
(float32, full matmul precision; the result also with its routed experts in bfloat16, the cost of INT4) and
degenerate 64-token greedy completions (training.degeneracy, with their text) of the start and of the result,
OUT/log.jsonl and OUT/loss.png.
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
from kdtree_jax.weights import cast_params
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from pallas_kernels.w4a16.reference import dequantize_any
from training.common import (
    ASSETS,
    TOKENIZER_PATH,
    JsonLog,
    describe_device,
    load_tokenizer,
    on_one_device,
    param_count,
    plot_curves,
    token_byte_lengths,
)
from training.data import load_streams, random_windows
from training.degeneracy import degenerate_counts, greedy_completions, line_shares, repeat_candidates
from training.train_target import (
    StepSchedule,
    bits_per_byte,
    causal_logits,
    check_step_args,
    eval_windows,
    lm_loss_and_loads,
    make_optimizer,
    set_learning_rate,
    update_router_bias,
)

PROMPTS_PATH = ASSETS / "heldout_prompts.json"


def dequantize_params(params):
    """The params tree with every INT4 weight replaced by its dense float32 value in the params convention
    ([..., in, out]): the INT4 checkpoint as a trainable float tree."""
    is_int4 = lambda x: isinstance(x, (Int4Weight, MosaicInt4Weight))  # noqa: E731
    return jax.tree.map(lambda x: jnp.swapaxes(dequantize_any(x), -1, -2) if is_int4(x) else x, params,
                        is_leaf=is_int4)


def unlikelihood_loss(params, cfg: kj.ModelConfig, tokens: jax.Array, candidates: jax.Array, compute_dtype):
    """Sequence-level unlikelihood of tokens [B, P + L] (a prefix of P, then the model's own continuation of L)
    at the continuation positions marked in candidates [B, L] bool: sum of -log(1 - p(token | context)) over the
    candidates / (B * L), float32."""
    length = candidates.shape[1]
    logits = causal_logits(params, cfg, tokens[:, :-1], compute_dtype)
    logits = logits[:, -length:].astype(jnp.float32)  # [B, L, V]: the predictions of the continuation tokens
    labels = tokens[:, -length:]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]
    # -log(1 - p), p kept below 1 so that a certain repeat gives a large but finite loss
    one_minus = jnp.maximum(-jnp.expm1(logp), 1e-5)
    return jnp.sum(jnp.where(candidates, -jnp.log(one_minus), 0.0)) / candidates.size


def degeneracy_report(cfg, params, tok, prompts: dict) -> dict:
    """Degenerate greedy completions of `params` (float32, full matmul precision) on the held-out prompts, with
    the completions' text."""
    with jax.default_matmul_precision("highest"):
        texts = greedy_completions(cfg, cast_params(params, jnp.float32, cfg), tok, prompts)
    shares = line_shares(texts)
    return {"degenerate": degenerate_counts(shares), "of": {k: len(v) for k, v in shares.items()},
            "median_top_line_share": {k: float(np.median(v)) for k, v in shares.items()},
            "top_line_shares": shares, "completions": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the INT4 target checkpoint to fine-tune")
    parser.add_argument("--data", type=Path, help="tokenized corpus folder (python -m training.data)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH, help="default: %(default)s")
    parser.add_argument("--steps", type=int, help="optimizer steps (or --time-budget-s)")
    parser.add_argument("--time-budget-s", type=float, help="train for about this long (steps from the measured "
                        "step time, logged as total_steps)")
    parser.add_argument("--batch", type=int, default=64, help="MLE sequences per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=512, help="MLE tokens per sequence (default: %(default)s)")
    parser.add_argument("--ul-batch", type=int, default=64, help="greedy continuations per step (default: %(default)s)")
    parser.add_argument("--prefix-len", type=int, default=64, help="prompt tokens of a continuation (default: "
                        "%(default)s)")
    parser.add_argument("--cont-len", type=int, default=96, help="greedy tokens of a continuation (default: "
                        "%(default)s)")
    parser.add_argument("--ngram", type=int, default=4, help="n of the repeated n-grams (default: %(default)s)")
    parser.add_argument("--ul-weight", type=float, default=1.0, help="weight of the UL-seq loss (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=30, help="warm-up steps (default: %(default)s)")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="router-bias step (default: %(default)s)")
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="dtype of the forward, backward and greedy continuations (master weights stay float32; "
                        "default: %(default)s)")
    parser.add_argument("--eval-tokens", type=int, default=500_000, help="held-out predictions for the bits per "
                        "byte (default: %(default)s)")
    parser.add_argument("--degeneracy-prompts", type=int, help="score only the first N prompts of each set "
                        "(default: all; a CPU smoke run)")
    parser.add_argument("--prompts", type=Path, default=PROMPTS_PATH, help="held-out prompts (default: %(default)s)")
    parser.add_argument("--no-start-eval", action="store_true", help="skip the evaluation of the starting weights "
                        "(bits per byte and degeneracy of the target as given: known already; two minutes on an H200, "
                        "mostly compiles); the summary's \"start\" is then null")
    parser.add_argument("--seed", type=int, default=0, help="seed of the window draws (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kdtree_train/unlikelihood"),
                        help="output folder: int4/, summary.json, log.jsonl, loss.png (default: %(default)s)")
    args = parser.parse_args()
    check_step_args(parser, args)
    for name in ("batch", "seq_len", "ul_batch", "prefix_len", "cont_len", "ngram"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.ul_weight < 0:
        parser.error(f"--ul-weight must be >= 0, got {args.ul_weight}")

    tok = load_tokenizer(args.tokenizer)
    cfg, stored = kj.load_checkpoint(args.target, expect_kind="target")
    if cfg.vocab_size != tok.get_vocab_size():
        raise ValueError(f"{args.target} has a vocabulary of {cfg.vocab_size}, the tokenizer {tok.get_vocab_size()}")
    for what, length in (("--seq-len", args.seq_len), ("--prefix-len + --cont-len", args.prefix_len + args.cont_len)):
        if length > cfg.max_position_embeddings:
            parser.error(f"{what} = {length} exceeds the target's {cfg.max_position_embeddings} positions")
    train, heldout = load_streams(args.data, tok, args.tokenizer)
    prompts = json.loads(args.prompts.read_text())
    if args.degeneracy_prompts:
        prompts = {k: v[:args.degeneracy_prompts] if isinstance(v, list) else v for k, v in prompts.items()}
    compute_dtype = jnp.dtype(args.compute_dtype)
    rng = np.random.default_rng(args.seed)
    log = JsonLog(args.out / "log.jsonl")
    windows = eval_windows(heldout, args.eval_tokens, args.seq_len)
    lengths = token_byte_lengths(tok)
    eval_batch = min(32, len(windows))

    start = None
    if not args.no_start_eval:
        start = {"bits_per_byte": bits_per_byte(stored, cfg, windows, lengths, eval_batch),
                 **degeneracy_report(cfg, stored, tok, prompts)}
    params = cast_params(dequantize_params(stored), jnp.float32, cfg)
    log(event="start", device=describe_device(), jax=jax.__version__, params=param_count(params),
        heldout_bpb=start and start["bits_per_byte"]["bits_per_byte"], degenerate=start and start["degenerate"],
        **{k: str(v) for k, v in vars(args).items()})

    optimizer = make_optimizer()
    params, opt_state = on_one_device((params, optimizer.init(params)))  # one compile of train_step

    @jax.jit
    def train_step(params, opt_state, tokens, ul_tokens):
        candidates = repeat_candidates(ul_tokens[:, args.prefix_len:], args.ngram)  # [Bu, L]

        def loss_fn(p):
            mle, loads = lm_loss_and_loads(p, cfg, tokens, compute_dtype)
            ul = unlikelihood_loss(p, cfg, ul_tokens, candidates, compute_dtype)
            return mle + args.ul_weight * ul, (mle, ul, loads)

        (_, (mle, ul, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = update_router_bias(params, loads, cfg, args.bias_rate)
        return params, opt_state, mle, ul, jnp.mean(candidates)

    def continue_greedily(params, prefixes):  # [Bu, P] -> [Bu, P + L] int32
        out = kj.generate(cfg, cast_params(params, compute_dtype, cfg), prefixes, args.cont_len, stop_tokens=())
        return jnp.concatenate([jnp.asarray(prefixes), out.tokens], axis=1)

    schedule = StepSchedule(args.steps, args.time_budget_s, args.lr, args.warmup, log)
    t_last, step = time.perf_counter(), 0
    while not schedule.done(step):
        step += 1
        batch = random_windows(train, args.batch, args.seq_len + 1, rng)
        prefixes = random_windows(train, args.ul_batch, args.prefix_len, rng)
        ul_tokens = continue_greedily(params, prefixes)
        lr = schedule.lr(step)
        params, opt_state, mle, ul, repeat_rate = train_step(params, set_learning_rate(opt_state, lr), batch,
                                                             ul_tokens)
        schedule.after(step, mle)
        if step % 25 == 0 or step == 1:
            now = time.perf_counter()
            log(step=step, train_loss=float(mle), ul_loss=float(ul), repeat_rate=float(repeat_rate), lr=lr,
                step_s=round((now - t_last) / (1 if step == 1 else 25), 4))  # step 1: the compile
            t_last = now
    train_s = schedule.train_s
    log(event="trained", total_steps=step, train_s=round(train_s, 1))

    dense = cast_params(params, jnp.bfloat16, cfg)
    result = kj.quantize(dense, cfg, policy="experts")  # stored as shipped
    kj.save_checkpoint(args.out / "int4", cfg, result, overwrite=True)
    end = {"bits_per_byte": bits_per_byte(result, cfg, windows, lengths, eval_batch),
           "bits_per_byte_bf16_experts": bits_per_byte(dense, cfg, windows, lengths, eval_batch),
           **degeneracy_report(cfg, result, tok, prompts)}
    summary = {"total_steps": step, "train_s": round(train_s, 1), "start": start, "result": end}
    if start is not None:
        summary["bits_per_byte_cost"] = end["bits_per_byte"]["bits_per_byte"] - start["bits_per_byte"]["bits_per_byte"]
    log(event="heldout", result_bpb=end["bits_per_byte"]["bits_per_byte"], result_degenerate=end["degenerate"],
        result_int4_nats=end["bits_per_byte"]["nats_per_token"])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_curves(args.out / "log.jsonl", args.out / "loss.png", "unlikelihood fine-tune of the target",
                ("train_loss", "ul_loss", "repeat_rate"),
                ylabel="losses: nats/token; repeat_rate: share of greedy tokens")
    print(f"saved {args.out}/int4, {args.out}/summary.json; degenerate {start and start['degenerate']} -> "
          f"{end['degenerate']}, held-out bits per byte {start and start['bits_per_byte']['bits_per_byte']} -> "
          f"{end['bits_per_byte']['bits_per_byte']:.4f}", flush=True)

if __name__ == "__main__":
    main()
