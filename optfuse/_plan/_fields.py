"""What an update plan holds: its leaf groups, its global stage and its statistics.

A plan's jaxprs take, of the flat inputs ``(consts, grads, state, params, ...)``, only those
their ``reads`` masks select. The runners (``_runners``) and the row checks (``_row_checks``)
read these fields; ``_plan.Plan`` puts the three together.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax.extend import core as jcore

from optfuse._jaxpr import _interpreter


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



@functools.lru_cache(maxsize=1024)
def slots_only(group: LeafGroup) -> tuple[jcore.Jaxpr, tuple[bool, ...]]:
  """``group`` pruned to its new state slots, and which flat inputs it reads: once per group
  (plans are cached per signature, and both the row checks and the runners ask)."""
  jaxpr, used = _interpreter.prune(group.jaxpr, [False] + [True] * len(group.state_outs))
  used = iter(used)
  return jaxpr, tuple(next(used) if r else False for r in group.reads)


class PlanFields(NamedTuple):
  """What a ``Plan`` holds: ``tx.update`` for one params/state signature, split per leaf.

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

