"""The fused scan: a ``scan`` over stacked params whose backward loop updates them in place.

``fused_scan`` binds one ``scan`` equation of the loss as a ``jax.custom_vjp``:

* the forward loop runs the body's VJP and stacks only the residuals that are neither inputs of
  the iteration (param rows, constants, with ``jax.checkpoint`` on the body: everything but the
  carries) nor computed from the constants alone (a causal mask, rotary tables: computed once,
  not once per layer), as JAX's own scan partial evaluation does;
* iteration ``l`` of the backward loop recomputes the body's VJP, takes row ``l`` of the
  gradient and runs the leaf's update on row ``l`` of the param and optimizer state (the
  updater's ``row_update``), writing the new rows into the param and state buffers themselves
  with ``dynamic_update_slice``;
* the rows of the next iteration are read from the buffers just written (prefetch): every read
  of a buffer then depends on its write, and XLA needs no copy of the stacked buffers (an
  unordered read of old ``mu`` next to the in-place write of ``mu`` makes it copy the whole
  buffer every iteration).

A stacked param may reach the scan through row-preserving operations (a dtype cast, a
``moveaxis``: its ``path``): they move into the loop body, so the body reads row ``l`` of the
stored param along its stored axis, and the update runs on the stored row in the stored dtype.

What the loop needs from a mode is the ``RowUpdater`` protocol (``_fused_step.LeafUpdater``),
or with two-pass backward's statistics the ``StatsUpdater`` (``_two_pass._Updater``), given
with the rest of what a step's loops read as one ``LoopInputs`` value; what the forward loops
update comes back as a value (``fused_scan``'s second result), and the backward loop records
only that it ran, in the step's ``_tap.PullbackRecord``. This module imports nothing above it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from optfuse._base._leaves import is_float, is_float_aval
from optfuse._fusion._row_buffers import (
  Stack,
  read_slots,
  row_at,
  row_loop,
  value_after,
  write_param_row,
  write_row,
  write_stack_rereading,
)
from optfuse._fusion._scan_body import Body, Residuals, merge, probe_residuals, residuals_of, split
from optfuse._fusion._sites import Site
from optfuse._fusion._tap import PullbackRecord
from optfuse._jaxpr import _interpreter, _rows
from optfuse._targets._backends import LoopPolicy


class RowUpdater(Protocol):
  """What a fused scan's backward loop asks of a mode that updates rows: the one-pass step of
  backward fusion, forward fusion's capture and accumulation (``_fused_step.LeafUpdater``).

  Attributes:
    update_params: whether the rows of the params are written (``False``: only the state's, for
      gradient accumulation).
  """

  update_params: bool

  def row_update(self, leaf: int, grad_row, param_row, slot_rows, readonly, index, length: int,
                 axis: int) -> tuple[Any, Any]:
    """Row ``index`` (along the stored ``axis``) of the leaf's ``(update, new_slots)``;
    ``readonly`` is the leaf's entry of ``LoopInputs.readonly`` (``None`` without one)."""


class StatsUpdater(RowUpdater, Protocol):
  """What a fused scan's backward loop asks of two-pass backward (``_two_pass._Updater``): in
  its statistics pass, each row's statistics; in its update pass, each row's update."""

  def row_stats(self, leaf: int, grad_row, index, length: int, axis: int) -> list:
    """The leaf's statistics on one gradient row as ``(partial, reduction)`` pairs."""


class LoopInputs(NamedTuple):
  """What the fused scans of one step read besides their equations, given by the step.

  Attributes:
    updater: the mode's ``RowUpdater``; a ``StatsUpdater`` where ``record`` starts with a
      statistics pass (two-pass backward).
    policy: the step's per-compiler choices of its loops.
    record: the step's ``PullbackRecord``: the backward loops record in it that they ran, and
      read which pass of two-pass backward is traced.
    slots: leaf -> its optimizer-state slots (stacked along the leaf's stacked axis).
    readonly: leaf -> the other inputs its row update reads whole (shared state, other params),
      passed through the fused scan's inputs.
    pre_updates: leaf -> ``PreUpdate``, updates applied in the forward loop (forward fusion).
    stat_inputs: leaf -> zero arrays whose cotangents carry the leaf's statistics (two-pass
      backward's statistics pass).
  """

  updater: RowUpdater
  policy: LoopPolicy
  record: PullbackRecord
  slots: dict
  readonly: dict = {}
  pre_updates: dict = {}
  stat_inputs: dict = {}


class PreUpdate(NamedTuple):
  """An update applied to each row of a stacked leaf in the forward iteration that reads it.

  Forward fusion (``_forward``) updates a scanned layer's params just before the layer runs:
  iteration ``l`` of the loop computes row ``l`` of the new param and optimizer state from row
  ``l`` of the pending gradient, writes them in place, and runs the layer on the new row.

  Attributes:
    grads: the stacked pending gradient of the leaf (read row by row).
    slots: the leaf's stacked optimizer-state slots, updated in place row by row.
    operands: a pytree of arrays ``row_fn`` reads whole (shared state, global cuts...).
    row_fn: ``row_fn(grad_row, param_row, slot_rows, operands, index) -> (param_row,
      slot_rows)``, the new rows of the param and of the slots.
    slots_fn: ``slots_fn(grads, slots, operands) -> slots``, the new slots from the whole
      stacks, or ``None`` (``Plan.slots_whole``). When given, the loop writes only the param
      rows and the slots are updated whole after it, once every row has read the old ones
      (see ``_ForwardLoop``).
  """

  grads: Any
  slots: tuple
  operands: Any
  row_fn: Any
  slots_fn: Any = None


class _ForwardLoop(NamedTuple):
  """The forward loop of a fused scan, which stacks the residuals its backward loop reads.

  With pre-updates (forward fusion) iteration ``l`` first updates row ``l`` of those leaves'
  param and slot stacks in place, then runs the body on the new param row. A leaf with a
  ``slots_fn`` has only its param rows written in the loop, and its slots updated whole after
  it: XLA's CPU fusion writes a stacked row in place only from a row of its own, so each slot
  row rewritten in the loop costs a copy of the old row and a write, where a whole elementwise
  pass over the stack runs in place (measured, 8 stacked 256x256 AdamW leaves: 1.18 ms for
  the update row by row, 0.68 ms with the slots whole, 0.55 ms for optax's). On TPU the
  loop carries the other param stacks too (``LoopPolicy.carried_stacks``).
  """

  policy: LoopPolicy
  body: Body
  pre: tuple  # per fused leaf, its ``PreUpdate`` or ``None``
  pre_in: tuple  # per fused leaf, ``(grads, slots, operands)`` of its ``PreUpdate`` or ``None``

  def index_of(self, k):
    return self.body.length - 1 - k if self.body.parts.reverse else k

  def pre_update(self, j: int, stacks: list, slot_stacks: list, index):
    """Row ``index`` of leaf ``j``'s param, updated in place in ``stacks``/``slot_stacks``:
    the slot rows read for the param row, then read again and written after it
    (``write_stack_rereading``).

    The first reads are not ordered after the gradient row (as the backward loop's are): that
    row is a slice of the pending gradient, not a value the iteration computes, and an index
    that depends on it is recomputed for every element of the update fusion (measured, the
    bench's 8x256 scanned MLP with AdamW: that fusion takes 0.38 ms per step instead of
    0.83 ms, at the same peak).
    """
    axis, (grads, slots, operands) = self.body.site.axes[j], self.pre_in[j]
    row_fn, whole = self.pre[j].row_fn, self.pre[j].slots_fn is not None
    stack = Stack(stacks[j], slots if whole else slot_stacks[j], axis)
    grad_row, param_row = row_at(grads, index, axis), row_at(stacks[j], index, axis)
    policy = self.policy
    p_row, _ = row_fn(grad_row, param_row, read_slots(policy, stack, index, None), operands,
                      index)
    p_row = p_row.astype(stack.param.dtype)
    if whole:
      stacks[j] = write_param_row(policy, stack.param, p_row, index, axis)
      return p_row
    stack = write_stack_rereading(
        policy, stack, p_row,
        lambda rows: row_fn(grad_row, param_row, rows, operands, index)[1], index)
    stacks[j], slot_stacks[j] = stack.param, stack.slots
    return p_row

  def whole_slots(self, j: int, new_param) -> tuple:
    """Leaf ``j``'s new slots, updated whole from the old ones, read once ``new_param`` (the
    loop's last param row) exists."""
    grads, slots, operands = self.pre_in[j]
    return tuple(self.pre[j].slots_fn(grads, [value_after(s, new_param) for s in slots],
                                      operands))

  def run(self, pstacks, consts, carry, xs_other, residuals: Residuals | None):
    """``(carry, ys, saved residuals, carries, pre_out, param stacks)``; residuals are stacked
    (and the carries, if the backward needs them) only when ``residuals`` is given."""
    body, pre = self.body, self.pre
    nk, save = body.parts.num_carry, residuals is not None

    def step(state, xo_rows):
      k, c, stacks, slot_stacks = state
      index = self.index_of(k)
      stacks, slot_stacks, p_rows = list(stacks), list(slot_stacks), []
      for j, (u, axis) in enumerate(zip(pre, body.site.axes)):
        if u is not None:
          p_rows.append(self.pre_update(j, stacks, slot_stacks, index))
        elif carried:  # read from the carry, written back (``LoopPolicy.carried_stacks``)
          p_rows.append(row_at(stacks[j], index, axis))
          stacks[j] = write_param_row(self.policy, stacks[j],
                                      lax.optimization_barrier(p_rows[-1]), index, axis)
        else:
          p_rows.append(row_at(pstacks[j], index, axis))
      out, pullback, _ = body.vjp(consts, c, body.body_rows(p_rows, index), xo_rows)
      saved = residuals_of(residuals, pullback, "saved") if save else []
      carries = c if save and residuals.needs_carry else None
      return (k + 1, out[:nk], tuple(stacks), tuple(slot_stacks)), (out[nk:], saved, carries)

    whole = [u is not None and u.slots_fn is not None for u in pre]
    slot_stacks = tuple(u[1] if u is not None and not w else ()
                        for u, w in zip(self.pre_in, whole))
    carried = self.policy.carried_stacks and not body.site.in_remat
    stacks = tuple(p if u is not None or carried else None for p, u in zip(pstacks, pre))
    init = (jnp.zeros((), jnp.int32), list(carry), stacks, slot_stacks)
    (_, carry_out, stacks, slot_stacks), (ys, saved, carries) = lax.scan(
        step, init, list(xs_other), length=body.length, reverse=body.parts.reverse,
        unroll=1 if body.site.rolled else body.parts.unroll)
    slot_stacks = tuple(self.whole_slots(j, stacks[j]) if w else t
                        for j, (t, w) in enumerate(zip(slot_stacks, whole)))
    pre_out = tuple(None if u is None else (q, t) for q, t, u in zip(stacks, slot_stacks, pre))
    new_pstacks = tuple(p if u is None and not carried else q
                        for p, q, u in zip(pstacks, stacks, pre))
    return carry_out, ys, saved, carries, pre_out, new_pstacks

  def probe(self, pstacks, consts, carry, xs_other) -> tuple[Residuals, list]:
    """The residuals of the body's VJP, and the loop-invariant ones, computed once."""
    body = self.body
    q_rows = body.body_rows([row_at(p, 0, a) for p, a in zip(pstacks, body.site.axes)], 0)
    xo_rows = [row_at(x, 0) for x in xs_other]
    return probe_residuals(body, consts, carry, q_rows, xo_rows)


def _body(eqn: jcore.JaxprEqn, site: Site, is_param_x: list) -> Body:
  parts = _interpreter.scan_parts(eqn)
  nc, nk, body_jaxpr = parts.num_consts, parts.num_carry, parts.body.jaxpr
  return Body(
      eqn, site, is_param_x, [is_float_aval(v) for v in body_jaxpr.invars[:nc]],
      [is_float_aval(v) for v in body_jaxpr.invars[nc:nc + nk]],
      [is_float_aval(v) for v, p in zip(body_jaxpr.invars[nc + nk:], is_param_x) if not p],
      [is_float_aval(v) for v in body_jaxpr.outvars])


def fused_scan(eqn: jcore.JaxprEqn, site: Site, inputs: LoopInputs, ins: list
               ) -> tuple[list, dict]:
  """Binds ``eqn`` (a scan) as a custom_vjp whose backward updates ``site.leaves`` in place.

  Args:
    eqn: the scan equation.
    site: its fused positions.
    inputs: what the step's loops read (``LoopInputs``).
    ins: the equation's inputs; at the fused positions the stored param leaves.

  Returns:
    ``(outputs, pre_results)``: the scan's outputs, and leaf -> ``(param stack, slot stacks)``
    for the leaves its forward loop updated (``inputs.pre_updates``).
  """
  updater, policy, record = inputs.updater, inputs.policy, inputs.record
  parts = _interpreter.scan_parts(eqn)
  nc, nk = parts.num_consts, parts.num_carry
  consts_in, carry_in, xs_in = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  is_param_x = [pos in site.positions for pos in range(len(xs_in))]
  pstacks = tuple(xs_in[pos] for pos in site.positions)
  xs_other = [x for x, p in zip(xs_in, is_param_x) if not p]
  leaf_slots = tuple(inputs.slots[leaf] for leaf in site.leaves)
  readonly = tuple(inputs.readonly.get(leaf) for leaf in site.leaves)
  stat_in = tuple(inputs.stat_inputs.get(leaf, ()) for leaf in site.leaves)
  pre = tuple(inputs.pre_updates.get(leaf) for leaf in site.leaves)
  pre_in = tuple(None if u is None else (u.grads, tuple(u.slots), u.operands) for u in pre)
  body = _body(eqn, site, is_param_x)
  # Where the residuals of the body's VJP come from (their sources and tree structure), found by
  # the forward rule and read by the backward rule, which runs after it: static structure, not an
  # array, so it cannot travel as a residual and crosses the custom_vjp boundary here.
  info: list[Residuals] = []

  @jax.custom_vjp
  def fscan(pstacks, leaf_slots, readonly, pre_in, stat_in, consts, carry, xs_other):
    del leaf_slots, readonly, stat_in
    loop = _ForwardLoop(policy, body, pre, pre_in)
    carry_out, ys, _, _, pre_out, _ = loop.run(pstacks, consts, carry, xs_other, None)
    return (*carry_out, *ys), pre_out

  def fwd(pstacks, leaf_slots, readonly, pre_in, stat_in, consts, carry, xs_other):
    loop = _ForwardLoop(policy, body, pre, pre_in)
    residuals, invariant = loop.probe(pstacks, list(consts), list(carry), list(xs_other))
    info.append(residuals)
    carry_out, ys, saved, carries, pre_out, pstacks = loop.run(pstacks, consts, carry, xs_other,
                                                               residuals)
    leaf_slots = tuple(ordered_after(ls, u, out) for ls, u, out in zip(leaf_slots, pre, pre_out))
    res = (pstacks, leaf_slots, readonly, stat_in, consts, carries, saved, invariant, xs_other)
    return ((*carry_out, *ys), pre_out), res

  def bwd(res, cts):
    pstacks, leaf_slots, readonly, stat_in, consts, carries, saved, invariant, xs_other = res
    for leaf in site.leaves:
      record.ran(leaf)
    cts = cts[0]  # the updated stacks of ``pre`` are read by no loss: zero cotangents
    float_consts = split(consts, body.fc)[0]
    loop = _BackwardLoop(policy, body, updater, info[-1], leaf_slots, readonly, float_consts,
                         carries, saved, invariant, xs_other, list(cts[nk:]))
    stats = record.stats
    ct_c, ct_consts, stacks, state_stacks, ct_xo, accs = loop.run(pstacks, list(cts[:nk]), stats)
    ct_consts_full = merge(ct_consts, [None] * (nc - sum(body.fc)), body.fc)
    ct_xo_full = merge(ct_xo, [None] * (len(xs_other) - sum(body.fxo)), body.fxo)
    if stats:  # the statistics leave as the cotangents of their zero inputs
      ct_stats = tuple(tuple(a.astype(z.dtype) for a, z in zip(acc, zeros))
                       for acc, zeros in zip(accs, stat_in))
      return (None, None, None, None, ct_stats, ct_consts_full, ct_c, ct_xo_full)
    return (tuple(stacks), tuple(state_stacks), None, None, None, ct_consts_full, ct_c,
            ct_xo_full)

  fscan.defvjp(fwd, bwd)
  outs, pre_out = fscan(pstacks, leaf_slots, readonly, pre_in, stat_in, consts_in, carry_in,
                        xs_other)
  return list(outs), {leaf: updated for leaf, updated in zip(site.leaves, pre_out)
                      if updated is not None}


def ordered_after(stacks: tuple, pre: PreUpdate | None, pre_out) -> tuple:
  """The backward loop's ``stacks`` of a leaf, ordered after the slots its pre-update computes
  whole: in forward fusion they are the pending gradient those slots read, which the backward
  loop overwrites in place with the new one."""
  if pre is None or pre.slots_fn is None:
    return stacks
  for slot in pre_out[1]:
    stacks = tuple(value_after(x, slot) for x in stacks)
  return stacks


class _BackwardLoop(NamedTuple):
  """The backward loop of a fused scan: one iteration per layer, last layer first."""

  policy: LoopPolicy
  body: Body
  updater: RowUpdater  # a ``StatsUpdater`` in two-pass backward
  residuals: Residuals
  leaf_slots: tuple
  readonly: tuple
  float_consts: list
  carries: Any
  saved: list
  invariant: list
  xs_other: list
  ct_ys: list

  def index_of(self, k):
    return k if self.body.parts.reverse else self.body.length - 1 - k

  def pullback(self, index, c_row, q_rows, xo_rows):
    """The body's pullback at iteration ``index``, rebuilt from its residuals."""
    body, residuals = self.body, self.residuals
    flat_inputs = [*self.float_consts, *split(c_row, body.fk)[0], *q_rows,
                   *split(xo_rows, body.fxo)[0]]
    saved_rows = [row_at(r, index) for r in self.saved]
    by_kind = {"input": flat_inputs, "saved": saved_rows, "invariant": self.invariant}
    leaves = [by_kind[kind][k] for kind, k in residuals.sources]
    return jax.tree.unflatten(residuals.treedef, leaves)

  def iteration(self, index, p_rows, read, carry, stats: bool):
    """Iteration ``index``: the body's pullback, then each leaf's row updated (or, with
    ``stats``, reduced into its statistics); returns the new rows and the carry."""
    body, updater, site = self.body, self.updater, self.body.site
    length, nk = body.length, body.parts.num_carry
    ct_c, ct_consts, ct_xo, accs = carry
    c_row = [row_at(c, index) for c in self.carries] if self.residuals.needs_carry else [None] * nk
    xo_rows = [row_at(x, index) for x in self.xs_other]
    # The param rows go through their paths (a cast, a transpose) inside the loop; the
    # gradient of each stored row is the path's transpose of the body's gradient.
    q_rows, path_vjp = jax.vjp(lambda rows: body.body_rows(rows, index), list(p_rows))
    ct_y_row = [row_at(y, index) for y, f in zip(self.ct_ys, body.fout[nk:]) if f]
    pullback = self.pullback(index, c_row, q_rows, xo_rows)
    g_consts, g_carry, g_q, g_xo = pullback([*split(ct_c, body.fk)[0], *ct_y_row])
    (g_params,) = path_vjp(list(g_q))
    new_rows, accs = [], list(accs)
    for j, (leaf, axis) in enumerate(zip(site.leaves, site.axes)):
      g = g_params[j]
      if stats:
        partials = updater.row_stats(leaf, g, index, length, axis)
        accs[j] = tuple(_rows.ROW_COMBINE[r].combine(a, v.astype(a.dtype))
                        for a, (v, r) in zip(accs[j], partials))
        new_rows.append((None, None))
        continue
      # The slot rows are read once the gradient row exists (``_row_buffers``).
      update, new_slots = updater.row_update(leaf, g, p_rows[j], read(j, g), self.readonly[j],
                                             index, length, axis)
      new_param = (p_rows[j] + update).astype(p_rows[j].dtype) if updater.update_params else None
      new_rows.append((new_param, list(new_slots)))
    ct_consts = [a + b for a, b in zip(ct_consts, g_consts)]
    ct_xo = [write_row(self.policy, acc, g, index) for acc, g in zip(ct_xo, g_xo)]
    ct_c = merge(g_carry, [None] * (nk - sum(body.fk)), body.fk)
    return new_rows, (ct_c, ct_consts, ct_xo, tuple(accs))

  def run(self, pstacks, ct_carry, stats: bool):
    """``(ct_carry, ct_consts, param stacks, state stacks, ct_xs, statistics)``.

    The param and state stacks are updated in place by ``_row_buffers.row_loop``; the first
    param rows are read after the loop's first cotangent.
    """
    body, updater, axes = self.body, self.updater, self.body.site.axes
    nk = body.parts.num_carry
    carry = (merge(split(ct_carry, body.fk)[0], [None] * (nk - sum(body.fk)), body.fk),
             [jnp.zeros_like(c) for c in self.float_consts],
             [jnp.zeros_like(x) for x in split(self.xs_other, body.fxo)[0]],
             tuple(_stat_identities(updater, leaf, p, body.length, a) if stats else ()
                   for leaf, p, a in zip(body.site.leaves, pstacks, axes)))
    stacks = [Stack(p, tuple(s), a) for p, s, a in zip(pstacks, self.leaf_slots, axes)]
    first = next((c for c in [*ct_carry, *self.ct_ys] if c is not None and is_float(c)), None)
    stacks, (ct_c, ct_consts, ct_xo, accs) = row_loop(
        self.policy, body.length, self.index_of, stacks,
        lambda k, index, rows, read, carry: self.iteration(index, rows, read, carry, stats),
        carry, first, prefetch=updater.update_params)
    return ct_c, ct_consts, [s.param for s in stacks], [s.slots for s in stacks], ct_xo, accs


def _stat_identities(updater: StatsUpdater, leaf: int, stack, length: int, axis: int) -> tuple:
  """The value of each statistic of ``leaf`` over no rows: where the backward loop starts
  combining the rows' partial statistics."""
  found: list = []
  shape = jnp.shape(stack)
  row = jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], jnp.result_type(stack))
  jax.eval_shape(lambda g: found.append(updater.row_stats(leaf, g, 0, length, axis)) or 0, row)
  return tuple(_rows.ROW_COMBINE[r].identity(p.shape, p.dtype) for p, r in found[0])
