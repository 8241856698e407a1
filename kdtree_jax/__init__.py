"""kdtree-jax: DeepSeek-V3 / Kimi K2.x inference in JAX with DDTree speculative decoding and INT4 weights.

Public API (see README.md):
    cfg = kj.ModelConfig.tiny()                       # or kj.ModelConfig.from_hf_config(dict)
    params = kj.init_params(cfg, jax.random.key(0))
    logits = kj.forward(params, cfg, tokens)          # [B, S] -> [B, S, V]
    out = kj.generate(cfg, params, prompts, max_new_tokens=64, method="ar")
    kj.save_checkpoint(path, cfg, params); cfg, params = kj.load_checkpoint(path)
"""

from kdtree_jax.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kdtree_jax.config import ConfigError, ModelConfig, YarnScaling
from kdtree_jax.generate import GenerateOutput, generate
from kdtree_jax.model import KVCache, forward, forward_with_cache, init_cache, init_params

__all__ = [
    "CheckpointError", "ConfigError", "GenerateOutput", "KVCache", "ModelConfig", "YarnScaling",
    "forward", "forward_with_cache", "generate", "init_cache", "init_params", "load_checkpoint",
    "save_checkpoint",
]
