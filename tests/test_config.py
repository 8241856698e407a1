"""ModelConfig: presets, validation errors, JSON round trip, and the Hugging Face config forms."""

import json
import re

import pytest
from helpers import TINY

import kdtree_jax as kj
from kdtree_jax.config import ConfigError, YarnScaling

DSV3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
}
K2 = {**DSV3, "model_type": "kimi_k2", "vocab_size": 163840, "first_k_dense_replace": 1, "n_routed_experts": 384,
      "num_attention_heads": 64, "num_key_value_heads": 64, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
      "n_group": 1, "topk_group": 1, "bos_token_id": 163584, "eos_token_id": 163585,
      "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                       "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}


def test_presets_are_valid_and_hashable():
    assert hash(TINY) == hash(kj.ModelConfig.tiny())
    k26 = kj.ModelConfig.kimi_k26()
    assert (k26.hidden_size, k26.n_routed_experts, k26.num_attention_heads, k26.latent_dim) == (7168, 384, 64, 576)
    assert k26.softmax_scale == pytest.approx(0.144680, abs=1e-6)
    assert TINY.is_moe_layer(1) and not TINY.is_moe_layer(0)


def test_json_round_trip():
    for cfg in (TINY, kj.ModelConfig.kimi_k26(), TINY.replace(q_lora_rank=None, rope_scaling=None)):
        assert kj.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="unknown ModelConfig fields"):
        kj.ModelConfig.from_dict({**TINY.to_dict(), "hiden_size": 3})


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(vocab_size=-5), "vocab_size"),
    (dict(num_attention_heads=2.5), "num_attention_heads"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace"),
    (dict(qk_rope_head_dim=15), "even"),
    (dict(num_experts_per_tok=9), "exceeds n_routed_experts"),
    (dict(n_group=3), "not divisible by n_group"),
    (dict(n_group=2, topk_group=3), "topk_group=3 exceeds"),
    (dict(n_group=8, topk_group=1), "must be >= 2"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "kept groups"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rope_scaling=YarnScaling(0.5, 64)), "factor must be >= 1"),
    (dict(rope_scaling=YarnScaling(4.0, 0)), "original_max_position_embeddings"),
    (dict(eos_token_id=(400,)), "eos_token_id\\[0\\]=400 is outside the vocabulary"),
    (dict(mask_token_id=-1), "mask_token_id"),
])
def test_validation_names_the_bad_value(changes, match):
    with pytest.raises(ConfigError, match=match):
        TINY.replace(**changes)


def test_from_hf_deepseek_v3_and_kimi_k2():
    ds = kj.ModelConfig.from_hf_config(DSV3)
    assert (ds.n_group, ds.topk_group, ds.first_k_dense_replace, ds.eos_token_id) == (8, 4, 3, (1,))
    assert ds.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    k2 = kj.ModelConfig.from_hf_config(K2)
    assert k2.rope_scaling.beta_fast == 1.0 and k2.rope_theta == 50000.0
    assert k2.softmax_scale == pytest.approx(0.130861, abs=1e-6)
    assert k2.rope_scaling.attention_factor == pytest.approx(1.0)


def test_from_hf_kimi_k25_text_config_and_rope_parameters():
    text = {k: v for k, v in K2.items() if k not in ("rope_theta", "rope_scaling", "bos_token_id", "eos_token_id")}
    text["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                               "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                               "mscale": 1.0, "mscale_all_dim": 1.0}
    outer = {"model_type": "kimi_k25", "text_config": text, "bos_token_id": 163584, "eos_token_id": 163586}
    cfg = kj.ModelConfig.from_hf_config(outer)
    assert cfg == kj.ModelConfig.kimi_k26().replace(max_position_embeddings=163840, rms_norm_eps=1e-6,
                                                    mask_token_id=None, pad_token_id=None)
    # the legacy form of the same rope gives the same config
    legacy = {**text, "rope_theta": 50000.0}
    del legacy["rope_parameters"]
    legacy["rope_scaling"] = {"type": "yarn", **{k: v for k, v in text["rope_parameters"].items()
                                                 if k not in ("rope_type", "rope_theta")}}
    assert kj.ModelConfig.from_hf_config({**outer, "text_config": legacy}) == cfg


def test_from_hf_without_yarn_and_without_q_lora():
    plain = {**DSV3, "q_lora_rank": None}
    del plain["rope_scaling"]
    cfg = kj.ModelConfig.from_hf_config(plain)
    assert cfg.rope_scaling is None and cfg.q_lora_rank is None
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5)


@pytest.mark.parametrize("hf,match", [
    ({**DSV3, "model_type": "llama"}, "unsupported model_type"),
    ({**DSV3, "num_key_value_heads": 8}, "num_key_value_heads"),
    ({**DSV3, "scoring_func": "softmax"}, "sigmoid"),
    ({**DSV3, "moe_layer_freq": 2}, "moe_layer_freq"),
    ({k: v for k, v in DSV3.items() if k != "kv_lora_rank"}, "missing required keys.*kv_lora_rank"),
    ({**DSV3, "rope_scaling": {"type": "linear", "factor": 2.0}}, "only yarn"),
    ({**DSV3, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, "factor"),
    ({**DSV3, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ({**DSV3, "hidden_size": "big"}, "config key 'hidden_size' must be an integer, got 'big'"),
    ({"model_type": "kimi_k25", "text_config": None}, "text_config"),
    ("not a dict", "expected a config dict"),
])
def test_from_hf_rejects_bad_configs(hf, match):
    with pytest.raises(ConfigError, match=match):
        kj.ModelConfig.from_hf_config(hf)


YARN = DSV3["rope_scaling"]
WRONG_JSON_TYPES = [  # (key, value of the wrong JSON type, the message)
    ("vocab_size", [129280], "'vocab_size' must be an integer, got [129280]"),
    ("hidden_size", 7168.5, "'hidden_size' must be an integer, got 7168.5"),  # never truncated to 7168
    ("first_k_dense_replace", "3", "'first_k_dense_replace' must be an integer, got '3'"),
    ("n_routed_experts", {"n": 256}, "'n_routed_experts' must be an integer"),
    ("q_lora_rank", "1536", "'q_lora_rank' must be an integer"),
    ("max_position_embeddings", float("inf"), "'max_position_embeddings' must be an integer, got inf"),
    ("rope_theta", "10000", "'rope_theta' must be a finite number, got '10000'"),
    ("rms_norm_eps", [1e-6], "'rms_norm_eps' must be a finite number"),
    ("routed_scaling_factor", True, "'routed_scaling_factor' must be a finite number, got True"),
    ("norm_topk_prob", "false", "'norm_topk_prob' must be true or false, got 'false'"),  # not read as True
    ("tie_word_embeddings", 1, "'tie_word_embeddings' must be true or false, got 1"),
    ("bos_token_id", "0", "'bos_token_id' must be an integer, got '0'"),
    ("pad_token_id", 1.5, "'pad_token_id' must be an integer, got 1.5"),
    ("eos_token_id", {"id": 1}, "'eos_token_id' must be a token id or a list of them"),
    ("eos_token_id", [1, "2"], "'eos_token_id' must be a token id or a list of them, got [1, '2']"),
    ("rope_scaling", ["yarn", 40], "'rope_scaling' must be a dict or null, got ['yarn', 40]"),
    ("rope_scaling", "yarn", "'rope_scaling' must be a dict or null, got 'yarn'"),
    ("rope_scaling", {**YARN, "factor": "40"}, "'rope_scaling.factor' must be a finite number, got '40'"),
    ("rope_scaling", {**YARN, "original_max_position_embeddings": [4096]},
     "'rope_scaling.original_max_position_embeddings' must be an integer"),
    ("rope_scaling", {**YARN, "beta_fast": {}}, "'rope_scaling.beta_fast' must be a finite number"),
    ("rope_parameters", ["yarn"], "'rope_parameters' must be a dict, got ['yarn']"),
    ("rope_parameters", {**YARN, "rope_type": "yarn", "mscale": "1"},
     "'rope_parameters.mscale' must be a finite number"),
]


@pytest.mark.parametrize("key, value, match", WRONG_JSON_TYPES, ids=[f"{k}={v!r}"[:40] for k, v, _ in WRONG_JSON_TYPES])
def test_from_hf_names_a_value_of_the_wrong_json_type(key, value, match):
    """Each of these was an AttributeError / TypeError (the CLI's "internal error"), or silently
    truncated or misread; now a ConfigError naming the key and the value."""
    with pytest.raises(ConfigError, match=re.escape(match)):
        kj.ModelConfig.from_hf_config({**DSV3, key: value})


def test_from_hf_accepts_whole_floats_and_null_defaults():
    cfg = kj.ModelConfig.from_hf_config({**DSV3, "hidden_size": 7168.0, "n_group": None, "topk_group": None,
                                         "norm_topk_prob": None, "n_routed_experts": 256.0})
    assert (cfg.hidden_size, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob) == (7168, 1, 1, True)
    assert type(cfg.hidden_size) is int and type(cfg.n_routed_experts) is int


@pytest.mark.parametrize("changes, match", [
    (dict(rope_scaling=["yarn"]), "rope_scaling must be a dict or null, got ['yarn']"),
    (dict(rope_scaling={"factor": 4.0}), "bad rope_scaling fields"),
    (dict(rope_scaling={"factor": "4", "original_max_position_embeddings": 64}),
     "rope_scaling.factor must be a finite number, got '4'"),
    (dict(eos_token_id="2"), "eos_token_id must be a list of token ids, got '2'"),
    (dict(eos_token_id=["2"]), "eos_token_id must be a tuple of token ids"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob must be true or false, got 'yes'"),
    (dict(latent_norm_eps="1e-6"), "latent_norm_eps must be a finite number, got '1e-6'"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor must be a finite number, got nan"),
    (dict(first_k_dense_replace="1"), "first_k_dense_replace must be an integer, got '1'"),
    (dict(bos_token_id=1.0), "bos_token_id must be an integer or null, got 1.0"),
])
def test_checkpoint_config_of_the_wrong_json_type_is_a_config_error(changes, match):
    """ModelConfig.from_dict reads a checkpoint's config.json: wrong types were raw TypeErrors."""
    with pytest.raises(ConfigError, match=re.escape(match)):
        kj.ModelConfig.from_dict({**TINY.to_dict(), **changes})
    with pytest.raises(ConfigError, match="expected a ModelConfig dict, got list"):
        kj.ModelConfig.from_dict([1, 2])
