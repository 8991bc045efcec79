"""The public entry point: ``optfuse.fuse(tx, mode)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optfuse import _accumulate, _backward, _checks, _forward, _global, _leaves, _plan, _two_pass
from optfuse._errors import (
    UnknownModeError,
)

MODES = ("backward", "forward", "off")
GLOBAL_OPS = (None, "two_pass")


class FusedTransformation(NamedTuple):
  """An optax transformation with its update fused into the training step.

  Attributes:
    init: ``init(params) -> state``. In "backward" and "off" mode exactly ``tx.init(params)``.
    value_and_update: ``value_and_update(loss_fn, has_aux=False, *, microbatches=None) -> step``
      where ``step(params, state, *args, **kwargs) -> (value, params, state)``. With
      ``microbatches=k`` every array argument is split along its leading axis into ``k``
      microbatches whose mean gradient makes one update (the mean loss is returned).
    flush: ``flush(params, state) -> (params, state)``; applies a pending forward-mode update,
      identity in the other modes.
    mode: "backward", "forward" or "off".
    tx: the wrapped optax transformation.
    global_ops: ``None`` or ``"two_pass"``, as passed to ``optfuse.fuse``.
  """

  init: Callable[[Any], Any]
  value_and_update: Callable[..., Callable[..., tuple[Any, Any, Any]]]
  flush: Callable[[Any, Any], tuple[Any, Any]]
  mode: str
  tx: optax.GradientTransformation
  global_ops: str | None = None


def _off_step(tx, loss_fn, has_aux):
  def step(params, state, *args, **kwargs):
    leaves, treedef = jax.tree.flatten(params)
    diff = [i for i, p in enumerate(leaves) if _leaves.is_float(p)]

    def loss_of_diff(diff_leaves):
      full = list(leaves)
      for i, x in zip(diff, diff_leaves):
        full[i] = x
      return _backward.check_loss(loss_fn(jax.tree.unflatten(treedef, full), *args, **kwargs),
                                  has_aux)

    (loss, aux), diff_grads = jax.value_and_grad(loss_of_diff, has_aux=True)(
        [leaves[i] for i in diff])
    grads = [jnp.zeros_like(p) for p in leaves]
    for i, g in zip(diff, diff_grads):
      grads[i] = g
    grads = jax.tree.unflatten(treedef, grads)
    extra = {}
    if isinstance(tx, optax.GradientTransformationExtraArgs):
      # What line searches, Polyak step sizes and reduce_on_plateau read; others ignore it.
      value_fn = lambda p: _backward.check_loss(loss_fn(p, *args, **kwargs), has_aux)[0]
      extra = dict(value=loss, grad=grads, value_fn=value_fn)
    updates, new_state = tx.update(grads, state, params, **extra)
    new_state = _backward.keep_int_state(new_state, state)
    new_leaves = jax.tree.leaves(optax.apply_updates(params, updates))
    new_leaves = [n if _leaves.is_float(p) else p for p, n in zip(leaves, new_leaves)]
    value = (loss, aux) if has_aux else loss
    return value, jax.tree.unflatten(treedef, new_leaves), new_state

  return step


def fuse(tx: optax.GradientTransformation, mode: str = "backward",
         global_ops: str | None = None) -> FusedTransformation:
  """Fuses the optax transformation ``tx`` into the training step.

  Args:
    tx: any optax ``GradientTransformation`` (a chain, ``inject_hyperparams``, masks...).
    mode: "backward" updates each leaf inside the backward pass as soon as its gradient is
      complete (separable transforms only); "forward" keeps the gradient and applies the update
      just before each leaf's first use in the next step (every transform); "off" is the plain
      optax step behind the same API.
    global_ops: ``"two_pass"`` lets backward mode run transforms that reduce over all the
      gradients (``clip_by_global_norm``, ``apply_if_finite``...) exactly: a first backward pass
      computes the global statistics, a second one (over the same forward pass) fuses the
      updates. ``None`` (default): backward mode refuses them with ``NonSeparableError``.
      Forward and off modes run them exactly either way.

  Returns:
    A ``FusedTransformation``.

  Raises:
    UnknownModeError: ``mode`` is not one of "backward", "forward", "off", or ``global_ops`` is
      not ``None`` or "two_pass".

  Examples:
    >>> import jax.numpy as jnp, optax, optfuse
    >>> fx = optfuse.fuse(optax.adam(1e-2))
    >>> params = {"w": jnp.ones(3)}
    >>> state = fx.init(params)
    >>> step = fx.value_and_update(lambda p, x: jnp.sum((p["w"] * x) ** 2))
    >>> loss, params, state = step(params, state, jnp.arange(3.0))
    >>> float(loss)
    5.0
  """
  if mode not in MODES:
    raise UnknownModeError(f"unknown mode {mode!r}; use one of {', '.join(map(repr, MODES))}.")
  if global_ops not in GLOBAL_OPS:
    raise UnknownModeError(f'unknown global_ops {global_ops!r}; use None or "two_pass".')
  if mode == "forward":
    return FusedTransformation(*_forward.transformation(tx), mode, tx)
  make_plan = _two_pass.make_plan if global_ops == "two_pass" else _plan.make_plan
  plans: dict = {}

  def get_plan(params, state) -> _plan.UpdatePlan | _global.GlobalPlan:
    if _checks.is_tracing((params, state)):
      return make_plan(tx, params, state)
    key = (_checks.signature(params), _checks.signature(state))
    if key not in plans:
      plans[key] = make_plan(tx, params, state)
    return plans[key]

  def init(params):
    _checks.check_params(params)
    return tx.init(params)

  def get_accumulator_plan(params, acc) -> _plan.UpdatePlan:
    return _plan.make_plan(_accumulate.accumulator(), params, acc)

  def fused(loss_fn, has_aux, params, state, args, kwargs, extra_grads=None):
    plan = get_plan(params, state)
    if isinstance(plan, _global.GlobalPlan):
      return _two_pass.value_and_update(plan, loss_fn, has_aux, params, state, args, kwargs,
                                        extra_grads)
    return _backward.value_and_update(plan, loss_fn, has_aux, params, state, args, kwargs,
                                      extra_grads)

  def value_and_update(loss_fn: Callable, has_aux: bool = False, *,
                       microbatches: int | None = None):
    k = _checks.check_microbatches(microbatches)
    if mode == "off":
      inner = (_off_step(tx, loss_fn, has_aux) if k == 1
               else _accumulate.optax_step(loss_fn, has_aux, k, tx))
    elif k == 1:
      inner = lambda params, state, *args, **kwargs: fused(loss_fn, has_aux, params, state, args,
                                                           kwargs)
    else:
      inner = _accumulate.fused_step(
          loss_fn, has_aux, k,
          lambda loss, params, state, args, kwargs, extra: fused(loss, has_aux, params, state,
                                                                 args, kwargs, extra),
          lambda loss, params, acc, args, kwargs, _: _backward.value_and_update(
              get_accumulator_plan(params, acc), loss, has_aux, params, acc, args, kwargs,
              update_params=False))

    def step(params, state, *args, **kwargs):
      _checks.check_params(params)
      _checks.check_state(tx, params, state)
      return inner(params, state, *args, **kwargs)

    return step

  def flush(params, state):
    return params, state

  return FusedTransformation(init, value_and_update, flush, mode, tx, global_ops)


def check_separable(tx: optax.GradientTransformation, params) -> None:
  """Raises ``NonSeparableError`` if ``tx`` cannot run in backward mode for ``params``.

  Args:
    tx: an optax transformation.
    params: params or their ``jax.ShapeDtypeStruct``s.

  Returns:
    None.

  Raises:
    NonSeparableError: naming the part of the chain whose update of one leaf reads the
      gradients of other leaves.
  """
  abstract = _checks.abstract(params)
  _plan.make_plan(tx, abstract, jax.eval_shape(tx.init, abstract))
