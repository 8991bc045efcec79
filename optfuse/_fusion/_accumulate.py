"""Gradient accumulation over microbatches: every backward pass adds to one sum, in place.

A step over ``k`` microbatches averages their gradients and applies one update, like
``optax.MultiSteps`` after ``k`` calls or a hand-written accumulation loop. The microbatches run
in one ``lax.scan`` whose backward passes are fused with a transformation whose state is the
running sum (``acc += g`` in each leaf's backward rule, row by row inside scanned layers; a sum
in host memory adds the first gradient to zeros selected in place of whatever its buffer held,
``accumulator``), so
the sum is the only gradient buffer: optax's loop also holds each microbatch's gradient next to
it. The update of the mean gradient follows the loop (``_apply``).

The sum has to exist whole before the update anyway, so updating inside the last microbatch's
backward pass saves nothing; it would compile the loss's forward and backward passes twice
(once in the loop, once for the last microbatch): 1.33x optax's compile time on the bench's
accumulation model, against 1.10x in one loop.

With ``offload="params"`` the param stacks of the loops live in host memory (``streamed``):
each microbatch's forward and backward loops read their rows to the device where they use
them, as one backward pass does, and the sum of those leaves' gradients lives in host memory
too, one row read and written per backward iteration: on the device it would hold a whole
gradient of the stacks, which is what streaming the params removes (the 1.3B decoder, two
microbatches, on the TPU v5e compiler: 9.35 GB peak with the sum on the device; in host memory,
docs/offload.md). It starts in a copy of the param stack, whose values the first microbatch
writes over: no zeros cross the host link first. The update after the loop runs row by row for
them (``_apply.update_rows``), writing each new row back to the host stacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optfuse._base._errors import MicrobatchError
from optfuse._base._leaves import is_float, keep_int_state
from optfuse._base._memory_spaces import host_leaves
from optfuse._fusion import _fused_step, _loops
from optfuse._fusion._apply import apply_update, stacked_rows
from optfuse._plan import _make
from optfuse._plan._plan import Plan
from optfuse._targets._backends import LoopPolicy


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


class SumState(NamedTuple):
  """The state of ``accumulator()``: how many gradients it has summed (``None`` when every sum
  starts as zeros), and their sum."""

  count: jax.Array | None
  sum: Any


def accumulator(written: frozenset[int] = frozenset()) -> optax.GradientTransformation:
  """A transformation whose state is the running sum of the gradients (updates are zero).

  Args:
    written: the leaves (flat indices) whose sum may start in a buffer that holds anything:
      the first gradient is added to zeros selected in place of its old values (``where``,
      which never propagates what it does not select, not even a NaN), so a streamed leaf's sum
      starts in a copy of its host param stack and needs no zeros written there first. Their
      sums are those of zeros plus each gradient in turn, bit for bit. The others start as
      zeros (``sum_state``), with no count to read.
  """
  def init(params):
    return sum_state(jax.tree.map(jnp.zeros_like, params), written)

  def update(grads, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(grads)
    sums = treedef.flatten_up_to(state.sum)
    if written:
      first = state.count == 0
      sums = [jnp.where(first, jnp.zeros_like(s), s) if i in written else s
              for i, s in enumerate(sums)]
    total = jax.tree.unflatten(treedef, [s + g for s, g in zip(sums, leaves)])
    count = state.count + 1 if written else None
    return jax.tree.map(jnp.zeros_like, grads), SumState(count, total)

  return optax.GradientTransformation(init, update)


def sum_state(sum_buffers, written: frozenset[int] = frozenset()) -> SumState:
  """``accumulator(written)``'s state before its first gradient, its sums in ``sum_buffers``
  (zeros, but for the leaves of ``written``, whose values the first gradient replaces)."""
  return SumState(jnp.zeros([], jnp.int32) if written else None, sum_buffers)


def sum_shapes(params, written: frozenset[int] = frozenset()) -> SumState:
  """``accumulator(written).init(params)``'s shapes and dtypes."""
  return SumState(jax.ShapeDtypeStruct((), jnp.int32) if written else None,
                  jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)),
                               params))


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


class Accumulation(NamedTuple):
  """What every microbatch of a step reuses: the accumulator's plan, the loss's loop plan
  (``analyze_loss``), the step's per-compiler choices of its loops, and the leaves whose sums
  start in buffers that hold anything (``accumulator``)."""

  plan: Plan
  loop_plan: _loops.LoopPlan
  policy: LoopPolicy
  written: frozenset[int] = frozenset()

  def first_state(self, sum_buffers) -> SumState:
    """The accumulator's state before the first microbatch, its sums in ``sum_buffers``."""
    return sum_state(sum_buffers, self.written)


def accumulate(loss_fn: Callable, has_aux: bool, params, acc, args: tuple, kwargs: dict,
               analysis: Accumulation) -> tuple[Any, Any]:
  """Adds the gradient of ``loss_fn`` to ``acc`` inside its backward pass: ``(value, acc)``.

  A backward-fused step of ``accumulator()``: each leaf's rule (each row's, inside scanned
  layers) adds its gradient to its slice of ``acc``, in place, and params are left as they are.
  """
  value, _, acc = _fused_step.value_and_update(analysis.plan, analysis.policy, loss_fn, has_aux,
                                               params, acc, args, kwargs, update_params=False,
                                               loop_plan=analysis.loop_plan)
  return value, acc


def analyze_loss(loss_fn: Callable, params, batches, policy: LoopPolicy,
                 written: frozenset[int] = frozenset()) -> Accumulation:
  """The plans of accumulating ``loss_fn``'s gradient on the microbatches of ``batches``, from
  the first (the loss is traced here, once for the whole step), with the loops' ``policy``;
  the sums of ``written`` start in buffers that hold anything (``accumulator``)."""
  # Shapes, not zeros: eagerly, a param in host memory (``offload="params"``) has no zeros
  # "like" it on the device.
  shapes = sum_shapes(params, written)
  plan = _make.make_plan(accumulator(written), params, shapes)
  diff = [i for i, p in enumerate(plan.params_def.flatten_up_to(params)) if is_float(p)]
  args, kwargs = _index(batches, 0)
  return Accumulation(plan, _loops.analyze(loss_fn, plan, params, jax.tree.leaves(shapes), args,
                                           kwargs, diff), policy, written)


def streamed_leaves(analysis: Accumulation, plan: Plan, state: list, params: list,
                    in_remat: bool = True) -> frozenset[int]:
  """The leaves whose params ``offload="params"`` streams with microbatches: those the loops
  of every microbatch update row by row (``analysis``) and whose update by ``plan`` runs row
  by row after them (``Plan.rowwise``); with ``in_remat=False`` (forward mode, whose fused
  loops update no row inside ``jax.checkpoint``) not those whose scan sits inside one. These
  are the leaves the step without microbatches streams (``describe``'s "loop" leaves)."""
  loop_plan = analysis.loop_plan
  return frozenset(i for i in loop_plan.fused_leaves
                   if (in_remat or i not in loop_plan.in_remat)
                   and plan.rowwise(i, state, params, axis=loop_plan.stacked[i]))


def fused_step(loss_fn: Callable, has_aux: bool, microbatches: int,
               plans: Callable[[Any, Any], Plan], stream_params: bool = False,
               mixed: bool = False):
  """A step over ``microbatches`` whose backward passes all accumulate in place.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` on one microbatch.
    has_aux: whether it returns ``(loss, aux)``.
    microbatches: how many microbatches each step's arguments are split into.
    plans: ``plans(params, state)``, the plan of the optimizer, applied once to the mean
      gradient (``_apply.apply_update``; with a global stage, stacked leaves row by row).
    stream_params: ``offload="params"``: the params of ``streamed_leaves`` are in host memory,
      and so is the sum of their gradients; they are updated row by row after the loop.
    mixed: ``offload="auto"``: with ``stream_params``, only those of them whose params are in
      host memory stream (each leaf where ``optfuse.place`` put it).

  Returns:
    ``step(policy, params, state, *args, **kwargs) -> ((value, params, state), (rows,
    stacked, streamed))`` (``policy``: the step's per-compiler choices of its loops), where
    value is the mean loss over the microbatches (with aux stacked along a leading axis when
    ``has_aux``), ``rows`` the leaves whose update ran row by row in place (the others ran
    whole), ``stacked`` the leaves a scan reads as its stacked input, all after the loop, and
    ``streamed`` the leaves whose params it streamed (``streamed_leaves``; empty without
    ``stream_params``).
  """
  k = microbatches
  scaled = scale_loss(loss_fn, has_aux, k)

  def step(policy, params, state, *args, **kwargs):
    batches = split(args, kwargs, k)
    # A streamed leaf's sum starts in host memory, in a buffer that holds anything.
    written = host_leaves(params) if stream_params else frozenset()
    analysis = analyze_loss(scaled, params, batches, policy, written)
    plan = plans(params, state)
    param_leaves, state_leaves = plan.params_def.flatten_up_to(params), jax.tree.leaves(state)
    streamed = (streamed_leaves(analysis, plan, state_leaves, param_leaves) if stream_params
                else frozenset())
    if mixed:
      streamed &= written

    # The sum of a streamed leaf's gradients lives in host memory, where its backward loops
    # write each row: it starts in a copy of its param stack (the host buffer of its shape the
    # step has), whose values the first microbatch's rows replace (``accumulator``).
    # (A stack that should stream but is on the device sums from zeros: ``offload="params"``
    # refuses the step once traced, ``_offload.with_params_placed``.)
    buffers = [p if i in streamed & written else jnp.zeros_like(p)
               for i, p in enumerate(param_leaves)]
    first = analysis.first_state(jax.tree.unflatten(plan.params_def, buffers))

    def body(acc, batch):
      value, acc = accumulate(scaled, has_aux, params, acc, *batch, analysis)
      return acc, value

    total, values = lax.scan(body, first, batches)
    axes = analysis.loop_plan.stacked
    mean = total.sum
    # A whole-leaf update with a global stage holds full-size temporaries (the clipped gradient,
    # read by both of Adam's moments): measured 21.09 MB instead of 18.54 MB for 16 stacked
    # 256x256 layers with clipping and AdamW over 4 microbatches. Without one it is in place, and
    # a row loop would only be slower. A streamed leaf is updated row by row: whole, its param,
    # gradient and slots would all be on the device at once.
    rows = streamed | (frozenset() if plan.is_separable
                       else stacked_rows(plan, axes, state_leaves, param_leaves))
    new_params, new_state, _, _ = apply_update(plan, policy, plan.params_def.flatten_up_to(mean),
                                            state_leaves, param_leaves, rows, axes=axes)
    return ((sum_value(values, has_aux), jax.tree.unflatten(plan.params_def, new_params),
             jax.tree.unflatten(plan.state_def, new_state)), (rows, frozenset(axes), streamed))

  return step


def sum_value(values, has_aux: bool):
  """The step's value from the microbatches' stacked values, each divided by ``k``: their
  losses summed in at least float32, their aux stacked."""
  loss, aux = values if has_aux else (values, None)
  loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32)).sum().astype(loss.dtype)
  return (loss, aux) if has_aux else loss


def _apply(tx: optax.GradientTransformation, grads, state, params) -> tuple[Any, Any]:
  """``tx``'s update of ``params`` from ``grads``; non-float params are kept as they are, and
  so are their integer slots (optax would promote them to float)."""
  updates, new_state = tx.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  return (jax.tree.map(lambda p, n: n if is_float(p) else p, params, new),
          keep_int_state(new_state, state))


def optax_step(loss_fn: Callable, has_aux: bool, microbatches: int, tx):
  """The unfused reference: accumulate all microbatch gradients, average, one optax update."""
  k = microbatches

  def step(params, state, *args, **kwargs):
    mb_args, mb_kwargs = split(args, kwargs, k)
    values, acc = _sum_gradients(loss_fn, has_aux, params, mb_args, mb_kwargs, k)
    grads = jax.tree.map(lambda g: g / k, acc)
    value = (values[0].mean(), values[1]) if has_aux else values.mean()
    return value, *_apply(tx, grads, state, params)

  return step
