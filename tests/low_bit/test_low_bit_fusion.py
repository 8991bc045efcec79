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
from tests import faults, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

# Ten steps: the reference's spread widens with the steps, and with gradient clipping its width
# reached 9.9e-3 of the params' movement at 20 steps, beyond the spread check's cap
# (models.SPREAD_CAP); at 10 steps at most 3.1e-3 (python -m tests.low_bit_margins).
STEPS = 10

# name -> (the transformation low_bit wraps, bits)
INNER = {
    "adamw_8bit": (lambda: optax.adamw(1e-2, weight_decay=0.05), 8),
    "adamw_4bit": (lambda: optax.adamw(1e-2, weight_decay=0.05), 4),
    "lion_8bit": (lambda: optax.lion(1e-3), 8),
    "sgd_momentum_4bit": (lambda: optax.sgd(1e-2, momentum=0.9), 4),
}


def low_bit_tx(name: str, fault=lambda tx: tx) -> optax.GradientTransformation:
  """The low-bit transformation ``name``, with ``fault`` (tests/faults.py) injected into the
  transformation it wraps: the codes then round the faulty moments as they would a fused bug's."""
  inner, bits = INNER[name]
  return optfuse.low_bit(fault(inner()), bits, min_size=0)


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
LAYER_AXIS = {"axis0": 0, "axis1": 1}


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
         for opt in sorted(INNER) for model in sorted(MODELS)
         for mode in ("off", "backward", "forward", "two_pass")]


@pytest.mark.parametrize("optimizer,model,mode", CASES)
def test_every_mode_trains_like_the_unfused_low_bit_transformation_over_10_steps(
    optimizer, model, mode):
  params, loss = MODELS[model]()
  tx = _with_clipping(low_bit_tx(optimizer), mode)
  got = _run(_fuse(tx, mode), loss, params, STEPS)
  models.assert_same_low_bit_trajectory(got, _optax_reference(tx, loss, params, STEPS),
                                        start=params)


def _optax_reference(tx, loss, params, steps):
  """The plain optax run from ``params`` moved by ``ulps``, as ``(losses, params)``."""
  batches = models.tied_lm_batches()
  return lambda ulps: models.run_optax(tx, models.nudge(params, ulps), batches, steps,
                                       loss_fn=loss)[:2]


def injected_faults(model: str) -> dict:
  """The errors of tests/faults.py, the skipped row one layer of the stacked kernel."""
  axis = LAYER_AXIS[model]
  return faults.faults(lambda path: path == "['layers']['w']", axis)


# Lion counts its steps but never reads the count, and SGD with momentum has none: a frozen
# count is no error there (the run must be the unfaulted one, bit for bit).
COUNT_UNREAD = {"lion_8bit", "sgd_momentum_4bit"}
FAULT_CASES = [pytest.param("adamw_8bit", "axis0"), pytest.param("adamw_4bit", "axis1"),
               pytest.param("lion_8bit", "axis0", marks=pytest.mark.slow),
               pytest.param("sgd_momentum_4bit", "axis0", marks=pytest.mark.slow)]


@pytest.mark.parametrize("optimizer,model", FAULT_CASES)
def test_the_trajectory_check_rejects_each_error_injected_into_the_backward_fused_step(
    optimizer, model):
  """A learning rate 1 % off, step counts not advanced, one layer's row not updated: each
  injected into the fused run only, inside the loop, and judged against the spread that passes
  the fused run (test_every_mode_trains_like_the_unfused_low_bit_transformation_over_10_steps)."""
  params, loss = MODELS[model]()
  spread = models.reference_spread(_optax_reference(low_bit_tx(optimizer), loss, params, STEPS),
                                   params)
  for name, fault in injected_faults(model).items():
    tx = low_bit_tx(optimizer, fault)
    where = optfuse.describe(tx, loss, params, *models.tied_lm_batches()[0])
    assert where["['layers']['w']"] == "loop", (name, where.table())
    got = _run(_fuse(tx, "backward"), loss, params, STEPS)
    if name == "count_frozen" and optimizer in COUNT_UNREAD:
      clean = _run(_fuse(low_bit_tx(optimizer), "backward"), loss, params, STEPS)
      chex.assert_trees_all_equal(got, clean)
      continue
    models.assert_rejected(got, spread, name)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_stacked_low_bit_slots_are_updated_row_by_row_in_the_loop(model):
  params, loss = MODELS[model]()
  where = optfuse.describe(low_bit_tx("adamw_8bit"), loss, params, *models.tied_lm_batches()[0])
  assert where["['layers']['w']"] == "loop", where.table()
  # A bias stored (L, d) is a loop leaf along axis 0; its blocks run along d.
  assert where["['layers']['b']"] == "loop", where.table()


def _microbatched_reference(tx, loss, params):
  """The unfused run over 2 microbatches from ``params`` moved by ``ulps``, as ``(losses,
  params)``."""
  return lambda ulps: _run(optfuse.fuse(tx, mode="off"), loss, models.nudge(params, ulps), STEPS,
                           microbatches=2)


@pytest.mark.parametrize("mode", ["backward", "forward"])
def test_microbatches_with_low_bit_state_match_the_unfused_microbatched_step(mode):
  params, loss = MODELS["axis0"]()
  tx = _with_clipping(low_bit_tx("adamw_8bit"), mode)
  got = _run(_fuse(tx, mode), loss, params, STEPS, microbatches=2)
  models.assert_same_low_bit_trajectory(got, _microbatched_reference(tx, loss, params),
                                        start=params)


@pytest.mark.parametrize("mode", ["backward", pytest.param("forward", marks=pytest.mark.slow)])
def test_the_microbatched_check_rejects_each_error_injected_into_the_fused_step(mode):
  """Each error of tests/faults.py injected into the fused run over 2 microbatches only (into
  the update of the mean gradient, after the loop over them), judged against the spread that
  passes the fused run
  (test_microbatches_with_low_bit_state_match_the_unfused_microbatched_step)."""
  params, loss = MODELS["axis0"]()
  reference = _microbatched_reference(_with_clipping(low_bit_tx("adamw_8bit"), mode), loss,
                                      params)
  spread = models.reference_spread(reference, params)
  for name, fault in injected_faults("axis0").items():
    tx = _with_clipping(low_bit_tx("adamw_8bit", fault), mode)
    got = _run(_fuse(tx, mode), loss, params, STEPS, microbatches=2)
    models.assert_rejected(got, spread, name)


# AdamW and the optimizer beyond it (Lion, SGD with momentum) in every mode with offloaded state.
@pytest.mark.parametrize("mode,optimizer", [
    ("backward", "adamw_8bit"), pytest.param("forward", "adamw_4bit", marks=pytest.mark.slow),
    ("off", "lion_8bit"), ("backward", "lion_8bit"),
    pytest.param("forward", "sgd_momentum_4bit", marks=pytest.mark.slow)])
def test_offloaded_codes_and_scales_live_on_the_host_and_train_like_the_unfused_transformation(
    mode, optimizer):
  params, loss = MODELS["axis0"]()
  tx = _with_clipping(low_bit_tx(optimizer), mode)
  fx = _fuse(tx, mode, offload="state")
  state = fx.init(models.copy(params))
  slot = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optfuse.QuantizedSlot))
  quantized = [x for x in slot if isinstance(x, optfuse.QuantizedSlot)]
  assert quantized and {x.sharding.memory_kind for q in quantized for x in q} == {"pinned_host"}
  got = _run(fx, loss, params, STEPS)
  models.assert_same_low_bit_trajectory(got, _optax_reference(tx, loss, params, STEPS),
                                        start=params)


def test_orbax_resume_of_offloaded_low_bit_state_continues_the_same_trajectory(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params, loss = MODELS["axis0"]()
  batches = models.tied_lm_batches()
  fx = optfuse.fuse(low_bit_tx("adamw_8bit"), offload="state")
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
