"""Fusion across loops: which scans update their stacked params in place, and the loss that
runs them.

Large JAX models scan over stacked layer params (``lax.scan``, ``nn.scan``, ``nnx.scan``). A tap on
the stacked leaf would fire only after the whole backward loop, with the full stacked gradient
materialised; a tap on the slice inside the loop body makes JAX's scan transpose emit fresh
stacked outputs (twice the memory). Instead, optfuse traces the loss to a jaxpr once and finds
every ``scan`` whose scanned input is a param leaf read nowhere else (``analyze``), and the loss
is evaluated from that jaxpr with those scans bound as fused scans (``_fused_scan``), whose
backward loop updates the leaf's rows in place.

The leaf is followed to its scan as real codebases write it:

* through row-preserving operations (``_rows.PATH_PRIMITIVES``): a mixed-precision cast of the
  whole params tree (jmp, Levanter), ``moveaxis``/``transpose`` of a stack stored with the layer
  axis elsewhere (MaxText's ``nn.scan(variable_axes={"params": 1})`` and NNX decoder),
  ``reshape``, ``squeeze``, ``expand_dims``, copies and sharding constraints. The stacked axis
  of the stored leaf is the one that arrives at the scan's axis 0; the operations move into the
  loop body and run on each row, so the update runs on the stored row, in the stored dtype;
* through call-like wrappers whose body may be rewritten (``jit``, ``closed_call``, and
  ``remat``/``jax.checkpoint`` around the whole stack, which is re-applied around the rewritten
  body so that its residuals are still recomputed).

A stacked leaf that is not fused gets an ordinary tap (updated after the loop, exactly as optax
does), and ``LoopPlan.reasons`` says why: read twice, read whole by a loop body, the scan sits
inside a ``while_loop``, ``cond`` or custom-derivative function, the path mixes rows, the loop
is too short to pay, or the update mixes rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from optfuse import _fused_scan, _jaxpr, _rows
from optfuse._fused_scan import PreUpdate as PreUpdate
from optfuse._fused_scan import Site
from optfuse._plan import UpdatePlan

# Calls whose body the loss interpreter may rewrite: inlined (``jit``...) or re-wrapped
# (``remat``). Custom-derivative functions keep their own rules, so their bodies are not.
_INLINED_CALLS = frozenset([P.jit_p, P.closed_call_p, P.call_p])
_REWRAPPED_CALLS = frozenset([P.remat_p])
_REWRITTEN_CALLS = _INLINED_CALLS | _REWRAPPED_CALLS
_OPAQUE = {
    P.while_p: "the scan sits inside a while_loop (fori_loop), whose body optfuse does not "
               "rewrite; scan over the layers with lax.scan instead",
    P.cond_p: "the scan sits inside a cond, whose branches optfuse does not rewrite",
    P.custom_jvp_call_p: "the scan sits inside a custom_jvp function, whose gradient rule is "
                         "user-defined",
    P.custom_vjp_call_p: "the scan sits inside a custom_vjp function, whose gradient rule is "
                         "user-defined",
}
SHARED = ("read more than once (by two scans, or also outside its scan): its gradient is "
          "complete only after every read, so it is updated once after the backward pass")
CLOSED_OVER = ("read whole by a loop body (closed over or carried), not as its scanned input: "
               "its gradient is a sum over the iterations")


class _View(NamedTuple):
  """A value computed from a stacked param leaf, as site finding follows it to a scan.

  Attributes:
    leaf: the param leaf.
    axes: ``(stored_axis, axis)`` pairs: where each stored axis that could be the stacked one
      is in this value (every axis at first; ``_rows.row_params`` moves them).
    path: the row-preserving equations from the stored leaf to this value.
    shared: some value on the way (the leaf included) is read more than once.
    problem: why a scan reading this value cannot fuse the leaf, if it cannot.
  """

  leaf: int
  axes: tuple[tuple[int, int], ...]
  path: tuple[jcore.JaxprEqn, ...]
  shared: bool = False
  problem: str | None = None


class _Deferred(NamedTuple):
  """A stored param leaf whose path to a fused scan runs inside the loop body, not here."""

  value: Any


class LoopPlan(NamedTuple):
  """The traced loss and its fused scans.

  Attributes:
    params_def: treedef of the params.
    fused_leaves: param leaves updated inside a backward loop.
    jaxpr: the traced loss.
    consts: its constants.
    sites: ``id(eqn) -> Site`` for every fused scan, at any depth of call nesting.
    deferred: ids of the path equations that run inside fused loop bodies.
    entered: ids of the call equations whose bodies hold a site or a deferred equation.
    dynamic: which leaves of ``(args, kwargs)`` are jaxpr inputs (the rest are static).
    out_def: treedef of the loss output.
    stacked: leaf -> stacked axis of every leaf a scan reads as its scanned input through a
      row-preserving path, fused or not.
    reasons: leaf -> why a leaf that a scan reads as its scanned input is not fused.
    in_remat: fused leaves whose scan sits inside ``jax.checkpoint`` (its forward runs again in
      the backward pass).
  """

  params_def: Any
  fused_leaves: tuple[int, ...]
  jaxpr: jcore.Jaxpr
  consts: tuple
  sites: dict
  deferred: frozenset
  entered: frozenset
  dynamic: tuple[bool, ...]
  out_def: Any
  stacked: dict
  reasons: dict
  in_remat: frozenset = frozenset()

  def call(self, updater, leaves, slots, args, kwargs):
    """Evaluates the loss on ``leaves`` (the fused leaves untapped) with fused scans."""
    arg_leaves = jax.tree.leaves((args, kwargs))
    dyn = [a for a, d in zip(arg_leaves, self.dynamic) if d]
    outs = _interpret(self, self.jaxpr, self.consts, [*leaves, *dyn], updater, slots)
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
  for atom in [*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]:
    if isinstance(atom, jcore.Var):
      counts[atom] = counts.get(atom, 0) + 1
  return counts


def min_loop_length(plan: UpdatePlan, leaf: int) -> int:
  """The shortest loop in which updating ``leaf`` row by row saves memory.

  Fusion removes the stacked gradient (``length`` rows) but keeps rows in flight in each
  iteration: the row's gradient, and the param and state rows read out of their buffers. Below
  ``2 + slots`` iterations that costs more than it saves, and the leaf is updated after the loop
  as optax does (measured: a 3-layer scan with AdamW used one row more temp memory fused).
  """
  return 2 + len(plan.groups[leaf].state_outs)


def _row_spec(x, axis: int) -> jax.ShapeDtypeStruct:
  shape = jnp.shape(x)
  return jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], jnp.result_type(x))


def row_refusal(plan: UpdatePlan, leaf: int, state_leaves, params_leaves, length: int,
                axis: int = 0) -> str | None:
  """Why row ``l`` of leaf ``leaf``'s update does not depend on row ``l`` of its inputs only,
  or ``None`` when it does."""
  group = plan.groups[leaf]
  rank = jnp.ndim(params_leaves[leaf])
  if any(jnp.ndim(state_leaves[k]) != rank or jnp.shape(state_leaves[k])[axis] != length
         for k in group.state_outs):
    return "its optimizer state is not stacked like the param"
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  n, m, c = plan.num_params, plan.num_state, len(plan.consts)
  reads_s, reads_p = group.reads[c + n:c + n + m], group.reads[c + n + m:]
  readonly = ([spec(s) if r and k not in group.state_outs else None
               for k, (s, r) in enumerate(zip(state_leaves, reads_s))],
              [spec(p) if r and j != leaf else None
               for j, (p, r) in enumerate(zip(params_leaves, reads_p))])
  param_row = _row_spec(params_leaves[leaf], axis)
  slot_rows = [_row_spec(state_leaves[k], axis) for k in group.state_outs]
  try:
    jax.eval_shape(lambda g, p, s, ro: row_update(plan, leaf, g, p, s, ro, 0, length, axis),
                   param_row, param_row, slot_rows, readonly)
  except _rows.NotRowwise as e:
    return str(e)
  return None


def row_update(plan: UpdatePlan, leaf: int, grad_row, param_row, slot_rows, readonly, index,
               length: int, axis: int = 0):
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
  out = _rows.evaluate_rows(group.jaxpr, (), args, is_row, index, length, axis=axis)
  return out[0], out[1:]


# A refusal: ``refuse(leaf, length, axis) -> str | None``, why a leaf scanned by a loop of
# ``length`` iterations along its stored ``axis`` is not updated inside it (``None``: it is).
Refusal = Callable[[int, int, int], "str | None"]


class _Finder:
  """Walks the loss jaxpr once, following every float param leaf to the scans that read it."""

  def __init__(self, shapes: list, refuse: Refusal, remat_problem: str | None):
    self.shapes = shapes
    self.refuse = refuse
    self.remat_problem = remat_problem
    self.remat_depth = 0
    self.in_remat: set = set()
    self.sites: dict = {}
    self.deferred: set = set()
    self.stacked: dict = {}
    self.reasons: dict = {}

  def reason(self, leaf: int, why: str) -> None:
    self.reasons.setdefault(leaf, why)

  def walk(self, jaxpr: jcore.Jaxpr, views: dict, problem: str | None = None) -> list:
    """Finds the sites in ``jaxpr`` whose invars carry ``views``; returns the views of its
    outvars."""
    counts = _use_counts(jaxpr)

    def put(v, w: _View) -> None:
      views[v] = w._replace(shared=w.shared or counts.get(v, 0) > 1, problem=w.problem or problem)

    given, views = views, {}
    for v, w in given.items():
      put(v, w)
    for eqn in jaxpr.eqns:
      ins = [views.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
      if not any(ins):
        continue
      prim = eqn.primitive
      if prim is P.scan_p:
        self.scan(eqn, ins)
        continue
      body = _jaxpr.call_body(eqn)
      if body is not None and prim in _REWRITTEN_CALLS:
        self.remat_depth += prim in _REWRAPPED_CALLS
        outs = self.walk(body.jaxpr, {iv: w for iv, w in zip(body.jaxpr.invars, ins) if w},
                         self.remat_problem if prim in _REWRAPPED_CALLS else None)
        self.remat_depth -= prim in _REWRAPPED_CALLS
        for v, w in zip(eqn.outvars, outs):
          if w is not None and prim in _INLINED_CALLS:
            put(v, w)
      elif prim in _OPAQUE:
        for inner in _jaxpr_params(eqn):
          self.walk(inner, {iv: w for iv, w in zip(_operands(eqn, inner), ins) if w},
                    _OPAQUE[prim])
      elif prim in _rows.PATH_PRIMITIVES and len(eqn.invars) == 1:
        put(eqn.outvars[0], self.step(eqn, ins[0]))
      else:  # followed only to say why a scan that reads the result cannot fuse the leaf
        w = next(w for w in ins if w)
        for v in eqn.outvars:
          put(v, w._replace(axes=(), problem=w.problem or (
              f"its scan reads it after {prim.name}, which optfuse does not move into the loop "
              "body")))
    return [views.get(v) if isinstance(v, jcore.Var) else None for v in jaxpr.outvars]

  def step(self, eqn: jcore.JaxprEqn, w: _View) -> _View:
    """The view of a path equation's output."""
    axes = []
    for stored, axis in w.axes:
      try:
        axes.append((stored, _rows.path_axis([eqn], axis, self.shapes[w.leaf][stored])))
      except _rows.NotRowwise:
        pass
    problem = w.problem or (None if axes else f"its rows are mixed by {eqn.primitive.name} on "
                            "the way to its scan")
    return _View(w.leaf, tuple(axes), (*w.path, eqn), w.shared, problem)

  def scan(self, eqn: jcore.JaxprEqn, ins: list) -> None:
    prm = eqn.params
    start, length = prm["num_consts"] + prm["num_carry"], prm["length"]
    positions, leaves, axes, paths = [], [], [], []
    inner: dict = {}
    for k, (w, iv) in enumerate(zip(ins, prm["jaxpr"].jaxpr.invars)):
      if w is None:
        continue
      if k < start:
        inner[iv] = w._replace(axes=(), problem=w.problem or CLOSED_OVER)
        if length in self.shapes[w.leaf]:  # a stack of this loop's length, not scanned
          self.reason(w.leaf, w.problem or CLOSED_OVER)
        continue
      stored = next((s for s, a in w.axes if a == 0 and self.shapes[w.leaf][s] == length), None)
      if w.problem is None and not w.shared and stored is not None:
        self.stacked[w.leaf] = stored
      why = w.problem or (SHARED if w.shared else None)
      if why is None and stored is None:
        why = ("no axis of the stored leaf becomes the scanned axis: a reshape or transpose "
               "on the way mixes the layer axis with another")
      why = why or self.refuse(w.leaf, length, stored)
      if why is not None:
        self.reason(w.leaf, why)
        continue
      positions.append(k - start)
      leaves.append(w.leaf)
      axes.append(stored)
      paths.append(w.path)
    self.walk(prm["jaxpr"].jaxpr, inner)  # for the reasons of loops nested in this one
    if leaves and self.remat_depth:
      self.in_remat.update(leaves)
    if leaves:
      self.sites[id(eqn)] = Site(tuple(positions), tuple(leaves), tuple(axes), tuple(paths))
      self.deferred.update(id(e) for path in paths for e in path)


def _entered(jaxpr: jcore.Jaxpr, marked: set) -> frozenset:
  """The call equations (at any depth) whose bodies hold an equation of ``marked``."""
  found: set = set()

  def holds(jaxpr) -> bool:
    any_marked = False
    for eqn in jaxpr.eqns:
      body = _jaxpr.call_body(eqn) if eqn.primitive in _REWRITTEN_CALLS else None
      if body is not None and holds(body.jaxpr):
        found.add(id(eqn))
      any_marked |= id(eqn) in marked or id(eqn) in found
    return any_marked

  holds(jaxpr)
  return frozenset(found)


def _jaxpr_params(eqn: jcore.JaxprEqn) -> list[jcore.Jaxpr]:
  """The bodies of a ``while``, ``cond`` or custom-derivative equation."""
  if eqn.primitive is P.cond_p:
    return [b.jaxpr for b in eqn.params["branches"]]
  if eqn.primitive is P.while_p:
    return [eqn.params["body_jaxpr"].jaxpr]
  body = _jaxpr.call_body(eqn)
  return [] if body is None else [body.jaxpr]


def _operands(eqn: jcore.JaxprEqn, inner: jcore.Jaxpr) -> list:
  """The invars of ``inner`` (a body of ``eqn``) lined up with ``eqn``'s operands."""
  if eqn.primitive is P.cond_p:
    return [None, *inner.invars]
  if eqn.primitive is P.while_p:
    skip = eqn.params["cond_nconsts"]
    return [None] * skip + list(inner.invars)
  return list(inner.invars)


REMAT_TWO_PASS = ("its scan sits inside jax.checkpoint, whose backward JAX traces once per "
                  "step, and two-pass backward needs two different backward passes")


def analyze(loss_fn, plan: UpdatePlan, params, state_leaves, args, kwargs, diff,
            refuse: Refusal | None = None, remat_problem: str | None = None) -> LoopPlan:
  """Traces ``loss_fn`` once and finds the scans whose stacked params update inside the loop.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    plan: the update plan.
    params: the params tree.
    state_leaves: the flat optimizer state.
    args: positional arguments of the loss after params.
    kwargs: keyword arguments of the loss.
    diff: indices of the float (differentiable) param leaves.
    refuse: ``refuse(leaf, length, axis) -> str | None``, why a leaf scanned by a loop of
      ``length`` iterations along its stored ``axis`` is not updated inside it; by default,
      when the loop is too short for the rows in flight to pay or ``plan``'s update of the
      leaf mixes rows.
    remat_problem: if given, scans inside ``jax.checkpoint`` are not fused, for this reason
      (two-pass backward: ``REMAT_TWO_PASS``).

  Returns:
    A ``LoopPlan``, which evaluates the loss from its jaxpr (the loss is called once, here).
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  closed, out_def, dynamic = _trace_loss(loss_fn, plan.params_def, param_leaves, args, kwargs)
  jaxpr = closed.jaxpr

  def default_refuse(leaf, length, axis):
    if length < min_loop_length(plan, leaf):
      return (f"its loop has {length} iterations, fewer than the {min_loop_length(plan, leaf)} "
              "from which updating row by row pays (the rows in flight cost more than the stack)")
    why = row_refusal(plan, leaf, state_leaves, param_leaves, length, axis)
    return None if why is None else f"its update mixes rows ({why})"

  shapes = [jnp.shape(p) for p in param_leaves]
  finder = _Finder(shapes, refuse or default_refuse, remat_problem)
  views = {jaxpr.invars[i]: _View(i, tuple((a, a) for a in range(len(shapes[i]))), ())
           for i in sorted(set(diff))}
  finder.walk(jaxpr, views)
  entered = _entered(jaxpr, set(finder.sites) | finder.deferred)
  fused = tuple(sorted(leaf for site in finder.sites.values() for leaf in site.leaves))
  reasons = {leaf: why for leaf, why in finder.reasons.items() if leaf not in fused}
  return LoopPlan(plan.params_def, fused, jaxpr, tuple(closed.consts), finder.sites,
                  frozenset(finder.deferred), entered, dynamic, out_def,
                  finder.stacked, reasons, frozenset(finder.in_remat))


def _interpret(loop_plan: LoopPlan, jaxpr: jcore.Jaxpr, consts, args, updater, slots) -> list:
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    key = id(eqn)
    if key in loop_plan.sites:
      ins = [x.value if isinstance(x, _Deferred) else x for x in ins]
      outs = _fused_scan.fused_scan(eqn, loop_plan.sites[key], updater, slots, ins)
    elif key in loop_plan.deferred:
      outs = [_Deferred(ins[0].value if isinstance(ins[0], _Deferred) else ins[0])]
    elif key in loop_plan.entered:
      outs = _enter(loop_plan, eqn, ins, updater, slots)
    else:
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _enter(loop_plan: LoopPlan, eqn: jcore.JaxprEqn, ins: list, updater, slots) -> list:
  """Evaluates a call equation's body with its fused scans: inlined, or under the same
  ``jax.checkpoint`` for ``remat``."""
  body = _jaxpr.call_body(eqn)
  if eqn.primitive not in _REWRAPPED_CALLS:
    return _interpret(loop_plan, body.jaxpr, body.consts, ins, updater, slots)
  deferred = [isinstance(x, _Deferred) for x in ins]
  before = set(updater.pre_results)

  def rematted(*arrays):
    vals = [_Deferred(a) if d else a for a, d in zip(arrays, deferred)]
    outs = _interpret(loop_plan, body.jaxpr, body.consts, vals, updater, slots)
    # Forward fusion's updated stacks leave the checkpoint as outputs, not as tracers of it.
    new = sorted(set(updater.pre_results) - before)
    return outs, {leaf: updater.pre_results.pop(leaf) for leaf in new}

  arrays = [x.value if d else x for x, d in zip(ins, deferred)]
  outs, pre = jax.checkpoint(rematted, prevent_cse=eqn.params["prevent_cse"],
                             policy=eqn.params["policy"])(*arrays)
  updater.pre_results.update(pre)
  return outs
