"""Shared helpers of the training scripts: the shipped model's config, tokenizer loading, logging,
loss-curve plots."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

import kdtree_jax as kj
from kdtree_jax import ASSETS

TOKENIZER_PATH = ASSETS / "tokenizer.json"
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3  # fixed by training/tokenizer.py


def load_tokenizer(path: Path = TOKENIZER_PATH) -> Tokenizer:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no tokenizer at {path}: run `python -m training.tokenizer` first")
    tok = Tokenizer.from_file(str(path))
    for name, want in (("<pad>", PAD_ID), ("<bos>", BOS_ID), ("<eos>", EOS_ID), ("<mask>", MASK_ID)):
        if tok.token_to_id(name) != want:
            raise ValueError(f"{path}: special token {name} has id {tok.token_to_id(name)}, expected {want}")
    return tok


def target_config(vocab_size: int, hidden: int = 384, layers: int = 8, experts: int = 32, moe_width: int = 96,
                  top_k: int = 4, heads: int | None = None, max_positions: int = 2048) -> kj.ModelConfig:
    """The shipped target's K2.6 architecture at small width: MLA with q/kv LoRA and decoupled RoPE,
    YaRN (factor 4 over max_positions / 4), first layer dense, the rest routed MoE (`experts` of width
    `moe_width`, top-`top_k`, sigmoid routing with a selection bias, one shared expert of the same width).
    Defaults: the shipped target (docs/training.md). Widths are multiples of 32 so the experts quantize
    to INT4 group-32."""
    heads = max(2, hidden // 64) if heads is None else heads
    return kj.ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=8 * hidden // 3 // 32 * 32,
        moe_intermediate_size=moe_width, num_hidden_layers=layers, first_k_dense_replace=1,
        n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=top_k, num_attention_heads=heads,
        q_lora_rank=hidden // 2, kv_lora_rank=max(32, hidden // 3 // 32 * 32), qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, rope_theta=50000.0,
        rope_scaling=kj.YarnScaling(factor=4.0, original_max_position_embeddings=max_positions // 4,
                                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, routed_scaling_factor=2.5,
        bos_token_id=BOS_ID, eos_token_id=(EOS_ID,), pad_token_id=PAD_ID, mask_token_id=MASK_ID,
    ).validate()


def on_one_device(tree, device=None):
    """Every leaf of a training state (params, optimizer state) committed to one device (default: the first).
    A jitted step's cache key includes whether each argument is committed: a state that mixes committed leaves
    (a loaded checkpoint) with uncommitted ones (a fresh optimizer state) compiles the step a second time on
    step 2, once its own committed outputs come back, which also spoils a step time measured over the first
    steps (`train_drafter --init` ran 469 of the ~8600 steps its time budget allowed)."""
    return jax.device_put(tree, jax.devices()[0] if device is None else device)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """Bytes of text each token id stands for (0 for special tokens): the denominator of bits per byte."""
    from kdtree_jax.healing import token_table

    return np.array([0 if b is None else len(b) for b in token_table(tokenizer).token_bytes], np.int64)


class JsonLog:
    """Append one JSON object per line to a log file and echo a compact line to stdout."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.t0 = time.perf_counter()

    def __call__(self, **record) -> None:
        record["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
              flush=True)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(log_path: Path, png_path: Path, title: str, keys: tuple[str, ...],
                ylabel: str = "cross-entropy (nats/token)") -> None:
    """Loss curves (every key that appears in the log) against the step."""
    import matplotlib  # noqa: PLC0415  # pyright: ignore[reportMissingImports] (the train / bench extras)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415  # pyright: ignore[reportMissingImports]

    records = read_log(log_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label=key, marker="o" if len(pts) < 40 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def describe_device() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')} x{jax.device_count()}"


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
