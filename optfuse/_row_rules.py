"""Row rules: how one equation runs on rows of a stacked value, keyed by primitive.

A row is the slice of a stacked value at one index along its stacked axis (see ``_rows``). A
rule rewrites an equation's shape parameters for row operands (``broadcast_in_dim`` shapes,
reduction axes, ``dot_general`` dimensions...), says along which axis to slice the operands
given whole, and where the stacked axis of each output is; it raises ``NotRowwise`` when the
equation would combine different rows. Adding a primitive is one entry of ``ROW_RULES``.
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


class NotRowwise(Exception):
  """The computation combines different rows of a stacked leaf."""


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


# A row rule: ``rule(eqn, axes, length) -> RowParams``; ``axes[i]`` is the stacked axis of
# input ``i`` if it is a row, else ``None``. It raises ``NotRowwise`` when rows would mix.
RowRule = Callable[[jcore.JaxprEqn, Sequence[Any], int], RowParams]


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


def _along(key: str) -> RowRule:
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


_ELEMENTWISE = (
    "abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp clz "
    "complex conj convert_element_type copy cos cosh digamma div eq erf erf_inv erfc exp exp2 "
    "expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p logistic lt "
    "max min mul ne neg nextafter not or polygamma population_count pow real reduce_precision rem "
    "round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt "
    "square stop_gradient sub tan tanh xor zeta").split()
_REDUCTIONS = ("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor "
               "argmax argmin").split()

ROW_RULES: dict[jcore.Primitive, RowRule] = {
    **{getattr(P, f"{name}_p"): _elementwise for name in _ELEMENTWISE if hasattr(P, f"{name}_p")},
    **{getattr(P, f"{name}_p"): _reduction for name in _REDUCTIONS},
    **{getattr(P, f"{name}_p"): _along("axis")
       for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    P.broadcast_in_dim_p: _broadcast_in_dim,
    P.reshape_p: _reshape,
    P.transpose_p: _transpose,
    P.squeeze_p: _squeeze,
    P.slice_p: _slice,
    P.concatenate_p: _along("dimension"),
    P.dot_general_p: _dot_general,
    P.sharding_constraint_p: _sharding_constraint,
}

# Equations that keep each row of their one operand a row of their output: the operations that
# may stand between a stored stacked param and the scan that reads it (``apply_path``).
PATH_PRIMITIVES = frozenset([
    P.convert_element_type_p, P.copy_p, P.reduce_precision_p, P.transpose_p, P.reshape_p,
    P.squeeze_p, P.broadcast_in_dim_p, P.sharding_constraint_p,
])

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


def row_params(eqn: jcore.JaxprEqn, axes: Sequence[int | None], length: int) -> RowParams:
  """How ``eqn`` runs when the inputs with an axis in ``axes`` are rows.

  Raises:
    NotRowwise: the equation combines different rows, or has no row rule.
  """
  rule = ROW_RULES.get(eqn.primitive)
  if rule is None:
    raise NotRowwise(f"{eqn.primitive.name} has no row rule")
  return rule(eqn, list(axes), length)
