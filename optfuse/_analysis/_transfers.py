"""Bytes a step moves between host and device memory: counted in the traced step, and in a
compiled program to check that count.

A value moves between memory spaces only where the step says so: ``_memory_spaces.to_device``
and ``like`` bind JAX's ``device_put`` to the other space, at a tap (a leaf's slots whole, and
back), in a row loop (a row of a host stack, and the new row back) and in mode "off" (the whole
state, and back). ``traced_transfer_bytes`` adds up those ``device_put`` equations of the step's
jaxpr, each loop's times its trip count: the exact bytes the step's plan moves, for the
compiler it was traced for (the TPU's row loops read each slot row an iteration ahead, one row
more than the GPU's).

The TPU and GPU compilers turn each of them into a host copy (``_tpu_gpu_device_put_lowering``
in jax/_src/dispatch.py, then XLA's host offloader): ``copy-start`` of a whole array to or from
memory space ``S(5)``, ``dynamic-slice-start`` of a row out of a host buffer,
``dynamic-update-slice-start`` of a device row into one (their synchronous forms too).
``compiled_transfer_bytes`` counts those in a compiled program's HLO text, each while loop's
body times its known trip count. XLA:CPU lowers ``device_put`` to nothing (its host and device
memory are one, ``_common_device_put_lowering``): its compiled program holds no copy to count,
and the traced count is what it runs.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import jax
import numpy as np
from jax.extend.core import primitives as P

from optfuse._analysis import _hlo
from optfuse._jaxpr import _interpreter


class TransferBytes(NamedTuple):
  """Bytes a step moves from host to device memory and back.

  Attributes:
    to_device: bytes read from host memory into device memory.
    to_host: bytes written from device memory into host memory.
  """

  to_device: int
  to_host: int

  @property
  def total(self) -> int:
    """Both directions together: ``host_transfer_bytes``."""
    return self.to_device + self.to_host


def traced_transfer_bytes(jaxpr) -> TransferBytes:
  """The bytes the ``device_put`` equations of ``jaxpr`` move between memory spaces.

  Args:
    jaxpr: a step's ``ClosedJaxpr`` or ``Jaxpr`` (``jax.jit(step).trace(...).jaxpr``).

  Returns:
    The bytes moved each way, each ``scan`` body's times its length.

  Raises:
    ValueError: a transfer inside a ``while_loop`` (its trip count is not known when traced).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  # What no output reads is not run: compilers drop it (a row read only for its shape).
  jaxpr, _ = _interpreter.prune(jaxpr, [True] * len(jaxpr.outvars))
  return _Transfers().count(jaxpr)


def _aval_bytes(aval) -> int:
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _device_put(walk: _Transfers, eqn, ins: list) -> list:
  host = jax.memory.Space.Host
  for a, b in zip(eqn.invars, eqn.outvars):
    src, dst = a.aval.memory_space, b.aval.memory_space
    if src == dst:
      continue
    if walk.in_while:
      raise ValueError("a host transfer inside a while_loop: its trip count is unknown.")
    if dst == host:
      walk.to_host += walk.times * _aval_bytes(b.aval)
    elif src == host:
      walk.to_device += walk.times * _aval_bytes(b.aval)
  return [None] * len(eqn.outvars)


def _cond(walk: _Transfers, eqn, ins: list) -> list:
  """One branch runs: the most any branch moves."""
  counts = [_Transfers(walk.times, walk.in_while).count(b.jaxpr)
            for b in _interpreter.cond_branches(eqn)]
  best = max(counts, key=lambda c: c.total, default=TransferBytes(0, 0))
  walk.to_device, walk.to_host = walk.to_device + best.to_device, walk.to_host + best.to_host
  return [None] * len(eqn.outvars)


class _Transfers(_interpreter.Interpreter):
  """The interpreter's walk that adds up the bytes of each ``device_put`` across memory spaces,
  ``times`` the trip counts of the loops around it; values are not computed (``None``)."""

  rules = {P.device_put_p: _device_put, P.cond_p: _cond}

  def __init__(self, times: int = 1, in_while: bool = False):
    super().__init__()
    self.times, self.in_while = times, in_while
    self.to_device = self.to_host = 0

  def literal(self, atom) -> None:
    return None

  def missing(self, v) -> None:
    return None

  def count(self, jaxpr) -> TransferBytes:
    """The bytes ``jaxpr`` moves, added to this walk's, and returned."""
    self.run(jaxpr, [None] * len(jaxpr.constvars), [None] * len(jaxpr.invars))
    return TransferBytes(self.to_device, self.to_host)

  def default(self, eqn, ins: list) -> list:
    """Any other equation moves what the jaxprs inside it move: a ``scan``'s body its length
    times, a ``while``'s body an unknown number of times."""
    primitive = _interpreter.primitive_of(eqn)
    times = self.times * (_interpreter.scan_parts(eqn).length if primitive is P.scan_p else 1)
    for sub in _interpreter.inner_jaxprs(eqn):
      inner = _Transfers(times, self.in_while or primitive is P.while_p).count(sub)
      self.to_device, self.to_host = self.to_device + inner.to_device, self.to_host + inner.to_host
    return [None] * len(eqn.outvars)


_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:[a-z]\d*[a-z]*)*)\[([\d,]*)\](\{[^}]*\})?")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# The HLO dtypes whose name is not NumPy's.
_HLO_DTYPES = {"pred": "bool", "bf16": "bfloat16", "f16": "float16", "f32": "float32",
               "f64": "float64"}


class _Array(NamedTuple):
  bytes: int
  host: bool


def _dtype_bytes(dtype: str) -> float:
  if dtype[0] in "su" and dtype[1:].isdigit():
    return int(dtype[1:]) / 8
  name = _HLO_DTYPES.get(dtype, dtype)
  return jax.numpy.dtype(name).itemsize


def _arrays(type_: str | tuple) -> list[_Array]:
  """Each array type of an HLO result type, in order, with its bytes and whether its layout
  puts it in host memory (``S(5)``)."""
  return [_Array(int(math.prod(int(d) for d in dims.split(",") if d) * _dtype_bytes(dtype)),
                 "S(5)" in layout)
          for leaf in _hlo.leaf_types(type_) for dtype, dims, layout in _ARRAY.findall(leaf)]


def _copies(instructions: list[_hlo.Instruction]) -> tuple[int, int]:
  """The bytes the host copies of one computation move to the device and to the host: each
  copy's destination array, or the row a dynamic slice reads from or writes into a host
  buffer."""
  types = {i.name: i.type for i in instructions}
  operand = lambda i, k: _arrays(types.get(i.operands[k], ""))[0]
  to_device = to_host = 0
  for i in instructions:
    arrays = _arrays(i.type)
    if i.opcode == "copy-start":  # (destination, source, context)
      moved, source = arrays[0], arrays[1]
    elif i.opcode == "copy":
      moved, source = arrays[0], operand(i, 0)
    elif i.opcode == "dynamic-slice-start":  # ((buffer, indices...), row, context)
      moved, source = arrays[-2], arrays[0]
    elif i.opcode == "dynamic-slice":
      moved, source = arrays[0], operand(i, 0)
    elif i.opcode == "dynamic-update-slice-start":  # ((buffer, row, indices...), buffer, ...)
      moved, source = _Array(arrays[1].bytes, arrays[0].host), arrays[1]
    elif i.opcode == "dynamic-update-slice":
      row = operand(i, 1)
      moved, source = _Array(row.bytes, arrays[0].host), row
    else:
      continue
    if moved.host and not source.host:
      to_host += moved.bytes
    elif source.host and not moved.host:
      to_device += moved.bytes
  return to_device, to_host


def _constant(name: str, table: dict[str, _hlo.Instruction]) -> int | None:
  """The value of the integer constant ``name`` is, through copies and bitcasts."""
  while name in table and table[name].opcode in ("copy", "bitcast", "convert"):
    name = table[name].operands[0]
  i = table.get(name)
  if i is None or i.opcode != "constant":
    return None
  return int(i.literal) if i.literal.lstrip("-").isdigit() else None


def _trip_count(loop: _hlo.Instruction, parent: list[_hlo.Instruction],
                computations: dict[str, list[_hlo.Instruction]]) -> int | None:
  """The trip count of a while loop: the compiler's ``known_trip_count`` where it says it, else
  read from a ``fori_loop``'s shape (a condition ``i < n`` for a tuple element ``i`` that starts
  at a constant, which the body adds one to); ``None`` when neither holds."""
  found = _TRIP_COUNT.search(loop.attributes)
  if found is not None:
    return int(found.group(1))
  condition = loop.callee("condition")
  if condition not in computations:
    return None
  cond = {i.name: i for i in computations[condition]}
  compare = [i for i in cond.values() if i.opcode == "compare" and "direction=LT" in i.attributes]
  if len(compare) != 1:
    return None
  counter, bound = compare[0].operands[:2]
  index = cond[counter].index() if counter in cond else None
  end = _constant(bound, cond)
  table = {i.name: i for i in parent}
  init = loop.operands[0]
  if index is None or end is None or init not in table or table[init].opcode != "tuple":
    return None
  start = _constant(table[init].operands[index], table)
  return None if start is None else end - start


def compiled_transfer_bytes(hlo: str) -> TransferBytes:
  """The bytes a compiled program's host copies move, each while loop's body times its known
  trip count.

  Args:
    hlo: the optimized HLO text of a program compiled for a TPU or GPU
      (``jax.stages.Compiled.as_text()``).

  Returns:
    The bytes its host copies move each way.

  Raises:
    ValueError: a host copy inside a while loop whose trip count the compiler does not know.
  """
  computations, entry = _hlo.computations(hlo)
  done: dict[str, tuple[int, int]] = {}

  def moved(name: str) -> tuple[int, int]:
    if name in done:
      return done[name]
    to_device, to_host = _copies(computations[name])
    for i in computations[name]:
      if i.opcode == "conditional":  # one branch runs: the most any moves
        counts = [moved(b) for b in i.callees() if b in computations]
        d, h = max(counts, key=sum, default=(0, 0))
        to_device, to_host = to_device + d, to_host + h
        continue
      for callee in i.callees():
        if callee not in computations:
          continue
        d, h = moved(callee)
        if i.opcode == "while" and callee == i.callee("body"):
          trips = _trip_count(i, computations[name], computations)
          if trips is None and (d or h):
            raise ValueError(f"a host copy in the while loop {i.name}, whose trip count "
                             "optfuse cannot read from the program.")
          d, h = d * (trips or 0), h * (trips or 0)
        to_device, to_host = to_device + d, to_host + h
    done[name] = to_device, to_host
    return done[name]

  return TransferBytes(*moved(entry))
