"""The update plan: ``tx.update`` for one params/state signature, split per parameter leaf.

For flat gradients ``g``, state ``s`` and params ``p`` the traced update computes ``updates,
new_state``. Following data dependencies (never names), its outputs split into:

* one *group* per leaf ``i``: the leaf's update and the state it owns (Adam's ``mu`` and
  ``nu``), computed from its own gradient, in that leaf's backward rule or loop row;
* the *shared* state, which depends on no gradient (``count``, injected hyperparameters),
  computed once per step;
* for a global transform only, the *global stage*: the values several groups read that depend
  on several gradients (the clipping factor, the all-finite flag: the *cuts*) and the state no
  single leaf owns, with, for two-pass backward, the same global stage as per-leaf *statistics*
  and a *combine* step (``StatsPlan``).

A separable transform (``_separable.make_plan``) has no global stage;
``_global_stage.make_global_plan`` finds it for the others. Either way the result is one
``Plan``, and every mode runs it with the same runners: a whole leaf (``run_group``), one row
of a stacked leaf (``run_group_row``), the global stage and the statistics, and one predicate
says whether a leaf runs row by row (``row_refusal``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optfuse._base._checks import is_tracing, signature
from optfuse._plan._fields import LeafGroup as LeafGroup
from optfuse._plan._fields import PlanFields
from optfuse._plan._fields import StatsPlan as StatsPlan
from optfuse._plan._row_checks import RowChecks
from optfuse._plan._runners import Runners


class Plan(PlanFields, Runners, RowChecks):
  """``tx.update`` for one params/state signature, split per leaf (see the module docstring):
  its fields (``PlanFields``), its runners (``Runners``) and its row checks (``RowChecks``)."""

  __slots__ = ()


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

