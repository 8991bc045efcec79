"""``optfuse.low_bit`` fused: every mode, microbatches, offload and checkpoints follow the unfused
low-bit transformation.

The low-bit rounding is the transformation's own, so fusion must change nothing: each fused run
is compared with the same ``low_bit`` transformation run by plain optax code. The stacked leaves
are quantized (``min_size=0``) and updated row by row inside the scans' loops, along axis 0
(``lax.scan`` over the stored stack) and axis 1 (a stack stored with the layer axis second).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from tests import models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

OPTIMIZERS = {
    "adamw_8bit": lambda: optfuse.low_bit(optax.adamw(1e-2, weight_decay=0.05), 8, min_size=0),
    "adamw_4bit": lambda: optfuse.low_bit(optax.adamw(1e-2, weight_decay=0.05), 4, min_size=0),
    "lion_8bit": lambda: optfuse.low_bit(optax.lion(1e-3), 8, min_size=0),
    "sgd_momentum_4bit": lambda: optfuse.low_bit(optax.sgd(1e-2, momentum=0.9), 4, min_size=0),
}


def axis1_loss(params, tokens, targets):
  """``scanned_loss`` with the stack stored layer axis second, moved first for the scan."""
  layers = {"w": jnp.moveaxis(params["layers"]["w"], 1, 0), "b": params["layers"]["b"]}
  return models.scanned_loss({**params, "layers": layers}, tokens, targets)


def _axis1_params():
  params = models.stacked_params(layers=6, dim=32)
  return {**params, "layers": {**params["layers"],
                               "w": jnp.moveaxis(params["layers"]["w"], 0, 1)}}


MODELS = {
    "axis0": lambda: (models.stacked_params(layers=6, dim=32), models.scanned_loss),
    "axis1": lambda: (_axis1_params(), axis1_loss),
}


def _fuse(tx, mode, **kwargs):
  if mode == "two_pass":
    return optfuse.fuse(tx, mode="backward", global_ops="two_pass", **kwargs)
  return optfuse.fuse(tx, mode=mode, **kwargs)


def _with_clipping(tx, mode):
  """Forward and two-pass exist for global transforms: clip the gradient before the low-bit
  update, as LLM training does."""
  return tx if mode in ("off", "backward") else optax.chain(optax.clip_by_global_norm(0.5), tx)


def _run(fx, loss, params, steps, microbatches=None):
  batches = models.tied_lm_batches()
  step = fx.value_and_update(loss, microbatches=microbatches)
  losses, p, s = models.run_steps(step, params, fx.init(models.copy(params)), batches, steps)
  return losses, fx.flush(p, s)[0] if hasattr(fx, "flush") else p


# One case a bit width and layout by default (Lion and SGD by default in the offload test); the
# rest with ``-m slow``.
DEFAULT = {("adamw_8bit", "axis0"), ("adamw_4bit", "axis1")}
CASES = [pytest.param(opt, model, mode, marks=() if (opt, model) in DEFAULT else pytest.mark.slow)
         for opt in sorted(OPTIMIZERS) for model in sorted(MODELS)
         for mode in ("off", "backward", "forward", "two_pass")]


@pytest.mark.parametrize("optimizer,model,mode", CASES)
def test_every_mode_trains_like_the_unfused_low_bit_transformation_over_20_steps(
    optimizer, model, mode):
  params, loss = MODELS[model]()
  tx = _with_clipping(OPTIMIZERS[optimizer](), mode)
  got = _run(_fuse(tx, mode), loss, params, 20)
  models.assert_same_low_bit_trajectory(got, _optax_reference(tx, loss, params, 20))


def _optax_reference(tx, loss, params, steps):
  """The plain optax run from ``params`` moved by ``ulps``, as ``(losses, params)``."""
  batches = models.tied_lm_batches()
  return lambda ulps: models.run_optax(tx, models.nudge(params, ulps), batches, steps,
                                       loss_fn=loss)[:2]


def test_the_trajectory_check_rejects_a_learning_rate_five_percent_off():
  # The check measures its own tolerance from the reference's spread: it must still see a
  # change of the update's math smaller than any bug of fusion would make.
  params, loss = MODELS["axis0"]()
  wrong = optfuse.low_bit(optax.adamw(1.05e-2, weight_decay=0.05), 8, min_size=0)
  got = _run(optfuse.fuse(wrong, mode="off"), loss, params, 20)
  with pytest.raises(AssertionError, match="beyond"):
    models.assert_same_low_bit_trajectory(
        got, _optax_reference(OPTIMIZERS["adamw_8bit"](), loss, params, 20))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_stacked_low_bit_slots_are_updated_row_by_row_in_the_loop(model):
  params, loss = MODELS[model]()
  where = optfuse.describe(OPTIMIZERS["adamw_8bit"](), loss, params, *models.tied_lm_batches()[0])
  assert where["['layers']['w']"] == "loop", where.table()
  # A bias stored (L, d) is a loop leaf along axis 0; its blocks run along d.
  assert where["['layers']['b']"] == "loop", where.table()


@pytest.mark.parametrize("mode", ["backward", "forward"])
def test_microbatches_with_low_bit_state_match_the_unfused_microbatched_step(mode):
  params, loss = MODELS["axis0"]()
  tx = _with_clipping(OPTIMIZERS["adamw_8bit"](), mode)
  got = _run(_fuse(tx, mode), loss, params, 10, microbatches=2)
  models.assert_same_low_bit_trajectory(got, lambda ulps: _run(
      optfuse.fuse(tx, mode="off"), loss, models.nudge(params, ulps), 10, microbatches=2))


# AdamW and the optimizer beyond it (Lion, SGD with momentum) in every mode with offloaded state.
@pytest.mark.parametrize("mode,optimizer", [
    ("backward", "adamw_8bit"), pytest.param("forward", "adamw_4bit", marks=pytest.mark.slow),
    ("off", "lion_8bit"), ("backward", "lion_8bit"),
    pytest.param("forward", "sgd_momentum_4bit", marks=pytest.mark.slow)])
def test_offloaded_codes_and_scales_live_on_the_host_and_train_like_the_unfused_transformation(
    mode, optimizer):
  params, loss = MODELS["axis0"]()
  tx = _with_clipping(OPTIMIZERS[optimizer](), mode)
  fx = _fuse(tx, mode, offload="state")
  state = fx.init(models.copy(params))
  slot = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optfuse.QuantizedSlot))
  quantized = [x for x in slot if isinstance(x, optfuse.QuantizedSlot)]
  assert quantized and {x.sharding.memory_kind for q in quantized for x in q} == {"pinned_host"}
  got = _run(fx, loss, params, 20)
  models.assert_same_low_bit_trajectory(got, _optax_reference(tx, loss, params, 20))


def test_orbax_resume_of_offloaded_low_bit_state_continues_the_same_trajectory(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params, loss = MODELS["axis0"]()
  batches = models.tied_lm_batches()
  fx = optfuse.fuse(OPTIMIZERS["adamw_8bit"](), offload="state")
  step = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1))
  straight = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                              batches, 8)
  p, s = models.copy(params), fx.init(models.copy(params))
  for t in range(4):
    _, p, s = step(p, s, *batches[t % len(batches)])
  p, s = models.orbax_round_trip(tmp_path / "step_4", (p, s),
                                 (params, fx.init(models.copy(params))))
  assert s[0].mu["layers"]["w"].codes.sharding.memory_kind == "pinned_host"
  for t in range(4, 8):
    _, p, s = step(p, s, *batches[t % len(batches)])
  # Restoring is exact: the resumed run is the straight run, bit for bit.
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, (p, s)),
                              jax.tree.map(np.asarray, straight[1:]))
