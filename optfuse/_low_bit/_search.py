"""The code of each normalized value: a lookup by the value's float32 bits, then one comparison.

A scheme's rounding (``_maps.Scheme``) sends a value ``y`` in [-1, 1] to a code that never
decreases as ``y`` grows, so it is fixed by its *thresholds*: ``thresholds[k - 1]`` is the
smallest float32 with code ``k`` or more, and the code of ``y`` is the number of thresholds at
most ``y``. They are found here once per scheme, in numpy, by bisecting the scheme's own
rounding over the ordered float32 values, so they hold for either rounding exactly.

Counting them on the device would take a binary search of ``bits`` dependent gathers (8 for
8 bits, the bulk of a low-bit step on CPU) or ``2 ** bits`` comparisons a value. Instead the
float32 bits of ``|y|`` above a floor, signed like ``y``, are shifted right into *buckets*, a
monotone map of ``y`` fine enough that no bucket holds two thresholds (checked when the tables
are built). A bucket's table entries are the thresholds below it and the one inside it, if
any: ``code = below[b] + (y >= inside[b])``, two gathers from tables of a few thousand entries
and the arithmetic of a few ops, whatever the bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optfuse._low_bit._maps import Scheme

F32 = np.float32
ONE_KEY = int(np.array(1.0, F32).view(np.int32))


def reference_codes(y: np.ndarray, scheme: Scheme) -> np.ndarray:
  """The scheme's rounding of float32 values ``y``, in numpy, as ``_maps.Scheme`` states it."""
  table = scheme.table
  if scheme.rounding == "nearest":
    return np.searchsorted((table[:-1] + table[1:]) / F32(2), y, side="left")
  down = np.clip(np.searchsorted(table, y, side="right") - 1, 0, len(table) - 1)
  up = np.minimum(down + 1, len(table) - 1)
  return np.where(y - table[down] >= (table[up] - table[down]) * F32(0.5), up, down)


def _to_float(keys: np.ndarray) -> np.ndarray:
  """Ordered integer keys (``sign * bits(|y|)``) back to float32."""
  magnitude = np.abs(keys).astype(np.int32).view(F32)
  return np.where(keys < 0, -magnitude, magnitude).astype(F32)


def thresholds(scheme: Scheme) -> np.ndarray:
  """``thresholds[k - 1]``: the smallest float32 in [-1, 1] with code ``k`` or more."""
  n = len(scheme.table)
  k = np.arange(1, n)
  # Bisection between a key below every threshold (-1 takes code 0) and 1 (the last code).
  lo, hi = np.full(n - 1, -ONE_KEY - 1, np.int64), np.full(n - 1, ONE_KEY, np.int64)
  assert reference_codes(_to_float(hi[:1]), scheme)[0] == n - 1
  while np.any(hi - lo > 1):
    mid = (lo + hi) // 2
    reached = reference_codes(_to_float(mid), scheme) >= k
    hi, lo = np.where(reached, mid, hi), np.where(reached, lo, mid)
  return _to_float(hi)


class Buckets:
  """The bucket tables of one scheme (``lookup``).

  Attributes:
    floor: the float32 bits subtracted from ``|y|``'s (its values below share bucket 0).
    shift: the right shift of the remaining bits.
    offset: added to the signed bucket so that indices start at 0.
    below: per bucket, the number of thresholds below it (int32).
    inside: per bucket, its threshold, or +inf (float32).
  """

  def __init__(self, scheme: Scheme):
    thr = thresholds(scheme)
    smallest = np.min(np.abs(thr[thr != 0])) if np.any(thr != 0) else F32(1)
    self.floor = int(np.array(F32(2.0) ** (np.floor(np.log2(smallest)) - 1), F32).view(np.int32))
    for shift in range(23, -1, -1):
      self.shift = shift
      index = self.bucket(thr)
      if len(np.unique(index)) == len(index):
        break
    else:  # pragma: no cover - a float32 map always separates at one bucket a value
      raise AssertionError("two thresholds share every bucket")
    self.offset = -int(self.bucket(np.array([-1.0], F32))[0])
    size = self.offset + int(self.bucket(np.array([1.0], F32))[0]) + 1
    index = index + self.offset
    self.below = np.searchsorted(index, np.arange(size), side="left").astype(np.int32)
    self.inside = np.full(size, np.inf, F32)
    self.inside[index] = thr

  def bucket(self, y: np.ndarray) -> np.ndarray:
    """Signed buckets (before ``offset``) of float32 values, in numpy."""
    u = np.maximum(np.abs(y).astype(F32).view(np.int32).astype(np.int64) - self.floor, 0)
    return np.where(y < 0, -u, u) >> self.shift


@functools.cache
def _buckets(table: bytes, rounding: str, scaling: str) -> Buckets:
  return Buckets(Scheme(np.frombuffer(table, F32), rounding, scaling))


def table_get(table: np.ndarray, index, mode: str):
  """``table[index]``, sharded like ``index``.

  The output sharding is spelled out because under ``AxisType.Explicit`` sharding (how the
  planner traces ``init`` with FSDP params' shardings in their types) a gather from an
  unsharded table into a sharded index is refused as ambiguous. ``mode`` is ``"clip"`` where an
  index may fall outside the table, ``"promise_in_bounds"`` where it cannot: ``"fill"``, ``take``'s
  default, adds a select over the whole output (a full-size temporary in a stacked update).
  """
  return jnp.asarray(table).at[index].get(mode=mode, out_sharding=jax.typeof(index).sharding)


def lookup(y, scheme: Scheme):
  """The code (int32) of each value of ``y`` (float32 in [-1, 1]) under ``scheme``."""
  b = _buckets(scheme.table.tobytes(), scheme.rounding, scheme.scaling)
  u = jnp.maximum(lax.bitcast_convert_type(jnp.abs(y), jnp.int32) - np.int32(b.floor),
                  np.int32(0))
  index = jnp.right_shift(jnp.where(y < 0, -u, u), np.int32(b.shift)) + np.int32(b.offset)
  below = table_get(b.below, index, "clip")
  inside = table_get(b.inside, index, "clip")
  return below + (y >= inside).astype(jnp.int32)
