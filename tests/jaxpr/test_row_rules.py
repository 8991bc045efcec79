"""Every row rule on its own: a row evaluated alone equals the same row of the full evaluation.

For each primitive of ``_rows.ROW_RULES`` a small function binds it on values stacked along
axis 0 or axis 1 (``L`` rows); ``_rows.evaluate_rows`` evaluates that function's jaxpr on each
row, and the result must equal the row of the whole evaluation, exactly (a row rule reorders no
arithmetic). Higher-order primitives (loops, ``cond``, calls) run their bodies on the rows.
Cases that would mix rows must raise ``NotRowwise``, a primitive without a rule ``NoRowRule``;
and every primitive in the updates of the optimizers the tests use, bodies included, has a rule.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as prims
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._jaxpr import _rows
from tests.engines import test_backward_equivalence
from tests.fusion.test_loops import _batch, _init, scan_loss
from tests.low_bit import test_low_bit_fusion

L = 4
_MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
_EXPLICIT = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                          devices=jax.devices()[:1])

# name -> (function of stacked inputs, input shapes and dtypes, stacked axis of the inputs).
# Shapes are given for stacked axis 0; axis-1 cases move the axis (see ``_inputs``).
F32 = jnp.float32
I32 = jnp.int32
U32 = jnp.uint32
UNARY = ("abs acos acosh asin asinh atan atanh cbrt ceil cos cosh exp exp2 expm1 floor log log1p "
         "logistic neg rsqrt sign sin sinh sqrt square tan tanh erf erfc lgamma digamma "
         "bessel_i0e bessel_i1e is_finite").split()
BINARY = "add sub mul div max min pow atan2 rem nextafter eq ne lt le gt ge igamma igammac".split()


def _unary(name):
  fn = getattr(lax, name)
  # Domains: acosh wants >= 1, acos/asin/atanh/erf_inv (-1, 1); the inputs are in (1.1, 1.9)
  # for acosh and (0.1, 0.9) otherwise.
  return (lambda x: fn(x + 1.0)) if name == "acosh" else fn


def _spd(x):
  """A symmetric positive definite matrix from each (3, 5) matrix of a stack."""
  gram = jnp.einsum("...ij,...kj->...ik", x, x)
  return gram + 3.0 * jnp.broadcast_to(jnp.eye(x.shape[-2]), gram.shape)


CASES: dict[str, tuple] = {
    **{name: (_unary(name), [((L, 3, 5), F32)]) for name in UNARY},
    **{name: (getattr(lax, name), [((L, 3, 5), F32), ((L, 3, 5), F32)]) for name in BINARY},
    "erf_inv": (lax.erf_inv, [((L, 3, 5), F32)]),
    "round": (lambda x: lax.round(x * 10), [((L, 3, 5), F32)]),
    "polygamma": (lambda x: lax.polygamma(jnp.ones_like(x), x), [((L, 3, 5), F32)]),
    "zeta": (lambda x: lax.zeta(x + 2.0, x), [((L, 3, 5), F32)]),
    "integer_pow": (lambda x: lax.integer_pow(x, 3), [((L, 3, 5), F32)]),
    "convert_element_type": (lambda x: x.astype(jnp.bfloat16), [((L, 3, 5), F32)]),
    "reduce_precision": (lambda x: lax.reduce_precision(x, 5, 10), [((L, 3, 5), F32)]),
    "copy": (lambda x: jnp.array(x, copy=True), [((L, 3, 5), F32)]),
    "clamp": (lambda x: lax.clamp(0.3, x, 0.7), [((L, 3, 5), F32)]),
    "select_n": (lambda x, y: lax.select(x > 0.5, x, y), [((L, 3, 5), F32), ((L, 3, 5), F32)]),
    "complex": (lambda x, y: jnp.abs(lax.complex(x, y)), [((L, 3, 5), F32), ((L, 3, 5), F32)]),
    "real": (lambda x, y: lax.real(lax.complex(x, y)), [((L, 3, 5), F32), ((L, 3, 5), F32)]),
    "imag": (lambda x, y: lax.imag(lax.complex(x, y)), [((L, 3, 5), F32), ((L, 3, 5), F32)]),
    "conj": (lambda x, y: lax.real(lax.conj(lax.complex(x, y))),
             [((L, 3, 5), F32), ((L, 3, 5), F32)]),
    "and": (lax.bitwise_and, [((L, 3, 5), I32), ((L, 3, 5), I32)]),
    "or": (lax.bitwise_or, [((L, 3, 5), I32), ((L, 3, 5), I32)]),
    "xor": (lax.bitwise_xor, [((L, 3, 5), I32), ((L, 3, 5), I32)]),
    "not": (lax.bitwise_not, [((L, 3, 5), I32)]),
    "clz": (lax.clz, [((L, 3, 5), I32)]),
    "population_count": (lax.population_count, [((L, 3, 5), I32)]),
    "shift_left": (lambda x: lax.shift_left(x, jnp.full_like(x, 2)), [((L, 3, 5), U32)]),
    "shift_right_logical": (lambda x: lax.shift_right_logical(x, jnp.full_like(x, 2)),
                            [((L, 3, 5), U32)]),
    "shift_right_arithmetic": (lambda x: lax.shift_right_arithmetic(x, jnp.full_like(x, 2)),
                               [((L, 3, 5), I32)]),
    # An operand not batched by ``vmap`` keeps a size-1 axis that lax broadcasts against the
    # stacked one (``optfuse.per_layer`` of low-bit state's bit shifts).
    "shift_right_logical of a size-1 operand": (jax.vmap(
        lambda x: jnp.right_shift(x, jnp.full((3, 5), 2, U32))), [((L, 3, 5), U32)]),
    "add of a size-1 operand": (lambda x: lax.add(x, jnp.full((1, 3, 5), 0.5)),
                                [((L, 3, 5), F32)]),
    "stop_gradient": (lax.stop_gradient, [((L, 3, 5), F32)]),
    "broadcast_in_dim": (lambda x: lax.broadcast_in_dim(x, (L, 2, 3, 5), (0, 2, 3)),
                         [((L, 3, 5), F32)]),
    "reshape": (lambda x: x.reshape(L, 15), [((L, 3, 5), F32)]),
    "transpose": (lambda x: x.transpose(0, 2, 1), [((L, 3, 5), F32)]),
    "squeeze": (lambda x: lax.squeeze(x, (1,)), [((L, 1, 5), F32)]),
    "slice": (lambda x: x[:, 1:3, ::2], [((L, 3, 5), F32)]),
    "concatenate": (lambda x, y: jnp.concatenate([x, y], axis=2),
                    [((L, 3, 5), F32), ((L, 3, 5), F32)]),
    "dot_general": (lambda x, y: jnp.einsum("lij,ljk->lik", x, y),
                    [((L, 3, 5), F32), ((L, 5, 2), F32)]),
    "sharding_constraint": (lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(_MESH, P(None, "x"))), [((L, 3, 5), F32)]),
    # As low-bit state's reshapes and lookups emit under ``AxisType.Explicit``.
    "reshard": (lambda x: jax.sharding.reshard(x, NamedSharding(_EXPLICIT, P(None, "x"))),
                [((L, 3, 5), F32)]),
    **{name: (lambda x, name=name: getattr(lax, f"{name}")(x, axis=2), [((L, 3, 5), F32)])
       for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    **{f"reduce_{name}": (lambda x, name=name: getattr(jnp, name)(x, axis=(1, 2)),
                          [((L, 3, 5), F32)]) for name in ("sum", "max", "min", "prod")},
    "argmax": (lambda x: jnp.argmax(x, axis=2), [((L, 3, 5), F32)]),
    "argmin": (lambda x: jnp.argmin(x, axis=2), [((L, 3, 5), F32)]),
    "reduce_and": (lambda x: jnp.all(x > 0.5, axis=2), [((L, 3, 5), F32)]),
    "reduce_or": (lambda x: jnp.any(x > 0.5, axis=2), [((L, 3, 5), F32)]),
    "reduce_xor": (lambda x: lax.reduce_xor_p.bind(x, axes=(2,)),
                   [((L, 3, 5), I32)]),
    # The low-bit state's quantizer: codes bitcast into float32 words and back, a slot padded
    # to whole blocks, values looked up in a constant table (with and without offset dims).
    "bitcast_convert_type": (lambda x: lax.bitcast_convert_type(
        lax.bitcast_convert_type(x, jnp.uint32), jnp.float32), [((L, 3, 5), F32)]),
    "bitcast_convert_type narrowing": (lambda x: lax.bitcast_convert_type(
        x, jnp.uint8).astype(jnp.float32), [((L, 3, 5), F32)]),
    "pad": (lambda x: lax.pad(x, 0.0, [(0, 0, 0), (1, 2, 0), (0, 3, 1)]), [((L, 3, 5), F32)]),
    "gather": (lambda i: jnp.take(jnp.arange(10.0) * 0.5, i % 10), [((L, 3, 5), I32)]),
    "gather of rows": (lambda i: jnp.take(jnp.arange(20.0).reshape(10, 2), i % 10, axis=0),
                       [((L, 3, 5), I32)]),
    # Linear algebra on each matrix of a stack (``optfuse.per_layer`` of GaLore's SVD).
    "svd": (jnp.linalg.svd, [((L, 3, 5), F32)]),
    "eigh": (lambda x: jnp.linalg.eigh(_spd(x)), [((L, 3, 5), F32)]),
    "qr": (jnp.linalg.qr, [((L, 3, 5), F32)]),
    "cholesky": (lambda x: jnp.linalg.cholesky(_spd(x)), [((L, 3, 5), F32)]),
    "lu": (lambda x: lax.linalg.lu(x[..., :3]), [((L, 3, 5), F32)]),
    # A full operand of size 1 along the stacked axis, broadcast (as jax.random.uniform's bounds).
    "broadcast of size 1": (lambda x: lax.max(jnp.full((1, 1, 1), 0.5), x), [((L, 3, 5), F32)]),
    # One key per row (raw key data, as optax state holds keys): each key's draw is its own.
    "random_wrap, random_bits": (lambda k: jax.vmap(lambda k: jax.random.bits(
        jax.random.wrap_key_data(k), (3, 5)))(k), [((L, 2), U32)]),
    "random_split, random_unwrap": (lambda k: jax.vmap(lambda k: jax.random.key_data(
        jax.random.split(jax.random.wrap_key_data(k), 3)))(k), [((L, 2), U32)]),
    "random_seed": (lambda s: jax.vmap(jax.vmap(
        lambda s: jax.random.key_data(jax.random.key(s))))(s), [((L, 3), I32)]),
    "threefry2x32": (lambda a, b, c, d: jax.extend.random.threefry2x32_p.bind(a, b, c, d),
                     [((L, 3, 5), U32)] * 4),
}


def _per_matrix_step(c, k):
  """A Newton-Schulz-like step on a stack of matrices: batched products, as Muon's vmap makes."""
  a = jnp.einsum("lij,lkj->lik", c, c)
  return k * c + jnp.einsum("lij,ljk->lik", a, c)


@jax.custom_vjp
def _custom_vjp_sin(x):
  return jnp.sin(x)


_custom_vjp_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x),))


# Higher-order primitives: their bodies run on the rows.
CASES.update({
    "scan": (lambda x: lax.scan(lambda c, k: (_per_matrix_step(c, k), None), x,
                                jnp.array([0.5, 0.25, 0.125]))[0], [((L, 3, 5), F32)]),
    "scan over another axis": (lambda x: jnp.moveaxis(lax.scan(
        lambda c, xi: (c + xi, c * xi), jnp.zeros((L, 5)), jnp.moveaxis(x, 1, 0))[1], 1, 0),
                               [((L, 3, 5), F32)]),
    "scan whose full carry becomes a row": (lambda x: lax.fori_loop(
        0, 3, lambda i, c: 0.5 * c + x, jnp.zeros_like(x)), [((L, 3, 5), F32)]),
    "while": (lambda x: lax.while_loop(lambda c: c[0] < 3,
                                       lambda c: (c[0] + 1, 0.5 * c[1] + jnp.sin(c[1])),
                                       (0, x))[1], [((L, 3, 5), F32)]),
    "cond on a shared predicate": (lambda x: lax.fori_loop(
        0, 2, lambda i, c: lax.cond(i == 0, jnp.sin, lambda c: _per_matrix_step(c, 0.5), c), x,
        unroll=True), [((L, 3, 5), F32)]),
    "cond on a per-row predicate": (lambda x: jax.vmap(
        lambda r: lax.cond(jnp.sum(r) > 7.5, jnp.sin, jnp.cos, r))(x), [((L, 3, 5), F32)]),
    "jit": (lambda x: jax.jit(lambda y: jnp.sum(y * y, axis=(1, 2)))(x), [((L, 3, 5), F32)]),
    "remat": (lambda x: jax.checkpoint(jnp.sin)(x), [((L, 3, 5), F32)]),
    "custom_jvp_call": (jax.nn.relu, [((L, 3, 5), F32)]),
    "custom_vjp_call": (_custom_vjp_sin, [((L, 3, 5), F32)]),
})


def _inputs(specs, axis: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  xs = []
  for shape, dtype in specs:
    if jnp.issubdtype(dtype, jnp.integer):
      x = rng.integers(1, 1000, shape).astype(dtype)
    else:
      x = rng.uniform(0.1, 0.9, shape).astype(dtype)
    xs.append(jnp.moveaxis(jnp.asarray(x), 0, axis))
  return xs


def _stacked_along(fn, axis: int):
  """``fn`` on inputs stacked along ``axis``, its outputs stacked along ``axis`` too (the row
  rules then meet the stacked axis in the middle of every shape, as MaxText's stacks put it)."""
  def stacked(*xs):
    outs = fn(*(jnp.moveaxis(x, axis, 0) for x in xs))
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, axis), outs)
  return stacked


def _check_rows_equal_full(fn, specs, axis: int):
  xs = _inputs(specs, axis)
  stacked = _stacked_along(fn, axis)
  closed = jax.make_jaxpr(stacked)(*xs)
  full = jax.tree.leaves(stacked(*xs))
  for index in range(L):
    rows = [lax.index_in_dim(x, index, axis, keepdims=False) for x in xs]
    got = _rows.evaluate_rows(closed.jaxpr, closed.consts, rows, [True] * len(rows), index, L,
                              axis=axis)
    want = [lax.index_in_dim(y, index, axis, keepdims=False) for y in full]
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _out_rank(name) -> int:
  fn, specs = CASES[name]
  outs = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(s, d) for s, d in specs))
  return min(len(o.shape) for o in jax.tree.leaves(outs))


# Axis 1 for every case whose outputs have a second axis to stack along (reductions to one
# value per row have none).
AXIS_CASES = [(name, 0) for name in sorted(CASES)] + [
    (name, 1) for name in sorted(CASES) if _out_rank(name) > 1]


@pytest.mark.parametrize("name,axis", AXIS_CASES)
def test_a_row_evaluated_alone_equals_the_row_of_the_full_evaluation(name, axis):
  fn, specs = CASES[name]
  _check_rows_equal_full(fn, specs, axis)


def _primitives(jaxpr: jcore.Jaxpr, found: set | None = None) -> set:
  """Every primitive of ``jaxpr`` and of its sub-jaxprs (call bodies, loop bodies, branches)."""
  found = set() if found is None else found
  for eqn in jaxpr.eqns:
    found.add(eqn.primitive)
    for sub in jcore.jaxprs_in_params(eqn.params):
      _primitives(sub, found)
  return found


def test_every_row_rule_has_a_case():
  bound = set()
  for fn, specs in CASES.values():
    _primitives(jax.make_jaxpr(fn)(*_inputs(specs, 0)).jaxpr, bound)
  # ``call_p`` and ``closed_call_p`` are bound by no public API; they share ``jit``'s rule.
  internal = {prims.call_p, prims.closed_call_p}
  missing = {p.name for p in _rows.ROW_RULES if p not in internal} - {p.name for p in bound}
  assert not missing, missing


MIXING = {
    "reduction over the stacked axis": (lambda x: jnp.sum(x, axis=0, keepdims=True) * x,
                                        [((L, 3, 5), F32)]),
    "cumsum along the stacked axis": (lambda x: jnp.cumsum(x, axis=0), [((L, 3, 5), F32)]),
    "reshape merging the stacked axis": (lambda x: x.reshape(L * 3, 5)[:L].reshape(L, 5),
                                         [((L, 3, 5), F32)]),
    "dot_general contracting it": (lambda x: jnp.einsum("lij,lik->jk", x, x)[:3][None] * x,
                                   [((L, 3, 5), F32)]),
    "scan along the stacked axis": (lambda x: lax.scan(lambda c, xi: (c + xi, c), x[0], x)[1],
                                    [((L, 3, 5), F32)]),
    "a loop whose carry mixes rows": (lambda x: lax.fori_loop(
        0, 2, lambda i, c: c + jnp.sum(c, axis=0), x), [((L, 3, 5), F32)]),
    "pad of the stacked axis": (lambda x: lax.pad(x, 0.0, [(1, 0, 0), (0, 0, 0), (0, 0, 0)])[1:],
                                [((L, 3, 5), F32)]),
    "gather from a stacked operand": (lambda x: jnp.take(x, jnp.array([1, 0, 2, 3]), axis=0),
                                      [((L, 3, 5), F32)]),
    "svd of matrices along the stacked axis": (lambda x: jnp.linalg.svd(jnp.swapaxes(x, 0, 1)),
                                               [((L, 3, 5), F32)]),
}


@pytest.mark.parametrize("case", sorted(MIXING))
def test_an_equation_that_mixes_rows_raises_not_rowwise(case):
  fn, specs = MIXING[case]
  xs = _inputs(specs, 0)
  closed = jax.make_jaxpr(fn)(*xs)
  row = lax.index_in_dim(xs[0], 0, 0, keepdims=False)
  with pytest.raises(_rows.NotRowwise):
    _rows.evaluate_rows(closed.jaxpr, closed.consts, [row], [True], 0, L)


_UNKNOWN = jcore.Primitive("optfuse_test_no_rule")
_UNKNOWN.def_abstract_eval(lambda x: x)


def test_a_primitive_without_a_row_rule_raises_no_row_rule_naming_it():
  closed = jax.make_jaxpr(lambda x: jnp.sin(_UNKNOWN.bind(x)))(jnp.ones((L, 3)))
  with pytest.raises(_rows.NoRowRule, match="optfuse_test_no_rule") as raised:
    _rows.evaluate_rows(closed.jaxpr, closed.consts, [jnp.ones(3)], [True], 0, L)
  assert raised.value.primitive == "optfuse_test_no_rule"


# The optimizers the tests train, and Muon with the stacked axis a batch axis of its matrices.
UPDATES = {**test_backward_equivalence.OPTIMIZERS,
           **{f"low_bit_{k}": functools.partial(test_low_bit_fusion.low_bit_tx, k)
              for k in test_low_bit_fusion.INNER},
           "muon_stacked": lambda: optax.contrib.muon(
               1e-2, muon_weight_dimension_numbers=lambda p: jax.tree.map(
                   lambda x: optax.contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1)
                   if x.ndim == 3 else None, p))}


@pytest.mark.parametrize("name", sorted(UPDATES))
def test_every_primitive_of_an_update_has_a_row_rule_or_describe_names_it(name):
  """Every primitive of the update, inside loop bodies, branches and calls too: one without a
  row rule that reads a stacked leaf's row keeps that leaf out of its loop with its own reason."""
  tx, params = UPDATES[name](), _init(jax.random.PRNGKey(0))
  closed = jax.make_jaxpr(tx.update)(params, tx.init(params), params)
  without = {p.name for p in _primitives(closed.jaxpr) if p not in _rows.ROW_RULES}
  reasons = optfuse.describe(tx, scan_loss, params, *_batch()).reasons
  assert without == {p for p in without if any(p in why for why in reasons.values())}, reasons
