"""The update plan: which leaves' state slots a row loop may leave to one whole pass, and which
leaves' whole update runs in place."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

from optfuse._plan._global_stage import make_global_plan
from optfuse._plan._row_checks import NOT_STACKED
from tests import criteria, models


def stacked_params():
  key_w, key_b = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(key_w, (4, 8, 8)), "b": jax.random.normal(key_b, (4, 8))}


def plan_of(tx, params):
  return make_global_plan(tx, params, tx.init(params))


def flat_inputs(tx):
  """The plan of ``tx`` for ``stacked_params`` with flat gradients, state, params and cuts."""
  params = stacked_params()
  grads = jax.tree.map(lambda p: jnp.cos(p) * 3.0, params)
  plan, state = plan_of(tx, params), tx.init(params)
  flat_grads, flat_params = jax.tree.leaves(grads), jax.tree.leaves(params)
  flat_state = jax.tree.leaves(state)
  cuts, _ = plan.run_global(flat_grads, flat_state, flat_params)
  return plan, flat_grads, flat_state, flat_params, cuts


@pytest.mark.parametrize("tx", [optax.adamw(1e-2, weight_decay=1e-2), optax.lion(1e-3),
                                optax.sgd(1e-2, momentum=0.9)], ids=["adamw", "lion", "sgdm"])
def test_slots_that_read_only_their_gradient_and_state_are_updated_whole(tx):
  params = stacked_params()
  plan = plan_of(tx, params)
  assert all(plan.slots_whole(i) for i in range(plan.num_params))


@pytest.mark.parametrize("tx", [
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),  # reads the clipping factor
    models.ema_of_params(),  # reads the param, which the row loop overwrites
    optax.sgd(1e-2),  # no slots
], ids=["clip_adam", "ema_of_params", "sgd"])
def test_slots_that_read_the_param_or_the_global_stage_are_not_updated_whole(tx):
  params = stacked_params()
  plan = plan_of(tx, params)
  assert not any(plan.slots_whole(i) for i in range(plan.num_params))


@pytest.mark.parametrize("tx", [optax.adamw(1e-2, weight_decay=1e-2), models.ema_of_params(),
                                optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))],
                         ids=["adamw", "ema_of_params", "clip_adam"])
def test_run_group_slots_gives_the_slots_of_the_whole_update(tx):
  plan, flat_grads, flat_state, flat_params, cuts = flat_inputs(tx)
  for i in range(plan.num_params):
    _, expected = plan.run_group(i, flat_grads[i], flat_state, flat_params, cuts)
    got = plan.run_group_slots(i, flat_grads[i], flat_state, flat_params, cuts)
    chex.assert_trees_all_equal(got, expected)


@pytest.mark.parametrize("tx", [
    optax.adamw(1e-2, weight_decay=1e-2),  # reads the old moments through the new ones
    optax.sgd(1e-2),
    optax.sgd(1e-2, momentum=0.9, nesterov=True),
    optax.chain(optax.clip(1.0), optax.adam(1e-2)),  # an elementwise clip is not a cut
    optax.rmsprop(1e-2),
], ids=["adamw", "sgd", "nesterov", "clip_adam", "rmsprop"])
def test_updates_that_read_only_their_own_old_buffers_run_whole_in_place(tx):
  plan = plan_of(tx, stacked_params())
  assert all(plan.in_place_whole(i) for i in range(plan.num_params))


@pytest.mark.parametrize("tx", [
    optax.lion(1e-3),  # the step reads the old momentum beside the new
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),  # reads the clipping factor
    models.ema_of_params(),  # reads the average, shared state the update overwrites
    optax.adam(1e-2, mu_dtype=jnp.bfloat16),  # the step reads the float32 moment, not the slot
], ids=["lion", "clip_by_global_norm", "ema_of_params", "adam_bf16_mu"])
def test_updates_that_read_an_old_buffer_another_output_overwrites_do_not_run_whole(tx):
  plan = plan_of(tx, stacked_params())
  assert not any(plan.in_place_whole(i) for i in range(plan.num_params))


def clip(tx):
  return optax.chain(optax.clip_by_global_norm(1.0), tx)


@pytest.mark.parametrize("tx", [clip(optax.adamw(1e-2, weight_decay=1e-2)), clip(optax.sgd(1e-2)),
                                clip(optax.sgd(1e-2, momentum=0.9))],
                         ids=["clip_adamw", "clip_sgd", "clip_sgdm"])
def test_clipped_updates_run_whole_in_place_from_their_cut_gradient(tx):
  # The clipping factor is read only through the clipped (cut) gradient: written first into the
  # gradient's buffer, the rest of the update is AdamW's (SGD's), in place whole.
  plan = plan_of(tx, stacked_params())
  for i in range(plan.num_params):
    assert not plan.in_place_whole(i) and plan.in_place_from_cut_gradient(i)
    (_, head_reads), tail = plan.cut_gradient_split(i)
    assert not any(tail.reads[len(plan.consts) + 2 * plan.num_params + plan.num_state:])
    assert any(head_reads[len(plan.consts) + 2 * plan.num_params + plan.num_state:])


@pytest.mark.parametrize("tx,split", [
    (clip(optax.lion(1e-3)), True),  # split, but Lion's rest is not in place
    (optax.apply_if_finite(clip(optax.adam(1e-2)), 3), False),  # the flag gates the state too
    (optax.adamw(1e-2), False),  # no cut at all
], ids=["clip_lion", "apply_if_finite", "adamw"])
def test_updates_that_read_a_cut_elsewhere_or_stay_out_of_place_are_not_in_place_from_it(tx,
                                                                                      split):
  plan = plan_of(tx, stacked_params())
  for i in range(plan.num_params):
    assert (plan.cut_gradient_split(i) is not None) == split
    assert not plan.in_place_from_cut_gradient(i)


@pytest.mark.parametrize("tx", [clip(optax.adamw(1e-2, weight_decay=1e-2)),
                                clip(optax.lion(1e-3))], ids=["clip_adamw", "clip_lion"])
def test_run_from_cut_gradient_gives_the_update_of_the_whole_group(tx):
  plan, flat_grads, flat_state, flat_params, cuts = flat_inputs(tx)
  assert plan.cuts  # the global norm is a cut: several leaves
  for i in range(plan.num_params):
    expected = plan.run_group(i, flat_grads[i], flat_state, flat_params, cuts)
    cut_grad, update, slots = plan.run_from_cut_gradient(i, flat_grads[i], flat_state,
                                                         flat_params, cuts)
    chex.assert_trees_all_close((update, slots), expected, rtol=1e-6, atol=1e-7)
    assert cut_grad.shape == flat_grads[i].shape and cut_grad.dtype == flat_grads[i].dtype


def _adafactor_factoring(min_dim_size_to_factor: int) -> optax.GradientTransformation:
  return optax.adafactor(1e-2, min_dim_size_to_factor=min_dim_size_to_factor,
                         clipping_threshold=None, multiply_by_parameter_scale=False)


def test_slots_of_another_shape_with_a_row_per_layer_run_row_by_row_as_the_whole_update():
  """``w`` (4, 8, 8) factored over its last two axes: its moments (4, 8) each have a row per
  layer, and each row of the update and the moments is that row of the whole update."""
  plan, grads, state, params, cuts = flat_inputs(_adafactor_factoring(8))
  w = 1  # leaves in key order: b, w
  assert plan.row_refusal(w, state, params) is None
  update, slots = plan.run_group(w, grads[w], state, params, cuts)
  assert [jnp.shape(s) for s in slots] == [(4, 8), (4, 8)]
  for row in range(4):
    rows = (grads[w][row], params[w][row], [state[k][row] for k in plan.groups[w].state_outs])
    got = plan.run_group_row(w, state, params, cuts, rows, row, 4)
    criteria.assert_matches_optax(got, (update[row], [s[row] for s in slots]))


def test_a_slot_without_a_row_per_layer_keeps_the_leaf_out_of_the_loop():
  """``b`` (4, 8) factored over its layer axis too: its column moment (8,) has no layer axis."""
  plan, _, state, params, _ = flat_inputs(_adafactor_factoring(4))
  assert plan.row_refusal(0, state, params) == NOT_STACKED
