"""Tree-budget cost model and advice (benchmarks/cost_model.py): floors against hand arithmetic, monotonicity,
break-even, the choice rule, calibration, and bad inputs."""

import math

import pytest

from benchmarks.cost_model import CostModel, choose_tree_budget, evaluate_budgets, saturating_profile

K26 = CostModel()


def test_floors_match_hand_arithmetic_at_k26_width():
    # One expert: 3 projections of 7168 x 2048 at 0.5 byte + a bf16 scale per 32 weights.
    assert K26.expert_bytes == pytest.approx(3 * 7168 * 2048 * 0.5625)
    assert K26.expert_bytes / 1e6 == pytest.approx(24.77, abs=0.01)
    # Touched experts (docs/kernels.md): T=8: ~60, T=32: ~188, T=129: ~359.
    assert K26.touched_experts(1) == pytest.approx(8.0)
    for t, want in ((8, 60), (32, 188), (129, 359)):
        assert abs(K26.touched_experts(t) - want) < 1.5
    # MLA attention floors (docs/kernels.md): S=32768 T=1 ~11 us (memory); S=4096 T=33 ~23 us; S=4096 T=129 ~92 us.
    assert K26.attention_floor(1, 32768) * 1e6 == pytest.approx(11.2, abs=0.5)  # 37.7 MB / 3.37 TB/s
    assert K26.attention_floor(33, 4096) * 1e6 == pytest.approx(2 * 64 * 33 * 4129 * 1088 / 823e6, rel=1e-9)
    assert 20 < K26.attention_floor(33, 4096) * 1e6 < 30
    assert 85 < K26.attention_floor(129, 4096) * 1e6 < 105
    # MoE floor at T=1: 8 experts' bytes.
    assert K26.moe_floor(1) == pytest.approx(8 * K26.expert_bytes / 3.37e12)


def test_costs_are_monotone():
    ts = [1, 2, 5, 9, 17, 33, 65, 129, 257]
    for s in (0, 4096, 32768):
        v = [K26.verify_seconds(t, s) for t in ts]
        assert all(a < b for a, b in zip(v, v[1:], strict=False))
    for t in (1, 33, 129):
        v = [K26.verify_seconds(t, s) for s in (0, 1024, 4096, 32768, 131072)]
        assert all(a < b for a, b in zip(v, v[1:], strict=False))
    touched = [K26.touched_experts(t) for t in ts]
    assert all(a < b for a, b in zip(touched, touched[1:], strict=False))
    assert all(x <= min(K26.num_experts, t * K26.top_k) + 1e-9 for x, t in zip(touched, ts, strict=True))
    # Break-even acceptance grows with the budget.
    be = [K26.break_even_acceptance(b, 4096) for b in (1, 4, 16, 64, 128)]
    assert all(1 < a < b for a, b in zip(be, be[1:], strict=False))


def test_break_even_is_where_speedup_is_one():
    for budget, s in ((8, 4096), (32, 32768), (128, 1024)):
        tau = K26.break_even_acceptance(budget, s)
        est = {e.budget: e for e in evaluate_budgets(s, {budget: min(tau, budget + 1.0)})}[budget]
        if tau <= budget + 1:
            assert est.speedup == pytest.approx(1.0)
            assert est.break_even == pytest.approx(tau)
        # Just above break-even the budget is chosen; just below, autoregressive decoding.
        if tau * 1.01 <= budget + 1:
            assert choose_tree_budget(s, {budget: tau * 1.01}) == budget
        assert choose_tree_budget(s, {budget: max(1.0, tau * 0.99)}) == 0


def test_choice_follows_acceptance_and_context():
    cheap = CostModel(draft_seconds=0.0)
    low = saturating_profile(1.5, 8.0)
    high = {b: 1.0 + 0.95 * b for b in (1, 2, 4, 8, 16, 32, 64, 128)}  # near-perfect drafter
    assert choose_tree_budget(4096, low) == 0
    b_high = choose_tree_budget(4096, high, cheap)
    assert b_high >= 32
    # A longer context makes big trees dearer (attention grows with T * S): the choice never grows.
    choices = [choose_tree_budget(s, high, cheap) for s in (1024, 8192, 65536, 262144)]
    assert all(a >= b for a, b in zip(choices, choices[1:], strict=False))
    # Ties go to the smaller budget.
    same = {4: 3.0, 8: 3.0}
    flat = CostModel(draft_seconds=0.0, moe_overhead=0.0, attention_overhead=0.0, rest_overhead=0.0,
                     head_overhead=0.0, layer_fixed_seconds=1e-4)  # every round costs the same
    assert choose_tree_budget(4096, same, flat) == 4


def test_calibration_recovers_overheads():
    truth = CostModel(attention_overhead=1.7, moe_overhead=1.25, rest_overhead=1.4)
    rows = []
    for t in (1, 9, 33, 65, 129):
        for s in (4096, 32768):
            layer = truth.layer_seconds(t, s)
            rows.append({"T": t, "S": s, "attention_s": layer["attention"], "moe_s": layer["moe"],
                         "rest_s": layer["rest"]})
    got = CostModel().calibrated(rows)
    assert got.attention_overhead == pytest.approx(1.7)
    assert got.moe_overhead == pytest.approx(1.25)
    assert got.rest_overhead == pytest.approx(1.4)
    with pytest.raises(ValueError, match="lacks"):
        CostModel().calibrated([{"T": 1, "S": 1}])
    with pytest.raises(ValueError, match="at least one"):
        CostModel().calibrated([])


def test_bad_inputs_raise_clearly():
    with pytest.raises(ValueError, match="non-empty mapping"):
        choose_tree_budget(4096, {})
    with pytest.raises(ValueError, match="finite number >= 1"):
        choose_tree_budget(4096, {8: 0.5})
    with pytest.raises(ValueError, match="exceeds 1 \\+ budget"):
        choose_tree_budget(4096, {2: 4.0})
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        choose_tree_budget(4096, {0: 1.0})
    with pytest.raises(ValueError, match="context_len must be an int >= 0"):
        choose_tree_budget(-1, {4: 2.0})
    with pytest.raises(ValueError, match="CostModel.bandwidth"):
        CostModel(bandwidth=math.nan)
    with pytest.raises(ValueError, match="top_k"):
        CostModel(top_k=500)
    with pytest.raises(ValueError, match="max_acceptance"):
        saturating_profile(0.5, 4)


def test_measured_h200_matches_the_committed_slice_run():
    """CostModel.measured_h200() must be the calibration of benchmarks/results/k26_slice.json."""
    import json
    from pathlib import Path

    stored = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/k26_slice.json").read_text())
    assert stored["meta"]["device"] == "NVIDIA H200" and not stored["meta"]["tiny"]
    base = CostModel(bandwidth=stored["meta"]["copy_TBps"] * 1e12)
    calibrated = base.calibrated(stored["rows"])
    measured = CostModel.measured_h200()
    for name in ("attention_overhead", "moe_overhead", "rest_overhead"):
        assert getattr(measured, name) == pytest.approx(getattr(calibrated, name), abs=0.006), name
    assert measured.bandwidth == pytest.approx(base.bandwidth, rel=0.01)
    # what the docs state: at batch 1 on K2.6 with these kernels a tree pays only for a strong drafter
    # (a small one, budget 4), never for a weak one
    assert choose_tree_budget(4096, saturating_profile(10.0, 16.0), measured) == 4
    assert choose_tree_budget(4096, saturating_profile(3.0, 8.0), measured) == 0
