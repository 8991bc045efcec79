"""The backward-fused step: every param leaf updated inside the backward pass.

Each float leaf ``p`` enters the loss through a tap (``_tap``) whose backward rule receives the
leaf's complete gradient and, instead of returning it, runs the leaf's group of the plan and
returns the *new* param and the *new* state slots as the cotangents of the param and of the
slots fed to the tap; stacked leaves of fused scans (``_loops``) are updated row by row in their
backward loops. ``jax.vjp`` of the tapped loss therefore returns the updated params and state,
and the full gradient tree never exists.

Every tap and fused scan also returns a marker (``_tap.rule_marker``) that the step returns
from the differentiated loss and seeds with a one, so JAX runs every backward rule: a leaf the
loss does not read (or only through ``stop_gradient``) gets its rule with a zero gradient,
exactly optax's update without one. What each rule computed comes back as its cotangents, never
through a record of which rules ran. Shared state (``count``, injected hyperparameters) is
computed once per step.

The backward engine runs this step with the optimizer's plan; forward fusion runs it with a
plan whose state is the gradient itself (capturing it into a donated buffer), and gradient
accumulation with one whose state is the running sum.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from optfuse._base._checks import check_loss
from optfuse._base._leaves import is_float, keep_int_state
from optfuse._base._memory_spaces import like, to_device
from optfuse._fusion import _loops
from optfuse._fusion._tap import check_ruled, make_tap, seeds
from optfuse._plan._plan import Plan
from optfuse._targets._backends import LoopPolicy


class LeafUpdater:
  """Runs the fused update of single leaves.

  The backward rules call ``apply`` (a tap's) and ``row_update`` (a fused scan's loop); the
  leaves that have no rule (integer leaves, not trained) are finished by ``finish``.
  """

  def __init__(self, plan: Plan, state_leaves: list, param_leaves: list,
               update_params: bool = True):
    self.plan = plan
    self.state = state_leaves
    self.params = param_leaves
    self.update_params = update_params

  def row_update(self, i: int, grad_row, param_row, slot_rows, readonly, index, length: int,
                 axis: int = 0):
    """Row ``index`` of leaf ``i``'s ``(update, new_slots)``, inside a backward loop."""
    return self.plan.run_group_row(i, readonly[0], readonly[1], (),
                                   (grad_row, param_row, slot_rows), index, length, axis)

  def slots(self, i: int) -> tuple:
    return tuple(self.state[k] for k in self.plan.groups[i].state_outs)

  def readonly(self, i: int) -> tuple[list, list]:
    """The other inputs leaf ``i``'s update reads (shared state, other params), on the
    device."""
    state, params, _ = self.plan.readonly(i, self.state, self.params)
    return [to_device(s) for s in state], params

  def apply(self, i: int, grad, param, slots, readonly):
    """New param and new state slots of leaf ``i`` from its complete gradient; slots in host
    memory (``offload="state"``) are read on the device and written back to the host."""
    new_param, new_slots = self.plan.apply_leaf(i, grad, param, [to_device(s) for s in slots],
                                                *readonly, update_params=self.update_params)
    return new_param, tuple(like(n, s) for n, s in zip(new_slots, slots))

  def finish(self, new_params: dict, new_slots: dict) -> tuple[list, list]:
    """Assembles the new flat params and state from the float leaves' ``new_params`` and
    ``new_slots``; the other leaves are kept as optax keeps them (its zero-gradient update)."""
    params_out, slots_out = list(self.params), {}
    for i in range(self.plan.num_params):
      if i in new_params:
        params_out[i], slots_out[i] = new_params[i], new_slots[i]
        continue
      p = self.params[i]  # an integer leaf, not trained: its int slots stay as they are
      _, slots = self.apply(i, jnp.zeros_like(p), p, self.slots(i), self.readonly(i))
      slots_out[i] = keep_int_state(slots, self.slots(i))
    return params_out, self.plan.new_state(self.state, self.params, slots_out)


def _make_tap(updater: LeafUpdater, i: int) -> Callable:
  """Leaf ``i``'s tap: ``tap(param, (slots, readonly))``, whose rule updates the leaf."""
  def rule(grad, param, operands):
    slots, readonly = operands
    new_param, new_slots = updater.apply(i, grad, param, slots, readonly)
    return new_param, (new_slots, None)

  return make_tap(rule)


def value_and_update(plan: Plan, policy: LoopPolicy, loss_fn: Callable, has_aux: bool, params,
                     state, args: tuple, kwargs: dict, loop_plan: _loops.LoopPlan,
                     update_params: bool = True,
                     pre_updates: dict[int, _loops.PreUpdate] | None = None) -> tuple:
  """One backward-fused step: ``(value, new_params, new_state)``.

  Args:
    plan: the update plan for these params/state.
    policy: the step's per-compiler choices of its loops (``_backends.loop_policy``).
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    params: the params tree.
    state: the optax state.
    args: positional arguments of ``loss_fn`` after params.
    kwargs: keyword arguments of ``loss_fn``.
    loop_plan: ``_loops.analyze``'s plan for this loss and these params.
    update_params: ``False`` leaves the params as they are and updates only the state (used to
      accumulate gradients into a state that holds their sum).
    pre_updates: leaf index -> ``_loops.PreUpdate`` for leaves of fused loops whose rows are
      updated in the forward iteration that reads them (forward fusion).

  Returns:
    ``(value, params, state)`` where value is the loss, or ``(loss, aux)`` with ``has_aux``;
    with ``pre_updates``, a fourth item: leaf index -> ``(param, slots)`` that the forward loops
    updated.
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  state_leaves = jax.tree.leaves(state)
  updater = LeafUpdater(plan, list(state_leaves), list(param_leaves), update_params)
  diff = [i for i, p in enumerate(param_leaves) if is_float(p)]
  tapped_leaves = [i for i in diff if i not in loop_plan.fused_leaves]
  taps = {i: _make_tap(updater, i) for i in tapped_leaves}

  def tapped_loss(diff_params, slots):
    leaves, markers = list(param_leaves), {}
    for i in tapped_leaves:
      leaves[i], markers[(i,)] = taps[i](diff_params[i], (slots[i], updater.readonly(i)))
    for i in loop_plan.fused_leaves:
      leaves[i] = diff_params[i]
    readonly = {i: updater.readonly(i) for i in loop_plan.fused_leaves}
    inputs = _loops.LoopInputs(updater, policy, slots, readonly, dict(pre_updates or {}))
    value, pre_results, loop_markers = loop_plan.call(inputs, leaves, args, kwargs)
    loss, aux = check_loss(value, has_aux)
    return (loss, {**markers, **loop_markers}), (aux, pre_results)

  diff_params = {i: param_leaves[i] for i in diff}
  slots = {i: updater.slots(i) for i in diff}
  (loss, markers), pullback, (aux, pre_results) = jax.vjp(tapped_loss, diff_params, slots,
                                                          has_aux=True)
  check_ruled(diff, markers)
  value = (loss, aux) if has_aux else loss
  new_params, new_slots = pullback((jnp.ones_like(loss), seeds(markers)))
  params_out, state_out = updater.finish(new_params, new_slots)
  out = (value, jax.tree.unflatten(plan.params_def, params_out),
         jax.tree.unflatten(plan.state_def, state_out))
  return out if pre_updates is None else (*out, pre_results)
