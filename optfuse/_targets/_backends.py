"""Choices that depend on the compiler: one table per choice, keyed by platform.

Each entry keeps one line of why; the figures that chose it are in the docs' design page. The
engine builds the ``LoopPolicy`` of a step once, where the step is traced (``loop_policy``), for
the platform it will be lowered for, and passes it down to the loops and row buffers that
apply it; nothing below the engines reads the platform. The platform is discovered at the top
only, through two context variables: the target inside ``lowering_for``
(``optfuse.memory_report`` and ``max_batch_size`` compile for a TPU or GPU target from this CPU
in it), else the placement of the step's inputs inside ``traced_on`` (``optfuse.fuse``'s steps
are traced in it), else this machine's backend. They stay context variables because the step
is traced by ``jax.jit`` between the two: the platform is known where ``jit`` is called and
needed where the traced function starts, with no argument of the user's step to carry it. The
step is traced once: ``lax.platform_dependent`` would stage every platform's alternative and
trace the step once per alternative (a slower compile). A program lowered for another platform
by other means than ``lowering_for`` or placed inputs gets this machine's choices: the same
math, the other compiler's memory.

One choice is made below the engines: ``optfuse.low_bit``'s code search (``CODE_SEARCH``) is
read by the optax transformation itself, which runs in a plain optax step too, with no engine
to pass it a policy.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

from optfuse._targets import _registry

# The target a step is being traced for, when it is not this machine's backend. Set only by
# ``lowering_for``; read at trace time by ``for_platform`` and the memory guard.
_TARGET: contextvars.ContextVar[Any] = contextvars.ContextVar("optfuse_target", default=None)
# Where the traced inputs are placed (``Placement``: their avals' meshes), set by ``traced_on``
# for the duration of one trace: a step lowered by hand for another platform or mesh.
_INPUTS: contextvars.ContextVar[Any] = contextvars.ContextVar("optfuse_inputs", default=None)

# The measurements that chose each entry, with the command that reproduces them, are in the docs'
# design page (docs/design.md, "Choices made per compiler").

# Host-resident slot rows (``offload="state"``) are prefetched an iteration ahead, not read once
# the gradient row exists: lower peaks on the TPU compiler, higher on the GPU compiler.
STREAMED_PREFETCH = {"tpu": True, "cuda": False, "rocm": False, "cpu": True}

# On several devices (FSDP) the row loops prefetch every row a step ahead, but the host-resident
# slot rows (``offload="state"``) and param rows (``offload="params"``) where these say no: they
# are read in the iteration that uses them. A prefetched host row is one more row in device
# memory the whole iteration on the TPU and GPU compilers; XLA:CPU copies a host stack read in
# the iteration it is written in.
SHARDED_STREAMED_PREFETCH = {"tpu": False, "cuda": False, "rocm": False, "cpu": True}
SHARDED_STREAMED_PARAM_PREFETCH = {"tpu": False, "cuda": True, "rocm": True, "cpu": True}

# Forward fusion updates every stacked leaf row by row, not whole in the pending update's
# conditional: the GPU compiler copies the whole params and state around the conditional.
FORWARD_STACKED_ROWS = {"tpu": True, "cuda": True, "rocm": True, "cpu": False}

# Forward fusion picks the pending update with a select per leaf rather than one ``lax.cond``:
# the GPU compiler copies every leaf a conditional updates whole; XLA:CPU does the opposite.
# With ``offload="state"`` the conditional stays on every platform.
PENDING_SELECT = {"tpu": False, "cuda": True, "rocm": True, "cpu": False}

# A fused scan's forward loop carries the param stacks it reads (rows written back behind an
# ``optimization_barrier``): the TPU compiler hoists a whole-stack cast of a loop invariant.
CARRIED_STACKS = {"tpu": True, "cuda": False, "rocm": False, "cpu": False}
# The same choice for two-pass backward, whose forward loop is followed by two backward loops
# over the same stacks: on the TPU compiler carrying them there adds whole-stack copies (TPU v5e,
# the 1.3B decoder with Adafactor's defaults, two-pass: 17.61 GB carried, 8.50 GB read as loop
# invariants, optax 14.94 GB; docs/design.md).
TWO_PASS_CARRIED_STACKS = {"tpu": False, "cuda": False, "rocm": False, "cpu": False}

# The row loops pin each param stack they write to its stored row-major layout: the TPU
# compiler otherwise lays a sliced stack out layer-major, a transposed copy of the whole stack.
STORED_LAYOUTS = {"tpu": True, "cuda": False, "rocm": False, "cpu": False}
# How optfuse.low_bit finds a value's code, per map width: "compact" bucket tables indexed by its
# magnitude's float32 bits above a floor, "raw" ones indexed by its bits (one op, tables 8x
# larger), or "compare" with each of a 16-entry map's 15 thresholds (no gather). XLA:CPU runs a
# fusion holding a gather as a scalar loop, where every op of the index counts. Untimed on TPU
# and GPU, which keep the compact tables.
_COMPACT = {8: "compact", 4: "compact"}
CODE_SEARCH = {"tpu": _COMPACT, "cuda": _COMPACT, "rocm": _COMPACT, "cpu": {8: "raw", 4: "compare"}}


class LoopPolicy(NamedTuple):
  """The per-compiler choices of one traced step's loops, built once per trace
  (``loop_policy``) and passed down to the loops and row buffers that apply them.

  Attributes:
    ordered: the row loops order each read after the value it is combined with
      (``_row_buffers.after``), on one device; on several they prefetch every row.
    stored_layouts: param stacks and host-bound rows are pinned to their row-major layout
      (``STORED_LAYOUTS``, one device only).
    streamed_prefetch: host-resident slot rows are prefetched an iteration ahead
      (``STREAMED_PREFETCH``; on several devices ``SHARDED_STREAMED_PREFETCH``).
    streamed_param_prefetch: host-resident param rows are prefetched an iteration ahead
      (always on one device; on several ``SHARDED_STREAMED_PARAM_PREFETCH``).
    carried_stacks: a fused scan's forward loop carries the param stacks it reads
      (``CARRIED_STACKS``).
    pending_select: forward fusion picks the pending update with a select per leaf
      (``PENDING_SELECT``).
    forward_stacked_rows: forward fusion updates every stacked leaf row by row whose update
      allows it (``FORWARD_STACKED_ROWS``).
  """

  ordered: bool
  stored_layouts: bool
  streamed_prefetch: bool
  streamed_param_prefetch: bool
  carried_stacks: bool
  pending_select: bool
  forward_stacked_rows: bool


def loop_policy(two_pass: bool = False) -> LoopPolicy:
  """The ``LoopPolicy`` of the platform and the devices steps are traced for now (``two_pass``:
  of two-pass backward's step, whose stacks are carried per ``TWO_PASS_CARRIED_STACKS``).

  The row loops are ordered on one device only. On several, the order's dependency would add
  scalar collectives (``_row_buffers.after``), and prefetching the slot rows with the param
  rows keeps XLA from copying the sharded stacks (measured, FSDP on 8 devices: the slot rows
  read unordered in the iteration peaked at 1.14x optax's memory per device, prefetched at
  1.00x); the host-resident rows of streamed stacks, which XLA never copies on the TPU and GPU
  compilers, are read in the iteration there (``SHARDED_STREAMED_PREFETCH``). Nor do they
  leave the slots to a whole pass after the loop there (``Plan.slots_whole``): ordering that
  pass after the loop with ``value_after`` on a sharded stack all-gathers it (measured: 18
  all-gathers more on the FSDP bench's decoder). On one
  device the order holds on every compiler (measured, backward peaks ordered against
  unordered: TPU v5e, the 1.3B decoder at 12 layers 9.83 / 10.58 GB; H100, 24 layers 17.42 /
  17.69 GB). The layout constraint is not partitioned by the SPMD partitioner (a custom call),
  which all-gathers a sharded stack into it every iteration: one device only too.

  Returns:
    The choices of ``for_platform``'s tables, and the device count's.
  """
  ordered = device_count() == 1
  return LoopPolicy(ordered, ordered and for_platform(STORED_LAYOUTS),
                    for_platform(STREAMED_PREFETCH if ordered else SHARDED_STREAMED_PREFETCH),
                    ordered or for_platform(SHARDED_STREAMED_PARAM_PREFETCH),
                    for_platform(TWO_PASS_CARRIED_STACKS if two_pass else CARRIED_STACKS),
                    for_platform(PENDING_SELECT),
                    for_platform(FORWARD_STACKED_ROWS))


@contextlib.contextmanager
def lowering_for(target: Any) -> Iterator[None]:
  """Steps traced inside are traced for the resolved ``target`` (``_registry.Target``; ``None``:
  this machine's backend): its platform's choices, and what a step compiles on its own (the
  memory guard) it compiles for that target."""
  token = _TARGET.set(target)
  try:
    yield
  finally:
    _TARGET.reset(token)


class Placement(NamedTuple):
  """Where a step's traced inputs are placed: their devices' platform and how many devices
  their mesh spans."""

  platform: str | None
  devices: int | None


def inputs_placement(tree: Any) -> Placement:
  """The platform and the device count of the mesh ``tree``'s traced leaves are placed on, from
  their avals' meshes (JAX keeps the device kind and the mesh shape of a jitted function's
  inputs in them); ``None``s where no leaf says."""
  platform, devices = None, None
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.core.Tracer):
      mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
      name = getattr(getattr(mesh, "abstract_device", None), "platform", None)
      platform = platform or ("cuda" if name == "gpu" else name)
      size = getattr(mesh, "size", 0) if getattr(mesh, "axis_names", ()) else 0
      devices = max(devices or 0, size) or devices
  return Placement(platform, devices)


@contextlib.contextmanager
def traced_on(tree: Any) -> Iterator[None]:
  """A step traced inside, on the inputs ``tree``, takes the choices of the platform they are
  placed on (a step lowered by hand for a TPU from this CPU gets the TPU's) and of the number
  of devices their mesh spans."""
  token = _INPUTS.set(inputs_placement(tree))
  try:
    yield
  finally:
    _INPUTS.reset(token)


def target() -> Any:
  """The resolved target steps are traced for now, or ``None`` (this machine's default
  device)."""
  return _TARGET.get()


def default_platform() -> str:
  """This machine's default backend ("cpu", "tpu", "cuda")."""
  name = jax.default_backend()
  return "cuda" if name == "gpu" else name


def platform() -> str:
  """The platform steps are traced for now ("cpu", "tpu", "cuda"; JAX's "gpu" is "cuda"): the
  target's inside ``lowering_for``, else that of the devices the inputs are placed on, else this
  machine's backend."""
  current = _TARGET.get()
  placed = _INPUTS.get()
  name = (current.platform if current is not None else placed and placed.platform
          or jax.default_backend())
  return "cuda" if name == "gpu" else name


def device_count() -> int:
  """The number of devices steps are traced for now: the target's inside ``lowering_for``,
  else that of the mesh the inputs are placed on, else this machine's."""
  current = _TARGET.get()
  if current is not None:
    return len(current.devices)
  placed = _INPUTS.get()
  return placed and placed.devices or jax.device_count()


def for_platform(table: dict[str, Any]) -> Any:
  """``table``'s entry for ``platform()``, the CPU's for a platform not in it.

  Args:
    table: platform name -> the value of the choice there ("cpu", "tpu", "cuda", "rocm").

  Returns:
    The value of the choice for the platform steps are traced for now.
  """
  return table.get(platform(), table["cpu"])


@contextlib.contextmanager
def compiling_for(target: Any) -> Iterator[Any]:
  """Steps traced inside take the compiler choices of ``target``, however they are lowered.

  A fused step picks a few orderings per compiler (see the docs' design page) when it is traced.
  It finds the platform from the devices its inputs are placed on, so ``jax.jit(step).lower``
  on ``jax.ShapeDtypeStruct`` values sharded over a target's devices needs nothing more. Use
  this context where the inputs carry no such placement, or with ``guard=True``, whose compiles
  need the target's devices; ``memory_report`` and ``max_batch_size`` use it with their
  ``target=``.

  Args:
    target: a name of ``optfuse.targets()`` (``"tpu-v5e"``, ``"tpu-v5e:2x2"``, ``"h100"``...),
      a ``jax.sharding.Mesh``, a ``TopologyDescription`` or a sequence of devices.

  Yields:
    The resolved target; its ``devices`` are the compile-only devices to place inputs on.

  Raises:
    TargetError: an unknown target, or one whose compiler is not installed.

  Examples:
    >>> import jax, optfuse
    >>> with optfuse.compiling_for(jax.devices()) as target:
    ...   target.platform
    'cpu'
  """
  resolved = _registry.resolve(target)
  with lowering_for(resolved):
    yield resolved
