"""Row evaluation: run a computation on one slice of a stacked leaf.

A scanned model stores its layers stacked: a leaf of shape ``(..., L, ...)`` whose slice ``l``
along its *stacked axis* belongs to layer ``l`` (axis 0 for ``lax.scan`` over the leaf, axis 1
for MaxText's ``nn.scan(variable_axes={"params": 1})``). Inside the backward loop only one row
of the gradient exists at a time, so the fused update must compute row ``l`` of the new param and
state from row ``l`` of the gradient, param and state. That is exact only when the update never
mixes rows: Adam does not, nor does Muon with the stacked axis as a batch axis of its matrices
(each layer's matrix is orthogonalised on its own); LAMB's trust ratio (a norm over the whole
leaf) and Adafactor's factored moments over the stacked axis do.

``evaluate_rows`` interprets a jaxpr on rows. Each value is either full or a ``_Row``: the slice
of a stacked value at one index, with the position its stacked axis had. Equations on full values
are bound as they are, except a draw of random numbers of the leaves' stacked shape from one key
(PSGD's probes, ``optax.add_noise``), which makes the row's numbers alone (``SOURCE_RULES``,
``_draws``); an equation that reads a row runs through its primitive's row rule
(``ROW_RULES``, one table keyed by primitive object, as in ``jax.experimental.jet``). A rule gets
the evaluator, the equation and its inputs, and returns its outputs, rows or full: most rules
only rewrite the equation's shape parameters for rows (``broadcast_in_dim`` shapes, reduction
axes, ``dot_general`` dimensions...; ``params_rule`` lifts such a rewrite into the table), while
the rules of higher-order primitives run their bodies again on rows (a call's body, a ``cond``'s
branches, the body of a ``scan`` or ``while_loop`` whose carry holds rows: Muon's Newton-Schulz
iterations). An equation that would combine different rows raises ``NotRowwise``; a primitive
without a rule raises ``NoRowRule``, its subclass: whether it mixes rows is not known. Running
the evaluator abstractly (under ``jax.eval_shape``) is the static test of whether a leaf can be
updated inside the loop, and by construction it accepts exactly what it can evaluate. The same
rules move the row-preserving operations between a stored param and a scan (a dtype cast,
``moveaxis``) into the loop body (``apply_path``).

The parameter rules are pure rewrites of an equation's params (``_row_params``); this module
holds the values of the evaluation, the rules that run bodies, the table that lifts the parameter
rules beside them (``ROW_RULES``) and the evaluator: adding a primitive is one entry of
``_row_params.PARAMS_RULES`` or of ``ROW_RULES``. Rules are looked up by ``primitive_of``, and
a rule that raises anything but ``NotRowwise`` refuses the leaf (``RowRuleError``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from optfuse._jaxpr import _draws, _interpreter
from optfuse._jaxpr._interpreter import CALL_PRIMITIVES, Interpreter, bind_shared, primitive_of
from optfuse._jaxpr._row_params import (
  PARAMS_RULES,
  REDUCTIONS,
  NoRowRule,
  NotRowwise,
  ParamsRule,
  RowParams,
  clear_params,
  drop_axis,
  run_rule,
)


class RowReduction(NamedTuple):
  """How the values of a reduction on each row combine into its value over all rows.

  Attributes:
    combine: ``combine(a, b)``, the reduction of two partial values.
    identity: ``identity(shape, dtype)``, its value over no rows.
  """

  combine: Callable[[Any, Any], Any]
  identity: Callable[[tuple[int, ...], Any], Any]


def _extreme(sign: int) -> Callable:
  def identity(shape, dtype):
    big = jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).max
    return jnp.full(shape, sign * big, dtype)

  return identity


# Reductions whose value over all rows is the same reduction of their values on each row.
ROW_COMBINE: dict[jcore.Primitive, RowReduction] = {
    P.reduce_sum_p: RowReduction(lax.add, lambda shape, dtype: jnp.zeros(shape, dtype)),
    P.reduce_max_p: RowReduction(lax.max, _extreme(-1)),
    P.reduce_min_p: RowReduction(lax.min, _extreme(1)),
    P.reduce_and_p: RowReduction(lax.bitwise_and, lambda shape, dtype: jnp.ones(shape, dtype)),
    P.reduce_or_p: RowReduction(lax.bitwise_or, lambda shape, dtype: jnp.zeros(shape, dtype)),
}


class _Row:
  """A value known only as its row ``index`` of a stacked array, stacked along ``axis``."""

  __slots__ = ("value", "axis")

  def __init__(self, value, axis: int):
    self.value = value
    self.axis = axis


class _Partial:
  """A reduction over the stacked axis, known as its value on one row: combining the values of
  every row with ``ROW_COMBINE[reduction]`` gives the whole value."""

  __slots__ = ("value", "reduction")

  def __init__(self, value, reduction: str):
    self.value = value
    self.reduction = reduction


def take_row(x, index, length: int, axis: int = 0):
  """Row ``index`` along ``axis`` of a full value (rank-0 values stay whole). A size-1 axis
  there is broadcast against the stacked one (lax's binary operations broadcast it, as ``vmap``
  emits them for an operand that is not batched): every row reads its one row."""
  shape = jax.numpy.shape(x)
  if not shape:
    return x
  if len(shape) <= axis or shape[axis] not in (length, 1):
    raise NotRowwise(f"a value of shape {shape} meets a row of a stacked leaf of length {length}")
  if shape[axis] != length:
    return lax.index_in_dim(x, 0, axis, keepdims=False)
  return lax.dynamic_index_in_dim(x, index, axis, keepdims=False)


def _wrap_axes(values: Sequence[Any], axes: Sequence[int | None]) -> list:
  return [x if a is None else _Row(x, a) for x, a in zip(values, axes, strict=True)]


def _unwrap(values: Sequence[Any]) -> list:
  return [x.value if isinstance(x, _Row) else x for x in values]


def _axes_of(values: Sequence[Any]) -> list[int | None]:
  return [x.axis if isinstance(x, _Row) else None for x in values]


# A row rule: ``rule(rows, eqn, ins) -> outs``, as an ``Interpreter`` rule: ``rows`` is the
# evaluator (``_RowEvaluator``), ``ins`` the equation's inputs, at least one of them a ``_Row``
# or a ``_Partial``, and ``outs`` one ``_Row``, ``_Partial`` or full value per outvar. It raises
# ``NotRowwise`` when rows would mix.
RowRule = Callable[["_RowEvaluator", jcore.JaxprEqn, list], list]


class ParamsRowRule:
  """The row rule of a primitive whose equation runs on rows with rewritten params: it lifts a
  parameter rule into ``ROW_RULES``.

  Attributes:
    how: the parameter rule, ``how(eqn, axes, length) -> RowParams``.
  """

  __slots__ = ("how",)

  def __init__(self, how: ParamsRule):
    self.how = how

  def __call__(self, rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
    return rows.bind(eqn, ins, self.how(eqn, rows.axes(eqn, ins), rows.length))


def _reduction_rule(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """A reduction on a row; with ``partial``, one over the stacked axis is its partial value."""
  row, primitive = ins[0], primitive_of(eqn)
  if not (rows.partial and primitive in ROW_COMBINE and isinstance(row, _Row)
          and row.axis in eqn.params["axes"]):
    return _REDUCTION(rows, eqn, ins)
  params = clear_params(dict(eqn.params, axes=drop_axis(eqn.params["axes"], row.axis)),
                        "out_sharding")
  (partial,) = _interpreter.bind(eqn, [row.value], params)
  return [_Partial(partial, primitive)]


def _call_rule(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """A call (``CALL_PRIMITIVES``): its body evaluated on the rows."""
  body = _interpreter.call_body(eqn)
  if body is None:
    raise NoRowRule(eqn.primitive.name)
  rows.axes(eqn, ins)
  return rows.run(body.jaxpr, body.consts, ins)


def _out_axes(rows: _RowEvaluator, body: jcore.ClosedJaxpr, ins: list) -> list[int | None]:
  """The stacked axis of each output of ``body`` evaluated on ``ins`` (``None``: full), found
  abstractly."""
  found: list = []

  def probe(*values):
    outs = rows.run(body.jaxpr, body.consts, _wrap_axes(values, _axes_of(ins)))
    found[:] = [rows.output_axis(o) for o in outs]
    return _unwrap(outs)

  jax.eval_shape(probe, *_unwrap(ins))
  return found


def _loop_carry(rows: _RowEvaluator, init: list, out_axes: Callable[[list], list]) -> list:
  """A loop's initial carry as rows wherever the body makes it rows: ``out_axes(carry)`` are the
  axes of the carry after one iteration from ``carry``. A full initial value that the body turns
  into rows is taken as its row, until the stacked axis of every carry is a fixed point."""
  carry = list(init)
  while True:
    changed = False
    for k, (x, b) in enumerate(zip(carry, out_axes(carry))):
      a = x.axis if isinstance(x, _Row) else None
      if b is None or a == b:
        continue
      if a is not None:
        raise NotRowwise("a loop that moves the stacked axis of its carry")
      carry[k], changed = _Row(rows.take(x, b), b), True
    if not changed:
      return carry


def _scan_rule(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """A ``scan`` (a ``fori_loop`` with static bounds) whose body runs on the rows it reads: the
  scanned axis of its inputs must not be the stacked one."""
  axes = rows.axes(eqn, ins)
  p = _interpreter.scan_parts(eqn)
  nc, nk, body = p.num_consts, p.num_carry, p.body
  consts, xs = ins[:nc], ins[nc + nk:]
  if 0 in axes[nc + nk:]:
    raise NotRowwise("scan along the stacked axis")
  x_axes = [None if a is None else a - 1 for a in axes[nc + nk:]]
  x_specs = [jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)) for x in _unwrap(xs)]
  slices = _wrap_axes(x_specs, x_axes)
  carry = _loop_carry(rows, ins[nc:nc + nk],
                      lambda c: _out_axes(rows, body, [*consts, *c, *slices])[:nk])
  carry_axes, y_axes = _axes_of(carry), []

  def step(c, x):
    outs = rows.run(body.jaxpr, body.consts,
                    [*consts, *_wrap_axes(c, carry_axes), *_wrap_axes(x, x_axes)])
    y_axes[:] = [rows.output_axis(o) for o in outs[nk:]]
    return [rows.conform(o, a) for o, a in zip(outs[:nk], carry_axes)], _unwrap(outs[nk:])

  out_carry, ys = lax.scan(step, _unwrap(carry), _unwrap(xs), length=p.length,
                           reverse=p.reverse, unroll=p.unroll)
  return [*_wrap_axes(out_carry, carry_axes),
          *_wrap_axes(ys, [None if a is None else a + 1 for a in y_axes])]


def _while_rule(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """A ``while_loop`` (a ``fori_loop`` with traced bounds) whose carry holds rows: its body runs
  on them, and its predicate must be the same for every row."""
  rows.axes(eqn, ins)
  nc, cond, nb, body = _interpreter.while_parts(eqn)
  cond_consts, body_consts = ins[:nc], ins[nc:nc + nb]
  carry = _loop_carry(rows, ins[nc + nb:], lambda c: _out_axes(rows, body, [*body_consts, *c]))
  carry_axes = _axes_of(carry)

  def predicate(c):
    (pred,) = rows.run(cond.jaxpr, cond.consts, [*cond_consts, *_wrap_axes(c, carry_axes)])
    return rows.conform(pred, None)

  def step(c):
    outs = rows.run(body.jaxpr, body.consts, [*body_consts, *_wrap_axes(c, carry_axes)])
    return [rows.conform(o, a) for o, a in zip(outs, carry_axes)]

  return _wrap_axes(lax.while_loop(predicate, step, _unwrap(carry)), carry_axes)


def _cond_rule(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """A ``cond`` on a predicate shared by every row (a per-row predicate is a ``select_n``, as
  ``vmap`` makes it): each branch runs on the rows, its outputs stacked where any branch's are."""
  rows.axes(eqn, ins)
  index, ops = ins[0], ins[1:]
  branches = _interpreter.cond_branches(eqn)
  out_axes = []
  for col in zip(*[_out_axes(rows, b, ops) for b in branches]):
    found = {a for a in col if a is not None}
    if len(found) > 1:
      raise NotRowwise("cond branches that stack an output along different axes")
    out_axes.append(min(found, default=None))

  def branch(b):
    def run(*values):
      outs = rows.run(b.jaxpr, b.consts, _wrap_axes(values, _axes_of(ops)))
      return [rows.conform(o, a) for o, a in zip(outs, out_axes)]

    return run

  outs = lax.switch(index, [branch(b) for b in branches], *_unwrap(ops))
  return _wrap_axes(outs, out_axes)


def _stacked_draw(rows: _RowEvaluator, eqn: jcore.JaxprEqn) -> bool:
  """Whether ``eqn`` is a draw from one key of a shape stacked along the leaves' axis."""
  if primitive_of(eqn) is not P.random_bits_p or eqn.invars[0].aval.shape:
    return False
  shape = eqn.params["shape"]
  return len(shape) > rows.axis and shape[rows.axis] == rows.length


def _draws_rows(rows: _RowEvaluator, jaxpr: jcore.Jaxpr) -> bool:
  """Whether ``jaxpr``, or a call inside it, makes a stacked draw (``_stacked_draw``)."""
  for eqn in jaxpr.eqns:
    body = _interpreter.call_body(eqn) if primitive_of(eqn) in CALL_PRIMITIVES else None
    if _stacked_draw(rows, eqn) or (body is not None and _draws_rows(rows, body.jaxpr)):
      return True
  return False


def _draw_source(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list | None:
  """A draw from one key of a stacked shape makes only the row's numbers (``_draws``)."""
  if not _stacked_draw(rows, eqn):
    return None
  (key,), shape = ins, tuple(eqn.params["shape"])
  _draws.check_draw(key, shape)
  return [_Row(_draws.draw_row(key, eqn.params["bit_width"], shape, rows.axis, rows.index),
               rows.axis)]


def _call_source(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list | None:
  """A call on full values whose body draws stacked numbers (``jax.random.normal``'s) runs
  on rows, so that its draw makes the row alone."""
  body = _interpreter.call_body(eqn)
  if body is None or not _draws_rows(rows, body.jaxpr):
    return None
  return rows.run(body.jaxpr, body.consts, ins)


# Rules of equations none of whose inputs is a row that still make rows: a draw of random numbers
# of a stacked shape, and the calls around it. A rule returns ``None`` to bind the equation whole.
SOURCE_RULES: dict[jcore.Primitive, Callable[[_RowEvaluator, jcore.JaxprEqn, list],
                                             list | None]] = {
    P.random_bits_p: _draw_source,
    **dict.fromkeys(CALL_PRIMITIVES, _call_source),
}

_REDUCTION = ParamsRowRule(PARAMS_RULES[P.reduce_sum_p])

# Every primitive's row rule: the parameter rules lifted (``ParamsRowRule``), reductions that
# may keep their partial value over the stacked axis, and the rules that run bodies on rows.
ROW_RULES: dict[jcore.Primitive, RowRule] = {
    **{p: ParamsRowRule(how) for p, how in PARAMS_RULES.items()},
    **dict.fromkeys(REDUCTIONS, _reduction_rule),
    **dict.fromkeys(CALL_PRIMITIVES, _call_rule),
    P.scan_p: _scan_rule,
    P.while_p: _while_rule,
    P.cond_p: _cond_rule,
}


class _RowEvaluator(Interpreter):
  """Evaluates a jaxpr whose values are ``_Row``s, ``_Partial``s (with ``partial``: a reduction
  over the stacked axis) or full values: an equation that reads a row or a partial value through
  its primitive's row rule (``ROW_RULES``), one on full values bound as it is.

  Attributes:
    index: the row index (a traced integer is fine).
    length: the number of rows.
    partial: whether a reduction over the stacked axis is kept as its value on the row.
    axis: the stacked axis of the leaves, where a draw of their shape has its rows
      (``SOURCE_RULES``).
  """

  def __init__(self, index, length: int, partial: bool, axis: int):
    super().__init__()
    self.index, self.length, self.partial, self.axis = index, length, partial, axis

  def default(self, eqn, ins):
    if not any(isinstance(x, (_Row, _Partial)) for x in ins):
      source = SOURCE_RULES.get(primitive_of(eqn))
      outs = None if source is None else run_rule(eqn, source, self, eqn, ins)
      return bind_shared(eqn, ins) if outs is None else outs
    rule = ROW_RULES.get(primitive_of(eqn))
    if rule is None:
      raise NoRowRule(eqn.primitive.name)
    return run_rule(eqn, rule, self, eqn, ins)

  def axes(self, eqn: jcore.JaxprEqn, ins: list) -> list[int | None]:
    """The stacked axis of each input (``None``: full) of an equation that cannot read a
    partial value."""
    if any(isinstance(x, _Partial) for x in ins):
      raise NotRowwise(f"{eqn.primitive.name} of a reduction over the stacked axis")
    return _axes_of(ins)

  def take(self, x, axis: int):
    """The row of the full value ``x`` along ``axis``."""
    return take_row(x, self.index, self.length, axis)

  def bind(self, eqn: jcore.JaxprEqn, ins: list, how: RowParams) -> list:
    """``eqn`` bound on rows with the params ``how`` gives; its outputs as ``_Row``s."""
    vals = [x.value if isinstance(x, _Row) else x if a is None else self.take(x, a)
            for x, a in zip(ins, how.full_axes)]
    outs = vals[:1] if how.params is None else _interpreter.bind(eqn, vals, how.params)
    return [_Row(o, a) for o, a in zip(outs, how.out_axes)]

  def output_axis(self, x) -> int | None:
    """The stacked axis of a value leaving a body (``None``: full)."""
    if isinstance(x, _Partial):
      raise NotRowwise("a body returning a reduction over the stacked axis")
    return x.axis if isinstance(x, _Row) else None

  def conform(self, x, axis: int | None):
    """The value of ``x`` as a body's output stacked along ``axis`` (``None``: full), its row
    taken if it is full."""
    if self.output_axis(x) == axis:
      return x.value if isinstance(x, _Row) else x
    if isinstance(x, _Row):
      raise NotRowwise("a body that moves the stacked axis of a value")
    return self.take(x, axis)


def _evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], index,
              length: int, partial: bool, axis: int) -> list[Any]:
  """The outputs of ``jaxpr`` as they are internally: ``_Row``, ``_Partial`` or full values."""
  return _RowEvaluator(index, length, partial, axis).run(jaxpr, consts, args)


def _wrap(args: Sequence[Any], is_row: Sequence[bool], axis: int) -> list:
  return [_Row(a, axis) if r else a for a, r in zip(args, is_row)]


def evaluate_rows(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                  is_row: Sequence[bool], index, length: int, *, axis: int = 0) -> list[Any]:
  """Evaluates ``jaxpr`` where the inputs flagged in ``is_row`` are given as row ``index``.

  Args:
    jaxpr: an open jaxpr traced on full stacked shapes.
    consts: its constants.
    args: its inputs; row inputs are row slices, others full values (``None`` if unread).
    is_row: which inputs are rows.
    index: the row index (a traced integer is fine).
    length: the number of rows.
    axis: the stacked axis of the row inputs and of every output.

  Returns:
    The outputs as rows.

  Raises:
    NotRowwise: some equation combines different rows, or an output is stacked along another
      axis than the inputs.
  """
  outs = _evaluate(jaxpr, consts, _wrap(args, is_row, axis), index, length, partial=False,
                   axis=axis)
  rows = []
  for o in outs:
    if isinstance(o, _Partial):
      raise NotRowwise("an output reduces over the stacked axis")
    if isinstance(o, _Row) and o.axis != axis:
      raise NotRowwise("an output moves the stacked axis")
    rows.append(o.value if isinstance(o, _Row) else take_row(o, index, length, axis))
  return rows


def evaluate_row_reductions(jaxpr: jcore.Jaxpr, args: Sequence[Any], is_row: Sequence[bool],
                            index, length: int, *, axis: int = 0) -> list[tuple[Any, str]]:
  """Evaluates ``jaxpr``, whose outputs are reductions over whole stacked leaves, on one row.

  Args:
    jaxpr: an open jaxpr without constants, traced on full stacked shapes, each of whose
      outputs is a ``reduce_sum``/``max``/``min``/``and``/``or`` over axes that include the
      stacked axis (a leaf's squared norm, whether it is finite).
    args: its inputs; row inputs are row slices, others full values (``None`` if unread).
    is_row: which inputs are rows.
    index: the row index.
    length: the number of rows.
    axis: the stacked axis of the row inputs.

  Returns:
    Per output, ``(partial, reduction)``: its value on this row and the reduction primitive
    whose ``ROW_COMBINE`` entry combines the rows' values.

  Raises:
    NotRowwise: an output is not such a reduction, or a reduced value is used further.
  """
  outs = _evaluate(jaxpr, (), _wrap(args, is_row, axis), index, length, partial=True, axis=axis)
  if not all(isinstance(o, _Partial) for o in outs):
    raise NotRowwise("a statistic that is not a reduction over the stacked axis")
  return [(o.value, o.reduction) for o in outs]


def apply_path(path: Sequence[jcore.JaxprEqn], row, axis: int, index, length: int):
  """Row ``index`` of the value ``path`` computes from a stored leaf, from that leaf's row.

  Args:
    path: unary row-preserving equations (``PATH_PRIMITIVES``), applied in order.
    row: the stored leaf's row (its stacked axis ``axis`` removed).
    axis: the stacked axis of the stored leaf.
    index: the row index.
    length: the number of rows.

  Returns:
    The row of the path's output.
  """
  rows, x = _RowEvaluator(index, length, partial=False, axis=axis), _Row(row, axis)
  for eqn in path:
    (x,) = rows.default(eqn, [x])
  return x.value
