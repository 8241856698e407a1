"""The training scripts' step loop: a jitted train step compiles once, also when training starts from a loaded
checkpoint (the time budget calibrates on the first steps' time, so a second compile on step 2 cut
`train_drafter --init --time-budget-s 190` to 469 steps)."""

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
