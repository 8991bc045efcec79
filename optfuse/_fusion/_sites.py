"""Site finding: which scans read a stacked param leaf as their scanned input, and how.

One walk over the traced loss follows every float param leaf (``View``) through
row-preserving equations (``_row_params.PATH_PRIMITIVES``: a cast, ``moveaxis``...) and into call
bodies optfuse may rewrite (``jit``, ``closed_call``, ``remat``), to the ``scan``s that read it.
A scan whose scanned input is such a leaf, read nowhere else, is a ``Site``: the loss
interpreter (``_loops``) binds it as a fused scan. For every stacked leaf it cannot fuse the
walk records why, in words a user can act on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jax.extend import core as jcore
from jax.extend.core import primitives as P

from optfuse._jaxpr import _interpreter, _row_params

# Calls whose body the loss interpreter may rewrite: inlined (``jit``...) or re-wrapped
# (``remat``). Custom-derivative functions keep their own rules, so their bodies are not.
_INLINED_CALLS = frozenset([P.jit_p, P.closed_call_p, P.call_p])
REWRAPPED_CALLS = frozenset([P.remat_p])
_REWRITTEN_CALLS = _INLINED_CALLS | REWRAPPED_CALLS
_OPAQUE = {
    P.while_p: "the scan sits inside a while_loop (fori_loop), whose body optfuse does not "
               "rewrite; scan over the layers with lax.scan instead",
    P.cond_p: "the scan sits inside a cond, whose branches optfuse does not rewrite",
    P.custom_jvp_call_p: "the scan sits inside a custom_jvp function, whose gradient rule is "
                         "user-defined",
    P.custom_vjp_call_p: "the scan sits inside a custom_vjp function, whose gradient rule is "
                         "user-defined",
}
if _interpreter.XLA_METADATA_CALL_P is not None:
  # Inlined, its body would lose the XLA metadata the call attaches to it.
  _OPAQUE[_interpreter.XLA_METADATA_CALL_P] = (
      "the scan sits inside an xla_metadata_call, whose body optfuse does not rewrite (it would "
      "drop the metadata); call xla_metadata_call inside the scan body instead")
SHARED = ("read more than once (by two scans, or also outside its scan): its gradient is "
          "complete only after every read, so it is updated once after the backward pass")
CLOSED_OVER = ("read whole by a loop body (closed over or carried), not as its scanned input: "
               "its gradient is a sum over the iterations")
class View(NamedTuple):
  """A value computed from a stacked param leaf, as site finding follows it to a scan.

  Attributes:
    leaf: the param leaf.
    axes: ``(stored_axis, axis)`` pairs: where each stored axis that could be the stacked one
      is in this value (every axis at first; ``_row_params.row_params`` moves them).
    path: the row-preserving equations from the stored leaf to this value.
    shared: some value on the way (the leaf included) is read more than once.
    problem: why a scan reading this value cannot fuse the leaf, if it cannot.
  """

  leaf: int
  axes: tuple[tuple[int, int], ...]
  path: tuple[jcore.JaxprEqn, ...]
  shared: bool = False
  problem: str | None = None


class Site(NamedTuple):
  """A scan equation whose scanned inputs at ``positions`` are the param leaves ``leaves``.

  Attributes:
    positions: indices among the scan's scanned inputs.
    leaves: the param leaf read at each position.
    axes: the stacked axis of each stored leaf.
    paths: the row-preserving equations between each stored leaf and the scan.
    rolled: the scan is fully unrolled (``unroll >= length``, penzai's ``LayerStack``): the
      fused loops roll it and save only the body's narrow matmul outputs
      (``_scan_body.narrow_matmuls_saveable``).
    in_remat: the scan sits inside ``jax.checkpoint`` (its forward loop runs again in the
      backward pass).
  """

  positions: tuple[int, ...]
  leaves: tuple[int, ...]
  axes: tuple[int, ...]
  paths: tuple[tuple[jcore.JaxprEqn, ...], ...]
  rolled: bool = False
  in_remat: bool = False


def _use_counts(jaxpr: jcore.Jaxpr) -> dict:
  counts: dict = {}
  for atom in [*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]:
    if isinstance(atom, jcore.Var):
      counts[atom] = counts.get(atom, 0) + 1
  return counts


# A refusal: ``refuse(leaf, length, axis) -> str | None``, why a leaf scanned by a loop of
# ``length`` iterations along its stored ``axis`` is not updated inside it (``None``: it is).
Refusal = Callable[[int, int, int], "str | None"]


class Finder(_interpreter.Interpreter):
  """Walks the loss jaxpr once, following every float param leaf to the scans that read it.

  Its values are ``View``s of param leaves (``None`` for values computed from no param leaf).
  """

  def __init__(self, shapes: list, refuse: Refusal, remat_problem: str | None):
    super().__init__()
    self.shapes = shapes
    self.refuse = refuse
    self.remat_problem = remat_problem
    self.remat_depth = 0
    self.in_remat: set = set()
    self.sites: dict = {}
    self.deferred: set = set()
    self.stacked: dict = {}
    self.reasons: dict = {}
    self.problem: str | None = None
    self.counts: dict = {}

  def reason(self, leaf: int, why: str) -> None:
    self.reasons.setdefault(leaf, why)

  def literal(self, atom) -> None:
    return None

  def missing(self, v) -> None:
    return None

  def write(self, v, w: View | None) -> None:
    if w is not None:
      self.env[v] = w._replace(shared=w.shared or self.counts.get(v, 0) > 1,
                               problem=w.problem or self.problem)

  def walk(self, jaxpr: jcore.Jaxpr, views: dict, problem: str | None = None) -> list:
    """Finds the sites in ``jaxpr`` whose invars carry ``views``; returns the views of its
    outvars (``problem``: why no scan in it can fuse a leaf, if none can)."""
    outer = self.problem, self.counts
    self.problem, self.counts = problem, _use_counts(jaxpr)
    try:
      return self.run(jaxpr, [None] * len(jaxpr.constvars), [views.get(v) for v in jaxpr.invars])
    finally:
      self.problem, self.counts = outer

  def default(self, eqn, ins) -> list:
    w = next((w for w in ins if w), None)
    if w is None:
      return [None] * len(eqn.outvars)
    # Followed only to say why a scan that reads the result cannot fuse the leaf.
    return [w._replace(axes=(), problem=w.problem or (
        f"its scan reads it after {eqn.primitive.name}, which optfuse does not move into the "
        "loop body"))] * len(eqn.outvars)

  def call(self, eqn, ins) -> list:
    """A call whose body the loss interpreter may rewrite: its scans are found inside."""
    body = _interpreter.call_body(eqn)
    if body is None or not any(ins):
      return self.default(eqn, ins)
    rewrapped = _interpreter.primitive_of(eqn) in REWRAPPED_CALLS
    self.remat_depth += rewrapped
    outs = self.walk(body.jaxpr, {iv: w for iv, w in zip(body.jaxpr.invars, ins) if w},
                     self.remat_problem if rewrapped else None)
    self.remat_depth -= rewrapped
    return [None] * len(eqn.outvars) if rewrapped else outs

  def opaque(self, eqn, ins) -> list:
    """A ``while``, ``cond`` or custom-derivative equation: its scans are not fused, and the
    reasons say why."""
    if not any(ins):
      return self.default(eqn, ins)
    for inner in _jaxpr_params(eqn):
      self.walk(inner, {iv: w for iv, w in zip(_operands(eqn, inner), ins) if w},
                _OPAQUE[_interpreter.primitive_of(eqn)])
    return [None] * len(eqn.outvars)

  def path(self, eqn, ins) -> list:
    """A row-preserving equation: the view moves its candidate stacked axes."""
    if len(eqn.invars) != 1 or ins[0] is None:
      return self.default(eqn, ins)
    w = ins[0]
    axes = []
    for stored, axis in w.axes:
      try:
        axes.append((stored, _row_params.path_axis([eqn], axis, self.shapes[w.leaf][stored])))
      except _row_params.NotRowwise:
        pass
    problem = w.problem or (None if axes else f"its rows are mixed by {eqn.primitive.name} on "
                            "the way to its scan")
    return [View(w.leaf, tuple(axes), (*w.path, eqn), w.shared, problem)]

  def scan(self, eqn: jcore.JaxprEqn, ins: list) -> list:
    """A scan: the leaves it reads as scanned inputs, each fused or given a reason."""
    if not any(ins):
      return [None] * len(eqn.outvars)
    parts = _interpreter.scan_parts(eqn)
    start, length = parts.num_consts + parts.num_carry, parts.length
    positions, leaves, axes, paths = [], [], [], []
    inner: dict = {}
    for k, (w, iv) in enumerate(zip(ins, parts.body.jaxpr.invars)):
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
    self.walk(parts.body.jaxpr, inner)  # for the reasons of loops nested in this one
    if leaves and self.remat_depth:
      self.in_remat.update(leaves)
    if leaves:
      self.sites[id(eqn)] = Site(tuple(positions), tuple(leaves), tuple(axes), tuple(paths),
                                 rolled=parts.unroll >= length > 1,
                                 in_remat=self.remat_depth > 0)
      self.deferred.update(id(e) for path in paths for e in path)
    return [None] * len(eqn.outvars)

  rules = {
      P.scan_p: scan,
      **dict.fromkeys(_REWRITTEN_CALLS, call),
      **dict.fromkeys(_OPAQUE, opaque),
      **dict.fromkeys(_row_params.PATH_PRIMITIVES, path),
  }


def entered_calls(jaxpr: jcore.Jaxpr, marked: set) -> frozenset:
  """The call equations (at any depth) whose bodies hold an equation of ``marked``."""
  found: set = set()

  def holds(jaxpr) -> bool:
    any_marked = False
    for eqn in jaxpr.eqns:
      rewritten = _interpreter.primitive_of(eqn) in _REWRITTEN_CALLS
      body = _interpreter.call_body(eqn) if rewritten else None
      if body is not None and holds(body.jaxpr):
        found.add(id(eqn))
      any_marked |= id(eqn) in marked or id(eqn) in found
    return any_marked

  holds(jaxpr)
  return frozenset(found)


def _jaxpr_params(eqn: jcore.JaxprEqn) -> list[jcore.Jaxpr]:
  """The bodies of a ``while``, ``cond`` or custom-derivative equation."""
  primitive = _interpreter.primitive_of(eqn)
  if primitive is P.cond_p:
    return [b.jaxpr for b in _interpreter.cond_branches(eqn)]
  if primitive is P.while_p:
    return [_interpreter.while_parts(eqn).body.jaxpr]
  body = _interpreter.call_body(eqn)
  return [] if body is None else [body.jaxpr]


def _operands(eqn: jcore.JaxprEqn, inner: jcore.Jaxpr) -> list:
  """The invars of ``inner`` (a body of ``eqn``) lined up with ``eqn``'s operands."""
  primitive = _interpreter.primitive_of(eqn)
  if primitive is P.cond_p:
    return [None, *inner.invars]
  if primitive is P.while_p:
    return [None] * _interpreter.while_parts(eqn).cond_nconsts + list(inner.invars)
  return list(inner.invars)
