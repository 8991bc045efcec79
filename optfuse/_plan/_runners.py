"""Running a plan: a leaf's update whole or one row at a time, the global stage, the statistics.

Every runner takes flat lists ``(grads, state, params, ...)`` whose unread entries may be
``None`` and evaluates the plan's jaxprs on what their ``reads`` masks select.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optax

from optfuse._base._memory_spaces import like
from optfuse._jaxpr import _interpreter, _rows
from optfuse._jaxpr._rows import take_row
from optfuse._plan._fields import slots_only


class Runners:
  """The runners of ``Plan`` (mixed into it: they read ``PlanFields``)."""

  __slots__ = ()

  def _eval(self, jaxpr, reads, grads, state, params, extra=()) -> list[Any]:
    flat = [*self.consts, *grads, *state, *params, *extra]
    return _interpreter.evaluate(jaxpr, (), [x for x, r in zip(flat, reads) if r])

  def _with_leaf(self, i: int, grad, param, slots, state, params) -> tuple[list, list, list]:
    """Flat grads, state and params with leaf ``i``'s gradient, param and slots put in."""
    grads, state, params = [None] * self.num_params, list(state), list(params)
    grads[i], params[i] = grad, param
    for k, s in zip(self.groups[i].state_outs, slots):
      state[k] = s
    return grads, state, params

  def run_group(self, i: int, grad, state, params, cuts=()) -> tuple[Any, list[Any]]:
    """``(update, new_state[groups[i].state_outs])`` of leaf ``i`` from its whole gradient."""
    grads = [None] * self.num_params
    grads[i] = grad
    group = self.groups[i]
    out = self._eval(group.jaxpr, group.reads, grads, state, params, cuts)
    return out[0], list(out[1:])

  def run_group_slots(self, i: int, grad, state, params, cuts=()) -> list[Any]:
    """``new_state[groups[i].state_outs]`` of leaf ``i`` from its whole gradient, without its
    update (``params[i]`` is not read when ``slots_whole``)."""
    grads = [None] * self.num_params
    grads[i] = grad
    jaxpr, reads = slots_only(self.groups[i])
    return self._eval(jaxpr, reads, grads, state, params, cuts)

  def run_from_cut_gradient(self, i: int, grad, state, params, cuts
                            ) -> tuple[Any, Any, list[Any]]:
    """``(cut_grad, update, new_slots)`` of leaf ``i``: its ``cut_gradient_split``'s head (the
    cut gradient: the clipped one), then the tail from it."""
    (head, head_reads), tail = self.cut_gradient_split(i)
    grads = [None] * self.num_params
    grads[i] = grad
    grads[i], = self._eval(head, head_reads, grads, state, params, cuts)
    out = self._eval(tail.jaxpr, tail.reads, grads, state, params, cuts)
    return grads[i], out[0], list(out[1:])

  def apply_leaf(self, i: int, grad, param, slots, state, params, cuts=(),
                 update_params: bool = True) -> tuple[Any, tuple]:
    """Leaf ``i``'s new param and slots: ``run_group`` with its own param and slots put in
    ``state``/``params``, and ``optax.apply_updates``."""
    _, state, params = self._with_leaf(i, None, param, slots, state, params)
    update, new_slots = self.run_group(i, grad, state, params, cuts)
    new_param = optax.apply_updates(param, update) if update_params else param
    return new_param, tuple(new_slots)

  def readonly(self, i: int, state, params, cuts=()) -> tuple[list, list, list]:
    """What leaf ``i``'s update reads besides its gradient, param and slots: flat state, params
    and cuts with ``None`` at every entry it does not read (and at its own)."""
    group, n, m, c = self.groups[i], self.num_params, self.num_state, len(self.consts)
    reads_s, reads_p = group.reads[c + n:c + n + m], group.reads[c + n + m:c + 2 * n + m]
    reads_c = group.reads[c + 2 * n + m:]
    return ([s if r and k not in group.state_outs else None
             for k, (s, r) in enumerate(zip(state, reads_s))],
            [p if r and j != i else None for j, (p, r) in enumerate(zip(params, reads_p))],
            [x if r else None for x, r in zip(cuts, reads_c)])

  def run_shared(self, state, params) -> list[Any]:
    """The state leaves that depend on no gradient (``count``, hyperparameters...)."""
    return self._eval(self.shared_jaxpr, self.shared_reads, [None] * self.num_params, state,
                      params)

  def run_global(self, grads, state, params) -> tuple[list[Any], list[Any]]:
    """``(cuts, new_state[global_outs])`` from the flat gradients, state and params."""
    if self.global_jaxpr is None:
      return [], []
    out = self._eval(self.global_jaxpr, self.global_reads, grads, state, params)
    return out[:len(self.cuts)], out[len(self.cuts):]

  def row_inputs(self, i: int, state, params, cuts, rows) -> tuple[list, list[bool]]:
    """The inputs leaf ``i``'s group jaxpr reads, and which of them are rows.

    ``rows`` = ``(grad, param, slots)``: one row of the leaf's gradient, param and state slots,
    in place of the whole leaves; the other inputs are ``state``, ``params`` and ``cuts``.
    """
    group, n = self.groups[i], self.num_params
    g, st, pr = self._with_leaf(i, *rows, state, params)
    flat = [*self.consts, *g, *st, *pr, *cuts]
    is_row = ([False] * len(self.consts) + [j == i for j in range(n)]
              + [k in group.state_outs for k in range(self.num_state)]
              + [j == i for j in range(n)] + [False] * len(cuts))
    used = list(zip(flat, is_row, group.reads, strict=True))
    return [x for x, _, r in used if r], [row for _, row, r in used if r]

  def run_group_row(self, i: int, state, params, cuts, rows, index, length: int, axis: int = 0
                    ) -> tuple[Any, list[Any]]:
    """Row ``index`` (along ``axis``) of ``run_group``'s ``(update, new_slots)`` from rows
    ``(grad, param, slots)`` of leaf ``i``.

    Raises:
      NotRowwise: the update combines rows of the stacked leaf.
    """
    args, is_row = self.row_inputs(i, state, params, cuts, rows)
    out = _rows.evaluate_rows(self.groups[i].jaxpr, (), args, is_row, index, length, axis=axis)
    return out[0], list(out[1:])

  def run_stats(self, i: int, grad, state, params) -> list[Any]:
    """Leaf ``i``'s statistics from its gradient (a plan built with ``two_pass=True``)."""
    grads = [None] * self.num_params
    grads[i] = grad
    return self._eval(self.stats.stat_jaxprs[i], self.stats.stat_reads[i], grads, state, params)

  def run_stats_row(self, i: int, grad_row, state, params, index, length: int, axis: int = 0
                    ) -> list[tuple[Any, str]]:
    """Leaf ``i``'s statistics as ``(partial, reduction)`` pairs from one row of its gradient:
    combining the partials of every row with the reduction gives ``run_stats``.

    Raises:
      NotRowwise: a statistic is not a reduction over the whole stacked leaf.
    """
    n, own = self.num_params, self.groups[i].state_outs
    grads = [None] * n
    grads[i] = grad_row
    flat = [*self.consts, *grads, *state, *params]
    is_row = ([False] * len(self.consts) + [j == i for j in range(n)]
              + [k in own for k in range(self.num_state)] + [j == i for j in range(n)])
    # The leaf's param and slots are given whole: their rows are taken where a statistic reads
    # them (a trust ratio's norm of the param, of Adam's update).
    whole = [j >= len(self.consts) + n for j in range(len(flat))]
    used = list(zip(flat, is_row, whole, self.stats.stat_reads[i], strict=True))
    args = [take_row(x, index, length, axis) if row and w else x for x, row, w, r in used if r]
    rows = [row for _, row, _, r in used if r]
    return _rows.evaluate_row_reductions(self.stats.stat_jaxprs[i], args, rows, index, length,
                                         axis=axis)

  def run_combine(self, stats: Sequence[Sequence[Any]], state, params):
    """``(cuts, new_state[global_outs])`` from every leaf's statistics."""
    flat_stats = [s for leaf_stats in stats for s in leaf_stats]
    out = self._eval(self.stats.combine_jaxpr, self.stats.combine_reads,
                     [None] * self.num_params, state, params, flat_stats)
    return out[:len(self.cuts)], out[len(self.cuts):]

  def new_state(self, state, params, slots: dict[int, Sequence[Any]], global_state=()
                ) -> list[Any]:
    """The flat new state: each leaf's new slots (``slots[i]``, leaves absent keep theirs),
    the global stage's state and the shared state, computed from the old ``state``.

    The global and shared leaves take the memory space of the leaves they replace: a leaf
    computed from no state leaf (Adafactor's ``(1,)`` placeholder moments of a leaf it does not
    factor) is made on the device, and ``offload="state"`` keeps it in host memory."""
    new = list(state)
    for i, leaf_slots in slots.items():
      for k, s in zip(self.groups[i].state_outs, leaf_slots):
        new[k] = s
    for k, s in zip(self.global_outs, global_state):
      new[k] = like(s, state[k])
    for k, s in zip(self.shared_outs, self.run_shared(state, params)):
      new[k] = like(s, state[k])
    return new

  def update(self, grads, state, params) -> tuple[list[Any], list[Any]]:
    """The whole update, stage by stage: flat ``(updates, new_state)`` as ``tx.update`` gives."""
    cuts, global_state = self.run_global(grads, state, params)
    updates, slots = [], {}
    for i in range(self.num_params):
      update, slots[i] = self.run_group(i, grads[i], state, params, cuts)
      updates.append(update)
    return updates, self.new_state(state, params, slots, global_state)

