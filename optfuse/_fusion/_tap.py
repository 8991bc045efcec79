"""The tap: an identity on one param leaf whose backward rule replaces its gradient.

A float leaf enters the loss through ``tap(param, operands)``. JAX sums the cotangents of every
use of the leaf before calling the backward rule, so the rule receives the leaf's complete
gradient (a tied weight gets one update) and returns, instead of that gradient, whatever the
mode needs as the cotangents of ``param`` and ``operands``: the new param and the new state
slots (backward fusion), the leaf's statistics (the first pass of two-pass backward), or the
gradient written into a pending buffer (forward fusion's capture). ``jax.vjp`` of the tapped
loss then returns those in place of the gradient tree, which never exists as a whole.

What a rule finds travels as values, never through a record a later trace could pair wrongly:
a tap also returns a marker (``rule_marker``, as a fused scan does), which the step returns from
the differentiated loss and seeds with a one. JAX then calls every rule in every pullback, a
rule whose leaf the loss does not read with a zero gradient (optax's update without one), and
each leaf's new param and slots are the cotangents its own rule returned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optfuse._base._errors import TracingError


def rule_marker() -> jax.Array:
  """The marker output of a custom_vjp that holds backward rules (a tap, a fused scan): a
  float32 zero whose cotangent the step seeds with a one, so that JAX calls the rule."""
  return jnp.zeros((), jnp.float32)


def seeds(markers):
  """The cotangents the step's pullback gives ``markers``: ones, so every rule runs."""
  return jax.tree.map(jnp.ones_like, markers)


def check_ruled(diff: Sequence[int], markers: dict) -> None:
  """Raises ``TracingError`` unless every float leaf of ``diff`` has a rule: ``markers`` maps
  the leaves of each tap or fused scan bound in the loss to its marker."""
  ruled = {leaf for leaves in markers for leaf in leaves}
  missing = sorted(set(diff) - ruled)
  if missing:
    raise TracingError(
        f"param leaves {missing} are read by no tap and no fused scan of the traced loss, so no "
        "backward rule would update them; this is an optfuse bug: please report it with the loss.")


class TwoPassPhase:
  """Which pullback of two-pass backward is traced, and the cuts its update pass reads: what a
  step hands its backward rules outside JAX's values, with its pairing checked.

  Two-pass backward calls one pullback twice: the statistics pass and the update pass, whose
  rules return different things (a static choice, not a value), the second reading the cuts,
  which exist only once the first has returned. The step opens each pass (``pass_``) around
  its pullback call; a rule reads the phase (``read``) only while a pass is open, and every rule
  must have read it by the time the pass closes (the markers make JAX call every rule in every
  pullback). A rule traced elsewhere (later, or a transpose JAX reused from the other pass)
  raises ``TracingError`` instead of updating with another pass's values.

  Attributes:
    stats: whether the open pass reduces statistics instead of updating.
    cuts: the combined statistics the update pass reads (empty in the statistics pass).
  """

  def __init__(self):
    self.stats, self.cuts = False, []
    self._open: set[int] | None = None

  @contextlib.contextmanager
  def pass_(self, stats: bool, cuts: list, leaves: Sequence[int]) -> Iterator[None]:
    """The pass of the pullback called inside the block; on leaving, every leaf of ``leaves``
    must have had its rule run inside it."""
    self.stats, self.cuts, self._open = stats, cuts, set()
    try:
      yield
      missing = sorted(set(leaves) - self._open)
    finally:
      self._open = None
    if missing:
      raise TracingError(
          f"the backward rules of param leaves {missing} did not run in the "
          f"{'statistics' if stats else 'update'} pass of two-pass backward (JAX traced them "
          "elsewhere, or reused a transpose traced for the other pass), so their updates would "
          "read another pass's values. Put the loss's jax.checkpoint inside the scanned body, "
          "or use global_ops=None.")

  def read(self, leaves: Sequence[int]) -> tuple[bool, list]:
    """``(stats, cuts)`` of the open pass, for the rule of ``leaves``."""
    if self._open is None:
      raise TracingError(
          f"the backward rule of param leaves {list(leaves)} was traced outside the pullback "
          "calls of two-pass backward, and cannot tell which pass it belongs to.")
    self._open.update(leaves)
    return self.stats, self.cuts


# ``rule(grad, param, operands) -> (param_cotangent, operands_cotangent)``; ``None`` in the
# cotangent of ``operands`` is a zero for that subtree.
TapRule = Callable[[Any, Any, Any], tuple[Any, Any]]


def make_tap(rule: TapRule) -> Callable[[Any, Any], Any]:
  """A tap whose backward rule is ``rule``.

  Args:
    rule: called in the backward pass with the leaf's complete gradient, the param and the
      operands passed to ``tap``, once per pullback call.

  Returns:
    The tap: ``tap(param, operands) -> (param, marker)`` (``rule_marker``).
  """
  @jax.custom_vjp
  def tap(param, operands):
    del operands
    return param, rule_marker()

  def fwd(param, operands):
    return (param, rule_marker()), (param, operands)

  def bwd(res, cts):
    param, operands = res
    return rule(cts[0], param, operands)

  tap.defvjp(fwd, bwd)
  return tap
