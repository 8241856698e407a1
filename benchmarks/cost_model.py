"""Tree-budget advice for DDTree at Kimi K2.6 width: a per-round cost model and `choose_tree_budget`.
A benchmark tool (bench_k26_slice.py, bench_moe_mgpu.py and the docs use it); the engine does not.

A DDTree round drafts once and verifies T = 1 + budget tokens in one target forward; it commits the
acceptance length tau(budget) tokens (>= 1). Plain autoregressive decoding commits 1 token per forward
of T = 1. So, at committed context S:

    speedup(B, S) = tau(B) * ar_step(S) / (draft + verify(1 + B, S))
    break-even acceptance length tau*(B, S) = (draft + verify(1 + B, S)) / ar_step(S)

verify(T, S) = sum over layers of attention(T, S) + moe(T) + rest(T), plus the lm_head. Each term is a
floor (bytes / bandwidth or FLOPs / peak, whichever is larger) times an overhead factor (measured time /
floor). The floors follow docs/k26_verify_cost.md:
  attention: absorbed MLA, reads S * 1152 bytes of latent cache, 2 * H * T * (S + T) * (576 + 512) FLOPs;
  moe:       routed experts, reads E * (1 - (1 - k / E)^T) touched experts * 24.8 MB (INT4 + bf16 scales);
  rest:      bf16 attention projections + shared expert + router (~296 MB per layer, ~flat in T).
The overhead factors and fixed costs are slots: the defaults are the issue's H200 targets and the
H200 machine figures of docs/kernels.md, NOT measurements of this engine; `CostModel.calibrated` fills
them from benchmarks/bench_k26_slice.py results, and `CostModel.measured_h200()` is that calibration
for the committed H200 run (docs/k26_verify_cost.md).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from typing import NamedTuple

from pallas_kernels.int4 import GROUP_SIZE

BF16_BYTES = 2


# CostModel.calibrated(rows of benchmarks/results/k26_slice.json), rounded; see CostModel.measured_h200.
MEASURED_H200 = {"bandwidth": 3.36e12, "attention_overhead": 3.68, "moe_overhead": 1.09, "rest_overhead": 1.63}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-round cost of DDTree verification (seconds). Shape fields default to Kimi K2.6."""

    # Model shape (ModelConfig.kimi_k26()).
    num_layers: int = 61
    num_dense_layers: int = 1  # first_k_dense_replace
    hidden: int = 7168
    num_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    vocab: int = 163840
    num_experts: int = 384
    top_k: int = 8
    moe_intermediate: int = 2048
    dense_intermediate: int = 18432
    num_shared_experts: int = 1
    # Machine (H200, docs/kernels.md): device copy bandwidth and bf16 dense matmul peak.
    bandwidth: float = 3.37e12  # bytes / s
    peak_flops: float = 823e12  # FLOP / s
    # Overhead factors = time / floor. Defaults: the targets (TO BE MEASURED by the slice bench).
    attention_overhead: float = 1.5  # the tree-attention targets (docs/kernels.md) are 1.2-2.2x their floors
    moe_overhead: float = 1.3  # issue 7: grouped INT4 MoE within 1.3x of the touched-expert floor
    rest_overhead: float = 1.2  # bf16 XLA GEMMs at ~4 TB/s of weights (docs/kernels.md): assumed
    head_overhead: float = 1.1
    layer_fixed_seconds: float = 0.0  # launch gaps per layer inside one jit (to be measured)
    # Drafter: a DFlash drafter at the target's width (assumed shape, to be measured).
    drafter_layers: int = 5
    drafter_intermediate: int = 18432
    draft_seconds: float | None = None  # measured draft time per round; None: estimated from bytes
    round_fixed_seconds: float = 0.0  # tree build + accept + compact per round (to be measured)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "draft_seconds" and v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CostModel.{f.name} must be a finite number >= 0, got {v!r}")
        if self.top_k > self.num_experts or self.num_dense_layers > self.num_layers:
            raise ValueError(f"CostModel: top_k={self.top_k} > num_experts={self.num_experts} or "
                             f"num_dense_layers={self.num_dense_layers} > num_layers={self.num_layers}")

    @classmethod
    def from_config(cls, cfg, **overrides) -> CostModel:
        """The shape fields from a `kdtree_jax.ModelConfig`; machine/overhead fields from `overrides`."""
        return cls(
            num_layers=cfg.num_hidden_layers, num_dense_layers=cfg.first_k_dense_replace, hidden=cfg.hidden_size,
            num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, vocab=cfg.vocab_size, num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok, moe_intermediate=cfg.moe_intermediate_size,
            dense_intermediate=cfg.intermediate_size, num_shared_experts=cfg.n_shared_experts,
            drafter_intermediate=cfg.intermediate_size, **overrides)

    @classmethod
    def measured_h200(cls, **overrides) -> CostModel:
        """Kimi K2.6 with the overheads measured on one H200 (benchmarks/results/k26_slice.json,
        2026-11-30, JAX 0.11.2, CUPTI kernel time: the attention was then the Pallas Triton tree-attention kernel,
        deleted since for the faster Mosaic GPU one; the MoE the Mosaic GPU grouped kernel) and that run's copy
        bandwidth. tests/test_budget.py checks these against the committed JSON."""
        return cls(**{**MEASURED_H200, **overrides})

    # ------------------------------------------------------------------------------- sizes (bytes)
    @property
    def latent_bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * BF16_BYTES  # 1152 at K2 width

    @property
    def expert_bytes(self) -> float:
        """One routed expert in INT4 group-32 with bf16 scales: 3 * D * I * (0.5 + 2/32) bytes."""
        return 3 * self.hidden * self.moe_intermediate * (0.5 + BF16_BYTES / GROUP_SIZE)

    @property
    def attention_params(self) -> int:
        """q_a, q_b, kv_a, absorbed kv_b (W_UK and W_UV), o_proj (bf16)."""
        h, d = self.num_heads, self.hidden
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return (d * self.q_lora_rank + self.q_lora_rank * h * qk + d * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * d)

    @property
    def rest_params(self) -> int:
        """bf16 weights of an MoE layer outside attention-core and routed experts."""
        shared = 3 * self.hidden * self.moe_intermediate * self.num_shared_experts
        return self.attention_params + shared + self.hidden * self.num_experts

    # ----------------------------------------------------------------------------------- floors (s)
    def touched_experts(self, num_tokens: int) -> float:
        """Expected distinct experts hit by T tokens under uniform top-k routing: E (1 - (1 - k/E)^T)."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def _floor(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.peak_flops)

    def attention_floor(self, num_tokens: int, context_len: int) -> float:
        """Absorbed MLA core over S cached + T tree tokens (the latent cache read, or the FLOPs)."""
        t, s = num_tokens, context_len
        flops = 2 * self.num_heads * t * (s + t) * (self.kv_lora_rank + self.qk_rope_head_dim + self.kv_lora_rank)
        return self._floor((s + t) * self.latent_bytes_per_token, flops)

    def moe_floor(self, num_tokens: int, touched: float | None = None) -> float:
        """Routed experts: the touched experts' INT4 bytes (or FLOPs of T * k expert rows)."""
        touched = self.touched_experts(num_tokens) if touched is None else touched
        flops = 2 * num_tokens * self.top_k * 3 * self.hidden * self.moe_intermediate
        return self._floor(touched * self.expert_bytes, flops)

    def rest_floor(self, num_tokens: int) -> float:
        """bf16 projections + shared expert + router of one MoE layer."""
        return self._floor(self.rest_params * BF16_BYTES, 2 * num_tokens * self.rest_params)

    def dense_mlp_floor(self, num_tokens: int) -> float:
        params = 3 * self.hidden * self.dense_intermediate
        return self._floor(params * BF16_BYTES, 2 * num_tokens * params)

    def head_floor(self, num_tokens: int) -> float:
        params = self.vocab * self.hidden
        return self._floor(params * BF16_BYTES, 2 * num_tokens * params)

    # ------------------------------------------------------------------------------ times (s)
    def layer_seconds(self, num_tokens: int, context_len: int) -> dict[str, float]:
        """Modelled time of one MoE layer, split as the slice benchmark reports it."""
        return {
            "attention": self.attention_overhead * self.attention_floor(num_tokens, context_len),
            "moe": self.moe_overhead * self.moe_floor(num_tokens),
            "rest": self.rest_overhead * self.rest_floor(num_tokens) + self.layer_fixed_seconds,
        }

    def verify_seconds(self, num_tokens: int, context_len: int) -> float:
        """One target forward over T tokens at committed context S: all layers + lm_head."""
        _check_positive_int("num_tokens", num_tokens)
        _check_positive_int("context_len", context_len, allow_zero=True)
        layer = self.layer_seconds(num_tokens, context_len)
        moe_layers = self.num_layers - self.num_dense_layers
        return (moe_layers * sum(layer.values())
                + self.num_dense_layers * self.dense_layer_seconds(num_tokens, context_len, layer["attention"])
                + self.head_overhead * self.head_floor(num_tokens))

    def dense_layer_seconds(self, num_tokens: int, context_len: int, attention_seconds: float | None = None) -> float:
        """A dense layer (layer 0): attention + its projections + a dense MLP (no router/shared/routed)."""
        if attention_seconds is None:
            attention_seconds = self.attention_overhead * self.attention_floor(num_tokens, context_len)
        projections = self._floor(self.attention_params * BF16_BYTES, 2 * num_tokens * self.attention_params)
        return (attention_seconds + self.layer_fixed_seconds
                + self.rest_overhead * (projections + self.dense_mlp_floor(num_tokens)))

    def ar_step_seconds(self, context_len: int) -> float:
        """One autoregressive step: a T = 1 forward."""
        return self.verify_seconds(1, context_len)

    def draft_estimate_seconds(self, budget: int) -> float:
        """Draft time per round: the measured slot, else a byte estimate (drafter layers, fc, lm_head on
        the 15 draft positions: memory-bound, independent of the budget)."""
        del budget
        if self.draft_seconds is not None:
            return self.draft_seconds
        d = self.hidden
        layer = 4 * d * d + 3 * d * self.drafter_intermediate
        nbytes = (self.drafter_layers * layer + 5 * d * d + self.vocab * d) * BF16_BYTES
        return self.head_overhead * nbytes / self.bandwidth

    def round_seconds(self, budget: int, context_len: int) -> float:
        """One DDTree round: draft + verify(1 + budget) + fixed per-round work."""
        _check_positive_int("budget", budget)
        return (self.draft_estimate_seconds(budget) + self.verify_seconds(1 + budget, context_len)
                + self.round_fixed_seconds)

    def break_even_acceptance(self, budget: int, context_len: int) -> float:
        """Acceptance length above which this budget beats autoregressive decoding."""
        return self.round_seconds(budget, context_len) / self.ar_step_seconds(context_len)

    # ------------------------------------------------------------------------------- calibration
    def calibrated(self, rows) -> CostModel:
        """Overheads from slice-benchmark rows [{"T", "S", "attention_s", "moe_s", "rest_s"}, ...]
        (per-layer seconds measured with the grouped kernel): median of measured / floor per term."""
        rows = list(rows)
        if not rows:
            raise ValueError("calibrated() needs at least one slice-benchmark row")
        need = {"T", "S", "attention_s", "moe_s", "rest_s"}
        for row in rows:
            if not need <= set(row):
                raise ValueError(f"slice row {row!r} lacks {sorted(need - set(row))}")
        ratio = lambda key, floor: statistics.median(r[key] / floor(r) for r in rows)  # noqa: E731
        return dataclasses.replace(
            self,
            attention_overhead=ratio("attention_s", lambda r: self.attention_floor(r["T"], r["S"])),
            moe_overhead=ratio("moe_s", lambda r: self.moe_floor(r["T"], r.get("touched"))),
            rest_overhead=ratio("rest_s", lambda r: self.rest_floor(r["T"])),
        )


class BudgetEstimate(NamedTuple):
    budget: int  # 0 = plain autoregressive decoding
    acceptance: float  # tokens committed per round
    round_seconds: float
    tokens_per_second: float
    speedup: float  # over autoregressive decoding at the same context
    break_even: float  # acceptance length at which this budget ties autoregressive decoding


def _check_positive_int(name: str, value, *, allow_zero: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        raise ValueError(f"{name} must be an int >= {0 if allow_zero else 1}, got {value!r}")


def _check_profile(acceptance_profile: Mapping[int, float]) -> None:
    if not isinstance(acceptance_profile, Mapping) or not acceptance_profile:
        raise ValueError(f"acceptance_profile must be a non-empty mapping budget -> acceptance length, "
                         f"got {acceptance_profile!r}")
    for budget, tau in acceptance_profile.items():
        _check_positive_int("acceptance_profile budget", budget)
        if not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 1:
            raise ValueError(f"acceptance length for budget {budget} must be a finite number >= 1 "
                             f"(tokens committed per round), got {tau!r}")
        if tau > budget + 1:
            raise ValueError(f"acceptance length {tau} for budget {budget} exceeds 1 + budget "
                             f"(a round commits at most the root and every drafted node)")


def evaluate_budgets(context_len: int, acceptance_profile: Mapping[int, float],
                     cost_model: CostModel | None = None) -> list[BudgetEstimate]:
    """Autoregressive decoding (budget 0) and every profiled budget at this context, budget order."""
    _check_positive_int("context_len", context_len, allow_zero=True)
    _check_profile(acceptance_profile)
    model = cost_model or CostModel()
    ar = model.ar_step_seconds(context_len)
    out = [BudgetEstimate(0, 1.0, ar, 1.0 / ar, 1.0, 1.0)]
    for budget in sorted(acceptance_profile):
        tau = float(acceptance_profile[budget])
        rnd = model.round_seconds(budget, context_len)
        out.append(BudgetEstimate(budget, tau, rnd, tau / rnd, tau * ar / rnd, rnd / ar))
    return out


def choose_tree_budget(context_len: int, acceptance_profile: Mapping[int, float],
                       cost_model: CostModel | None = None) -> int:
    """The profiled budget with the highest tokens/s at this committed context, or 0 (decode
    autoregressively) when none beats it. acceptance_profile: {budget: mean tokens committed per
    round}, measured for the drafter on the workload (e.g. from bench_decode). Ties go to the
    smaller budget (less work for the same speed)."""
    best = max(evaluate_budgets(context_len, acceptance_profile, cost_model),
               key=lambda e: (e.tokens_per_second, -e.budget))
    return best.budget


def saturating_profile(max_acceptance: float, half_budget: float,
                       budgets=(1, 2, 4, 8, 16, 32, 64, 128)) -> dict[int, float]:
    """An illustrative acceptance profile tau(B) = 1 + (max - 1) * B / (B + half_budget), capped at
    1 + B: acceptance grows with the budget and saturates (the DDTree paper, arXiv 2604.12989). For docs and
    tests; real advice should use a measured profile."""
    if not (math.isfinite(max_acceptance) and max_acceptance >= 1) or not half_budget > 0:
        raise ValueError(f"want max_acceptance >= 1 and half_budget > 0, got {max_acceptance}, {half_budget}")
    return {b: min(1.0 + b, 1.0 + (max_acceptance - 1.0) * b / (b + half_budget)) for b in budgets}
