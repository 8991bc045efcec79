"""The largest batch that fits a memory budget, found from compiled memory alone.

``max_batch_size`` compiles each mode's training step (``_memory.lower_step``) for the
batch sizes a search asks for and compares XLA's compiled peak with the budget: batches 1 and 2,
then the secant of the measured peaks (a step's peak is close to affine in its batch), kept
between the largest batch known to fit and the smallest known not to (``largest_affine``).
Nothing is allocated or run, and no (mode, batch) is compiled twice. The answer
is exact for the search's own test: the step at the returned batch fits, the step one batch
(one multiple of ``microbatches``) larger does not.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optfuse import _fuse
from optfuse._analysis import _memory
from optfuse._base import _checks, _options
from optfuse._base._errors import BudgetError
from optfuse._base._options import NOT_GIVEN, FuseOptions, NotGiven
from optfuse._targets import _registry
from optfuse._targets._compiled import format_bytes

# Decimal units as XLA and ``format_bytes`` print them, binary ones as allocators count.
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)

# A search that compiles more often than this shows a progress bar (big models compile for
# seconds to minutes each on CPU).
QUIET_COMPILES = 3


def parse_budget(budget: int | float | str) -> int:
  """A memory budget in bytes.

  Args:
    budget: a positive number of bytes (an int, or a float such as ``24e9``), or a string: a
      number and a unit, "24GB", "80GiB", "512MB", "1.5 GB" (decimal kB, MB, GB, TB; binary
      KiB, MiB, GiB, TiB; case-insensitive; no unit or "B": bytes).

  Returns:
    The budget in whole bytes, rounded down.

  Raises:
    BudgetError: ``budget`` is not a positive number of bytes or such a string.

  Examples:
    >>> from optfuse._analysis._fit import parse_budget
    >>> parse_budget("24GB"), parse_budget("1.5 GiB"), parse_budget(512)
    (24000000000, 1610612736, 512)
  """
  if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
    raise BudgetError(f"a memory budget is a number of bytes or a string such as '24GB', got "
                      f"{budget!r}.")
  if isinstance(budget, str):
    match = _BUDGET.fullmatch(budget.strip())
    if match is None or match.group(2).lower() not in UNITS:
      raise BudgetError(
          f"cannot read the memory budget {budget!r}: write a number of bytes and a unit, such as "
          "'24GB', '80GiB' or '1.5 GB' (units: kB, MB, GB, TB, KiB, MiB, GiB, TiB).")
    value = Fraction(match.group(1)) * UNITS[match.group(2).lower()]
  elif isinstance(budget, float) and not math.isfinite(budget):
    raise BudgetError(f"a memory budget must be finite, got {budget!r}.")
  else:
    value = Fraction(budget)
  if value < 1:
    raise BudgetError(f"a memory budget must be at least one byte, got {budget!r}.")
  return math.floor(value)


def _args_bytes(args) -> int:
  return sum(math.prod(jnp.shape(x)) * jnp.dtype(jnp.result_type(x)).itemsize
             for x in jax.tree.leaves(args))


def _as_args(args) -> tuple:
  return args if isinstance(args, tuple) else (args,)


class FitReport(Mapping):
  """The largest batch per mode: ``report[mode]`` is an int (0: batch 1 does not fit).

  Modes that cannot run the optimizer are absent from the mapping; ``unavailable`` maps them to
  the reason (the exception's name and message). ``str(report)`` is a table. A ``FitReport``
  compares equal to the dict of its batches.

  Attributes:
    budget_bytes: the budget the batches fit, in bytes (per device).
    budget_source: where the budget comes from ("given", or the target's memory).
    target: the compile target's name ("cpu" for this machine's default backend).
    microbatches: the number of microbatches per step (batches are multiples of it), or ``None``.
    multiple: the batches searched are multiples of it: the microbatches times the devices the
      batch is split over.
    peaks: mode -> {batch: compiled peak bytes} for every batch the search compiled.
    does_not_fit: mode -> {batch: the compiler's ``DoesNotFit``} for every batch the compiler
      refused for want of memory (those batches are absent from ``peaks``).
    unavailable: mode -> why it could not be compiled.
    max_batch: the largest batch searched, or ``None`` (no cap); see ``capped``.
  """

  def __init__(self, batches: Mapping[str, int], peaks: Mapping[str, Mapping[int, int]],
               unavailable: Mapping[str, str], budget_bytes: int,
               microbatches: int | None = None, *,
               does_not_fit: Mapping[str, Mapping[int, _memory.DoesNotFit]] | None = None,
               target: str | None = None, budget_source: str = "given",
               multiple: int | None = None, max_batch: int | None = None):
    self._batches = dict(batches)
    self.peaks = {mode: dict(sorted(p.items())) for mode, p in peaks.items()}
    self.does_not_fit = {mode: dict(sorted(r.items())) for mode, r in (does_not_fit or {}).items()
                         if r}
    self.unavailable = dict(unavailable)
    self.budget_bytes = budget_bytes
    self.budget_source = budget_source
    self.target = target
    self.microbatches = microbatches
    self.multiple = multiple or microbatches or 1
    self.max_batch = max_batch

  def __getitem__(self, mode: str) -> int:
    return self._batches[mode]

  def __iter__(self) -> Iterator[str]:
    return iter(self._batches)

  def __len__(self) -> int:
    return len(self._batches)

  def capped(self, mode: str) -> bool:
    """Whether ``mode`` fits at ``max_batch``, the cap of the search: larger batches were not
    tried, so they may fit too."""
    return self.max_batch is not None and self._batches[mode] == self.max_batch

  def next_batch(self, mode: str) -> int | None:
    """The smallest batch larger than ``self[mode]`` that the search tried: it does not fit
    (``None`` when ``mode`` reached the cap ``max_batch`` and no larger batch was tried)."""
    return None if self.capped(mode) else self._batches[mode] + self.multiple

  def table(self) -> str:
    """The report as a fixed-width text table, one line per mode."""
    header = ["mode", "max batch", "peak at max", "next batch", "its peak", "compiles"]
    rows = {}
    for mode, batch in self._batches.items():
      nxt, peaks = self.next_batch(mode), self.peaks[mode]
      refused = self.does_not_fit.get(mode, {})
      its_peak = ("not tried (the cap)" if nxt is None else
                  f"compiler: needs {format_bytes(refused[nxt].needed_bytes)}"
                  if nxt in refused else format_bytes(peaks.get(nxt)))
      rows[mode] = [mode, str(batch), format_bytes(peaks.get(batch)),
                    "-" if nxt is None else str(nxt), its_peak, str(len(peaks) + len(refused))]
    title = (f"largest batch within {format_bytes(self.budget_bytes)} "
             f"({self.budget_bytes} bytes) of compiled peak memory")
    if self.target is not None:
      title += f" per device on {self.target} ({self.budget_source})"
    if self.microbatches:
      title += f", in multiples of {self.microbatches} microbatches"
    if self.multiple != (self.microbatches or 1):
      title += f", in multiples of {self.multiple} (the batch split over the devices)"
    if self.max_batch is not None:
      title += f", searched up to batch {self.max_batch}"
    return "\n".join([title, *_memory.mode_table(header, rows, self.unavailable)])

  def __str__(self) -> str:
    return self.table()

  def __repr__(self) -> str:
    return f"FitReport(\n{self.table()}\n)"


class _Progress:
  """Counts the compiles of a search; shows a bar (tqdm, when installed) after a few."""

  def __init__(self, enabled: bool):
    self.enabled, self.count, self.bar = enabled, 0, None

  def start(self, label: str) -> None:
    """A compile of ``label`` begins."""
    if self.bar is None and self.enabled and self.count >= QUIET_COMPILES:
      try:
        with warnings.catch_warnings():
          # tqdm.auto warns in a notebook without ipywidgets, then falls back to a text bar.
          warnings.simplefilter("ignore")
          from tqdm.auto import tqdm  # optional: the bench and test extras install it
      except ImportError:
        self.enabled = False
      else:
        self.bar = tqdm(desc="optfuse.max_batch_size", initial=self.count,
                        bar_format="{desc}: {n} compiles, {elapsed}{postfix}")
    if self.bar is not None:
      self.bar.set_postfix_str(label)

  def done(self) -> None:
    """The compile that began last has finished."""
    self.count += 1
    if self.bar is not None:
      self.bar.update()

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


# The most an unbracketed search multiplies the largest k known to fit by in one probe.
GROWTH = 16


def largest_affine(peak: Callable[[int], int | None], budget: int, lower: int = 1,
                   guesses: Sequence[int] = (1, 2), slope: float | None = None,
                   upper: int | None = None) -> int:
  """The largest ``k >= lower`` with ``peak(k) <= budget`` (``lower - 1`` if none), for a peak
  that grows with ``k`` and is close to affine in it (a scanned model's depth). With ``upper``,
  ``k`` is at most ``upper`` and nothing above it is asked (``upper`` is returned if it fits).

  ``peak(k)`` is the compiled peak, or ``None`` where the compiler refused ``k`` for want of
  memory. The search asks ``guesses`` first (a good guess and the one after it answer in two
  calls), then the secant through the two measured peaks nearest the boundary, kept strictly
  between the largest ``k`` known to fit and the smallest known not to (bisection once the
  secant has had three tries at a closed bracket; before any ``k`` fails it grows at most
  ``GROWTH`` times the largest that fits). ``slope`` (bytes per ``k``, say from another
  compiler's peaks) aims the next probe while only one peak is known, as when the compiler
  refuses every probe above the boundary. The answer is exact whatever the peaks: ``k`` fits and
  ``k + 1`` does not, and each ``k`` is asked once.
  """
  known: dict[int, int | None] = {}

  def fits(k: int) -> bool:
    if k not in known:
      known[k] = peak(k)
    return known[k] is not None and known[k] <= budget

  def secant() -> int:
    measured = sorted((k for k in known if known[k] is not None),
                      key=lambda k: (abs(k - lo), -k))[:2]
    rate = slope
    if len(measured) == 2:
      a, b = measured
      rate = (known[a] - known[b]) / (a - b)
    if measured and rate is not None and rate > 0:
      a = measured[0]
      aim = a + int((budget - known[a]) // rate)
      # Unbracketed, grow at most 16x a step: peaks nearly equal at two small k (a compiler
      # that pads the batch, buffers it keeps out of device memory) aim the secant at a k
      # whose program no compiler can build.
      return aim if hi is not None else min(aim, GROWTH * max(lo, 1))
    return 2 * max(lo, 1) if hi is None else (lo + hi) // 2

  lo, hi, tries = lower - 1, None if upper is None else max(upper, lower - 1) + 1, 3
  queue = [g for g in guesses if g >= lower and (upper is None or g <= upper)]
  while hi is None or hi - lo > 1:
    aimed = not queue and (hi is None or tries > 0)
    probe = queue.pop(0) if queue else secant() if aimed else (lo + hi) // 2
    if aimed and hi is not None and probe >= hi and hi not in known:
      probe = hi - 1  # the secant points past the cap: ask the cap itself
    elif aimed and (probe < lo or (hi is not None and probe >= hi)):
      # The secant points outside the bracket: the peaks are not affine there (the compiler
      # keeps small buffers out of device memory, say), so halve the bracket instead.
      probe = 2 * max(lo, 1) if hi is None else (lo + hi) // 2
    tries -= aimed and hi is not None
    probe = max(probe, lo + 1) if hi is None else min(max(probe, lo + 1), hi - 1)
    if fits(probe):
      lo = probe
    else:
      hi = probe
  return lo


def _cap(max_batch: int | None, unit: int) -> int | None:
  """``max_batch`` in multiples of ``unit``, checked."""
  if max_batch is None:
    return None
  if not _checks.is_positive_int(max_batch) or max_batch < unit:
    raise BudgetError(
        f"max_batch must be an int of at least {unit} (the devices the batch is split over times "
        f"the microbatches: the smallest batch searched), got {max_batch!r}; pass None to "
        "search without a cap.")
  return max_batch // unit


def resolve_budget(budget_bytes: int | float | str | None, target: _registry.Target | None
                   ) -> tuple[int, str]:
  """The budget in bytes and where it comes from: given, or the target's memory.

  Raises:
    BudgetError: no budget is given and the target's memory is unknown, or it cannot be read.
  """
  if budget_bytes is not None:
    return parse_budget(budget_bytes), "given"
  _, memory, source = _memory.target_budget(target)
  if memory is None:
    raise BudgetError(
        "no memory budget given and the target's memory is unknown: pass budget_bytes (such as "
        "'24GB'), or a target of optfuse.targets() such as target='tpu-v5e'.")
  return memory, source


def max_batch_size(loss_fn: Callable, tx: optax.GradientTransformation, params: Any,
                   args_for: Callable[[int], Any], budget_bytes: int | float | str | None = None,
                   *, target: Any = None, modes: Sequence[str] | None = None,
                   options: FuseOptions | None = None,
                   global_ops: str | None | NotGiven = NOT_GIVEN,
                   microbatches: int | None = None, offload: str | None | NotGiven = NOT_GIVEN,
                   guard: bool | None = None, state_bits: int | None = None,
                   max_batch: int | None = None, progress: bool = True) -> FitReport:
  """The largest batch whose compiled training step fits ``budget_bytes``, per mode.

  For each mode, ``jax.jit(fx.value_and_update(loss_fn), donate_argnums=(0, 1))`` is lowered
  for ``params``, ``fx.init``'s state and ``args_for(b)``, compiled for the default backend or
  ``target``, and its peak (``argument + temp + output - alias`` bytes, as in
  ``optfuse.memory_report``) compared with the budget. A batch the compiler refuses for want of
  memory (the TPU compiler checks its HBM) does not fit. Every mode is compiled with the options
  given, in that mode (``FuseOptions.for_mode``), as ``memory_report`` compiles them. The search
  compiles batches 1 and 2, then
  aims at the budget along the secant of the measured peaks (close to affine in the batch), kept
  strictly inside the bracket of batches known to fit and not to: about four compiles per mode,
  each (mode, b) compiled once. Nothing is allocated or run, so ``params`` and the arguments may
  be ``jax.ShapeDtypeStruct`` values of a model that fits nowhere. The search assumes the peak grows
  with the batch; the step at the returned batch fits the budget and the step at the next batch
  does not.

  The figures are XLA's buffer assignment for the compiler of ``target``. On GPU targets the
  default budget is the share of the device that JAX preallocates (75 %, or
  ``XLA_PYTHON_CLIENT_MEM_FRACTION``); leave a margin there: the allocator fragments memory and
  cuDNN and cuBLAS take workspace the compiler does not count.

  Args:
    loss_fn: ``loss_fn(params, *args_for(b))``, as given to ``fx.value_and_update``; whether
      it returns ``(loss, aux)`` is read from its abstract output.
    tx: the optax transformation.
    params: params or their ``jax.ShapeDtypeStruct`` values.
    args_for: ``args_for(b)`` returns the loss's arguments after ``params`` for batch size
      ``b``: a tuple of arrays or ``jax.ShapeDtypeStruct`` values (a single non-tuple value is the
      only argument). Their size must grow with ``b``.
    budget_bytes: the memory budget per device: bytes, or a string such as "24GB", "80GiB",
      "1.5 GB" (decimal kB, MB, GB, TB; binary KiB, MiB, GiB, TiB). By default the target's
      memory (``report.budget_source`` says which).
    target: the compiler to compile for, as in ``optfuse.memory_report``: ``None`` (this
      machine), a name of ``optfuse.targets()`` ("tpu-v5e", "h100"...), a ``Mesh``, a
      ``TopologyDescription`` or a sequence of devices. On a target of several devices the
      batch is split over them (data parallel): ``b`` is the global batch, and only multiples
      of the device count are searched (a batch that does not split would run replicated).
    modes: the modes to search, by default "off", "backward" and "forward".
    options: the ``FuseOptions`` of the fused steps, in place of ``global_ops``, ``offload``
      and ``guard``; its ``mode`` is not read (``modes`` are searched).
    global_ops: passed to ``optfuse.fuse`` in backward mode (``"two_pass"`` lets it run
      clipping; the other modes run it without).
    offload: passed to ``optfuse.fuse``: ``"state"`` searches the steps whose optimizer state
      lives in host memory; the budget bounds device memory.
    guard: passed to ``optfuse.fuse`` in backward mode: ``True`` searches the step whose loops
      are kept only where they lower the peak on ``target``.
    state_bits: 8 or 4 searches ``optfuse.low_bit(tx, bits=state_bits)`` (the state's slots in
      8 or 4 bits); ``None`` or 32 searches ``tx`` as it is.
    microbatches: passed to ``fx.value_and_update``: each step splits its arguments into this
      many microbatches along their leading axis, so only multiples of ``microbatches`` are
      searched and every batch returned is one (``b`` is the whole step's batch, not a
      microbatch's).
    max_batch: the largest batch to search (rounded down to a multiple of the devices times
      the microbatches): a mode whose step fits at ``max_batch`` answers ``max_batch``
      (``report.capped(mode)``) and nothing larger is compiled. ``None``: no cap.
    progress: show a progress bar (tqdm, when installed) once a search has compiled more than
      a few times.

  Returns:
    A ``FitReport``: a mapping from mode to the largest batch that fits, 0 when the smallest
    batch (1, or ``microbatches``) does not. A mode that cannot run ``tx`` (a non-separable
    transform in backward mode without ``global_ops="two_pass"``) is left out and its reason
    kept in ``report.unavailable``; ``report.peaks[mode]`` holds every compiled peak and
    ``report.does_not_fit[mode]`` every refusal of the compiler.

  Raises:
    BudgetError: ``budget_bytes`` cannot be read, or is not given for a target whose memory is
      unknown, or ``args_for(2 * k)`` is no larger than ``args_for(k)`` (no budget would stop
      the search), or ``max_batch`` is not an int at least the smallest batch searched.
    TargetError: ``target`` is unknown or its compiler is not installed.
    UnknownModeError: a mode or ``global_ops`` that ``optfuse.fuse`` does not know.
    OffloadError, GuardError: the options make a combination that does not run, as
      ``optfuse.fuse`` raises them (backward mode's: ``guard`` and ``global_ops`` are backward
      mode's options).
    OptionsError: ``options`` is given with a keyword that contradicts it.
    MicrobatchError: ``microbatches`` is not a positive int or ``None``.
    LowBitError: ``state_bits`` is not ``None``, 32, 8 or 4.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    >>> args_for = lambda b: (jax.ShapeDtypeStruct((b, 256, 256), jnp.float32),)
    >>> loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    >>> fit = optfuse.max_batch_size(loss, optax.adamw(1e-3), params, args_for, "4MB",
    ...                              modes=["off", "backward"])
    >>> sorted(fit), fit["backward"] > 0
    (['backward', 'off'], True)
    >>> peaks = fit.peaks["backward"]  # every batch compiled: b fits, the next does not
    >>> peaks[fit["backward"]] <= 4_000_000 < peaks[fit.next_batch("backward")]
    True
  """
  given = _options.resolve(options, global_ops=global_ops, offload=offload, guard=guard)
  resolved = _registry.resolve(target)
  tx = _memory.with_state_bits(tx, state_bits)
  budget, source = resolve_budget(budget_bytes, resolved)
  unit = given.check_microbatches(microbatches) * (1 if resolved is None else
                                                     len(resolved.devices))
  cap = _cap(max_batch, unit)
  modes = (modes,) if isinstance(modes, str) else tuple(_memory.MODES if modes is None else modes)
  for mode in modes:  # an unknown mode is refused before anything compiles
    if mode not in _options.MODES:
      given.for_mode(mode)
  fused = lambda mode: _fuse.fuse(tx, options=given.for_mode(mode))
  if _args_bytes(_as_args(args_for(2 * unit))) <= _args_bytes(_as_args(args_for(unit))):
    raise BudgetError(
        f"args_for({2 * unit}) returns arguments no larger than args_for({unit}), so the step's "
        "memory does not grow with the batch and no budget bounds it: make args_for(b) return "
        "arrays or jax.ShapeDtypeStructs with a leading axis of size b.")
  has_aux = _memory.loss_has_aux(loss_fn, params, *_as_args(args_for(unit)))
  peaks: dict[str, dict[int, int]] = {mode: {} for mode in modes}
  refused: dict[str, dict[int, _memory.DoesNotFit]] = {mode: {} for mode in modes}
  batches, unavailable = {}, {}
  bar = _Progress(progress)

  def peak(mode: str, b: int) -> int | None:
    bar.start(f"{mode}, batch {b}")
    lowered = _memory.lower_step(fused(mode), loss_fn, params, _as_args(args_for(b)),
                                 has_aux=has_aux, target=resolved, microbatches=microbatches)
    memory = _memory.compile_memory(lowered)
    bar.done()
    if isinstance(memory, _memory.DoesNotFit):
      refused[mode][b] = memory
      return None
    peaks[mode][b] = memory["peak_bytes"]
    return peaks[mode][b]

  try:
    for mode in modes:
      try:
        batches[mode] = unit * largest_affine(lambda k, mode=mode: peak(mode, unit * k), budget,
                                              upper=cap)
      except _memory.UNAVAILABLE_ERRORS as e:
        unavailable[mode] = f"{type(e).__name__}: {e}"
        del peaks[mode], refused[mode]
  finally:
    bar.close()
  name = _memory.target_budget(resolved)[0]
  return FitReport(batches, peaks, unavailable, budget, microbatches, does_not_fit=refused,
                   target=name, budget_source=source, multiple=unit,
                   max_batch=None if cap is None else cap * unit)
