"""A draw of random numbers of a stacked shape, evaluated on one row, makes that row's numbers
alone, and they are the numbers of that row of the whole draw.

``jax.random`` draws from one key (``random_bits`` inside its jitted functions); under
``jax_threefry_partitionable`` (JAX's default) each element's bits hash its own counter, so
``_rows.SOURCE_RULES`` draws a row from the row's counters. Without the flag, or with another
key implementation, the leaf is refused with a reason that says what to do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

from optfuse._jaxpr import _draws, _rows

L = 6
KEY = jax.random.key(7)

DRAWS = {
    "bits8": lambda k, s: jax.random.bits(k, s, jnp.uint8).astype(jnp.float32),
    "bits16": lambda k, s: jax.random.bits(k, s, jnp.uint16).astype(jnp.float32),
    "bits32": lambda k, s: (jax.random.bits(k, s) >> 8).astype(jnp.float32),
    "uniform": jax.random.uniform,
    "normal": jax.random.normal,
    "bernoulli": lambda k, s: jax.random.bernoulli(k, 0.3, s).astype(jnp.float32),
    # The draw inside the other calls of ``CALL_PRIMITIVES``.
    "normal under jax.checkpoint": lambda k, s: jax.checkpoint(
        lambda k: jax.random.normal(k, s))(k),
    "normal in a custom_jvp": lambda k, s: _custom(jax.custom_jvp, s)(k),
    "normal in a custom_vjp": lambda k, s: _custom(jax.custom_vjp, s)(k),
}


def _custom(kind, shape):
  """``jax.random.normal(k, shape)`` as a ``kind`` function (its derivative zero)."""
  fn = kind(lambda k: jax.random.normal(k, shape))
  if kind is jax.custom_jvp:
    fn.defjvp(lambda primals, tangents: (fn(*primals), jnp.zeros(shape)))
  else:
    fn.defvjp(lambda k: (fn(k), None), lambda _, ct: (None,))
  return fn
# Shapes with the stacked axis (length L) at axis 0, 1 and last.
SHAPES = {0: (L, 3, 5), 1: (3, L, 5), 2: (3, 5, L)}


def _noisy(draw, key=KEY):
  """``x`` plus a draw of its shape from one shared key, as ``optax.add_noise`` and PSGD's
  probes make it."""
  return lambda x: x + draw(key, x.shape)


def _rows_of(fn, x, axis: int) -> list:
  closed = jax.make_jaxpr(fn)(x)
  return [_rows.evaluate_rows(closed.jaxpr, closed.consts,
                              [lax.index_in_dim(x, i, axis, keepdims=False)], [True], i, L,
                              axis=axis)[0] for i in range(L)]


def _shapes(jaxpr: jcore.Jaxpr, found: set | None = None) -> set:
  """The shapes of every value ``jaxpr`` and its bodies compute."""
  found = set() if found is None else found
  for eqn in jaxpr.eqns:
    found.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    for sub in jcore.jaxprs_in_params(eqn.params):
      _shapes(sub, found)
  return found


@pytest.mark.parametrize("axis", sorted(SHAPES))
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_a_row_of_a_draw_equals_that_row_of_the_whole_draw_and_draws_no_other(name, axis):
  shape = SHAPES[axis]
  x = jnp.asarray(np.random.default_rng(0).uniform(size=shape), jnp.float32)
  fn = _noisy(DRAWS[name])
  full = fn(x)
  for i, got in enumerate(_rows_of(fn, x, axis)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(lax.index_in_dim(full, i, axis,
                                                                               keepdims=False)))
  closed = jax.make_jaxpr(fn)(x)
  row = lax.index_in_dim(x, 0, axis, keepdims=False)
  evaluated = jax.make_jaxpr(lambda r, i: _rows.evaluate_rows(
      closed.jaxpr, closed.consts, [r], [True], i, L, axis=axis))(row, 0)
  assert shape not in _shapes(evaluated.jaxpr), "the row evaluation drew the whole leaf"


def test_a_draw_stacked_along_another_axis_than_the_rows_is_drawn_whole_exactly():
  """A draw whose shape has the stacked length elsewhere than the leaves' axis is no row of
  theirs: it is drawn whole, and a row taken where it meets one."""
  x = jnp.asarray(np.random.default_rng(0).uniform(size=(L, 3, 5)), jnp.float32)
  fn = lambda x: x + jnp.swapaxes(jax.random.normal(KEY, (3, L, 5)), 0, 1)
  for i, got in enumerate(_rows_of(fn, x, 0)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(x)[i]))


# Shapes of 2**33 to 2**44 elements with rows of 8192 to 24576: their counters need both
# 32-bit words, and the second one a stride of 2**33.
HUGE = [((2 ** 20, 2 ** 12, 2), 0, [0, 1, 2 ** 19 + 3, 2 ** 20 - 1]),
        ((3, 2 ** 20, 2 ** 13), 1, [0, 7, 2 ** 20 - 1]),
        ((2 ** 31, 2 ** 12, 2), 0, [2 ** 31 - 1])]


@pytest.mark.parametrize("shape,axis,indices", HUGE)
def test_a_rows_counters_are_its_elements_row_major_numbers_in_64_bits(shape, axis, indices):
  """Counters above 2**32 carry into the high word, as ``iota_2x32_shape``'s do; checked on
  rows of draws too large to make whole, against numpy's uint64 row-major numbers."""
  strides = np.array([np.prod(shape[d + 1:], dtype=np.uint64) for d in range(len(shape))],
                     np.uint64)
  row_shape = shape[:axis] + shape[axis + 1:]
  for index in indices:
    hi, lo = jax.jit(lambda i: _draws.counters(shape, axis, i))(index)
    grid = np.stack(np.meshgrid(*[np.arange(n, dtype=np.uint64) for n in row_shape],
                                indexing="ij"))
    want = (np.uint64(index) * strides[axis]
            + np.tensordot(np.delete(strides, axis), grid, axes=1).astype(np.uint64))
    got = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) | np.asarray(lo).astype(np.uint64)
    np.testing.assert_array_equal(got, want)


def test_without_jax_threefry_partitionable_a_draw_is_refused_naming_the_flag():
  x = jnp.ones((L, 3, 5))
  with jax.threefry_partitionable(False):
    with pytest.raises(_draws.NonPartitionableDraw, match="jax_threefry_partitionable"):
      _rows_of(_noisy(jax.random.normal), x, 0)


def test_a_draw_from_an_rbg_key_is_refused():
  x = jnp.ones((L, 3, 5))
  with pytest.raises(_draws.NonPartitionableDraw, match="rbg"):
    _rows_of(_noisy(jax.random.normal, jax.random.key(0, impl="rbg")), x, 0)


def test_every_source_rule_has_a_case():
  bound = set()
  for draw in DRAWS.values():
    closed = jax.make_jaxpr(_noisy(draw))(jnp.ones(SHAPES[0]))
    stack = [closed.jaxpr]
    while stack:
      jaxpr = stack.pop()
      for eqn in jaxpr.eqns:
        bound.add(eqn.primitive)
        stack.extend(jcore.jaxprs_in_params(eqn.params))
  # ``call_p`` and ``closed_call_p`` are bound by no public API; they share ``jit``'s rule.
  internal = {prims.call_p, prims.closed_call_p}
  missing = {p.name for p in _rows.SOURCE_RULES if p not in internal} - {p.name for p in bound}
  assert not missing, missing
