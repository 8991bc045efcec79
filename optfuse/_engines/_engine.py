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

from collections.abc import Callable
from typing import Any, Protocol

import optax

from optfuse._base._options import FuseOptions

# ``step(params, state, *args, **kwargs) -> (value, params, state)``.
Step = Callable[..., tuple[Any, Any, Any]]


class Engine(Protocol):
  """One mode of running a training step.

  An engine is built from the transformation and the ``FuseOptions`` of the step it runs
  (``_fuse.ENGINES``), and keeps them.

  Attributes:
    tx: the wrapped optax transformation.
    options: the options of the step it runs.
    unplaced: where ``placements`` says a float leaf runs when it names no other place
      ("tap", "leaf", "optax").
  """

  tx: optax.GradientTransformation
  options: FuseOptions
  unplaced: str

  def init(self, params) -> Any:
    """The engine's state for ``params`` (``tx.init(params)`` unless the mode keeps more)."""

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> Step:
    """The training step of ``loss_fn``: it checks its params and state, and with
    ``microbatches > 1`` averages the gradients of that many slices of the batch."""

  def flush(self, params, state) -> tuple[Any, Any]:
    """``(params, state)`` with nothing pending (identity unless the mode defers updates)."""

  def placements(self, loss_fn: Callable, params, state, args: tuple, kwargs: dict
                 ) -> tuple[dict[int, str], dict[int, str]]:
    """Where ``step`` updates each float param leaf, decided from shapes alone.

    Called under ``jax.eval_shape`` with abstract ``params``, ``state = init(params)`` and
    arguments.

    Returns:
      ``(where, reasons)``: leaf index -> its place, for leaves not at ``unplaced``; and leaf
      index -> why a leaf a scan reads as its stacked input is not updated in the loop.
    """
