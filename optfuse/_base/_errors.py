"""Named exceptions raised by optfuse.

Every refusal is one of these: the message names the offending transform, leaf path or argument
and says what to do instead.
"""


class OptfuseError(Exception):
  """Base class of every error raised by optfuse."""


class NonSeparableError(OptfuseError, ValueError):
  """The optimizer's update of one leaf depends on the gradients of other leaves.

  Backward fusion updates each leaf as soon as its own gradient is complete, so it is exact only
  for separable transforms. Use ``mode="forward"`` (exact for every transform) or ``mode="off"``.
  """


class StateMismatchError(OptfuseError, ValueError):
  """The optimizer state does not belong to this optimizer and these params."""


class ParamsStructureError(OptfuseError, ValueError):
  """The params passed to a step are not the params the state was built for."""


class LossOutputError(OptfuseError, TypeError):
  """The loss function returned something other than a float scalar (and aux, with has_aux)."""


class UnknownModeError(OptfuseError, ValueError):
  """``fuse`` was called with a mode other than "backward", "forward" or "off"."""


class OptionsError(OptfuseError, ValueError):
  """Two values of the same fusion option that disagree.

  Raised when an entry point is given an ``options=`` value and a keyword that contradicts it
  (``fuse(tx, mode="off", options=FuseOptions("forward"))``), or when ``train_step`` is given
  options that contradict those an ``optfuse.linen.TrainState`` was created with (its
  ``opt_state`` was built for its own). Pass the options once.
  """


class MicrobatchError(OptfuseError, ValueError):
  """The step's arguments cannot be split into the requested number of microbatches."""


class BudgetError(OptfuseError, ValueError):
  """A memory budget that cannot be read, or that no batch size can bound.

  Budgets are positive byte counts: an int, or a string such as "24GB", "80GiB" or "1.5 GB"
  (decimal kB, MB, GB, TB; binary KiB, MiB, GiB, TiB).
  """


class TargetError(OptfuseError, ValueError):
  """A compile target that optfuse does not know, or whose compiler is not installed.

  Targets are the names of ``optfuse.targets()`` ("tpu-v5e", "tpu-v6e:2x2", "h100", "t4"...), a
  ``jax.experimental.topologies.TopologyDescription``, a ``jax.sharding.Mesh`` or a sequence of
  devices. The TPU compiler comes with ``pip install "optfuse[tpu]"`` (libtpu), the GPU compiler
  with ``pip install "optfuse[cuda]"``.
  """


class OffloadError(OptfuseError, ValueError):
  """``offload`` was given a value other than ``None`` or "state", or a mode it does not run in.

  ``offload="state"`` keeps the optimizer state in host memory; it runs in ``mode="backward"``
  and ``mode="forward"`` (streamed row by row through the fused loops) and ``mode="off"``
  (fetched whole for optax's update), not with ``global_ops="two_pass"``. Also raised when a
  step is given a state whose slots are in device memory.
  """


class GuardError(OptfuseError, ValueError):
  """``guard`` was given a value other than ``True`` or ``False``, or ``True`` in a mode it
  does not guard.

  The memory guard (``fuse``'s ``guard``) compiles backward mode's step for its input shapes
  and keeps only the loops that lower its peak: it runs in ``mode="backward"``.
  """


class LowBitError(OptfuseError, ValueError):
  """``low_bit`` was given bits other than 8 or 4, a block size that is not a positive multiple
  of 8, or an inner transformation with a large float slot shaped like no parameter.

  ``low_bit`` quantizes elementwise slots (Adam's ``mu`` and ``nu``, momentum traces), each
  shaped like its parameter. Wrap only the elementwise part of a chain, or pass ``slot_map``
  returning ``None`` for the slots to keep as they are.
  """


class MuonDimsError(OptfuseError, ValueError):
  """``stacked_muon_dims`` cannot number a leaf's axes as Muon's matrices.

  Raised when the layer axis is out of range for a leaf taken as stacked (pass ``layer_axis``,
  or ``stacked`` to say which leaves carry it), or when a ``matrix`` rule returns axes that are
  not a matrix of one layer: an axis out of range, an axis on both sides, or a side empty.
  """


class LayerAxesError(OptfuseError, ValueError):
  """``per_layer`` cannot read which leaves are stacked, and on which axis.

  Raised when its ``layer_axes`` is not a pytree prefix of the params, or gives a leaf an axis
  that is not an int or is out of the leaf's range. Give one axis (or ``None``, not stacked) per
  leaf or per subtree: ``{"layers": 0, "head": None}``.
  """


class TracingError(OptfuseError, RuntimeError):
  """A backward rule of a fused step was not traced with the pass it belongs to.

  Raised when a float param leaf has no backward rule in the step, or when two-pass backward
  finds one of its rules traced outside the pullback it belongs to (or not traced in it: a
  transpose JAX reused from another trace). The step is never compiled with an update it cannot
  vouch for; the message names the leaves. Report it as a bug, with the loss.
  """
