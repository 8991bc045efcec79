"""Global transforms: ``tx.update`` split into a global stage and one group per leaf.

Global-norm clipping, ``apply_if_finite`` and ``normalize_by_update_norm`` reduce over the
gradients of every leaf, and the update of each leaf then reads the result. ``make_global_plan``
traces ``tx.update`` and splits it in three, following data dependencies:

* the *global stage* computes, once per step and from all the gradients, the values that the
  updates of several leaves read (the clipping factor, the all-finite flag: the *cuts*) and the
  state that no single leaf owns (``apply_if_finite``'s counters);
* one *group* per leaf computes the leaf's update and its own state from its gradient, the cuts
  and the shared state;
* the *shared* state depends on no gradient (``count``, injected hyperparameters).

The split is found, not assumed: walking back from the outputs of leaf ``i``, a value that depends
on another leaf's gradient becomes a cut when the updates of other leaves read it too (the
clipping factor) and is computed in the group otherwise (``g_i * factor``). A separable transform
has no cuts. ``lax.cond`` inside the update (``apply_if_finite`` skips the inner update with one)
is split into one ``cond`` per leaf first, so that each leaf's share stays in its group.

The global stage is further split into per-leaf *statistics* (each leaf's squared norm, whether
it is finite: the values that feed the first operation mixing two leaves) and a *combine* step
that reads only statistics: what the two-pass backward step (``_two_pass``) needs, whose first
backward pass emits each leaf's statistics and whose second updates every leaf with the cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore
from jax.extend.core import primitives

from optfuse import _jaxpr, _leaves, _plan, _rows
from optfuse._errors import NonSeparableError

Deps = frozenset


class StatsPlan(NamedTuple):
  """The global stage as per-leaf statistics and a combine step.

  Every jaxpr here and in ``GlobalPlan`` takes, of the flat inputs ``(consts, grads, state,
  params, ...)``, only those its ``reads`` mask selects.

  Attributes:
    stats: for each param leaf, the shapes/dtypes of the statistics it contributes.
    stat_jaxprs: for each param leaf, a jaxpr from ``(consts, grads, state, params)`` to its
      statistics (it reads only that leaf's gradient).
    stat_reads: which inputs each ``stat_jaxprs`` entry reads.
    combine_jaxpr: from ``(consts, grads, state, params, *statistics of every leaf in leaf
      order)`` to ``(*cuts, *global state leaves)``; it reads no gradient.
    combine_reads: which inputs ``combine_jaxpr`` reads.
  """

  stats: tuple[tuple[jax.ShapeDtypeStruct, ...], ...]
  stat_jaxprs: tuple[jcore.Jaxpr, ...]
  stat_reads: tuple[tuple[bool, ...], ...]
  combine_jaxpr: jcore.Jaxpr
  combine_reads: tuple[bool, ...]


class GlobalPlan(NamedTuple):
  """``tx.update`` for one params/state signature, split into a global stage and leaf groups.

  Attributes:
    params_def: treedef of the params.
    state_def: treedef of the optimizer state.
    num_params: number of param leaves ``n``.
    num_state: number of state leaves ``m``.
    consts: constants of the traced update, the leading inputs of the jaxprs below.
    cuts: shapes/dtypes of the values the global stage hands to the groups.
    global_outs: flat indices of the state leaves the global stage writes.
    global_jaxpr: from ``(consts, grads, state, params)`` to
      ``(*cuts, *new_state[global_outs])``.
    global_reads: which inputs ``global_jaxpr`` reads.
    groups: one ``LeafGroup`` per param leaf; its jaxpr maps ``(consts, grads, state, params,
      *cuts)`` to ``(update, *new_state[state_outs])`` and reads no gradient but the leaf's own.
    shared_outs: flat indices of the state leaves that depend on no gradient.
    shared_jaxpr: from ``(consts, grads, state, params)`` to those state leaves.
    shared_reads: which inputs ``shared_jaxpr`` reads.
    stats: the global stage as per-leaf statistics, or ``None`` unless asked for.
  """

  params_def: Any
  state_def: Any
  num_params: int
  num_state: int
  consts: tuple[Any, ...]
  cuts: tuple[jax.ShapeDtypeStruct, ...]
  global_outs: tuple[int, ...]
  global_jaxpr: jcore.Jaxpr
  global_reads: tuple[bool, ...]
  groups: tuple[_plan.LeafGroup, ...]
  shared_outs: tuple[int, ...]
  shared_jaxpr: jcore.Jaxpr
  shared_reads: tuple[bool, ...]
  stats: StatsPlan | None

  @property
  def is_separable(self) -> bool:
    """Whether the update of every leaf reads only its own gradient."""
    return not self.cuts and not self.global_outs

  def _eval(self, jaxpr, reads, grads, state, params, extra=()):
    flat = [*self.consts, *grads, *state, *params, *extra]
    return _jaxpr.evaluate(jaxpr, (), [x for x, r in zip(flat, reads) if r])

  def run_global(self, grads, state, params) -> tuple[list[Any], list[Any]]:
    """``(cuts, new_state[global_outs])`` from the flat gradients, state and params."""
    out = self._eval(self.global_jaxpr, self.global_reads, grads, state, params)
    return out[:len(self.cuts)], out[len(self.cuts):]

  def run_shared(self, state, params) -> list[Any]:
    """The state leaves that depend on no gradient."""
    return self._eval(self.shared_jaxpr, self.shared_reads, [None] * self.num_params, state,
                      params)

  def run_group(self, i: int, grad, state, params, cuts) -> tuple[Any, list[Any]]:
    """``(update, new_state[groups[i].state_outs])`` of leaf ``i``, from its gradient and cuts."""
    grads = [None] * self.num_params
    grads[i] = grad
    group = self.groups[i]
    out = self._eval(group.jaxpr, group.reads, grads, state, params, cuts)
    return out[0], list(out[1:])

  def row_inputs(self, i: int, state, params, cuts, rows) -> tuple[list, list[bool]]:
    """The inputs leaf ``i``'s group jaxpr reads, and which of them are rows.

    ``rows`` = ``(grad, param, slots)``: one row of the leaf's gradient, param and state slots,
    in place of the whole leaves; the other inputs are ``state``, ``params`` and ``cuts``.
    """
    group, n = self.groups[i], self.num_params
    grad_row, param_row, slot_rows = rows
    g, st, pr = [None] * n, list(state), list(params)
    g[i], pr[i] = grad_row, param_row
    for k, s in zip(group.state_outs, slot_rows):
      st[k] = s
    flat = [*self.consts, *g, *st, *pr, *cuts]
    is_row = ([False] * len(self.consts) + [j == i for j in range(n)]
              + [k in group.state_outs for k in range(self.num_state)]
              + [j == i for j in range(n)] + [False] * len(cuts))
    used = list(zip(flat, is_row, group.reads, strict=True))
    return [x for x, _, r in used if r], [row for _, row, r in used if r]

  def run_group_row(self, i: int, state, params, cuts, rows, index, length: int, axis: int = 0
                    ) -> tuple[Any, list[Any]]:
    """Row ``index`` (along ``axis``) of ``run_group``'s ``(update, new_slots)`` from rows of
    leaf ``i``.

    Raises:
      NotRowwise: the update combines rows of the stacked leaf.
    """
    args, is_row = self.row_inputs(i, state, params, cuts, rows)
    out = _rows.evaluate_rows(self.groups[i].jaxpr, (), args, is_row, index, length, axis=axis)
    return out[0], list(out[1:])

  def row_refusal(self, i: int, state, params, stats: bool = False, axis: int = 0
                  ) -> str | None:
    """Why leaf ``i`` is not updated row by row along ``axis``, or ``None`` when it can be.

    It can when the leaf is stacked along ``axis`` with its state slots and its update
    computes row ``l`` from row ``l`` of its gradient, param and slots only (with ``stats``:
    and its statistics are reductions whose rows combine, see ``run_stats_row``). Below ``2 +
    slots`` rows the rows in flight cost more than the whole update, as for the backward loops
    (``_loops.min_loop_length``).
    """
    group, p = self.groups[i], params[i]
    shape = jnp.shape(p)
    length = shape[axis] if len(shape) > axis else 0
    if length < 2 + len(group.state_outs):
      return (f"its loop has {length} iterations, fewer than the {2 + len(group.state_outs)} "
              "from which updating row by row pays")
    if any(jnp.ndim(state[k]) != len(shape) or jnp.shape(state[k])[axis] != length
           for k in group.state_outs):
      return "its optimizer state is not stacked like the param"
    row = lambda x: jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], jnp.result_type(x))
    rows = (row(p), row(p), [row(state[k]) for k in group.state_outs])
    try:
      jax.eval_shape(lambda rows, cuts: self.run_group_row(i, state, params, cuts, rows, 0,
                                                           length, axis), rows, list(self.cuts))
      if stats and self.stats is not None:
        jax.eval_shape(lambda g: [v for v, _ in self.run_stats_row(i, g, state, params, 0,
                                                                   length, axis)], row(p))
    except _rows.NotRowwise as e:
      return f"its update mixes rows ({e})"
    return None

  def rowwise(self, i: int, state, params, stats: bool = False, axis: int = 0) -> bool:
    """Whether leaf ``i`` can be updated row by row along ``axis`` (``row_refusal``)."""
    return self.row_refusal(i, state, params, stats, axis) is None

  def run_stats_row(self, i: int, grad_row, state, params, index, length: int, axis: int = 0
                    ) -> list[tuple[Any, str]]:
    """Leaf ``i``'s statistics as ``(partial, reduction)`` pairs from one row of its gradient:
    combining the partials of every row with the reduction gives ``run_stats``.

    Raises:
      NotRowwise: a statistic is not a reduction over the whole stacked leaf.
    """
    n = self.num_params
    grads = [None] * n
    grads[i] = grad_row
    flat = [*self.consts, *grads, *state, *params]
    is_row = [False] * len(self.consts) + [j == i for j in range(n)] + [False] * (
        self.num_state + n)
    used = list(zip(flat, is_row, self.stats.stat_reads[i], strict=True))
    args, rows = [x for x, _, r in used if r], [row for _, row, r in used if r]
    return _rows.evaluate_row_reductions(self.stats.stat_jaxprs[i], args, rows, index, length,
                                         axis=axis)

  def run_stats(self, i: int, grad, state, params) -> list[Any]:
    """Leaf ``i``'s statistics from its gradient (a plan built with ``two_pass=True``)."""
    grads = [None] * self.num_params
    grads[i] = grad
    return self._eval(self.stats.stat_jaxprs[i], self.stats.stat_reads[i], grads, state, params)

  def run_combine(self, stats: Sequence[Sequence[Any]], state, params):
    """``(cuts, new_state[global_outs])`` from every leaf's statistics."""
    flat_stats = [s for leaf_stats in stats for s in leaf_stats]
    out = self._eval(self.stats.combine_jaxpr, self.stats.combine_reads,
                     [None] * self.num_params, state, params, flat_stats)
    return out[:len(self.cuts)], out[len(self.cuts):]

  def new_state(self, state, params, slots: dict[int, Sequence[Any]], global_state) -> list[Any]:
    """The flat new state: each leaf's new slots (``slots[i]``, leaves absent keep theirs),
    the global stage's state and the shared state, computed from the old ``state``."""
    new = list(state)
    for i, leaf_slots in slots.items():
      for k, s in zip(self.groups[i].state_outs, leaf_slots):
        new[k] = s
    for k, s in zip(self.global_outs, global_state):
      new[k] = s
    for k, s in zip(self.shared_outs, self.run_shared(state, params)):
      new[k] = s
    return new

  def update(self, grads, state, params) -> tuple[list[Any], list[Any]]:
    """The whole update, stage by stage: flat ``(updates, new_state)`` as ``tx.update`` gives."""
    cuts, global_state = self.run_global(grads, state, params)
    updates, slots = [], {}
    for i in range(self.num_params):
      update, slots[i] = self.run_group(i, grads[i], state, params, cuts)
      updates.append(update)
    return updates, self.new_state(state, params, slots, global_state)


def _is_var(atom) -> bool:
  return not isinstance(atom, jcore.Literal)


def _read(env: dict, atom):
  return env[atom] if _is_var(atom) else atom


def _callee(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, list[Any]] | None:
  """The body and its constants of a call-like equation whose body takes the same operands."""
  body = _jaxpr.call_body(eqn)
  return None if body is None else (body.jaxpr, list(body.consts))


def _make_jaxpr(constvars, invars, outvars, eqns) -> jcore.Jaxpr:
  """A jaxpr of these parts; its effects are those of its equations."""
  effects = jcore.no_effects.union(*(e.effects for e in eqns))
  return jcore.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects)


class _Flattener:
  """Flattens the traced update and labels every variable with the gradients it reads.

  Call-like equations (``jit``, ``custom_jvp_call``...) are inlined: the update is never
  differentiated, so a custom derivative's primal body is all it needs, and inlined equations get
  fresh variables (one body may be called several times). A ``cond`` is split into one ``cond``
  per set of gradients its outputs read, so that each leaf's share of it stays with the leaf
  (``apply_if_finite`` puts the whole inner update under one ``cond`` on the all-finite flag);
  where a piece still mixes leaves (a global-norm clip inside ``apply_if_finite``), its branches
  are inlined and the outputs chosen with ``select_n``, so the analysis sees through it.
  """

  def __init__(self):
    self.consts: list = []
    self.constvars: list = []
    self.eqns: list = []
    self.deps: dict = {}

  def dep(self, v) -> Deps:
    return self.deps.get(v, Deps()) if _is_var(v) else Deps()

  def emit(self, eqn: jcore.JaxprEqn, deps: Deps) -> None:
    self.eqns.append(eqn)
    self.deps.update((v, deps) for v in eqn.outvars)

  def inline(self, jaxpr: jcore.Jaxpr, consts: Sequence, args: Sequence) -> list:
    """Emits ``jaxpr``'s equations on ``args``; returns the atoms holding its outputs."""
    constvars = [jcore.Var(v.aval) for v in jaxpr.constvars]
    self.constvars.extend(constvars)
    self.consts.extend(consts)
    env = {**dict(zip(jaxpr.constvars, constvars)), **dict(zip(jaxpr.invars, args))}
    for eqn in jaxpr.eqns:
      invars = [_read(env, v) for v in eqn.invars]
      callee = _callee(eqn)
      if callee is not None:
        outs = self.inline(*callee, invars)
      elif eqn.primitive is primitives.cond_p and not eqn.effects:
        outs = self.cond(eqn.replace(invars=invars))
      else:
        outs = [v if isinstance(v, jcore.DropVar) else jcore.Var(v.aval) for v in eqn.outvars]
        self.emit(eqn.replace(invars=invars, outvars=outs),
                  Deps().union(*(self.dep(v) for v in invars)))
      env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]

  def cond(self, eqn: jcore.JaxprEqn) -> list:
    index, ops = eqn.invars[0], eqn.invars[1:]
    branches = eqn.params["branches"]
    columns = zip(*(_jaxpr.output_dependencies(b.jaxpr, [self.dep(v) for v in ops])
                    for b in branches))
    outs = [jcore.Var(v.aval) for v in eqn.outvars]
    by_deps: dict[Deps, list] = {}
    for v, col in zip(outs, columns):
      by_deps.setdefault(Deps().union(*col), []).append(v)
    operands = list(dict.fromkeys(v for v in eqn.invars if _is_var(v)))
    whole = eqn.replace(outvars=outs)
    for deps, piece_outs in by_deps.items():
      if len(deps) > 1:
        chosen = [self.inline(b.jaxpr, b.consts, ops) for b in branches]
        for k, out in enumerate(outs):
          if out in piece_outs:
            self.emit(jcore.new_jaxpr_eqn([index, *(c[k] for c in chosen)], [out],
                                          primitives.select_n_p, {}, jcore.no_effects),
                      self.dep(index).union(*(self.dep(c[k]) for c in chosen)))
        continue
      pruned, _ = _jaxpr.prune(_make_jaxpr([], operands, piece_outs, [whole]),
                               [True] * len(piece_outs))
      (piece,) = pruned.eqns
      self.emit(piece.replace(outvars=piece_outs), self.dep(index) | deps)
    return outs


def _flatten(closed: jcore.ClosedJaxpr, in_deps: Sequence[Deps]) -> tuple[jcore.Jaxpr, list, dict]:
  """The flat update jaxpr, its constants and the gradients each variable reads.

  Returns:
    ``(jaxpr, consts, deps)``: a jaxpr without constvars whose leading inputs are ``consts``
    (the traced update's and those of inlined bodies), then the update's own inputs.
  """
  flattener = _Flattener()
  top = closed.jaxpr
  flattener.deps.update(zip(top.invars, in_deps))
  outvars = flattener.inline(top, closed.consts, top.invars)
  jaxpr = _make_jaxpr([], [*flattener.constvars, *top.invars], outvars, flattener.eqns)
  return jaxpr, flattener.consts, flattener.deps


class _Graph:
  """The flat update jaxpr with, for every variable, its gradient dependencies (``deps``), the
  leaves whose update it reaches (``reach``) and its producing equation.

  ``local_deps`` are the dependencies that do not flow through a global value (one that depends
  on several gradients and reaches several updates): the only leaves that can own a state output.
  """

  def __init__(self, jaxpr: jcore.Jaxpr, deps: dict, num_params: int):
    self.jaxpr = jaxpr
    self.deps = deps
    self.producer = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
    reach: dict = {}
    for i, v in enumerate(jaxpr.outvars[:num_params]):
      if _is_var(v):
        reach[v] = reach.get(v, Deps()) | {i}
    for eqn in reversed(jaxpr.eqns):
      r = Deps().union(*(reach.get(v, Deps()) for v in eqn.outvars))
      for v in eqn.invars:
        if _is_var(v) and r:
          reach[v] = reach.get(v, Deps()) | r
    self.reach = reach
    is_global = lambda v: len(self.dep(v)) > 1 and len(reach.get(v, Deps())) > 1
    local = {v: d for v, d in deps.items() if v in set(jaxpr.invars)}
    for eqn in jaxpr.eqns:
      d = Deps().union(*(local.get(v, Deps()) for v in eqn.invars
                         if _is_var(v) and not is_global(v)))
      local.update((v, d) for v in eqn.outvars)
    self.local_deps = local

  def dep(self, v) -> Deps:
    return self.deps.get(v, Deps()) if _is_var(v) else Deps()

  def ancestors(self, outvars: Sequence) -> set[int]:
    """The equations ``outvars`` are computed from."""
    needed, stack = set(), [v for v in outvars if _is_var(v)]
    while stack:
      k = self.producer.get(stack.pop())
      if k is not None and k not in needed:
        needed.add(k)
        stack.extend(u for u in self.jaxpr.eqns[k].invars if _is_var(u))
    return needed

  def walk(self, i: int, starts) -> tuple[set[int], list, bool]:
    """What leaf ``i`` computes to produce ``starts``.

    Returns:
      ``(equations, cuts, reads_own_grad)``: the equations computed in the group, the values it
      takes from the global stage, and whether it computes anything from its own gradient.
    """
    own = Deps([i])
    included, cuts, seen, reads_own = set(), [], set(), False
    stack = [v for v in starts if _is_var(v)]
    while stack:
      v = stack.pop()
      if v in seen:
        continue
      seen.add(v)
      deps = self.dep(v)
      k = self.producer.get(v)
      if not deps <= own and (k is None or self.reach.get(v, Deps()) - own):
        cuts.append(v)
        continue
      reads_own |= deps == own
      if k is not None and k not in included:
        included.add(k)
        stack.extend(u for u in self.jaxpr.eqns[k].invars if _is_var(u))
    produced = {v for k in included for v in self.jaxpr.eqns[k].outvars}
    return included, [c for c in cuts if c not in produced], reads_own

  def stage(self, included: set[int], outvars: Sequence, cuts: Sequence,
            extra_invars: Sequence = ()) -> tuple[jcore.Jaxpr, list[bool]]:
    """A jaxpr from ``(*invars, *extra_invars, *cuts)`` to ``outvars`` computing ``included``.

    Each cut the included equations do not produce becomes an input of its own (a fresh variable,
    so that a cut gradient never aliases the gradient inputs).
    """
    eqns = [self.jaxpr.eqns[k] for k in sorted(included)]
    produced = {v for e in eqns for v in e.outvars}
    sub = {c: jcore.Var(c.aval) for c in cuts if c not in produced}
    rename = lambda v: sub.get(v, v) if _is_var(v) else v
    eqns = [e.replace(invars=[rename(v) for v in e.invars]) for e in eqns]
    cut_invars = [sub[c] if c in sub else jcore.Var(c.aval) for c in cuts]
    jaxpr = _make_jaxpr([], [*self.jaxpr.invars, *extra_invars, *cut_invars],
                        [rename(v) for v in outvars], eqns)
    return _jaxpr.prune(jaxpr, [True] * len(outvars))


def _aval(v) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)


def _stats_plan(graph: _Graph, c: int, n: int, global_outvars: Sequence,
                names: list[str]) -> StatsPlan:
  """Splits the global stage into per-leaf statistics and a combine step."""
  eqns = graph.jaxpr.eqns
  live = set()
  needed = {v for v in global_outvars if _is_var(v)}
  for k in reversed(range(len(eqns))):
    if any(v in needed for v in eqns[k].outvars):
      live.add(k)
      needed.update(v for v in eqns[k].invars if _is_var(v))
  single = lambda v: len(graph.dep(v)) == 1
  stats: list[list] = [[] for _ in range(n)]

  def add(v):
    if _is_var(v) and single(v) and v not in stats[next(iter(graph.dep(v)))]:
      stats[next(iter(graph.dep(v)))].append(v)

  for k in sorted(live):
    eqn = eqns[k]
    if any(len(graph.dep(v)) > 1 for v in eqn.outvars):
      for v in eqn.invars:
        add(v)
  for v in global_outvars:
    add(v)
  for i, leaf_stats in enumerate(stats):
    for v in leaf_stats:
      if not (_leaves.is_float_aval(v) or v.aval.dtype == jnp.bool_):
        raise NonSeparableError(
            f"two-pass backward cannot carry a {v.aval.dtype} statistic of leaf {names[i]} "
            'through the backward pass; use mode="forward" for this optimizer.')
  stat_jaxprs, stat_reads = [], []
  for leaf_stats in stats:
    jaxpr, reads = _jaxpr.prune(
        _make_jaxpr([], graph.jaxpr.invars, leaf_stats,
                    [eqns[k] for k in sorted(graph.ancestors(leaf_stats))]),
        [True] * len(leaf_stats))
    stat_jaxprs.append(jaxpr)
    stat_reads.append(tuple(reads))
  flat_stats = [v for leaf_stats in stats for v in leaf_stats]
  stat_invars = [jcore.Var(v.aval) for v in flat_stats]
  sub = dict(zip(flat_stats, stat_invars))
  rename = lambda v: sub.get(v, v) if _is_var(v) else v
  combine_eqns = [e.replace(invars=[rename(v) for v in e.invars])
                  for k, e in enumerate(eqns) if k in live]
  combine, combine_reads = _jaxpr.prune(
      _make_jaxpr([], [*graph.jaxpr.invars, *stat_invars],
                  [rename(v) for v in global_outvars], combine_eqns),
      [True] * len(global_outvars))
  if any(combine_reads[c:c + n]):
    raise NonSeparableError(
        "two-pass backward cannot split this optimizer's global reduction into per-leaf "
        'statistics (it reads the gradients themselves after mixing them); use mode="forward".')
  return StatsPlan(tuple(tuple(_aval(v) for v in s) for s in stats), tuple(stat_jaxprs),
                   tuple(stat_reads), combine, tuple(combine_reads))


def make_global_plan(tx: optax.GradientTransformation, params, state,
                     two_pass: bool = False) -> GlobalPlan:
  """Traces ``tx.update`` for these params/state and splits it into global stage and groups.

  Args:
    tx: any optax transformation.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    state: ``tx.init(params)`` or a state of the same structure.
    two_pass: also split the global stage into per-leaf statistics (``GlobalPlan.stats``) and
      check that every group's state can travel as a cotangent (float), as the two-pass backward
      step needs.

  Returns:
    The ``GlobalPlan``; for a separable transform it has no cuts and no global state.

  Raises:
    NonSeparableError: with ``two_pass``, the global stage does not split into float or bool
      per-leaf statistics, or a leaf owns non-float state; ``tx.update`` changes the state's
      tree structure.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    >>> plan = make_global_plan(tx, params, tx.init(params))
    >>> len(plan.cuts) > 0, plan.is_separable
    (True, False)
  """
  closed, params_def, state_def, n, m, needs_loss = _plan._trace_update(tx, params, state)
  if needs_loss is not None:
    raise NonSeparableError(
        f"optfuse cannot split {needs_loss}: its update needs the loss (the extra arguments value, "
        "grad or value_fn of tx.update) of the step whose gradient it applies. Use mode=\"off\".")
  flat, consts, deps = _flatten(closed, [Deps([i]) for i in range(n)] + [Deps()] * (m + n))
  c = len(consts)
  graph = _Graph(flat, deps, n)
  outs = flat.outvars
  state_outs_of: list[list[int]] = [[] for _ in range(n)]
  global_outs, shared_outs = [], []
  for k in range(m):
    v = outs[n + k]
    if not graph.dep(v):
      shared_outs.append(k)
      continue
    candidates = sorted(graph.local_deps.get(v, Deps()) & graph.dep(v))
    owners = [i for i in candidates if graph.walk(i, [v])[2]]
    if len(owners) == 1:
      state_outs_of[owners[0]].append(k)
    else:
      global_outs.append(k)
  walks = [graph.walk(i, [outs[i], *(outs[n + k] for k in state_outs_of[i])]) for i in range(n)]
  cuts: list = []
  for _, group_cuts, _ in walks:
    cuts.extend(c for c in group_cuts if c not in cuts)
  state_names = _plan._paths(state)
  param_names = _plan._paths(jax.tree.unflatten(params_def, list(range(n))))
  state_leaves, params_leaves = jax.tree.leaves(state), jax.tree.leaves(params)
  groups = []
  for i, (included, _, _) in enumerate(walks):
    group_outs = tuple(state_outs_of[i])
    # A non-float param has no tap: its state is updated after the backward passes, any dtype.
    if two_pass and _leaves.is_float(params_leaves[i]):
      for k in group_outs:
        if not _leaves.is_float(state_leaves[k]):
          raise NonSeparableError(
              f"optimizer state leaf {state_names[k]} has dtype "
              f"{jnp.result_type(state_leaves[k])} and belongs to leaf {param_names[i]}; "
              "two-pass backward carries per-leaf state in the backward pass, which needs float "
              'state. Use mode="forward".')
    jaxpr, reads = graph.stage(included, [outs[i], *(outs[n + k] for k in group_outs)], cuts)
    groups.append(_plan.LeafGroup(i, group_outs, jaxpr, tuple(reads), any(reads[c:c + n])))
  global_outvars = [*cuts, *(outs[n + k] for k in global_outs)]
  global_jaxpr, global_reads = _jaxpr.prune(
      _make_jaxpr([], flat.invars, global_outvars, flat.eqns),
      [True] * len(global_outvars))
  shared_jaxpr, shared_reads = _jaxpr.prune(flat, [False] * n + [k in shared_outs
                                                                  for k in range(m)])
  stats = None
  if two_pass and global_outvars:
    stats = _stats_plan(graph, c, n, global_outvars, param_names)
  return GlobalPlan(params_def, state_def, n, m, tuple(consts), tuple(_aval(c) for c in cuts),
                    tuple(global_outs), global_jaxpr, tuple(global_reads), tuple(groups),
                    tuple(shared_outs), shared_jaxpr, tuple(shared_reads), stats)
