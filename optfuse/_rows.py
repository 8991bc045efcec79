"""Row evaluation: run a computation on one slice of a stacked leaf.

A scanned model stores its layers stacked: a leaf of shape ``(..., L, ...)`` whose slice ``l``
along its *stacked axis* belongs to layer ``l`` (axis 0 for ``lax.scan`` over the leaf, axis 1
for MaxText's ``nn.scan(variable_axes={"params": 1})``). Inside the backward loop only one row
of the gradient exists at a time, so the fused update must compute row ``l`` of the new param and
state from row ``l`` of the gradient, param and state. That is exact only when the update never
mixes rows: Adam does not, LAMB's trust ratio (a norm over the whole leaf) and Adafactor's
factored moments over the stacked axis do.

``evaluate_rows`` interprets a jaxpr on rows. Each value is either full or a ``_Row``: the slice
of a stacked value at one index, with the position its stacked axis had. A row rule
(``ROW_RULES``, keyed by primitive) rewrites an equation's shape parameters for rows
(``broadcast_in_dim`` shapes, reduction axes, ``dot_general`` dimensions...) and says where the
stacked axis of each output is; an equation that would combine different rows raises
``NotRowwise``. Running it abstractly (under ``jax.eval_shape``) is the static test of whether a
leaf can be updated inside the loop, and by construction it accepts exactly what it can evaluate.
The same rules move the row-preserving operations between a stored param and a scan (a dtype
cast, ``moveaxis``) into the loop body (``apply_path``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore

from optfuse._jaxpr import CALL_PRIMITIVES, Interpreter, bind_shared, call_body
from optfuse._row_rules import PATH_PRIMITIVES as PATH_PRIMITIVES
from optfuse._row_rules import ROW_COMBINE as ROW_COMBINE
from optfuse._row_rules import ROW_RULES as ROW_RULES
from optfuse._row_rules import NotRowwise as NotRowwise
from optfuse._row_rules import clear_params, drop_axis, row_params


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
  """Row ``index`` along ``axis`` of a full value (rank-0 values stay whole)."""
  shape = jax.numpy.shape(x)
  if not shape:
    return x
  if len(shape) <= axis or shape[axis] != length:
    raise NotRowwise(f"a value of shape {shape} meets a row of a stacked leaf of length {length}")
  return lax.dynamic_index_in_dim(x, index, axis, keepdims=False)


def _bind_rows(eqn: jcore.JaxprEqn, ins: list, index, length: int) -> list:
  """``eqn`` on inputs some of which are ``_Row``s; its outputs as ``_Row``s."""
  how = row_params(eqn, [x.axis if isinstance(x, _Row) else None for x in ins], length)
  vals = [x.value if isinstance(x, _Row) else x if a is None else take_row(x, index, length, a)
          for x, a in zip(ins, how.full_axes)]
  if how.params is None:
    outs = vals[:1]
  else:
    outs = eqn.primitive.bind(*vals, **how.params)
    outs = outs if eqn.primitive.multiple_results else [outs]
  return [_Row(o, a) for o, a in zip(outs, how.out_axes)]


def _has_rows(ins: list) -> bool:
  return any(isinstance(x, _Row) for x in ins)


def _row_call(interp: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  body = call_body(eqn)
  if body is None or not _has_rows(ins) or any(isinstance(x, _Partial) for x in ins):
    return interp.default(eqn, ins)
  return interp.run(body.jaxpr, body.consts, ins)


def _row_reduction(interp: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """With ``partial``, a reduction over the stacked axis of a row is its partial value."""
  row = ins[0]
  if not (interp.partial and isinstance(row, _Row) and row.axis in eqn.params["axes"]):
    return interp.default(eqn, ins)
  params = clear_params(dict(eqn.params, axes=drop_axis(eqn.params["axes"], row.axis)),
                        "out_sharding")
  return [_Partial(eqn.primitive.bind(row.value, **params), eqn.primitive)]


class _RowEvaluator(Interpreter):
  """Evaluates a jaxpr whose values are ``_Row``s, ``_Partial``s (with ``partial``: a reduction
  over the stacked axis) or full values: rows through ``ROW_RULES``, full values bound as
  they are."""

  rules = {**dict.fromkeys(CALL_PRIMITIVES, _row_call),
           **dict.fromkeys(ROW_COMBINE, _row_reduction)}

  def __init__(self, index, length: int, partial: bool):
    super().__init__()
    self.index, self.length, self.partial = index, length, partial

  def default(self, eqn, ins):
    if any(isinstance(x, _Partial) for x in ins):
      raise NotRowwise(f"{eqn.primitive.name} of a reduction over the stacked axis")
    if not _has_rows(ins):
      return bind_shared(eqn, ins)
    return _bind_rows(eqn, ins, self.index, self.length)


def _evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], index,
              length: int, partial: bool) -> list[Any]:
  """The outputs of ``jaxpr`` as they are internally: ``_Row``, ``_Partial`` or full values."""
  return _RowEvaluator(index, length, partial).run(jaxpr, consts, args)


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
  outs = _evaluate(jaxpr, consts, _wrap(args, is_row, axis), index, length, partial=False)
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
  outs = _evaluate(jaxpr, (), _wrap(args, is_row, axis), index, length, partial=True)
  if not all(isinstance(o, _Partial) for o in outs):
    raise NotRowwise("a statistic that is not a reduction over the stacked axis")
  return [(o.value, o.reduction) for o in outs]


def path_axis(path: Sequence[jcore.JaxprEqn], axis: int, length: int) -> int:
  """Where the stacked axis ``axis`` of a stored leaf is after the equations of ``path``.

  Raises:
    NotRowwise: an equation of the path mixes rows.
  """
  for eqn in path:
    (axis,) = row_params(eqn, [axis], length).out_axes
  return axis


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
  x = _Row(row, axis)
  for eqn in path:
    with eqn.ctx.manager:
      (x,) = _bind_rows(eqn, [x], index, length)
  return x.value
