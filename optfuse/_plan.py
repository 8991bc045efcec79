"""The update plan: ``tx.update`` for one params/state signature, split per parameter leaf.

For flat gradients ``g``, state ``s`` and params ``p`` the traced update computes ``updates,
new_state``. Following data dependencies (never names), its outputs split into:

* one *group* per leaf ``i``: the leaf's update and the state it owns (Adam's ``mu`` and
  ``nu``), computed from its own gradient, in that leaf's backward rule or loop row;
* the *shared* state, which depends on no gradient (``count``, injected hyperparameters),
  computed once per step;
* for a global transform only, the *global stage*: the values several groups read that depend
  on several gradients (the clipping factor, the all-finite flag: the *cuts*) and the state no
  single leaf owns, with, for two-pass backward, the same stage as per-leaf *statistics* and a
  *combine* step (``StatsPlan``).

A separable transform (``_split.make_plan``) has no global stage; ``_global.make_global_plan``
finds it for the others. Either way the result is one ``Plan``, and every mode runs it with the
same runners: a whole leaf (``run_group``), one row of a stacked leaf (``run_group_row``), the
stage and the statistics, and one predicate says whether a leaf runs row by row
(``row_refusal``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore

from optfuse import _in_place, _jaxpr, _rows
from optfuse._checks import is_tracing, signature


class LeafGroup(NamedTuple):
  """What the update of one parameter leaf computes.

  Attributes:
    leaf: index of the parameter leaf in ``jax.tree.leaves(params)``.
    state_outs: flat indices of the state leaves this leaf writes.
    jaxpr: the update pruned to ``(update, *new_state[state_outs])``; it takes, of the flat
      inputs ``(consts, grads, state, params, *cuts)``, those ``reads`` selects.
    reads: which of those inputs the pruned jaxpr reads; its invars are exactly those.
    reads_grad: whether the outputs depend on the gradient at all.
  """

  leaf: int
  state_outs: tuple[int, ...]
  jaxpr: jcore.Jaxpr
  reads: tuple[bool, ...]
  reads_grad: bool


class StatsPlan(NamedTuple):
  """The global stage as per-leaf statistics and a combine step (two-pass backward).

  Attributes:
    stats: for each param leaf, the shapes/dtypes of the statistics it contributes.
    stat_jaxprs: for each param leaf, a jaxpr from ``(consts, grads, state, params)`` to its
      statistics (it reads only that leaf's gradient).
    stat_reads: which inputs each ``stat_jaxprs`` entry reads.
    combine_jaxpr: from ``(consts, grads, state, params, *statistics of every leaf in leaf
      order)`` to ``(*cuts, *global state leaves)``; it reads no gradient.
    combine_reads: which inputs ``combine_jaxpr`` reads.
  """

  stats: tuple[tuple[jax.ShapeDtypeStruct, ...], ...]
  stat_jaxprs: tuple[jcore.Jaxpr, ...]
  stat_reads: tuple[tuple[bool, ...], ...]
  combine_jaxpr: jcore.Jaxpr
  combine_reads: tuple[bool, ...]


def _row_spec(x, axis: int) -> jax.ShapeDtypeStruct:
  shape = jnp.shape(x)
  return jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], jnp.result_type(x))


@functools.lru_cache(maxsize=1024)
def _slots_only(group: LeafGroup) -> tuple[jcore.Jaxpr, tuple[bool, ...]]:
  """``group`` pruned to its new state slots, and which flat inputs it reads: once per group
  (plans are cached per signature, and both ``Plan.slots_whole`` and ``run_group_slots`` ask)."""
  jaxpr, used = _jaxpr.prune(group.jaxpr, [False] + [True] * len(group.state_outs))
  used = iter(used)
  return jaxpr, tuple(next(used) if r else False for r in group.reads)


class Plan(NamedTuple):
  """``tx.update`` for one params/state signature, split per leaf (see the module docstring).

  Every jaxpr here takes, of the flat inputs ``(consts, grads, state, params, ...)``, only
  those its ``reads`` mask selects; the runners take flat lists, whose unread entries may be
  ``None``.

  Attributes:
    params_def: treedef of the params.
    state_def: treedef of the optimizer state.
    num_params: number of param leaves ``n``.
    num_state: number of state leaves ``m``.
    consts: constants of the traced update, the leading inputs of the jaxprs.
    groups: one ``LeafGroup`` per param leaf.
    shared_outs: flat indices of the state leaves that depend on no gradient.
    shared_jaxpr: from ``(consts, grads, state, params)`` to those state leaves.
    shared_reads: which inputs ``shared_jaxpr`` reads.
    cuts: shapes/dtypes of the values the global stage hands to the groups.
    global_outs: flat indices of the state leaves the global stage writes.
    global_jaxpr: from ``(consts, grads, state, params)`` to ``(*cuts,
      *new_state[global_outs])``, or ``None`` for a separable transform.
    global_reads: which inputs ``global_jaxpr`` reads.
    stats: the global stage as per-leaf statistics, or ``None`` unless asked for.
    refused: ``(leaf, why)`` pairs, leaves kept out of every loop (the memory guard's taps).
  """

  params_def: Any
  state_def: Any
  num_params: int
  num_state: int
  consts: tuple[Any, ...]
  groups: tuple[LeafGroup, ...]
  shared_outs: tuple[int, ...]
  shared_jaxpr: jcore.Jaxpr
  shared_reads: tuple[bool, ...]
  cuts: tuple[jax.ShapeDtypeStruct, ...] = ()
  global_outs: tuple[int, ...] = ()
  global_jaxpr: jcore.Jaxpr | None = None
  global_reads: tuple[bool, ...] = ()
  stats: StatsPlan | None = None
  refused: tuple[tuple[int, str], ...] = ()

  @property
  def is_separable(self) -> bool:
    """Whether the update of every leaf reads only its own gradient."""
    return not self.cuts and not self.global_outs

  def _eval(self, jaxpr, reads, grads, state, params, extra=()) -> list[Any]:
    flat = [*self.consts, *grads, *state, *params, *extra]
    return _jaxpr.evaluate(jaxpr, (), [x for x, r in zip(flat, reads) if r])

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

  def _slots_only(self, i: int) -> tuple[jcore.Jaxpr, tuple[bool, ...]]:
    """Leaf ``i``'s group pruned to its new state slots, and which flat inputs it reads."""
    return _slots_only(self.groups[i])

  def slots_whole(self, i: int) -> bool:
    """Whether a row loop that updates leaf ``i``'s param may leave its state slots to one
    whole pass after the loop (``run_group_slots``).

    They may when they read neither the param, which the loop overwrites in place, nor the
    global stage's cuts: XLA then holds the gradient scaled by the cut (the clipped gradient,
    read by both of Adam's moments) as a full-size buffer (measured, the quick suite's scanned
    MLP in forward mode with clipping: 12.05 MB instead of 10.40 MB).
    """
    group, n, m, c = self.groups[i], self.num_params, self.num_state, len(self.consts)
    reads = self._slots_only(i)[1]
    return bool(group.state_outs) and not reads[c + n + m + i] and not any(
        reads[c + 2 * n + m:])

  def in_place_whole(self, i: int) -> bool:
    """Whether leaf ``i``'s whole update runs in place (``_in_place.in_place``): otherwise XLA
    holds a full-size temporary (measured, the quick suite's scanned MLP in forward mode: Lion
    9.55 MB whole, 8.02 MB row by row), which a row loop holds one row of."""
    g = self.groups[i]
    return _in_place.in_place(g.jaxpr, g.reads, i, g.state_outs, len(self.consts),
                              self.num_params, self.num_state)

  def gradient_stage(self, i: int) -> tuple[tuple[jcore.Jaxpr, tuple[bool, ...]],
                                            LeafGroup] | None:
    """Leaf ``i``'s update split at its clipped gradient (``_in_place.gradient_stage``):
    ``((head, reads), tail)``, the tail a ``LeafGroup`` reading it in the gradient's place."""
    g = self.groups[i]
    stage = _in_place.gradient_stage(g.jaxpr, g.reads, i, len(self.consts), self.num_params,
                                     self.num_state)
    return None if stage is None else (stage[0], LeafGroup(i, g.state_outs, *stage[1], True))

  def staged_in_place(self, i: int) -> bool:
    """Whether leaf ``i``'s update, once its clipped gradient is staged over the gradient's
    buffer, runs whole in place (measured, that MLP with clipping: 10.27 MB staged, 11.64 MB
    whole, 10.40 MB row by row)."""
    stage = self.gradient_stage(i)
    return stage is not None and _in_place.in_place(
        stage[1].jaxpr, stage[1].reads, i, stage[1].state_outs, len(self.consts),
        self.num_params, self.num_state)

  def run_staged(self, i: int, grad, state, params, cuts) -> tuple[Any, Any, list[Any]]:
    """``(staged, update, new_slots)`` of leaf ``i``: its ``gradient_stage``'s head, then the
    tail from it."""
    (head, head_reads), tail = self.gradient_stage(i)
    grads = [None] * self.num_params
    grads[i] = grad
    grads[i], = self._eval(head, head_reads, grads, state, params, cuts)
    out = self._eval(tail.jaxpr, tail.reads, grads, state, params, cuts)
    return grads[i], out[0], list(out[1:])

  def run_group_slots(self, i: int, grad, state, params, cuts=()) -> list[Any]:
    """``new_state[groups[i].state_outs]`` of leaf ``i`` from its whole gradient, without its
    update (``params[i]`` is not read when ``slots_whole``)."""
    grads = [None] * self.num_params
    grads[i] = grad
    jaxpr, reads = self._slots_only(i)
    return self._eval(jaxpr, reads, grads, state, params, cuts)

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

  def min_rows(self, i: int) -> int:
    """The shortest stack that leaf ``i`` pays to update row by row.

    A row loop removes the stacked gradient (``length`` rows) but keeps rows in flight: the
    row's gradient and the param and state rows read out of their buffers. Below ``2 + slots``
    rows that costs more than it saves (measured: a 3-layer scan with AdamW used one row more
    temp memory fused), and the leaf is updated whole.
    """
    return 2 + len(self.groups[i].state_outs)

  def row_refusal(self, i: int, state, params, axis: int = 0, stats: bool = False
                  ) -> str | None:
    """Why leaf ``i`` is not updated row by row along ``axis``, or ``None`` when it is.

    It is when the leaf has at least ``min_rows`` rows, its state slots are stacked like it,
    and its update computes row ``l`` from row ``l`` of its gradient, param and slots only
    (with ``stats``: and its statistics are reductions whose rows combine, ``run_stats_row``).
    This is the one test of every mode: backward loops, two-pass loops, forward loops and row
    updates before the loss.
    """
    if (refused := dict(self.refused).get(i)) is not None:
      return refused
    group, p = self.groups[i], params[i]
    shape = jnp.shape(p)
    length = shape[axis] if len(shape) > axis else 0
    if length < self.min_rows(i):
      return (f"its loop has {length} iterations, fewer than the {self.min_rows(i)} from which "
              "updating row by row pays (the rows in flight cost more than the stack)")
    if any(jnp.ndim(state[k]) != len(shape) or jnp.shape(state[k])[axis] != length
           for k in group.state_outs):
      return "its optimizer state is not stacked like the param"
    row = _row_spec(p, axis)
    rows = (row, row, [_row_spec(state[k], axis) for k in group.state_outs])
    spec = lambda x: None if x is None else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
    state, params = [spec(s) for s in state], [spec(q) for q in params]
    try:
      jax.eval_shape(lambda rows, cuts: self.run_group_row(i, state, params, cuts, rows, 0,
                                                           length, axis), rows, list(self.cuts))
      if stats and self.stats is not None:
        jax.eval_shape(lambda g: [v for v, _ in self.run_stats_row(i, g, state, params, 0,
                                                                   length, axis)], row)
    except _rows.NotRowwise as e:
      return f"its update mixes rows ({e})"
    return None

  def rowwise(self, i: int, state, params, axis: int = 0, stats: bool = False) -> bool:
    """Whether leaf ``i`` is updated row by row along ``axis`` (``row_refusal``)."""
    return self.row_refusal(i, state, params, axis, stats) is None

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
    n = self.num_params
    grads = [None] * n
    grads[i] = grad_row
    flat = [*self.consts, *grads, *state, *params]
    is_row = [False] * len(self.consts) + [j == i for j in range(n)] + [False] * (
        self.num_state + n)
    used = list(zip(flat, is_row, self.stats.stat_reads[i], strict=True))
    args, rows = [x for x, _, r in used if r], [row for _, row, r in used if r]
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
    the global stage's state and the shared state, computed from the old ``state``."""
    new = list(state)
    for i, leaf_slots in slots.items():
      for k, s in zip(self.groups[i].state_outs, leaf_slots):
        new[k] = s
    for k, s in zip(self.global_outs, global_state):
      new[k] = s
    for k, s in zip(self.shared_outs, self.run_shared(state, params)):
      new[k] = s
    return new

  def update(self, grads, state, params) -> tuple[list[Any], list[Any]]:
    """The whole update, stage by stage: flat ``(updates, new_state)`` as ``tx.update`` gives."""
    cuts, global_state = self.run_global(grads, state, params)
    updates, slots = [], {}
    for i in range(self.num_params):
      update, slots[i] = self.run_group(i, grads[i], state, params, cuts)
      updates.append(update)
    return updates, self.new_state(state, params, slots, global_state)


class PlanCache:
  """Plans per params/state signature, built on first use (a traced call builds a fresh one).

  Args:
    make: ``make(params, state) -> Plan``.
  """

  def __init__(self, make: Callable[[Any, Any], Plan]):
    self._make = make
    self._plans: dict = {}

  def __call__(self, params, state) -> Plan:
    if is_tracing((params, state)):
      return self._make(params, state)
    key = (signature(params), signature(state))
    if key not in self._plans:
      self._plans[key] = self._make(params, state)
    return self._plans[key]
