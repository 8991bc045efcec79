"""``offload="state"``: an engine whose optimizer state lives in host memory between steps.

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
"""

from __future__ import annotations

from collections.abc import Callable

from optfuse._base import _memory_spaces
from optfuse._engines._engine import Engine, PlacedStep


class OffloadEngine:
  """``engine`` with its state's slots in host memory: fetched whole for optax's step (mode
  "off"), streamed by the fused modes' engines themselves."""

  def __init__(self, engine: Engine):
    self.engine, self.whole = engine, engine.options.mode == "off"
    self.tx, self.options, self.unplaced = engine.tx, engine.options, engine.unplaced

  def init(self, params):
    return _memory_spaces.state_to_host(self.engine.init(params))

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    inner = self.engine.step(loss_fn, has_aux, microbatches)

    def step(params, state, *args, **kwargs):
      _memory_spaces.check_on_host(state)
      if not self.whole:
        return inner(params, state, *args, **kwargs)
      on_device = _memory_spaces.tree_to_device(state)
      (value, params, new_state), placed = inner(params, on_device, *args, **kwargs)
      return (value, params, _memory_spaces.tree_like(new_state, state)), placed

    return step

  def flush(self, params, state):
    # Forward mode's flush starts a new pending gradient (zeros): it goes to the host too.
    params, state = self.engine.flush(params, state)
    return params, _memory_spaces.state_to_host(state)
