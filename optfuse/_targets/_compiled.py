"""A compiled program's memory: XLA's buffer assignment read from ``memory_analysis()``.

The peak is ``argument + temp + output - alias`` bytes: the program's inputs, its scratch
buffers and its outputs, minus the outputs written into donated input buffers. A compiler that
refuses a program for want of memory (the TPU compiler's ``RESOURCE_EXHAUSTED ... exceeds
available HBM``) answers ``DoesNotFit``, with the bytes it says it needed, instead of raising.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax

FIELDS = ("peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes")
# Host memory, apart: what ``offload="state"`` keeps in ``pinned_host`` memory. The TPU and GPU
# compilers count it apart from device memory; XLA:CPU counts both as one (host_bytes 0).
HOST_FIELDS = ("host_bytes",)


def format_bytes(n: float | None) -> str:
  """``n`` bytes in decimal units (kB, MB, GB), as XLA and the docs quote them."""
  if n is None:
    return "-"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """The memory fields of a compiled step, with ``peak = argument + temp + output - alias``.

  Args:
    compiled: the result of ``jax.jit(...).lower(...).compile()``.

  Returns:
    A dict with the keys of ``FIELDS`` (device memory) and ``HOST_FIELDS`` (``host_bytes``: the
    same sum over host memory), in bytes.

  Raises:
    RuntimeError: the backend gives no memory analysis.
  """
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(
        f"the {jax.default_backend()} backend returns no memory analysis for compiled programs, "
        "so optfuse cannot report compiled memory on it.")
  out = {
      "temp_bytes": int(stats.temp_size_in_bytes),
      "argument_bytes": int(stats.argument_size_in_bytes),
      "output_bytes": int(stats.output_size_in_bytes),
      "alias_bytes": int(stats.alias_size_in_bytes),
  }
  out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                       - out["alias_bytes"])
  host = lambda name: int(getattr(stats, f"host_{name}_size_in_bytes", 0) or 0)
  out["host_bytes"] = host("argument") + host("temp") + host("output") - host("alias")
  return {k: out[k] for k in FIELDS + HOST_FIELDS}


class DoesNotFit(NamedTuple):
  """A compiler's refusal of a program that needs more memory than the device has.

  Attributes:
    needed_bytes: what the compiler says the program needs (``None`` if it does not say).
    available_bytes: what it says the device has (``None`` if it does not say).
    message: the compiler's message.
  """

  needed_bytes: int | None
  available_bytes: int | None
  message: str

  def __str__(self) -> str:
    needed = format_bytes(self.needed_bytes) if self.needed_bytes else "more"
    available = format_bytes(self.available_bytes) if self.available_bytes else "the device's"
    return f"does not fit: the compiler needs {needed} of {available}"


_SIZE = r"([\d.]+)([KMGT]?)i?B?"
# The TPU compiler's two phrasings: "Used 16.65G of 15.75G hbm" and "the total memory required
# for HLO temporaries (18.64G) exceeds available HBM (15.75G)". Its G are GiB.
_OOM_PATTERNS = (re.compile(rf"[Uu]sed {_SIZE} of {_SIZE}"),
                 re.compile(rf"\({_SIZE}\) exceeds available \w+ \({_SIZE}\)"))
_BINARY = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def does_not_fit(error: BaseException) -> DoesNotFit | None:
  """The ``DoesNotFit`` a compile error means, or ``None`` if it is not an out-of-memory."""
  text = str(error)
  if not isinstance(error, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in text:
    return None
  for pattern in _OOM_PATTERNS:
    match = pattern.search(text)
    if match:
      n, u, m, v = match.groups()
      return DoesNotFit(int(float(n) * _BINARY[u]), int(float(m) * _BINARY[v]), text.strip())
  return DoesNotFit(None, None, text.strip())


def compile_memory(lowered: jax.stages.Lowered) -> dict[str, int] | DoesNotFit:
  """The compiled memory of ``lowered``, or the compiler's ``DoesNotFit`` refusal."""
  try:
    return compiled_memory(lowered.compile())
  except jax.errors.JaxRuntimeError as e:
    refusal = does_not_fit(e)
    if refusal is None:
      raise
    return refusal
