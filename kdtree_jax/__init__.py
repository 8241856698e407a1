"""kdtree-jax: DeepSeek-V3 / Kimi K2.x inference in JAX with DDTree speculative decoding and INT4 weights.

Public API (see README.md):
    cfg = kj.ModelConfig.tiny()                       # or kj.ModelConfig.from_hf_config(dict)
    params = kj.init_params(cfg, jax.random.key(0))
    logits = kj.forward(params, cfg, tokens)          # [B, S] -> [B, S, V]
    out = kj.generate(cfg, params, prompts, max_new_tokens=64, method="ddtree",
                      drafter=(dcfg, dparams), tree_budget=32)   # or tree_budget="auto"
    costs = kj.calibrate_budget_costs(cfg, params, prompts, drafter=(dcfg, dparams))  # for "auto", measured here
    kj.save_checkpoint(path, cfg, params); cfg, params = kj.load_checkpoint(path)
    cfg, params = kj.load_hf(hf_dir)
    dcfg, dparams = kj.load_hf_drafter(dflash_dir, target=cfg)   # a published z-lab DFlash drafter
    params = kj.prepare_params(params, cfg)           # once: the layout the chosen kernels run on
    kj.kernel_plan(params, cfg)                       # which kernel each op runs here, and why
    out = kj.generate(..., kernels=kj.Kernels(attention="xla"))  # override the choice per call

Importing kdtree_jax sets its XLA flags (kdtree_jax/xla_flags.py: CUDA graphs for every run of kernels) unless
XLA_FLAGS already names them, KDTREE_JAX_XLA_FLAGS=0, or a JAX backend has already started.
"""

from pathlib import Path

from kdtree_jax import xla_flags  # noqa: F401  first: importing it applies the flags, before anything can start a backend
from kdtree_jax.budget import BudgetCosts
from kdtree_jax.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kdtree_jax.config import ConfigError, ModelConfig, YarnScaling
from kdtree_jax.ddtree import DFlashDraft, OracleDraft
from kdtree_jax.decoding import GenerateOutput
from kdtree_jax.drafter import (
                                DrafterCache,
                                DrafterConfig,
                                drafter_extend_context,
                                drafter_forward,
                                init_drafter_cache,
                                init_drafter_params,
)
from kdtree_jax.generate import calibrate_budget_costs, generate
from kdtree_jax.hf import HFCheckpointError, load_hf
from kdtree_jax.hf_drafter import DrafterFormatError, export_hf_drafter, load_hf_drafter
from kdtree_jax.kernels import kernel_plan, plan_summary, prepare_params
from kdtree_jax.model import KVCache, forward, forward_with_cache, init_cache, init_params
from kdtree_jax.quantize import mosaic_moe_unsupported, quantize, to_mosaic_experts
from kdtree_jax.tree import Tree, build_chain, build_tree
from pallas_kernels.dispatch import Kernels, KernelUnavailableError
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight

# The trained pair shipped in the package (training/, docs/training.md): target/, drafter/, tokenizer.json and the
# held-out prompts; the CLI, the training scripts and the benchmarks default to it.
ASSETS = Path(__file__).resolve().parent / "assets"

__all__ = [
    "ASSETS", "BudgetCosts", "calibrate_budget_costs",
    "CheckpointError", "ConfigError", "DFlashDraft", "DrafterCache", "DrafterConfig", "DrafterFormatError",
    "GenerateOutput", "HFCheckpointError", "Int4Weight", "KVCache", "KernelUnavailableError", "Kernels",
    "ModelConfig", "MosaicInt4Weight", "OracleDraft", "Tree", "YarnScaling", "build_chain", "export_hf_drafter",
    "load_hf_drafter",
    "build_tree", "drafter_extend_context", "drafter_forward", "forward", "forward_with_cache", "generate",
    "init_cache", "init_drafter_cache", "init_drafter_params", "init_params", "kernel_plan", "load_checkpoint",
    "load_hf", "mosaic_moe_unsupported", "plan_summary", "prepare_params", "quantize", "save_checkpoint",
    "to_mosaic_experts",
]
