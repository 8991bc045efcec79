"""Forward fusion: step ``t``'s gradient is applied at the start of step ``t + 1``.

A forward-mode step receives the params and a ``ForwardState``: the optax state plus the
*pending* gradient of the previous step. It first applies the pending update (the global stage of
the update once, then each leaf's share; see ``_global_stage``), then runs the loss and its gradient
on the updated params and keeps that gradient as the new pending one. The params every forward pass
sees are therefore exactly optax's, for every transform: global-norm clipping, ``apply_if_finite``
and ``normalize_by_update_norm`` included, since the whole gradient is known when the update runs.

Unstacked leaves are updated before the loss runs; under ``jax.jit`` XLA is free to schedule (and
fuse) each leaf's update next to its first consumer. So are stacked layers (param leaves consumed by
a ``lax.scan``) whose whole update writes its param and slots in place (``Plan.in_place_whole``:
AdamW, SGD): a few elementwise passes at optax's speed, where a row loop costs kernels per row; and
so are those that read the clipping factor only through the clipped gradient
(``Plan.in_place_from_cut_gradient``): the clipped gradient (the cut gradient), which both of Adam's
moments read, is written over the pending gradient's buffer first (``apply_pending``), then the rest
of the update runs whole, in place. The others would hold a full-size temporary whole (Lion's old
momentum, read beside the new), so their rows are updated inside the scan: iteration ``l`` of the
forward loop reads row ``l`` of the pending gradient, param and optimizer state, writes the new
param and state rows in place and runs the layer on the new row (``_loops.PreUpdate``). That needs
an update that never mixes rows (``_rows``; other stacked leaves are updated whole before the loop);
inside ``jax.checkpoint``, and in loops too short to fuse, the rows are updated in place in a row
loop before the loss (``_apply``). The global stage (clipping factor, all-finite flag) runs once
before the loop; the rows read its result.

The new gradient is taken by a backward-fused step (``_backward``) of a transformation whose
state is the last gradient: each leaf's gradient, and each row of a scanned leaf inside the
backward loop (``_loops``), is written into the donated buffer of the pending gradient the
update has just consumed. ``jax.grad`` would build it in a fresh buffer that XLA then copies into
the donated one: one gradient more at the peak.

With microbatches the pending update is applied first, then each microbatch adds its gradient
to the new pending buffer inside its backward pass, in one loop (``_microbatch_step``).

``flush`` applies the pending update without a forward pass (evaluation, checkpoints, the end of
training); ``to_optax_state`` and ``from_optax_state`` convert to and from a plain optax state.

Which of these runs for each leaf is decided from shapes alone (``schedule``). The new gradient
is captured by a backward-fused step of ``capture()``, whose state is the gradient itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.experimental.shard_alike import shard_alike

from optfuse._base import _leaves
from optfuse._base._checks import check_params
from optfuse._base._errors import NonSeparableError, OffloadError
from optfuse._base._memory_spaces import host_leaves, is_host
from optfuse._base._options import FuseOptions
from optfuse._engines._engine import Placed, PlacedStep, microbatched
from optfuse._engines._forward_state import ForwardState, check_forward_state, no_pending
from optfuse._fusion import _accumulate, _fused_step, _loops
from optfuse._fusion._apply import apply_update, stacked_from_cut_gradient, stacked_rows
from optfuse._fusion._row_buffers import value_after
from optfuse._plan import _make
from optfuse._plan._plan import Plan, PlanCache
from optfuse._targets._backends import LoopPolicy, loop_policy


def _same_type(new, old):
  """``new`` in ``old``'s dtype, as optax keeps it; a typed PRNG key (``optax.add_noise``'s
  state) has no dtype to cast to and is returned as it is."""
  if jax.dtypes.issubdtype(jnp.result_type(old), jax.dtypes.prng_key):
    return new
  return jnp.asarray(new).astype(jnp.result_type(old))


def _selected_rows(plan: Plan, rows: frozenset[int], own_params: list, own_state: list,
                   from_cut: list) -> tuple[list, list, list, list]:
  """``apply``'s outputs as booleans: whether a row loop chose the value row by row."""
  row_slots = {k for i in rows for k in plan.groups[i].state_outs}
  return ([i in rows for i in own_params], [k in row_slots for k in own_state],
          [False] * len(plan.cuts), [False] * len(from_cut))


def apply_pending(plan: Plan, policy: LoopPolicy, params, state: ForwardState,
                  rows: frozenset[int] = frozenset(), deferred: frozenset[int] = frozenset(),
                  axes: dict | None = None, from_cut: frozenset[int] = frozenset()
                  ) -> tuple[Any, Any, list, list]:
  """Applies the pending update, if any: ``(params, opt_state, cuts, buffers)``.

  The global stage runs once on all the pending gradients, then each leaf's share (row by row
  in place for the stacked leaves of ``rows``, see ``_apply``), except for
  the leaves of ``deferred``, whose param and slots are returned as they are (their rows are
  updated inside the forward loop that reads them, from the ``cuts`` returned). When
  ``state.has_pending`` is false params and state are returned unchanged (and the cuts are
  zeros). On XLA:CPU the choice is one ``lax.cond`` rather than a select per leaf: a select
  keeps the old and the new value of every param and state leaf alive together (measured: 36 MB
  of temporaries instead of 0.5 MB for a 4M-param MLP with AdamW), while the conditional updates
  them in place. The GPU compiler copies the leaves the conditional updates whole, and updates
  them in place under a select (``policy.pending_select``), but for state in host memory.

  The leaves of ``from_cut`` are updated whole through their cut gradient (the clipped one,
  ``Plan.cut_gradient_split``), which the conditional returns: ``buffers`` is the flat pending
  gradient with it in their place, so that XLA writes it over the pending gradient's buffer
  (dead once the update has read it) and the next gradient is captured into that buffer.
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  state_leaves = jax.tree.leaves(state.opt_state)
  deferred_slots = {k for i in deferred for k in plan.groups[i].state_outs}
  own_params = [i for i in range(plan.num_params) if i not in deferred]
  own_state = [k for k in range(plan.num_state) if k not in deferred_slots]
  from_cut_leaves = sorted(from_cut)

  def apply(operands, rows_if=None):
    grads, state_leaves, param_leaves = operands
    new_params, new_state, cuts, buffers = apply_update(
        plan, policy, grads, state_leaves, param_leaves, rows, deferred, axes, from_cut,
        rows_if)
    # Both branches must give the same types; optax keeps each leaf's dtype (weak types aside).
    new_state = [_same_type(new_state[k], state_leaves[k]) for k in own_state]
    cuts = [jnp.asarray(c).astype(a.dtype) for c, a in zip(cuts, plan.cuts)]
    buffers = [buffers[i].astype(grads[i].dtype) for i in from_cut_leaves]
    return [new_params[i] for i in own_params], new_state, cuts, buffers

  def keep(operands):
    grads, state_leaves, param_leaves = operands
    return ([param_leaves[i] for i in own_params], [state_leaves[k] for k in own_state],
            [jnp.zeros(a.shape, a.dtype) for a in plan.cuts], [grads[i] for i in from_cut_leaves])

  operands = (plan.params_def.flatten_up_to(state.pending_grads), state_leaves, param_leaves)
  traced = isinstance(state.has_pending, jax.core.Tracer)
  if traced and policy.pending_select and not any(map(is_host, state_leaves)):
    # The row loops choose row by row (``_apply.update_rows``): their stacks are not selected
    # again whole.
    chosen = _selected_rows(plan, rows, own_params, own_state, from_cut_leaves)
    own_new_params, own_new_state, cuts, cut_grads = jax.tree.map(
        lambda new, old, row_chosen: new if row_chosen else jnp.where(state.has_pending, new, old),
        apply(operands, state.has_pending), keep(operands), chosen)
  elif traced:
    own_new_params, own_new_state, cuts, cut_grads = jax.lax.cond(
        state.has_pending, apply, keep, operands)
  else:  # eagerly, an eager cond would compile its freshly traced branches at every step
    own_new_params, own_new_state, cuts, cut_grads = (
        apply if state.has_pending else keep)(operands)
  new_params, new_state = list(param_leaves), list(state_leaves)
  for i, p in zip(own_params, own_new_params):
    new_params[i] = p
  for k, x in zip(own_state, own_new_state):
    new_state[k] = x
  buffers = list(operands[0])
  for i, g in zip(from_cut_leaves, cut_grads):
    buffers[i] = g
  return (jax.tree.unflatten(plan.params_def, new_params),
          jax.tree.unflatten(plan.state_def, new_state), cuts, buffers)


def _microbatch_step(plan: Plan, policy: LoopPolicy, loss_fn: Callable, has_aux: bool, params,
                     state: ForwardState, args: tuple, kwargs: dict, microbatches: int,
                     stream_params: bool = False):
  """A forward-fused step over ``microbatches`` slices of the batch: ``(value, params, state)``.

  The pending update is applied first (stacked leaves row by row in place, or whole in place
  from their cut gradient, as the single-batch step does), then every
  microbatch adds its gradient to the new pending buffer inside its own backward pass
  (``_accumulate.accumulate``), in one loop: the loss is compiled once, as in optax's
  accumulation loop. The loss is divided by ``microbatches``, so the buffer ends with the mean
  gradient and the values sum to the mean loss, as ``mode="off"`` computes them; the aux is
  stacked along a leading axis.

  With ``stream_params`` (``offload="params"``) the params of ``_accumulate.streamed_leaves``
  live in host memory: the pending update writes their new rows there (they are rows: their
  pending gradient is in host memory too), and each microbatch's loops read them a row at a
  time.
  """
  k = microbatches
  scaled = _accumulate.scale_loss(loss_fn, has_aux, k)
  batches = _accumulate.split(args, kwargs, k)
  # A sum in host memory starts in the pending gradient's buffer, which holds anything.
  analysis = _accumulate.analyze_loss(scaled, params, batches, policy,
                                      host_leaves(state.pending_grads))
  axes = analysis.loop_plan.stacked
  param_leaves = plan.params_def.flatten_up_to(params)
  from_cut, rows = stacked_updates(plan, axes, jax.tree.leaves(state.opt_state), param_leaves,
                                  plan.params_def.flatten_up_to(state.pending_grads),
                                  policy.forward_stacked_rows)
  streamed = (_accumulate.streamed_leaves(analysis, plan, jax.tree.leaves(state.opt_state),
                                          param_leaves, in_remat=False) if stream_params
              else frozenset())
  params, opt_state, _, buffers = apply_pending(plan, policy, params, state, rows, axes=axes,
                                                from_cut=from_cut)

  def body(acc, batch):
    value, acc = _accumulate.accumulate(scaled, has_aux, params, acc, *batch, analysis)
    return acc, value

  # The new sum starts in the buffers of the pending gradient (of the cut gradients that
  # took them over), once the update has read them: on the device as zeros made after the
  # update, so that XLA writes them there; in host memory (``offload="state"``) as the old
  # gradient itself, whose values the first microbatch writes over (``_accumulate.accumulator``):
  # zeros made whole would be whole on the device first, and written a row at a time they
  # would cross the host link once more.
  def start(g, p):
    return g if is_host(g) else value_after(jnp.zeros_like(g), p, g)

  zeros = analysis.first_state(jax.tree.unflatten(plan.params_def, [
      start(g, p) for g, p in zip(buffers, plan.params_def.flatten_up_to(params))]))
  total, values = lax.scan(body, zeros, batches)
  floats = [i for i, p in enumerate(param_leaves) if _leaves.is_float(p)]
  return ((_accumulate.sum_value(values, has_aux), params,
           _next_state(opt_state, total.sum, state.pending_grads)),
          microbatched(rows, axes, floats, microbatches, before=True, streamed=streamed))


def value_and_update(plan: Plan, policy: LoopPolicy, loss_fn: Callable, has_aux: bool, params,
                     state: ForwardState, args: tuple, kwargs: dict, microbatches: int = 1,
                     stream_params: bool = False) -> tuple[tuple[Any, Any, Any], Placed]:
  """One forward-fused step: ``((value, params, state), placed)``.

  Args:
    plan: the global plan of ``tx`` for these params and ``state.opt_state``.
    policy: the step's per-compiler choices (``_backends.loop_policy``); with
      ``forward_stacked_rows`` every stacked leaf whose update allows it is updated row by row,
      never whole.
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    params: the params tree.
    state: the ``ForwardState``.
    args: positional arguments of ``loss_fn`` after params.
    kwargs: keyword arguments of ``loss_fn``.
    microbatches: split the batch (the leading axis of every array argument) into this many
      slices and keep their mean gradient, as ``mode="off"`` does.
    stream_params: ``offload="params"``, with microbatches: the step streams the params of
      ``_accumulate.streamed_leaves`` (``_microbatch_step``); without them the streamed params
      are the "loop" leaves, whose rows every loop reads wherever they live.

  Returns:
    ``((value, params, state), placed)``: the loss (or ``(loss, aux)``) at the updated params,
    the updated params and a ``ForwardState`` whose pending gradient is this step's; and where
    the step updated each leaf (``Placed``).
  """
  if microbatches > 1:
    return _microbatch_step(plan, policy, loss_fn, has_aux, params, state, args, kwargs,
                            microbatches, stream_params)
  where = schedule(plan, loss_fn, params, state, args, kwargs, policy.forward_stacked_rows)
  # The new gradient is the state of a backward-fused ``capture()`` step: each leaf's gradient
  # (each row of a scanned leaf, inside the backward loop) is written into the buffer of the
  # pending gradient just consumed, which the step donates, instead of a fresh buffer that XLA
  # then copies into the donated one.
  param_leaves = plan.params_def.flatten_up_to(params)
  grad_leaves = plan.params_def.flatten_up_to(state.pending_grads)
  state_leaves = jax.tree.leaves(state.opt_state)
  in_loop = where.in_loop
  params, opt_state, cuts, buffers = apply_pending(plan, policy, params, state, where.rows,
                                                   in_loop, where.axes, where.from_cut)
  pre = {i: _pre_update(plan, policy, i, grad_leaves, state_leaves, param_leaves, cuts,
                        state.has_pending, where.axes) for i in in_loop}
  pending = jax.tree.unflatten(plan.params_def, buffers)
  value, _, grads, updated = _fused_step.value_and_update(
      where.capture_plan, policy, loss_fn, has_aux, params, pending, args, kwargs,
      update_params=False, loop_plan=where.loop_plan, pre_updates=pre)
  if in_loop:
    new_params = plan.params_def.flatten_up_to(params)
    new_state = jax.tree.leaves(opt_state)
    for i in in_loop:
      new_params[i], slots = updated[i]
      for k, slot in zip(plan.groups[i].state_outs, slots):
        new_state[k] = slot
    params = jax.tree.unflatten(plan.params_def, new_params)
    opt_state = jax.tree.unflatten(plan.state_def, new_state)
  placed = Placed({**dict.fromkeys(where.rows, "rows"), **dict.fromkeys(in_loop, "loop")},
                  dict(where.loop_plan.reasons))
  return (value, params, _next_state(opt_state, grads, state.pending_grads)), placed


def _pre_update(plan: Plan, policy: LoopPolicy, i: int, grads: list, state: list, params: list,
                cuts: list, has_pending, axes: dict) -> _loops.PreUpdate:
  """Leaf ``i``'s pending update as a ``PreUpdate``: row by row, inside the forward loop.

  The update reads the old state and params (``tx.update(g, state, params)``) and the cuts of
  this step's global stage; when nothing is pending the rows are kept as they are.
  """
  axis = axes.get(i, 0)
  group, length = plan.groups[i], jnp.shape(params[i])[axis]
  operands = (plan.readonly(i, state, params, cuts), has_pending)

  def row_fn(grad_row, param_row, slot_rows, operands, index):
    (state, params, cuts), enabled = operands
    update, new_slots = plan.run_group_row(i, state, params, cuts,
                                           (grad_row, param_row, slot_rows), index, length, axis)
    keep = lambda new, old: jnp.where(enabled, new.astype(old.dtype), old)
    return (keep(optax.apply_updates(param_row, update), param_row),
            [keep(new, old) for new, old in zip(new_slots, slot_rows)])

  def slots_fn(grads, slots, operands):
    (state, params, cuts), enabled = operands
    state = list(state)
    for k, slot in zip(group.state_outs, slots):
      state[k] = slot
    new_slots = plan.run_group_slots(i, grads, state, params, cuts)
    return [jnp.where(enabled, new.astype(old.dtype), old) for new, old in zip(new_slots, slots)]

  slots = tuple(state[k] for k in group.state_outs)
  # Whole slots are read on the device at once: not for slots in host memory; nor unordered,
  # where ordering the pass after the loop all-gathers a sharded stack (``loop_policy``).
  whole = (slots_fn if plan.slots_whole(i) and policy.ordered and not any(map(is_host, slots))
           else None)
  return _loops.PreUpdate(grads[i], slots, operands, row_fn, whole)


def _next_state(opt_state, grads, pending_grads) -> ForwardState:
  """The state that keeps ``grads`` pending, each leaf sharded like the pending gradient it
  replaces.

  Under a mesh with Auto axes XLA chooses the layout of a gradient from the matmul that makes it
  (``P(None, "fsdp")`` for the gradient of a ``P("fsdp")`` weight), so the state would come back
  resharded and the next step would move it back. ``shard_alike`` ties each new leaf to the
  donated buffer it takes over; without a mesh it changes nothing.
  """
  if jax.tree.leaves(grads):  # shard_alike cannot unpack the results of an empty tree
    grads, _ = shard_alike(grads, pending_grads)
  return ForwardState(opt_state, grads, jnp.ones((), jnp.bool_))


def _make_plan(tx: optax.GradientTransformation, params, opt_state, streamed: bool) -> Plan:
  """The global plan of ``tx``; ``streamed`` (``offload="state"``: the pending gradient in host
  memory) with its global stage split into per-leaf statistics, which ``_apply.global_stage``
  reduces one row at a time.

  Raises:
    OffloadError: ``streamed``, and the global stage does not split into per-leaf statistics.
  """
  if not streamed:
    return _make.make_plan(tx, params, opt_state, global_handling="tree")
  try:
    return _make.make_plan(tx, params, opt_state, global_handling="per_leaf")
  except NonSeparableError as e:
    raise OffloadError(
        f"forward fusion with offload='state' computes the global stage of the update from "
        f"per-leaf statistics of the pending gradient in host memory, and this one does not "
        f"split into them ({e}). Use offload=None.") from e


class ForwardEngine:
  """``mode="forward"``: leaves placed "loop" (inside a scan's forward loop), "rows" (row by row
  before the loss) or "leaf" (whole, before the loss)."""

  unplaced = "leaf"

  def __init__(self, tx: optax.GradientTransformation, options: FuseOptions):
    self.tx, self.options = tx, options
    # With offload="state" the pending gradient is streamed from host memory too.
    streamed = options.offload is not None
    self.plans = PlanCache(lambda params, opt_state: _make_plan(tx, params, opt_state, streamed))

  def init(self, params) -> ForwardState:
    check_params(params)
    return no_pending(params, self.tx.init(params))

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    def step(params, state, *args, **kwargs):
      check_params(params)
      check_forward_state(self.tx, params, state)
      plan = self.plans(params, state.opt_state)
      return value_and_update(plan, loop_policy(), loss_fn, has_aux, params, state, args,
                              kwargs, microbatches, self.options.offload == "params")

    return step

  def flush(self, params, state):
    check_params(params)
    check_forward_state(self.tx, params, state)
    params, opt_state, _, _ = apply_pending(self.plans(params, state.opt_state), loop_policy(),
                                            params, state)
    return params, no_pending(params, opt_state)


class Schedule(NamedTuple):
  """Where a forward-mode step updates each leaf and captures its gradient.

  Attributes:
    capture_plan: the plan of the backward-fused step that captures the new gradient.
    loop_plan: its loop plan: the leaves whose gradient rows a backward loop writes in place.
    in_loop: leaves updated row by row inside the forward loop that reads them.
    rows: other stacked leaves updated row by row, in place before the loss runs (the rest
      are updated whole before it).
    from_cut: stacked leaves updated whole through their cut (clipped) gradient, which takes
      over the pending gradient's buffer (``apply_pending``).
    axes: leaf -> stacked axis of every stacked leaf.
  """

  capture_plan: Plan
  loop_plan: _loops.LoopPlan
  in_loop: frozenset[int]
  rows: frozenset[int]
  from_cut: frozenset[int] = frozenset()

  @property
  def axes(self) -> dict:
    return self.loop_plan.stacked


def schedule(plan: Plan, loss_fn: Callable, params, state: ForwardState,
             args: tuple, kwargs: dict, rows_only: bool = False) -> Schedule:
  """Decides, from shapes alone, where each leaf's pending update runs.

  A stacked leaf whose update is in place once its cut (clipped) gradient is written first
  (``_apply.stacked_from_cut_gradient``) is updated whole through it. One whose update never
  mixes rows and would hold a full-size temporary whole (``_apply.stacked_rows``) is updated row
  by row: inside the forward loop, each row just before the layer reads it, when a backward loop
  captures its gradient rows outside ``jax.checkpoint``, else before the loss. Every other leaf
  is updated whole before the loss.
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  grad_leaves = plan.params_def.flatten_up_to(state.pending_grads)
  state_leaves = jax.tree.leaves(state.opt_state)
  pending = jax.tree.unflatten(plan.params_def, grad_leaves)
  capture_plan = _make.make_plan(capture(), params, pending)
  diff = [i for i, p in enumerate(param_leaves) if _leaves.is_float(p)]
  loop_plan = _loops.analyze(loss_fn, capture_plan, params, grad_leaves, args, kwargs, diff)
  axes = loop_plan.stacked  # every float leaf a scan reads as its stacked input, any length
  # Inside ``jax.checkpoint`` the forward loop runs again in the backward pass: an update there
  # would be recomputed with fresh param and state stacks (measured: 1.05x optax's peak instead
  # of 0.97x for a checkpointed 16-layer stack), so those rows are updated before the loss.
  from_cut, by_rows = stacked_updates(plan, axes, state_leaves, param_leaves, grad_leaves,
                                     rows_only)
  by_rows &= frozenset(diff)
  in_loop = frozenset(i for i in loop_plan.fused_leaves if i in by_rows
                      and i not in loop_plan.in_remat)
  rows = by_rows - in_loop
  return Schedule(capture_plan, loop_plan, in_loop, rows, from_cut)


def stacked_updates(plan: Plan, axes: dict, state: list, params: list, grads: list,
                     rows_only: bool = False) -> tuple[frozenset[int], frozenset[int]]:
  """``(from_cut, rows)``: the stacked leaves updated whole from their cut gradient, and
  those updated row by row (the others are updated whole). With ``rows_only``, and for a
  leaf whose pending gradient lives in host memory (``offload="state"``), every leaf whose
  update allows it is updated row by row: whole, its gradient and slots would be on the device
  at once."""
  streamed = frozenset(i for i in axes if (rows_only or is_host(grads[i]))
                       and plan.rowwise(i, state, params, axis=axes[i]))
  from_cut = stacked_from_cut_gradient(plan, axes, params) - streamed
  return from_cut, (stacked_rows(plan, axes, state, params) - from_cut) | streamed


def capture() -> optax.GradientTransformation:
  """A transformation whose state is the last gradient (its updates are zero)."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, grads), grads

  return optax.GradientTransformation(init, update)
