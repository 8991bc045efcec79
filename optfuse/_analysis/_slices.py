"""``smallest_slices``: over a list of compile targets, the fewest chips on which each step fits.

For every kind of chip in the list, every layout (data parallel: params and state replicated;
FSDP: each param leaf and its state sharded over the chips) and every step (optax, backward
fusion, backward fusion with the state in host memory), the slices of that kind are tried from
the fewest chips up with ``max_batch_size``; the first on which a batch of one example per chip
fits answers, with the largest batch per chip there. Everything is compile-only.

A slice that does not fit costs one compile (one example per chip), the slice that fits about
four (``max_batch_size``'s search). A single chip is both layouts, so its searches serve both;
data parallel stops at its first slice that does not fit, since every chip holds the whole
model and state and one example whatever the slice (tests/analysis/test_slices.py checks that a
larger slice's peak per chip is no lower).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optfuse._analysis import _fit, _memory
from optfuse._analysis._fsdp import fsdp_axis
from optfuse._base import _checks
from optfuse._base._errors import (
  BudgetError,
  OffloadError,
  OptionsError,
  TargetError,
  UnknownModeError,
)
from optfuse._base._options import FuseOptions
from optfuse._low_bit import _transform as _low_bit
from optfuse._targets import _registry
from optfuse._targets._compiled import format_bytes

# The TPU v5e and v6e slices of 1, 4 and 8 chips, and one of each GPU of the registry.
DEFAULT_TARGETS = ("tpu-v5e", "tpu-v5e:2x2", "tpu-v5e:2x4", "tpu-v6e", "tpu-v6e:2x2",
                   "tpu-v6e:2x4", "t4", "l4", "a100-40gb", "a100-80gb", "h100", "h200")
LAYOUTS = ("data", "fsdp")
# The steps compared: (mode, offload).
STEPS = {"optax": ("off", None), "backward": ("backward", None),
         "backward + offload": ("backward", "state")}


def kind_slices(kind: str) -> tuple[str, ...]:
  """The slices of ``kind`` that ``DEFAULT_TARGETS`` tries (one chip alone for a kind it
  does not name).

  Examples:
    >>> kind_slices("tpu-v5e"), kind_slices("tpu-v4")
    (('tpu-v5e', 'tpu-v5e:2x2', 'tpu-v5e:2x4'), ('tpu-v4',))
  """
  named = tuple(n for n in DEFAULT_TARGETS if n.partition(":")[0] == kind)
  return named or (kind,)


def _fsdp(params: Any, target: _registry.Target, shard_axis: Callable) -> Any:
  n = len(target.devices)

  def place(x):
    spec = [None] * len(x.shape)
    at = shard_axis(tuple(x.shape), n)
    if at is not None:
      spec[at] = "devices"
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=NamedSharding(target.mesh, PartitionSpec(*spec)))

  return jax.tree.map(place, params)


class SliceFit(NamedTuple):
  """The smallest slice of one kind of chip on which one step fits, in one layout.

  Attributes:
    kind: the chip ("tpu-v5e", "h100"...).
    layout: "data" or "fsdp".
    step: "optax", "backward" or "backward + offload".
    target: the smallest slice's name, or ``None`` when no slice tried fits the step.
    chips: its number of chips (0 when none fits).
    batch_per_chip: the largest batch per chip that fits there (0 when none).
    peak_bytes: the compiled peak per chip at that batch (``None`` when none fits).
    budget_bytes: the memory per chip the step must fit.
    tried: the slices compiled for, fewest chips first.
    unavailable: why the step cannot run the optimizer, or ``None``.
    capped: whether ``batch_per_chip`` is the cap of the search (``max_batch_per_chip``), so
      a larger batch was not tried and may fit too.
  """

  kind: str
  layout: str
  step: str
  target: str | None
  chips: int
  batch_per_chip: int
  peak_bytes: int | None
  budget_bytes: int | None
  tried: tuple[str, ...] = ()
  unavailable: str | None = None
  capped: bool = False


class SliceReport(tuple):
  """The ``SliceFit`` of every (kind, layout, step); ``str(report)`` is a markdown table.

  Attributes:
    compiles: the number of steps compiled to answer (searches shared between rows counted
      once).
  """

  def __new__(cls, rows: Sequence[SliceFit] = (), compiles: int = 0):
    report = super().__new__(cls, rows)
    report.compiles = compiles
    return report

  def __str__(self) -> str:
    lines = ["| chip | layout | step | smallest slice | chips | batch per chip | peak per chip "
             "| memory per chip |", "|---|---|---|---|---:|---:|---:|---:|"]
    for f in self:
      where = f.unavailable or f.target or f"none of {', '.join(f.tried) or 'none'}"
      lines.append(f"| {f.kind} | {f.layout} | {f.step} | {where} | {f.chips or '-'} "
                   f"| {f.batch_per_chip or '-'}{' (the cap)' if f.capped else ''} "
                   f"| {format_bytes(f.peak_bytes)} "
                   f"| {format_bytes(f.budget_bytes)} |")
    return "\n".join(lines)

  def __repr__(self) -> str:
    return f"SliceReport(\n{self}\n)"


def _by_kind(names: Sequence[str]) -> dict[str, list[_registry.Target]]:
  kinds: dict[str, list[_registry.Target]] = {}
  for name in names:
    if not isinstance(name, str):
      raise TargetError(f"smallest_slices takes names of optfuse.targets() with their topology "
                        f"('tpu-v5e:2x2'), got {name!r}: it builds each slice from its name.")
    target = _registry.resolve(name)
    kinds.setdefault(target.name.partition(":")[0], []).append(target)
  return {k: sorted(ts, key=lambda t: len(t.devices)) for k, ts in kinds.items()}


def _first_fit(kind: str, layout: str, step: str, slices: Sequence[_registry.Target],
               search: Callable) -> SliceFit:
  mode = STEPS[step][0]
  budget, tried = None, []
  for target in slices:
    try:
      fit = search(target, layout, step)
    except OffloadError as e:  # the step's options do not run: no slice would change that
      return SliceFit(kind, layout, step, None, 0, 0, None, budget, tuple(tried),
                      _memory.error_line(e))
    budget = fit.budget_bytes
    tried.append(target.name)
    if mode in fit.unavailable:
      return SliceFit(kind, layout, step, None, 0, 0, None, budget, tuple(tried),
                      _memory.first_sentence(fit.unavailable[mode]))
    if fit[mode]:
      chips = len(target.devices)
      return SliceFit(kind, layout, step, target.name, chips, fit[mode] // chips,
                      fit.peaks[mode][fit[mode]], budget, tuple(tried),
                      capped=fit.capped(mode))
    if layout == "data":
      break  # every chip holds the whole model, its state and one example on any slice
  return SliceFit(kind, layout, step, None, 0, 0, None, budget, tuple(tried))


def _check(layouts: Sequence[str], steps: Sequence[str]) -> None:
  bad_layouts = [x for x in layouts if x not in LAYOUTS]
  if bad_layouts:
    raise TargetError(f"unknown layouts {bad_layouts} of the params over a slice: choose among "
                      f"{LAYOUTS} ('data': replicated on every chip; 'fsdp': sharded over them).")
  bad_steps = [x for x in steps if x not in STEPS]
  if bad_steps:
    raise UnknownModeError(f"unknown steps {bad_steps}: choose among {tuple(STEPS)} (optax's "
                           "step, backward fusion, backward fusion with offload='state').")


def smallest_slices(loss_fn: Callable, tx: optax.GradientTransformation, params: Any,
                    args_for: Callable[[int], Any], targets: Sequence[str] = DEFAULT_TARGETS,
                    *, layouts: Sequence[str] = LAYOUTS, steps: Sequence[str] = tuple(STEPS),
                    budget_bytes: int | str | None = None,
                    shard_axis: Callable[[tuple, int], int | None] = fsdp_axis,
                    state_bits: int | None = None, max_batch_per_chip: int | None = None,
                    options: FuseOptions | None = None, progress: bool = True) -> SliceReport:
  """For each kind of chip among ``targets``, the fewest chips on which each step fits.

  Every slice is compiled for, never run: a step fits a slice when its compiled peak per chip at
  one example per chip is within the chip's memory (``max_batch_size``'s budget of the target,
  or ``budget_bytes``); the slices of a kind are tried from the fewest chips up, and the first
  that fits answers with ``max_batch_size``'s largest batch there. Under "data" the params and
  the optimizer state are replicated on every chip and the batch split over them; under "fsdp"
  each param leaf is sharded along ``shard_axis(shape, chips)`` and the state like its param.
  A single chip is both layouts. A slice that does not fit costs one compile, the one that fits
  about four; ``report.compiles`` counts them.

  Args:
    loss_fn: ``loss_fn(params, *args_for(b))``.
    tx: the optax transformation.
    params: the params' ``jax.ShapeDtypeStruct`` values (or arrays), without shardings.
    args_for: ``args_for(b)``: the loss's arguments for the global batch ``b``.
    targets: names of ``optfuse.targets()`` with their topologies (such as
      ``"tpu-v5e:2x2"``); by default the TPU v5e and v6e slices of 1, 4 and 8 chips and one
      of each GPU.
    layouts: among "data" and "fsdp".
    steps: among "optax", "backward" and "backward + offload".
    budget_bytes: the memory per chip, if not each target's own.
    shard_axis: the axis FSDP shards a leaf along (``fsdp_axis`` by default).
    state_bits: 8 or 4 to hold the optimizer state in that many bits
      (``optfuse.low_bit(tx, bits=state_bits)``); ``None`` keeps ``tx`` as it is.
    max_batch_per_chip: the largest batch per chip to search: a step that fits it there
      answers it (``SliceFit.capped``) without compiling larger batches, which bounds the
      compiles for a model far smaller than the chips. ``None``: no cap.
    options: the ``FuseOptions`` every step is compiled with (``global_ops``, ``guard``), in
      the mode and with the ``offload`` the step names (``max_batch_size``'s
      ``FuseOptions.for_mode``); ``None``: ``FuseOptions()``. A step its options refuse
      (``offload`` with ``global_ops``) is reported unavailable.
    progress: show ``max_batch_size``'s progress bar during long searches.

  Returns:
    A ``SliceReport``: one ``SliceFit`` per (kind, layout, step), kinds in the order of
    ``targets``.

  Raises:
    TargetError: a target that is unknown, not a name, or whose compiler is not installed; or an
      unknown layout.
    UnknownModeError: an unknown step.
    LowBitError: ``state_bits`` other than ``None``, 8 or 4.
    BudgetError: ``max_batch_per_chip`` is not a positive int.
    OptionsError: ``options`` is not a ``FuseOptions``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    >>> args_for = lambda b: (jax.ShapeDtypeStruct((b, 512), jnp.float32),)
    >>> loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    >>> optfuse.smallest_slices(loss, optax.adamw(1e-3), params, args_for, ["tpu-v5e"],
    ...                         layouts=["zero3"])
    Traceback (most recent call last):
    ...
    optfuse._base._errors.TargetError: unknown layouts ['zero3'] of the params over a slice: ...

    With the TPU compiler installed, ``print(optfuse.smallest_slices(loss, optax.adamw(1e-3),
    params, args_for, ["tpu-v5e", "tpu-v5e:2x2"]))`` prints the table (docs/targets.md).
  """
  _check(layouts, steps)
  if options is not None and not isinstance(options, FuseOptions):
    raise OptionsError(f"options must be an optfuse.FuseOptions, not {options!r}.")
  if max_batch_per_chip is not None and not _checks.is_positive_int(max_batch_per_chip):
    raise BudgetError(f"max_batch_per_chip must be a positive int or None (no cap), got "
                      f"{max_batch_per_chip!r}.")
  base = FuseOptions() if options is None else options
  tx = tx if state_bits is None else _low_bit.low_bit(tx, bits=state_bits)
  kinds = _by_kind(targets)
  cache: dict[tuple, _fit.FitReport] = {}

  def search(target, layout, step):
    single = len(target.devices) == 1
    key = (target.name, "data" if single else layout, step)
    if key not in cache:
      mode, offload = STEPS[step]
      placed = params if layout == "data" or single else _fsdp(params, target, shard_axis)
      cache[key] = _fit.max_batch_size(loss_fn, tx, placed, args_for, budget_bytes,
                                       target=target, modes=(mode,),
                                       options=dataclasses.replace(base, offload=offload),
                                       max_batch=None if max_batch_per_chip is None else
                                       max_batch_per_chip * len(target.devices),
                                       progress=progress)
    return cache[key]

  rows = [_first_fit(kind, layout, step, slices, search)
          for kind, slices in kinds.items() for layout in layouts for step in steps]
  compiles = sum(len(f.peaks[m]) + len(f.does_not_fit.get(m, {})) for f in cache.values()
                 for m in f)
  return SliceReport(rows, compiles)
