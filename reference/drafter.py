"""NumPy float64 reference of the DFlash-style drafter, one sequence at a time, written for clarity.

It recomputes the context keys/values from the raw target hidden states on every call (no cache), so
comparing it with the engine's cached path checks the cache bookkeeping too. Independent of
`kdtree_jax`: `cfg` is any object with the DrafterConfig attributes; params are the drafter dict of
docs/drafter.md (weights [in, out]).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reference.model import rms_norm, to_float64


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope_interleaved(x: np.ndarray, position: int, theta: float) -> np.ndarray:
    """Rotate pairs (2i, 2i+1) of one head vector x [hd] by angle position * theta^(-2i/hd)."""
    hd = x.shape[-1]
    out = np.empty_like(x)
    for i in range(hd // 2):
        angle = position * theta ** (-2.0 * i / hd)
        c, s = np.cos(angle), np.sin(angle)
        out[2 * i] = x[2 * i] * c - x[2 * i + 1] * s
        out[2 * i + 1] = x[2 * i] * s + x[2 * i + 1] * c
    return out


def context_features(p: dict, cfg: Any, target_hidden: np.ndarray) -> np.ndarray:
    """target_hidden [T, n, D] -> [T, D]: RMSNorm(concat of the n layers' states @ fc)."""
    T = target_hidden.shape[0]
    concat = np.concatenate([target_hidden[:, i, :] for i in range(target_hidden.shape[1])], axis=-1)
    assert concat.shape == (T, len(cfg.target_layer_ids) * cfg.hidden_size)
    return rms_norm(concat @ p["fc"], p["hidden_norm"], cfg.rms_norm_eps)


def _check_plain_rope(cfg: Any) -> None:
    if getattr(cfg, "rope_scaling", None) is not None:  # YaRN drafters are checked against the DFlash fixtures
        raise NotImplementedError("the reference drafter implements plain RoPE only, got rope_scaling="
                                  f"{cfg.rope_scaling!r}")


def project_kv(p_attn: dict, cfg: Any, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, D] at positions [T] -> keys [T, KVH, hd] (per-head k_norm then RoPE), values [T, KVH, hd]."""
    _check_plain_rope(cfg)
    T = x.shape[0]
    KVH, hd = cfg.num_key_value_heads, cfg.head_dim
    keys = np.zeros((T, KVH, hd))
    values = np.zeros((T, KVH, hd))
    for t in range(T):
        k_all = x[t] @ p_attn["k"]
        v_all = x[t] @ p_attn["v"]
        for g in range(KVH):
            k = rms_norm(k_all[g * hd:(g + 1) * hd], p_attn["k_norm"], cfg.rms_norm_eps)
            keys[t, g] = rope_interleaved(k, int(positions[t]), cfg.rope_theta)
            values[t, g] = v_all[g * hd:(g + 1) * hd]
    return keys, values


def context_keys_values(p: dict, cfg: Any, target_hidden: np.ndarray, positions: np.ndarray) -> list:
    """Per drafter layer, (keys, values) [T, KVH, hd] of the context tokens: what the cache must hold."""
    features = context_features(p, cfg, target_hidden)
    return [project_kv(p[f"layers_{layer}"]["attn"], cfg, features, positions)
            for layer in range(cfg.num_hidden_layers)]


def block_attention(p_attn: dict, cfg: Any, x: np.ndarray, positions: np.ndarray,
                    ctx_keys: np.ndarray, ctx_values: np.ndarray) -> np.ndarray:
    """x [Tb, D] normed block states; ctx_keys/values [S, KVH, hd]. Every block query sees every context
    row and every block row (no causal mask). Returns [Tb, D]."""
    Tb = x.shape[0]
    H, KVH, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = H // KVH
    blk_keys, blk_values = project_kv(p_attn, cfg, x, positions)
    keys = np.concatenate([ctx_keys, blk_keys], axis=0)  # [S + Tb, KVH, hd]
    values = np.concatenate([ctx_values, blk_values], axis=0)
    heads_out = np.zeros((Tb, H * hd))
    for t in range(Tb):
        q_all = x[t] @ p_attn["q"]
        for h in range(H):
            q = rms_norm(q_all[h * hd:(h + 1) * hd], p_attn["q_norm"], cfg.rms_norm_eps)
            q = rope_interleaved(q, int(positions[t]), cfg.rope_theta)
            kv_head = h // group
            scores = keys[:, kv_head, :] @ q / np.sqrt(hd)
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            heads_out[t, h * hd:(h + 1) * hd] = weights @ values[:, kv_head, :]
    return heads_out @ p_attn["o"]


def drafter_logits(p: dict, cfg: Any, context_hidden: np.ndarray, context_positions: np.ndarray,
                   embed_tokens: np.ndarray, lm_head: np.ndarray, bonus_token: int,
                   block_start: int) -> np.ndarray:
    """One sequence. context_hidden [S, n, D] (S may be 0) at context_positions [S]; the block
    [bonus, mask, ...] sits at positions block_start .. block_start + block_size - 1.
    Returns logits [block_size - 1, V] for the drafted positions."""
    p = to_float64(p)
    embed_tokens = np.asarray(embed_tokens, np.float64)
    lm_head = np.asarray(lm_head, np.float64)
    Tb = cfg.block_size
    kv = context_keys_values(p, cfg, np.asarray(context_hidden, np.float64), np.asarray(context_positions))
    tokens = [int(bonus_token)] + [cfg.mask_token_id] * (Tb - 1)
    positions = np.array([block_start + i for i in range(Tb)])
    h = embed_tokens[tokens]  # [Tb, D]
    eps = cfg.rms_norm_eps
    for layer in range(cfg.num_hidden_layers):
        pl = p[f"layers_{layer}"]
        ctx_keys, ctx_values = kv[layer]
        h = h + block_attention(pl["attn"], cfg, rms_norm(h, pl["input_norm"], eps), positions,
                                ctx_keys, ctx_values)
        x = rms_norm(h, pl["post_attn_norm"], eps)
        mlp = pl["mlp"]
        h = h + (silu(x @ mlp["gate"]) * (x @ mlp["up"])) @ mlp["down"]
    h = rms_norm(h, p["final_norm"], eps)
    return h[1:] @ lm_head
