"""Backward fusion refuses every transform whose update of one leaf reads other leaves' gradients.

The refusal is ``optfuse.NonSeparableError`` (a ``ValueError``), raised by
``optfuse.check_separable`` and when a backward step is first traced; its message names the
offending part of the chain and points to ``mode="off"`` (and ``mode="forward"``).
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from tests import criteria, models

LR = 1e-2

# name -> (transform factory, the name the error must give).
NON_SEPARABLE = {
    "clip_by_global_norm": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR)),
        "clip_by_global_norm"),
    "apply_if_finite": (lambda: optax.apply_if_finite(optax.adam(LR), 3), "apply_if_finite"),
    "normalize_by_update_norm": (optax.normalize_by_update_norm, "normalize_by_update_norm"),
    # lbfgs and polyak_sgd also need the loss (value, grad, value_fn); their cross-leaf inner
    # products and global gradient norm are found first.
    "lbfgs": (optax.lbfgs, "scale_by_lbfgs"),
    "polyak_sgd": (optax.polyak_sgd, "scale_by_polyak"),
    "prodigy": (optax.contrib.prodigy, "prodigy"),
    "dog": (optax.contrib.dog, "scale_by_dog"),
    # SAM itself only switches between two optimizers on a step counter (separable with a
    # per-leaf adversary, see test_backward_equivalence); the standard adversary normalizes the
    # gradient by its global norm, and that is the part named.
    "sam": (lambda: optax.contrib.sam(
        optax.sgd(LR), optax.chain(optax.contrib.normalize(), optax.sgd(0.05))), "normalize"),
    "dadapt_adamw": (optax.contrib.dadapt_adamw, "dadapt_adamw"),
    "mechanize": (lambda: optax.contrib.mechanize(optax.adam(LR)), "mechanize"),
    "momo": (optax.contrib.momo, "momo"),
    "momo_adam": (optax.contrib.momo_adam, "momo_adam"),
    "backtracking_linesearch": (
        lambda: optax.chain(optax.sgd(LR), optax.scale_by_backtracking_linesearch(5)),
        "scale_by_backtracking_linesearch"),
    # Reads only the loss value, no other leaf's gradient, but backward fusion has no loss to
    # pass to a single leaf's update.
    "reduce_on_plateau": (
        lambda: optax.chain(optax.adam(LR), optax.contrib.reduce_on_plateau()),
        "reduce_on_plateau"),
}

SEPARABLE = {
    "adam": lambda: optax.adam(LR),
    "adamw_callable_mask": lambda: optax.adamw(
        LR, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(LR, 0.0, 10), momentum=0.9),
    "muon": lambda: optax.contrib.muon(LR),
    "lamb": lambda: optax.lamb(LR),
    "clip_elementwise": lambda: optax.chain(optax.clip(0.1), optax.sgd(LR)),
}


def _params():
  return models.tied_lm_params()


@pytest.mark.parametrize("name", list(NON_SEPARABLE))
def test_check_separable_raises_naming_the_transform(name):
  make_tx, culprit = NON_SEPARABLE[name]
  with pytest.raises(optfuse.NonSeparableError, match=culprit) as info:
    optfuse.check_separable(make_tx(), _params())
  assert isinstance(info.value, ValueError)
  assert 'mode="off"' in str(info.value)


@pytest.mark.parametrize("name", list(NON_SEPARABLE))
def test_backward_step_raises_when_first_traced(name):
  make_tx, culprit = NON_SEPARABLE[name]
  fx = optfuse.fuse(make_tx(), mode="backward")
  params = _params()
  state = fx.init(params)
  step = jax.jit(fx.value_and_update(models.tied_lm_loss))
  with pytest.raises(optfuse.NonSeparableError, match=culprit):
    step(params, state, *models.tied_lm_batches(1)[0])


@pytest.mark.parametrize("name", ["clip_by_global_norm", "normalize_by_update_norm", "dog"])
def test_gradient_mixing_error_points_to_forward_and_off_modes(name):
  make_tx, _ = NON_SEPARABLE[name]
  with pytest.raises(optfuse.NonSeparableError) as info:
    optfuse.check_separable(make_tx(), _params())
  message = str(info.value)
  assert 'mode="forward"' in message and 'mode="off"' in message
  assert "['embed']" in message  # names the leaves whose gradients are mixed


def test_eager_backward_step_raises_too():
  fx = optfuse.fuse(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(LR)))
  params = _params()
  with pytest.raises(optfuse.NonSeparableError, match="clip_by_global_norm"):
    fx.value_and_update(models.tied_lm_loss)(params, fx.init(params),
                                             *models.tied_lm_batches(1)[0])


def test_state_that_a_gradient_turns_into_bools_is_refused():
  # zero_nans is per leaf, but its found_nan flags are bool state computed from the gradient,
  # and a custom_vjp backward rule can only return float cotangents.
  with pytest.raises(optfuse.NonSeparableError, match="found_nan"):
    optfuse.check_separable(optax.chain(optax.zero_nans(), optax.sgd(LR)), _params())


@pytest.mark.parametrize("name", list(SEPARABLE))
def test_check_separable_returns_none_for_separable_transforms(name):
  assert optfuse.check_separable(SEPARABLE[name](), _params()) is None


def test_check_separable_accepts_abstract_params():
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params())
  assert optfuse.check_separable(optax.adamw(LR), abstract) is None
  with pytest.raises(optfuse.NonSeparableError, match="clip_by_global_norm"):
    optfuse.check_separable(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(LR)), abstract)


def test_separability_is_decided_per_params_tree():
  # One leaf: the "global" norm is that leaf's own norm, so clipping is separable.
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(LR))
  assert optfuse.check_separable(tx, {"w": jnp.ones((3, 2))}) is None


def _linear_regression_loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@pytest.mark.parametrize("name",
                         ["clip_by_global_norm", "polyak_sgd", "lbfgs", "reduce_on_plateau"])
def test_off_mode_runs_what_backward_refuses_like_optax(name):
  # mode="off" passes value, grad and value_fn to a tx.update that requires them, so the
  # transforms that need the loss run too. A linear regression keeps lbfgs's line search cheap
  # to compile. Same float32 reasoning and tolerances as test_backward_equivalence.
  make_tx, _ = NON_SEPARABLE[name]
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros((2,))}
  x = jax.random.normal(k1, (5, 8, 4))
  batches = [(xi, xi @ jnp.ones((4, 2)) + 0.1 * ni) for xi, ni in
             zip(x, jax.random.normal(k2, (5, 8, 2)))]
  want = models.run_optax(make_tx(), params, batches, 50, loss_fn=_linear_regression_loss,
                          loss_args=True)
  got = models.run_fused(make_tx(), "off", params, batches, 50, loss_fn=_linear_regression_loss)
  chex.assert_trees_all_equal_structs(got, want)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert got[0][-1] < 0.5 * got[0][0]  # it trains


def _sgd_without_loss_args(learning_rate):
  """A third party's ``GradientTransformationExtraArgs`` whose update takes no loss: Python
  raises ``TypeError`` if it is given ``value``, ``grad`` or ``value_fn``, as plain optax code
  (``tx.update(grads, state, params)``) never gives them."""

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda g: -learning_rate * g, updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("mode", ["backward", "forward", "off"])
def test_every_mode_calls_an_update_that_takes_no_loss_as_optax_users_do(mode):
  params, batches = models.stacked_params(), models.tied_lm_batches()
  tx = _sgd_without_loss_args(LR)
  want = models.run_optax(tx, params, batches, 3, loss_fn=models.scanned_loss)
  got = models.run_fused(tx, mode, params, batches, 3, loss_fn=models.scanned_loss)
  # The losses of every step: forward mode's params and state hold an update still pending.
  criteria.assert_matches_optax(got[0], want[0])


def test_memory_report_compiles_the_optax_row_of_an_update_that_takes_no_loss():
  params, batch = models.stacked_params(), models.tied_lm_batches()[0]
  report = optfuse.memory_report(models.scanned_loss, _sgd_without_loss_args(LR), params, *batch)
  assert "off" not in report.unavailable
  assert report["off"]["peak_bytes"] > 0
