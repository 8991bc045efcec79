"""Where forward fusion applies each leaf's pending update, decided from shapes alone.

Unstacked leaves are updated whole before the loss. A stacked leaf (a param a ``lax.scan``
reads as its stacked input) is updated whole before the loss when that runs in place, whole
from its staged (clipped) gradient, or row by row: inside the forward loop that reads it, or in
a row loop before the loss (see ``_forward``). The new gradient is captured by a backward-fused
step of ``capture()``, whose state is the gradient itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optfuse import _leaves, _loops, _split
from optfuse._apply import stacked_rows, stacked_staged
from optfuse._forward_state import ForwardState
from optfuse._offload import is_host
from optfuse._plan import Plan


class Placement(NamedTuple):
  """Where a forward-mode step updates each leaf and captures its gradient.

  Attributes:
    capture_plan: the plan of the backward-fused step that captures the new gradient.
    loop_plan: its loop plan: the leaves whose gradient rows a backward loop writes in place.
    in_loop: leaves updated row by row inside the forward loop that reads them.
    rows: other stacked leaves updated row by row, in place before the loss runs (the rest
      are updated whole before it).
    staged: stacked leaves updated whole through their staged (clipped) gradient, which takes
      over the pending gradient's buffer (``apply_pending``).
    axes: leaf -> stacked axis of every stacked leaf.
  """

  capture_plan: Plan
  loop_plan: _loops.LoopPlan
  in_loop: frozenset[int]
  rows: frozenset[int]
  staged: frozenset[int] = frozenset()

  @property
  def axes(self) -> dict:
    return self.loop_plan.stacked


def placement(plan: Plan, loss_fn: Callable, params, state: ForwardState,
              args: tuple, kwargs: dict, rows_only: bool = False) -> Placement:
  """Decides, from shapes alone, where each leaf's pending update runs.

  A stacked leaf whose update is in place once its clipped gradient is staged
  (``_apply.stacked_staged``) is updated whole through it. One whose update never mixes rows
  and would hold a full-size temporary whole (``_apply.stacked_rows``) is updated row by row:
  inside the forward loop, each row just before the layer reads it, when a backward loop
  captures its gradient rows outside ``jax.checkpoint``, else before the loss. Every other leaf
  is updated whole before the loss.
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  grad_leaves = plan.params_def.flatten_up_to(state.pending_grads)
  state_leaves = jax.tree.leaves(state.opt_state)
  pending = jax.tree.unflatten(plan.params_def, grad_leaves)
  capture_plan = _split.make_plan(capture(), params, pending)
  diff = [i for i, p in enumerate(param_leaves) if _leaves.is_float(p)]
  loop_plan = _loops.analyze(loss_fn, capture_plan, params, grad_leaves, args, kwargs, diff)
  axes = loop_plan.stacked  # every float leaf a scan reads as its stacked input, any length
  # Inside ``jax.checkpoint`` the forward loop runs again in the backward pass: an update there
  # would be recomputed with fresh param and state stacks (measured: 1.05x optax's peak instead
  # of 0.97x for a checkpointed 16-layer stack), so those rows are updated before the loss.
  staged, by_rows = stacked_updates(plan, axes, state_leaves, param_leaves, grad_leaves,
                                     rows_only)
  by_rows &= frozenset(diff)
  in_loop = frozenset(i for i in loop_plan.fused_leaves if i in by_rows
                      and i not in loop_plan.in_remat)
  rows = by_rows - in_loop
  return Placement(capture_plan, loop_plan, in_loop, rows, staged)


def stacked_updates(plan: Plan, axes: dict, state: list, params: list, grads: list,
                     rows_only: bool = False) -> tuple[frozenset[int], frozenset[int]]:
  """``(staged, rows)``: the stacked leaves updated whole from their staged gradient, and
  those updated row by row (the others are updated whole). With ``rows_only``, and for a
  leaf whose pending gradient lives in host memory (``offload="state"``), every leaf whose
  update allows it is updated row by row: whole, its gradient and slots would be on the device
  at once."""
  streamed = frozenset(i for i in axes if (rows_only or is_host(grads[i]))
                       and plan.rowwise(i, state, params, axis=axes[i]))
  staged = stacked_staged(plan, axes, params) - streamed
  return staged, (stacked_rows(plan, axes, state, params) - staged) | streamed


def capture() -> optax.GradientTransformation:
  """A transformation whose state is the last gradient (its updates are zero)."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, grads), grads

  return optax.GradientTransformation(init, update)
