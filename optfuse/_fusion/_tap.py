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
