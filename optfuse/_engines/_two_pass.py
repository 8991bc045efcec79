"""Two-pass backward: global transforms (clipping, apply_if_finite) fused into the backward pass.

``optfuse.fuse(tx, mode="backward", global_ops="two_pass")`` runs the forward pass once and its
pullback twice. Each float leaf enters the loss through a tap (an identity with a
``jax.custom_vjp``, ``_tap``):

* in the first backward pass each tap's rule computes its leaf's *statistics* (its squared norm,
  whether it is finite: ``_plan.StatsPlan``) from the leaf's complete gradient and returns them
  as the cotangent of a zero input, so only statistics leave the pass;
* the *combine* step turns every leaf's statistics into the *cuts* (the clipping factor, the
  all-finite flag) and the global state;
* in the second backward pass, over the same forward residuals, each tap's rule runs its leaf's
  group with the cuts and returns the new param and state leaves as cotangents.

No gradient tree is ever materialised. With gradient accumulation (``microbatches=k``,
``_accumulate.fused_step``) the sum of the microbatches' gradients is a buffer anyway: each
backward pass adds to it in place, once, and the global stage then reads it directly, so
there is no second pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optfuse._base import _leaves
from optfuse._base._checks import check_loss
from optfuse._base._errors import NonSeparableError
from optfuse._engines import _backward
from optfuse._engines._engine import Placed
from optfuse._fusion import _loops
from optfuse._fusion._row_buffers import value_after
from optfuse._fusion._tap import TwoPassPhase, check_ruled, make_tap, seeds
from optfuse._plan import _make
from optfuse._plan._plan import Plan
from optfuse._targets._backends import LoopPolicy, loop_policy


def _carry(x):
  """A statistic as a cotangent: bool statistics travel as exact 0.0/1.0 float32."""
  return x.astype(jnp.float32) if jnp.result_type(x) == jnp.bool_ else x


def _uncarry(x, aval: jax.ShapeDtypeStruct):
  return x != 0 if aval.dtype == jnp.bool_ else x


class _Updater:
  """What the backward loops of fused scans (``_loops._fused_scan``) ask of a two-pass step.

  In the first backward pass each row of a scanned leaf's gradient is reduced into the leaf's
  statistics (``row_stats``); in the second each row is updated (``row_update``) with the cuts
  the statistics combine into, which the step's ``phase`` holds by then.
  """

  def __init__(self, plan: Plan, state_leaves: list, param_leaves: list, phase: TwoPassPhase):
    self.plan = plan
    self.state = state_leaves
    self.params = param_leaves
    self.phase = phase
    self.update_params = True

  def row_update(self, i: int, grad_row, param_row, slot_rows, readonly, index, length: int,
                 axis: int = 0):
    del readonly  # none given: the rows read the whole state and params from here
    _, cuts = self.phase.read((i,))
    return self.plan.run_group_row(i, self.state, self.params, cuts,
                                   (grad_row, param_row, slot_rows), index, length, axis)

  def row_stats(self, i: int, grad_row, index, length: int, axis: int = 0):
    return self.plan.run_stats_row(i, grad_row, self.state, self.params, index, length, axis)


def value_and_update(plan: Plan, policy: LoopPolicy, loss_fn: Callable, has_aux: bool, params,
                     state, args: tuple, kwargs: dict, loop_plan: _loops.LoopPlan
                     ) -> tuple[Any, Any, Any]:
  """One two-pass backward step: ``(value, params, state)``, exactly optax's update.

  Args:
    plan: a plan with a global stage split into per-leaf statistics
      (``_make.make_plan(..., global_handling="if_needed")``).
    policy: the step's per-compiler choices of its loops (``_backends.loop_policy``).
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    params: the params tree.
    state: the optax state.
    args: positional arguments of ``loss_fn`` after params.
    kwargs: keyword arguments of ``loss_fn``.
    loop_plan: ``_loops.analyze``'s plan of the loss with ``two_pass=True``: the scanned
      leaves whose rows are reduced to their statistics one at a time and updated one at a
      time inside the backward loops; the others get taps.

  Returns:
    ``(value, params, state)`` where value is the loss, or ``(loss, aux)`` with ``has_aux``.
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  state_leaves = jax.tree.leaves(state)
  diff = [i for i, p in enumerate(param_leaves) if _leaves.is_float(p)]
  phase = TwoPassPhase()
  updater = _Updater(plan, state_leaves, param_leaves, phase)
  tapped_leaves = [i for i in diff if i not in loop_plan.fused_leaves]

  def slots_of(i):
    return tuple(state_leaves[k] for k in plan.groups[i].state_outs)

  def apply(i, grad, param, slots, cuts):
    return plan.apply_leaf(i, grad, param, slots, state_leaves, param_leaves, cuts)

  def tap_rule(i):
    def rule(grad, param, operands):
      slots, _ = operands
      stats_pass, cuts = phase.read((i,))
      if stats_pass:
        params_in = list(param_leaves)
        params_in[i] = param
        stats = plan.run_stats(i, grad, state_leaves, params_in)
        return None, (None, tuple(_carry(s) for s in stats))
      new_param, new_slots = apply(i, grad, param, slots, cuts)
      return new_param, (new_slots, None)

    return rule

  taps = {i: make_tap(tap_rule(i)) for i in tapped_leaves}
  stat_avals = plan.stats.stats if plan.stats is not None else ((),) * plan.num_params

  def tapped_loss(diff_params, slots, stat_zeros):
    leaves, markers = list(param_leaves), {}
    for i in tapped_leaves:
      leaves[i], markers[(i,)] = taps[i](diff_params[i], (slots[i], stat_zeros[i]))
    for i in loop_plan.fused_leaves:
      leaves[i] = diff_params[i]
    inputs = _loops.LoopInputs(updater, policy, slots, stat_inputs=stat_zeros, phase=phase)
    value, _, loop_markers = loop_plan.call(inputs, leaves, args, kwargs)
    loss, aux = check_loss(value, has_aux)
    return (loss, {**markers, **loop_markers}), aux

  stat_zeros = {i: tuple(jnp.zeros(a.shape, jnp.result_type(_carry(jnp.zeros((), a.dtype))))
                         for a in stat_avals[i]) for i in diff}
  slots = {i: slots_of(i) for i in diff}
  (loss, markers), pullback, aux = jax.vjp(tapped_loss, {i: param_leaves[i] for i in diff},
                                           slots, stat_zeros, has_aux=True)
  check_ruled(diff, markers)
  seed = (jnp.ones_like(loss), seeds(markers))
  cuts, global_state = [], []
  if plan.stats is not None:
    with phase.pass_(True, [], diff):
      _, _, stat_cts = pullback(seed)
    stats = []
    for i, p in enumerate(param_leaves):
      if i in stat_cts:
        stats.append([_uncarry(x, a) for x, a in zip(stat_cts[i], stat_avals[i])])
      else:  # not trained: optax sees a zero gradient
        stats.append(plan.run_stats(i, jnp.zeros_like(p), state_leaves, param_leaves))
    cuts, global_state = plan.run_combine(stats, state_leaves, param_leaves)
    # Without the order XLA runs the two backward passes side by side (the second one's
    # cotangents depend on nothing the first computes) and keeps each weight gradient of the
    # second pass alive until the global statistics are known: optax's memory. Every leaf's
    # statistics order it, not the cuts alone: an update that reads none (SM3's, whose
    # statistics are only its new state) would otherwise let XLA run the second pass, which
    # writes the param and slot stacks in place, before the first has read them, and copy
    # every stack to keep both (measured: 32 MB more on an 8-layer d=256 decoder).
    first = seed[0]
    for dep in (cuts, global_state, *stats):
      first = value_after(first, dep)
    seed = (first, seed[1])
  with phase.pass_(False, cuts, diff):
    new_params, new_slots, _ = pullback(seed)

  params_out, state_out = _finish(plan, new_params, new_slots, param_leaves, state_leaves,
                                  cuts, global_state)
  value = (loss, aux) if has_aux else loss
  return (value, jax.tree.unflatten(plan.params_def, params_out),
          jax.tree.unflatten(plan.state_def, state_out))


def _finish(plan: Plan, new_params: dict, new_slots: dict, param_leaves: list,
            state_leaves: list, cuts, global_state) -> tuple[list, list]:
  """The flat new params and state: the float leaves' cotangents (``new_params``,
  ``new_slots``), and the integer leaves kept as optax keeps them."""
  params_out, slots_out = list(param_leaves), {}
  for i, p in enumerate(param_leaves):
    slots = tuple(state_leaves[k] for k in plan.groups[i].state_outs)
    if i in new_params:
      params_out[i], slots_out[i] = new_params[i], new_slots[i]
      continue
    # Not trained: optax's zero-gradient update would promote its int slots to float.
    _, new = plan.apply_leaf(i, jnp.zeros_like(p), p, slots, state_leaves, param_leaves, cuts)
    slots_out[i] = _leaves.keep_int_state(new, slots)
  return params_out, plan.new_state(state_leaves, param_leaves, slots_out, global_state)


def _reads_cuts(plan: Plan, i: int) -> bool:
  """Whether leaf ``i``'s update reads the cuts (its group's last inputs)."""
  return any(plan.groups[i].reads[len(plan.consts) + 2 * plan.num_params + plan.num_state:])


def _needs_statistics(plan: Plan, separable: Plan, i: int) -> bool:
  """Whether leaf ``i``'s loop needs the first pass: its update reads the cuts, or a slot of
  its state is written by the combine step (SM3's accumulators of the non-layer axes, which
  the separable plan keeps with the leaf)."""
  return _reads_cuts(plan, i) or plan.groups[i].state_outs != separable.groups[i].state_outs


class TwoPassEngine(_backward.BackwardEngine):
  """``mode="backward", global_ops="two_pass"``: backward fusion of global transforms, and of
  norms over whole stacked leaves; a separable transform runs the one-pass backward step, unless
  its norms over whole leaves let it update a stacked leaf in a loop."""

  two_pass = True

  def __init__(self, tx, options):
    super().__init__(tx, options)
    # A separable transform whose updates read norms over whole leaves (LAMB) needs the first
    # pass only for a stacked leaf whose loop reads them; without one, one pass computes them.
    self.one_pass = _backward.BackwardEngine(tx, options)

  def separable(self, params, state) -> bool:
    try:
      self.one_pass.plan(params, state)
    except NonSeparableError:
      return False
    return True

  def make_plan(self, params, state) -> Plan:
    return _make.make_plan(self.tx, params, state, global_handling="if_needed")

  def reasons(self, loop_plan: _loops.LoopPlan, params, state) -> dict[int, str]:
    return dict(loop_plan.reasons)

  def fused(self, loss_fn: Callable, has_aux: bool, params, state, args: tuple, kwargs: dict,
            refused: _backward.Refused = ()) -> tuple[tuple, Placed]:
    plan = self.plan(params, state, refused)
    if plan.is_separable:
      return super().fused(loss_fn, has_aux, params, state, args, kwargs, refused)
    loop_plan = self.analyze(loss_fn, params, state, args, kwargs, refused)
    if self.separable(params, state) and not any(
        _needs_statistics(plan, self.one_pass.plan(params, state), i)
        for i in loop_plan.fused_leaves):
      return self.one_pass.fused(loss_fn, has_aux, params, state, args, kwargs, refused)
    return (value_and_update(plan, loop_policy(two_pass=True), loss_fn, has_aux, params, state,
                             args, kwargs, loop_plan),
            Placed(dict.fromkeys(loop_plan.fused_leaves, "loop"), dict(loop_plan.reasons)))
