"""The quantization maps: the sorted tables of values a code stands for, and how each anchor
rounds onto them.

8 bits use bitsandbytes' dynamic maps (``create_dynamic_map`` in ``bitsandbytes/functional.py``,
Dettmers et al. 2021): signed for first moments, unsigned for second moments, rounded to the
nearest entry as bitsandbytes' ``quantize_blockwise`` does. 4 bits use torchao's 4-bit AdamW
scheme (``torchao/optim/subclass_4bit.py``, after Li et al. 2023): a signed dynamic map of 16
entries for first moments, a linear map without zero for second moments (a zero second moment
would make Adam's step ``mu / (sqrt(nu) + eps)`` blow up), with torchao's rounding.

The tables are built here, in float32, exactly as their construction states it. bitsandbytes'
tables come from ``torch.linspace``, whose last bit depends on where torch runs it: the table
published and shipped as literals is the one built with a single rounding per entry (as the
CUDA kernel's fused multiply-add computes it); torch's vectorised CPU linspace differs in the
last bit of some entries. That published table is the one built here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

F32 = np.float32


def _linspace(start: float, end: float, steps: int) -> np.ndarray:
  """``torch.linspace(start, end, steps)`` in float32, each entry rounded once: the first half
  counted up from ``start``, the second half down from ``end``, as torch computes it."""
  start32, end32 = F32(start), F32(end)
  step = F32((end32 - start32) / F32(steps - 1))
  half = steps // 2
  # step * i is exact in float64 (a 24-bit mantissa times an index below 2**29), so one
  # rounding to float32 of the float64 sum is the fused multiply-add.
  return np.array([F32(float(start32) + float(step) * i) if i < half
                   else F32(float(end32) - float(step) * (steps - 1 - i))
                   for i in range(steps)], dtype=F32)


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
  """bitsandbytes' dynamic quantization map (``create_dynamic_map``), sorted, in float32.

  Args:
    signed: a map for values of either sign (first moments) or non-negative ones.
    max_exponent_bits: the most exponent bits; 7 for bitsandbytes' 8-bit maps, 3 for torchao's
      4-bit signed map.
    total_bits: the bits of a code.

  Returns:
    The ``2 ** total_bits`` entries, ascending, from -1 (signed) or 0 up to 1.
  """
  non_sign_bits = total_bits - 1
  data: list[float] = []
  for i in range(max_exponent_bits):
    items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
    bounds = _linspace(0.1, 1.0, items)
    means = (bounds[:-1] + bounds[1:]) / F32(2.0)
    scale = F32(10.0 ** (i - (max_exponent_bits - 1)))
    data += (scale * means).tolist()
    if signed:
      data += (-scale * means).tolist()
  data += [0.0, 1.0]
  assert len(data) == 2 ** total_bits, (signed, max_exponent_bits, total_bits)
  return np.array(sorted(data), dtype=F32)


def linear_map(bits: int) -> np.ndarray:
  """torchao's 4-bit second-moment map: ``k / 2**bits`` for ``k = 1 .. 2**bits`` (no zero)."""
  n = 2 ** bits
  return np.arange(1, n + 1, dtype=F32) / F32(n)


class Scheme(NamedTuple):
  """How one kind of slot is quantized.

  Attributes:
    table: the sorted float32 values the ``2 ** bits`` codes stand for.
    rounding: ``"nearest"``: bitsandbytes' nearest entry, a value on a midpoint taking the lower
      code (``torch.bucketize`` over the midpoints); ``"torchao"``: the largest entry not above
      the value, moved up when the value is at least half way to the next (``residual >=
      (up - down) * 0.5``).
    scaling: ``"reciprocal"``: bitsandbytes' ``x * (1 / max(absmax, 1e-38))``, clamped to
      [-1, 1], the block's absmax stored as it is; ``"divide"``: torchao's ``x / scale`` with
      ``scale = max(absmax, 1e-12)`` stored.
  """

  table: np.ndarray
  rounding: str
  scaling: str

  @property
  def bits(self) -> int:
    return int(np.log2(len(self.table)))


# The default block sizes of the anchors: bitsandbytes' and torchao's 8-bit optimizers block
# 256 values, torchao's 4-bit optimizers 128.
DEFAULT_BLOCK_SIZE = {8: 256, 4: 128}


def scheme(bits: int, signed: bool) -> Scheme:
  """The scheme for a slot of ``bits`` bits: signed (first moments) or unsigned (second)."""
  if bits == 8:
    return Scheme(dynamic_map(signed), "nearest", "reciprocal")
  if signed:
    return Scheme(dynamic_map(True, max_exponent_bits=3, total_bits=4), "torchao", "divide")
  return Scheme(linear_map(4), "torchao", "divide")
