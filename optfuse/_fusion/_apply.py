"""Applying an update once the whole gradient exists: leaf by leaf, stacked leaves row by row.

Forward fusion applies the pending gradient at the start of the next step, and gradient
accumulation applies the sum of the microbatches' gradients after the loop over them: in both
the gradient is a buffer, and the update runs outside any backward pass. Two formulations keep
its temporaries to one leaf's (or one row's):

* the leaves of ``rows`` (stacked layers) are updated one row per iteration of a loop, in place:
  the whole update would build each full-size intermediate it cannot fuse into all its
  consumers (the clipped gradient, read by both of Adam's moments); a row loop holds one row.
  Stacked leaves whose whole update is in place (``Plan.in_place_whole``: AdamW) are not rows:
  whole, XLA updates them in a few elementwise passes, faster than a loop. Nor are those of
  ``from_cut`` (clipping before AdamW, ``Plan.in_place_from_cut_gradient``): their cut
  gradient (the clipped one) is computed first and returned, for the caller to let it take
  over the gradient's buffer, and the rest of the update runs whole from it, in place.
* with a global stage (clipping), the other leaves are updated one after the other: each
  leaf's update reads its gradient only once the previous leaf's new param exists
  (``value_after``). XLA would otherwise run each part of the update (the clipping, the
  moments, the step) over every leaf before the next, holding a whole tree of its temporaries
  (measured, a 16-layer 256x256 MLP with clipping and AdamW over 4 microbatches: 8.39 MB of
  temporaries unordered, 4.61 MB ordered with two-pass and 0.42 MB in forward mode). A
  separable update runs leaf by leaf anyway: on the bench's models the order changed no peak
  and cost up to 0.1 s of compile time. A row loop's gradient is not ordered: the ordered copy
  would be a full-size buffer the loop reads (measured: 22.16 MB instead of 18.28 MB for 16
  stacked 256x256 layers).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optfuse._base._leaves import is_float, keep_int_state
from optfuse._base._memory_spaces import is_host, like, to_device
from optfuse._fusion._row_buffers import Stack, row_at, row_loop, value_after
from optfuse._jaxpr._rows import ROW_COMBINE, NotRowwise
from optfuse._plan._plan import Plan
from optfuse._targets._backends import LoopPolicy


def apply_update(plan: Plan, policy: LoopPolicy, grads: list, state: list, params: list,
                 rows: frozenset[int] = frozenset(), deferred: frozenset[int] = frozenset(),
                 axes: dict | None = None, from_cut: frozenset[int] = frozenset(),
                 rows_if: jax.Array | None = None) -> tuple[list, list, list, list]:
  """The plan's update of flat ``params`` and ``state`` from the flat ``grads``, applied.

  Args:
    plan: the plan of the optimizer for these params and state.
    policy: the step's per-compiler choices of its row loops (``_backends.loop_policy``).
    grads: the flat gradient, one leaf per param leaf.
    state: the flat optimizer state.
    params: the flat params.
    rows: leaves updated row by row in place (``update_rows``), along ``axes[i]``.
    deferred: leaves left as they are (their param and slots come back unchanged).
    axes: leaf -> the axis its rows are stacked along (default 0).
    from_cut: leaves updated whole through their ``Plan.cut_gradient_split``: the cut gradient
      (the clipped one) first, then the rest of the update from it, in place.
    rows_if: a scalar bool, or ``None`` (true): whether the row loops write their new rows;
      where false, each row is written back as it was (``update_rows``).

  Returns:
    ``(new_params, new_state, cuts, cut_grads)``: flat, with the cuts of the plan's global
    stage, and ``grads`` with the cut gradient of each ``from_cut`` leaf in place of its
    gradient (a caller that returns it lets XLA write it over the gradient's buffer). Non-float
    params are kept, with their integer slots.
  """
  cuts, global_state = global_stage(plan, grads, state, params, axes or {})
  new_params, slots, previous, cut_grads = list(params), {}, None, list(grads)
  for i, p in enumerate(params):
    if i in deferred:
      continue
    old = [state[k] for k in plan.groups[i].state_outs]
    if i in from_cut:
      cut_grads[i], update, slots[i] = plan.run_from_cut_gradient(i, to_device(grads[i]),
                                                          _on_device(plan, i, state), params, cuts)
      cut_grads[i] = like(cut_grads[i], grads[i])
      new_params[i] = optax.apply_updates(p, update)
    elif i in rows:
      new_params[i], slots[i] = update_rows(plan, policy, i, grads[i], state, params, cuts,
                                            (axes or {}).get(i, 0), rows_if)
    else:
      ordered = previous is not None and not plan.is_separable
      grad = to_device(grads[i])
      grad = value_after(grad, previous) if ordered else grad
      update, slots[i] = plan.run_group(i, grad, _on_device(plan, i, state), params, cuts)
      if is_float(p):
        new_params[i] = optax.apply_updates(p, update)
    slots[i] = [like(n, o) for n, o in zip(slots[i], old)]
    if is_float(p):
      previous = new_params[i]
    else:
      slots[i] = keep_int_state(tuple(slots[i]), tuple(old))
  return new_params, plan.new_state(state, params, slots, global_state), cuts, cut_grads


def global_stage(plan: Plan, grads: list, state: list, params: list, axes: dict
                 ) -> tuple[list, list]:
  """``(cuts, new_state[global_outs])`` of the plan's global stage (the clipping factor...).

  From gradients in host memory (forward fusion with ``offload="state"``) it is computed from
  per-leaf statistics (``Plan.stats``, a plan built with ``two_pass=True``): a stacked leaf's
  one row at a time, each row moved to the device and reduced, so that the device never holds
  a whole gradient leaf; the others' whole, one leaf at a time.
  """
  if plan.global_jaxpr is None or plan.stats is None or not any(is_host(g) for g in grads):
    return plan.run_global(grads, state, params)
  stats = [_leaf_stats(plan, i, g, state, params, axes.get(i)) for i, g in enumerate(grads)]
  return plan.run_combine(stats, state, params)


def _leaf_stats(plan: Plan, i: int, grad, state: list, params: list, axis: int | None) -> list:
  """Leaf ``i``'s statistics, reduced row by row along ``axis`` when its gradient lives in host
  memory and they are reductions over the rows (``Plan.run_stats_row``), else whole."""
  if axis is None or not is_host(grad) or not plan.stats.stats[i]:
    return plan.run_stats(i, to_device(grad), state, params)
  shape = jnp.shape(grad)
  length, row = shape[axis], jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], grad.dtype)
  found: list = []  # (partial, reduction) of each statistic, on an abstract row
  try:
    jax.eval_shape(lambda g: found.extend(plan.run_stats_row(i, g, state, params, 0, length,
                                                             axis)) or 0, row)
  except NotRowwise:
    return plan.run_stats(i, to_device(grad), state, params)

  def body(k, accs):
    partials = plan.run_stats_row(i, row_at(grad, k, axis), state, params, k, length, axis)
    return tuple(ROW_COMBINE[r].combine(a, v.astype(a.dtype)) for a, (v, r) in zip(accs, partials))

  init = tuple(ROW_COMBINE[r].identity(v.shape, v.dtype) for v, r in found)
  return list(lax.fori_loop(0, length, body, init))


def _on_device(plan: Plan, i: int, state: list) -> list:
  """The flat ``state`` with leaf ``i``'s slots on the device (``offload="state"`` keeps them
  in host memory): the whole update reads them there."""
  state = list(state)
  for k in plan.groups[i].state_outs:
    state[k] = to_device(state[k])
  return state


def stacked_rows(plan: Plan, axes: dict, state: list, params: list) -> frozenset[int]:
  """The stacked leaves (``axes``: leaf -> its stacked axis) to update row by row: those whose
  update never mixes rows and, run whole, would hold a full-size temporary
  (``Plan.in_place_whole``); the others are updated whole, in place and faster."""
  return frozenset(i for i in axes if not plan.in_place_whole(i)
                   and plan.rowwise(i, state, params, axis=axes[i]))


def stacked_from_cut_gradient(plan: Plan, axes: dict, params: list) -> frozenset[int]:
  """The stacked float leaves (``axes``) whose update is not in place whole but is from their
  cut gradient (``Plan.in_place_from_cut_gradient``: the clipped gradient written over the
  gradient's buffer, then AdamW whole from it)."""
  return frozenset(i for i in axes if is_float(params[i]) and not plan.in_place_whole(i)
                   and plan.in_place_from_cut_gradient(i))


def update_rows(plan: Plan, policy: LoopPolicy, i: int, grad, state: list, params: list,
                cuts: list, axis: int = 0, rows_if: jax.Array | None = None
                ) -> tuple[Any, list]:
  """Leaf ``i``'s new param and state slots from its gradient ``grad``, one row per iteration,
  written in place.

  With ``rows_if`` (a scalar bool) each row written is the new one where it is true and the old
  one where it is false. A caller that chooses between the updated and the old stacks chooses
  so, row by row: a select between the loop's whole output and the stack it read would keep
  both stacks, and the GPU compiler copies the param and slot stacks whole before the loop
  (``tests/engines/test_in_place.py``).

  The slots are written in the loop too. Updating them whole after it, as the forward loop
  does when ``plan.slots_whole(i)``, makes XLA copy the whole param stack twice inside the
  ``lax.cond`` of forward fusion's pending update (measured, 8 stacked 512x512 AdamW layers
  under ``jax.checkpoint``: 49.96 MB instead of 43.65 MB).
  """
  group, length = plan.groups[i], jnp.shape(params[i])[axis]

  def body(k, index, param_rows, read, carry):
    del k
    # The gradient is a buffer: its rows are slices, and the slot rows need no order after
    # them (``_row_buffers``).
    grad_row = row_at(grad, index, axis)
    old_slots = read(0, None)
    update, new_slots = plan.run_group_row(i, state, params, cuts,
                                           (grad_row, param_rows[0], old_slots), index,
                                           length, axis)
    new_param = optax.apply_updates(param_rows[0], update)
    if rows_if is not None:
      new_param, new_slots = jax.tree.map(lambda new, old: jnp.where(rows_if, new, old),
                                          (new_param, list(new_slots)),
                                          (param_rows[0], list(old_slots)))
    return [(new_param, new_slots)], carry

  stack = Stack(params[i], tuple(state[k] for k in group.state_outs), axis)
  (stack,), _ = row_loop(policy, length, lambda k: k, [stack], body, ())
  return stack.param, list(stack.slots)
