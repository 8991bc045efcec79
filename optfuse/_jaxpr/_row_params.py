"""The parameter rules of row evaluation: how an equation's params change when some of its
operands are rows of stacked values.

A scanned model stores its layers stacked along a *stacked axis*; inside a loop only one row of
a stacked value exists at a time (``_rows``, the evaluator). Most primitives run on rows as they
are, with their shape parameters rewritten: ``broadcast_in_dim`` shapes, reduction axes,
``dot_general`` dimensions, a sharding's spec without the stacked axis. A parameter rule is a
pure function of the equation, the stacked axis of each operand and the number of rows: it
returns the params for rows, how to slice an operand given whole, and where the stacked axis of
each output is (``RowParams``), or raises ``NotRowwise`` when the equation would combine
different rows. ``PARAMS_RULES`` is their table, keyed by primitive object; ``path_axis`` follows
a stored leaf's stacked axis through the row-preserving equations between it and its scan.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from optfuse._jaxpr._interpreter import RANDOM_UNWRAP_P, RANDOM_WRAP_P, RESHARD_P, primitive_of


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


# Set to ``1`` (the tests' ``conftest.py`` does), a row rule's own error propagates instead of
# becoming a ``RowRuleError``, so that a test sees it.
RAISE_RULE_ERRORS = "OPTFUSE_RAISE_ROW_RULE_ERRORS"


class RowRuleError(NotRowwise):
  """A row rule raised an error of its own (a bug in optfuse, or a form of equation it does not
  know): the leaf is refused, so it is updated whole after the loop, exactly, and ``describe``
  names the error.

  Attributes:
    primitive: the primitive's name.
    error: the error the rule raised.
  """

  def __init__(self, primitive: str, error: Exception):
    super().__init__(f"the row rule of {primitive} raised {type(error).__name__}: {error}")
    self.primitive, self.error = primitive, error


def run_rule(eqn: jcore.JaxprEqn, rule: Callable[..., Any], *args) -> Any:
  """``rule(*args)``, a row rule of ``eqn``'s primitive; an error other than ``NotRowwise``
  comes out as a ``RowRuleError`` (as itself when ``RAISE_RULE_ERRORS`` is set).

  Raises:
    NotRowwise: the rule's own, or a ``RowRuleError``.
  """
  try:
    return rule(*args)
  except NotRowwise:
    raise
  except Exception as e:
    if os.environ.get(RAISE_RULE_ERRORS) == "1":
      raise
    raise RowRuleError(eqn.primitive.name, e) from e


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
    elif len(shape) > a and shape[a] in (length, 1):  # a size-1 axis broadcasts (take_row)
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


def _matrices(eqn, axes, length):
  """A linear-algebra primitive on a stack of matrices (``svd``, ``eigh``, ``qr``...): it works
  on the last two axes of its operand, every leading axis a batch axis that each output keeps in
  front, as ``jax.vmap`` of it makes (``optfuse.per_layer`` of GaLore's SVD)."""
  del length
  a = _unary(eqn, axes)
  if a >= len(_shape(eqn.invars[0])) - 2:
    raise NotRowwise(f"{eqn.primitive.name} of matrices along the stacked axis")
  return RowParams(dict(eqn.params), (None,), (a,) * len(eqn.outvars))


def _key_array(last: int) -> ParamsRule:
  """A rule for a primitive on arrays of random keys (``random_bits``, ``random_split``,
  ``random_wrap``, ``random_unwrap``, ``random_seed``): each key's output is its own, along the
  key array's axes, then ``last`` trailing axes of the operand that are not keys (the two words
  of a raw threefry key), which the stacked axis must not be."""
  def rule(eqn, axes, length):
    del length
    a = _unary(eqn, axes)
    if a >= len(_shape(eqn.invars[0])) - last:
      raise NotRowwise(f"{eqn.primitive.name} of a key's words along the stacked axis")
    return RowParams(dict(eqn.params), (None,), (a,))

  return rule


ELEMENTWISE: tuple[jcore.Primitive, ...] = (
    P.abs_p, P.acos_p, P.acosh_p, P.add_p, P.and_p, P.asin_p, P.asinh_p, P.atan_p, P.atan2_p,
    P.atanh_p, P.bessel_i0e_p, P.bessel_i1e_p, P.cbrt_p, P.ceil_p, P.clamp_p, P.clz_p, P.complex_p,
    P.conj_p, P.convert_element_type_p, P.copy_p, P.cos_p, P.cosh_p, P.digamma_p, P.div_p, P.eq_p,
    P.erf_p, P.erf_inv_p, P.erfc_p, P.exp_p, P.exp2_p, P.expm1_p, P.floor_p, P.ge_p, P.gt_p,
    P.igamma_p, P.igammac_p, P.imag_p, P.integer_pow_p, P.is_finite_p, P.le_p, P.lgamma_p, P.log_p,
    P.log1p_p, P.logistic_p, P.lt_p, P.max_p, P.min_p, P.mul_p, P.ne_p, P.neg_p, P.nextafter_p,
    P.not_p, P.or_p, P.polygamma_p, P.population_count_p, P.pow_p, P.real_p, P.reduce_precision_p,
    P.rem_p, P.round_p, P.rsqrt_p, P.select_n_p, P.shift_left_p, P.shift_right_arithmetic_p,
    P.shift_right_logical_p, P.sign_p, P.sin_p, P.sinh_p, P.sqrt_p, P.square_p, P.stop_gradient_p,
    P.sub_p, P.tan_p, P.tanh_p, P.xor_p, P.zeta_p,
)
# Linear algebra on the last two axes of one operand, the leading axes batch axes of every output.
MATRICES: tuple[jcore.Primitive, ...] = (P.svd_p, P.eigh_p, P.qr_p, P.cholesky_p, P.lu_p)
REDUCTIONS: tuple[jcore.Primitive, ...] = (
    P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p, P.reduce_and_p,
    P.reduce_or_p, P.reduce_xor_p, P.argmax_p, P.argmin_p,
)

# The parameter rule of each primitive that has one. Every primitive named here exists in every
# JAX release optfuse supports (``jax.extend.core.primitives`` of 0.10 and 0.11); one that a
# release lacks would be an explicit ``getattr`` with the release named, never a silent skip.
PARAMS_RULES: dict[jcore.Primitive, ParamsRule] = {
    **dict.fromkeys(ELEMENTWISE, _elementwise),
    **dict.fromkeys(REDUCTIONS, _reduction),
    **dict.fromkeys(MATRICES, _matrices),
    **dict.fromkeys((P.cumsum_p, P.cumprod_p, P.cummax_p, P.cummin_p, P.cumlogsumexp_p),
                    _along("axis")),
    P.broadcast_in_dim_p: _broadcast_in_dim,
    P.reshape_p: _reshape,
    P.transpose_p: _transpose,
    P.squeeze_p: _squeeze,
    P.slice_p: _slice,
    P.concatenate_p: _along("dimension"),
    P.dot_general_p: _dot_general,
    P.sharding_constraint_p: _sharding_constraint,
    RESHARD_P: _reshard,
    P.bitcast_convert_type_p: _bitcast_convert_type,
    P.pad_p: _pad,
    P.gather_p: _gather,
    P.threefry2x32_p: _elementwise,
    **dict.fromkeys((P.random_bits_p, P.random_split_p, RANDOM_UNWRAP_P, P.random_seed_p),
                    _key_array(0)),
    RANDOM_WRAP_P: _key_array(1),
}

# Equations that keep each row of their one operand a row of their output: the operations that
# may stand between a stored stacked param and the scan that reads it (``_rows.apply_path``).
PATH_PRIMITIVES = frozenset([
    P.convert_element_type_p, P.copy_p, P.reduce_precision_p, P.transpose_p, P.reshape_p,
    P.squeeze_p, P.broadcast_in_dim_p, P.sharding_constraint_p,
])


def row_params(eqn: jcore.JaxprEqn, axes: Sequence[int | None], length: int) -> RowParams:
  """How ``eqn``, whose primitive has a parameter rule (``PARAMS_RULES``), runs when the inputs
  with an axis in ``axes`` are rows.

  Raises:
    NotRowwise: the equation combines different rows (``RowRuleError``: its rule failed).
    NoRowRule: its primitive has no parameter rule.
  """
  how = PARAMS_RULES.get(primitive_of(eqn))
  if how is None:
    raise NoRowRule(eqn.primitive.name)
  return run_rule(eqn, how, eqn, list(axes), length)


def path_axis(path: Sequence[jcore.JaxprEqn], axis: int, length: int) -> int:
  """Where the stacked axis ``axis`` of a stored leaf is after the equations of ``path``.

  Raises:
    NotRowwise: an equation of the path mixes rows.
  """
  for eqn in path:
    (axis,) = row_params(eqn, [axis], length).out_axes
  return axis
