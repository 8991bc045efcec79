"""Compile-only memory report: how much device memory a training step needs, before it runs.

``memory_report`` lowers and compiles ``jax.jit(step, donate_argnums=(0, 1))`` for the optax step
(mode "off") and the fused steps, and reads XLA's buffer assignment from
``compiled.memory_analysis()``. Nothing is allocated or run: params and arguments may be
``jax.ShapeDtypeStruct``s, so a model that does not fit on the device can still be measured.

The peak is ``argument + temp + output - alias`` bytes: the step's inputs, its scratch buffers
and its outputs, minus the outputs written into donated input buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import optax

from optfuse import _fuse
from optfuse._errors import NonSeparableError

MODES = ("off", "backward", "forward")
FIELDS = ("peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes")

# Errors that mean "this mode cannot run this optimizer (yet)", reported as an unavailable row.
UNAVAILABLE_ERRORS = (NotImplementedError, NonSeparableError)


def format_bytes(n: float | None) -> str:
  """``n`` bytes in decimal units (kB, MB, GB), as XLA and the README quote them."""
  if n is None:
    return "-"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def first_sentence(text: str) -> str:
  """The first sentence of an error message, for one-line table cells."""
  text = " ".join(text.split())
  end = text.find(". ")
  return text if end < 0 else text[:end + 1]


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """The memory fields of a compiled step, with ``peak = argument + temp + output - alias``.

  Args:
    compiled: the result of ``jax.jit(...).lower(...).compile()``.

  Returns:
    A dict with the keys of ``FIELDS``, in bytes.

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
  return {k: out[k] for k in FIELDS}


def loss_has_aux(loss_fn: Callable, params, *args, **kwargs) -> bool:
  """Whether ``loss_fn`` returns a ``(loss, aux)`` pair, decided from its abstract output."""
  out = jax.eval_shape(loss_fn, params, *args, **kwargs)
  return isinstance(out, (tuple, list)) and len(out) == 2


def lower_step(fx: _fuse.FusedTransformation, loss_fn: Callable, params, args: tuple = (),
               kwargs: Mapping[str, Any] | None = None, has_aux: bool = False,
               **step_options: Any) -> jax.stages.Lowered:
  """Lowers ``jax.jit(fx.value_and_update(loss_fn, ...), donate_argnums=(0, 1))``.

  Args:
    fx: the fused transformation.
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    params: params or their ``jax.ShapeDtypeStruct``s.
    args: positional arguments of ``loss_fn`` (arrays or ``jax.ShapeDtypeStruct``s).
    kwargs: keyword arguments of ``loss_fn``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    **step_options: further keyword arguments of ``fx.value_and_update``.

  Returns:
    The lowered step; its state argument is ``jax.eval_shape(fx.init, params)``.
  """
  state = jax.eval_shape(fx.init, params)
  step = fx.value_and_update(loss_fn, has_aux=has_aux, **step_options)
  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *args, **(kwargs or {}))


def mode_table(header: list[str], rows: Mapping[str, list[str]],
               unavailable: Mapping[str, str]) -> list[str]:
  """Fixed-width lines: the header, then one line per mode in ``MODES`` order, the modes of
  ``unavailable`` with the first sentence of their reason."""
  widths = [max(len(cells[i]) for cells in [header, *rows.values()]) for i in range(len(header))]
  widths[0] = max([widths[0], *map(len, unavailable)])
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()
  lines = [fmt(header)]
  for mode in MODES:
    if mode in rows:
      lines.append(fmt(rows[mode]))
    elif mode in unavailable:
      lines.append(fmt([mode, f"unavailable: {first_sentence(unavailable[mode])}"]))
  return lines


class MemoryReport(Mapping):
  """Compiled memory per mode: ``report[mode]`` is a dict with the keys of ``FIELDS`` (bytes).

  Modes that cannot run this optimizer are absent from the mapping; ``unavailable`` maps them to
  the reason (the exception's name and message). ``str(report)`` is a table.

  Attributes:
    unavailable: mode -> why it could not be compiled.
  """

  def __init__(self, rows: Mapping[str, Mapping[str, int]], unavailable: Mapping[str, str]):
    self._rows = {mode: dict(row) for mode, row in rows.items()}
    self.unavailable = dict(unavailable)

  def __getitem__(self, mode: str) -> dict[str, int]:
    return self._rows[mode]

  def __iter__(self) -> Iterator[str]:
    return iter(self._rows)

  def __len__(self) -> int:
    return len(self._rows)

  def table(self) -> str:
    """The report as a fixed-width text table, one line per mode."""
    header = ["mode", "peak", "temp", "arguments", "outputs", "aliased", "peak vs off"]
    base = self._rows["off"]["peak_bytes"] if "off" in self._rows else None
    rows = {}
    for mode, row in self._rows.items():
      ratio = f"{row['peak_bytes'] / base:.2f}x" if base else "-"
      rows[mode] = [mode, *(format_bytes(row[k]) for k in FIELDS), ratio]
    return "\n".join(mode_table(header, rows, self.unavailable))

  def __str__(self) -> str:
    return self.table()

  def __repr__(self) -> str:
    return f"MemoryReport(\n{self.table()}\n)"


def memory_report(loss_fn: Callable, tx: optax.GradientTransformation, params: Any, *args: Any,
                  **kwargs: Any) -> MemoryReport:
  """Compiled memory of the optax step and of the fused steps, without running anything.

  Each mode's step is ``jax.jit(fx.value_and_update(loss_fn), donate_argnums=(0, 1))`` lowered
  for ``params``, ``fx.init``'s state and ``args``/``kwargs``, then compiled for the default
  backend. Whether ``loss_fn`` returns ``(loss, aux)`` is read from its abstract output.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)``, as given to ``fx.value_and_update``.
    tx: the optax transformation.
    params: params or their ``jax.ShapeDtypeStruct``s.
    *args: positional arguments of ``loss_fn``: arrays or ``jax.ShapeDtypeStruct``s.
    **kwargs: keyword arguments of ``loss_fn``.

  Returns:
    A ``MemoryReport``: a mapping from "off", "backward", "forward" to dicts with
    ``peak_bytes``, ``temp_bytes``, ``argument_bytes``, ``output_bytes`` and ``alias_bytes``.
    A mode that cannot run ``tx`` (a non-separable transform in backward mode, a mode this
    version does not implement) is left out and its reason kept in ``report.unavailable``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    >>> x = jax.ShapeDtypeStruct((8, 512), jnp.float32)
    >>> loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    >>> report = optfuse.memory_report(loss, optax.adamw(1e-3), params, x)
    >>> report["off"]["argument_bytes"] >= 3 * 512 * 512 * 4  # params, mu and nu
    True
  """
  has_aux = loss_has_aux(loss_fn, params, *args, **kwargs)
  rows, unavailable = {}, {}
  for mode in MODES:
    try:
      fx = _fuse.fuse(tx, mode=mode)
      compiled = lower_step(fx, loss_fn, params, args, kwargs, has_aux=has_aux).compile()
    except UNAVAILABLE_ERRORS as e:
      unavailable[mode] = f"{type(e).__name__}: {e}"
      continue
    rows[mode] = compiled_memory(compiled)
  return MemoryReport(rows, unavailable)
