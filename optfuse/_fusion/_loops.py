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

* through row-preserving operations (``_row_params.PATH_PRIMITIVES``): a mixed-precision cast of the
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
from jax.extend.core import primitives as P

from optfuse._base._memory_spaces import is_host
from optfuse._fusion import _fused_scan
from optfuse._fusion._fused_scan import LoopInputs as LoopInputs
from optfuse._fusion._fused_scan import PreUpdate as PreUpdate
from optfuse._fusion._sites import REWRAPPED_CALLS, Finder, View, entered_calls
from optfuse._jaxpr import _interpreter, _row_params
from optfuse._plan._plan import Plan


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

  def call(self, inputs: LoopInputs, leaves, args, kwargs) -> tuple[Any, dict, dict]:
    """Evaluates the loss on ``leaves`` (the fused leaves untapped) with fused scans, which
    read ``inputs``: ``(value, pre_results, markers)``, the loss's value, leaf -> ``(param
    stack, slot stacks)`` of the leaves the forward loops updated (``LoopInputs.pre_updates``),
    and the leaves of each fused scan bound -> its marker (``_tap.rule_marker``)."""
    arg_leaves = jax.tree.leaves((args, kwargs))
    dyn = [a for a, d in zip(arg_leaves, self.dynamic) if d]
    interpreter = _LossInterpreter(self, inputs)
    outs = interpreter.run(self.jaxpr, self.consts, [*leaves, *dyn])
    return (jax.tree.unflatten(self.out_def, outs), interpreter.pre_results,
            interpreter.markers)


def is_dynamic(x) -> bool:
  """Whether an argument of the loss is an array (traced) rather than a static value."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _trace_loss(loss_fn, params_def, param_leaves, args, kwargs):
  arg_leaves, arg_def = jax.tree.flatten((args, kwargs))
  dynamic = tuple(is_dynamic(a) for a in arg_leaves)

  def flat_loss(p_leaves, dyn):
    it = iter(dyn)
    full = [next(it) if d else a for a, d in zip(arg_leaves, dynamic)]
    a, kw = jax.tree.unflatten(arg_def, full)
    return loss_fn(jax.tree.unflatten(params_def, p_leaves), *a, **kw)

  dyn = [a for a, d in zip(arg_leaves, dynamic) if d]
  # A host-resident stack (``offload="params"``) is traced as the device value each of its rows
  # becomes in the loop that reads it (``_row_buffers.row_at``).
  traced = [jax.ShapeDtypeStruct(p.shape, p.dtype, weak_type=jax.typeof(p).weak_type)
            if is_host(p) else p for p in param_leaves]
  closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(traced, dyn)
  return closed, jax.tree.structure(out_shape), dynamic


REMAT_TWO_PASS = ("its scan sits inside jax.checkpoint, whose backward JAX traces once per "
                  "step, and two-pass backward needs two different backward passes")


def analyze(loss_fn, plan: Plan, params, state_leaves, args, kwargs, diff,
            two_pass: bool = False) -> LoopPlan:
  """Traces ``loss_fn`` once and finds the scans whose stacked params update inside the loop.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    plan: the update plan.
    params: the params tree.
    state_leaves: the flat optimizer state.
    args: positional arguments of the loss after params.
    kwargs: keyword arguments of the loss.
    diff: indices of the float (differentiable) param leaves.
    two_pass: the loops also reduce each row's gradient to the leaf's statistics (a leaf is
      fused only if they are reductions over its rows, ``Plan.row_refusal``), and scans inside
      ``jax.checkpoint`` are not fused (``REMAT_TWO_PASS``).

  Returns:
    A ``LoopPlan``, which evaluates the loss from its jaxpr (the loss is called once, here).
  """
  param_leaves = plan.params_def.flatten_up_to(params)
  closed, out_def, dynamic = _trace_loss(loss_fn, plan.params_def, param_leaves, args, kwargs)
  jaxpr = closed.jaxpr

  def refuse(leaf, length, axis):
    del length  # the leaf's, along ``axis``
    return plan.row_refusal(leaf, state_leaves, param_leaves, axis, stats=two_pass)

  shapes = [jnp.shape(p) for p in param_leaves]
  finder = Finder(shapes, refuse, REMAT_TWO_PASS if two_pass else None)
  views = {jaxpr.invars[i]: View(i, tuple((a, a) for a in range(len(shapes[i]))), ())
           for i in sorted(set(diff))}
  finder.walk(jaxpr, views)
  entered = entered_calls(jaxpr, set(finder.sites) | finder.deferred)
  fused = tuple(sorted(leaf for site in finder.sites.values() for leaf in site.leaves))
  reasons = {leaf: why for leaf, why in finder.reasons.items() if leaf not in fused}
  return LoopPlan(plan.params_def, fused, jaxpr, tuple(closed.consts), finder.sites,
                  frozenset(finder.deferred), entered, dynamic, out_def,
                  finder.stacked, reasons, frozenset(finder.in_remat))


class _LossInterpreter(_interpreter.Interpreter):
  """Evaluates the traced loss with its fused scans: a site's scan is bound as a fused scan,
  the path equations of its leaves are deferred into the loop body, and the calls that hold
  either are entered."""

  def __init__(self, loop_plan: LoopPlan, inputs: LoopInputs):
    super().__init__()
    self.loop_plan, self.inputs = loop_plan, inputs
    self.pre_results: dict = {}  # what the forward loops updated, returned by ``LoopPlan.call``
    self.markers: dict = {}  # the fused scans' markers, returned by ``LoopPlan.call``

  def scan(self, eqn, ins) -> list:
    site = self.loop_plan.sites.get(id(eqn))
    if site is None:
      return self.default(eqn, ins)
    ins = [x.value if isinstance(x, _Deferred) else x for x in ins]
    outs, pre_results, self.markers[site.leaves] = _fused_scan.fused_scan(eqn, site, self.inputs,
                                                                          ins)
    self.pre_results.update(pre_results)
    return outs

  def path(self, eqn, ins) -> list:
    if id(eqn) not in self.loop_plan.deferred:
      return self.default(eqn, ins)
    return [_Deferred(ins[0].value if isinstance(ins[0], _Deferred) else ins[0])]

  def call(self, eqn, ins) -> list:
    if id(eqn) not in self.loop_plan.entered:
      return self.default(eqn, ins)
    return _enter(self, eqn, ins)

  rules = {
      P.scan_p: scan,
      **dict.fromkeys(_row_params.PATH_PRIMITIVES, path),
      **dict.fromkeys(_interpreter.CALL_PRIMITIVES, call),
  }


def _enter(interp: _LossInterpreter, eqn: jcore.JaxprEqn, ins: list) -> list:
  """Evaluates a call equation's body with its fused scans: inlined, or under the same
  ``jax.checkpoint`` for ``remat``."""
  body = _interpreter.call_body(eqn)
  if _interpreter.primitive_of(eqn) not in REWRAPPED_CALLS:
    return interp.run(body.jaxpr, body.consts, ins)
  # Forward fusion updates no row inside a checkpoint (``LoopPlan.in_remat``), so nothing but
  # the outputs and the markers of its fused scans leaves it.
  deferred = [isinstance(x, _Deferred) for x in ins]
  outer = interp.markers

  def rematted(*arrays):
    interp.markers = {}
    vals = [_Deferred(a) if d else a for a, d in zip(arrays, deferred)]
    return interp.run(body.jaxpr, body.consts, vals), interp.markers

  arrays = [x.value if d else x for x, d in zip(ins, deferred)]
  outs, markers = jax.checkpoint(rematted, **_interpreter.remat_options(eqn))(*arrays)
  interp.markers = {**outer, **markers}
  return outs
