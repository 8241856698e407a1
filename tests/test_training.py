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
