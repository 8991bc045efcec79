"""The options of a fused step as one value, validated once where it is made.

``optfuse.fuse(tx, mode, global_ops, offload, guard)`` makes a ``FuseOptions`` of its keyword
arguments; ``train_step``, the Flax adapters, the engines and ``describe`` pass that value on,
so every layer sees options that were checked once, together, and a step and its description
are built from the same value.
"""

from __future__ import annotations

import dataclasses

from optfuse._base._errors import GuardError, OffloadError, UnknownModeError

# What each option accepts.
MODES = ("backward", "forward", "off")
GLOBAL_OPS = (None, "two_pass")
OFFLOADS = (None, "state", "params")


@dataclasses.dataclass(frozen=True)
class FuseOptions:
  """How ``optfuse.fuse`` runs a transformation: its keyword arguments as one immutable value.

  Every option is checked when the value is made (``dataclasses.replace`` makes a new one, checked
  too), so a ``FuseOptions`` always describes a step that runs. Its fields are ``fuse``'s keyword
  arguments: ``optfuse.fuse(tx, **dataclasses.asdict(options))``.

  Attributes:
    mode: "backward", "forward" or "off" (see ``optfuse.fuse``).
    global_ops: ``None`` or ``"two_pass"``.
    offload: ``None``, ``"state"`` or ``"params"``.
    guard: whether backward mode keeps only the loops that lower the compiled peak.

  Raises:
    UnknownModeError: ``mode`` is not "backward", "forward" or "off", or ``global_ops`` is not
      ``None`` or "two_pass".
    OffloadError: ``offload`` is not ``None``, "state" or "params", or is given with
      ``global_ops``, or is "params" in mode "off".
    GuardError: ``guard`` is not a bool, or is ``True`` outside backward mode.

  Examples:
    >>> import dataclasses, optax, optfuse
    >>> fx = optfuse.fuse(optax.adam(1e-3), mode="forward", offload="state")
    >>> fx.options
    FuseOptions(mode='forward', global_ops=None, offload='state', guard=False)
    >>> optfuse.fuse(optax.adam(1e-3), **dataclasses.asdict(fx.options)).options == fx.options
    True
  """

  mode: str = "backward"
  global_ops: str | None = None
  offload: str | None = None
  guard: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise UnknownModeError(
          f"unknown mode {self.mode!r}; use one of {', '.join(map(repr, MODES))}.")
    if self.global_ops not in GLOBAL_OPS:
      raise UnknownModeError(f'unknown global_ops {self.global_ops!r}; use None or "two_pass".')
    self._check_offload()
    if not isinstance(self.guard, bool):
      raise GuardError(f"guard must be True or False, not {self.guard!r}.")
    if self.guard and self.mode != "backward":
      raise GuardError(f'guard=True guards the loops of mode="backward", not mode={self.mode!r}; '
                       'use mode="backward", or guard=False.')

  def _check_offload(self) -> None:
    if self.offload not in OFFLOADS:
      raise OffloadError(
          f'unknown offload {self.offload!r}; use None, "state" or "params".')
    if self.offload == "params" and self.mode == "off":
      raise OffloadError(
          'offload="params" streams params through the fused loops of modes "backward" and '
          '"forward", and mode="off" has none. Use offload="state" (or a fused mode).')
    if self.offload is None or self.global_ops is None:
      return
    if self.mode == "forward":  # forward fusion runs global transforms without global_ops
      raise OffloadError(
          f'offload={self.offload!r} runs without global_ops, and mode="forward" needs none: it '
          f'runs global transforms exactly, with the pending gradient streamed too. Drop '
          f'global_ops={self.global_ops!r}.')
    raise OffloadError(
        f'offload={self.offload!r} runs in modes "backward" and "forward" (and "state" in "off") '
        f'without global_ops, not in mode={self.mode!r} with global_ops={self.global_ops!r}. For '
        'global clipping with offloaded state use mode="forward", which streams the pending '
        'gradient too.')
