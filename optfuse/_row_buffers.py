"""The in-place row-buffer idiom: read, update and write one row of stacked buffers per
iteration, with the next rows prefetched from the buffers just written.

Every row loop of optfuse (the backward loop of a fused scan, the forward loop that applies a
pending update before each layer, the row updates before the loss) updates stacked params and
optimizer state in place with ``dynamic_update_slice``. XLA does that without copying a buffer
only when it can prove that no read of the old buffer happens after its write. Reading the next
iteration's rows from the buffers *just written* (``row_loop``) makes every read of a buffer
depend on its last write: an unordered read of old ``mu`` next to the in-place write of ``mu``
makes XLA copy the whole buffer every iteration (measured in ``_fused_scan``: both moment
stacks of AdamW copied per layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def row_at(x, index, axis: int = 0):
  """Row ``index`` of ``x`` along ``axis`` (the axis removed)."""
  return lax.dynamic_index_in_dim(x, index, axis, keepdims=False)


def write_row(buf, row, index, axis: int = 0):
  """``buf`` with its row ``index`` along ``axis`` replaced by ``row`` (cast to its dtype)."""
  return lax.dynamic_update_index_in_dim(buf, row.astype(buf.dtype), index, axis)


def read_rows(buffers, axes, index):
  """Row ``index`` of every buffer of the pytree ``buffers``, along the matching ``axes``."""
  return jax.tree.map(lambda b, a: row_at(b, index, a), buffers, axes)


def write_rows(buffers, rows, axes, index):
  """Writes ``rows`` into ``buffers`` at ``index``; a ``None`` row leaves its buffer as it is."""
  return jax.tree.map(lambda b, r, a: b if r is None else write_row(b, r, index, a),
                      buffers, rows, axes)


def row_loop(length: int, index_of: Callable, buffers, axes,
             body: Callable[[Any, Any, Any, Any], tuple[Any, Any]], carry):
  """Runs ``body`` once per row, updating ``buffers`` in place.

  Args:
    length: the number of iterations.
    index_of: ``index_of(k)``, the row of iteration ``k`` (``k`` or ``length - 1 - k``).
    buffers: a pytree of stacked arrays.
    axes: the stacked axis of each buffer (a pytree like ``buffers``).
    body: ``body(k, index, rows, carry) -> (new_rows, carry)``; ``rows`` are the buffers' rows
      at ``index``, ``new_rows`` is a pytree like them (``None`` leaves a buffer's row as it is).
    carry: the loop's other state.

  Returns:
    ``(buffers, carry)`` after the last iteration.
  """
  def iteration(k, state):
    buffers, rows, carry = state
    index = index_of(k)
    new_rows, carry = body(k, index, rows, carry)
    buffers = write_rows(buffers, new_rows, axes, index)
    return buffers, read_rows(buffers, axes, index_of(jnp.minimum(k + 1, length - 1))), carry

  init = (buffers, read_rows(buffers, axes, index_of(0)), carry)
  buffers, _, carry = lax.fori_loop(0, length, iteration, init)
  return buffers, carry
