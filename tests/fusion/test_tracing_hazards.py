"""Steps traced the ways JAX may trace them train like optax.

A fused step's backward rules (the taps', the fused scans' loops) are traced when JAX chooses:
once per trace of the step, again under ``jax.checkpoint``, inside a jaxpr built before the
``jax.jit`` that runs it, and by the newer ``custom_vjp`` (``jax_custom_vjp3``) at transpose
time. What a rule learns while it is traced travels to the step as values (``_tap``,
``_fused_scan``), so each of these traces pairs a rule with its own forward pass; a side channel
written in one trace and read in another would update with the wrong structure, or give a leaf
whose rule ran a zero-gradient update. The models read a tied weight twice, hold a leaf the loss
never reads, stack layers for a fused loop, and stop the gradient of a whole fused scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._fusion import _tap
from tests import criteria, models

pytestmark = [pytest.mark.equivalence, pytest.mark.jax_upgrades]

STEPS = 3


def _stopped_scan_loss(params, tokens, targets):
  """A fused scan whose outputs reach the loss only through ``stop_gradient``: its stacked
  leaves get optax's zero-gradient update (AdamW still decays them)."""
  body = lambda h, layer: (h + jnp.tanh(h @ layer["w"] + layer["b"]), None)
  h0 = params["embed"][tokens]
  h, _ = jax.lax.scan(body, h0, params["layers"])
  h = h0 + jax.lax.stop_gradient(h)
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], targets).mean()


def _twice_scanned_loss(params, tokens, targets):
  """One stacked leaf read by two scans (tapped: a fused loop updates a leaf one scan reads)."""
  body = lambda h, layer: (h + jnp.tanh(h @ layer["w"] + layer["b"]), None)
  h, _ = jax.lax.scan(body, params["embed"][tokens], params["layers"])
  h, _ = jax.lax.scan(body, h, params["layers"], reverse=True)
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], targets).mean()


MODELS = {
    "tied_and_unused": (models.tied_lm_params, models.tied_lm_loss),
    "scanned": (models.stacked_params, models.scanned_loss),
    "stopped_scan": (models.stacked_params, _stopped_scan_loss),
    "twice_scanned": (models.stacked_params, _twice_scanned_loss),
}

OPTIMIZERS = {
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), {}),
    "two_pass_clip_adamw": (lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                                optax.adamw(1e-2, weight_decay=0.1)),
                            {"global_ops": "two_pass"}),
}


def _lowered_twice(step, params, state, batch):
  """Two traces of one step (two ``jax.jit`` wrappers); the second one's program runs."""
  jax.jit(lambda *a: step(*a)).lower(params, state, *batch)
  return jax.jit(lambda *a: step(*a)).lower(params, state, *batch).compile()


def _jaxpr_then_jit(step, params, state, batch):
  """A jaxpr of the step first (as ``describe`` and the memory guard trace it), then its jit."""
  jax.make_jaxpr(step)(params, state, *batch)
  jax.eval_shape(step, params, state, *batch)
  return jax.jit(step)


def _checkpointed(step, params, state, batch):
  """The whole step under ``jax.checkpoint``."""
  del params, state, batch
  return jax.jit(jax.checkpoint(step))


HAZARDS = {
    "lowered_twice": _lowered_twice,
    "jaxpr_then_jit": _jaxpr_then_jit,
    "checkpointed_step": _checkpointed,
}


def _run(compiled_for, step, params, state, batches):
  """``STEPS`` steps of the program ``compiled_for`` builds from ``step``, against the first
  batch's inputs."""
  run = compiled_for(step, params, state, batches[0])
  losses = []
  for t in range(STEPS):
    loss, params, state = run(params, state, *batches[t % len(batches)])
    losses.append(loss)
  return jnp.stack(losses), params, state


def _check(optimizer: str, model: str, compiled_for, loss_wrap=lambda f: f):
  make_tx, options = OPTIMIZERS[optimizer]
  make_params, loss_fn = MODELS[model]
  loss_fn = loss_wrap(loss_fn)
  params, batches = make_params(), models.tied_lm_batches()
  expected = models.run_optax(make_tx(), params, batches, STEPS, loss_fn=loss_fn)
  fx = optfuse.fuse(make_tx(), mode="backward", **options)
  got = _run(compiled_for, fx.value_and_update(loss_fn), params, fx.init(params), batches)
  criteria.assert_matches_optax(got, expected)


@pytest.mark.parametrize("hazard", sorted(HAZARDS))
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_step_traced_again_or_under_checkpoint_matches_optax(optimizer, model, hazard):
  _check(optimizer, model, HAZARDS[hazard])


def _checkpointed_loss_cases():
  """Every optimizer and model; one-pass fuses the scans inside the checkpoint (two-pass taps
  their leaves instead), which JAX 0.10's custom_vjp3 cannot transpose."""
  for optimizer in sorted(OPTIMIZERS):
    for model in sorted(MODELS):
      fused = optimizer == "adamw" and model in ("scanned", "stopped_scan")
      yield pytest.param(optimizer, model,
                         marks=[models.CUSTOM_VJP3_REMAT_BUG] if fused else [])


@pytest.mark.parametrize(("optimizer", "model"), _checkpointed_loss_cases())
def test_a_checkpointed_loss_traced_twice_matches_optax(optimizer, model):
  _check(optimizer, model, _lowered_twice, loss_wrap=jax.checkpoint)


@pytest.fixture
def custom_vjp3():
  """``jax_custom_vjp3`` on: each custom_vjp is staged as a hi-primitive whose backward rule is
  called when it is transposed (every custom_vjp optfuse makes is made inside the step)."""
  before = jax.config.jax_custom_vjp3
  jax.config.update("jax_custom_vjp3", True)
  yield
  jax.config.update("jax_custom_vjp3", before)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_step_under_custom_vjp3_traced_twice_matches_optax(custom_vjp3, optimizer, model):
  del custom_vjp3
  _check(optimizer, model, _lowered_twice)


# The helpers that keep the rules paired with their pass.


def test_a_tap_rule_runs_with_a_zero_gradient_when_the_loss_does_not_read_its_leaf():
  tap = _tap.make_tap(lambda grad, param, operands: (grad + 2.0, None))

  def loss(p):
    q, marker = tap(p, ())
    return jnp.sum(jax.lax.stop_gradient(q)), marker

  (value, marker), pullback = jax.vjp(loss, jnp.ones(3))
  (new,) = pullback((jnp.ones_like(value), _tap.seeds(marker)))
  assert new.tolist() == [2.0, 2.0, 2.0]


def test_a_leaf_without_a_rule_raises_instead_of_keeping_zeros():
  _tap.check_ruled([0, 1, 2], {(0,): None, (1, 2): None})
  with pytest.raises(optfuse.TracingError, match=r"\[2\]"):
    _tap.check_ruled([0, 1, 2], {(0,): None, (1,): None})


def test_two_pass_phase_is_read_only_inside_its_pass_by_every_rule():
  phase = _tap.TwoPassPhase()
  with pytest.raises(optfuse.TracingError, match="outside"):
    phase.read((0,))
  with phase.pass_(True, [], [0, 1]):
    assert phase.read((0, 1)) == (True, [])
  with pytest.raises(optfuse.TracingError, match=r"\[1\].*update pass"):
    with phase.pass_(False, ["cut"], [0, 1]):
      assert phase.read((0,)) == (False, ["cut"])
