"""The in-place row-buffer idiom: update one row of stacked buffers per loop iteration.

Every row loop of optfuse (the backward loop of a fused scan, the forward loop that applies a
pending update before each layer, the row updates before the loss) updates a stacked param and
its optimizer-state slots in place with ``dynamic_update_slice``. XLA does that without copying
a buffer only when it can prove that every read of the old buffer happens before its write, and
it keeps a row alive from the point it is sliced to its last use. ``row_loop`` orders the reads
and writes of each leaf so that both hold:

* the param row is *prefetched*: read at the end of the previous iteration from the buffer just
  written (the body reads it all iteration long, and a read that depends on the last write is
  one XLA can order before the next one);
* the slot rows (Adam's ``mu`` and ``nu``) are read only once the value they are combined with
  exists (``read_slots(j, x)``: the leaf's gradient row), and written only after the param row
  is (``after``), so that their reads fuse into the update and they are never held through the
  body's VJP. A loop whose gradient rows are slices of a buffer (forward fusion's pending
  update) reads them unordered (``x=None``): there is no VJP to hold them through, and the
  ordered index costs time (``_fused_scan._ForwardLoop.pre_update``).

Which of these orders applies is the compiler's and the device count's choice, made once per
traced step by its engine: every function here that orders or lays out takes that step's
``LoopPolicy`` (``_backends.loop_policy``) as its first argument.

Measured on the 1.3B decoder (AdamW, backward fusion): prefetching every row kept 12 rows
(three layer rows, 576 MiB) alive through the VJP, 18.02 GB peak; this order holds only the four
param rows, 17.61 GB. An unordered read of old ``mu`` next to its in-place write makes XLA copy
the whole stack every iteration instead (an optimization barrier does not order them: XLA's CPU
pipeline drops it before copy insertion).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from optfuse._base._memory_spaces import is_host, like, to_device
from optfuse._targets._backends import LoopPolicy


def row_at(x, index, axis: int = 0):
  """Row ``index`` of ``x`` along ``axis`` (the axis removed), in device memory: a row of a
  host-resident stack (``_memory_spaces``) is moved to the device, where the update reads it."""
  return to_device(lax.dynamic_index_in_dim(x, index, axis, keepdims=False))


def write_row(policy: LoopPolicy, buf, row, index, axis: int = 0):
  """``buf`` with its row ``index`` along ``axis`` replaced by ``row`` (cast to its dtype, and
  moved to host memory when ``buf`` lives there)."""
  row = row.astype(buf.dtype)
  if is_host(buf):  # a streamed row: pinned on the device, before its move to the host stack
    row = _stored_layout(policy, row)
  return lax.dynamic_update_index_in_dim(buf, like(row, buf), index, axis)


def _stored_layout(policy: LoopPolicy, x):
  """``x`` pinned to the row-major layout the step's arguments have, where the compiler would
  otherwise choose another for a stack or a row written into one (``LoopPolicy.stored_layouts``):
  it laid packed low-bit codes out column-major, and relayouted their whole host stack."""
  if x.ndim < 2 or not policy.stored_layouts:
    return x
  return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def write_param_row(policy: LoopPolicy, buf, row, index, axis: int = 0):
  """``write_row`` for a param stack: the new stack keeps the row-major layout the step's
  arguments have, where the compiler would relayout a loop-carried stack whole
  (``LoopPolicy.stored_layouts``)."""
  out = write_row(policy, buf, row, index, axis)
  return out if is_host(out) else _stored_layout(policy, out)


def after(policy: LoopPolicy, index, x):
  """``index``, as a value XLA computes only once ``x`` exists: reads and writes at it follow
  ``x``. (``min(i, max(d, i)) == i`` for any integer ``d``, an identity XLA does not fold.)

  Unordered (``LoopPolicy.ordered``: several devices) it is ``index`` itself: when ``x`` is
  sharded (FSDP) the element it would read lives on one device, and reading it would add a
  scalar collective per leaf and iteration to the loop.
  """
  if x is None or not jnp.size(x) or not policy.ordered:
    return index
  dep = x[(0,) * jnp.ndim(x)].real.astype(jnp.int32)
  return jnp.minimum(index, jnp.maximum(dep, index))


def value_after(x, dep, other=None):
  """``x``, as a value XLA computes only once ``dep`` exists (``x`` itself when ``dep`` has no
  element).

  It is ``where(pred, x, other)`` (``other`` defaults to zeros) for a ``pred`` computed from
  ``dep`` that is always true: ``(bits | 1) != 0`` for the bits of ``dep``'s first element,
  NaN included. An optimization barrier alone does not order them: XLA sees through it. With
  ``other`` a buffer that is dead afterwards, XLA can write the result into it.
  """
  deps = [d for d in jax.tree.leaves(dep) if jnp.size(d)]
  if not deps:
    return x
  first = jnp.ravel(deps[0])[0].astype(jnp.float32)
  bits = lax.bitcast_convert_type(first, jnp.int32)
  return jnp.where((bits | 1) != 0, x, jnp.zeros_like(x) if other is None else other)


class Stack(NamedTuple):
  """One stacked leaf's buffers in a row loop: its param and its state slots, stacked along
  ``axis``."""

  param: Any
  slots: tuple
  axis: int


def write_stack(policy: LoopPolicy, stack: Stack, param_row, slot_rows, index) -> Stack:
  """Writes a leaf's new rows at ``index``: the param row (``None``: kept), then the slot rows
  (``None``: kept) after it."""
  param, at = stack.param, index
  if param_row is not None:
    param = write_param_row(policy, param, param_row, index, stack.axis)
    at = after(policy, index, _written(param, param_row))
  slots = tuple(s if r is None else write_row(policy, s, r, at, stack.axis)
                for s, r in zip(stack.slots, slot_rows or [None] * len(stack.slots)))
  return Stack(param, slots, stack.axis)


def _written(param, row):
  """What the slot rows of a leaf are ordered after once its param ``row`` is written into
  ``param``: the new stack, or with the stack in host memory (``offload="params"``) the row
  itself, which exists only once the old slot rows are read (reading an element of the host
  stack would be a computation in host memory, which the compilers move to the host)."""
  return row if is_host(param) else param


def write_stack_rereading(policy: LoopPolicy, stack: Stack, param_row, slot_fn: Callable, index
                          ) -> Stack:
  """Writes a leaf's new param row at ``index``, then its slot rows ``slot_fn(old_rows)``,
  computed from the old slot rows read again once the param row is written.

  XLA's CPU fusion does not fuse the read of a slot row into the in-place write of its stack:
  each old slot row is sliced into a buffer of its own. Read after the param row is written
  (rather than once the gradient row exists, as ``write_stack``'s slot rows are), those buffers
  are not alive while the new param row is (measured on an 8x256 scanned MLP with AdamW, the
  forward loop of forward fusion: 0.99 MB of temporaries instead of 1.19 MB). ``slot_fn``
  recomputes the new slots, which the param update computed already.
  """
  param = write_param_row(policy, stack.param, param_row, index, stack.axis)
  at = after(policy, index, _written(param, param_row))
  new_rows = slot_fn([row_at(s, at, stack.axis) for s in stack.slots])
  slots = tuple(write_row(policy, s, r, at, stack.axis) for s, r in zip(stack.slots, new_rows))
  return Stack(param, slots, stack.axis)


def read_slots(policy: LoopPolicy, stack: Stack, index, x) -> list:
  """A leaf's slot rows at ``index``, read once ``x`` exists (``None``: unordered)."""
  at = after(policy, index, x)
  return [row_at(s, at, stack.axis) for s in stack.slots]


# ``body(k, index, param_rows, read, carry) -> (new_rows, carry)``: ``read(j, x)`` gives leaf
# ``j``'s slot rows read after ``x``; ``new_rows[j]`` is ``(param_row, slot_rows)``, ``None``s
# where a row is kept.
RowBody = Callable[[Any, Any, list, Callable, Any], tuple[Sequence, Any]]


def row_loop(policy: LoopPolicy, length: int, index_of: Callable, stacks: Sequence[Stack],
             body: RowBody, carry, first=None, prefetch: bool = True
             ) -> tuple[list[Stack], Any]:
  """Runs ``body`` once per row, updating the ``stacks`` in place in the order above.

  Args:
    policy: the step's per-compiler choices.
    length: the number of iterations.
    index_of: ``index_of(k)``, the row of iteration ``k`` (``k`` or ``length - 1 - k``).
    stacks: the stacked leaves the loop updates.
    body: the iteration (``RowBody``).
    carry: the loop's other state.
    first: a value the first param rows are read after (the loop's first input), so that XLA
      does not slice them at the start of the step and hold them until the loop.
    prefetch: ``False`` when the body writes no param row (``None`` param rows): each
      iteration then reads its rows itself, as there is no write to order them after, and the
      loop carries no row (a carried row is one more row alive and two row copies per
      iteration; measured on the capture loop of forward fusion).

  Returns:
    ``(stacks, carry)`` after the last iteration.

  On one device a loop with slots in host memory (``offload="state"``) prefetches every row
  where the platform's compiler measured better with it (``LoopPolicy.streamed_prefetch``:
  TPU): the next iteration's slot rows start their host-to-device transfer at the end of this
  iteration, so that it overlaps the next layer's pullback instead of waiting for its gradient
  row (one row per slot more on the device). Elsewhere (GPU) they are read once the gradient
  row exists, as on one device without offload. On several devices every row is prefetched but
  the host-resident ones the policy reads in the iteration that uses them (``_kind_major_loop``).
  """
  streamed = any(is_host(t) for s in stacks for t in s.slots)
  prefetch_slots = streamed and policy.streamed_prefetch
  loop = _leaf_major_loop if policy.ordered and not prefetch_slots else _kind_major_loop
  return loop(policy, length, index_of, list(stacks), body, carry, first, prefetch)


# The two layouts of the loop's carry. They hold the same values; XLA assigns buffers
# differently for them (measured): on one device the per-leaf ``(param, slots)`` pairs keep
# the 6.6B decoder at 84.48 GB (84.75 GB the other way) and the quick suite's scanned MLP at
# 0.96x optax's step time (1.09x); under SPMD the loop's own state first and the params, the
# slots and the rows as tuples of their own keep the 1.3B decoder on 8 devices at 3.87 GB per
# device (3.94 GB the other way).


def _leaf_major_loop(policy, length, index_of, stacks, body, carry, first, prefetch):
  """One device: reads ordered with ``after``, the carry as per-leaf ``(param, slots)``."""
  axes = [s.axis for s in stacks]
  restack = lambda buffers: [Stack(p, tuple(t), a) for (p, t), a in zip(buffers, axes)]
  param_rows = lambda stacks, index: [row_at(s.param, index, s.axis) for s in stacks]

  def iteration(k, state):
    buffers, rows, carry = state
    stacks, index = restack(buffers), index_of(k)
    rows = rows if prefetch else param_rows(stacks, index)
    read = lambda j, x: read_slots(policy, stacks[j], index, x)
    new_rows, carry = body(k, index, rows, read, carry)
    stacks = [write_stack(policy, s, *new, index) for s, new in zip(stacks, new_rows)]
    next_rows = param_rows(stacks, index_of(jnp.minimum(k + 1, length - 1))) if prefetch else []
    return [(s.param, s.slots) for s in stacks], next_rows, carry

  init = ([(s.param, s.slots) for s in stacks],
          param_rows(stacks, after(policy, index_of(0), first)) if prefetch else [], carry)
  buffers, _, carry = lax.fori_loop(0, length, iteration, init)
  return restack(buffers), carry


def _kind_major_loop(policy, length, index_of, stacks, body, carry, first, prefetch):
  """Several devices: the carry as the loop's state, then the params, the slots and the rows.

  Every row is prefetched, but for a host-resident one that the policy reads in the iteration
  that uses it (``LoopPolicy.streamed_prefetch`` for slot rows, ``streamed_param_prefetch`` for
  param rows): a prefetched row from the host is one more row in device memory for the whole
  iteration, where a device-resident row read in the iteration makes XLA copy its stack.
  """
  del first  # ``after`` is the index itself on several devices
  axes = [s.axis for s in stacks]
  ahead = ([prefetch and (policy.streamed_param_prefetch or not is_host(s.param))
            for s in stacks],
           [tuple(prefetch and (policy.streamed_prefetch or not is_host(t)) for t in s.slots)
            for s in stacks])

  def rows_at(params, slots, index):
    """The rows at ``index`` of the stacks read ahead, ``None`` for the others."""
    return ([row_at(p, index, a) if go else None for p, a, go in zip(params, axes, ahead[0])],
            [tuple(row_at(t, index, a) if go else None for t, go in zip(ts, gos))
             for ts, a, gos in zip(slots, axes, ahead[1])])

  def iteration(k, state):
    carry, params, slots, rows = state
    stacks = [Stack(p, tuple(t), a) for p, t, a in zip(params, slots, axes)]
    index = index_of(k)
    here = lambda row, stack, axis: row_at(stack, index, axis) if row is None else row
    param_rows = [here(r, p, a) for r, p, a in zip(rows[0], params, axes)]
    read = lambda j, x: [here(r, t, axes[j]) for r, t in zip(rows[1][j], slots[j])]
    new_rows, carry = body(k, index, param_rows, read, carry)
    stacks = [write_stack(policy, s, *new, index) for s, new in zip(stacks, new_rows)]
    params, slots = tuple(s.param for s in stacks), tuple(s.slots for s in stacks)
    return carry, params, slots, rows_at(params, slots, index_of(jnp.minimum(k + 1, length - 1)))

  params, slots = tuple(s.param for s in stacks), tuple(tuple(s.slots) for s in stacks)
  init = (carry, params, slots, rows_at(params, slots, index_of(0)))
  carry, params, slots, _ = lax.fori_loop(0, length, iteration, init)
  return [Stack(p, tuple(t), a) for p, t, a in zip(params, slots, axes)], carry
