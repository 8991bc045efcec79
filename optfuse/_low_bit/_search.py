"""The code of each normalized value: a lookup by the value's float32 bits, then one comparison.

A scheme's rounding (``_maps.Scheme``) sends a value ``y`` in [-1, 1] to a code that never
decreases as ``y`` grows, so it is fixed by its *thresholds*: ``thresholds[k - 1]`` is the
smallest float32 with code ``k`` or more, and the code of ``y`` is the number of thresholds at
most ``y``. They are found here once per scheme, in numpy, by bisecting the scheme's own
rounding over the ordered float32 values, so they hold for either rounding exactly.

Counting them on the device by a binary search takes ``bits`` dependent gathers a value (8 for
8 bits, once the bulk of a low-bit step on CPU), and by comparing ``y`` with each of them
``2 ** bits - 1`` comparisons, which pays for 16-entry maps only. Instead the float32 bits of
``y`` can be shifted right into *buckets*: each bucket is an interval of floats,
fine enough that it holds at most one threshold (checked when the tables are built). A bucket's
table entries are the number of thresholds at or below its smallest float and the one inside
it, if any: ``code = below[b] + (y >= inside[b])``, two gathers from constant tables and the
arithmetic of a few ops, whatever the bits.

Three ways to find them, chosen per compiler and map width (``_backends.CODE_SEARCH``), all
giving the same codes:

* ``"compact"`` buckets (``Buckets``): the bits of ``|y|`` above a floor, signed like ``y``,
  shifted: a monotone index into tables of a few thousand entries (2,945 for the signed 8-bit
  map).
* ``"raw"`` buckets (``RawBuckets``): the bits of ``y`` themselves, shifted, an index of one op;
  the tables span every float32 exponent of both signs (24,513 entries for the signed 8-bit
  map, 16,257 for a map of nonnegative values, whose negative inputs take zero's bucket).
* ``"compare"``: the sum of ``y >= t`` over the thresholds, for a 16-entry map (15 comparisons,
  no table).

XLA:CPU runs a fusion holding a gather as a scalar loop, so each op of the index costs there
what a whole vectorized pass costs: on a 2-core CPU the raw index makes the 8-bit search 2.6x
faster than the compact one, and comparing makes the 4-bit search 3.8x faster
(``examples/low_bit_step_time.py --parts``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optfuse._low_bit._maps import Scheme
from optfuse._targets._backends import CODE_SEARCH, for_platform

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
    thr = scheme_thresholds(scheme)
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


class RawBuckets:
  """The raw bucket tables of one scheme: buckets of the float32 bits of ``y`` shifted right.

  Attributes:
    shift: the right shift of ``y``'s bits (as uint32).
    nonnegative: whether every threshold is positive, so that every negative ``y`` (and -0.0)
      has zero's code: their bits (negative as int32) are raised to 0 first, and the tables
      need no negative half.
    below: per bucket, the number of thresholds at or below its smallest float (int32).
    inside: per bucket, its threshold above that float, or +inf (float32).
  """

  def __init__(self, scheme: Scheme):
    thr = scheme_thresholds(scheme)
    self.nonnegative = bool(np.all(thr > 0))
    top = np.array([1.0 if self.nonnegative else -1.0], F32).view(np.uint32)[0]
    for shift in range(23, -1, -1):
      self.shift = shift
      keys = np.arange((int(top) >> shift) + 1, dtype=np.uint64) << np.uint64(shift)
      first = keys.astype(np.uint32).view(F32)
      last = (keys + np.uint64(2 ** shift - 1)).astype(np.uint32).view(F32)
      # A bucket of negative floats runs from its last bits (most negative) to its first.
      low, high = np.where(keys >= 2 ** 31, last, first), np.where(keys >= 2 ** 31, first, last)
      below = np.searchsorted(thr, low, side="right")
      within = np.searchsorted(thr, high, side="right") - below
      used = (np.abs(low) <= 1) | (np.abs(high) <= 1)  # buckets above 1 or NaN are never read
      if np.all(within[used] <= 1):
        break
    else:  # pragma: no cover - one float a bucket separates every map
      raise AssertionError("two thresholds share every bucket")
    self.below = below.astype(np.int32)
    self.inside = np.full(len(keys), np.inf, F32)
    self.inside[within == 1] = thr[below[within == 1]]


@functools.cache
def _thresholds(table: bytes, rounding: str, scaling: str) -> np.ndarray:
  return thresholds(Scheme(np.frombuffer(table, F32), rounding, scaling))


def scheme_thresholds(scheme: Scheme) -> np.ndarray:
  """``thresholds(scheme)``, bisected once per scheme and shared by every search method."""
  return _thresholds(scheme.table.tobytes(), scheme.rounding, scheme.scaling)


@functools.cache
def _buckets(table: bytes, rounding: str, scaling: str, raw: bool = False
             ) -> Buckets | RawBuckets:
  return (RawBuckets if raw else Buckets)(Scheme(np.frombuffer(table, F32), rounding, scaling))


def buckets(scheme: Scheme, raw: bool) -> Buckets | RawBuckets:
  """The bucket tables of ``scheme`` (built once): raw or compact."""
  return _buckets(scheme.table.tobytes(), scheme.rounding, scheme.scaling, raw)


def table_get(table: np.ndarray, index, mode: str):
  """``table[index]``, sharded like ``index``.

  The output sharding is spelled out because under ``AxisType.Explicit`` sharding (how the
  planner traces ``init`` with FSDP params' shardings in their types) a gather from an
  unsharded table into a sharded index is refused as ambiguous. ``mode`` is ``"clip"`` where an
  index may fall outside the table, ``"promise_in_bounds"`` where it cannot: ``"fill"``, ``take``'s
  default, adds a select over the whole output (a full-size temporary in a stacked update).
  """
  return jnp.asarray(table).at[index].get(mode=mode, out_sharding=jax.typeof(index).sharding)


METHODS = ("compact", "raw", "compare")


def lookup(y, scheme: Scheme, method: str | None = None):
  """The code (int32) of each value of ``y`` (float32 in [-1, 1]) under ``scheme``.

  Args:
    y: float32 values in [-1, 1].
    scheme: the map and its rounding.
    method: ``"compact"`` or ``"raw"`` bucket tables, or ``"compare"`` with every threshold
      (maps of 16 entries); ``None`` takes the choice of the platform the step is traced for
      (``_backends.CODE_SEARCH``). All give the same codes.
  """
  method = for_platform(CODE_SEARCH)[scheme.bits] if method is None else method
  if method not in METHODS:
    raise ValueError(f"the code search is one of {METHODS}, not {method!r}")
  if method == "compare":
    thr = scheme_thresholds(scheme)
    if len(thr) > 15:
      raise ValueError(f'method="compare" is for maps of 16 entries, not {len(thr) + 1}')
    codes = jnp.zeros(jnp.shape(y), jnp.int32)
    for t in thr:  # 15 elementwise comparisons, never a broadcast of y against the map
      codes = codes + (y >= t).astype(jnp.int32)
    return codes
  b = buckets(scheme, method == "raw")
  if method == "raw":
    bits = lax.bitcast_convert_type(y, jnp.int32)
    if b.nonnegative:
      bits = jnp.maximum(bits, np.int32(0))
    index = jnp.right_shift(lax.bitcast_convert_type(bits, jnp.uint32), np.uint32(b.shift))
    # Every index of a float in [-1, 1] is in the tables; a NaN's is clamped by the gather.
    mode = "promise_in_bounds"
  else:
    u = jnp.maximum(lax.bitcast_convert_type(jnp.abs(y), jnp.int32) - np.int32(b.floor),
                    np.int32(0))
    index = jnp.right_shift(jnp.where(y < 0, -u, u), np.int32(b.shift)) + np.int32(b.offset)
    mode = "clip"
  below = table_get(b.below, index, mode)
  inside = table_get(b.inside, index, mode)
  return below + (y >= inside).astype(jnp.int32)
