"""Block quantization along the last axis: a float slot to packed codes and one scale a block.

A slot of shape ``(*lead, n)`` is cut along its last axis into ``ceil(n / block_size)`` equal
blocks of ``leaf_block(n, block_size)`` values: at most ``block_size``, a multiple of 8, the
last block padded with zeros (which change no block's absmax), fewer than 8 a block. The scales
have shape ``(*lead, ceil(n / block_size))``. A row shorter than ``block_size`` is one block of
its own length, so a 64-wide leaf's 8-bit codes take 64 bytes a row, not 256. Blocks never
cross an index of a leading axis, so a row of a stacked leaf (its layer axis leading, at
position 0 or 1) has its own blocks, and a shard of the last axis holds whole blocks whenever
its length is a multiple of the block.

Codes are looked up by the float32 bits of the normalized values (``_search``): two gathers
from small constant tables and one comparison a value, so quantizing holds a few arrays of the
slot's size and never the ``2 ** bits``-fold broadcast of comparing every value with every
entry.

The codes of a slot are packed into float32 *words* of bits (4 codes of 8 bits, or 8 of 4 bits,
a word): optfuse's fused steps return a leaf's new state as the cotangents of its old state,
and JAX drops a cotangent returned for an integer input (``jax.vjp`` gives ``float0`` zeros in
its place), so only a float carries it. Every bit pattern is a word of valid codes, denormals
and NaNs included, which arithmetic would change (TPUs and XLA:CPU flush denormals, XLA:CPU
quiets signalling NaNs): a word is made by ``_pack``'s bitcast of integers, read back by
``_unpack``'s bitcast to integers, and between them only moved. Two tests show it
(tests/low_bit/test_low_bit_words.py): ``optfuse._analysis._words`` finds no op that reads a
word otherwise in the compiled steps of every mode, offload and microbatches for XLA:CPU, the
TPU v5e and the H100 compilers; and state whose words are denormals and NaNs trains bit for
bit like the unfused transformation on XLA:CPU. As bytes (little-endian), the words are the
anchors' layout: one code a byte for 8 bits, two a byte for 4 bits with the first in the high
nibble, as torchao packs them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

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


def leaf_block(n: int, block_size: int) -> int:
  """The values a block of a last axis of length ``n``: ``n`` split into ``num_blocks`` equal
  blocks, rounded up to a multiple of 8 (``block_size`` itself when it divides ``n``)."""
  return 8 * math.ceil(math.ceil(n / num_blocks(n, block_size)) / 8)


def words_shape(shape: tuple[int, ...], bits: int, block_size: int) -> tuple[int, ...]:
  """The shape of the packed codes of a slot of ``shape``."""
  n = shape[-1]
  return (*shape[:-1], num_blocks(n, block_size) * leaf_block(n, block_size)
          // codes_per_word(bits))


def scales_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  return (*shape[:-1], num_blocks(shape[-1], block_size))


def _explicit_spec(x) -> tuple | None:
  """The spec of ``x``, one entry an axis, when it is sharded under ``AxisType.Explicit`` (as
  the planner traces ``init`` for an FSDP mesh, or a user's program under ``jax.set_mesh``);
  ``None`` otherwise, where XLA chooses the layout of every reshape."""
  sharding = jax.typeof(x).sharding
  if AxisType.Explicit not in tuple(getattr(sharding.mesh, "axis_types", ())):
    return None
  return (*sharding.spec, *(None,) * (x.ndim - len(sharding.spec)))


def _shards(x, entry) -> int:
  names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(jax.typeof(x).sharding.mesh.shape[name] for name in names)


def _on(x, spec) -> NamedSharding:
  return NamedSharding(jax.typeof(x).sharding.mesh, PartitionSpec(*spec))


def _whole_last(x):
  """``x`` with its last axis unsharded (gathered), under Explicit sharding."""
  spec = _explicit_spec(x)
  if spec is None or spec[-1] is None:
    return x
  return jax.sharding.reshard(x, _on(x, (*spec[:-1], None)))


def _split_last(x, size: int):
  """``x`` of shape ``(*lead, m)`` as ``(*lead, m // size, size)``. Under Explicit sharding
  the groups take the last axis's sharding when its shards hold whole groups; otherwise that
  axis is gathered first (a block would cross shards)."""
  shape = (*x.shape[:-1], x.shape[-1] // size, size)
  spec = _explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  if shape[-2] % _shards(x, spec[-1]):
    x, spec = _whole_last(x), (*spec[:-1], None)
  return lax.reshape(x, shape, out_sharding=_on(x, (*spec, None)))


def _merge_last(x):
  """``x`` of shape ``(*lead, a, b)`` as ``(*lead, a * b)``, sharded as its ``a`` axis."""
  shape = (*x.shape[:-2], x.shape[-2] * x.shape[-1])
  spec = _explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  if spec[-1] is not None:
    x = jax.sharding.reshard(x, _on(x, (*spec[:-1], None)))
  return lax.reshape(x, shape, out_sharding=_on(x, spec[:-1]))


def _pack(codes, bits: int):
  """Codes ``(*lead, m)`` (m a multiple of the codes a word) to float32 words."""
  per = codes_per_word(bits)
  grouped = _split_last(codes.astype(jnp.uint32), per)
  shifts = jnp.broadcast_to(_shifts(bits), grouped.shape)  # full shape: a row of it is a row
  words = jnp.bitwise_or.reduce(jnp.left_shift(grouped, shifts), axis=-1)
  return lax.bitcast_convert_type(words, jnp.float32)


def _unpack(words, bits: int):
  grouped = lax.bitcast_convert_type(words, jnp.uint32)[..., None]
  mask = np.uint32(2 ** bits - 1)
  per = codes_per_word(bits)
  shifts = jnp.broadcast_to(_shifts(bits), (*grouped.shape[:-1], per))
  codes = jnp.right_shift(jnp.broadcast_to(grouped, shifts.shape), shifts) & mask
  return _merge_last(codes)


def quantize(x, scheme: Scheme, block_size: int):
  """Quantizes ``x`` block by block along its last axis.

  Args:
    x: a float array of rank at least 1.
    scheme: the map and rounding (``_maps.scheme``).
    block_size: the most values a block; a multiple of 8 (``leaf_block`` gives the block).

  Returns:
    ``(words, scales)``: float32 arrays of shapes ``words_shape`` and ``scales_shape``.
  """
  x = x.astype(jnp.float32)
  n = x.shape[-1]
  nb, block_size = num_blocks(n, block_size), leaf_block(n, block_size)
  if nb * block_size != n:
    x = _whole_last(x)  # a shard of the last axis holds whole blocks only when none is padded
    x = lax.pad(x, np.float32(0), [(0, 0, 0)] * (x.ndim - 1) + [(0, nb * block_size - n, 0)])
  blocks = _split_last(x, block_size)
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
  codes = _merge_last(_search.lookup(y, scheme))
  return _pack(codes, scheme.bits), scales


def dequantize(words, scales, scheme: Scheme, block_size: int, n: int, dtype=jnp.float32):
  """The values ``quantize`` stands for: ``table[code] * scale``, cut to ``n`` along the last
  axis, in ``dtype``."""
  codes, block_size = _unpack(words, scheme.bits), leaf_block(n, block_size)
  # An unpacked code is below 2 ** bits, the table's length: always in bounds.
  values = _search.table_get(scheme.table, _split_last(codes, block_size), "promise_in_bounds")
  values = _merge_last(values * scales[..., None])
  return values[..., :n].astype(dtype)
