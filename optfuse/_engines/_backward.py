"""The ``backward`` engine: every parameter leaf updated inside the backward pass.

The step is ``_fused_step.value_and_update`` with the optimizer's separable plan
(``_make.make_plan``, which refuses a transform whose update of one leaf reads the gradients of
others): unstacked leaves through taps, stacked leaves of scans row by row inside their backward
loops. With ``microbatches=k`` every backward pass adds its gradient to a running sum in place,
and the update of the sum follows the loop over microbatches (``_accumulate.fused_step``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax
import optax

from optfuse._base import _checks, _leaves
from optfuse._base._options import FuseOptions
from optfuse._engines import _guard
from optfuse._engines._engine import Placed, PlacedStep, microbatched, without_placements
from optfuse._fusion import _accumulate, _fused_step, _loops
from optfuse._plan import _make
from optfuse._plan._plan import Plan, PlanCache
from optfuse._targets._backends import loop_policy

# ``(leaf, why)`` pairs, sorted: fused leaves kept out of every loop (``Plan.refused``), which
# the memory guard taps.
Refused = tuple[tuple[int, str], ...]


class BackwardEngine:
  """``mode="backward"``: leaves placed "loop" (inside a scan's backward loop) or "tap"."""

  unplaced = "tap"
  two_pass = False

  def __init__(self, tx: optax.GradientTransformation, options: FuseOptions):
    self.tx, self.options = tx, options
    self.plans = PlanCache(self.make_plan)
    # The memory guard's decisions: loss -> (has_aux, microbatches, input shapes) -> the fused
    # leaves it taps, with why; kept while the loss lives (an NNX step's loss is new per trace).
    self.decisions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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
    return out, in_loops(loop_plan)

  def unchecked(self, loss_fn: Callable, has_aux: bool, microbatches: int,
                refused: Refused = ()) -> PlacedStep:
    """The step without its input checks, the leaves of ``refused`` kept out of its loops."""
    if microbatches == 1:
      return lambda params, state, *args, **kwargs: self.fused(loss_fn, has_aux, params, state,
                                                               args, kwargs, refused)
    accumulated = _accumulate.fused_step(loss_fn, has_aux, microbatches, self.plans,
                                         stream_params=self.options.offload == "params")

    def step(params, state, *args, **kwargs):
      out, (rows, stacked, streamed) = accumulated(loop_policy(), params, state, *args, **kwargs)
      floats = [i for i, p in enumerate(jax.tree.leaves(params)) if _leaves.is_float(p)]
      return out, microbatched(rows, stacked, floats, microbatches, before=False,
                               streamed=streamed)

    return step

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    def refusing(refused: Refused) -> PlacedStep:
      return self.unchecked(loss_fn, has_aux, microbatches, refused)

    inner = (self.guarded(refusing, loss_fn, (has_aux, microbatches)) if self.options.guard
             else refusing(()))
    return _checks.checked_step(self.tx, inner)

  def guarded(self, refusing: Callable[[Refused], PlacedStep], loss_fn: Callable, key: tuple
              ) -> PlacedStep:
    """The step ``refusing(refused)`` with the fused leaves the memory guard taps (``_guard``)
    refused its loops, decided once per step (``loss_fn``, and ``key``: its ``has_aux`` and
    microbatches) and input shapes, for every step the engine builds: a step traced again
    (``describe``'s trace) compiles nothing more."""

    own: dict = {}  # for a loss that takes no weak reference: this step's decisions alone

    def step(params, state, *args, **kwargs):
      try:
        decisions = self.decisions.setdefault(loss_fn, {})
      except TypeError:
        decisions = own
      shapes = (*key, _guard.shapes_key(params, state, args, kwargs))
      if shapes not in decisions:
        loop_plan = self.analyze(loss_fn, params, state, args, kwargs)
        decisions[shapes] = self.decide(refusing, loop_plan, params, state, args, kwargs)
      return refusing(tuple(sorted(decisions[shapes].items())))(params, state, *args, **kwargs)

    return step

  def decide(self, refusing: Callable[[Refused], PlacedStep], loop_plan: _loops.LoopPlan,
             params, state, args: tuple, kwargs: dict) -> dict[int, str]:
    """The fused leaves of ``loop_plan`` the memory guard taps: ``_guard.decide`` on the peaks
    of ``refusing(refused)``, the step with the leaves of ``refused`` tapped."""
    sites = [site.leaves for site in loop_plan.sites.values()]

    def peak_of(tapped: frozenset) -> int:
      refused = tuple((i, "tapped by the memory guard's probe") for i in sorted(tapped))
      run = without_placements(refusing(refused))
      return _guard.peak(run, params, state, args, kwargs, self.tx.init)

    return _guard.decide(sites, peak_of)

  def analyze(self, loss_fn: Callable, params, state, args: tuple, kwargs: dict,
              refused: Refused = ()) -> _loops.LoopPlan:
    plan = self.plan(params, state, refused)
    leaves = plan.params_def.flatten_up_to(params)
    diff = [i for i, p in enumerate(leaves) if _leaves.is_float(p)]
    return _loops.analyze(loss_fn, plan, params, jax.tree.leaves(state), args, kwargs, diff,
                          two_pass=self.two_pass and not plan.is_separable)

  def flush(self, params, state):
    return params, state


def in_loops(loop_plan: _loops.LoopPlan) -> Placed:
  """The placements of a step that ran ``loop_plan``: its fused leaves in the loops, and why
  each other stacked leaf is not."""
  return Placed(dict.fromkeys(loop_plan.fused_leaves, "loop"), dict(loop_plan.reasons))
