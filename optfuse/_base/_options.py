"""The options of a fused step as one value, validated once where it is made.

Every entry point takes a ``FuseOptions`` (``options=``), or its keyword arguments as a shorthand
that builds one (``resolve``): ``optfuse.fuse``, ``train_step``, the Flax adapters, ``describe``,
``memory_report``, ``max_batch_size`` and ``smallest_slices``. The engines and the reports are
built from that value, so every layer sees options that were checked once, together, by one
table (``refusal``), and a step and its description are built from the same value.

``microbatches`` is not a field of the value: the state and the engine of a fused
transformation are the same for every number of microbatches, which each step chooses
(``value_and_update(loss_fn, microbatches=k)``). The table covers it all the same: the entry
points that build or describe a step take it beside the options and check the two together
(``FuseOptions.check_microbatches``); ``guard=True`` is refused with microbatches, whose update
runs in no loop of the loss.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterator

from optfuse._base._checks import is_positive_int
from optfuse._base._errors import (
  GuardError,
  MicrobatchError,
  OffloadError,
  OptfuseError,
  OptionsError,
  UnknownModeError,
)


class NotGiven(enum.Enum):
  """The default of the ``offload`` and ``global_ops`` keywords: ``None`` is a value of theirs
  (nothing offloaded, no global ops), so an explicit ``None`` is an option given, and "not
  given" needs a value of its own."""

  NOT_GIVEN = "not given"

  def __repr__(self) -> str:
    return "NOT_GIVEN"


NOT_GIVEN = NotGiven.NOT_GIVEN

# What each option accepts.
MODES = ("backward", "forward", "off")
GLOBAL_OPS = (None, "two_pass")
OFFLOADS = (None, "state", "params", "auto")
GUARDS = (False, True)


def refusal(mode, global_ops, offload, guard, microbatches=None) -> OptfuseError | None:
  """The table of what runs: the named error a combination of options raises, or ``None``.

  Args:
    mode: "backward", "forward" or "off".
    global_ops: ``None`` or "two_pass".
    offload: ``None``, "state", "params" or "auto".
    guard: ``True`` or ``False``.
    microbatches: ``None`` or a positive int, the step's (``value_and_update``'s).

  Returns:
    ``None`` when the combination runs; else the error, not raised, whose message names the
    option and what to pass instead: ``UnknownModeError`` (a mode or ``global_ops`` that does
    not exist), ``OffloadError`` (an unknown ``offload``, an ``offload`` with ``global_ops``,
    ``offload="params"`` in mode "off", ``offload="auto"`` outside backward mode or with
    ``global_ops``), ``GuardError`` (a ``guard`` that is not a bool, ``True``
    outside backward mode, with ``offload="params"`` or ``"auto"``, or with microbatches),
    ``MicrobatchError`` (``microbatches`` is not a positive int or ``None``).
  """
  if mode not in MODES:
    return UnknownModeError(f"unknown mode {mode!r}; use one of {', '.join(map(repr, MODES))}.")
  if global_ops not in GLOBAL_OPS:
    return UnknownModeError(f'unknown global_ops {global_ops!r}; use None or "two_pass".')
  if offload not in OFFLOADS:
    return OffloadError(
        f'unknown offload {offload!r}; use None, "state", "params" or "auto".')
  if offload == "auto" and mode != "backward":
    return OffloadError(
        f'offload="auto" chooses per leaf what backward fusion streams, and mode={mode!r} is '
        'not backward fusion. Use mode="backward", or offload="state" or "params" (whole) in '
        f'mode={mode!r}.')
  if offload == "auto" and global_ops is not None:
    return OffloadError(
        f'offload="auto" plans one backward pass, and global_ops={global_ops!r} runs two. Drop '
        'global_ops, or use mode="forward" with offload="state" or "params" for global '
        'clipping with streamed state.')
  if offload == "params" and mode == "off":
    return OffloadError(
        'offload="params" streams params through the fused loops of modes "backward" and '
        '"forward", and mode="off" has none. Use offload="state" (or a fused mode).')
  if offload is not None and global_ops is not None and mode == "forward":
    # forward fusion runs global transforms without global_ops
    return OffloadError(
        f'offload="{offload}" runs without global_ops, and mode="forward" needs none: it runs '
        f'global transforms exactly, with the pending gradient streamed too. Drop '
        f'global_ops={global_ops!r}.')
  if offload is not None and global_ops is not None:
    return OffloadError(
        f'offload="{offload}" runs in modes "backward" and "forward" (and "state" in "off") '
        f'without global_ops, not in mode={mode!r} with global_ops={global_ops!r}. For global '
        'clipping with offloaded state use mode="forward", which streams the pending gradient '
        'too.')
  if not isinstance(guard, bool):
    return GuardError(f"guard must be True or False, not {guard!r}.")
  if guard and mode != "backward":
    return GuardError(f'guard=True guards the loops of mode="backward", not mode={mode!r}; use '
                      'mode="backward", or guard=False.')
  if guard and offload == "params":
    return GuardError(
        'guard=True keeps a loop only where it lowers the peak, else takes its leaves out of '
        'it, and with offload="params" the leaves of the loops are those in host memory, read '
        'a row at a time: out of its loop a stack would be read whole, on the device, which is '
        'what offload="params" avoids (and the guard\'s probes compile the params on the '
        'device). Use guard=False with offload="params", or guard=True with offload="state".')
  if guard and offload == "auto":
    return GuardError(
        'guard=True may take a loop\'s leaves out of it, and offload="auto" plans which loop '
        'stacks stream their params from host memory, read a row at a time only in their '
        'loop (as with offload="params"): a tapped stack would be read whole, on the device, '
        'and the plan\'s peaks are those of every loop fused. Use guard=False with '
        'offload="auto" (the plan fits the step to its budget from compiled peaks), or '
        'guard=True with offload="state".')
  if microbatches is not None and not is_positive_int(microbatches):
    return MicrobatchError(f"microbatches must be a positive int or None, got {microbatches!r}.")
  if guard and microbatches is not None and microbatches > 1:
    return GuardError(
        f"guard=True chooses between fusing the update in the loops of the loss and tapping it, "
        f"and with microbatches={microbatches} the update runs once after the loop over the "
        "microbatches, in no loop: there is nothing to guard. Use guard=False with "
        "microbatches.")
  return None


def combinations(microbatches: tuple = (None, 2)
                 ) -> Iterator[tuple[str, str | None, str | None, bool, int | None]]:
  """Every ``(mode, global_ops, offload, guard, microbatches)`` of accepted values, runnable or
  not, with the given ``microbatches``."""
  return itertools.product(MODES, GLOBAL_OPS, OFFLOADS, GUARDS, microbatches)


@dataclasses.dataclass(frozen=True)
class FuseOptions:
  """How a transformation is fused: ``optfuse.fuse``'s keyword arguments as one immutable value.

  Every option is checked when the value is made (``dataclasses.replace`` makes a new one, checked
  too), so a ``FuseOptions`` always describes a step that runs. Every entry point takes it as
  ``options=``: ``optfuse.fuse(tx, options=options)``, ``optfuse.train_step``,
  ``optfuse.linen.TrainState.create``, ``optfuse.nnx.Optimizer``, ``optfuse.describe``,
  ``optfuse.memory_report``, ``optfuse.max_batch_size`` and ``optfuse.smallest_slices``.

  Attributes:
    mode: "backward", "forward" or "off" (see ``optfuse.fuse``).
    global_ops: ``None`` or ``"two_pass"``.
    offload: ``None``, ``"state"``, ``"params"`` or ``"auto"``.
    guard: whether backward mode keeps only the loops that lower the compiled peak.

  Raises:
    UnknownModeError: ``mode`` is not "backward", "forward" or "off", or ``global_ops`` is not
      ``None`` or "two_pass".
    OffloadError: ``offload`` is not ``None``, "state", "params" or "auto", or is given with
      ``global_ops``, or is "params" in mode "off", or "auto" outside backward mode.
    GuardError: ``guard`` is not a bool, or is ``True`` outside backward mode or with
      ``offload="params"`` or ``"auto"``.

  Examples:
    >>> import optax, optfuse
    >>> options = optfuse.FuseOptions(mode="forward", offload="state")
    >>> fx = optfuse.fuse(optax.adam(1e-3), options=options)
    >>> fx.options
    FuseOptions(mode='forward', global_ops=None, offload='state', guard=False)
    >>> optfuse.fuse(optax.adam(1e-3), mode="forward", offload="state").options == options
    True
    >>> optfuse.FuseOptions(mode="off", guard=True)
    Traceback (most recent call last):
    ...
    optfuse._base._errors.GuardError: guard=True guards the loops of mode="backward", not ...
  """

  mode: str = "backward"
  global_ops: str | None = None
  offload: str | None = None
  guard: bool = False

  def __post_init__(self):
    error = refusal(self.mode, self.global_ops, self.offload, self.guard)
    if error is not None:
      raise error

  def check_microbatches(self, microbatches: int | None) -> int:
    """The number of microbatches of a step with these options, checked with them (``refusal``).

    Returns:
      ``microbatches``, 1 for ``None``.

    Raises:
      MicrobatchError: ``microbatches`` is not a positive int or ``None``.
      GuardError: ``guard=True`` with more than one microbatch.
    """
    error = refusal(self.mode, self.global_ops, self.offload, self.guard, microbatches)
    if error is not None:
      raise error
    return 1 if microbatches is None else microbatches

  def for_mode(self, mode: str) -> FuseOptions:
    """These options in ``mode``, as a report that compares modes compiles each of them
    (``memory_report``, ``max_batch_size``): ``global_ops`` and ``guard``, which only backward
    mode reads, are left out of the other modes.

    Raises:
      UnknownModeError: ``mode`` is not a mode.
      OffloadError: backward mode with ``offload`` and ``global_ops``.
    """
    if mode == "backward":
      return dataclasses.replace(self, mode=mode)
    return dataclasses.replace(self, mode=mode, global_ops=None, guard=False)


def resolve(options: FuseOptions | None, *, mode: str | None = None,
            global_ops: str | None | NotGiven = NOT_GIVEN,
            offload: str | None | NotGiven = NOT_GIVEN,
            guard: bool | None = None) -> FuseOptions:
  """The options an entry point runs with: ``options``, or those its keywords build.

  ``mode`` and ``guard`` left at ``None``, and ``global_ops`` and ``offload`` left at
  ``NOT_GIVEN``, are not given: they take the value of ``options``, or ``FuseOptions``'s
  default. An explicit ``offload=None`` or ``global_ops=None`` is given, and checked against
  ``options`` like any other value.

  Raises:
    OptionsError: ``options`` is not a ``FuseOptions``, or a keyword given contradicts it.
    UnknownModeError, OffloadError, GuardError: the keywords make a combination that does not
      run (``refusal``).
  """
  given = given_options(mode=mode, global_ops=global_ops, offload=offload, guard=guard)
  if options is None:
    return FuseOptions(**given)
  if not isinstance(options, FuseOptions):
    raise OptionsError(f"options must be an optfuse.FuseOptions, not {options!r}.")
  conflicts = {name: value for name, value in given.items() if getattr(options, name) != value}
  if conflicts:
    named = ", ".join(f"{name}={value!r}" for name, value in conflicts.items())
    raise OptionsError(
        f"{named} contradicts options={options!r}: pass each option once, in options or as a "
        f"keyword (dataclasses.replace(options, {named}) is the options with them).")
  return options


def given_options(**keywords) -> dict:
  """The option keywords an entry point was given: those not left at ``NOT_GIVEN``, nor
  ``mode`` or ``guard`` at ``None`` (not a value of theirs)."""
  return {name: value for name, value in keywords.items()
          if value is not NOT_GIVEN and not (value is None and name in ("mode", "guard"))}
