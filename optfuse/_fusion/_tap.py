"""The tap: an identity on one param leaf whose backward rule replaces its gradient.

A float leaf enters the loss through ``tap(param, operands)``. JAX sums the cotangents of every
use of the leaf before calling the backward rule, so the rule receives the leaf's complete
gradient (a tied weight gets one update) and returns, instead of that gradient, whatever the
mode needs as the cotangents of ``param`` and ``operands``: the new param and the new state
slots (backward fusion), the leaf's statistics (the first pass of two-pass backward), or the
gradient written into a pending buffer (forward fusion's capture). ``jax.vjp`` of the tapped
loss then returns those in place of the gradient tree, which never exists as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


class PullbackRecord:
  """What crosses the ``jax.custom_vjp`` boundary of one step's backward rules: the one object
  a step writes while it is traced.

  A backward rule (a tap's, a fused scan's loop) runs when ``jax.vjp``'s pullback is traced,
  after the forward pass that bound it has returned. What it returns are cotangents only, and a
  leaf whose rule never ran (the loss does not read it) comes back as a zero like any other;
  so each rule records here that it ran, and the step reads the record after its pullback to
  give the other leaves optax's zero-gradient update. Two-pass backward calls the pullback
  twice, and its rules read here which pass is traced and the cuts the first pass's statistics
  combine into: values known only after the first pullback.

  Attributes:
    stats: whether the pullback traced now reduces statistics (two-pass backward's first pass)
      instead of updating.
    cuts: the combined statistics the update pass reads (two-pass backward; else empty).
    fired: per pullback call, the leaves whose backward rule ran in it.
  """

  def __init__(self, stats: bool = False):
    self.stats, self.cuts = stats, []
    self.fired: list[set[int]] = [set()]

  def ran(self, leaf: int) -> None:
    """Records that ``leaf``'s backward rule ran in the pullback traced now."""
    self.fired[-1].add(leaf)

  def start_update_pass(self, cuts: list) -> None:
    """Starts the update pass of two-pass backward, whose rules read ``cuts``."""
    self.stats, self.cuts = False, cuts
    self.fired.append(set())


# ``rule(grad, param, operands) -> (param_cotangent, operands_cotangent)``; ``None`` in the
# cotangent of ``operands`` is a zero for that subtree.
TapRule = Callable[[Any, Any, Any], tuple[Any, Any]]


def make_tap(rule: TapRule) -> Callable[[Any, Any], Any]:
  """``tap(param, operands) -> param`` whose backward rule is ``rule``.

  Args:
    rule: called in the backward pass with the leaf's complete gradient, the param and the
      operands passed to ``tap``, once per pullback call.

  Returns:
    The tap.
  """
  @jax.custom_vjp
  def tap(param, operands):
    del operands
    return param

  def fwd(param, operands):
    return param, (param, operands)

  def bwd(res, grad):
    param, operands = res
    return rule(grad, param, operands)

  tap.defvjp(fwd, bwd)
  return tap
