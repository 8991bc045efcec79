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
are bound as they are; an equation that reads a row runs through its primitive's row rule
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

The parameter rules come first in this module, then the values of the evaluation and the rules
that run bodies, the table, and the evaluator: adding a primitive is one entry of ``ROW_RULES``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from optfuse._jaxpr._interpreter import (
    CALL_PRIMITIVES,
    RESHARD_P,
    Interpreter,
    bind_shared,
    call_body,
)


class NotRowwise(Exception):
  """The computation combines different rows of a stacked leaf (or, as ``NoRowRule``, is not
  known not to)."""


class NoRowRule(NotRowwise):
  """A primitive that reads a row has no row rule yet: whether it mixes rows is not known.

  Attributes:
    primitive: the primitive's name.
  """

  def __init__(self, primitive: str):
    super().__init__(f"{primitive} has no row rule")
    self.primitive = primitive


class RowParams(NamedTuple):
  """How an equation runs on rows.

  Attributes:
    params: the equation's params for row operands (``None``: the equation is the identity
      on rows, e.g. a sharding constraint the row cannot keep).
    full_axes: per input given whole, the axis along which to slice it to the row (``None``:
      pass it whole).
    out_axes: per output, the position of its stacked axis.
  """

  params: dict | None
  full_axes: tuple[int | None, ...]
  out_axes: tuple[int, ...]


# A parameter rule: ``how(eqn, axes, length) -> RowParams``; ``axes[i]`` is the stacked axis of
# input ``i`` if it is a row, else ``None``. It raises ``NotRowwise`` when rows would mix.
ParamsRule = Callable[[jcore.JaxprEqn, Sequence[Any], int], RowParams]


def drop_axis(axes: Sequence[int], a: int) -> tuple[int, ...]:
  """Axis numbers of a value without its axis ``a``."""
  return tuple(x - (x > a) for x in axes if x != a)


def _shape(v) -> tuple[int, ...]:
  return tuple(getattr(v, "aval", v).shape)


def clear_params(params: dict, *keys: str) -> dict:
  return {**params, **{k: None for k in keys if params.get(k) is not None}}


def _elementwise(eqn, axes, length):
  row_axes = {a for a in axes if a is not None}
  if len(row_axes) != 1:
    raise NotRowwise(f"{eqn.primitive.name} of rows stacked on different axes")
  (a,) = row_axes
  full = []
  for v, ax in zip(eqn.invars, axes):
    shape = _shape(v)
    if ax is not None or not shape:
      full.append(None)
    elif len(shape) > a and shape[a] == length:
      full.append(a)
    else:
      raise NotRowwise(f"a value of shape {shape} meets a row of a stacked leaf of length "
                       f"{length}")
  return RowParams(clear_params(dict(eqn.params), "sharding"), tuple(full), (a,) * len(eqn.outvars))


def _unary(eqn, axes) -> int:
  if len(axes) != 1 or axes[0] is None:
    raise NotRowwise(f"{eqn.primitive.name} with extra operands")
  return axes[0]


def _broadcast_in_dim(eqn, axes, length):
  a = _unary(eqn, axes)
  dims, shape = eqn.params["broadcast_dimensions"], eqn.params["shape"]
  b = dims[a]
  if shape[b] != length:
    raise NotRowwise("broadcast_in_dim of the stacked axis")
  params = dict(eqn.params, shape=shape[:b] + shape[b + 1:],
                broadcast_dimensions=tuple(d - (d > b) for i, d in enumerate(dims) if i != a))
  return RowParams(clear_params(params, "sharding"), (None,), (b,))


def _reshape(eqn, axes, length):
  a = _unary(eqn, axes)
  in_shape, out_shape = _shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
  if eqn.params.get("dimensions") is not None:
    raise NotRowwise("reshape with a transposition")
  before = math.prod(in_shape[:a])
  for b in range(len(out_shape)):
    if math.prod(out_shape[:b]) == before and out_shape[b] == length:
      params = dict(eqn.params, new_sizes=out_shape[:b] + out_shape[b + 1:])
      return RowParams(clear_params(params, "sharding"), (None,), (b,))
  raise NotRowwise(f"reshape {in_shape} -> {out_shape} merges the stacked axis")


def _transpose(eqn, axes, length):
  del length
  a = _unary(eqn, axes)
  perm = eqn.params["permutation"]
  return RowParams(dict(eqn.params, permutation=tuple(p - (p > a) for p in perm if p != a)),
                   (None,), (perm.index(a),))


def _reduction(eqn, axes, length):
  del length
  a = _unary(eqn, axes)
  red = eqn.params["axes"]
  if a in red:
    raise NotRowwise(f"{eqn.primitive.name} over the stacked axis")
  params = clear_params(dict(eqn.params, axes=drop_axis(red, a)), "out_sharding")
  return RowParams(params, (None,), (a - sum(x < a for x in red),) * len(eqn.outvars))


def _squeeze(eqn, axes, length):
  del length
  a = _unary(eqn, axes)
  dims = eqn.params["dimensions"]
  if a in dims:
    raise NotRowwise("squeeze of the stacked axis")
  return RowParams(dict(eqn.params, dimensions=drop_axis(dims, a)), (None,),
                   (a - sum(d < a for d in dims),))


def _along(key: str) -> ParamsRule:
  """A rule for an equation that works along the axis ``params[key]`` and keeps the others
  (cumulative reductions, ``concatenate``, ``split``)."""
  def rule(eqn, axes, length):
    base = _elementwise(eqn, axes, length) if len(axes) > 1 else None
    a = base.out_axes[0] if base else _unary(eqn, axes)
    d = eqn.params[key]
    if d == a:
      raise NotRowwise(f"{eqn.primitive.name} along the stacked axis")
    full = base.full_axes if base else (None,)
    return RowParams(dict(eqn.params, **{key: d - (d > a)}), full, (a,) * len(eqn.outvars))

  return rule


def _slice(eqn, axes, length):
  a = _unary(eqn, axes)
  start, limit, strides = (eqn.params["start_indices"], eqn.params["limit_indices"],
                           eqn.params["strides"])
  if start[a] != 0 or limit[a] != length or (strides is not None and strides[a] != 1):
    raise NotRowwise("slice of the stacked axis")
  cut = lambda xs: None if xs is None else tuple(x for i, x in enumerate(xs) if i != a)
  return RowParams(dict(eqn.params, start_indices=cut(start), limit_indices=cut(limit),
                        strides=cut(strides)), (None,), (a,))


def _sharding_constraint(eqn, axes, length):
  del length
  a = _unary(eqn, axes)
  sharding = eqn.params["sharding"]
  spec = getattr(sharding, "spec", None)
  if spec is None or eqn.params.get("layout") is not None:
    return RowParams(None, (None,), (a,))  # a hint the row cannot keep: the identity
  row_spec = jax.sharding.PartitionSpec(*[s for i, s in enumerate(spec) if i != a])
  unconstrained = frozenset(drop_axis(sorted(eqn.params.get("unconstrained_dims", ())), a))
  params = dict(eqn.params, sharding=jax.sharding.NamedSharding(sharding.mesh, row_spec),
                unconstrained_dims=unconstrained)
  return RowParams(params, (None,), (a,))


def _reshard(eqn, axes, length):
  """A reshard (``jax.sharding.reshard``, as low-bit state's reshapes and table lookups emit
  under ``AxisType.Explicit``): the row takes the target sharding of its other axes."""
  del length
  a = _unary(eqn, axes)
  dst = eqn.params["dst_sharding"]
  rank = len(_shape(eqn.invars[0]))
  spec = (*dst.spec, *(None,) * (rank - len(dst.spec)))
  row = jax.sharding.NamedSharding(dst.mesh, jax.sharding.PartitionSpec(*spec[:a], *spec[a + 1:]),
                                   memory_kind=dst.memory_kind)
  return RowParams(dict(eqn.params, dst_sharding=row), (None,), (a,))


def _dot_general(eqn, axes, length):
  del length
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  al, ar = axes
  lhs_rank, rhs_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
  lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
  rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
  if al is not None and ar is not None:
    if al not in lb or ar not in rb or lb.index(al) != rb.index(ar):
      raise NotRowwise("dot_general contracting the stacked axis")
    k = lb.index(al)
    dims = ((drop_axis(lc, al), drop_axis(rc, ar)), (drop_axis(lb, al), drop_axis(rb, ar)))
    out = k
  elif al is not None:
    if al not in lhs_free:
      raise NotRowwise("dot_general contracting the stacked axis")
    dims, out = ((drop_axis(lc, al), rc), (drop_axis(lb, al), rb)), len(lb) + lhs_free.index(al)
  else:
    if ar not in rhs_free:
      raise NotRowwise("dot_general contracting the stacked axis")
    dims = ((lc, drop_axis(rc, ar)), (lb, drop_axis(rb, ar)))
    out = len(lb) + len(lhs_free) + rhs_free.index(ar)
  params = clear_params(dict(eqn.params, dimension_numbers=dims), "out_sharding")
  return RowParams(params, (None, None), (out,))


def _bitcast_convert_type(eqn, axes, length):
  """A bitcast keeps every axis; between dtypes of different widths it adds (to a narrower
  dtype) or consumes (to a wider one) a trailing axis, which must not be the stacked one."""
  del length
  a = _unary(eqn, axes)
  in_rank, out_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.outvars[0]))
  if out_rank < in_rank and a == in_rank - 1:
    raise NotRowwise("bitcast_convert_type merging the stacked axis into wider values")
  return RowParams(dict(eqn.params), (None,), (a,))


def _pad(eqn, axes, length):
  del length
  if axes[0] is None or axes[1] is not None:
    raise NotRowwise("pad with a stacked padding value")
  a = axes[0]
  config = eqn.params["padding_config"]
  if tuple(config[a]) != (0, 0, 0):
    raise NotRowwise("pad of the stacked axis")
  return RowParams(dict(eqn.params, padding_config=tuple(c for i, c in enumerate(config)
                                                          if i != a)), (None, None), (a,))


def _gather(eqn, axes, length):
  """A gather of row indices from a whole operand (a lookup table): its output's batch axes
  are the indices' axes, so the stacked axis of the indices is one of them."""
  del length
  a_operand, a = axes
  dims = eqn.params["dimension_numbers"]
  index_rank = len(_shape(eqn.invars[1]))
  if a_operand is not None or a is None or a == index_rank - 1 or dims.operand_batching_dims:
    raise NotRowwise("gather from a stacked operand, or along the index vector")
  out_rank = len(_shape(eqn.outvars[0]))
  out = [d for d in range(out_rank) if d not in dims.offset_dims][a]
  row_dims = dims._replace(offset_dims=tuple(d - (d > out) for d in dims.offset_dims))
  params = clear_params(dict(eqn.params, dimension_numbers=row_dims), "out_sharding")
  return RowParams(params, (None, None), (out,))


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
  """Row ``index`` along ``axis`` of a full value (rank-0 values stay whole)."""
  shape = jax.numpy.shape(x)
  if not shape:
    return x
  if len(shape) <= axis or shape[axis] != length:
    raise NotRowwise(f"a value of shape {shape} meets a row of a stacked leaf of length {length}")
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
  row = ins[0]
  if not (rows.partial and eqn.primitive in ROW_COMBINE and isinstance(row, _Row)
          and row.axis in eqn.params["axes"]):
    return _REDUCTION(rows, eqn, ins)
  params = clear_params(dict(eqn.params, axes=drop_axis(eqn.params["axes"], row.axis)),
                        "out_sharding")
  return [_Partial(eqn.primitive.bind(row.value, **params), eqn.primitive)]


def _call_rule(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """A call (``CALL_PRIMITIVES``): its body evaluated on the rows."""
  body = call_body(eqn)
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
  p = eqn.params
  nc, nk, body = p["num_consts"], p["num_carry"], p["jaxpr"]
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

  out_carry, ys = lax.scan(step, _unwrap(carry), _unwrap(xs), length=p["length"],
                           reverse=p["reverse"], unroll=p["unroll"])
  return [*_wrap_axes(out_carry, carry_axes),
          *_wrap_axes(ys, [None if a is None else a + 1 for a in y_axes])]


def _while_rule(rows: _RowEvaluator, eqn: jcore.JaxprEqn, ins: list) -> list:
  """A ``while_loop`` (a ``fori_loop`` with traced bounds) whose carry holds rows: its body runs
  on them, and its predicate must be the same for every row."""
  rows.axes(eqn, ins)
  p = eqn.params
  nc, nb, cond, body = p["cond_nconsts"], p["body_nconsts"], p["cond_jaxpr"], p["body_jaxpr"]
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
  branches = eqn.params["branches"]
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


_ELEMENTWISE = (
    "abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp clz "
    "complex conj convert_element_type copy cos cosh digamma div eq erf erf_inv erfc exp exp2 "
    "expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p logistic lt "
    "max min mul ne neg nextafter not or polygamma population_count pow real reduce_precision rem "
    "round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt "
    "square stop_gradient sub tan tanh xor zeta").split()
_REDUCTIONS = ("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor "
               "argmax argmin").split()
_REDUCTION = ParamsRowRule(_reduction)

ROW_RULES: dict[jcore.Primitive, RowRule] = {
    **{getattr(P, f"{name}_p"): ParamsRowRule(_elementwise)
       for name in _ELEMENTWISE if hasattr(P, f"{name}_p")},
    **{getattr(P, f"{name}_p"): _reduction_rule for name in _REDUCTIONS},
    **{getattr(P, f"{name}_p"): ParamsRowRule(_along("axis"))
       for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    P.broadcast_in_dim_p: ParamsRowRule(_broadcast_in_dim),
    P.reshape_p: ParamsRowRule(_reshape),
    P.transpose_p: ParamsRowRule(_transpose),
    P.squeeze_p: ParamsRowRule(_squeeze),
    P.slice_p: ParamsRowRule(_slice),
    P.concatenate_p: ParamsRowRule(_along("dimension")),
    P.dot_general_p: ParamsRowRule(_dot_general),
    P.sharding_constraint_p: ParamsRowRule(_sharding_constraint),
    RESHARD_P: ParamsRowRule(_reshard),
    P.bitcast_convert_type_p: ParamsRowRule(_bitcast_convert_type),
    P.pad_p: ParamsRowRule(_pad),
    P.gather_p: ParamsRowRule(_gather),
    **dict.fromkeys(CALL_PRIMITIVES, _call_rule),
    P.scan_p: _scan_rule,
    P.while_p: _while_rule,
    P.cond_p: _cond_rule,
}

# Equations that keep each row of their one operand a row of their output: the operations that
# may stand between a stored stacked param and the scan that reads it (``apply_path``).
PATH_PRIMITIVES = frozenset([
    P.convert_element_type_p, P.copy_p, P.reduce_precision_p, P.transpose_p, P.reshape_p,
    P.squeeze_p, P.broadcast_in_dim_p, P.sharding_constraint_p,
])


def row_params(eqn: jcore.JaxprEqn, axes: Sequence[int | None], length: int) -> RowParams:
  """How ``eqn``, whose primitive's row rule rewrites params (``ParamsRowRule``), runs when the
  inputs with an axis in ``axes`` are rows.

  Raises:
    NotRowwise: the equation combines different rows.
    NoRowRule: its primitive has no parameter rule.
  """
  rule = ROW_RULES.get(eqn.primitive)
  if not isinstance(rule, ParamsRowRule):
    raise NoRowRule(eqn.primitive.name)
  return rule.how(eqn, list(axes), length)


class _RowEvaluator(Interpreter):
  """Evaluates a jaxpr whose values are ``_Row``s, ``_Partial``s (with ``partial``: a reduction
  over the stacked axis) or full values: an equation that reads a row or a partial value through
  its primitive's row rule (``ROW_RULES``), one on full values bound as it is.

  Attributes:
    index: the row index (a traced integer is fine).
    length: the number of rows.
    partial: whether a reduction over the stacked axis is kept as its value on the row.
  """

  def __init__(self, index, length: int, partial: bool):
    super().__init__()
    self.index, self.length, self.partial = index, length, partial

  def default(self, eqn, ins):
    if not any(isinstance(x, (_Row, _Partial)) for x in ins):
      return bind_shared(eqn, ins)
    rule = ROW_RULES.get(eqn.primitive)
    if rule is None:
      raise NoRowRule(eqn.primitive.name)
    return rule(self, eqn, ins)

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
    if how.params is None:
      outs = vals[:1]
    else:
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*vals, **how.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
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
  rows, x = _RowEvaluator(index, length, partial=False), _Row(row, axis)
  for eqn in path:
    (x,) = rows.default(eqn, [x])
  return x.value
