"""What fits, read off compiled peaks and host bytes that are affine in a scanned model's size.

A scanned model's compiled peak is close to affine in its depth and in its batch, and the host
bytes of a step that streams its stacks are affine in its depth (each layer adds its rows of
params and state). So:

- ``seeded_largest``: the largest depth or batch within a budget, searched with
  ``_fit.largest_affine`` from the first two probes that another target's peaks give at this
  budget (``affine_guesses``): about four compiles, two when the guess is right; the answer is
  exact whatever the peaks (it fits, one more does not);
- ``host_depth``: the deepest model a machine's host memory holds, from the host bytes of the
  depths compiled.

``python -m optfuse.bench --what-fits`` and ``--host-fits`` run these searches on the benchmark's
decoders over the registry's targets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

from optfuse._analysis import _fit


def affine_guesses(previous: dict[int, int | None], budget: int, default: tuple[int, int]
                   ) -> tuple[tuple[int, int], float | None]:
  """The first two probes of a search at ``budget``, read from another target's peaks
  (``previous``: size -> peak, ``None`` where refused) by the line through its smallest and
  largest measured sizes, and that line's slope; ``default`` and ``None`` when ``previous``
  holds fewer than two measured sizes or a flat line.

  Examples:
    >>> affine_guesses({4: 1_000, 8: 1_800}, budget=2_000, default=(1, 2))  # 200 a size
    ((9, 10), 200.0)
    >>> affine_guesses({4: 1_000, 8: None}, budget=2_000, default=(1, 2))
    ((1, 2), None)
  """
  points = sorted(k for k, p in previous.items() if p is not None)
  if len(points) < 2 or previous[points[-1]] == previous[points[0]]:
    return default, None
  a, b = points[0], points[-1]
  slope = (previous[b] - previous[a]) / (b - a)
  guess = max(1, a + math.floor((budget - previous[a]) / slope))
  return (guess, guess + 1), slope


def seeded_largest(peak: Callable[[int], int | None], budget: int,
                   previous: dict[int, int | None] | None, default: tuple[int, int]) -> int:
  """The largest size ``k >= 1`` with ``peak(k) <= budget`` (0 if none): ``_fit.largest_affine``
  with its first probes and slope from ``previous``, another target's peaks of the same model
  (``affine_guesses``; ``default`` without them).

  Examples:
    >>> seeded_largest(lambda k: 200 * k + 200, 2_000, {4: 1_000, 8: 1_800}, default=(1, 2))
    9
  """
  guesses, slope = affine_guesses(previous or {}, budget, default)
  return _fit.largest_affine(peak, budget, 1, guesses, slope)


def host_depth(hosts: dict[int, int | None], memory: int | None, best: int) -> int | None:
  """The deepest decoder, up to ``best`` layers, whose host bytes ``memory`` holds.

  A layer adds its rows of params and state to the host, so the host bytes are affine in the
  depth: the line through the two deepest of ``hosts`` (layers -> host bytes, as compiled)
  gives them at every depth the loops fuse. ``None`` when ``memory`` is unknown or fewer than
  two depths were compiled.

  Examples:
    >>> host_depth({4: 1_000, 8: 1_800}, memory=2_000, best=50)  # 200 + 200 a layer
    9
  """
  points = sorted(k for k, h in hosts.items() if h is not None)
  if memory is None or len(points) < 2:
    return None
  a, b = points[-2], points[-1]
  per_layer = Fraction(hosts[b] - hosts[a], b - a)
  if per_layer <= 0:
    return best
  base = hosts[a] - per_layer * a
  return max(0, min(best, math.floor((memory - base) / per_layer)))
