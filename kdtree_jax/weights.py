"""Every weight of the target model, declared once (the tree is documented in docs/params.md).

One row of `_TABLE` per weight: where it sits (block, name), its shape as a function of the config (params
convention: linear maps [in, out], stacked experts [E, in, out]), its logical axes (kdtree_jax.sharding maps
them to the mesh), its initializer, whether it stays float32 (the router), and its Hugging Face tensor.
Everything else derives from the table:
  init           `model.Transformer` reads each weight's shape, dtype and initializer from `declare(cfg)`;
  checkpoints    `abstract_params(cfg, dtype)` is the tree a checkpoint is checked and restored against;
  sharding       `logical_axes(path)` gives the PartitionSpec of every leaf;
  HF import      `kdtree_jax.hf` plans which file tensors to read from `declare(cfg)`.
Adding a weight is one row here plus the line of the module that uses it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.config import ModelConfig
from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight

# blocks: where a weight sits in the tree
TOP = ""  # {"embed_tokens", "final_norm", "lm_head"}
LAYER = "layer"  # directly under "layers_{i}"
ATTN, MLP, MOE, EXPERTS, SHARED = "attn", "mlp", "moe", "experts", "shared"
# block -> key path under "layers_{i}"
_BLOCK_PATH = {LAYER: (), ATTN: ("attn",), MLP: ("mlp",), MOE: ("moe",), EXPERTS: ("moe", "experts"),
               SHARED: ("moe", "shared")}
# block -> HF name prefix under "model.layers.{i}."
_HF_PREFIX = {LAYER: "", ATTN: "self_attn.", MLP: "mlp.", MOE: "mlp.", EXPERTS: "mlp.experts.{e}.",
              SHARED: "mlp.shared_experts."}


# ------------------------------------------------------------------------------------- initializers
def _fan_in_normal(key, shape, dtype):
    fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


INITIALIZERS: dict[str, Callable] = {"fan_in_normal": _fan_in_normal, "normal": _normal, "ones": _ones,
                                     "zeros": _zeros}


# ------------------------------------------------------------------------------------------ the table
@dataclasses.dataclass(frozen=True)
class _Row:
    block: str
    name: str
    shape: Callable[[ModelConfig], tuple[int, ...]]
    axes: tuple[str, ...]
    init: str
    hf: str  # HF tensor name under the block's prefix
    hf_linear: bool = True  # an HF Linear weight [out, in]: stored transposed ([in, out])
    float32: bool = False
    when: Callable[[ModelConfig], bool] = lambda cfg: True


def _q_lora(cfg: ModelConfig) -> int:
    """q_lora_rank, for the rows that exist only with a low-rank query (their `when` checks it is set)."""
    assert cfg.q_lora_rank is not None
    return cfg.q_lora_rank


def _heads_qk(cfg: ModelConfig) -> int:
    return cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


_TABLE: tuple[_Row, ...] = (
    _Row(TOP, "embed_tokens", lambda c: (c.vocab_size, c.hidden_size), ("vocab", "embed"), "normal",
         "model.embed_tokens.weight", hf_linear=False),
    _Row(LAYER, "input_norm", lambda c: (c.hidden_size,), ("norm",), "ones", "input_layernorm.weight",
         hf_linear=False),
    _Row(ATTN, "q", lambda c: (c.hidden_size, _heads_qk(c)), ("embed", "heads"), "fan_in_normal",
         "q_proj.weight", when=lambda c: c.q_lora_rank is None),
    _Row(ATTN, "q_a", lambda c: (c.hidden_size, _q_lora(c)), ("embed", "q_lora"), "fan_in_normal",
         "q_a_proj.weight", when=lambda c: c.q_lora_rank is not None),
    _Row(ATTN, "q_a_norm", lambda c: (_q_lora(c),), ("norm",), "ones", "q_a_layernorm.weight",
         hf_linear=False, when=lambda c: c.q_lora_rank is not None),
    # columns are head-major: a column block of q_b / kv_b / rows of o = whole heads
    _Row(ATTN, "q_b", lambda c: (_q_lora(c), _heads_qk(c)), ("q_lora", "heads"), "fan_in_normal",
         "q_b_proj.weight", when=lambda c: c.q_lora_rank is not None),
    # columns [0, c): latent c_kv; [c, c+r): k_pe before RoPE
    _Row(ATTN, "kv_a", lambda c: (c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim), ("embed", "latent"),
         "fan_in_normal", "kv_a_proj_with_mqa.weight"),
    _Row(ATTN, "kv_a_norm", lambda c: (c.kv_lora_rank,), ("norm",), "ones", "kv_a_layernorm.weight",
         hf_linear=False),
    # head h: columns h*(n+v) .. +n = W_UK, then +v = W_UV (HF's order)
    _Row(ATTN, "kv_b", lambda c: (c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)),
         ("latent", "heads"), "fan_in_normal", "kv_b_proj.weight"),
    _Row(ATTN, "o", lambda c: (c.num_attention_heads * c.v_head_dim, c.hidden_size), ("heads", "embed"),
         "fan_in_normal", "o_proj.weight"),
    _Row(LAYER, "post_attn_norm", lambda c: (c.hidden_size,), ("norm",), "ones",
         "post_attention_layernorm.weight", hf_linear=False),
    _Row(MLP, "gate", lambda c: (c.hidden_size, c.intermediate_size), ("embed", "mlp"), "fan_in_normal",
         "gate_proj.weight"),
    _Row(MLP, "up", lambda c: (c.hidden_size, c.intermediate_size), ("embed", "mlp"), "fan_in_normal",
         "up_proj.weight"),
    _Row(MLP, "down", lambda c: (c.intermediate_size, c.hidden_size), ("mlp", "embed"), "fan_in_normal",
         "down_proj.weight"),
    _Row(MOE, "router", lambda c: (c.hidden_size, c.n_routed_experts), ("embed", "router"), "fan_in_normal",
         "gate.weight", float32=True),
    # e_score_correction_bias: only chooses experts
    _Row(MOE, "router_bias", lambda c: (c.n_routed_experts,), ("router",), "zeros",
         "gate.e_score_correction_bias", hf_linear=False, float32=True),
    _Row(EXPERTS, "gate", lambda c: (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size),
         ("experts", "embed", "mlp"), "fan_in_normal", "gate_proj.weight"),
    _Row(EXPERTS, "up", lambda c: (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size),
         ("experts", "embed", "mlp"), "fan_in_normal", "up_proj.weight"),
    _Row(EXPERTS, "down", lambda c: (c.n_routed_experts, c.moe_intermediate_size, c.hidden_size),
         ("experts", "mlp", "embed"), "fan_in_normal", "down_proj.weight"),
    _Row(SHARED, "gate", lambda c: (c.hidden_size, c.shared_intermediate_size), ("embed", "mlp"),
         "fan_in_normal", "gate_proj.weight"),
    _Row(SHARED, "up", lambda c: (c.hidden_size, c.shared_intermediate_size), ("embed", "mlp"),
         "fan_in_normal", "up_proj.weight"),
    _Row(SHARED, "down", lambda c: (c.shared_intermediate_size, c.hidden_size), ("mlp", "embed"),
         "fan_in_normal", "down_proj.weight"),
    _Row(TOP, "final_norm", lambda c: (c.hidden_size,), ("norm",), "ones", "model.norm.weight",
         hf_linear=False),
    _Row(TOP, "lm_head", lambda c: (c.hidden_size, c.vocab_size), ("embed", "vocab"), "fan_in_normal",
         "lm_head.weight", when=lambda c: not c.tie_word_embeddings),
)

@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One weight of a model with a given config.

    shape: params convention ([in, out]; stacked experts [E, in, out]); axes: a logical name per dim;
    init: a key of INITIALIZERS; float32: stored in float32 whatever the param dtype; hf: the HF tensor
    name ("{e}" stands for the expert index of stacked experts); hf_linear: the HF tensor is a Linear
    weight [out, in] (stored transposed here)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str
    float32: bool
    hf: str
    hf_linear: bool

    def dtype(self, param_dtype) -> jnp.dtype:
        return jnp.dtype(jnp.float32) if self.float32 else jnp.dtype(param_dtype)

    @property
    def stacked_experts(self) -> bool:
        return "{e}" in self.hf

    def initializer(self) -> Callable:
        """f(key, shape, dtype) -> array."""
        return INITIALIZERS[self.init]


def _blocks_of_layer(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    if not cfg.is_moe_layer(layer):
        return LAYER, ATTN, MLP
    return (LAYER, ATTN, MOE, EXPERTS, *((SHARED,) if cfg.n_shared_experts else ()))


@functools.lru_cache(maxsize=64)
def declare(cfg: ModelConfig) -> dict[tuple[str, ...], WeightSpec]:
    """Every weight of a model with config `cfg`: {path: WeightSpec}, in the table's order per layer.

    Treat the returned dict as read-only (it is cached per config)."""
    out: dict[tuple[str, ...], WeightSpec] = {}

    def add(row: _Row, path: tuple[str, ...], hf: str) -> None:
        out[path] = WeightSpec(path, tuple(int(d) for d in row.shape(cfg)), row.axes, row.init, row.float32, hf,
                               row.hf_linear)

    top = [row for row in _TABLE if row.block == TOP and row.when(cfg)]
    for row in top[:1]:  # the embedding comes first, the rest after the layers
        add(row, (row.name,), row.hf)
    for layer in range(cfg.num_hidden_layers):
        blocks = _blocks_of_layer(cfg, layer)
        for row in _TABLE:
            if row.block in blocks and row.when(cfg):
                add(row, (f"layers_{layer}", *_BLOCK_PATH[row.block], row.name),
                    f"model.layers.{layer}.{_HF_PREFIX[row.block]}{row.hf}")
    for row in top[1:]:
        add(row, (row.name,), row.hf)
    return out


def logical_axes(path: tuple[str, ...]) -> tuple[str, ...] | None:
    """Logical axes of the weight at `path` (a full params path, or one ending in the weight's block,
    e.g. ("experts", "gate")); None for a path no declaration matches."""
    if len(path) == 1:
        block = TOP
    else:
        block = LAYER if path[-2].startswith("layers_") else path[-2]
        if block not in _BLOCK_PATH:
            return None
    # the axes do not depend on the config: a (block, name) row says them for every model
    return next((row.axes for row in _TABLE if (row.block, row.name) == (block, path[-1])), None)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """The params tree of `cfg` as ShapeDtypeStructs (dense): what init_params returns, without computing it."""
    tree: dict = {}
    for path, spec in declare(cfg).items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.ShapeDtypeStruct(spec.shape, spec.dtype(dtype))
    return tree


def cast_params(params, dtype, cfg: ModelConfig | None = None):
    """`params` with every dense floating-point array in `dtype`: a bf16-stored checkpoint run in float32
    (or the bf16 forward of float32 master weights). With a target `cfg`, the weights the model keeps in
    float32 (the router) stay float32; INT4 weights (and their scales) and integer arrays are untouched.
    Works for target and drafter trees."""
    dtype = jnp.dtype(dtype)
    keep = set() if cfg is None else {path for path, spec in declare(cfg).items() if spec.float32}
    is_int4 = lambda x: isinstance(x, (Int4Weight, MosaicInt4Weight))  # noqa: E731

    def cast(path, x):
        if is_int4(x) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if tuple(str(getattr(k, "key", k)) for k in path) in keep:
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=is_int4)
