"""The ``backward`` engine: every parameter leaf updated inside the backward pass.

The step is ``_fused_step.value_and_update`` with the optimizer's separable plan
(``_make.make_plan``, which refuses a transform whose update of one leaf reads the gradients of
others): unstacked leaves through taps, stacked leaves of scans row by row inside their backward
loops. With ``microbatches=k`` every backward pass adds its gradient to a running sum in place,
and the update of the sum follows the loop over microbatches (``_accumulate.fused_step``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from optfuse._base import _checks, _leaves
from optfuse._base._options import FuseOptions
from optfuse._engines._engine import Placed, PlacedStep, microbatched
from optfuse._fusion import _accumulate, _fused_step, _loops
from optfuse._plan import _make
from optfuse._plan._plan import Plan, PlanCache
from optfuse._targets._backends import loop_policy

# ``(leaf, why)`` pairs, sorted: fused leaves kept out of every loop (``Plan.refused``), which
# the memory guard (``_guard.GuardedEngine``) taps.
Refused = tuple[tuple[int, str], ...]

# What a reason adds when two-pass backward would update the leaf in the loop.
TWO_PASS_HINT = "use global_ops='two_pass' to compute it in a first sweep"


class BackwardEngine:
  """``mode="backward"``: leaves placed "loop" (inside a scan's backward loop) or "tap"."""

  unplaced = "tap"
  two_pass = False

  def __init__(self, tx: optax.GradientTransformation, options: FuseOptions):
    self.tx, self.options = tx, options
    self.plans = PlanCache(self.make_plan)

  def make_plan(self, params, state) -> Plan:
    return _make.make_plan(self.tx, params, state)

  def init(self, params):
    _checks.check_params(params)
    return self.tx.init(params)

  def plan(self, params, state, refused: Refused = ()) -> Plan:
    """The plan of ``params`` and ``state``, with the leaves of ``refused`` kept out of every
    loop (``Plan.refused``)."""
    plan = self.plans(params, state)
    return plan._replace(refused=refused) if refused else plan

  def fused(self, loss_fn: Callable, has_aux: bool, params, state, args: tuple, kwargs: dict,
            refused: Refused = ()) -> tuple[tuple, Placed]:
    """One fused step, and the leaves its backward loops updated (none of ``refused``)."""
    loop_plan = self.analyze(loss_fn, params, state, args, kwargs, refused)
    out = _fused_step.value_and_update(self.plan(params, state, refused), loop_policy(),
                                       loss_fn, has_aux, params, state, args, kwargs,
                                       loop_plan=loop_plan)
    return out, Placed(dict.fromkeys(loop_plan.fused_leaves, "loop"),
                       self.reasons(loop_plan, params, state))

  def reasons(self, loop_plan: _loops.LoopPlan, params, state) -> dict[int, str]:
    """Why each stacked leaf is not fused, saying where two-pass backward would fuse it: a
    leaf refused for its update (it mixes rows, its state is not stacked like it) that reads
    norms over the whole leaf, which two-pass computes in its first sweep."""
    reasons = dict(loop_plan.reasons)
    plan = self.plan(params, state)
    param_leaves, state_leaves = plan.params_def.flatten_up_to(params), jax.tree.leaves(state)
    refused_rows = [i for i, why in reasons.items() if i in loop_plan.stacked and why ==
                    plan.row_refusal(i, state_leaves, param_leaves, loop_plan.stacked[i])]
    if not refused_rows:
      return reasons
    two_pass = _make.make_plan(self.tx, params, state, global_handling="if_needed")
    if two_pass.stats is None:
      return reasons
    for i in refused_rows:
      if two_pass.rowwise(i, state_leaves, param_leaves, loop_plan.stacked[i], stats=True):
        reasons[i] += f"; {TWO_PASS_HINT}"
    return reasons

  def unchecked(self, loss_fn: Callable, has_aux: bool, microbatches: int,
                refused: Refused = ()) -> PlacedStep:
    """The step without its input checks, the leaves of ``refused`` kept out of its loops (the
    memory guard's probes and choice, ``_guard.GuardedEngine``)."""
    if microbatches == 1:
      return lambda params, state, *args, **kwargs: self.fused(loss_fn, has_aux, params, state,
                                                               args, kwargs, refused)
    offload = self.options.offload
    accumulated = _accumulate.fused_step(loss_fn, has_aux, microbatches, self.plans,
                                         stream_params=offload in ("params", "auto"),
                                         mixed=offload == "auto")

    def step(params, state, *args, **kwargs):
      out, (rows, stacked, streamed) = accumulated(loop_policy(), params, state, *args, **kwargs)
      floats = [i for i, p in enumerate(jax.tree.leaves(params)) if _leaves.is_float(p)]
      return out, microbatched(rows, stacked, floats, microbatches, before=False,
                               streamed=streamed)

    return step

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    inner = self.unchecked(loss_fn, has_aux, microbatches)
    return _checks.checked_step(self.tx, inner)

  def analyze(self, loss_fn: Callable, params, state, args: tuple, kwargs: dict,
              refused: Refused = ()) -> _loops.LoopPlan:
    plan = self.plan(params, state, refused)
    leaves = plan.params_def.flatten_up_to(params)
    diff = [i for i, p in enumerate(leaves) if _leaves.is_float(p)]
    return _loops.analyze(loss_fn, plan, params, jax.tree.leaves(state), args, kwargs, diff,
                          two_pass=self.two_pass and not plan.is_separable)

  def flush(self, params, state):
    return params, state

