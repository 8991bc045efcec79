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


def _float_grad(loss_fn: Callable, has_aux: bool):
  """``(value, grads)`` of ``loss_fn``; non-float param leaves get zero gradients."""
  def value_and_grad(params, args, kwargs):
    leaves, treedef = jax.tree.flatten(params)
    diff = [i for i, p in enumerate(leaves) if jnp.issubdtype(jnp.result_type(p), jnp.inexact)]

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


def _combine(values, last_value, has_aux: bool, k: int):
  """Mean loss over the microbatches (whose losses were scaled by 1/k); aux stacked."""
  stack = lambda xs, x: jnp.concatenate([xs, x[None]])
  if has_aux:
    return stack(values[0], last_value[0]).sum(), jax.tree.map(stack, values[1], last_value[1])
  return stack(values, last_value).sum()


def scale_loss(loss_fn: Callable, has_aux: bool, microbatches: int) -> Callable:
  """``loss_fn`` divided by ``microbatches``: the sum of its gradients over the microbatches is
  their mean gradient, and the sum of its values the mean loss."""
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
    mb_args, mb_kwargs = split(args, kwargs, k)

    def body(acc, batch):
      value, _, acc = accumulate(scaled, params, acc, *batch, None)
      return acc, value

    zeros = jax.tree.map(jnp.zeros_like, params)
    acc, values = lax.scan(body, zeros, _index((mb_args, mb_kwargs), slice(0, k - 1)))
    last_args, last_kwargs = _index((mb_args, mb_kwargs), k - 1)
    value, params, state = fused(scaled, params, state, last_args, last_kwargs, acc)
    return _combine(values, value, has_aux, k), params, state

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
        lambda p, n: n if jnp.issubdtype(jnp.result_type(p), jnp.inexact) else p, params, new)
    if has_aux:
      value = (values[0].mean(), values[1])
    else:
      value = values.mean()
    return value, new, state

  return step
