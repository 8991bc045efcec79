"""``offload``: an engine whose optimizer state (``"state"``), and the params of its fused loops
(``"params"``), live in host memory between steps.

It wraps the mode's engine. ``init`` puts the slots in host memory
(``_memory_spaces.state_to_host``); the step is the mode's own:

* backward fusion streams them: each tap moves its leaf's slots to the device and the new ones
  back, and each fused loop moves one row of each slot stack per iteration (prefetched an
  iteration ahead where the platform's compiler measured it better: ``_backends``), so the
  device holds a few rows of state, never the stack;
* forward fusion streams the pending gradient too (``init`` places it with the slots): its
  stacked leaves are updated row by row in the forward loop, and the global stage (the clipping
  factor) is reduced from one host row at a time (``_apply.global_stage``);
* optax's step (mode "off") fetches the whole state to the device before the update and writes
  it back after, as JAX's host-offloading tutorial and MaxText's
  ``optimizer_memory_host_offload`` do: the reference the streamed step is measured against.

With ``offload="params"`` the param stacks the fused loops update ("loop" placements) live in
host memory too: the loops read each of their rows to the device where the forward iteration
and the backward iteration use it (``_row_buffers.row_at``) and write the updated row back to
the host stack (``_row_buffers.write_row``), and the loss is traced on device-typed stand-ins
of those stacks (``_loops``), which no equation outside a fused loop reads. The user places
the params (``optfuse.params_to_host``): the step checks where each leaf is.
"""

from __future__ import annotations

from collections.abc import Callable

from optfuse._base import _memory_spaces
from optfuse._base._errors import OffloadError
from optfuse._engines._engine import Engine, Step


class OffloadEngine:
  """``engine`` with its state's slots in host memory: fetched whole for optax's step (mode
  "off"), streamed by the fused modes' engines themselves; with ``offload="params"`` the param
  stacks of the fused loops too."""

  def __init__(self, engine: Engine):
    self.engine, self.whole = engine, engine.options.mode == "off"
    self.tx, self.options, self.unplaced = engine.tx, engine.options, engine.unplaced
    self.params = engine.options.offload == "params"

  def init(self, params):
    return _memory_spaces.state_to_host(self.engine.init(params))

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> Step:
    if self.params and microbatches > 1:
      raise OffloadError(
          "offload='params' streams params through the loops of one backward pass; with "
          "microbatches the update after the accumulation loop would read the whole stacks. "
          "Use offload='state' with microbatches, or microbatches=None.")
    inner = self.engine.step(loss_fn, has_aux, microbatches)

    def step(params, state, *args, **kwargs):
      _memory_spaces.check_on_host(state)
      if self.params:
        self.check_params(loss_fn, params, state, args, kwargs)
      if not self.whole:
        return inner(params, state, *args, **kwargs)
      on_device = _memory_spaces.tree_to_device(state)
      value, params, new_state = inner(params, on_device, *args, **kwargs)
      return value, params, _memory_spaces.tree_like(new_state, state)

    return step

  def check_params(self, loss_fn: Callable, params, state, args: tuple, kwargs: dict) -> None:
    """Raises ``OffloadError`` unless exactly the leaves the step updates in a fused loop are
    in host memory (``_memory_spaces.check_params_placed``)."""
    where, _ = self.engine.placements(loss_fn, params, state, args, kwargs)
    streamed = {i for i, place in where.items() if place == "loop"}
    _memory_spaces.check_params_placed(params, streamed)

  def flush(self, params, state):
    # Forward mode's flush starts a new pending gradient (zeros): it goes to the host too. It
    # updates every leaf whole, on the device: host-resident params are fetched and put back.
    new_params, state = self.engine.flush(_memory_spaces.tree_to_device(params), state)
    return _memory_spaces.tree_like(new_params, params), _memory_spaces.state_to_host(state)

  def placements(self, loss_fn, params, state, args, kwargs):
    return self.engine.placements(loss_fn, params, state, args, kwargs)
