"""Fusion across loops: stacked params updated in place inside the backward ``scan``.

Large JAX models scan over stacked layer params (``lax.scan``, ``nn.scan``, ``nnx.scan``). A tap on
the stacked leaf would fire only after the whole backward loop, with the full stacked gradient
materialised; a tap on the slice inside the loop body makes JAX's scan transpose emit fresh
stacked outputs (twice the memory). Instead, optfuse traces the loss to a jaxpr, finds every
``scan`` whose scanned inputs include a param leaf that the loss uses nowhere else, and replaces
that scan with a ``custom_vjp`` whose backward rule is a hand-written reverse loop:

* the forward saves the per-iteration carries (what ``jax.checkpoint`` on the body saves);
* iteration ``l`` of the backward recomputes the body's VJP, takes row ``l`` of the gradient and
  runs the leaf's update on row ``l`` of the param and optimizer state (see ``_rows``), writing
  the new rows into the param and state buffers themselves with ``dynamic_update_slice``;
* the rows read from the buffers pass through ``lax.optimization_barrier`` before any write, so
  every read of a buffer's old row is ordered before every in-place write: XLA then needs no
  copy of the stacked buffers (an unordered read of old ``mu`` next to the in-place write of
  ``mu`` makes it copy the whole buffer every iteration).

Leaves whose update mixes rows (LAMB's trust ratio, Adafactor's factored moments over the
stacked axis, ...) are left to an ordinary tap: updated after the loop, exactly as optax does.

The same loops serve the other modes. Forward fusion (``_forward``) hands in a ``PreUpdate``
per leaf: the forward loop then updates row ``l`` of the param and state in place just before
the body reads it, and the backward loop writes the gradient rows into the pending buffer.
Two-pass backward (``_two_pass``) runs the backward rule twice: with ``updater.stage ==
"stats"`` the loop reduces each gradient row into the leaf's statistics and writes nothing, then
it updates the rows with the combined statistics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from optfuse import _jaxpr, _rows
from optfuse._plan import UpdatePlan


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_float_aval(v) -> bool:
  return jnp.issubdtype(v.aval.dtype, jnp.inexact)


class _Site(NamedTuple):
  """A scan equation whose scanned inputs at ``positions`` are the param leaves ``leaves``."""

  positions: tuple[int, ...]
  leaves: tuple[int, ...]


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
  """

  grads: Any
  slots: tuple
  operands: Any
  row_fn: Any


class LoopPlan(NamedTuple):
  """How the loss is evaluated: directly, or through its jaxpr with fused scans.

  Attributes:
    params_def: treedef of the params.
    loss_fn: the user's loss.
    fused_leaves: param leaves updated inside a backward loop.
    jaxpr: the traced loss (``None`` when no scan is fused).
    consts: its constants.
    sites: ``id(eqn) -> _Site`` for every fused scan, at any depth of ``jit`` nesting.
    dynamic: which leaves of ``(args, kwargs)`` are jaxpr inputs (the rest are static).
    out_def: treedef of the loss output.
  """

  params_def: Any
  loss_fn: Any
  fused_leaves: tuple[int, ...]
  jaxpr: jcore.Jaxpr | None = None
  consts: tuple = ()
  sites: dict | None = None
  dynamic: tuple[bool, ...] = ()
  out_def: Any = None

  def call(self, updater, leaves, slots, args, kwargs):
    """Evaluates the loss on ``leaves`` (the fused leaves untapped) with fused scans."""
    if self.jaxpr is None:
      return self.loss_fn(jax.tree.unflatten(self.params_def, leaves), *args, **kwargs)
    arg_leaves = jax.tree.leaves((args, kwargs))
    dyn = [a for a, d in zip(arg_leaves, self.dynamic) if d]
    outs = _interpret(self.jaxpr, self.consts, [*leaves, *dyn], self.sites, updater, slots)
    return jax.tree.unflatten(self.out_def, outs)


def _is_dynamic(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _trace_loss(loss_fn, params_def, param_leaves, args, kwargs):
  arg_leaves, arg_def = jax.tree.flatten((args, kwargs))
  dynamic = tuple(_is_dynamic(a) for a in arg_leaves)

  def flat_loss(p_leaves, dyn):
    it = iter(dyn)
    full = [next(it) if d else a for a, d in zip(arg_leaves, dynamic)]
    a, kw = jax.tree.unflatten(arg_def, full)
    return loss_fn(jax.tree.unflatten(params_def, p_leaves), *a, **kw)

  dyn = [a for a, d in zip(arg_leaves, dynamic) if d]
  closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(list(param_leaves), dyn)
  return closed, jax.tree.structure(out_shape), dynamic


def _use_counts(jaxpr: jcore.Jaxpr) -> dict:
  counts: dict = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if isinstance(v, jcore.Var):
        counts[v] = counts.get(v, 0) + 1
  for v in jaxpr.outvars:
    if isinstance(v, jcore.Var):
      counts[v] = counts.get(v, 0) + 1
  return counts


def min_loop_length(plan: UpdatePlan, leaf: int) -> int:
  """The shortest loop in which updating ``leaf`` row by row saves memory.

  Fusion removes the stacked gradient (``length`` rows) but keeps rows in flight in each
  iteration: the row's gradient, and the param and state rows read out of their buffers. Below
  ``2 + slots`` iterations that costs more than it saves, and the leaf is updated after the loop
  as optax does (measured: a 3-layer scan with AdamW used one row more temp memory fused).
  """
  return 2 + len(plan.groups[leaf].state_outs)


def row_fusible(plan: UpdatePlan, leaf: int, state_leaves, params_leaves, length: int) -> bool:
  """Whether row ``l`` of leaf ``leaf``'s update depends on row ``l`` of its inputs only."""
  group = plan.groups[leaf]
  if any(jnp.shape(state_leaves[k])[:1] != (length,) for k in group.state_outs):
    return False
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  row = lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x))
  n, m, c = plan.num_params, plan.num_state, len(plan.consts)
  reads_s, reads_p = group.reads[c + n:c + n + m], group.reads[c + n + m:]
  readonly = ([spec(s) if r and k not in group.state_outs else None
               for k, (s, r) in enumerate(zip(state_leaves, reads_s))],
              [spec(p) if r and j != leaf else None
               for j, (p, r) in enumerate(zip(params_leaves, reads_p))])
  param_row = row(params_leaves[leaf])
  slot_rows = [row(state_leaves[k]) for k in group.state_outs]
  try:
    jax.eval_shape(lambda g, p, s, ro: row_update(plan, leaf, g, p, s, ro, 0, length),
                   param_row, param_row, slot_rows, readonly)
  except _rows.NotRowwise:
    return False
  return True


def row_update(plan: UpdatePlan, leaf: int, grad_row, param_row, slot_rows, readonly, index,
               length: int):
  """Row ``index`` of leaf ``leaf``'s ``(update, new_slots)`` from rows of its inputs.

  Raises:
    NotRowwise: the update combines rows of the stacked leaf.
  """
  group, n = plan.groups[leaf], plan.num_params
  state, params = list(readonly[0]), list(readonly[1])
  is_row_state = [False] * plan.num_state
  for k, s in zip(group.state_outs, slot_rows):
    state[k] = s
    is_row_state[k] = True
  params[leaf] = param_row
  grads = [grad_row if j == leaf else None for j in range(n)]
  is_row = ([False] * len(plan.consts) + [j == leaf for j in range(n)] + is_row_state
            + [j == leaf for j in range(n)])
  args = plan.inputs(grads, state, params, group.reads)
  is_row = [r for r, used in zip(is_row, group.reads) if used]
  out = _rows.evaluate_rows(group.jaxpr, (), args, is_row, index, length)
  return out[0], out[1:]


def _find_sites(jaxpr: jcore.Jaxpr, param_of: dict, fusible) -> dict:
  """Scan equations (also inside nested ``jit``) that scan over a param used nowhere else."""
  counts = _use_counts(jaxpr)
  sites: dict = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "scan":
      start = eqn.params["num_consts"] + eqn.params["num_carry"]
      positions, leaves = [], []
      for pos, v in enumerate(eqn.invars[start:]):
        leaf = param_of.get(v) if isinstance(v, jcore.Var) else None
        if leaf is not None and counts.get(v) == 1 and leaf not in leaves and fusible(
            leaf, eqn.params["length"]):
          positions.append(pos)
          leaves.append(leaf)
      if leaves:
        sites[id(eqn)] = _Site(tuple(positions), tuple(leaves))
    elif name in ("jit", "pjit"):
      inner = eqn.params["jaxpr"].jaxpr
      inner_param_of = {iv: param_of[v] for v, iv in zip(eqn.invars, inner.invars)
                        if isinstance(v, jcore.Var) and v in param_of and counts.get(v) == 1}
      if inner_param_of:
        sites.update(_find_sites(inner, inner_param_of, fusible))
  return sites


def _contains(jaxpr: jcore.Jaxpr, sites: dict) -> bool:
  for eqn in jaxpr.eqns:
    if id(eqn) in sites:
      return True
    if eqn.primitive.name in ("jit", "pjit") and _contains(eqn.params["jaxpr"].jaxpr, sites):
      return True
  return False


def analyze(loss_fn, plan: UpdatePlan, params, state_leaves, args, kwargs, diff,
            fusible=None) -> LoopPlan:
  """Finds the scans of ``loss_fn`` whose stacked params can be updated inside the loop.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    plan: the update plan.
    params: the params tree.
    state_leaves: the flat optimizer state.
    args: positional arguments of the loss after params.
    kwargs: keyword arguments of the loss.
    diff: indices of the float (differentiable) param leaves.
    fusible: ``fusible(leaf, length) -> bool``, whether a leaf scanned by a loop of ``length``
      iterations is updated inside it; by default, when the loop is long enough for the rows in
      flight to pay and ``plan``'s update of the leaf never mixes rows.

  Returns:
    A ``LoopPlan``; with no fusible scan it calls ``loss_fn`` directly.
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  closed, out_def, dynamic = _trace_loss(loss_fn, plan.params_def, param_leaves, args, kwargs)
  jaxpr = closed.jaxpr
  diff = set(diff)
  param_of = {v: i for i, v in enumerate(jaxpr.invars[:len(param_leaves)]) if i in diff}

  def default_fusible(leaf, length):
    return (length >= min_loop_length(plan, leaf)
            and row_fusible(plan, leaf, state_leaves, param_leaves, length))

  fusible = fusible or default_fusible

  sites = _find_sites(jaxpr, param_of, fusible)
  if not sites:
    return LoopPlan(plan.params_def, loss_fn, ())
  fused = tuple(sorted(leaf for site in sites.values() for leaf in site.leaves))
  return LoopPlan(plan.params_def, loss_fn, fused, jaxpr, tuple(closed.consts), sites, dynamic,
                  out_def)


def _interpret(jaxpr: jcore.Jaxpr, consts, args, sites: dict, updater, slots) -> list:
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    site = sites.get(id(eqn))
    if site is not None:
      outs = _fused_scan(eqn, site, updater, slots, ins)
    elif eqn.primitive.name in ("jit", "pjit") and _contains(eqn.params["jaxpr"].jaxpr, sites):
      inner = eqn.params["jaxpr"]
      outs = _interpret(inner.jaxpr, inner.consts, ins, sites, updater, slots)
    else:
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
      outs = outs if eqn.primitive.multiple_results else [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _split(values, mask):
  return [v for v, m in zip(values, mask) if m], [v for v, m in zip(values, mask) if not m]


def _merge(selected, others, mask):
  it_s, it_o = iter(selected), iter(others)
  return [next(it_s) if m else next(it_o) for m in mask]


class _Residuals(NamedTuple):
  """Where each residual of the body's VJP comes from in iteration ``l`` of the backward.

  Attributes:
    treedef: treedef of the VJP function (its leaves are the residuals).
    sources: per residual, ``("input", k)`` for the ``k``-th flat input of the body's float
      VJP (constants, carry, param rows, other scanned rows), or ``("saved", j)`` for the
      ``j``-th residual the forward loop stacks.
    needs_carry: whether some residual is a carry input (then the forward stacks the carries).
  """

  treedef: Any
  sources: tuple[tuple[str, int], ...]
  needs_carry: bool


def _fused_scan(eqn: jcore.JaxprEqn, site: _Site, updater, slots: dict, ins: list) -> list:
  """Binds ``eqn`` (a scan) as a custom_vjp whose backward updates ``site.leaves`` in place.

  The forward runs the body's VJP in the loop and stacks only the residuals that are not
  inputs of the iteration (with ``jax.checkpoint`` on the body: none, just the carries), as JAX's
  own scan transpose does; inputs of the iteration (param rows, constants) are read again in the
  backward instead of being stacked.
  """
  prm = eqn.params
  nc, nk, length, reverse = prm["num_consts"], prm["num_carry"], prm["length"], prm["reverse"]
  body = prm["jaxpr"]
  consts_in, carry_in, xs_in = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  is_param_x = [pos in site.positions for pos in range(len(xs_in))]
  pstacks = tuple(xs_in[pos] for pos in site.positions)
  xs_other = [x for x, p in zip(xs_in, is_param_x) if not p]
  leaf_slots = tuple(slots[leaf] for leaf in site.leaves)
  readonly = tuple(updater.readonly(leaf) for leaf in site.leaves)
  extras = tuple(None if updater.extra is None else updater.extra[leaf] for leaf in site.leaves)
  stat_in = tuple(updater.stat_inputs.get(leaf, ()) for leaf in site.leaves)
  pre = tuple(updater.pre_updates.get(leaf) for leaf in site.leaves)
  pre_in = tuple(None if u is None else (u.grads, tuple(u.slots), u.operands) for u in pre)
  has_pre = any(u is not None for u in pre)

  fc = [_is_float_aval(v) for v in body.jaxpr.invars[:nc]]
  fk = [_is_float_aval(v) for v in body.jaxpr.invars[nc:nc + nk]]
  fxo = [_is_float_aval(v) for v, p in zip(body.jaxpr.invars[nc + nk:], is_param_x) if not p]
  fout = [_is_float_aval(v) for v in body.jaxpr.outvars]

  def xs_slices(params_rows, other_rows):
    it_p, it_o = iter(params_rows), iter(other_rows)
    return [next(it_p) if p else next(it_o) for p in is_param_x]

  def float_vjp(consts, carry, p_rows, xo_rows):
    """The body's VJP with respect to its float inputs; non-float outputs come as aux."""
    static_consts, static_carry = _split(consts, fc)[1], _split(carry, fk)[1]
    static_xo = _split(xo_rows, fxo)[1]

    def float_body(f_consts, f_carry, f_params, f_xo):
      out = _jaxpr.evaluate(body.jaxpr, body.consts, [
          *_merge(f_consts, static_consts, fc), *_merge(f_carry, static_carry, fk),
          *xs_slices(f_params, _merge(f_xo, static_xo, fxo))])
      return _split(out, fout)

    inputs = (_split(consts, fc)[0], _split(carry, fk)[0], list(p_rows), _split(xo_rows, fxo)[0])
    out_float, pullback, out_static = jax.vjp(float_body, *inputs, has_aux=True)
    return _merge(out_float, out_static, fout), pullback, [x for part in inputs for x in part]

  def residual_sources(pullback, flat_inputs) -> tuple[list, list]:
    sources, saved = [], []
    for r in jax.tree.leaves(pullback):
      k = next((k for k, x in enumerate(flat_inputs) if x is r), None)
      if k is None:
        sources.append(("saved", len(saved)))
        saved.append(r)
      else:
        sources.append(("input", k))
    return sources, saved

  def split_row(x):
    return [x[pos] for pos in site.positions], [x[pos] for pos, p in enumerate(is_param_x)
                                                if not p]

  def probe(consts, carry, x):
    p_rows, xo_rows = split_row(x)
    _, pullback, flat_inputs = float_vjp(consts, carry, p_rows, xo_rows)
    sources, _ = residual_sources(pullback, flat_inputs)
    n_carry_inputs = sum(fc), sum(fc) + sum(fk)
    needs_carry = any(kind == "input" and n_carry_inputs[0] <= k < n_carry_inputs[1]
                      for kind, k in sources)
    info.append(_Residuals(jax.tree.structure(pullback), tuple(sources), needs_carry))

  info: list[_Residuals] = []

  def pre_loop(pstacks, pre_in, consts, carry, xs_other, needs_carry):
    """The forward loop of forward fusion: each leaf of ``pre`` has its row updated in place
    right before the body reads it; returns the body's outputs, the residuals and the updated
    param and slot stacks."""
    put = lambda buf, r, index: lax.dynamic_update_index_in_dim(buf, r.astype(buf.dtype),
                                                                 index, 0)
    plain = [p for p, u in zip(pstacks, pre) if u is None]

    index_of = lambda k: length - 1 - k if reverse else k

    def fetch(stacks, slot_stacks, index):
      at = lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False)
      return tuple(None if u is None else tuple(at(t) for t in slots)
                   for slots, u in zip(slot_stacks, pre))

    def body(state, x):
      k, c, stacks, slot_stacks, rows = state
      index = index_of(k)
      plain_rows, xo_rows = x
      plain_rows = iter(plain_rows)
      p_rows, stacks, slot_stacks = [], list(stacks), list(slot_stacks)
      for j, u in enumerate(pre):
        if u is None:
          p_rows.append(next(plain_rows))
          continue
        grads, _, operands = pre_in[j]
        grad_row = lax.dynamic_index_in_dim(grads, index, 0, keepdims=False)
        param_row = lax.dynamic_index_in_dim(stacks[j], index, 0, keepdims=False)
        p_row, s_rows = u.row_fn(grad_row, param_row, list(rows[j]), operands, index)
        stacks[j] = put(stacks[j], p_row, index)
        slot_stacks[j] = tuple(put(t, r, index) for t, r in zip(slot_stacks[j], s_rows))
        p_rows.append(p_row.astype(stacks[j].dtype))
      out, pullback, flat_inputs = float_vjp(consts, c, p_rows, xo_rows)
      _, saved = residual_sources(pullback, flat_inputs)
      # Prefetch the next slot rows from the buffers just written, as the backward loop does:
      # XLA recomputes a new slot row inside each of its consumers, so rows read in this
      # iteration would be read again after the in-place write and XLA would copy the whole
      # stack every iteration to keep them. The param row is read once, before its write.
      rows = fetch(stacks, slot_stacks, index_of(jnp.minimum(k + 1, length - 1)))
      state = (k + 1, out[:nk], tuple(stacks), tuple(slot_stacks), rows)
      return state, (out[nk:], saved, c if needs_carry else None)

    stacks = tuple(p if u is not None else None for p, u in zip(pstacks, pre))
    slot_stacks = tuple(u[1] if u is not None else () for u in pre_in)
    init = (jnp.zeros((), jnp.int32), list(carry), stacks, slot_stacks,
            fetch(stacks, slot_stacks, index_of(0)))
    (_, carry_out, stacks, slot_stacks, _), (ys, saved, carries) = lax.scan(
        body, init, (plain, list(xs_other)), length=length, reverse=reverse,
        unroll=prm["unroll"])
    new_pstacks = tuple(p if u is None else q for p, q, u in zip(pstacks, stacks, pre))
    pre_out = tuple(None if u is None else (q, t) for q, t, u in zip(stacks, slot_stacks, pre))
    return carry_out, ys, saved, carries, new_pstacks, pre_out

  @jax.custom_vjp
  def fscan(pstacks, leaf_slots, readonly, extras, pre_in, stat_in, consts, carry, xs_other):
    del leaf_slots, readonly, extras, stat_in
    if has_pre:
      carry_out, ys, _, _, _, pre_out = pre_loop(pstacks, pre_in, consts, carry, xs_other,
                                                 False)
      return (*carry_out, *ys), pre_out
    xs = xs_slices(pstacks, xs_other)
    return tuple(eqn.primitive.bind(*consts, *carry, *xs, **prm)), tuple(None for _ in pre)

  def fwd(pstacks, leaf_slots, readonly, extras, pre_in, stat_in, consts, carry, xs_other):
    xs = xs_slices(pstacks, xs_other)
    row0 = [lax.dynamic_index_in_dim(x, 0, 0, keepdims=False) for x in xs]
    jax.eval_shape(probe, list(consts), list(carry), row0)
    residuals = info[-1]

    def save_body(c, x):
      p_rows, xo_rows = split_row(x)
      out, pullback, flat_inputs = float_vjp(consts, c, p_rows, xo_rows)
      _, saved = residual_sources(pullback, flat_inputs)
      return out[:nk], (out[nk:], saved, c if residuals.needs_carry else None)

    if has_pre:
      carry_out, ys, saved, carries, pstacks, pre_out = pre_loop(
          pstacks, pre_in, consts, carry, xs_other, residuals.needs_carry)
    else:
      carry_out, (ys, saved, carries) = lax.scan(save_body, list(carry), xs, length=length,
                                                 reverse=reverse, unroll=prm["unroll"])
      pre_out = tuple(None for _ in pre)
    res = (pstacks, leaf_slots, readonly, extras, stat_in, consts, carries, saved, xs_other)
    return ((*carry_out, *ys), pre_out), res

  def bwd(res, cts):
    pstacks, leaf_slots, readonly, extras, stat_in, consts, carries, saved, xs_other = res
    residuals = info[-1]
    # Two-pass backward (``_two_pass``) runs this rule twice: first to reduce each leaf's
    # gradient rows to its statistics (nothing written), then to update the rows.
    stats_stage = updater.stage == "stats"
    for leaf in site.leaves:
      updater.fired.add(leaf)
    cts = cts[0]  # the updated stacks of ``pre`` are read by no loss: zero cotangents
    ct_carry, ct_ys = list(cts[:nk]), list(cts[nk:])
    float_consts = _split(consts, fc)[0]

    def row_at(x, index):
      return lax.dynamic_index_in_dim(x, index, 0, keepdims=False)

    def index_of(k):
      return k if reverse else length - 1 - k

    def fetch(stacks, state_stacks, index):
      return ([row_at(p, index) for p in stacks],
              [[row_at(s, index) for s in slots] for slots in state_stacks])

    def iteration(k, state):
      ct_c, ct_consts, stacks, state_stacks, ct_xo, (p_rows, slot_rows), accs = state
      index = index_of(k)
      row = lambda x: row_at(x, index)
      c_row = [row(c) for c in carries] if residuals.needs_carry else [None] * nk
      xo_rows = [row(x) for x in xs_other]
      flat_inputs = [*float_consts, *_split(c_row, fk)[0], *p_rows, *_split(xo_rows, fxo)[0]]
      saved_rows = [row(r) for r in saved]
      leaves = [flat_inputs[k] if kind == "input" else saved_rows[k]
                for kind, k in residuals.sources]
      pullback = jax.tree.unflatten(residuals.treedef, leaves)
      ct_y_row = [row(y) for y, f in zip(ct_ys, fout[nk:]) if f]
      g_consts, g_carry, g_params, g_xo = pullback([*_split(ct_c, fk)[0], *ct_y_row])
      new_stacks, new_state_stacks, accs = list(stacks), list(state_stacks), list(accs)
      write = lambda buf, r: lax.dynamic_update_index_in_dim(buf, r.astype(buf.dtype), index, 0)
      for j, leaf in enumerate(site.leaves):
        g = g_params[j]
        if extras[j] is not None:
          g = g + row(extras[j]).astype(g.dtype)
        if stats_stage:
          partials = updater.row_stats(leaf, g, index, length)
          accs[j] = tuple(_rows.ROW_COMBINE[r](a, v.astype(a.dtype))
                          for a, (v, r) in zip(accs[j], partials))
          continue
        update, new_slots = updater.row_update(leaf, g, p_rows[j], slot_rows[j], readonly[j],
                                               index, length)
        if updater.update_params:
          new_stacks[j] = write(stacks[j], (p_rows[j] + update).astype(p_rows[j].dtype))
        new_state_stacks[j] = tuple(write(s, r) for s, r in zip(state_stacks[j], new_slots))
      ct_consts = [a + b for a, b in zip(ct_consts, g_consts)]
      ct_xo = [lax.dynamic_update_index_in_dim(acc, g, index, 0) for acc, g in zip(ct_xo, g_xo)]
      ct_c = _merge(g_carry, [None] * (nk - sum(fk)), fk)
      # Prefetch the next rows from the buffers just written: the only read of a buffer in this
      # iteration then depends on its write, so XLA can prove the in-place updates safe and
      # copies no buffer (reads of old rows unordered with the writes make it copy them all).
      next_index = index_of(jnp.minimum(k + 1, length - 1))
      prefetched = fetch(new_stacks, new_state_stacks, next_index)
      return (ct_c, ct_consts, tuple(new_stacks), tuple(new_state_stacks), ct_xo, prefetched,
              tuple(accs))

    init = (_merge(_split(ct_carry, fk)[0], [None] * (nk - sum(fk)), fk),
            [jnp.zeros_like(c) for c in float_consts], tuple(pstacks),
            tuple(tuple(s) for s in leaf_slots),
            [jnp.zeros_like(x) for x in _split(xs_other, fxo)[0]],
            fetch(pstacks, leaf_slots, index_of(0)),
            tuple(_stat_identities(updater, leaf, pstacks[j], length) if stats_stage else ()
                  for j, leaf in enumerate(site.leaves)))
    ct_c, ct_consts, stacks, state_stacks, ct_xo, _, accs = lax.fori_loop(0, length, iteration,
                                                                          init)
    ct_consts_full = _merge(ct_consts, [None] * (nc - sum(fc)), fc)
    ct_xo_full = _merge(ct_xo, [None] * (len(xs_other) - sum(fxo)), fxo)
    if stats_stage:  # the statistics leave as the cotangents of their zero inputs
      ct_stats = tuple(tuple(a.astype(z.dtype) for a, z in zip(acc, zeros))
                       for acc, zeros in zip(accs, stat_in))
      return (None, None, None, None, None, ct_stats, ct_consts_full, ct_c, ct_xo_full)
    return (tuple(stacks), tuple(state_stacks), None, None, None, None, ct_consts_full, ct_c,
            ct_xo_full)

  fscan.defvjp(fwd, bwd)
  outs, pre_out = fscan(pstacks, leaf_slots, readonly, extras, pre_in, stat_in, consts_in,
                        carry_in, xs_other)
  for leaf, updated in zip(site.leaves, pre_out):
    if updated is not None:
      updater.pre_results[leaf] = updated
  return list(outs)


def _stat_identities(updater, leaf: int, stack, length: int) -> tuple:
  """The value of each statistic of ``leaf`` over no rows: where the backward loop starts
  combining the rows' partial statistics."""
  found: list = []
  row = jax.ShapeDtypeStruct(jnp.shape(stack)[1:], jnp.result_type(stack))
  jax.eval_shape(lambda g: found.append(updater.row_stats(leaf, g, 0, length)) or 0, row)

  def identity(partial, reduction):
    dtype, shape = partial.dtype, partial.shape
    if reduction in ("reduce_max", "reduce_min"):
      big = jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).max
      return jnp.full(shape, -big if reduction == "reduce_max" else big, dtype)
    return jnp.full(shape, reduction == "reduce_and", dtype)

  return tuple(identity(p, r) for p, r in found[0])
