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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from optfuse import _fused_scan, _jaxpr, _rows
from optfuse._fused_scan import PreUpdate as PreUpdate
from optfuse._plan import UpdatePlan
from optfuse._sites import REWRAPPED_CALLS, Finder, Refusal, View, entered_calls


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
  finder = Finder(shapes, refuse or default_refuse, remat_problem)
  views = {jaxpr.invars[i]: View(i, tuple((a, a) for a in range(len(shapes[i]))), ())
           for i in sorted(set(diff))}
  finder.walk(jaxpr, views)
  entered = entered_calls(jaxpr, set(finder.sites) | finder.deferred)
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
  if eqn.primitive not in REWRAPPED_CALLS:
    return _interpret(loop_plan, body.jaxpr, body.consts, ins, updater, slots)
  # Forward fusion updates no row inside a checkpoint (``LoopPlan.in_remat``), so nothing but
  # the outputs leaves it.
  deferred = [isinstance(x, _Deferred) for x in ins]

  def rematted(*arrays):
    vals = [_Deferred(a) if d else a for a, d in zip(arrays, deferred)]
    return _interpret(loop_plan, body.jaxpr, body.consts, vals, updater, slots)

  arrays = [x.value if d else x for x, d in zip(ins, deferred)]
  return jax.checkpoint(rematted, prevent_cse=eqn.params["prevent_cse"],
                        policy=eqn.params["policy"])(*arrays)
