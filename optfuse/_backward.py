"""The ``backward`` engine: every parameter leaf updated inside the backward pass.

The step is ``_fused_step.value_and_update`` with the optimizer's separable plan
(``_split.make_plan``, which refuses a transform whose update of one leaf reads the gradients of
others): unstacked leaves through taps, stacked leaves of scans row by row inside their backward
loops. With ``microbatches=k`` every backward pass adds its gradient to a running sum in place,
and the update of the sum follows the loop over microbatches (``_accumulate.fused_step``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from optfuse import _accumulate, _checks, _fused_step, _leaves, _loops, _split
from optfuse._engine import Step
from optfuse._plan import Plan, PlanCache


class BackwardEngine:
  """``mode="backward"``: leaves placed "loop" (inside a scan's backward loop) or "tap"."""

  unplaced = "tap"
  two_pass = False

  def __init__(self, tx: optax.GradientTransformation):
    self.tx = tx
    self.plans = PlanCache(self.make_plan)

  def make_plan(self, params, state) -> Plan:
    return _split.make_plan(self.tx, params, state)

  def init(self, params):
    _checks.check_params(params)
    return self.tx.init(params)

  def fused(self, loss_fn: Callable, has_aux: bool, params, state, args: tuple, kwargs: dict):
    """One fused step."""
    return _fused_step.value_and_update(self.plans(params, state), loss_fn, has_aux, params,
                                        state, args, kwargs)

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> Step:
    if microbatches == 1:
      inner = lambda params, state, *args, **kwargs: self.fused(loss_fn, has_aux, params, state,
                                                                args, kwargs)
    else:
      inner = _accumulate.fused_step(loss_fn, has_aux, microbatches, self.plans)
    return _checks.checked_step(self.tx, inner)

  def flush(self, params, state):
    return params, state

  def placements(self, loss_fn, params, state, args, kwargs):
    plan = self.plans(params, state)
    leaves = plan.params_def.flatten_up_to(params)
    diff = [i for i, p in enumerate(leaves) if _leaves.is_float(p)]
    loop_plan = _loops.analyze(loss_fn, plan, params, jax.tree.leaves(state), args, kwargs, diff,
                               two_pass=self.two_pass and not plan.is_separable)
    return dict.fromkeys(loop_plan.fused_leaves, "loop"), loop_plan.reasons
