"""The equivalence criteria: what "trains like optax" means, one named function each.

A fused run ``got`` and its reference ``want`` are trees of the same structure (losses, params,
optimizer state); each criterion has a distance in units of its tolerance, so a run passes when
that distance is at most 1, and the distance of a wrong update says how far beyond the
tolerance the criterion puts it (``tests/end_to_end/test_fault_rejection.py`` injects such errors,
``python -m tests.margins`` prints the table):

- ``assert_matches_optax``: every element within ``atol + rtol * |want|`` (``np.allclose``'s
  rule), at the float32 tolerances below unless a test says otherwise. Used for float32 (every
  mode), for the optimizer state in host memory, for microbatches and on a mesh of devices.
- ``assert_within_ulps``: every float element within ``ulps`` representable values of its own
  dtype (integer leaves equal). Used for bfloat16, whose trajectory is deterministic: the fused
  step runs the same bfloat16 operations in the same order as optax.

The low-bit spread criterion, for chaotic trajectories, is
``models.assert_same_low_bit_trajectory``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

# float32: the fused step runs the same update operations on the same gradients, but inside the
# backward pass (or the next forward pass), where XLA fuses and orders them differently than
# after a full gradient. Measured over 50 steps (CPU): 13 of the 30 optimizers of
# test_backward_equivalence are bit-identical to optax, the others differ by at most 7.2e-7
# absolute (1-2 ulps of the O(1) params and losses), 7.6e-7 relative to a leaf's largest entry.
# rtol=1e-5 / atol=1e-6 leaves headroom for other CPUs and XLA versions and is far below a real
# difference: a learning rate 1 % off moves the params of the criteria's runs by hundreds of
# times the tolerance (``python -m tests.margins``).
F32_RTOL, F32_ATOL = 1e-5, 1e-6

# bfloat16: measured bit-identical to optax's bfloat16 run in every mode, with the state in
# host memory too, at both XLA optimisation levels (``python -m tests.margins``). One ulp of
# headroom lets another XLA round one float32 intermediate the other way; a doubled or missed
# step, or a learning rate 1 % off, moves the params by many ulps.
BF16_ULPS = 1

# A wrong update must be this many times its criterion's tolerance away: an error of 1 % of the
# update is far outside what passes, not at its edge (the measured distances are hundreds of
# times and more: ``python -m tests.margins``).
REJECTED_BY = 10.0


def _paths(tree) -> list[str]:
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _worst(got, want, distance: Callable[[np.ndarray, np.ndarray], float]) -> tuple[float, str]:
  """The largest ``distance`` over the leaves of two trees of one structure, and its leaf."""
  chex.assert_trees_all_equal_structs(got, want)
  worst, where = 0.0, ""
  for path, g, w in zip(_paths(want), jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    d = distance(np.asarray(g), np.asarray(w))
    if d > worst or (np.isnan(d) and not np.isnan(worst)):
      worst, where = d, path
  return worst, where


def _allclose_distance(rtol: float, atol: float) -> Callable:
  def distance(g: np.ndarray, w: np.ndarray) -> float:
    if g.shape != w.shape:
      return np.inf
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))  # NaN where optax has NaN; equal infinities
    with np.errstate(invalid="ignore"):
      ratio = np.where(same, 0.0, np.abs(g - w) / (atol + rtol * np.abs(w)))
    return float(np.max(np.nan_to_num(ratio, nan=np.inf), initial=0.0))

  return distance


def matches_optax_distance(got, want, rtol: float = F32_RTOL, atol: float = F32_ATOL
                           ) -> tuple[float, str]:
  """The largest ``|got - want| / (atol + rtol * |want|)`` over every element, and its leaf:
  ``assert_matches_optax``'s distance in units of its tolerance (NaN against NaN is 0)."""
  return _worst(got, want, _allclose_distance(rtol, atol))


def assert_matches_optax(got, want, rtol: float = F32_RTOL, atol: float = F32_ATOL) -> None:
  """``got`` trains like the reference ``want``: same tree structure and dtypes, every element
  within ``atol + rtol * |want|``.

  Raises:
    AssertionError: the structures or dtypes differ, or an element is beyond the tolerance.
  """
  chex.assert_trees_all_equal_dtypes(got, want)
  distance, where = matches_optax_distance(got, want, rtol, atol)
  assert distance <= 1, (f"{where}: {distance:.3g} times the tolerance (rtol={rtol:g}, "
                         f"atol={atol:g}) from the reference")


_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}


def _ordinal(x: np.ndarray) -> np.ndarray:
  """Each float's position among its dtype's representable values (monotone, 0.0 == -0.0)."""
  bits = x.view(_SIGNED[x.dtype.itemsize]).astype(np.int64)
  lowest = np.int64(-(2 ** (8 * x.dtype.itemsize - 1)))  # the bits of -0.0
  return np.where(bits < 0, lowest - bits, bits).astype(np.float64)


def _ulp_distance(g: np.ndarray, w: np.ndarray) -> float:
  if g.shape != w.shape or g.dtype != w.dtype:
    return np.inf
  if not jnp.issubdtype(w.dtype, jnp.floating):  # integers, bools
    return 0.0 if np.array_equal(g, w) else np.inf
  both_nan = np.isnan(g.astype(np.float32)) & np.isnan(w.astype(np.float32))
  steps = np.where(both_nan, 0.0, np.abs(_ordinal(g) - _ordinal(w)))
  return float(np.max(steps, initial=0.0))


def ulp_distance(got, want) -> tuple[float, str]:
  """The most representable values (of each leaf's own dtype) between an element of ``got``
  and the same element of ``want``, and its leaf; integer leaves count as infinitely far when
  they differ at all."""
  return _worst(got, want, _ulp_distance)


def assert_within_ulps(got, want, ulps: int = BF16_ULPS) -> None:
  """``got`` trains like the reference ``want`` up to ``ulps`` roundings: same structure and
  dtypes, every float element at most ``ulps`` representable values away, integers equal.

  Raises:
    AssertionError: the structures or dtypes differ, or an element is further away.
  """
  chex.assert_trees_all_equal_dtypes(got, want)
  distance, where = ulp_distance(got, want)
  assert distance <= ulps, f"{where}: {distance:g} ulps from the reference, beyond {ulps}"


@dataclasses.dataclass(frozen=True)
class Criterion:
  """One equivalence criterion on one training run, for fault injection.

  Attributes:
    fused: ``fused(tx) -> got``, the fused run of the transformation ``tx``.
    tx: the optimizer the run trains with (a zero-argument factory).
    reference: ``reference() -> want``, the plain optax run of ``tx()``.
    check: the criterion's assertion, ``check(got, want)``.
    distance: ``distance(got, want) -> (distance in units of the tolerance, leaf)``.
    stacked: which leaves (by ``jax.tree_util.keystr`` path) are stacked layers, for
      ``faults.row_skipped``.
  """
  fused: Callable[[Any], Any]
  tx: Callable[[], Any]
  reference: Callable[[], Any]
  check: Callable[[Any, Any], None]
  distance: Callable[[Any, Any], tuple[float, str]]
  stacked: Callable[[str], bool]


def margins(criterion: Criterion, faults: Mapping[str, Callable]
            ) -> dict[str, tuple[float, float]]:
  """The criterion's distances in units of its tolerance for the passing fused run
  (``"passing"``, at most 1) and for the fused run of each ``faults[name](tx)``: over the whole
  run ``(losses, params, state)``, and over the trajectory ``(losses, params)`` alone (a frozen
  step count is far from optax's in the state at once, in the params only through its
  effect)."""
  want = criterion.reference()
  runs = {"passing": lambda tx: tx, **faults}
  out = {}
  for name, fault in runs.items():
    got = criterion.fused(fault(criterion.tx()))
    out[name] = (criterion.distance(got, want)[0], criterion.distance(got[:2], want[:2])[0])
  return out
