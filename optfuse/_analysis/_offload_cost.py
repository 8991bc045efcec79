"""What offload costs in time: the bytes a streamed step moves, and how long they take.

A model, not a timing. Per step, from the plan:

- a param row in host memory (``offload="params"``) is read to the device twice, by the forward
  iteration that runs its layer and by the backward iteration that recomputes it, and written
  back once, by the backward iteration that updates it;
- a state row in host memory is read once and written once, by the iteration that updates it;
  forward mode's pending gradient likewise (written by the backward loop, read by the next
  step's forward loop).

So a step reads ``2 P + S`` bytes and writes ``P + S``, with ``P`` the host-resident params and
``S`` every other host-resident input (the state, the pending gradient): ``moved_bytes``. The
plan gives both (``plan_bytes``): ``P`` from ``describe``'s placements, ``P + S`` from the host
memory spaces of the lowered step's inputs.

The transfers take ``reads / link bandwidth`` (a PCIe link carries each direction apart, and
the reads are the larger); the step's matmuls take ``FLOPs / peak FLOP/s`` (``step_flops``:
the decoder's matmuls, forward, recomputed forward and backward). The transfer hides behind
the compute from the batch at which the matmuls take as long as the transfers
(``hiding_batch``): the bytes do not grow with the batch, the FLOPs do. The chips' figures and
their sources are ``optfuse._targets._hosts.CHIPS``. Peak FLOP/s is what no step reaches, so
the model's matmul time is a lower bound and its hiding batch an upper bound: at 40 % of peak
the transfers hide from 0.4 times that batch. ``python -m optfuse.bench --offload-cost`` prints
it for the benchmark's decoders.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import jax

from optfuse import _fuse
from optfuse._analysis import _describe, _memory
from optfuse._base._leaves import nbytes
from optfuse._targets import _hosts


class DecoderShape(Protocol):
  """What ``step_flops`` reads of a decoder's configuration (``optfuse.bench``'s
  ``DecoderConfig`` is one)."""

  layers: int
  dim: int
  ff: int
  vocab: int
  seq: int
  batch: int


class Moved(NamedTuple):
  """Bytes a step moves across the host link.

  Attributes:
    reads: host to device.
    writes: device to host.
  """

  reads: int
  writes: int


def moved_bytes(param_bytes: int, other_bytes: int) -> Moved:
  """The bytes a streamed step moves: host params read twice and written once, every other
  host-resident input (state, pending gradient) read once and written once.

  Args:
    param_bytes: bytes of the params in host memory (``offload="params"``; 0 otherwise).
    other_bytes: bytes of the step's other host-resident inputs.

  Returns:
    The bytes read and written a step.

  Examples:
    >>> moved_bytes(param_bytes=4, other_bytes=8)
    Moved(reads=16, writes=12)
  """
  return Moved(2 * param_bytes + other_bytes, param_bytes + other_bytes)


def plan_bytes(fx: _fuse.FusedTransformation, loss_fn, params, batch: tuple) -> tuple[int, int]:
  """``(P, S)`` of ``moved_bytes`` for ``fx``'s step: the bytes of the params it keeps in host
  memory, and of its other host-resident inputs, from the plan and the lowered step's types
  (no compile)."""
  where = _describe.describe(fx, loss_fn, params, *batch).params
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  param = sum(nbytes(x) for path, x in flat
              if where.get(jax.tree_util.keystr(path)) == "host")
  lowered = _memory.lower_step(fx, loss_fn, params, batch)
  host = sum(nbytes(a) for a in jax.tree.leaves(lowered.in_avals)
             if getattr(a, "memory_space", None) == jax.memory.Space.Host)
  return param, host - param


def step_flops(c: DecoderShape, remat: bool = True) -> int:
  """Matmul FLOPs of one training step of the scanned decoder of configuration ``c``
  (``optfuse.bench._models.decoder(c, scanned=True, remat=remat)``).

  Per token and layer, the forward pass multiplies by the qkv, proj, up and down matrices
  (``2 d (3d + d + 2 ff)`` FLOPs) and runs attention over the whole sequence (``4 T d``: the
  model masks the scores, it computes them all); the tied head adds ``2 d vocab``. The
  backward pass costs twice the forward; remat runs the layers' forward once more.

  Examples:
    >>> from types import SimpleNamespace
    >>> c = SimpleNamespace(layers=1, dim=1, ff=1, vocab=1, seq=1, batch=1)
    >>> step_flops(c, remat=False)  # (2 * (3 + 1 + 2) + 4 + 2) * 3
    54
  """
  layer = 2 * c.dim * (4 * c.dim + 2 * c.ff) + 4 * c.seq * c.dim
  head = 2 * c.dim * c.vocab
  passes = 4 if remat else 3
  return c.batch * c.seq * (passes * c.layers * layer + 3 * head)


class Cost(NamedTuple):
  """The model's answer for one step on one chip.

  Attributes:
    transfer_s: seconds the reads take at the chip's host link (``None``: link unknown).
    matmul_s: seconds the step's matmuls take at the chip's peak, at the step's batch.
    hiding_batch: the smallest batch whose matmuls take as long as the transfers (``None``:
      link unknown).
    link_needed: bytes/s each way the link needs for the transfers to hide at this batch.
  """

  transfer_s: float | None
  matmul_s: float
  hiding_batch: int | None
  link_needed: float


def cost(moved: Moved, flops: int, chip: _hosts.Chip) -> Cost:
  """The transfer time beside the matmul time of a step that moves ``moved`` and computes
  ``flops`` on ``chip``, and the batch from which the transfer hides (``flops`` is the step's
  at its batch; the hiding batch scales it, counted in multiples of that batch).

  Examples:
    >>> chip = _hosts.Chip("x", "x", 1e12, "", 1e9, "")
    >>> cost(Moved(reads=3e9, writes=1e9), flops=1e12, chip=chip)
    Cost(transfer_s=3.0, matmul_s=1.0, hiding_batch=3, link_needed=3000000000.0)
  """
  matmul = flops / chip.peak_flops
  needed = moved.reads / matmul
  if chip.link_bytes_per_s is None:
    return Cost(None, matmul, None, needed)
  transfer = moved.reads / chip.link_bytes_per_s
  return Cost(transfer, matmul, max(1, math.ceil(transfer / matmul - 1e-9)), needed)
