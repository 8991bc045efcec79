"""Two-pass backward: global-norm clipping and other global transforms fused exactly."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from optfuse import _global, _plan
from tests import models

STEPS = 50
# float32: the fused step runs optax's arithmetic leaf by leaf, in the same order, in another XLA
# program. Measured after 50 steps on CPU: at most 7.2e-7 absolute; 1e-5 leaves a 10x margin.
TOL = dict(rtol=1e-5, atol=1e-5)

GLOBAL = {
    "clip_by_global_norm+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                                     optax.adamw(1e-2)),
    "apply_if_finite(clip+adamw)": lambda: optax.apply_if_finite(
        optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), max_consecutive_errors=3),
    "normalize_by_update_norm": lambda: optax.chain(optax.normalize_by_update_norm(1e-2),
                                                    optax.trace(0.9)),
}
NAN_STEPS = {4, 17, 18, 30}


def scaled_loss(params, tokens, targets, scale):
  """``tied_lm_loss`` times ``scale``: a NaN scale makes every gradient NaN."""
  return models.tied_lm_loss(params, tokens, targets) * scale


def batches_with_nans():
  return [(*batch, jnp.float32(np.nan if t in NAN_STEPS else 1.0))
          for t, batch in enumerate(models.tied_lm_batches(STEPS))]


def train(fx, params, batches, steps, loss_fn=scaled_loss, jit=True):
  """``steps`` steps of ``fx``, jitted with donation unless ``jit=False``."""
  return models.run_steps(fx.value_and_update(loss_fn), params, fx.init(params), batches, steps,
                          jit)


@pytest.mark.parametrize("name", GLOBAL)
def test_two_pass_backward_matches_optax_over_50_steps(name):
  tx = GLOBAL[name]()
  params, batches = models.tied_lm_params(), batches_with_nans()
  if "apply_if_finite" not in name:
    batches = [(*batch[:2], jnp.float32(1.0)) for batch in batches]
  expected = models.run_optax(tx, params, batches, STEPS, loss_fn=scaled_loss)
  got = train(optfuse.fuse(tx, mode="backward", global_ops="two_pass"), params, batches, STEPS)
  chex.assert_trees_all_close(got, expected, **TOL)  # NaN losses compare equal to NaN


def test_two_pass_backward_without_jit_matches_optax_over_50_steps():
  tx = GLOBAL["clip_by_global_norm+adamw"]()
  params, batches = models.mlp_params_and_batches()
  expected = models.run_optax(tx, params, batches, STEPS, loss_fn=models.mlp_loss, jit=False)
  got = train(optfuse.fuse(tx, mode="backward", global_ops="two_pass"), params, batches, STEPS,
              loss_fn=models.mlp_loss, jit=False)
  chex.assert_trees_all_close(got, expected, **TOL)


def test_two_pass_skips_nan_steps_like_optax():
  tx = GLOBAL["apply_if_finite(clip+adamw)"]()
  params, batches = models.tied_lm_params(), batches_with_nans()
  fx = optfuse.fuse(tx, mode="backward", global_ops="two_pass")
  losses, new_params, state = train(fx, params, batches, 19)
  assert int(state.total_notfinite) == 3 and int(state.notfinite_count) == 2
  # Two NaN steps in a row were skipped: the params moved only on the finite steps.
  _, after_17, _ = train(fx, params, batches, 17)
  chex.assert_trees_all_equal(new_params, after_17)


def test_backward_mode_without_the_opt_in_refuses_global_transforms():
  fx = optfuse.fuse(GLOBAL["clip_by_global_norm+adamw"](), mode="backward")
  params = models.tied_lm_params()
  step = fx.value_and_update(models.tied_lm_loss)
  with pytest.raises(optfuse.NonSeparableError,
                     match=r'clip_by_global_norm.*mode="forward".*global_ops="two_pass"'):
    step(params, fx.init(params), *models.tied_lm_batches()[0])


def test_two_pass_with_a_separable_transform_is_the_one_pass_backward_step():
  tx = optax.adamw(1e-2)
  params = models.tied_lm_params()
  plan = _global.make_two_pass_plan(tx, params, tx.init(params))
  assert isinstance(plan, _plan.UpdatePlan)


def test_two_pass_plan_statistics_are_scalars_for_clipping():
  tx = GLOBAL["clip_by_global_norm+adamw"]()
  params = models.tied_lm_params()
  plan = _global.make_two_pass_plan(tx, params, tx.init(params))
  # One squared norm per leaf crosses the backward pass, never a gradient-sized array.
  assert all([s.shape for s in leaf_stats] == [()] for leaf_stats in plan.stats.stats)


def stacked_params(layers=3, dim=models.DIM):
  k = jax.random.split(jax.random.PRNGKey(3), 3)
  return {
      "embed": jax.random.normal(k[0], (models.VOCAB, dim)) / np.sqrt(dim),
      "layers": {"w": jax.random.normal(k[1], (layers, dim, dim)) / np.sqrt(dim),
                 "b": jnp.zeros((layers, dim))},
      "head": jax.random.normal(k[2], (dim, models.VOCAB)) / np.sqrt(dim),
  }


def scanned_loss(params, tokens, targets, scale):
  body = lambda h, layer: (h + jnp.tanh(h @ layer["w"] + layer["b"]), None)
  h, _ = jax.lax.scan(body, params["embed"][tokens], params["layers"])
  logits = h @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean() * scale


def test_two_pass_of_a_scanned_model_matches_optax():
  tx = GLOBAL["clip_by_global_norm+adamw"]()
  params = stacked_params()
  batches = [(*batch, jnp.float32(1.0)) for batch in models.tied_lm_batches()]
  fx = optfuse.fuse(tx, mode="backward", global_ops="two_pass")
  step = jax.jit(fx.value_and_update(scanned_loss))
  expected = models.run_optax(tx, params, batches, 10, loss_fn=scanned_loss)
  state, losses = fx.init(params), []
  for t in range(10):
    loss, params, state = step(params, state, *batches[t % len(batches)])
    losses.append(loss)
  chex.assert_trees_all_close((jnp.stack(losses), params, state), expected, **TOL)


def test_unknown_global_ops_is_refused():
  with pytest.raises(optfuse.UnknownModeError, match="two_pass"):
    optfuse.fuse(optax.adam(1e-2), global_ops="three_pass")
