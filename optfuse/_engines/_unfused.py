"""The ``off`` engine: the plain optax step behind optfuse's API.

``jax.value_and_grad`` of the loss, ``tx.update``, ``optax.apply_updates``: the reference every
fused mode is tested against, and what ``memory_report`` compares with.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from optfuse._base import _checks, _leaves
from optfuse._base._options import FuseOptions
from optfuse._engines._engine import NOTHING_PLACED, PlacedStep, Step
from optfuse._fusion import _accumulate
from optfuse._plan._separable import update_needs_loss


def _step(tx: optax.GradientTransformation, loss_fn: Callable, has_aux: bool) -> Step:
  def step(params, state, *args, **kwargs):
    leaves, treedef = jax.tree.flatten(params)
    diff = [i for i, p in enumerate(leaves) if _leaves.is_float(p)]

    def loss_of_diff(diff_leaves):
      full = list(leaves)
      for i, x in zip(diff, diff_leaves):
        full[i] = x
      return _checks.check_loss(loss_fn(jax.tree.unflatten(treedef, full), *args, **kwargs),
                                has_aux)

    (loss, aux), diff_grads = jax.value_and_grad(loss_of_diff, has_aux=True)(
        [leaves[i] for i in diff])
    grads = [jnp.zeros_like(p) for p in leaves]
    for i, g in zip(diff, diff_grads):
      grads[i] = g
    grads = jax.tree.unflatten(treedef, grads)
    extra = {}
    # Called as optax users call it, and as the fused modes do: a transform's update need not
    # take the loss (a third party's may not accept it). Those that require it (line searches,
    # Polyak step sizes, reduce_on_plateau) get value, grad and value_fn, which only mode off has.
    if (isinstance(tx, optax.GradientTransformationExtraArgs)
        and update_needs_loss(tx, grads, state, params)):
      value_fn = lambda p: _checks.check_loss(loss_fn(p, *args, **kwargs), has_aux)[0]
      extra = dict(value=loss, grad=grads, value_fn=value_fn)
    updates, new_state = tx.update(grads, state, params, **extra)
    new_state = _leaves.keep_int_state(new_state, state)
    new_leaves = jax.tree.leaves(optax.apply_updates(params, updates))
    new_leaves = [n if _leaves.is_float(p) else p for p, n in zip(leaves, new_leaves)]
    value = (loss, aux) if has_aux else loss
    return value, jax.tree.unflatten(treedef, new_leaves), new_state

  return step


class OffEngine:
  """``mode="off"``: optax's step, every leaf placed "optax"."""

  unplaced = "optax"

  def __init__(self, tx: optax.GradientTransformation, options: FuseOptions):
    self.tx, self.options = tx, options

  def init(self, params):
    _checks.check_params(params)
    return self.tx.init(params)

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    inner = (_step(self.tx, loss_fn, has_aux) if microbatches == 1
             else _accumulate.optax_step(loss_fn, has_aux, microbatches, self.tx))
    return _checks.checked_step(self.tx, lambda *args, **kwargs: (inner(*args, **kwargs),
                                                                 NOTHING_PLACED))

  def flush(self, params, state):
    return params, state
