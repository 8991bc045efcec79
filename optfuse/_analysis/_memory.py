"""One training step compiled for its memory: lowered for the default backend or a target,
with ``jax.ShapeDtypeStruct`` inputs, and read from XLA's buffer assignment
(``compiled.memory_analysis()``), with the bytes it moves between host and device memory.

The peak is ``argument + temp + output - alias`` bytes: the step's inputs, its scratch buffers
and its outputs, minus the outputs written into donated input buffers. ``memory_report``
(``_report``) and ``max_batch_size`` (``_fit``) compile their steps here, and
``offload="auto"`` (``_auto``) its candidate placements.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import optax

from optfuse import _fuse
from optfuse._analysis import _params_memory, _streams, _transfers
from optfuse._base import _checks
from optfuse._base._errors import LowBitError, NonSeparableError, OffloadError
from optfuse._low_bit import _transform as _low_bit
from optfuse._targets import _backends, _inputs, _registry
from optfuse._targets._compiled import DoesNotFit, compile_memory

MODES = ("off", "backward", "forward")
# What ``state_bits`` accepts: ``None`` or 32 plans ``tx`` as it is, 8 and 4 ``optfuse.low_bit``.
STATE_BITS = (None, 32, 8, 4)
# Bytes a step moves between host and device memory, apart from the compiler's fields.
TRANSFER_FIELDS = ("host_transfer_bytes",)

# Errors that mean "this mode cannot run this optimizer (yet)", reported as an unavailable row.
UNAVAILABLE_ERRORS = (NotImplementedError, NonSeparableError, OffloadError)


def first_sentence(text: str) -> str:
  """The first sentence of an error message, for one-line table cells."""
  text = " ".join(text.split())
  end = text.find(". ")
  return text if end < 0 else text[:end + 1]


def error_line(e: BaseException) -> str:
  """An exception as one table cell: its type and the first sentence of its message."""
  return f"{type(e).__name__}: {first_sentence(str(e))}"


def with_state_bits(tx: optax.GradientTransformation, state_bits: int | None
                    ) -> optax.GradientTransformation:
  """The transformation a plan with ``state_bits`` compiles: ``tx`` itself for ``None`` or 32,
  ``optfuse.low_bit(tx, bits=state_bits)`` for 8 or 4.

  Raises:
    LowBitError: ``state_bits`` is another value.
  """
  if state_bits is None or (state_bits == 32 and not isinstance(state_bits, bool)):
    return tx
  if isinstance(state_bits, bool) or state_bits not in STATE_BITS:
    raise LowBitError(
        f"state_bits is None or 32 (the state as tx keeps it), 8 or 4 (optfuse.low_bit(tx, "
        f"bits=state_bits)), not {state_bits!r}.")
  return _low_bit.low_bit(tx, bits=state_bits)


def loss_has_aux(loss_fn: Callable, params, *args, **kwargs) -> bool:
  """Whether ``loss_fn`` returns a ``(loss, aux)`` pair, decided from its abstract output."""
  return _checks.returns_pair(loss_fn, params, args, kwargs)


def trace_step(fx: _fuse.FusedTransformation, loss_fn: Callable, params, args: tuple = (),
               kwargs: Mapping[str, Any] | None = None, has_aux: bool = False,
               target: _registry.Target | None = None,
               streams: Mapping[str, str] | None = None, **step_options: Any
               ) -> jax.stages.Traced:
  """Traces ``jax.jit(fx.value_and_update(loss_fn, ...), donate_argnums=(0, 1))`` on the inputs
  ``lower_step`` lowers it for (``traced.lower()`` lowers it only under ``on_target``); with
  ``offload="auto"``, placed as ``streams`` says (``_streams.place_streams``; ``None``:
  nothing streamed)."""
  kwargs = dict(kwargs or {})
  # The offloaded state is laid out from the device-resident init (``_inputs.offloaded_on``).
  init = (fx.init if fx.offload is None
          else _fuse.fuse_with(fx.tx, dataclasses.replace(fx.options, offload=None)).init)
  if target is None:
    state = jax.eval_shape(init, params)
  else:
    params = _inputs.params_on(params, target)
    args, kwargs = _inputs.batch_on((tuple(args), kwargs), target)
    state = _inputs.state_on(init, params, target)
  if fx.offload == "auto":
    params, state = _streams.place_streams(
        fx.tx, params, state, streams or {}, lambda x: _inputs.offloaded_on(x, target))
  elif fx.offload is not None:
    state = _inputs.offloaded_on(state, target)
    params = _params_memory.abstract_params_on_host(fx, loss_fn, params, args, kwargs, target)
  step = jax.jit(fx.value_and_update(loss_fn, has_aux=has_aux, **step_options),
                 donate_argnums=(0, 1))
  with on_target(target):
    return step.trace(params, state, *args, **kwargs)


@contextlib.contextmanager
def on_target(target: _registry.Target | None) -> Iterator[None]:
  """Traces and lowers a step for ``target`` (``None``: this machine's backend as it is)."""
  if target is None:
    yield
    return
  # Host-resident inputs on a compile-only GPU are placed on the target's abstract mesh
  # (``_inputs.offloaded_on``), which the lowering resolves against the concrete one; the
  # step takes the target's per-backend choices (``_backends``).
  with jax.set_mesh(target.mesh), _backends.lowering_for(target):
    yield


def lower_step(fx: _fuse.FusedTransformation, loss_fn: Callable, params, args: tuple = (),
               kwargs: Mapping[str, Any] | None = None, has_aux: bool = False,
               target: _registry.Target | None = None, **step_options: Any
               ) -> jax.stages.Lowered:
  """Lowers ``jax.jit(fx.value_and_update(loss_fn, ...), donate_argnums=(0, 1))``.

  Args:
    fx: the fused transformation.
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    params: params or their ``jax.ShapeDtypeStruct`` values.
    args: positional arguments of ``loss_fn`` (arrays or ``jax.ShapeDtypeStruct`` values).
    kwargs: keyword arguments of ``loss_fn``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    target: a resolved compile target (``optfuse._targets._registry.resolve``), or ``None`` for the
      default backend with the inputs as given.
    **step_options: further keyword arguments of ``fx.value_and_update``.

  Returns:
    The lowered step; its state argument is ``jax.eval_shape(fx.init, params)`` (on a target,
    laid out as ``fx.init`` lays it out from the placed params).
  """
  traced = trace_step(fx, loss_fn, params, args, kwargs, has_aux, target, **step_options)
  with on_target(target):
    return traced.lower()


def step_memory(fx: _fuse.FusedTransformation, loss_fn: Callable, params, args: tuple = (),
                kwargs: Mapping[str, Any] | None = None, has_aux: bool = False,
                target: _registry.Target | None = None, **step_options: Any
                ) -> dict[str, int] | DoesNotFit:
  """The compiled memory of ``lower_step``'s step (the keys of ``FIELDS``, ``HOST_FIELDS`` and
  ``TRANSFER_FIELDS``), or the compiler's ``DoesNotFit`` refusal."""
  traced = trace_step(fx, loss_fn, params, args, kwargs, has_aux, target, **step_options)
  with on_target(target):
    memory = compile_memory(traced.lower())
  if isinstance(memory, DoesNotFit):
    return memory
  return {**memory, "host_transfer_bytes": _transfers.traced_transfer_bytes(traced.jaxpr).total}


def mode_table(header: list[str], rows: Mapping[str, list[str]],
               unavailable: Mapping[str, str], refused: Mapping[str, Any] | None = None
               ) -> list[str]:
  """Fixed-width lines: the header, then one line per mode in ``MODES`` order, the modes of
  ``unavailable`` with the first sentence of their reason, those of ``refused`` (the
  compiler's ``DoesNotFit``) with what the compiler needed."""
  refused = refused or {}
  widths = [max(len(cells[i]) for cells in [header, *rows.values()]) for i in range(len(header))]
  widths[0] = max([widths[0], *map(len, unavailable), *map(len, refused)])
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()
  lines = [fmt(header)]
  for mode in MODES:
    if mode in rows:
      lines.append(fmt(rows[mode]))
    elif mode in unavailable:
      lines.append(fmt([mode, f"unavailable: {first_sentence(unavailable[mode])}"]))
    elif mode in refused:
      lines.append(fmt([mode, str(refused[mode])]))
  return lines


def target_budget(target: _registry.Target | None) -> tuple[str, int | None, str]:
  """The name, per-device budget and budget source of a resolved target (``None``: default)."""
  if target is None:
    return (jax.default_backend(), *_registry.default_budget())
  return target.name, target.memory_bytes, target.memory_source
