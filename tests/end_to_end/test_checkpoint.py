"""Checkpoints and mode switches: a resumed or switched run continues optax's trajectory."""

import chex
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import optfuse
from tests import criteria, models

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 60)


def separable():
  return optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=1e-2)


def clipped():
  return optax.chain(optax.clip_by_global_norm(0.5), separable())


# (tx, fuse keyword arguments): every mode, and backward mode with a global transform.
MODES = {
    "off": (clipped, dict(mode="off")),
    "backward": (separable, dict(mode="backward")),
    "backward+two_pass": (clipped, dict(mode="backward", global_ops="two_pass")),
    "forward": (clipped, dict(mode="forward")),
}


def jitted_step(fx):
  return jax.jit(fx.value_and_update(models.tied_lm_loss), donate_argnums=(0, 1))


def run(step, params, state, batches, start, steps):
  """Steps ``start .. start + steps - 1`` of ``step``."""
  losses = []
  for t in range(start, start + steps):
    loss, params, state = step(params, state, *batches[t % len(batches)])
    losses.append(loss)
  return losses, params, state


def injected_state(opt_state):
  """The ``inject_hyperparams`` state inside ``opt_state`` (alone or after a clip)."""
  return opt_state if hasattr(opt_state, "hyperparams") else opt_state[-1]


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m == "forward" else m
                                  for m in MODES])
def test_orbax_resume_mid_run_continues_the_same_trajectory(name, tmp_path):
  make_tx, kwargs = MODES[name]
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  fx = optfuse.fuse(make_tx(), **kwargs)
  step = jitted_step(fx)
  straight = run(step, models.copy(params), fx.init(models.copy(params)), batches, 0, 12)

  first, params_6, state_6 = run(step, models.copy(params), fx.init(models.copy(params)),
                                 batches, 0, 6)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "step_6", (params_6, state_6))
    checkpointer.wait_until_finished()
    del params_6, state_6
    abstract = jax.eval_shape(lambda p: (p, fx.init(p)), params)
    restored = checkpointer.restore(tmp_path / "step_6", abstract)
  fx = optfuse.fuse(make_tx(), **kwargs)  # as a new process would, after a restart
  second, params_12, state_12 = run(jitted_step(fx), *restored, batches, 6, 6)

  # The same compiled step on the same values: bit for bit the same run.
  chex.assert_trees_all_equal((first + second, params_12, state_12), straight)
  _, opt_state = optfuse.to_optax_state(fx, params_12, state_12)
  assert int(injected_state(opt_state).count) == 12


@pytest.mark.parametrize("tx, backward", [
    (separable, dict(mode="backward")),
    pytest.param(clipped, dict(mode="backward", global_ops="two_pass"), marks=pytest.mark.slow),
], ids=["adamw", "clip+adamw two_pass"])
def test_switching_off_backward_forward_off_follows_optax(tx, backward):
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  expected_losses, expected_params, expected_state = models.run_optax(tx(), params, batches, 52)
  fxs = [optfuse.fuse(tx(), mode="off"), optfuse.fuse(tx(), **backward),
         optfuse.fuse(tx(), mode="forward"), optfuse.fuse(tx(), mode="off")]
  params = models.copy(params)
  opt_state, losses = tx().init(params), []
  for k, fx in enumerate(fxs):
    state = optfuse.from_optax_state(fx, params, opt_state)
    segment, params, state = run(jitted_step(fx), params, state, batches, 13 * k, 13)
    losses += segment
    params, opt_state = optfuse.to_optax_state(fx, params, state)  # flushes in forward mode
  chex.assert_trees_all_close((jnp.stack(losses), params, opt_state),
                              (expected_losses, expected_params, expected_state),
                              **criteria.F32_FLOOR)
  injected = injected_state(opt_state)
  assert int(injected.count) == 52
  assert float(injected.hyperparams["learning_rate"]) == pytest.approx(float(SCHEDULE(51)))
