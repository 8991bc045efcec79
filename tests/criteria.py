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

- ``assert_each_step_matches``: one step at a time from the reference's own states, for a
  low-bit trajectory too chaotic for the spread check (8-bit Muon): at every step ``t`` the
  fused step starts from the reference's params and state before its step ``t`` and must land
  where the reference's step landed. Each step's error starts afresh, so it cannot compound;
  the tolerance of each params leaf is measured (the reference's own step from starts an ulp or
  two away), and a flipped code of the low-bit state is one quantization step.

The low-bit spread criterion, for chaotic trajectories, is
``models.assert_same_low_bit_trajectory``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

import optfuse
from optfuse._low_bit import _blocks
from tests.faults import LR_ERROR

# float32: the fused step runs the same update operations on the same gradients, but inside the
# backward pass (or the next forward pass), where XLA fuses and orders them differently than
# after a full gradient. Measured over 50 steps (CPU): 13 of the 30 optimizers of
# test_backward_equivalence are bit-identical to optax, the others differ by at most 7.2e-7
# absolute (1-2 ulps of the O(1) params and losses), 7.6e-7 relative to a leaf's largest entry.
# rtol=1e-5 / atol=1e-6 leaves headroom for other CPUs and XLA versions and is far below a real
# difference: a learning rate 1 % off moves the params of the criteria's runs by hundreds of
# times the tolerance (``python -m tests.margins``).
F32_RTOL, F32_ATOL = 1e-5, 1e-6
# The same, as keyword arguments (``np.testing.assert_allclose``, ``chex``, the spread check).
F32 = dict(rtol=F32_RTOL, atol=F32_ATOL)

# float32 with an absolute floor of 1e-5 (about 100 ulps of values of order 1) where a test
# compares elements that start at or cross zero (biases, moments of near-zero gradients) after
# many steps: Adam's division by sqrt(nu) amplifies an ulp of a near-zero gradient, so an
# element near zero can drift further than F32_ATOL while every O(1) element stays within
# F32_RTOL. Measured on CPU: at most 7.2e-7 absolute after 50 forward-mode steps (lion,
# adafactor and normalize_by_update_norm bit-identical) and after 50 two-pass steps, 4.8e-7
# after the 52 steps of test_checkpoint's mode switches. Used by the loops, forward, two-pass,
# guard, checkpoint, model-form and unknown-primitive tests, and as LOW_BIT_TOL.
F32_FLOOR = dict(rtol=F32_RTOL, atol=1e-5)

# Microbatches: the fused step divides each microbatch's loss by k before its gradient is
# added to the sum (optax's loop adds, then divides), one rounding per step more than one batch
# (test_accumulate, test_offload_params and test_offload_auto, over 20 steps); a learning rate
# 1 % off is still far beyond it (the "microbatches" row of test_fault_rejection).
MICROBATCH = dict(rtol=2e-5, atol=2e-5)
# Two-pass with microbatches over 20 steps (test_two_pass), on the tied LM: at most 4.8e-7
# absolute (one ulp of the losses, about 4.0); 5e-6 leaves a 10x margin.
TWO_PASS_MICROBATCH = dict(rtol=5e-6, atol=5e-6)

# The examples and the notebook report the largest difference of a few float32 steps (losses of
# order 1 to 6, ulp(6) = 4.8e-7) from their own plain optax run, as one scalar: a few ulps.
EXAMPLE_DIFF = 1e-5

# bfloat16: measured bit-identical to optax's bfloat16 run in every mode, with the state in
# host memory too, at both XLA optimisation levels (``python -m tests.margins``). One ulp of
# headroom lets another XLA round one float32 intermediate the other way; a doubled or missed
# step, or a learning rate 1 % off, moves the params by many ulps.
BF16_ULPS = 1

# A wrong update must be this many times its criterion's tolerance away: an error of 1 % of the
# update is far outside what passes, not at its edge (the measured distances are hundreds of
# times and more: ``python -m tests.margins``).
REJECTED_BY = 10.0


class SpreadTooWide(AssertionError):
  """The reference is too chaotic for a check to judge a run: the spread check's width exceeds
  ``SPREAD_CAP``, or the one-step check's ``STEP_WIDTH_CAP``."""


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
    trajectory: a run (or the reference) without its state, for ``margins``: ``(losses,
      params)`` of ``(losses, params, state)``; a criterion that judges only the trajectory
      (the low-bit spread check, whose reference is a ``models.Spread``) keeps it whole.
  """
  fused: Callable[[Any], Any]
  tx: Callable[[], Any]
  reference: Callable[[], Any]
  check: Callable[[Any, Any], None]
  distance: Callable[[Any, Any], tuple[float, str]]
  stacked: Callable[[str], bool]
  trajectory: Callable[[Any], Any] = lambda run: run[:2]


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
    out[name] = (criterion.distance(got, want)[0],
                 criterion.distance(criterion.trajectory(got), criterion.trajectory(want))[0])
  return out


# One step at a time. The reference's run is taken apart into its steps: ``starts[t]``, the
# params and state before step ``t``, and ``want``, ``(losses, params after each step, state
# after each step)`` (``models.reference_steps``); a fused run ``got`` is the fused step from
# each of those starts (``models.steps_from``), in the same form. A low-bit step's update is
# computed from the dequantized state in float32 and only its new state is quantized, so from
# the same start the fused and reference steps differ by float32 roundings, in the update, and
# by a code flipped where a moment sits on the boundary between two codes, in the new state.
#
# The params: each leaf's update (its move in one step) against the reference's, in units of
# that leaf's width. The width is STEP_MARGIN times the widest distance, over the steps, between
# the reference's update and its own update from the start moved by an ulp or two (STEP_NUDGES):
# the roundings an ulp sets off (8-bit Muon's widest width: 8.8e-5 of the update at the suite's
# level, 1.3e-4 at XLA's default level, where the fused steps reach 0.31 of it: python -m
# tests.low_bit_margins --all --groups muon_8bit_one_step). A learning rate 1 % off moves every
# update by 1e-2 of itself, so a width above STEP_WIDTH_CAP would let it pass less than
# REJECTED_BY times outside: the check then refuses to judge (SpreadTooWide).
# The state: integer leaves (step counts) equal; a low-bit slot's codes at most one code apart
# (one quantization step: a rounding on a code boundary), its scales and every other float leaf
# within the float32 tolerance. The losses, of the same params, within the float32 tolerance.
STEP_NUDGES = (1, -1, 2, -2)
STEP_MARGIN = 2.0
STEP_WIDTH_CAP = LR_ERROR / REJECTED_BY

# The two caps on a measured width, side by side. Both are LR_ERROR divided by the factor by
# which a learning rate 1 % off must land beyond the widest width the check accepts, on any leaf
# it judges. One step at a time, that error moves every leaf's update by exactly LR_ERROR of
# itself, so STEP_WIDTH_CAP guarantees REJECTED_BY. The spread check
# (``models.assert_within_spread``) judges where a whole chaotic trajectory ends, in units of
# how far the reference moved the leaf, ||p_T - p_0||: there the error moves a leaf by about
# LR_ERROR of that only to first order (measured 0.9e-2 to 11e-2 per leaf in the low-bit and
# Muon tests), and the low-bit references' own widths reach 4.1e-3 of it (low-bit AdamW, 10
# steps; python -m tests.low_bit_margins), so a cap of STEP_WIDTH_CAP (1e-3) would refuse to
# judge every low-bit trajectory. The spread cap guarantees SPREAD_REJECTED_BY on each leaf it
# judges, and REJECTED_BY is measured instead of guaranteed: every fault test of the spread
# check (``models.assert_rejected``, the ``low_bit_offload_params`` row of
# test_fault_rejection) requires its faulted run at REJECTED_BY or more.
SPREAD_REJECTED_BY = 2.0
SPREAD_CAP = LR_ERROR / SPREAD_REJECTED_BY

# The spread check's element-by-element tolerance: a leaf within it of the reference's run needs
# no width (no code flipped).
LOW_BIT_TOL = F32_FLOOR


class StepWidths(NamedTuple):
  """The widths ``assert_each_step_matches`` accepts, one per params leaf (``names``)."""

  names: list[str]
  widths: list[float]


def update_distances(got, want, got_start, want_start) -> list[float]:
  """Each params leaf's ``||(got - got_start) - (want - want_start)|| / ||want - want_start||``:
  how far one step's update is from the reference's, as a fraction of the reference's."""
  out = []
  for g, w, gs, ws in zip(*map(jax.tree.leaves, (got, want, got_start, want_start)), strict=True):
    g, w, gs, ws = (np.asarray(x, np.float64) for x in (g, w, gs, ws))
    moved = np.linalg.norm(w - ws)
    out.append(float(np.linalg.norm((g - gs) - (w - ws)) / moved) if moved else
               (0.0 if np.array_equal(g - gs, w - ws) else np.inf))
  return out


def step_widths(nudged: Mapping[int, tuple], want, starts: list) -> StepWidths:
  """The ``StepWidths`` of the reference's steps from its own starts moved by ``ulps``
  (``nudged[ulps] = (starts moved, run)``, each run in ``want``'s form).

  Raises:
    SpreadTooWide: a width exceeds STEP_WIDTH_CAP: the reference's step is too sensitive for
      the check to tell a learning rate 1 % off.
  """
  names = _paths(starts[0][0])
  widest = np.zeros(len(names))
  for moved, run in nudged.values():
    for t, (start, _) in enumerate(starts):
      widest = np.maximum(widest, update_distances(run[1][t], want[1][t], moved[t][0], start))
  widths = StepWidths(names, [STEP_MARGIN * w for w in widest])
  for name, width in zip(widths.names, widths.widths):
    if width > STEP_WIDTH_CAP:
      raise SpreadTooWide(
          f"{name}: the reference's steps from starts an ulp or two apart differ by up to "
          f"{width / STEP_MARGIN:.3g} of a step, more than {STEP_WIDTH_CAP / STEP_MARGIN:g}: "
          "the one-step check cannot judge this run (a learning rate 1 % off could pass "
          f"within {REJECTED_BY:g} times its tolerance).")
  return widths


def _is_slot(x) -> bool:
  return isinstance(x, optfuse.QuantizedSlot)


def _state_distance(got, want, bits: int) -> tuple[float, str]:
  """The farthest leaf of two states: integers 0 or infinitely far, a low-bit slot's codes in
  code steps, every other float leaf in units of the float32 tolerance."""
  paths = [jax.tree_util.keystr(k) for k, _ in
           jax.tree_util.tree_flatten_with_path(want, is_leaf=_is_slot)[0]]
  worst, where = 0.0, ""
  for path, g, w in zip(paths, jax.tree.leaves(got, is_leaf=_is_slot),
                        jax.tree.leaves(want, is_leaf=_is_slot), strict=True):
    if _is_slot(w):
      codes = [np.asarray(_blocks._unpack(x.codes, bits), np.int64) for x in (g, w)]
      d = max(float(np.max(np.abs(codes[0] - codes[1]), initial=0)),
              matches_optax_distance(g.scales, w.scales)[0])
    elif jnp.issubdtype(jnp.result_type(w), jnp.floating):
      d = matches_optax_distance(g, w)[0]
    else:
      d = 0.0 if np.array_equal(np.asarray(g), np.asarray(w)) else np.inf
    if d > worst:
      worst, where = d, path
  return worst, where


def one_step_distance(got, want, starts: list, widths: StepWidths, bits: int
                      ) -> tuple[float, str]:
  """``assert_each_step_matches``'s distance of ``got`` (``(losses, params, state)`` after each
  step, or ``(losses, params)``) in units of its tolerance, and where (step and leaf)."""
  worst, where = matches_optax_distance(got[0], want[0])[0], "losses"
  for t, (start, _) in enumerate(starts):
    ratios = [d / w if w else (0.0 if d == 0 else np.inf) for d, w in
              zip(update_distances(got[1][t], want[1][t], start, start), widths.widths)]
    i = int(np.argmax(ratios))
    found = [(ratios[i], f"step {t} params {widths.names[i]}")]
    if len(got) > 2:
      d, path = _state_distance(got[2][t], want[2][t], bits)
      found.append((d, f"step {t} state {path}"))
    for d, here in found:
      if d > worst:
        worst, where = d, here
  return worst, where


def assert_each_step_matches(got, want, starts: list, widths: StepWidths, bits: int) -> None:
  """Every fused step of ``got`` lands where the reference's step from the same start landed:
  each params leaf's update within its width, integer state equal, low-bit codes at most one
  code apart, the losses and every other float within the float32 tolerance.

  Raises:
    AssertionError: a step is farther.
  """
  distance, where = one_step_distance(got, want, starts, widths, bits)
  assert distance <= 1, (f"{where}: {distance:.3g} times the tolerance from the reference's "
                         "step from the same start")
