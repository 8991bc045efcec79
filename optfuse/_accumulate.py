"""Gradient accumulation over microbatches, with the update fused into the last backward pass.

A step over ``k`` microbatches averages their gradients and applies one update, like
``optax.MultiSteps`` after ``k`` calls or a hand-written accumulation loop. The first ``k - 1``
microbatches run in a ``lax.scan`` whose backward passes are themselves fused, with a
transformation whose state is the running sum (``acc += g`` in each leaf's backward rule,
row by row inside scanned layers); the last one runs the fused optimizer step, whose backward
rules add the accumulated sum to each leaf's gradient before updating it. The accumulated sum
is the only gradient buffer: optax's loop also holds each microbatch's gradient next to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optfuse._errors import MicrobatchError
from optfuse._leaves import is_float

FusedStep = Callable[[Callable, Any, Any, tuple, dict, Any], tuple[Any, Any, Any]]


def split(args: tuple, kwargs: dict, microbatches: int) -> tuple[tuple, dict]:
  """Reshapes every array leaf of ``(args, kwargs)`` to ``(microbatches, batch // k, ...)``.

  Raises:
    MicrobatchError: an array leaf is a scalar or its leading axis is not divisible by
      ``microbatches``.
  """
  def reshape(path, x):
    if not isinstance(x, (jax.Array, np.ndarray)):
      return x
    if x.ndim == 0 or x.shape[0] % microbatches:
      raise MicrobatchError(
          f"argument {jax.tree_util.keystr(path)} has shape {x.shape}: its leading (batch) axis "
          f"must be divisible by microbatches={microbatches}. Pass batch-shaped arrays, or close "
          "over arguments that are not per-example.")
    return x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])

  return jax.tree_util.tree_map_with_path(reshape, (args, kwargs))


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _index(tree, sl):
  return jax.tree.map(lambda x: x[sl] if _is_array(x) else x, tree)


def _take(tree, index):
  """Microbatch ``index`` (a scalar holding an integer, maybe a float) of every array leaf."""
  i = jnp.asarray(index).astype(jnp.int32)
  return jax.tree.map(
      lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False) if _is_array(x) else x, tree)


def _float_grad(loss_fn: Callable, has_aux: bool):
  """``(value, grads)`` of ``loss_fn``; non-float param leaves get zero gradients."""
  def value_and_grad(params, args, kwargs):
    leaves, treedef = jax.tree.flatten(params)
    diff = [i for i, p in enumerate(leaves) if is_float(p)]

    def of_diff(diff_leaves):
      full = list(leaves)
      for i, x in zip(diff, diff_leaves):
        full[i] = x
      return loss_fn(jax.tree.unflatten(treedef, full), *args, **kwargs)

    value, diff_grads = jax.value_and_grad(of_diff, has_aux=has_aux)([leaves[i] for i in diff])
    grads = [jnp.zeros_like(p) for p in leaves]
    for i, g in zip(diff, diff_grads):
      grads[i] = g
    return value, jax.tree.unflatten(treedef, grads)

  return value_and_grad


def accumulator() -> optax.GradientTransformation:
  """A transformation whose state is the running sum of the gradients (updates are zero)."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, acc, params=None):
    del params
    return jax.tree.map(jnp.zeros_like, grads), jax.tree.map(jnp.add, acc, grads)

  return optax.GradientTransformation(init, update)


def _sum_gradients(loss_fn, has_aux, params, args, kwargs, count):
  """Sums the gradients of the first ``count`` microbatches; returns ``(values, sum)``."""
  value_and_grad = _float_grad(loss_fn, has_aux)

  def body(acc, batch):
    value, grads = value_and_grad(params, *batch)
    return jax.tree.map(jnp.add, acc, grads), value

  zeros = jax.tree.map(jnp.zeros_like, params)
  acc, values = lax.scan(body, zeros, _index((args, kwargs), slice(0, count)))
  return values, acc


def scale_loss(loss_fn: Callable, has_aux: bool, microbatches) -> Callable:
  """``loss_fn`` divided by ``microbatches`` (an int, or a scalar of the loss's dtype): the sum
  of its gradients over the microbatches is their mean gradient, and the sum of its values the
  mean loss."""
  def scaled(params, *args, **kwargs):
    value = loss_fn(params, *args, **kwargs)
    return (value[0] / microbatches, value[1]) if has_aux else value / microbatches

  return scaled


def fused_step(loss_fn: Callable, has_aux: bool, microbatches: int, fused: FusedStep,
               accumulate: FusedStep):
  """A step over ``microbatches`` whose backward passes are all fused.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` on one microbatch.
    has_aux: whether it returns ``(loss, aux)``.
    microbatches: how many microbatches each step's arguments are split into.
    fused: ``fused(loss_fn, params, state, args, kwargs, extra_grads)``, a fused optimizer step
      that adds ``extra_grads`` to each leaf's gradient before its update.
    accumulate: ``accumulate(loss_fn, params, acc, args, kwargs, None)``, a fused step of the
      ``accumulator()`` transformation that leaves params as they are.

  Returns:
    ``step(params, state, *args, **kwargs) -> (value, params, state)`` where value is the mean
    loss over the microbatches (with aux stacked along a leading axis when ``has_aux``).
  """
  k = microbatches
  scaled = scale_loss(loss_fn, has_aux, k)

  def step(params, state, *args, **kwargs):
    batches = split(args, kwargs, k)
    first_args, first_kwargs = _take(batches, 0)
    value = jax.eval_shape(scaled, params, *first_args, **first_kwargs)
    loss_dtype = (value[0] if has_aux else value).dtype
    dtype = jnp.promote_types(loss_dtype, jnp.float32)

    # The microbatches are read by dynamic index (slicing off the first k - 1 would copy them).
    # The loop carries the losses of the microbatches, whose last slot (the last microbatch's
    # loss, filled after the loop) holds the loop's counter meanwhile: a counter of its own
    # would be one more loop-carried buffer. The counter is a float, as XLA folds an integer
    # counter's final value to a constant.
    def body(carry, _):
      acc, losses = carry
      index = losses[k - 1]
      value, _, acc = accumulate(scaled, params, acc, *_take(batches, index), None)
      loss, aux = value if has_aux else (value, None)
      losses = losses.at[index.astype(jnp.int32)].set(loss.astype(dtype)).at[k - 1].add(1)
      return (acc, losses), aux

    zeros = jax.tree.map(jnp.zeros_like, params)
    (acc, losses), auxes = lax.scan(body, (zeros, jnp.zeros(k, dtype)), None, length=k - 1)
    index, last_scaled = k - 1, scaled
    if k > 2:
      # The last microbatch's index is the counter's final value, and its loss is divided by
      # that plus one (k, exactly): its forward pass and the constants of its backward pass
      # (the loss's cotangent, broadcast) then depend on the loop, so XLA can neither start
      # them before the loop nor hold what they make across it. (XLA removes a loop of one
      # iteration, and then folds the counter anyway.)
      index = losses[k - 1]
      last_scaled = scale_loss(loss_fn, has_aux, (index + 1).astype(loss_dtype))
    last_args, last_kwargs = _take(batches, index)
    value, params, state = fused(last_scaled, params, state, last_args, last_kwargs, acc)
    loss, aux = value if has_aux else (value, None)
    loss = losses.at[k - 1].set(loss.astype(dtype)).astype(loss_dtype).sum()
    if has_aux:
      stack = lambda xs, x: jnp.concatenate([xs, x[None]])
      return (loss, jax.tree.map(stack, auxes, aux)), params, state
    return loss, params, state

  return step


def optax_step(loss_fn: Callable, has_aux: bool, microbatches: int, tx):
  """The unfused reference: accumulate all microbatch gradients, average, one optax update."""
  k = microbatches

  def step(params, state, *args, **kwargs):
    mb_args, mb_kwargs = split(args, kwargs, k)
    values, acc = _sum_gradients(loss_fn, has_aux, params, mb_args, mb_kwargs, k)
    grads = jax.tree.map(lambda g: g / k, acc)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    new = jax.tree.map(
        lambda p, n: n if is_float(p) else p, params, new)
    if has_aux:
      value = (values[0].mean(), values[1])
    else:
      value = values.mean()
    return value, new, state

  return step
