"""Backward fusion: every parameter leaf is updated inside the backward pass.

Each float leaf ``p`` enters the loss through a *tap*, an identity function with a
``jax.custom_vjp``. The tap's backward rule receives the leaf's complete gradient (JAX sums the
cotangents of every use before calling it, so a tied weight gets one update) and, instead of
returning that gradient, runs the leaf's slice of ``tx.update`` and returns the *new* param and
the *new* optimizer-state leaves as the cotangents of the param and of the state leaves fed to
the tap. ``jax.vjp`` of the tapped loss therefore returns the updated params and state, and the
full gradient tree never exists.

Leaves whose tap never fires (the loss does not depend on them, or only through
``stop_gradient``) get exactly optax's update with a zero gradient. Shared state (``count``,
injected hyperparameters) is computed once per step.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from optfuse import _loops
from optfuse._errors import LossOutputError
from optfuse._leaves import is_float
from optfuse._plan import UpdatePlan


def keep_int_state(new, old):
  """``new``, except where an integer or bool state leaf of ``old`` changed dtype: ``old`` there.

  Integer and bool params are carried unchanged; optax, run on them with a zero gradient,
  promotes their slots (Adam's ``mu``...) to float. Keeping those slots as they were keeps the
  state's signature stable from step to step (``lax.scan`` over steps, jit caches, donation).
  """
  keep = lambda n, o: o if not is_float(o) and jnp.result_type(n) != jnp.result_type(o) else n
  return jax.tree.map(keep, new, old)


def check_loss(value, has_aux: bool):
  """Splits ``value`` into ``(loss, aux)`` and checks that the loss is a float scalar."""
  if has_aux:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
      returned = (f"an array of shape {jnp.shape(value)}" if hasattr(value, "shape")
                  else f"a {type(value).__name__}")
      raise LossOutputError(
          "has_aux=True but the loss function did not return a (loss, aux) pair; it returned "
          f"{returned}. Return (loss, aux) or use has_aux=False.")
    loss, aux = value
  else:
    loss, aux = value, None
  if isinstance(loss, (tuple, list, dict)):
    raise LossOutputError(
        f"the loss function returned a {type(loss).__name__}, not a scalar; if it returns "
        "(loss, aux), pass has_aux=True.")
  shape, dtype = jnp.shape(loss), jnp.result_type(loss)
  if shape != () or not jnp.issubdtype(dtype, jnp.floating):
    raise LossOutputError(
        f"the loss must be a float scalar, got shape {shape} and dtype {dtype}; reduce it "
        "(e.g. with .mean()) and make it floating point.")
  return loss, aux


class LeafUpdater:
  """Runs the fused update of single leaves, recording which leaves were updated.

  The backward rules call ``update``; leaves that are never updated during the backward pass are
  finished by ``finish`` with a zero gradient, exactly as optax would treat them.
  """

  def __init__(self, plan: UpdatePlan, state_leaves: list, param_leaves: list,
               extra_grads: list | None = None, update_params: bool = True,
               pre_updates: dict | None = None):
    self.plan = plan
    self.state = state_leaves
    self.params = param_leaves
    self.extra = extra_grads
    self.update_params = update_params
    self.fired: set[int] = set()
    self.pre_updates: dict[int, _loops.PreUpdate] = dict(pre_updates or {})
    self.pre_results: dict[int, tuple] = {}
    self.stage = "update"  # one backward pass, which updates (see ``_two_pass`` for two)
    self.stat_inputs: dict[int, tuple] = {}

  def row_update(self, i: int, grad_row, param_row, slot_rows, readonly, index, length: int,
                 axis: int = 0):
    """Row ``index`` of leaf ``i``'s ``(update, new_slots)``, inside a backward loop."""
    return _loops.row_update(self.plan, i, grad_row, param_row, slot_rows, readonly, index,
                             length, axis)

  def slots(self, i: int) -> tuple:
    return tuple(self.state[k] for k in self.plan.groups[i].state_outs)

  def readonly(self, i: int) -> tuple[list, list]:
    """The other inputs leaf ``i``'s update reads (shared state, other params)."""
    group, n, m = self.plan.groups[i], self.plan.num_params, self.plan.num_state
    c = len(self.plan.consts)
    reads_s, reads_p = group.reads[c + n:c + n + m], group.reads[c + n + m:]
    state = [s if r and k not in group.state_outs else None
             for k, (s, r) in enumerate(zip(self.state, reads_s))]
    params = [p if r and j != i else None for j, (p, r) in enumerate(zip(self.params, reads_p))]
    return state, params

  def apply(self, i: int, grad, param, slots, readonly, extra=None):
    """New param and new state slots of leaf ``i`` from its complete gradient."""
    state, params = list(readonly[0]), list(readonly[1])
    for k, s in zip(self.plan.groups[i].state_outs, slots):
      state[k] = s
    params[i] = param
    if extra is not None:
      grad = grad + extra.astype(grad.dtype)
    update, new_slots = self.plan.run_group(i, grad, state, params)
    new_param = optax.apply_updates(param, update) if self.update_params else param
    return new_param, tuple(new_slots)

  def finish(self, new_params: dict, new_slots: dict) -> tuple[list, list]:
    """Assembles the new flat params and state; leaves never fired get a zero gradient."""
    plan = self.plan
    params_out, state_out = list(self.params), list(self.state)
    for i, group in enumerate(plan.groups):
      if i in new_params:
        params_out[i], slots = new_params[i], new_slots[i]
      else:
        p = self.params[i]
        extra = None if self.extra is None else self.extra[i]
        grad = jnp.zeros_like(p) if extra is None else extra.astype(jnp.result_type(p))
        new_p, slots = self.apply(i, grad, p, self.slots(i), self.readonly(i))
        params_out[i] = new_p if is_float(p) else p
        slots = slots if is_float(p) else keep_int_state(slots, self.slots(i))
      for k, s in zip(group.state_outs, slots):
        state_out[k] = s
    for k, s in zip(plan.shared_outs, plan.run_shared(self.state, self.params)):
      state_out[k] = s
    return params_out, state_out


def _make_tap(updater: LeafUpdater, i: int) -> Callable:
  @jax.custom_vjp
  def tap(param, slots, readonly, extra):
    del slots, readonly, extra
    return param

  def fwd(param, slots, readonly, extra):
    return param, (param, slots, readonly, extra)

  def bwd(res, grad):
    param, slots, readonly, extra = res
    updater.fired.add(i)
    new_param, new_slots = updater.apply(i, grad, param, slots, readonly, extra)
    return new_param, new_slots, None, None

  tap.defvjp(fwd, bwd)
  return tap


def value_and_update(plan: UpdatePlan, loss_fn: Callable, has_aux: bool, params, state,
                     args: tuple, kwargs: dict, extra_grads=None, update_params: bool = True,
                     loop_plan: _loops.LoopPlan | None = None,
                     pre_updates: dict[int, _loops.PreUpdate] | None = None) -> tuple:
  """One backward-fused step: ``(value, new_params, new_state)``.

  Args:
    plan: the update plan for these params/state.
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    params: the params tree.
    state: the optax state.
    args: positional arguments of ``loss_fn`` after params.
    kwargs: keyword arguments of ``loss_fn``.
    extra_grads: optional tree like params, added to each leaf's gradient before its update
      (the gradient accumulated over earlier microbatches).
    update_params: ``False`` leaves the params as they are and updates only the state (used to
      accumulate gradients into a state that holds their sum).
    loop_plan: ``_loops.analyze``'s plan for this loss and these params, if already made.
    pre_updates: leaf index -> ``_loops.PreUpdate`` for leaves of fused loops whose rows are
      updated in the forward iteration that reads them (forward fusion).

  Returns:
    ``(value, params, state)`` where value is the loss, or ``(loss, aux)`` with ``has_aux``;
    with ``pre_updates``, a fourth item: leaf index -> ``(param, slots)`` that the forward loops
    updated.
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  state_leaves = jax.tree.leaves(state)
  extra = None if extra_grads is None else plan.params_def.flatten_up_to(extra_grads)
  updater = LeafUpdater(plan, list(state_leaves), list(param_leaves), extra, update_params,
                        pre_updates)
  diff = [i for i, p in enumerate(param_leaves) if is_float(p)]
  if loop_plan is None:
    loop_plan = _loops.analyze(loss_fn, plan, params, list(state_leaves), args, kwargs, diff)
  tapped_leaves = [i for i in diff if i not in loop_plan.fused_leaves]
  taps = {i: _make_tap(updater, i) for i in tapped_leaves}

  def tapped_loss(diff_params, slots):
    leaves = list(param_leaves)
    for i in tapped_leaves:
      leaves[i] = taps[i](diff_params[i], slots[i], updater.readonly(i),
                          None if extra is None else extra[i])
    for i in loop_plan.fused_leaves:
      leaves[i] = diff_params[i]
    value = loop_plan.call(updater, leaves, slots, args, kwargs)
    loss, aux = check_loss(value, has_aux)
    return loss, (aux, dict(updater.pre_results))

  diff_params = {i: param_leaves[i] for i in diff}
  slots = {i: updater.slots(i) for i in diff}
  loss, pullback, (aux, pre_results) = jax.vjp(tapped_loss, diff_params, slots, has_aux=True)
  value = (loss, aux) if has_aux else loss
  seed = jnp.ones_like(loss)
  new_params, new_slots = pullback(seed)
  fired = updater.fired
  params_out, state_out = updater.finish(
      {i: new_params[i] for i in diff if i in fired},
      {i: new_slots[i] for i in diff if i in fired})
  out = (value, jax.tree.unflatten(plan.params_def, params_out),
         jax.tree.unflatten(plan.state_def, state_out))
  return out if pre_updates is None else (*out, pre_results)
