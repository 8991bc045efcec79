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

With ``offload="auto"`` each leaf streams what its own arrays' memory spaces say: ``init``
leaves the state on the device, ``optfuse.place`` moves the slots (and the param stacks) the
plan streams to the host, and the step accepts any placement of the loops' param stacks and of
the slots (the streaming code reads each buffer's memory space), refusing only a param in host
memory that no fused loop updates.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from optfuse._base import _memory_spaces
from optfuse._engines._engine import Engine, Placed, PlacedStep, streamed_params


class OffloadEngine:
  """``engine`` with its state's slots in host memory: fetched whole for optax's step (mode
  "off"), streamed by the fused modes' engines themselves; with ``offload="params"`` the param
  stacks of the fused loops too."""

  def __init__(self, engine: Engine):
    self.engine, self.whole = engine, engine.options.mode == "off"
    self.mixed = engine.options.offload == "auto"
    self.tx, self.options, self.unplaced = engine.tx, engine.options, engine.unplaced

  def init(self, params):
    # With offload="params" the params may be in host memory already, where optax's init
    # cannot make its zeros "like" them (JAX places them on the device buffers it makes).
    # With offload="auto" the state starts on the device: ``optfuse.place`` moves it.
    state = self.engine.init(_memory_spaces.tree_to_device(params))
    return state if self.mixed else _memory_spaces.state_to_host(state)

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    inner = self.engine.step(loss_fn, has_aux, microbatches)

    def step(params, state, *args, **kwargs):
      if not self.mixed:
        _memory_spaces.check_on_host(state)
      if not self.whole:
        return inner(params, state, *args, **kwargs)
      on_device = _memory_spaces.tree_to_device(state)
      (value, params, new_state), placed = inner(params, on_device, *args, **kwargs)
      return (value, params, _memory_spaces.tree_like(new_state, state)), placed

    return step

  def flush(self, params, state):
    # Forward mode's flush starts a new pending gradient (zeros): it goes to the host too. It
    # updates every leaf whole, on the device: host-resident params are fetched and put back.
    new_params, state = self.engine.flush(_memory_spaces.tree_to_device(params), state)
    return _memory_spaces.tree_like(new_params, params), _memory_spaces.state_to_host(state)


def with_params_placed(step: PlacedStep, mixed: bool = False) -> PlacedStep:
  """``step`` of ``offload="params"``, refusing params not where it keeps them: it raises
  ``OffloadError`` unless exactly the leaves its trace streams (``streamed_params``: those it
  placed in a fused loop) are in host memory (``_memory_spaces.check_params_placed``); ``mixed``
  (``offload="auto"``): unless every leaf in host memory is one of those. ``describe`` traces
  the step without this check: it says where the params go, wherever they are."""

  def checked(params, *args, **kwargs):
    try:
      outs, placed = step(params, *args, **kwargs)
    except Exception:
      # A leaf in host memory that an equation outside the loops reads fails the trace: the
      # placements of the same step on device-resident params name it.
      if any(_memory_spaces.is_host(x) for x in jax.tree.leaves(params)):
        _check_placed(params, _placements_on_device(step, params, args, kwargs), mixed)
      raise
    _check_placed(params, placed, mixed)
    return outs, placed

  return checked


def _check_placed(params, placed: Placed, mixed: bool) -> None:
  _memory_spaces.check_params_placed(params, streamed_params(placed), mixed)


def _placements_on_device(step: PlacedStep, params, args: tuple, kwargs: dict) -> Placed:
  """What ``step``'s trace places where, traced abstractly on ``params`` in device memory."""
  found: list[Placed] = []
  on_device = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                           params)
  jax.eval_shape(lambda p, a, kw: found.append(step(p, *a, **kw)[1]), on_device, args, kwargs)
  return found[0]
