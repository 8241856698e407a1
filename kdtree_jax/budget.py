"""The tree sizes itself: `tree_budget="auto"` picks, every round and on device, the budget that maximises
expected committed tokens per unit of round cost (docs/ddtree.md, "Auto budget").

Each round the tree is built once at the largest candidate budget. The best-first builder orders nodes by
score, the cumulative draft log-prob of the node's path, which is the drafter's own probability that the
target accepts that whole path; the first n nodes are exactly the budget-n tree. So a budget-n round is
expected to commit

    E(n) = 1 + sum_{i <= n} exp(score_i)     (the bonus token, plus every node's chance of acceptance)

tokens per live row, and costs `cost(n)`: one round (draft, build, verify of 1 + n tokens, bookkeeping) in
any unit, e.g. AR steps. The round verifies with the budget maximising sum_rows E(n) / cost(n) among the
candidates, one compiled verify per candidate (`lax.switch`): a smaller tree then costs less on every
backend, dense or MoE (an MoE verify reads only the experts its tokens route to).

A round may also draft nothing: with `BudgetCosts.ar_cost` (the CPU's defaults have it) a round whose predecessor
expected fewer tokens per cost than one token per AR step skips the drafter and verifies only the bonus token,
an AR step (every PROBE_EVERY-th such round drafts again, to see whether drafting pays again). Where the drafter
cannot pay for itself (any pair on a CPU; the shipped pair at temperature 1 on the H200), `auto` then decodes
at close to AR's speed instead of below it.

The costs come from measurement: `default_costs` gives whole-`generate` timings of the shipped pair (rounds
per second against AR steps per second at the same temperature, greedy and sampled apart: benchmarks/results/
e2e_h200_b1_s14_drafter8c.json, e2e_h200_b8_s14.json, e2e_h200_b8_s11.json, e2e_cpu.json);
`kdtree_jax.calibrate_budget_costs` measures them for any model on the device at hand.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class BudgetCosts:
    """Candidate budgets (increasing) and the cost of one round at each (any positive unit; AR steps in
    the defaults). Static: part of the compiled program, like the budget itself."""

    budgets: tuple[int, ...]
    costs: tuple[float, ...]
    source: str = "given"
    # The cost, in the same unit, of a round that drafts nothing and verifies only the bonus token: an AR step.
    # Given, `auto` skips the draft whenever the last drafted round expected fewer tokens per cost than such a
    # round's one token (re-drafting every PROBE_EVERY rounds to look again); None: every round drafts.
    ar_cost: float | None = None

    def __post_init__(self):
        budgets, costs = tuple(self.budgets), tuple(self.costs)
        if not budgets or len(budgets) != len(costs):
            raise ValueError(f"BudgetCosts needs one cost per budget, got {len(budgets)} budgets and "
                             f"{len(costs)} costs")
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in budgets):
            raise ValueError(f"BudgetCosts.budgets must be integers >= 1, got {budgets}")
        if list(budgets) != sorted(set(budgets)):
            raise ValueError(f"BudgetCosts.budgets must be strictly increasing, got {budgets}")
        if any(not (float(c) > 0 and float(c) < float("inf")) for c in costs):
            raise ValueError(f"BudgetCosts.costs must be finite and > 0, got {costs}")
        if self.ar_cost is not None and not (float(self.ar_cost) > 0 and float(self.ar_cost) < float("inf")):
            raise ValueError(f"BudgetCosts.ar_cost must be None or finite and > 0, got {self.ar_cost!r}")
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "costs", tuple(float(c) for c in costs))
        object.__setattr__(self, "ar_cost", None if self.ar_cost is None else float(self.ar_cost))

    @property
    def max_budget(self) -> int:
        return self.budgets[-1]


# Round cost in AR steps of the shipped pair, (device kind, batch, sampled) -> {budget: cost}: the wall time of a
# generate call per round over its wall time per AR step at the same temperature. sampled=False: greedy; True:
# temperature 1 (used for every temperature > 0: a sampled round also samples every tree node and runs the
# acceptance walk on samples, and its cost grows faster with the budget than a greedy round's).
# H200, batch 1 greedy and temperature 1, batch 8 greedy: e2e_h200_b1_s14_drafter8c.json and e2e_h200_b8_s14.json
# (2026-12-03 13:30-13:45; the shipped pair, float32 precision highest, the engine's kernel choice and XLA flag;
# 8 prompts x 128 tokens, median of 3 calls, sampled points summed over 2 seeds). The candidates are 2^k - 1:
# such a budget verifies 2^k tokens (the bonus + n nodes) and measured faster than 2^k at every k (7 / 15 / 31
# against 8 / 16 / 32: +7.8 / +0.7 / +4.7%, e2e_h200_b1_s13.json). An AR step is 384 us at batch 1 and 493 us
# at batch 8. Batch 8 at temperature 1: e2e_h200_b8_s11.json (2026-12-02, budgets 8 / 16 / 32: the 2026-12-03 run
# at 7 / 15 / 31 ran out of time before those rows).
# CPU: e2e_cpu.json (2026-12-02, the shipped pair, 2-core machine, batch 1 and 8, greedy and temperature 1, 8
# prompts x 64 tokens). Candidates on a CPU stop at 16: no larger budget was the best fixed one in any setting of
# that run (nor of the 2026-12-01 run), and auto builds its tree at the largest candidate every round (at batch 8
# its rounds cost 4.28 AR steps against fixed budget 8's 3.72 with 64 as the largest candidate, e2e_cpu.json).
_MEASURED = {
    ("gpu", 1, False): {7: 1.74, 15: 2.03, 31: 2.28},
    ("gpu", 8, False): {7: 1.96, 15: 2.25, 31: 3.23},
    ("gpu", 1, True): {7: 1.64, 15: 1.86, 31: 2.05},
    ("gpu", 8, True): {8: 1.92, 16: 2.34, 32: 3.06},
    ("cpu", 1, False): {4: 3.74, 8: 4.06, 16: 5.35},
    ("cpu", 8, False): {4: 4.11, 8: 3.72, 16: 5.72},
    ("cpu", 1, True): {4: 2.99, 8: 3.88, 16: 5.88},
    ("cpu", 8, True): {4: 2.40, 8: 3.45, 16: 4.74},
}
_MEASURED_ON = {"gpu": "NVIDIA H200", "cpu": "a 2-core CPU"}
# BudgetCosts.ar_cost of the defaults, per platform: rounds may skip the draft where that was measured to help
# (CPU: e2e_cpu_auto_ar.json, 2026-12-02: auto 0.79-1.00x AR against 0.36-0.78x before); on a GPU it stays off
# until an H200 run measures it (bench_e2e.py --auto-skip-draft on).
SKIP_DRAFT_AR_COST: dict[str, float | None] = {"cpu": 1.0, "gpu": None}


def default_costs(batch: int, device=None, *, temperature: float = 0.0) -> BudgetCosts:
    """The measured costs of the shipped pair for this device's platform, the nearest measured batch (1 or 8)
    and the kind of decoding (greedy for temperature 0, sampled, measured at temperature 1, for any other). A
    different model or device has different costs: measure them with `kdtree_jax.calibrate_budget_costs` and
    pass `budget_costs=`."""
    platform = "gpu" if dispatch.is_gpu(device or dispatch.default_device()) else "cpu"
    measured_batch = min((1, 8), key=lambda b: abs(b - batch))
    sampled = temperature > 0
    table = _MEASURED[(platform, measured_batch, sampled)]
    budgets = tuple(sorted(table))
    kind = "temperature 1" if sampled else "greedy"
    return BudgetCosts(budgets, tuple(table[b] for b in budgets), ar_cost=SKIP_DRAFT_AR_COST[platform],
                       source=f"shipped pair on {_MEASURED_ON[platform]}, batch {measured_batch}, {kind}")


def expected_tokens(scores: jax.Array, live: jax.Array, budgets: tuple[int, ...]) -> jax.Array:
    """[len(budgets)] expected committed tokens of a round at each budget, summed over live rows.

    scores [B, 1 + max budget]: the best-first tree's node scores (root 0, unused slots -inf), live [B] bool."""
    p = jnp.exp(scores[:, 1:].astype(jnp.float32))  # [B, max budget]; exp(-inf) = 0 for unused slots
    cum = jnp.cumsum(p, axis=1)  # [B, max budget]: sum of the first n nodes' acceptance chances
    per_budget = jnp.stack([cum[:, b - 1] for b in budgets], axis=1) + 1.0  # [B, nb]
    return jnp.sum(jnp.where(live[:, None], per_budget, 0.0), axis=0)


def choose(scores: jax.Array, live: jax.Array, costs: BudgetCosts) -> jax.Array:
    """Index into costs.budgets of the budget with the most expected tokens per cost (ties: the smaller)."""
    return choose_with_rate(scores, live, costs)[0]


def choose_with_rate(scores: jax.Array, live: jax.Array, costs: BudgetCosts) -> tuple[jax.Array, jax.Array]:
    """`choose`, and the chosen budget's expected tokens per cost per live row (float32 []): what a drafted round
    is expected to give, against 1 / costs.ar_cost for a round that drafts nothing."""
    rate = expected_tokens(scores, live, costs.budgets) / jnp.asarray(costs.costs, jnp.float32)
    best = jnp.argmax(rate).astype(jnp.int32)
    return best, rate[best] / jnp.maximum(jnp.sum(live), 1).astype(jnp.float32)


# With BudgetCosts.ar_cost, rounds that skip the draft (it is what they save) cannot see whether drafting would
# pay again: every PROBE_EVERY-th consecutive such round drafts anyway, to refresh the estimate.
PROBE_EVERY = 8


def draft_pays(rate_per_row: jax.Array, rounds_since_draft: jax.Array, ar_cost: float) -> jax.Array:
    """Whether this round drafts: the last drafted round's expected tokens per cost per row beat an undrafted
    round's 1 / ar_cost, or PROBE_EVERY rounds went by without a draft. (Costs without an ar_cost always draft:
    the decode loop then compiles no undrafted branch.)"""
    return (rate_per_row * ar_cost > 1.0) | (rounds_since_draft >= PROBE_EVERY)


def rounds_per_budget(out) -> dict[int, int]:
    """{budget: rounds} of a speculative `generate` output: how many rounds verified each budget (0: rounds of
    `auto` that drafted nothing, AR steps)."""
    used: dict[int, int] = {}
    for b in np.asarray(out.tree_budgets)[: int(out.rounds)].tolist():
        used[b] = used.get(b, 0) + 1
    return dict(sorted(used.items()))
