"""The training scripts' step loop: a jitted train step compiles once, also when training starts from a loaded
checkpoint (the time budget calibrates on the first steps' time, so a second compile on step 2 cut
`train_drafter --init --time-budget-s 190` to 469 steps); the unlikelihood fine-tune's candidates, loss and INT4 round
trip (training/unlikelihood.py); `train_drafter`'s decode-view metric (the simulated greedy DFlash and DDTree
acceptance), its walk of the rounds and its arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from training.common import on_one_device
from training.train_target import make_optimizer, set_learning_rate


def _run_steps(params, opt_state, steps: int = 3):
    optimizer = make_optimizer(weight_decay=0.01)

    @jax.jit
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jnp.ones((2, 4), jnp.float32)
    for i in range(steps):
        params, opt_state, _ = step(params, set_learning_rate(opt_state, 1e-3 * (i + 1)), x)
    return step._cache_size()


@pytest.mark.parametrize("loaded", [True, False], ids=["loaded-params", "fresh-params"])
def test_train_step_compiles_once(loaded):
    params = {"w": jnp.ones((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
    if loaded:  # a checkpoint restored onto the device: committed leaves
        params = jax.device_put(params, jax.devices()[0])
    state = on_one_device((params, make_optimizer(weight_decay=0.01).init(params)))
    assert _run_steps(*state) == 1


def _cache_file(path, rows: int, width: int, fill: int, ev_fill: int):
    import numpy as np
    np.savez(path, seqs=np.full((rows, width), fill, np.int32), valid=np.full(rows, width, np.int32),
             temperature=np.zeros(rows, np.float32), ev_greedy_seqs=np.full((2, width), ev_fill, np.int32),
             ev_greedy_valid=np.full(2, width, np.int32), ev_sampled_seqs=np.full((2, width), ev_fill, np.int32),
             ev_sampled_valid=np.full(2, width, np.int32))
    return path


def test_several_data_caches_train_together(tmp_path):
    """`train_drafter --data-cache a b`: the training rows of both in order, the held-out sets of the first."""
    from training.train_drafter import load_caches
    events = []
    a = _cache_file(tmp_path / "a.npz", 3, 5, fill=1, ev_fill=7)
    b = _cache_file(tmp_path / "b.npz", 2, 5, fill=2, ev_fill=9)
    data = load_caches([a, b], lambda **kw: events.append(kw))
    assert data["seqs"][:, 0].tolist() == [1, 1, 1, 2, 2]
    assert len(data["valid"]) == len(data["temperature"]) == 5
    assert (data["ev_greedy_seqs"] == 7).all() and (data["ev_sampled_seqs"] == 7).all()
    assert [e["seqs"] for e in events] == [3, 2]


def test_several_data_caches_refuse_missing_or_mismatched(tmp_path):
    from training.train_drafter import load_caches
    a = _cache_file(tmp_path / "a.npz", 3, 5, fill=1, ev_fill=7)
    with pytest.raises(SystemExit, match="missing: .*nope.npz"):
        load_caches([a, tmp_path / "nope.npz"], lambda **kw: None)
    c = _cache_file(tmp_path / "c.npz", 2, 6, fill=2, ev_fill=9)
    with pytest.raises(SystemExit, match="different lengths"):
        load_caches([a, c], lambda **kw: None)


# ------------------------------------------------------------------------ unlikelihood fine-tune
def _repeat_candidates_loop(cont, n):
    """The sequence-level candidates by a Python loop over n-gram tuples."""
    import numpy as np

    out = np.zeros(cont.shape, bool)
    for b, row in enumerate(cont.tolist()):
        seen = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1: t + 1])
            out[b, t] = gram in seen
            seen.add(gram)
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_repeat_candidates_match_a_loop(n):
    import numpy as np

    from training.degeneracy import repeat_candidates

    cont = np.random.default_rng(n).integers(0, 3, (4, 24))  # 3 symbols: many repeats
    cont[0] = [5, 6, 7, 8] * 6  # one loop: every token from the second lap on repeats a 4-gram
    got = np.asarray(repeat_candidates(jnp.asarray(cont), n))
    np.testing.assert_array_equal(got, _repeat_candidates_loop(cont, n))
    if n == 4:
        assert not got[0, :7].any() and got[0, 7:].all()


def test_unlikelihood_loss_matches_float64():
    """-log(1 - p) over the candidates, from the model's own logits (kj.forward, checked against the float64
    reference elsewhere) in float64 NumPy."""
    import numpy as np
    from helpers import SMALL, random_params

    import kdtree_jax as kj
    from training.unlikelihood import unlikelihood_loss

    cfg = SMALL  # one dense and one MoE layer: every block kind, the least compile time
    params = random_params(cfg, seed=3)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (2, 11)), jnp.int32)  # prefix 5, continuation 6
    cand = np.zeros((2, 6), bool)
    cand[0, [1, 4]] = cand[1, 5] = True
    with jax.default_matmul_precision("highest"):
        got = float(unlikelihood_loss(params, cfg, tokens, jnp.asarray(cand), jnp.float32))
        logits = np.asarray(kj.forward(params, cfg, tokens[:, :-1]), np.float64)[:, -6:]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(np.take_along_axis(logp, np.asarray(tokens[:, -6:])[..., None], -1)[..., 0])
    want = -np.log(1 - p)[cand].sum() / cand.size
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_dequantize_params_round_trips_int4():
    """The INT4 checkpoint as a float tree: quantizing it again gives the same words and scales."""
    import numpy as np
    from helpers import SMALL, random_params

    import kdtree_jax as kj
    from pallas_kernels.int4 import Int4Weight
    from training.unlikelihood import dequantize_params

    q = kj.quantize(random_params(SMALL, seed=4), SMALL, policy="experts")
    dense = jax.jit(dequantize_params)(q)  # one compile instead of an eager dispatch per op
    again = kj.quantize(dense, SMALL, policy="experts")
    leaves = jax.tree.leaves(q, is_leaf=lambda x: isinstance(x, Int4Weight))
    redone = jax.tree.leaves(again, is_leaf=lambda x: isinstance(x, Int4Weight))
    int4 = [(a, b) for a, b in zip(leaves, redone, strict=True) if isinstance(a, Int4Weight)]
    assert int4 and not any(isinstance(x, Int4Weight) for x in jax.tree.leaves(
        dense, is_leaf=lambda x: isinstance(x, Int4Weight)))
    for a, b in int4:
        np.testing.assert_array_equal(np.asarray(a.qweight), np.asarray(b.qweight))
        np.testing.assert_array_equal(np.asarray(a.scale, np.float32), np.asarray(b.scale, np.float32))


@pytest.mark.parametrize("argv,message", [
    (["--steps", "1", "--cont-len", "0"], "--cont-len must be >= 1"),
    (["--steps", "1", "--ul-weight", "-1"], "--ul-weight must be >= 0"),
    (["--steps", "1", "--time-budget-s", "9"], "exactly one of --steps and --time-budget-s"),
])
def test_unlikelihood_cli_refuses_bad_arguments(argv, message, monkeypatch, capsys):
    import sys

    from training import unlikelihood

    monkeypatch.setattr(sys, "argv", ["unlikelihood", "--target", "unused", *argv])
    with pytest.raises(SystemExit) as exit_info:
        unlikelihood.main()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _training_logits_on_random_features(cfg, dcfg):
    """(drafter config, params) -> the training forward's logits over fixed random target features, tokens and
    anchors (two sequences of 12 tokens, two anchors each): a drafter grown from dcfg compared with dcfg itself."""
    from training.train_drafter import drafter_training_logits

    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    B, T, D = 2, 12, cfg.hidden_size
    hidden = jax.random.normal(k1, (B, T, dcfg.num_target_layers, D), jnp.float32)
    tokens = jax.random.randint(k2, (B, T), 4, cfg.vocab_size)
    anchors = jnp.asarray([[3, 7], [5, 8]], jnp.int32)
    embed = jax.random.normal(k3, (cfg.vocab_size, D), jnp.float32) * 0.02

    def logits(cfg_, params):
        return drafter_training_logits(params, cfg_, hidden, tokens, anchors, embed, embed.T)

    return logits


def test_grown_drafter_starts_as_the_same_function_and_trains():
    """train_drafter --grow-layers: the appended layers add nothing at step 0 (the logits equal the loaded drafter's),
    and the gradient reaches their zero output projections at once (so they train)."""
    import numpy as np

    import kdtree_jax as kj
    from training.train_drafter import grow_layers

    cfg = kj.ModelConfig.tiny()
    dcfg = kj.DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    dparams = kj.init_drafter_params(dcfg, jax.random.key(0))
    grown_cfg, grown = grow_layers(dcfg, dparams, 2, jax.random.key(1))
    assert grown_cfg.num_hidden_layers == 3 and grown_cfg.replace(num_hidden_layers=1) == dcfg
    assert set(grown) == set(dparams) | {"layers_1", "layers_2"}

    logits = _training_logits_on_random_features(cfg, dcfg)
    # the same function up to float32 rounding (XLA fuses the deeper program differently); without the zero
    # projections the logits would differ by O(1)
    np.testing.assert_allclose(np.asarray(logits(grown_cfg, grown)), np.asarray(logits(dcfg, dparams)),
                               rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda p: jnp.sum(logits(grown_cfg, p) ** 2))(grown)
    for i in (1, 2):
        assert float(jnp.abs(grads[f"layers_{i}"]["attn"]["o"]).max()) > 0
        assert float(jnp.abs(grads[f"layers_{i}"]["mlp"]["down"]).max()) > 0
    with pytest.raises(ValueError, match="extra must be >= 1"):
        grow_layers(dcfg, dparams, 0, jax.random.key(1))


def test_widened_drafter_starts_as_the_same_function_and_trains():
    """train_drafter --grow-width: the new SwiGLU units add nothing at step 0 (the logits equal the loaded drafter's,
    its own weights kept), and the gradient reaches their zero down rows at once (so they train)."""
    import numpy as np

    import kdtree_jax as kj
    from training.train_drafter import grow_width

    cfg = kj.ModelConfig.tiny()
    dcfg = kj.DrafterConfig.for_target(cfg, num_layers=2, block_size=4)
    dparams = kj.init_drafter_params(dcfg, jax.random.key(0))
    old = dcfg.intermediate_size
    wide_cfg, wide = grow_width(dcfg, dparams, 2 * old, jax.random.key(1))
    assert wide_cfg.intermediate_size == 2 * old and wide_cfg.replace(intermediate_size=old) == dcfg
    for i in range(2):
        mlp = wide[f"layers_{i}"]["mlp"]
        assert mlp["gate"].shape == (cfg.hidden_size, 2 * old) and mlp["down"].shape == (2 * old, cfg.hidden_size)
        kept = dparams[f"layers_{i}"]["mlp"]["gate"]
        np.testing.assert_array_equal(np.asarray(mlp["gate"][:, :old]), np.asarray(kept))
        assert float(jnp.abs(mlp["gate"][:, old:]).max()) > 0 and float(jnp.abs(mlp["down"][old:]).max()) == 0

    logits = _training_logits_on_random_features(cfg, dcfg)
    np.testing.assert_allclose(np.asarray(logits(wide_cfg, wide)), np.asarray(logits(dcfg, dparams)),
                               rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda p: jnp.sum(logits(wide_cfg, p) ** 2))(wide)
    for i in range(2):
        assert float(jnp.abs(grads[f"layers_{i}"]["mlp"]["down"][old:]).max()) > 0
    with pytest.raises(ValueError, match="width must exceed"):
        grow_width(dcfg, dparams, old, jax.random.key(1))


@pytest.mark.parametrize("flag", ["--grow-layers", "--grow-width"])
def test_growing_needs_init(monkeypatch, capsys, flag):
    import sys

    from training import train_drafter

    monkeypatch.setattr(sys, "argv", ["train_drafter", "--target", "unused", "--steps", "1", flag, "2"])
    with pytest.raises(SystemExit) as exit_info:
        train_drafter.main()
    assert exit_info.value.code == 2 and f"{flag} needs --init" in capsys.readouterr().err


def test_distill_weight_out_of_range_is_refused(monkeypatch, capsys):
    import sys

    from training import train_drafter

    monkeypatch.setattr(sys, "argv", ["train_drafter", "--target", "unused", "--steps", "1", "--distill", "1.5"])
    with pytest.raises(SystemExit) as exit_info:
        train_drafter.main()
    assert exit_info.value.code == 2 and "--distill must be in [0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--anchor-horizon", "-1"], "--anchor-horizon must be 0 (off) or a token count"),
    (["--decode-horizon", "1"], "--decode-horizon must be 0 (off) or at least 2"),
    (["--decode-horizon", "-5"], "--decode-horizon must be 0 (off) or at least 2"),
    (["--decode-budget", "0"], "--decode-budget must be in [1, 1024]"),
])
def test_decode_view_arguments_out_of_range_are_refused(argv, message, monkeypatch, capsys):
    import sys

    from training import train_drafter

    monkeypatch.setattr(sys, "argv", ["train_drafter", "--target", "unused", "--steps", "1", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train_drafter.main()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_anchor_horizon_keeps_the_anchors_among_the_first_new_tokens():
    import numpy as np

    from training.train_drafter import sample_anchors
    valid = np.array([40, 40, 12], np.int32)  # prompt 8: 32, 32 and 4 new tokens
    everywhere = sample_anchors(np.random.default_rng(0), valid, 8, 4000)
    assert everywhere[:2].min() == 8 and everywhere[:2].max() == 38 and everywhere[2].max() == 10
    early = sample_anchors(np.random.default_rng(0), valid, 8, 4000, horizon=16)
    assert early[:2].min() == 8 and early[:2].max() == 8 + 15  # the first 16 new tokens
    assert early[2].max() == 10  # a continuation shorter than the horizon keeps its own limit


def _write_log(path, records):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_plot_logs_draws_every_run_and_refuses_a_metric_a_run_never_logged(tmp_path):
    """training.plot_logs: one panel a metric, one line a run; a metric missing from one run's log is a clear error
    (before matplotlib is needed), as is a --run without LABEL=LOG."""
    from training import plot_logs

    a = _write_log(tmp_path / "a.jsonl", [{"step": 0, "m": 1.0}, {"step": 10, "m": 1.5, "other": 2.0}])
    b = _write_log(tmp_path / "b.jsonl", [{"step": 0, "other": 1.0}])
    with pytest.raises(ValueError, match=r"run 'b' .* never logged \['m'\]"):
        plot_logs.plot_runs({"a": a, "b": b}, ["m"], tmp_path / "x.png", "t")
    with pytest.raises(SystemExit, match="expected LABEL=LOG"):
        plot_logs.main(["--run", str(a), "--keys", "m", "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="no file"):
        plot_logs.main(["--run", f"a={tmp_path / 'none.jsonl'}", "--keys", "m", "--out", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig" / "runs.png"
    plot_logs.main(["--run", f"a={a}", "--run", f"b={b}", "--keys", "other", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_expert_loads_count_the_routing_of_the_normed_moe_input():
    """lm_loss_and_loads (the router-bias update's input) counts each MoE layer's experts as the model routes them:
    route(rms_norm(h, post_attn_norm)), recomputed here from the MoE's own call. A count from the un-normed residual
    stream h (what the MoE receives since it applies its norm itself) gives other loads, so this test tells them
    apart."""
    import flax.linen as nn
    import numpy as np
    from helpers import TINY, random_params

    from kdtree_jax.layers import rms_norm
    from kdtree_jax.model import MoE, route
    from training.train_target import causal_logits, lm_loss_and_loads

    cfg = TINY
    params = random_params(cfg, seed=7)
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, cfg.vocab_size, (2, 9)), jnp.int32)
    _, loads = lm_loss_and_loads(params, cfg, tokens)
    normed, raw = [], []

    def count(x, p):
        idx, _ = route(cfg, x.reshape(-1, cfg.hidden_size), p["router"], p["router_bias"])
        return jnp.zeros(cfg.n_routed_experts).at[idx.ravel()].add(1.0) / idx.size

    def spy(next_fun, args, kwargs, context):
        if isinstance(context.module, MoE) and context.method_name == "__call__":
            p = context.module.variables["params"]
            normed.append(count(rms_norm(args[0], args[1], cfg.rms_norm_eps), p))
            raw.append(count(args[0], p))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        causal_logits(params, cfg, tokens[:, :-1])
    assert loads.shape == (cfg.num_hidden_layers - cfg.first_k_dense_replace, cfg.n_routed_experts)
    np.testing.assert_allclose(loads, np.stack(normed), atol=1e-7)
    assert not np.allclose(loads, np.stack(raw))


def test_simulated_acceptance_walks_the_rounds():
    """A round at a bonus token j new tokens in commits min(lead + 1, horizon - 1 - j) tokens, the next bonus among
    them: the walk the decode loop makes (tests/test_shipped_model.py checks the loop against it)."""
    import numpy as np

    from training.train_drafter import simulated_acceptance
    leads = np.array([[2, 9, 9, 0, 1, 9, 9, 9],   # rounds at 0 (3 tokens), 3 (1), 4 (2), 6 (1, cut at 7): 7 / 4
                      [6, 9, 9, 9, 9, 9, 9, 9]])  # round at 0: 7 tokens, then done: 7 / 1
    assert simulated_acceptance(leads, 8) == 14 / 5
    assert simulated_acceptance(leads[:, :3], 4) == 6 / 2  # each row one round, cut at 3 tokens
    with pytest.raises(ValueError, match="horizon"):
        simulated_acceptance(leads, 10)  # needs 9 columns
    with pytest.raises(ValueError, match="horizon"):
        simulated_acceptance(leads, 1)


def test_train_drafter_logs_the_decode_view(tmp_path, monkeypatch):
    """A short `train_drafter` run over a tiny target logs heldout_greedy_{dflash,ddtree}_acceptance at every
    evaluation: the simulated greedy acceptance over the first --decode-horizon new tokens of the greedy held-out
    rows (DDTree at --decode-budget)."""
    import json
    import sys

    import numpy as np
    from helpers import TINY

    import kdtree_jax as kj
    from training import train_drafter

    params = kj.init_params(TINY, jax.random.key(0), dtype=jnp.float32)
    kj.save_checkpoint(tmp_path / "target", TINY, params)
    rng = np.random.default_rng(0)
    width = 8 + 16  # --prompt-len 8, --new-tokens 16
    seqs = lambda n: rng.integers(4, TINY.vocab_size, (n, width)).astype(np.int32)  # noqa: E731
    np.savez(tmp_path / "data.npz", seqs=seqs(8), valid=np.full(8, width, np.int32),
             temperature=np.zeros(8, np.float32), ev_greedy_seqs=seqs(4),
             ev_greedy_valid=np.array([width, width, width, 12], np.int32), ev_sampled_seqs=seqs(4),
             ev_sampled_valid=np.full(4, width, np.int32))
    out = tmp_path / "out"
    monkeypatch.setattr(train_drafter, "plot_curves", lambda *args, **kwargs: None)  # matplotlib: the train extra
    monkeypatch.setattr(sys, "argv", [
        "train_drafter", "--target", str(tmp_path / "target"), "--data-cache", str(tmp_path / "data.npz"),
        "--steps", "2", "--eval-every", "1", "--batch", "4", "--anchors", "2", "--block-size", "4", "--layers", "1",
        "--width", "32", "--target-layers", "2", "--prompt-len", "8", "--new-tokens", "16", "--decode-horizon", "12",
        "--decode-budget", "5", "--compute-dtype", "float32", "--out", str(out)])
    train_drafter.main()
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    setup = [(r["horizon"], r["rows"], r["ddtree_budget"]) for r in records if r.get("event") == "decode_eval"]
    assert setup == [(12, 3, 5)]  # the held-out row that stopped at 12 tokens is left out
    for method in ("dflash", "ddtree"):
        key = f"heldout_greedy_{method}_acceptance"
        scored = [r[key] for r in records if key in r]
        assert len(scored) == 3 and all(1.0 <= a <= 4.0 for a in scored), scored  # steps 1, 2 and the final one
