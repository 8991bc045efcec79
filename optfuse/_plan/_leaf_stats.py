"""Statistics over a whole leaf: a separable update's norms cut out as per-leaf statistics.

LAMB's and LARS's trust ratios (``scale_by_trust_ratio``: ``||param|| / ||update||``) and
Adafactor's ``clip_by_block_rms`` reduce over every element of a leaf, so for a stacked leaf
they mix the layers: row ``l`` of the update reads every row. The update is still separable
(each leaf reads only its own gradient), and ``_separable.make_plan`` gives one group per leaf;
but a backward loop can update the leaf row by row only once those reductions are known.

``make_leaf_stats_plan`` splits such an update the way ``_global_stage`` splits a global norm,
with the leaf's own full reductions in the place of the reduction over all leaves:

* a *full reduction* is a ``reduce_sum``/``max``/``min`` over every axis of a value computed
  from the leaf's rows (its gradient, param and state slots): whatever the stacked axis, its
  value combines the values of the rows (``_rows.ROW_COMBINE``), so it is a per-leaf
  *statistic*, which two-pass backward's first pass reduces row by row;
* the *combine* step computes, from the statistics, the values of the update that depend on
  them and on no row (the trust ratio: the *cuts*);
* the leaf's *group* computes its update and state from its rows and the cuts, row by row in
  the second pass.

A leaf's state slot that is not shaped like the leaf (novograd's second moment, one scalar) is
read whole, not by rows, and where its new value is computed from statistics the combine step
writes it (the plan's ``global_outs``). A ``cond`` whose branches reduce (novograd's first-step
``cond``) is inlined, its outputs chosen with ``select_n``, so that its reductions are seen.

A full reduction may read a value that itself depends on an earlier one: optax's
``safe_norm`` takes the norm of ``where(norm(x) <= 0, 1, x)``. Its first reduction is known
only after the first pass, so the second is reduced for both values of the flag it reads (a
bool of one element, the same for every row) and the combine step chooses: exact, and still one
pass. A reduction that reads a non-bool or a larger value computed from statistics is reduced
whole, from the whole gradient: exact for a leaf updated whole (an unstacked embedding), and
refused row by row (``Plan.run_stats_row``), so that a stacked leaf with one is updated after
the loop. Any other shape of update is left to the separable plan (``None``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from optfuse._jaxpr import _interpreter
from optfuse._plan import _global_stage
from optfuse._plan._plan import LeafGroup, Plan, StatsPlan

_FULL_REDUCTIONS = (P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p)


def _is_var(atom) -> bool:
  return not isinstance(atom, jcore.Literal)


def _reduces(jaxpr: jcore.Jaxpr) -> bool:
  """Whether ``jaxpr`` or a jaxpr inside it runs a reduction that may be a full one."""
  return any(_interpreter.primitive_of(e) in _FULL_REDUCTIONS
             or any(_reduces(sub) for sub in _interpreter.inner_jaxprs(e)) for e in jaxpr.eqns)


class _Flattener(_global_stage._Flattener):
  """``_global_stage``'s flattener that also inlines a ``cond`` whose branches reduce, its
  outputs chosen with ``select_n`` (novograd's first-step ``cond`` around its per-leaf norm):
  the reductions must be top-level equations to become statistics."""

  def split_cond(self, eqn, ins) -> list:
    if eqn.effects or not any(_reduces(b.jaxpr) for b in _interpreter.cond_branches(eqn)):
      return super().split_cond(eqn, ins)
    index, ops = ins[0], ins[1:]
    chosen = [self.inline(b.jaxpr, b.consts, ops) for b in _interpreter.cond_branches(eqn)]
    outs = [jcore.Var(v.aval) for v in eqn.outvars]
    for k, out in enumerate(outs):
      cases = [c[k] for c in chosen]
      self.emit(jcore.new_jaxpr_eqn([index, *cases], [out], P.select_n_p, {}, jcore.no_effects),
                self.dep(index).union(*(self.dep(c) for c in cases)))
    return outs

  rules = {**_global_stage._Flattener.rules, P.cond_p: split_cond}


class _Reduction(NamedTuple):
  """A full reduction of one leaf's rows.

  Attributes:
    out: its output variable in the flat update.
    leaf: the leaf whose rows it reduces.
    flags: the one-element bool values, computed from the leaf's earlier reductions, that its
      operand reads: it is reduced once per assignment of them (``itertools.product`` order).
  """

  out: jcore.Var
  leaf: int
  flags: tuple[jcore.Var, ...]


class _Labels(NamedTuple):
  """Every variable of the flat update labelled by what it is computed from."""

  row: dict  # var -> the leaf whose rows it reads (not through a full reduction)
  uniform: dict  # var -> the leaf whose full reductions it reads, reading no row
  level: dict  # var -> how many full reductions deep it is (0: none)
  reductions: list  # (output, operand) of each full reduction of a row value, in order


def _is_statistic(eqn: jcore.JaxprEqn, row: dict, rows_read: set) -> bool:
  """Whether ``eqn`` reduces a row value into a statistic of its leaf: over every axis, or
  over axes that include axis 0 (the layer axis of a scan over the leaf) where no row value
  reads the result (SM3's accumulator of a non-layer axis, ``max`` over the others, which only
  its new state holds)."""
  op = eqn.invars[0] if eqn.invars else None
  if (_interpreter.primitive_of(eqn) not in _FULL_REDUCTIONS or not _is_var(op) or op not in row
      or not op.aval.ndim):
    return False
  axes = sorted(eqn.params["axes"])
  return axes == list(range(op.aval.ndim)) or (0 in axes and eqn.outvars[0] not in rows_read)


def _dependencies(flat: jcore.Jaxpr, outvars: Sequence) -> set:
  """The variables ``outvars`` are computed from: the outputs of ``flat``'s equations that
  ``flat`` pruned to ``outvars`` keeps."""
  outvars = [v for v in outvars if _is_var(v)]
  jaxpr, _ = _interpreter.prune(_interpreter.new_jaxpr(flat.invars, outvars, flat.eqns, like=flat),
                                [True] * len(outvars))
  return {*outvars, *(v for e in jaxpr.eqns for v in e.outvars)}


def _label(flat: jcore.Jaxpr, row_inputs: dict, rows_read: set) -> _Labels | None:
  """Labels ``flat``'s variables; ``None`` if a value mixes two leaves. ``rows_read``: the
  variables the updates and the slots shaped like their params are computed from."""
  labels = _Labels(dict(row_inputs), {}, {}, [])
  row, uniform, level = labels.row, labels.uniform, labels.level
  for eqn in flat.eqns:
    ins = [v for v in eqn.invars if _is_var(v)]
    leaves = {row[v] for v in ins if v in row} | {uniform[v] for v in ins if v in uniform}
    if len(leaves) > 1:
      return None
    depth = max((level.get(v, 0) for v in ins), default=0)
    op = eqn.invars[0] if eqn.invars else None
    if _is_statistic(eqn, row, rows_read):
      (out,) = eqn.outvars
      uniform[out], level[out] = row[op], depth + 1
      labels.reductions.append((out, op))
      continue
    for v in eqn.outvars:
      if any(u in row for u in ins):
        row[v] = next(iter(leaves))
      elif leaves:
        uniform[v] = next(iter(leaves))
      level[v] = depth
  return labels


def _reached(labels: _Labels, producer: dict, flat: jcore.Jaxpr, starts: Sequence) -> list:
  """The values computed from statistics (``uniform``) that the row computation of
  ``starts`` reads, walking back through row values only."""
  found, seen, stack = [], set(), [v for v in starts if _is_var(v)]
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    if v in labels.uniform:
      found.append(v)
    elif v in labels.row and v in producer:
      stack.extend(u for u in flat.eqns[producer[v]].invars if _is_var(u))
  return found


def _with_inputs(flat: jcore.Jaxpr, given: Sequence, outvars: Sequence
                 ) -> tuple[jcore.Jaxpr, list[bool]]:
  """``flat`` computing ``outvars`` with the values ``given`` taken as inputs after its own
  (instead of computed), pruned: the jaxpr and which of those inputs it reads."""
  fresh = {v: jcore.Var(v.aval) for v in given}
  eqns = [e.replace(outvars=[fresh.get(v, v) for v in e.outvars])
          if any(v in fresh for v in e.outvars) else e for e in flat.eqns]
  jaxpr = _interpreter.new_jaxpr([*flat.invars, *given], outvars, eqns, like=flat)
  return _interpreter.prune(jaxpr, [True] * len(outvars))


def _run(flat: jcore.Jaxpr, given: Sequence, outvars: Sequence, args: Sequence) -> list:
  """``outvars`` of ``flat`` evaluated on ``args`` (its inputs, then ``given``'s values)."""
  jaxpr, reads = _with_inputs(flat, given, outvars)
  return _interpreter.evaluate(jaxpr, (), [x for x, r in zip(args, reads) if r])


def _choose(variants: list, flags: list):
  """The variant of a reduction the flags' values pick (``itertools.product`` order)."""
  if not flags:
    return variants[0]
  half = len(variants) // 2
  return lax.select(jnp.reshape(flags[0], ()), _choose(variants[half:], flags[1:]),
                    _choose(variants[:half], flags[1:]))


def _traced(fn, specs) -> tuple[jcore.Jaxpr, list[bool]] | None:
  closed = jax.make_jaxpr(fn)(*specs)
  if closed.consts:
    return None
  return _interpreter.prune(closed.jaxpr, [True] * len(closed.jaxpr.outvars))


def _flags(labels: _Labels, producer: dict, flat: jcore.Jaxpr, op) -> tuple | None:
  """The flags (one-element bools computed from statistics) the row computation of ``op``
  reads, through bool values computed from them alone (a broadcast); ``None`` if it reads
  another value computed from statistics."""
  found, seen, stack = [], set(), [op]
  while stack:
    v = stack.pop()
    if not _is_var(v) or v in seen:
      continue
    seen.add(v)
    if v in labels.uniform:
      if v.aval.dtype != jnp.bool_:
        return None
      if v.aval.size == 1:
        if labels.level[v] != 1:
          return None
        found.append(v)
        continue
    if (v in labels.row or v in labels.uniform) and v in producer:
      stack.extend(flat.eqns[producer[v]].invars)
  return tuple(found)


def _find(flat: jcore.Jaxpr, labels: _Labels) -> list[_Reduction]:
  """The full reductions with the flags each reads.

  A reduction that reads another value computed from statistics (Adafactor's mean of a
  factored moment of an unstacked (V, d) embedding, ``mean(v_row)``, inside its block RMS) is
  computed whole (no flags): exact where the leaf's gradient is reduced whole, and refused
  row by row by ``Plan.run_stats_row`` (a reduced value used further), so such a stacked leaf
  is updated after the loop and ``describe`` says why."""
  producer = {v: k for k, e in enumerate(flat.eqns) for v in e.outvars}
  return [_Reduction(out, labels.uniform[out], _flags(labels, producer, flat, op) or ())
          for out, op in labels.reductions]


def _spec(v) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)


def _leaf_statistics(flat: jcore.Jaxpr, reductions: Sequence[_Reduction], *args) -> list:
  """One leaf's statistics from the flat update's inputs: each full reduction, once per
  assignment of its flags."""
  return [_run(flat, r.flags, [r.out],
               [*args, *(jnp.full(f.aval.shape, a) for f, a in zip(r.flags, bits))])[0]
          for r in reductions for bits in itertools.product([False, True], repeat=len(r.flags))]


def _combine(flat: jcore.Jaxpr, reductions: Sequence[_Reduction], cuts: Sequence, *args
             ) -> list:
  """The cuts from the flat update's inputs and every leaf's statistics (``reductions`` in
  leaf order): the flags from the first reductions, then each reduction's chosen variant."""
  flat_in, stats = args[:len(flat.invars)], list(args[len(flat.invars):])
  variants = {}
  for r in reductions:
    variants[r.out], stats = stats[:2 ** len(r.flags)], stats[2 ** len(r.flags):]
  first = [r.out for r in reductions if not r.flags]
  flags = list(dict.fromkeys(f for r in reductions for f in r.flags))
  flag_values = dict(zip(flags, _run(flat, first, flags,
                                     [*flat_in, *(variants[v][0] for v in first)])))
  chosen = [_choose(variants[r.out], [flag_values[f] for f in r.flags]) for r in reductions]
  return _run(flat, [r.out for r in reductions], cuts, [*flat_in, *chosen])


def make_leaf_stats_plan(traced, plan: Plan) -> Plan | None:
  """``plan`` (separable) with each leaf's full reductions cut out as statistics.

  Args:
    traced: ``_separable.trace_update(tx, params, state)``, which ``plan`` was made from.
    plan: the separable plan.

  Returns:
    A plan whose ``stats`` are the full reductions of each leaf (two-pass backward's first
    pass reduces them row by row), whose ``cuts`` are the values the updates read from them,
    and whose groups read those cuts; ``None`` when the update has no full reduction or does
    not split so.
  """
  closed, params_def, state_def, n, m, _ = traced
  flattener = _Flattener()
  top = closed.jaxpr
  # Labelled by leaf, so that a ``cond`` over the whole tree splits into one per leaf.
  owner = {k: g.leaf for g in plan.groups for k in g.state_outs}
  leaf_of = [*range(n), *(owner.get(k) for k in range(m)), *range(n)]
  flattener.deps.update((v, _global_stage.Deps() if i is None else _global_stage.Deps([i]))
                        for v, i in zip(top.invars, leaf_of))
  outvars = flattener.inline(top, closed.consts, top.invars)
  flat = _interpreter.new_jaxpr([*flattener.constvars, *top.invars], outvars, flattener.eqns,
                                like=top)
  consts = flattener.consts
  c, invars, outs = len(consts), flat.invars, flat.outvars
  row_inputs = {}
  for g in plan.groups:
    row_inputs[invars[c + g.leaf]] = row_inputs[invars[c + n + m + g.leaf]] = g.leaf
    # A slot shaped like its param has rows; another (novograd's scalar second moment) is read
    # whole, and where its new value is a statistic's the combine step writes it.
    row_inputs.update((invars[c + n + k], g.leaf) for k in g.state_outs
                      if invars[c + n + k].aval.shape == invars[c + g.leaf].aval.shape)
  row_slots = [k for g in plan.groups for k in g.state_outs
               if invars[c + n + k].aval.shape == invars[c + g.leaf].aval.shape]
  labels = _label(flat, row_inputs,
                  _dependencies(flat, [*outs[:n], *(outs[n + k] for k in row_slots)]))
  if labels is None or not labels.reductions:
    return None
  global_outs = tuple(k for g in plan.groups for k in g.state_outs
                      if outs[n + k] in labels.uniform)
  if any(invars[c + n + k] in row_inputs for k in global_outs):
    return None
  reductions = _find(flat, labels)
  producer = {v: k for k, e in enumerate(flat.eqns) for v in e.outvars}
  slots_of = [tuple(k for k in g.state_outs if k not in global_outs) for g in plan.groups]
  group_outs = [[outs[g.leaf], *(outs[n + k] for k in ks)] for g, ks in zip(plan.groups, slots_of)]
  cuts = list(dict.fromkeys(v for o in group_outs for v in _reached(labels, producer, flat, o)))
  specs = [_spec(v) for v in invars]
  by_leaf = [[r for r in reductions if r.leaf == i] for i in range(n)]
  stat_parts = [_traced(functools.partial(_leaf_statistics, flat, rs), specs) for rs in by_leaf]
  if any(part is None for part in stat_parts):
    return None
  stat_avals = [tuple(_spec(v) for v in jaxpr.outvars) for jaxpr, _ in stat_parts]
  if not all(jnp.issubdtype(a.dtype, jnp.floating) for s in stat_avals for a in s):
    return None
  global_state = [outs[n + k] for k in global_outs]
  combine_fn = functools.partial(_combine, flat, [r for rs in by_leaf for r in rs],
                                 [*cuts, *global_state])
  traced_combine = _traced(combine_fn, [*specs, *(a for s in stat_avals for a in s)])
  if traced_combine is None:
    return None
  combine, combine_reads = traced_combine
  if any(r for v, r in zip(invars, combine_reads) if v in row_inputs):
    return None
  groups = []
  for g, ks, o in zip(plan.groups, slots_of, group_outs):
    jaxpr, reads = _with_inputs(flat, cuts, o)
    groups.append(LeafGroup(g.leaf, ks, jaxpr, tuple(reads), any(reads[c:c + n])))
  global_outvars = [*cuts, *global_state]
  global_jaxpr, global_reads = _interpreter.prune(
      _interpreter.new_jaxpr(invars, global_outvars, flat.eqns, like=flat),
      [True] * len(global_outvars))
  shared_jaxpr, shared_reads = _interpreter.prune(
      flat, [False] * n + [k in plan.shared_outs for k in range(m)])
  stats = StatsPlan(tuple(stat_avals), tuple(j for j, _ in stat_parts),
                    tuple(tuple(r) for _, r in stat_parts), combine, tuple(combine_reads))
  return Plan(params_def, state_def, n, m, tuple(consts), tuple(groups), plan.shared_outs,
              shared_jaxpr, tuple(shared_reads),
              cuts=tuple(_spec(v) for v in cuts),
              global_outs=global_outs, global_jaxpr=global_jaxpr,
              global_reads=tuple(global_reads), stats=stats)
