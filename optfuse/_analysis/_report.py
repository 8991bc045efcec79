"""Compile-only memory report: how much device memory a training step needs, before it runs.

``memory_report`` lowers and compiles ``jax.jit(step, donate_argnums=(0, 1))`` for the optax step
(mode "off") and the fused steps, and reads XLA's buffer assignment from
``compiled.memory_analysis()``. Nothing is allocated or run: params and arguments may be
``jax.ShapeDtypeStruct`` values, so a model that does not fit on the device can still be measured.

The peak is ``argument + temp + output - alias`` bytes: the step's inputs, its scratch buffers
and its outputs, minus the outputs written into donated input buffers.

``target=`` compiles for another accelerator's compiler (``_registry``: TPU v5e, H100...)
without its hardware. A compiler that refuses a program for want of memory (the TPU compiler's
``RESOURCE_EXHAUSTED ... exceeds available HBM``) answers "does not fit", with the bytes it says
it needed, instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optax

from optfuse import _fuse
from optfuse._analysis import _auto, _memory
from optfuse._analysis._memory import MODES, TRANSFER_FIELDS, UNAVAILABLE_ERRORS
from optfuse._base import _options
from optfuse._base._errors import OffloadError
from optfuse._base._options import NOT_GIVEN, FuseOptions, NotGiven
from optfuse._targets import _registry
from optfuse._targets._compiled import FIELDS, HOST_FIELDS, DoesNotFit, format_bytes


class MemoryReport(Mapping):
  """Compiled memory per mode: ``report[mode]`` is a dict with the keys of ``FIELDS`` (bytes).

  Modes that cannot run this optimizer are absent from the mapping; ``unavailable`` maps them to
  the reason (the exception's name and message). Modes the compiler refused for want of memory
  are absent too; ``does_not_fit`` maps them to the refusal. ``str(report)`` is a table.

  Attributes:
    unavailable: mode -> why it could not be compiled.
    does_not_fit: mode -> the compiler's ``DoesNotFit`` (the bytes it needed).
    target: the compile target's name ("cpu" for this machine's default backend).
    budget_bytes: the memory one device may use on that target, or ``None`` if unknown.
    budget_source: where ``budget_bytes`` comes from.
    offload_plan: with ``offload="auto"``, the ``OffloadPlan`` of the backward row (what each
      leaf streams to fit ``budget_bytes``, and why); else ``None``.
  """

  def __init__(self, rows: Mapping[str, Mapping[str, int]], unavailable: Mapping[str, str],
               does_not_fit: Mapping[str, DoesNotFit] | None = None, target: str | None = None,
               budget_bytes: int | None = None, budget_source: str = "unknown",
               offload_plan: Any = None):
    self._rows = {mode: dict(row) for mode, row in rows.items()}
    self.offload_plan = offload_plan
    self.unavailable = dict(unavailable)
    self.does_not_fit = dict(does_not_fit or {})
    self.target = target
    self.budget_bytes = budget_bytes
    self.budget_source = budget_source

  def __getitem__(self, mode: str) -> dict[str, int]:
    return self._rows[mode]

  def __iter__(self) -> Iterator[str]:
    return iter(self._rows)

  def __len__(self) -> int:
    return len(self._rows)

  def fits(self, mode: str) -> bool | None:
    """Whether ``mode``'s step fits the target's budget (``None``: no budget is known).

    Raises:
      KeyError: ``mode`` was not compiled (unavailable, or not a mode).
    """
    if mode in self.does_not_fit:
      return False
    peak = self._rows[mode]["peak_bytes"]
    return None if self.budget_bytes is None else peak <= self.budget_bytes

  def table(self) -> str:
    """The report as a fixed-width text table, one line per mode."""
    header = ["mode", "peak", "temp", "arguments", "outputs", "aliased", "peak vs off"]
    host = any(row.get("host_bytes") for row in self._rows.values())
    moves = any(row.get("host_transfer_bytes") for row in self._rows.values())
    if host:
      header.insert(6, "host")
    if moves:
      header.insert(6 + host, "host transfers")
    budget = self.budget_bytes is not None
    if budget:
      header.append("fits")
    base = self._rows["off"]["peak_bytes"] if "off" in self._rows else None
    rows = {}
    for mode, row in self._rows.items():
      ratio = f"{row['peak_bytes'] / base:.2f}x" if base else "-"
      fields = FIELDS + HOST_FIELDS[:host] + TRANSFER_FIELDS[:moves]
      rows[mode] = [mode, *(format_bytes(row.get(k)) for k in fields), ratio]
      if budget:
        rows[mode].append("yes" if self.fits(mode) else "no")
    lines = _memory.mode_table(header, rows, self.unavailable, self.does_not_fit)
    if self.target is not None:
      within = (f", budget {format_bytes(self.budget_bytes)} per device ({self.budget_source})"
                if budget else "")
      lines.append(f"compiled for {self.target}{within}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()

  def __repr__(self) -> str:
    return f"MemoryReport(\n{self.table()}\n)"


def memory_report(loss_fn: Callable, tx: optax.GradientTransformation, params: Any, *args: Any,
                  target: Any = None, options: FuseOptions | None = None,
                  offload: str | None | NotGiven = NOT_GIVEN, guard: bool | None = None,
                  state_bits: int | None = None, global_ops: str | None | NotGiven = NOT_GIVEN,
                  microbatches: int | None = None, **kwargs: Any) -> MemoryReport:
  """Compiled memory of the optax step and of the fused steps, without running anything.

  Each mode's step is ``jax.jit(fx.value_and_update(loss_fn), donate_argnums=(0, 1))`` lowered
  for ``params``, ``fx.init``'s state and ``args``/``kwargs``, then compiled for the default
  backend or for ``target``. Whether ``loss_fn`` returns ``(loss, aux)`` is read from its
  abstract output. Every mode is compiled with the options given, in that mode
  (``FuseOptions.for_mode``: ``global_ops`` and ``guard``, which only backward mode reads, are
  left out of the others), as ``max_batch_size`` compiles them.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)``, as given to ``fx.value_and_update``.
    tx: the optax transformation.
    params: params or their ``jax.ShapeDtypeStruct`` values.
    *args: positional arguments of ``loss_fn``: arrays or ``jax.ShapeDtypeStruct`` values.
    target: the compiler to compile for (a reserved keyword, not passed to ``loss_fn``):
      ``None`` for this machine's default backend, a name of ``optfuse.targets()``
      ("tpu-v5e", "tpu-v5e:2x2", "h100", "t4"...), a ``jax.sharding.Mesh``, a
      ``TopologyDescription`` or a sequence of devices. Memory is per device; on several
      devices the step is data parallel unless the inputs carry their own shardings.
    options: the ``FuseOptions`` of the fused steps (a reserved keyword too), in place of
      ``offload``, ``guard`` and ``global_ops``; its ``mode`` is not read (every mode is
      compiled).
    offload: ``"state"`` compiles every mode with ``optfuse.fuse(tx, mode,
      offload="state")`` (a reserved keyword too): the state's slots in host memory, reported
      apart as ``host_bytes``; ``"params"`` the fused modes with the param stacks of their
      loops in host memory too (``optfuse.params_to_host``; mode "off" is unavailable);
      ``"auto"`` backward mode with what each leaf streams planned to fit the target's memory
      (``optfuse.place``; ``report.offload_plan`` says what, and why; the other modes are
      unavailable).
    guard: ``True`` compiles backward mode with ``optfuse.fuse(tx, guard=True)`` (a reserved
      keyword too): its loops kept only where they lower the peak on ``target``.
    state_bits: 8 or 4 plans ``optfuse.low_bit(tx, bits=state_bits)`` (a reserved keyword
      too): the state's slots in 8 or 4 bits; ``None`` or 32 plans ``tx`` as it is.
    global_ops: passed to ``optfuse.fuse`` (a reserved keyword too): ``"two_pass"`` compiles
      backward mode as two passes, so a clipped ``tx`` reports a backward row.
    microbatches: passed to ``fx.value_and_update`` (a reserved keyword too): each step splits
      its arguments into this many microbatches along their leading axis.
    **kwargs: keyword arguments of ``loss_fn``.

  Returns:
    A ``MemoryReport``: a mapping from "off", "backward", "forward" to dicts with
    ``peak_bytes``, ``temp_bytes``, ``argument_bytes``, ``output_bytes`` and ``alias_bytes``
    (device memory), ``host_bytes`` (host memory the step uses: the offloaded state) and
    ``host_transfer_bytes`` (the bytes each step moves between host and device memory, both
    ways: every ``device_put`` across memory spaces of the traced step, each loop's times its
    trip count, as ``_transfers.traced_transfer_bytes`` counts them; the TPU and GPU compilers'
    host copies move exactly these, and XLA:CPU, whose host memory is its device memory, none).
    A mode that cannot run ``tx`` (a non-separable transform in backward mode, a mode this
    version does not implement) is left out and its reason kept in ``report.unavailable``; a
    mode the compiler refused for want of memory is left out and kept in
    ``report.does_not_fit``. ``report.fits(mode)`` compares each peak with the target's memory.

  Raises:
    TargetError: ``target`` is unknown or its compiler is not installed (the message names the
      pip extra that installs it).
    LowBitError: ``state_bits`` is not ``None``, 32, 8 or 4.
    UnknownModeError, OffloadError, GuardError: the options make a combination that does not
      run, as ``optfuse.fuse`` raises them (backward mode's: ``guard`` and ``global_ops``
      are backward mode's options).
    OptionsError: ``options`` is given with a keyword that contradicts it.
    MicrobatchError: ``microbatches`` is not a positive int or ``None``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    >>> x = jax.ShapeDtypeStruct((8, 512), jnp.float32)
    >>> loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    >>> report = optfuse.memory_report(loss, optax.adamw(1e-3), params, x)
    >>> report["off"]["argument_bytes"] >= 3 * 512 * 512 * 4  # params, mu and nu
    True
  """
  given = _options.resolve(options, global_ops=global_ops, offload=offload, guard=guard)
  given.check_microbatches(microbatches)
  resolved = _registry.resolve(target)
  tx = _memory.with_state_bits(tx, state_bits)
  has_aux = _memory.loss_has_aux(loss_fn, params, *args, **kwargs)
  rows, unavailable, refused = {}, {}, {}
  name, budget, source = _memory.target_budget(resolved)
  plan = None
  for mode in MODES:
    try:
      fx = _fuse.fuse(tx, options=given.for_mode(mode))
      if fx.offload == "auto":
        if budget is None:
          raise OffloadError(f"offload='auto' plans for the target's memory, and {name}'s is "
                             f"not known ({source}): name a target with a known memory.")
        plan = _auto.plan_offload(fx, loss_fn, params, *args, budget=budget, target=resolved,
                                  microbatches=microbatches, **kwargs)
        memory = plan.memory
      else:
        memory = _memory.step_memory(fx, loss_fn, params, args, kwargs, has_aux=has_aux,
                             target=resolved, microbatches=microbatches)
    except UNAVAILABLE_ERRORS as e:
      unavailable[mode] = f"{type(e).__name__}: {e}"
      continue
    if isinstance(memory, DoesNotFit):
      refused[mode] = memory
    else:
      rows[mode] = memory
  return MemoryReport(rows, unavailable, refused, name, budget, source, plan)
