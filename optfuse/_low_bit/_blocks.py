"""Block quantization along the last axis: a float slot to packed codes and one scale a block.

A slot of shape ``(*lead, n)`` is cut along its last axis into ``ceil(n / block_size)`` blocks
(the last one padded with zeros, which change no block's absmax): the scales have shape
``(*lead, ceil(n / block_size))``. Blocks never cross an index of a leading axis, so a row of a
stacked leaf (its layer axis leading, at position 0 or 1) has its own blocks, and a shard of the
last axis holds whole blocks whenever its length is a multiple of ``block_size``.

Codes are looked up by the float32 bits of the normalized values (``_search``): two gathers
from small constant tables and one comparison a value, so quantizing holds a few arrays of the
slot's size and never the ``2 ** bits``-fold broadcast of comparing every value with every
entry.

The codes of a slot are packed into float32 *words* of bits (4 codes of 8 bits, or 8 of 4 bits,
a word): optfuse's fused steps return a leaf's new state as the cotangents of its old state,
which JAX allows only for floats. A word is read back with ``lax.bitcast_convert_type`` and no
arithmetic ever touches it. As bytes (little-endian), the words are the anchors' layout: one
code a byte for 8 bits, two a byte for 4 bits with the first in the high nibble, as torchao
packs them.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from optfuse._low_bit import _search
from optfuse._low_bit._maps import Scheme

WORD_BITS = 32


def codes_per_word(bits: int) -> int:
  return WORD_BITS // bits


def _shifts(bits: int) -> np.ndarray:
  """The shift of each code within its word: byte ``k`` of a word holds bits ``8k .. 8k+7``;
  for 4 bits, the even code of a byte is its high nibble."""
  if bits == 8:
    return np.array([0, 8, 16, 24], dtype=np.uint32)
  return np.array([8 * (j // 2) + (4 if j % 2 == 0 else 0) for j in range(8)], dtype=np.uint32)


def num_blocks(n: int, block_size: int) -> int:
  return math.ceil(n / block_size)


def words_shape(shape: tuple[int, ...], bits: int, block_size: int) -> tuple[int, ...]:
  """The shape of the packed codes of a slot of ``shape``."""
  n = shape[-1]
  return (*shape[:-1], num_blocks(n, block_size) * block_size // codes_per_word(bits))


def scales_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  return (*shape[:-1], num_blocks(shape[-1], block_size))


def _pack(codes, bits: int):
  """Codes ``(*lead, m)`` (m a multiple of the codes a word) to float32 words."""
  per = codes_per_word(bits)
  grouped = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
  shifts = jnp.broadcast_to(_shifts(bits), grouped.shape)  # full shape: a row of it is a row
  words = jnp.bitwise_or.reduce(jnp.left_shift(grouped, shifts), axis=-1)
  return lax.bitcast_convert_type(words, jnp.float32)


def _unpack(words, bits: int):
  grouped = lax.bitcast_convert_type(words, jnp.uint32)[..., None]
  mask = np.uint32(2 ** bits - 1)
  per = codes_per_word(bits)
  shifts = jnp.broadcast_to(_shifts(bits), (*grouped.shape[:-1], per))
  codes = jnp.right_shift(jnp.broadcast_to(grouped, shifts.shape), shifts) & mask
  return codes.reshape(*words.shape[:-1], words.shape[-1] * per)


def quantize(x, scheme: Scheme, block_size: int):
  """Quantizes ``x`` block by block along its last axis.

  Args:
    x: a float array of rank at least 1.
    scheme: the map and rounding (``_maps.scheme``).
    block_size: values a block; a multiple of 8.

  Returns:
    ``(words, scales)``: float32 arrays of shapes ``words_shape`` and ``scales_shape``.
  """
  x = x.astype(jnp.float32)
  n = x.shape[-1]
  nb = num_blocks(n, block_size)
  if nb * block_size != n:
    x = lax.pad(x, np.float32(0), [(0, 0, 0)] * (x.ndim - 1) + [(0, nb * block_size - n, 0)])
  blocks = x.reshape(*x.shape[:-1], nb, block_size)
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  if scheme.scaling == "reciprocal":
    scales = absmax
    # bitsandbytes floors absmax at 1e-38 before its reciprocal: a subnormal, which XLA flushes
    # to zero, so an all-zero block takes the reciprocal 0 instead (its codes are zero's).
    recip = jnp.where(absmax > 0, 1.0 / absmax, np.float32(0))
    y = jnp.clip(blocks * recip[..., None], -1.0, 1.0)
  else:
    scales = jnp.maximum(absmax, np.float32(1e-12))
    y = blocks / scales[..., None]
  codes = _search.lookup(y, scheme).reshape(*x.shape[:-1], nb * block_size)
  return _pack(codes, scheme.bits), scales


def dequantize(words, scales, scheme: Scheme, block_size: int, n: int, dtype=jnp.float32):
  """The values ``quantize`` stands for: ``table[code] * scale``, cut to ``n`` along the last
  axis, in ``dtype``."""
  codes = _unpack(words, scheme.bits)
  nb = scales.shape[-1]
  values = jnp.take(jnp.asarray(scheme.table), codes.reshape(*codes.shape[:-1], nb, block_size))
  values = (values * scales[..., None]).reshape(*codes.shape[:-1], nb * block_size)
  return values[..., :n].astype(dtype)
