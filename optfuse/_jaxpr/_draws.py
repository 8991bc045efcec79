"""A row of a random draw: the numbers ``random_bits`` draws for one row of a stacked shape,
without drawing the others.

An update that draws random numbers of a stacked leaf's shape (a probe vector of PSGD, the noise
of ``optax.add_noise``) from a key shared by every layer makes, inside the backward loop, one
row of the draw per iteration. Drawing the whole leaf's numbers in each iteration would be exact
but would cost the loop a whole-leaf temporary and ``L`` times the hashing; drawing the row
alone is exact only where the row's numbers do not depend on the others'.

With ``jax_threefry_partitionable`` (JAX's default: on in jax 0.10.2), ``random_bits(key,
shape)`` with the threefry key hashes each element's own counter: element ``j`` (in row-major
order) is ``threefry2x32(key, (hi(j), lo(j)))``, its two words xored
(``jax/_src/random/threefry2x32.py``, ``_threefry_random_bits_partitionable``). A row's numbers
are then the hashes of the row's own counters, ``index * stride + offset``. Without the flag,
the draw hashes counter ``j`` paired with counter ``j + n/2`` of a draw of ``n`` words (and
packs several 8- or 16-bit numbers in one word): a row's numbers come out of hashes that make
another row's too, and the numbers themselves are others, so such a draw is refused
(``NonPartitionableDraw``), as is a draw of another key implementation (``rbg``: XLA's
``RngBitGenerator`` over the whole shape).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p

from optfuse._jaxpr._row_params import NotRowwise

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


class NonPartitionableDraw(NotRowwise):
  """A draw whose row cannot be drawn alone: ``jax_threefry_partitionable`` is off, or the key
  is not a threefry key."""


def check_draw(key, shape: tuple[int, ...]) -> None:
  """Raises ``NotRowwise`` (``NonPartitionableDraw``) unless a row of ``random_bits(key, shape)``
  can be drawn alone."""
  impl = jax.random.key_impl(key)
  if str(impl) != "threefry2x32":
    raise NonPartitionableDraw(f"its update draws random numbers for the whole stacked leaf "
                               f"with the {impl} key, whose rows cannot be drawn alone: use a "
                               "threefry key")
  if not jax.config.jax_threefry_partitionable:
    raise NonPartitionableDraw(
        "its update draws random numbers for the whole stacked leaf with "
        "jax_threefry_partitionable off, where a row's numbers cannot be drawn alone: set "
        "jax.config.update('jax_threefry_partitionable', True) (JAX's default)")


def _times(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
  """The 64-bit product of the uint32 array ``a`` and the integer ``0 <= b < 2**64``, as its high
  and low words (uint32 arithmetic only, as JAX's counters without ``jax_enable_x64``)."""
  b_hi, b_lo = b >> 32, b & 0xFFFFFFFF
  a0, a1 = a & 0xFFFF, a >> 16
  p00, p01 = a0 * jnp.uint32(b_lo & 0xFFFF), a0 * jnp.uint32(b_lo >> 16)
  p10, p11 = a1 * jnp.uint32(b_lo & 0xFFFF), a1 * jnp.uint32(b_lo >> 16)
  mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
  lo = (p00 & 0xFFFF) | (mid << 16)
  hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16) + a * jnp.uint32(b_hi)
  return hi, lo


def _plus(x: tuple[jax.Array, jax.Array], y: tuple[jax.Array, jax.Array]
          ) -> tuple[jax.Array, jax.Array]:
  """The sum of two 64-bit numbers given as (high, low) uint32 words."""
  lo = x[1] + y[1]
  return x[0] + y[0] + (lo < x[1]).astype(jnp.uint32), lo


def counters(shape: tuple[int, ...], axis: int, index) -> tuple[jax.Array, jax.Array]:
  """The row-major numbers of the elements of row ``index`` along ``axis`` of ``shape``, as the
  high and low words of 64-bit counters (JAX's ``iota_2x32_shape``, for one row)."""
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  row_shape = shape[:axis] + shape[axis + 1:]
  row_strides = strides[:axis] + strides[axis + 1:]
  base = _times(jnp.full(row_shape, lax.convert_element_type(index, jnp.uint32)), strides[axis])
  for d, stride in enumerate(row_strides):
    base = _plus(base, _times(lax.broadcasted_iota(jnp.uint32, row_shape, d), stride))
  return base


def draw_row(key, bit_width: int, shape: tuple[int, ...], axis: int, index) -> jax.Array:
  """Row ``index`` along ``axis`` of ``random_bits(key, bit_width, shape)`` for one threefry key
  under ``jax_threefry_partitionable`` (``check_draw``), as JAX computes each element."""
  k1, k2 = jax.random.key_data(key)
  bits1, bits2 = threefry2x32_p.bind(k1, k2, *counters(shape, axis, index))
  dtype = _UINT[bit_width]
  if bit_width == 64:
    hi = lax.convert_element_type(bits1, dtype)
    return lax.shift_left(hi, jnp.asarray(32, dtype)) | lax.convert_element_type(bits2, dtype)
  return lax.convert_element_type(bits1 ^ bits2, dtype)
