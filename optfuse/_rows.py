"""Row evaluation: run a leaf's update on one slice of a stacked leaf.

A scanned model stores its layers stacked: a leaf of shape ``(L, ...)`` whose row ``l`` belongs to
layer ``l``. Inside the backward loop only one row of the gradient exists at a time, so the fused
update must compute row ``l`` of the new param and state from row ``l`` of the gradient, param and
state. That is exact only when the update never mixes rows: Adam does not, LAMB's trust ratio (a
norm over the whole leaf) and Adafactor's factored moments over the stacked axis do.

``evaluate_rows`` interprets the leaf's update jaxpr on row slices, rewriting the shape parameters
of each equation (``broadcast_in_dim``, ``reduce_sum`` axes, ``dot_general`` dimensions...). Any
equation that would combine different rows raises ``NotRowwise``. Running it abstractly (under
``jax.eval_shape``) is the static test of whether a leaf can be updated inside the loop, and by
construction it accepts exactly what it can evaluate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore

from optfuse._jaxpr import _inner_jaxpr


class NotRowwise(Exception):
  """The computation combines different rows of a stacked leaf."""


_ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type copy
copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma imag integer_pow
is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or polygamma pow
reduce_precision real rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh
xor square population_count shift_left shift_right_arithmetic shift_right_logical
""".split())

_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


class _Row:
  """A value known only as its row ``index`` of a stacked ``(length, ...)`` array."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value


def _shape(x) -> tuple[int, ...]:
  return tuple(x.value.shape if isinstance(x, _Row) else jax.numpy.shape(x))


def _take_row(x, index, length: int):
  """Row ``index`` of a full value broadcast against rows (rank-0 values stay whole)."""
  if isinstance(x, _Row):
    return x.value
  shape = jax.numpy.shape(x)
  if not shape:
    return x
  if shape[0] != length:
    raise NotRowwise(f"a value of shape {shape} meets a row of a stacked leaf of length {length}")
  return lax.dynamic_index_in_dim(x, index, 0, keepdims=False)


def _row_params(eqn: jcore.JaxprEqn, rows: Sequence[bool], length: int) -> dict:
  """The equation's params rewritten for row inputs; raises NotRowwise if rows would mix."""
  name, params = eqn.primitive.name, dict(eqn.params)
  if name in _ELEMENTWISE:
    return params
  (operand_is_row, *_) = rows
  if name == "broadcast_in_dim":
    dims = params["broadcast_dimensions"]
    if not dims or dims[0] != 0 or params["shape"][0] != length:
      raise NotRowwise(name)
    params["shape"] = tuple(params["shape"][1:])
    params["broadcast_dimensions"] = tuple(d - 1 for d in dims[1:])
    if params.get("sharding") is not None:
      params["sharding"] = None
    return params
  if name == "reshape":
    in_shape = eqn.invars[0].aval.shape
    if not in_shape or in_shape[0] != length or params["new_sizes"][0] != length or params.get(
        "dimensions") is not None:
      raise NotRowwise(name)
    params["new_sizes"] = tuple(params["new_sizes"][1:])
    if params.get("sharding") is not None:
      params["sharding"] = None
    return params
  if name == "transpose":
    perm = params["permutation"]
    if perm[0] != 0:
      raise NotRowwise(name)
    params["permutation"] = tuple(p - 1 for p in perm[1:])
    return params
  if name in _REDUCTIONS:
    if 0 in params["axes"]:
      raise NotRowwise(name)
    params["axes"] = tuple(a - 1 for a in params["axes"])
    if params.get("out_sharding") is not None:
      params["out_sharding"] = None
    return params
  if name == "squeeze":
    if 0 in params["dimensions"]:
      raise NotRowwise(name)
    params["dimensions"] = tuple(d - 1 for d in params["dimensions"])
    return params
  if name in _CUMULATIVE:
    if params["axis"] == 0:
      raise NotRowwise(name)
    params["axis"] -= 1
    return params
  if name in ("concatenate", "split"):
    key = "dimension" if name == "concatenate" else "axis"
    if params[key] == 0:
      raise NotRowwise(name)
    params[key] -= 1
    return params
  if name == "dot_general":
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs_row, rhs_row = rows
    if params.get("out_sharding") is not None:
      params["out_sharding"] = None
    if lhs_row and rhs_row and lb and lb[0] == 0 and rb[0] == 0:
      dec = lambda ds: tuple(d - 1 for d in ds)
      params["dimension_numbers"] = ((dec(lc), dec(rc)), (dec(lb[1:]), dec(rb[1:])))
      return params
    if lhs_row and not rhs_row and not lb and 0 not in lc:
      params["dimension_numbers"] = ((tuple(d - 1 for d in lc), rc), (lb, rb))
      return params
    raise NotRowwise(name)
  raise NotRowwise(f"{name} has no row rule")


class _Partial:
  """A reduction over the stacked axis, known as its value on one row: combining the values of
  every row with ``reduction`` gives the whole value."""

  __slots__ = ("value", "reduction")

  def __init__(self, value, reduction: str):
    self.value = value
    self.reduction = reduction


# Reductions whose value over all rows is the same reduction of their values on each row.
ROW_COMBINE = {
    "reduce_sum": lax.add, "reduce_max": lax.max, "reduce_min": lax.min,
    "reduce_and": lax.bitwise_and, "reduce_or": lax.bitwise_or,
}


def evaluate_row_reductions(jaxpr: jcore.Jaxpr, args: Sequence[Any], is_row: Sequence[bool],
                            index, length: int) -> list[tuple[Any, str]]:
  """Evaluates ``jaxpr``, whose outputs are reductions over whole stacked leaves, on one row.

  Args:
    jaxpr: an open jaxpr without constants, traced on full stacked shapes, each of whose
      outputs is a ``reduce_sum``/``max``/``min``/``and``/``or`` over axes that include the
      stacked axis (a leaf's squared norm, whether it is finite).
    args: its inputs; row inputs are row slices, others full values (``None`` if unread).
    is_row: which inputs are rows.
    index: the row index.
    length: the number of rows.

  Returns:
    Per output, ``(partial, reduction)``: its value on this row and the name of the reduction
    that combines the rows' values (a key of ``ROW_COMBINE``).

  Raises:
    NotRowwise: an output is not such a reduction, or a reduced value is used further.
  """
  outs = _evaluate(jaxpr, (), args, is_row, index, length, partial=True)
  if not all(isinstance(o, _Partial) for o in outs):
    raise NotRowwise("a statistic that is not a reduction over the stacked axis")
  return [(o.value, o.reduction) for o in outs]


def evaluate_rows(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                  is_row: Sequence[bool], index, length: int, *, tagged: bool = False) -> list[Any]:
  """Evaluates ``jaxpr`` where the inputs flagged in ``is_row`` are given as row ``index``.

  Args:
    jaxpr: an open jaxpr traced on full stacked shapes.
    consts: its constants.
    args: its inputs; row inputs are row slices, others full values (``None`` if unread).
    is_row: which inputs are rows.
    index: the row index (a traced integer is fine).
    length: the number of rows.
    tagged: return outputs as they are internally (rows wrapped, full values bare) instead of
      taking the row of every output.

  Returns:
    The outputs as rows.

  Raises:
    NotRowwise: some equation combines different rows.
  """
  outs = _evaluate(jaxpr, consts, args, is_row, index, length, partial=False)
  if tagged:
    return outs
  return [_take_row(o, index, length) for o in outs]


def _evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
              is_row: Sequence[bool], index, length: int, partial: bool) -> list[Any]:
  """The outputs of ``jaxpr`` as they are internally: ``_Row``, ``_Partial`` (with
  ``partial``: a reduction over the stacked axis) or full values."""
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a, r in zip(jaxpr.invars, args, is_row):
    env[v] = _Row(a) if r else a
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    rows = [isinstance(x, _Row) for x in ins]
    name = eqn.primitive.name
    if any(isinstance(x, _Partial) for x in ins):
      raise NotRowwise(f"{name} of a reduction over the stacked axis")
    if partial and name in ROW_COMBINE and rows[0] and 0 in eqn.params["axes"]:
      params = dict(eqn.params, axes=tuple(a - 1 for a in eqn.params["axes"] if a))
      if params.get("out_sharding") is not None:
        params["out_sharding"] = None
      env[eqn.outvars[0]] = _Partial(eqn.primitive.bind(ins[0].value, **params), name)
      continue
    if not any(rows):
      outs = eqn.primitive.bind(*ins, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    else:
      inner = _inner_jaxpr(eqn)
      if inner is not None:
        inner_consts = getattr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")), "consts", ())
        vals = [x.value if isinstance(x, _Row) else x for x in ins]
        outs = _evaluate(inner, inner_consts, vals, rows, index, length, partial)
      else:
        params = _row_params(eqn, rows, length)
        if eqn.primitive.name in _ELEMENTWISE or eqn.primitive.name in ("concatenate",):
          vals = [_take_row(x, index, length) for x in ins]
        else:
          vals = [x.value if isinstance(x, _Row) else x for x in ins]
        outs = eqn.primitive.bind(*vals, **params)
        outs = [_Row(o) for o in (outs if eqn.primitive.multiple_results else [outs])]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]
