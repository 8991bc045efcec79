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

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore
from jax.extend.core import primitives

from optfuse._base import _leaves
from optfuse._base._errors import NonSeparableError
from optfuse._jaxpr import _interpreter
from optfuse._plan import _separable
from optfuse._plan._plan import LeafGroup, Plan, StatsPlan

Deps = frozenset


def _is_var(atom) -> bool:
  return not isinstance(atom, jcore.Literal)


class _Flattener(_interpreter.Interpreter):
  """Flattens the traced update and labels every variable with the gradients it reads.

  Its values are the atoms of the flat jaxpr it emits. Call-like equations (``jit``,
  ``custom_jvp_call``...) are inlined: the update is never differentiated, so a custom
  derivative's primal body is all it needs, and inlined equations get fresh variables (one body
  may be called several times). A ``cond`` is split into one ``cond`` per set of gradients its
  outputs read, so that each leaf's share of it stays with the leaf (``apply_if_finite`` puts
  the whole inner update under one ``cond`` on the all-finite flag); where a piece still mixes
  leaves (a global-norm clip inside ``apply_if_finite``), its branches are inlined and the
  outputs chosen with ``select_n``, so the analysis sees through it.
  """

  def __init__(self):
    super().__init__()
    self.consts: list = []
    self.constvars: list = []
    self.eqns: list = []
    self.deps: dict = {}

  def literal(self, atom):
    return atom

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
    return self.run(jaxpr, constvars, args)

  def default(self, eqn, ins) -> list:
    outs = [v if isinstance(v, jcore.DropVar) else jcore.Var(v.aval) for v in eqn.outvars]
    self.emit(eqn.replace(invars=ins, outvars=outs), Deps().union(*(self.dep(v) for v in ins)))
    return outs

  def call(self, eqn, ins) -> list:
    body = _interpreter.call_body(eqn)
    if body is None:
      return self.default(eqn, ins)
    return self.inline(body.jaxpr, list(body.consts), ins)

  def split_cond(self, eqn, ins) -> list:
    if eqn.effects:
      return self.default(eqn, ins)
    return self.cond(eqn.replace(invars=ins))

  def cond(self, eqn: jcore.JaxprEqn) -> list:
    index, ops = eqn.invars[0], eqn.invars[1:]
    branches = _interpreter.cond_branches(eqn)
    columns = zip(*(_interpreter.output_dependencies(b.jaxpr, [self.dep(v) for v in ops])
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
      alone = _interpreter.new_jaxpr(operands, piece_outs, [whole], like=branches[0].jaxpr)
      pruned, _ = _interpreter.prune(alone, [True] * len(piece_outs))
      (piece,) = pruned.eqns
      self.emit(piece.replace(outvars=piece_outs), self.dep(index) | deps)
    return outs

  rules = {**dict.fromkeys(_interpreter.CALL_PRIMITIVES, call), primitives.cond_p: split_cond}


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
  jaxpr = _interpreter.new_jaxpr([*flattener.constvars, *top.invars], outvars, flattener.eqns,
                                 like=top)
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
    jaxpr = _interpreter.new_jaxpr([*self.jaxpr.invars, *extra_invars, *cut_invars],
                                   [rename(v) for v in outvars], eqns, like=self.jaxpr)
    return _interpreter.prune(jaxpr, [True] * len(outvars))


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
    jaxpr, reads = _interpreter.prune(
        _interpreter.new_jaxpr(graph.jaxpr.invars, leaf_stats,
                               [eqns[k] for k in sorted(graph.ancestors(leaf_stats))],
                               like=graph.jaxpr),
        [True] * len(leaf_stats))
    stat_jaxprs.append(jaxpr)
    stat_reads.append(tuple(reads))
  flat_stats = [v for leaf_stats in stats for v in leaf_stats]
  stat_invars = [jcore.Var(v.aval) for v in flat_stats]
  sub = dict(zip(flat_stats, stat_invars))
  rename = lambda v: sub.get(v, v) if _is_var(v) else v
  combine_eqns = [e.replace(invars=[rename(v) for v in e.invars])
                  for k, e in enumerate(eqns) if k in live]
  combine, combine_reads = _interpreter.prune(
      _interpreter.new_jaxpr([*graph.jaxpr.invars, *stat_invars],
                             [rename(v) for v in global_outvars], combine_eqns,
                             like=graph.jaxpr),
      [True] * len(global_outvars))
  if any(combine_reads[c:c + n]):
    raise NonSeparableError(
        "two-pass backward cannot split this optimizer's global reduction into per-leaf "
        'statistics (it reads the gradients themselves after mixing them); use mode="forward".')
  return StatsPlan(tuple(tuple(_aval(v) for v in s) for s in stats), tuple(stat_jaxprs),
                   tuple(stat_reads), combine, tuple(combine_reads))


def make_global_plan(tx: optax.GradientTransformation, params, state,
                     two_pass: bool = False, traced=None) -> Plan:
  """Traces ``tx.update`` for these params/state and splits it into global stage and groups.

  Args:
    tx: any optax transformation.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    state: ``tx.init(params)`` or a state of the same structure.
    two_pass: also split the global stage into per-leaf statistics (``Plan.stats``) and
      check that every group's state can travel as a cotangent (float), as the two-pass backward
      step needs (``Plan.stats``).
    traced: ``_separable.trace_update(tx, params, state)``, when the caller has it already.

  Returns:
    The ``Plan``; for a separable transform it has no cuts and no global state.

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
  traced = _separable.trace_update(tx, params, state) if traced is None else traced
  closed, params_def, state_def, n, m, needs_loss = traced
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
  state_names = _separable.paths(state)
  param_names = _separable.paths(jax.tree.unflatten(params_def, list(range(n))))
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
    groups.append(LeafGroup(i, group_outs, jaxpr, tuple(reads), any(reads[c:c + n])))
  global_outvars = [*cuts, *(outs[n + k] for k in global_outs)]
  global_jaxpr, global_reads = _interpreter.prune(
      _interpreter.new_jaxpr(flat.invars, global_outvars, flat.eqns, like=flat),
      [True] * len(global_outvars))
  shared_jaxpr, shared_reads = _interpreter.prune(flat, [False] * n + [k in shared_outs
                                                                  for k in range(m)])
  stats = None
  if two_pass and global_outvars:
    stats = _stats_plan(graph, c, n, global_outvars, param_names)
  return Plan(params_def, state_def, n, m, tuple(consts), tuple(groups), tuple(shared_outs),
              shared_jaxpr, tuple(shared_reads), cuts=tuple(_aval(c) for c in cuts),
              global_outs=tuple(global_outs), global_jaxpr=global_jaxpr,
              global_reads=tuple(global_reads), stats=stats)
