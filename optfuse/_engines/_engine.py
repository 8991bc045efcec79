"""The engine protocol: what one mode of ``optfuse.fuse`` implements.

An engine is one way of running a training step over an optax transformation: ``off`` (the
plain optax step), ``backward`` (every leaf updated in the backward pass), ``two_pass``
(backward fusion of global transforms over two backward passes) and ``forward`` (each step's
gradient applied in the next step's forward pass). ``optfuse.fuse`` looks the engine up in its
table (``_fuse.ENGINES``) and exposes it as a ``FusedTransformation``; ``describe``,
``memory_report``, ``max_batch_size``, the Flax adapters and the benchmark drive engines only
through this protocol.

Adding a mode is one module implementing ``Engine`` and one entry of ``_fuse.ENGINES``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import optax

from optfuse._base._options import FuseOptions

# ``step(params, state, *args, **kwargs) -> (value, params, state)``.
Step = Callable[..., tuple[Any, Any, Any]]


class Placed(NamedTuple):
  """Where a step placed the update of each float param leaf, as its trace found it.

  Attributes:
    where: leaf index -> its place ("loop", "rows", "leaf"), for the leaves not at the engine's
      ``unplaced``.
    reasons: leaf index -> why a leaf that a scan reads as its stacked input is not updated in
      the loop.
    streamed: with ``offload="params"`` and microbatches, the leaves whose params the step
      keeps in host memory: read a row at a time by each microbatch's loops, and updated row
      by row after them (``streamed_params``).
  """

  where: dict[int, str]
  reasons: dict[int, str]
  streamed: frozenset[int] = frozenset()


def streamed_params(placed: Placed) -> frozenset[int]:
  """The param leaves a step with ``offload="params"`` keeps in host memory: those it updates
  in a fused loop, and with microbatches those its ``Placed`` names ``streamed``."""
  return placed.streamed | {i for i, where in placed.where.items() if where == "loop"}


# ``step(params, state, *args, **kwargs) -> ((value, params, state), Placed)``: a step that
# returns what its trace placed where (``describe`` reads it, ``optfuse.fuse``'s step drops it).
PlacedStep = Callable[..., tuple[tuple[Any, Any, Any], Placed]]

NOTHING_PLACED = Placed({}, {})


def without_placements(step: PlacedStep) -> Step:
  """``step`` returning ``(value, params, state)`` only."""
  @functools.wraps(step)
  def run(*args, **kwargs):
    return step(*args, **kwargs)[0]

  return run


def microbatched(rows: Iterable[int], stacked: Iterable[int], float_leaves: Iterable[int],
                 microbatches: int, before: bool, streamed: Iterable[int] = ()) -> Placed:
  """The placements of a step over ``microbatches``: its update runs once, outside the loop
  over microbatches (``before`` it in forward mode, after it otherwise), row by row in place
  for the leaves of ``rows`` and whole for the others; no leaf is updated in a loop of the
  loss. The params of ``streamed`` (a part of ``rows``) live in host memory."""
  rows, floats = frozenset(rows), frozenset(float_leaves)
  when = "before" if before else "after"
  why = (f"with microbatches={microbatches} the update runs once, {when} the loop over the "
         "microbatches, not in the loops of the loss")
  return Placed({i: "rows" if i in rows else "leaf" for i in sorted(floats)},
                dict.fromkeys(sorted(frozenset(stacked) & floats), why), frozenset(streamed))


class Engine(Protocol):
  """One mode of running a training step.

  An engine is built from the transformation and the ``FuseOptions`` of the step it runs
  (``_fuse.ENGINES``), and keeps them.

  Attributes:
    tx: the wrapped optax transformation.
    options: the options of the step it runs.
    unplaced: where a step's ``Placed`` says a float leaf runs when it names no other place
      ("tap", "leaf", "optax").
  """

  tx: optax.GradientTransformation
  options: FuseOptions
  unplaced: str

  def init(self, params) -> Any:
    """The engine's state for ``params`` (``tx.init(params)`` unless the mode keeps more)."""

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    """The training step of ``loss_fn``: it checks its params and state, and with
    ``microbatches > 1`` averages the gradients of that many slices of the batch. It returns
    its outputs and the ``Placed`` its trace found."""

  def flush(self, params, state) -> tuple[Any, Any]:
    """``(params, state)`` with nothing pending (identity unless the mode defers updates)."""
