"""NumPy float64 reference of the DeepSeek-V3 / Kimi-K2 text model: the ground truth of every test.

Written for clarity, not speed: plain NumPy, loops over heads / tokens / experts where that reads better.
It follows the public DeepSeek-V3 definition step by step (github.com/deepseek-ai/DeepSeek-V3
`inference/model.py`; Hugging Face transformers `models/deepseek_v3/modeling_deepseek_v3.py`) and
imports nothing from the engine except the config
(the reference must stay independent of the code it checks). Params are the tree of docs/params.md:
linear weights are [in, out], so a linear map is `x @ W`.

Everything is float64; inputs of any float dtype (jax bf16 included) are converted by `to_float64`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kdtree_jax.config import ModelConfig
from reference import int4


# ----------------------------------------------------------------------------------------- params
def to_float64(params: Any) -> Any:
    """Nested dict of array-likes (jax or numpy, any float dtype) -> nested dict of float64 np arrays.

    Integer leaves (e.g. packed INT4 words) keep their integer dtype: casting them to float would
    silently corrupt them; `_linear` decides what to do with such leaves. A typed INT4 weight
    (pallas_kernels.int4.Int4Weight) is read in its stored form, the dict {"qweight", "scale"} (`to_dict`).
    """
    if hasattr(params, "to_dict"):
        params = params.to_dict()
    if isinstance(params, Mapping):
        return {str(k): to_float64(v) for k, v in params.items()}
    arr = np.asarray(params)
    if arr.dtype.kind in "iub":
        return arr
    try:
        return np.asarray(arr, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"cannot convert a params leaf of dtype {arr.dtype} to float64: {e}") from None


def _linear(x: np.ndarray, w: Any) -> np.ndarray:
    """y = x @ W. x [..., in] -> [..., out] for a dense [in, out] weight, or for an INT4 leaf
    {"qweight": int16 [out, in/4], "scale": [out, in/32]} (the engine's leaf: the file's int32 words
    viewed as little-endian int16 halves), dequantized in float64 by reference/int4.py."""
    if isinstance(w, Mapping):
        if set(w) != {"qweight", "scale"}:
            raise TypeError(f"unknown dict leaf with keys {sorted(w)}: expected an INT4 leaf (qweight, scale)")
        qweight = np.ascontiguousarray(np.asarray(w["qweight"], np.int16))
        packed = qweight.view("<i4")  # [out, in/8]: two int16 halves per file word, low half first
        dense = int4.dequantize(int4.unpack(packed), np.asarray(w["scale"], np.float64))  # [out, in]
        return x @ dense.T
    return x @ w


def _expert_weight(w: Any, expert: int) -> Any:
    """The weight of one routed expert out of a stacked [E, ...] leaf (an INT4 leaf would slice each key)."""
    if isinstance(w, Mapping):
        return {k: v[expert] for k, v in w.items()}
    return w[expert]


# ------------------------------------------------------------------------------------ elementwise
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y = weight * x / sqrt(mean(x^2) + eps) over the last axis. x [..., D], weight [D]."""
    x = np.asarray(x, dtype=np.float64)
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _silu(z: np.ndarray) -> np.ndarray:
    return z * _sigmoid(z)


def swiglu(x: np.ndarray, gate: Any, up: Any, down: Any) -> np.ndarray:
    """(silu(x @ gate) * (x @ up)) @ down. x [..., D], gate/up [D, F], down [F, D] -> [..., D]."""
    return _linear(_silu(_linear(x, gate)) * _linear(x, up), down)


# ------------------------------------------------------------------------------------------- YaRN
def _get_mscale(scale: float, mscale: float) -> float:
    """DeepSeek `yarn_get_mscale`: 1 for scale <= 1, else 0.1 * mscale * ln(scale) + 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_dim(cfg: ModelConfig, num_rotations: float) -> float:
    """corr_dim(n) = d * ln(L0 / (2 pi n)) / (2 ln base): the rope dim index that rotates n times over L0."""
    rs = cfg.rope_scaling
    if rs is None:
        raise ValueError("yarn_correction_dim needs cfg.rope_scaling (YaRN), got None")
    d = cfg.qk_rope_head_dim
    return d * math.log(rs.original_max_position_embeddings / (2 * math.pi * num_rotations)) / (
        2 * math.log(cfg.rope_theta))


def yarn_correction_range(cfg: ModelConfig) -> tuple[float, float]:
    """(low, high) frequency indices of the YaRN ramp (HF `truncate=True`: floor / ceil)."""
    rs = cfg.rope_scaling
    if rs is None:
        raise ValueError("yarn_correction_range needs cfg.rope_scaling (YaRN), got None")
    d = cfg.qk_rope_head_dim
    low = max(math.floor(yarn_correction_dim(cfg, rs.beta_fast)), 0)
    high = min(math.ceil(yarn_correction_dim(cfg, rs.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # avoid 0/0 in the ramp; the ramp becomes a hard switch
    return low, high


def yarn_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies inv_freq [r/2] (rad / position), YaRN-blended when configured."""
    d = cfg.qk_rope_head_dim
    extra = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [r/2]
    rs = cfg.rope_scaling
    if rs is None:
        return extra
    inter = extra / rs.factor
    low, high = yarn_correction_range(cfg)
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # [r/2]
    # Small i (high frequency) keeps its original frequency; large i is interpolated (divided by s).
    return inter * ramp + extra * (1.0 - ramp)


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """Multiplier on cos/sin: get_mscale(s, mscale) / get_mscale(s, mscale_all_dim); 1 without YaRN."""
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0
    return _get_mscale(rs.factor, rs.mscale) / _get_mscale(rs.factor, rs.mscale_all_dim)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-1/2 * get_mscale(s, mscale_all_dim)^2 (DeepSeek-V3's MLA scale); the same in the absorbed form."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs is not None:
        m = _get_mscale(rs.factor, rs.mscale_all_dim)
        scale *= m * m
    return scale


# ------------------------------------------------------------------------------------------- RoPE
def rope_cos_sin(cfg: ModelConfig, positions) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [..., r/2] of positions [...] * inv_freq, both multiplied by the YaRN attention factor."""
    positions = np.asarray(positions)
    if positions.dtype.kind not in "iu":
        raise TypeError(f"positions must be integers, got dtype {positions.dtype}")
    angles = positions.astype(np.float64)[..., None] * yarn_inv_freq(cfg)  # [..., r/2]
    factor = yarn_attention_factor(cfg)
    return np.cos(angles) * factor, np.sin(angles) * factor


def apply_rope_interleaved(x: np.ndarray, positions, cfg: ModelConfig) -> np.ndarray:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by positions * inv_freq[i] (DeepSeek-V3 `apply_rotary_emb`).

    x [..., T, r]; positions [T] (or broadcastable to x.shape[:-1]). Returns float64 [..., T, r].
    """
    x = np.asarray(x, dtype=np.float64)
    r = cfg.qk_rope_head_dim
    if x.shape[-1] != r:
        raise ValueError(f"last axis of x must be qk_rope_head_dim={r}, got shape {x.shape}")
    cos, sin = rope_cos_sin(cfg, positions)  # [T, r/2]
    even, odd = x[..., 0::2], x[..., 1::2]  # [..., T, r/2]: the pair (x[2i], x[2i+1]) as a complex number
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


# -------------------------------------------------------------------------------------------- MLA
def _softmax(s: np.ndarray) -> np.ndarray:
    s = s - np.max(s, axis=-1, keepdims=True)
    e = np.exp(s)
    return e / np.sum(e, axis=-1, keepdims=True)


def mla_naive(p_attn: Mapping, cfg: ModelConfig, x: np.ndarray, positions) -> np.ndarray:
    """Multi-head latent attention in the naive form (DeepSeek-V3 `attn_impl="naive"`), causal over one sequence.

    x [T, D] (the input-normed residual, tokens in order), positions [T] int -> [T, D].
    Token t attends to tokens j <= t.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [T, hidden_size={cfg.hidden_size}], got shape {x.shape}")
    T = x.shape[0]
    positions = np.asarray(positions)
    if positions.shape != (T,):
        raise ValueError(f"positions must be [T={T}], got shape {positions.shape}")
    H, n, r, v, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim, cfg.kv_lora_rank)

    # 1. queries, through the q LoRA when there is one.
    if cfg.q_lora_rank is not None:
        c_q = rms_norm(_linear(x, p_attn["q_a"]), p_attn["q_a_norm"], cfg.latent_norm_eps)  # [T, q]
        q = _linear(c_q, p_attn["q_b"])  # [T, H*(n+r)]
    else:
        q = _linear(x, p_attn["q"])  # [T, H*(n+r)]
    q = q.reshape(T, H, n + r)
    q_nope, q_pe = q[:, :, :n], q[:, :, n:]  # [T, H, n], [T, H, r]

    # 2. the latent: c_kv (normed) and one k_pe shared by all heads.
    a = _linear(x, p_attn["kv_a"])  # [T, c + r]
    c_kv = rms_norm(a[:, :c], p_attn["kv_a_norm"], cfg.latent_norm_eps)  # [T, c]
    k_pe = a[:, c:]  # [T, r]

    # 3. RoPE on q_pe (each head) and k_pe.
    k_pe = apply_rope_interleaved(k_pe, positions, cfg)  # [T, r]
    q_pe = np.stack([apply_rope_interleaved(q_pe[:, h], positions, cfg) for h in range(H)], axis=1)

    # 4. up-project the latent to per-head keys and values.
    kv = _linear(c_kv, p_attn["kv_b"]).reshape(T, H, n + v)  # [T, H, n+v]
    k_nope, values = kv[:, :, :n], kv[:, :, n:]  # [T, H, n], [T, H, v]

    scale = softmax_scale(cfg)
    causal = np.tril(np.ones((T, T), dtype=bool))  # [T, T]: query t sees keys j <= t
    heads_out = []
    for h in range(H):
        q_h = np.concatenate([q_nope[:, h], q_pe[:, h]], axis=-1)  # [T, n+r]
        k_h = np.concatenate([k_nope[:, h], k_pe], axis=-1)  # [T, n+r]
        s = (q_h @ k_h.T) * scale  # [T, T]
        s = np.where(causal, s, -np.inf)
        heads_out.append(_softmax(s) @ values[:, h])  # [T, v]
    o = np.concatenate(heads_out, axis=-1)  # [T, H*v], head-major like the o weight's rows
    return _linear(o, p_attn["o"])  # [T, D]


# -------------------------------------------------------------------------------------------- MoE
def moe_route(p_moe: Mapping, cfg: ModelConfig, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """noaux_tc routing (DeepSeek-V3 `Gate`). x [T, D] -> (expert indices [T, k] int, combine weights [T, k] float64).

    Indices are in order of decreasing biased score. The bias only chooses; the weights are the
    unbiased sigmoid scores of the chosen experts, normalised (norm_topk_prob) and scaled.
    """
    x = np.asarray(x, dtype=np.float64)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    G, kg = cfg.n_group, cfg.topk_group
    scores = _sigmoid(x @ np.asarray(p_moe["router"], dtype=np.float64))  # [T, E]
    bias = np.asarray(p_moe["router_bias"], dtype=np.float64)  # [E]
    T = x.shape[0]
    idx = np.zeros((T, k), dtype=np.int64)
    weights = np.zeros((T, k), dtype=np.float64)
    for t in range(T):
        choice = scores[t] + bias  # [E]
        # Group-limited selection: a group's score is the sum of its top-2 biased scores; only the
        # best topk_group groups stay eligible.
        groups = choice.reshape(G, E // G)  # [G, E/G]
        group_score = np.array([np.sum(np.sort(g)[-2:]) for g in groups])  # [G]
        kept_groups = np.argsort(-group_score, kind="stable")[:kg]
        eligible = np.full(E, -np.inf)
        for g in kept_groups:
            sl = slice(g * (E // G), (g + 1) * (E // G))
            eligible[sl] = choice[sl]
        chosen = np.argsort(-eligible, kind="stable")[:k]  # [k]
        w = scores[t, chosen]  # unbiased
        if cfg.norm_topk_prob:
            w = w / (np.sum(w) + 1e-20)
        idx[t] = chosen
        weights[t] = w * cfg.routed_scaling_factor
    return idx, weights


def moe(p_moe: Mapping, cfg: ModelConfig, x: np.ndarray) -> np.ndarray:
    """DeepSeekMoE: sum_k w_k * Expert_{idx_k}(x) + SharedExpert(x). x [T, D] -> [T, D]."""
    x = np.asarray(x, dtype=np.float64)
    idx, weights = moe_route(p_moe, cfg, x)  # [T, k], [T, k]
    experts = p_moe["experts"]
    out = np.zeros_like(x)  # [T, D]
    for t in range(x.shape[0]):
        for e, w in zip(idx[t], weights[t], strict=True):
            e = int(e)
            y = swiglu(x[t:t + 1], _expert_weight(experts["gate"], e), _expert_weight(experts["up"], e),
                       _expert_weight(experts["down"], e))  # [1, D]
            out[t] += w * y[0]
    if cfg.n_shared_experts > 0:
        shared = p_moe["shared"]
        out += swiglu(x, shared["gate"], shared["up"], shared["down"])  # added unscaled
    return out


# ---------------------------------------------------------------------------------------- forward
def _decoder_layer(p_layer: Mapping, cfg: ModelConfig, layer: int, h: np.ndarray,
                   positions: np.ndarray) -> np.ndarray:
    """One pre-norm decoder layer on one sequence. h [T, D] -> [T, D]."""
    h = h + mla_naive(p_layer["attn"], cfg, rms_norm(h, p_layer["input_norm"], cfg.rms_norm_eps), positions)
    normed = rms_norm(h, p_layer["post_attn_norm"], cfg.rms_norm_eps)
    if cfg.is_moe_layer(layer):
        return h + moe(p_layer["moe"], cfg, normed)
    mlp = p_layer["mlp"]
    return h + swiglu(normed, mlp["gate"], mlp["up"], mlp["down"])


def forward(params: Mapping, cfg: ModelConfig, tokens, return_hidden: Iterable[int] = ()):
    """Full causal forward. tokens [B, S] int -> logits [B, S, V] float64.

    With `return_hidden` (layer indices, 0-based) also returns {layer: hidden [B, S, D]}, the residual
    stream after that decoder layer. Each batch row is an independent sequence at positions 0..S-1.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must be an integer array [B, S], got shape {tokens.shape} "
                         f"dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        raise ValueError(f"token ids must be in [0, vocab_size={cfg.vocab_size}), got min "
                         f"{tokens.min()} max {tokens.max()}")
    L = cfg.num_hidden_layers
    return_hidden = tuple(int(layer) for layer in return_hidden)
    for layer in return_hidden:
        if not 0 <= layer < L:
            raise ValueError(f"return_hidden layer {layer} is outside [0, num_hidden_layers={L})")
    params = to_float64(params)
    if cfg.tie_word_embeddings:
        lm_head = params["embed_tokens"].T  # [D, V]
    elif "lm_head" in params:
        lm_head = params["lm_head"]  # [D, V]
    else:
        raise KeyError("params has no 'lm_head' and cfg.tie_word_embeddings is False")

    B, S = tokens.shape
    positions = np.arange(S)
    hidden = {layer: np.zeros((B, S, cfg.hidden_size)) for layer in return_hidden}
    logits = np.zeros((B, S, cfg.vocab_size))
    for b in range(B):
        h = params["embed_tokens"][tokens[b]]  # [S, D]; no embedding scaling
        for layer in range(L):
            h = _decoder_layer(params[f"layers_{layer}"], cfg, layer, h, positions)
            if layer in hidden:
                hidden[layer][b] = h
        logits[b] = _linear(rms_norm(h, params["final_norm"], cfg.rms_norm_eps), lm_head)
    if return_hidden:
        return logits, hidden
    return logits


def greedy_generate(params: Mapping, cfg: ModelConfig, prompt: list[int], max_new_tokens: int,
                    stop_tokens: Iterable[int] = ()) -> list[int]:
    """Greedy autoregressive decoding by re-running the full forward each step (clarity over speed).

    Returns the new tokens only; the stop token is included when hit. Ties go to the lowest id.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    stop = {int(t) for t in stop_tokens}
    params = to_float64(params)  # once, not per step
    seq = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = np.asarray(forward(params, cfg, np.asarray([seq], dtype=np.int64)))  # [1, len(seq), V]
        token = int(np.argmax(logits[0, -1]))
        new.append(token)
        seq.append(token)
        if token in stop:
            break
    return new
