"""Compile targets: the accelerators whose compilers the compile-only tools compile for.

``memory_report``, ``max_batch_size`` and the bench compile training steps without running them,
so they can compile for an accelerator this machine does not have: the TPU compiler (libtpu) and
the GPU compiler (the CUDA plugin) run deviceless, on compile-only devices from
``jax.experimental.topologies``. A target is

- ``None``: this machine's default backend (inputs as given, JAX's own placement);
- a name of ``targets()``, optionally with a topology of several chips: ``"tpu-v5e"``,
  ``"tpu-v5e:2x2"``, ``"tpu-v5p:2x2x1"``, ``"h100"``, ``"a100-40gb"``...;
- what a JAX user already holds: a ``TopologyDescription``, a ``jax.sharding.Mesh`` or a
  sequence of devices.

On a target of several devices the step is data parallel (params and state replicated, the
batch split along its leading axis over every device) unless the inputs carry their own
``NamedSharding`` on the target's devices (FSDP, say); memory is reported per device.

The registry is data: ``SPECS`` names each target, its compiler and where its memory budget
comes from. Adding a GPU is one ``.txtpb`` file in ``optfuse/_targets/gpu`` (a
``GpuTargetConfig`` text proto) and one entry here; adding a TPU is one entry with its
topology prefix and the HBM limit its compiler states.
"""

from __future__ import annotations

import functools
import glob
import importlib.resources
import importlib.util
import math
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from optfuse._base._errors import TargetError

GiB = 2**30


class TargetSpec(NamedTuple):
  """One named target of the registry.

  Attributes:
    platform: the compiler: "tpu" (libtpu) or "cuda" (the CUDA plugin).
    chip: the TPU topology prefix ("v5e"), or the GPU's ``GpuTargetConfig`` file name.
    default_topology: the topology of ``name`` alone (one chip).
    memory_bytes: a TPU's HBM per device as its compiler states it ("exceeds available HBM
      (15.75G)"); ``None`` for GPUs, whose budget is read from their config file.
    description: the accelerator, in words.
  """

  platform: str
  chip: str
  default_topology: str
  memory_bytes: int | None
  description: str


# TPU HBM limits: the "available HBM" of libtpu 0.0.42's compile-time out-of-memory error, for a
# program too large for every chip (tests/analysis/test_targets.py checks each against the
# compiler).
SPECS: dict[str, TargetSpec] = {
    "tpu-v5e": TargetSpec("tpu", "v5e", "1x1", int(15.75 * GiB),
                          "TPU v5e (v5 lite; Colab's TPU v5e-1): 16 GiB HBM per chip"),
    "tpu-v6e": TargetSpec("tpu", "v6e", "1x1", int(31.25 * GiB),
                          "TPU v6e (Trillium; Colab's TPU v6e-1): 32 GiB HBM per chip"),
    "tpu-v5p": TargetSpec("tpu", "v5p", "1x1x1", int(95.74 * GiB),
                          "TPU v5p: 95 GiB HBM per chip"),
    "tpu-v4": TargetSpec("tpu", "v4", "1x1x1", int(15.25 * GiB),
                         "TPU v4: 32 GiB HBM per chip, compiled per TensorCore (2 per chip)"),
    "t4": TargetSpec("cuda", "t4.txtpb", "1x1x1", None, "NVIDIA T4 (Colab's free GPU), 16 GB"),
    "l4": TargetSpec("cuda", "l4.txtpb", "1x1x1", None, "NVIDIA L4 (Colab), 24 GB"),
    "a100-40gb": TargetSpec("cuda", "a100-40gb.txtpb", "1x1x1", None, "NVIDIA A100 SXM 40 GB"),
    "a100-80gb": TargetSpec("cuda", "a100-80gb.txtpb", "1x1x1", None, "NVIDIA A100 SXM 80 GB"),
    "h100": TargetSpec("cuda", "h100.txtpb", "1x1x1", None, "NVIDIA H100 SXM 80 GB"),
    "h200": TargetSpec("cuda", "h200.txtpb", "1x1x1", None, "NVIDIA H200 SXM 141 GB"),
}

def _accelerator_present() -> bool:
  """Whether this machine shows a TPU or an NVIDIA GPU: a device file, or a Google PCI device."""
  if os.environ.get("JAX_FORCE_TPU_INIT") is not None or any(
      glob.glob(p) for p in ("/dev/nvidia*", "/dev/dxg", "/dev/accel*", "/dev/vfio/[0-9]*")):
    return True
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      if pathlib.Path(vendor).read_text().strip() == "0x1ae0":  # Google's vendor id: a TPU
        return True
    except OSError:
      pass
  return False


def _quiet_compilers() -> None:
  """Tells libtpu and the CUDA plugin, before they start, that this machine has no TPU or GPU.

  Without it a machine with the tpu and cuda extras but no accelerator logs their failures on
  every run: libtpu (loaded by JAX's backend probe or by a compile-only TPU target) finds no TPU
  metadata server and prints an ``E0000 ... unexpected worker hostname`` error and a source
  trace, and the CUDA plugin's version check, which needs a CUDA runtime and a GPU, prints a
  traceback. Only defaults are set, and only where no accelerator is visible, so a user's
  settings and a real TPU or GPU are left to JAX as they are.
  """
  if _accelerator_present():
    return
  # libtpu without a TPU metadata server reads the slice's hosts from here: one host, this one.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  if "TPU_ACCELERATOR_TYPE" not in os.environ:
    # ... and this host's chip bounds, which it would otherwise look up by accelerator type.
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
  # Compile-only use needs no exclusive hold of libtpu, and another process may have it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # The CUDA plugin's check of the CUDA runtime and libraries concerns running on a GPU, which
  # JAX skips without one; compile-only devices need only the plugin (as with JAX_PLATFORMS=cpu).
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


_quiet_compilers()

INSTALL = {"tpu": 'pip install "optfuse[tpu]" (in a checkout: pip install -e ".[tpu]")',
           "cuda": 'pip install "optfuse[cuda]" (in a checkout: pip install -e ".[cuda]")'}

# The share of a GPU that JAX's allocator takes when it starts (JAX's default preallocation).
DEFAULT_GPU_MEM_FRACTION = 0.75


class Target(NamedTuple):
  """A resolved compile target.

  Attributes:
    name: the registry name and topology ("tpu-v5e:2x2"), or how it was given.
    platform: "tpu", "cuda", "cpu"...
    devices: the (compile-only) devices, in mesh order.
    memory_bytes: the memory one device's program may use, or ``None`` when unknown.
    memory_source: where ``memory_bytes`` comes from, in words.
  """

  name: str
  platform: str
  devices: tuple
  memory_bytes: int | None
  memory_source: str

  @property
  def mesh(self) -> Mesh:
    """A one-axis mesh ("devices") over every device of the target."""
    return Mesh(np.array(self.devices, dtype=object), ("devices",))

  def described(self) -> tuple:
    """The target by value, hashable: two resolutions of one target (a new ``Target`` each
    ``compiling_for``) describe it alike, and an object's reused ``id`` never stands for
    another target. A device is its platform, kind, id and coordinates (what the compiler
    places by); compile-only devices compare by identity."""
    devices = tuple((d.platform, d.device_kind, d.id, tuple(getattr(d, "coords", ()) or ()))
                    for d in self.devices)
    return self.name, self.platform, devices, self.memory_bytes, self.memory_source


def targets() -> dict[str, str]:
  """The named compile targets: name -> the accelerator, in words.

  Examples:
    >>> import optfuse
    >>> "tpu-v5e" in optfuse.targets() and "h100" in optfuse.targets()
    True
  """
  return {name: spec.description for name, spec in SPECS.items()}


def compiler_installed(platform: str) -> bool:
  """Whether the compiler of ``platform`` ("tpu" or "cuda") is installed."""
  if platform == "tpu":
    return importlib.util.find_spec("libtpu") is not None
  # find_spec of a submodule imports its parent: with no JAX plugin at all (a plain install of
  # jax), the parent jax_plugins is missing and find_spec would raise ModuleNotFoundError.
  return (importlib.util.find_spec("jax_plugins") is not None
          and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


def _host_bounds(dims: tuple[int, ...]) -> tuple[int, int, int]:
  """Chips per host for a deviceless topology: the whole slice, up to 2x2 (4 chips) a host."""
  padded = (*dims, 1, 1)[:3]
  return tuple(d if i == 2 else min(d, 2) for i, d in enumerate(padded))


def gpu_config(chip: str) -> str:
  """The ``GpuTargetConfig`` text proto of a GPU of the registry."""
  return importlib.resources.files("optfuse._targets.gpu").joinpath(chip).read_text()


def _gpu_memory(chip: str) -> tuple[int, str]:
  size = int(re.search(r"device_memory_size:\s*(\d+)", gpu_config(chip)).group(1))
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_GPU_MEM_FRACTION))
  return int(size * fraction), (f"{fraction:.0%} of the device's {size} bytes "
                                "(XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's preallocation)")


@functools.cache
def _named(name: str) -> Target:
  base, _, topology = name.partition(":")
  if base not in SPECS:
    raise TargetError(f"unknown compile target {name!r}: choose one of {', '.join(SPECS)}, "
                      "optionally with a topology ('tpu-v5e:2x2'), or pass a jax Mesh, a "
                      "TopologyDescription or a sequence of devices.")
  spec = SPECS[base]
  if not compiler_installed(spec.platform):
    raise TargetError(f"target {name!r} compiles with the {spec.platform.upper()} compiler, "
                      f"which is not installed: {INSTALL[spec.platform]}.")
  topology = topology or spec.default_topology
  if not re.fullmatch(r"\d+(x\d+)*", topology):
    raise TargetError(f"cannot read the topology {topology!r} of target {name!r}: write chips "
                      "per dimension, such as 'tpu-v5e:2x2' or 'tpu-v5p:2x2x1'.")
  if spec.platform == "tpu":
    # Compile-only use needs no exclusive hold of libtpu, and another process may have it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    dims = tuple(int(d) for d in topology.split("x"))
    desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{spec.chip}:{topology}",
                                        chips_per_host_bounds=_host_bounds(dims))
    memory, source = spec.memory_bytes, "the HBM limit the TPU compiler states"
  else:
    desc = _cuda_topology(gpu_config(spec.chip), topology)
    memory, source = _gpu_memory(spec.chip)
  return Target(f"{base}:{topology}" if ":" in name else base, spec.platform,
                tuple(desc.devices), memory, source)


def _cuda_topology(config: str, topology: str):
  """Compile-only devices of the CUDA plugin, loading the plugin without a GPU if need be.

  With no GPU, the plugin's CUDA version check fails when JAX starts its backends, and JAX goes
  on without it (logging "Unable to load CUDA"). A deviceless compile needs no CUDA driver, so
  the plugin is initialised again with that check skipped, for this call only.
  """
  try:
    return topologies.get_topology_desc(platform="cuda", target_config=config,
                                        topology=topology)
  except NotImplementedError:
    pass
  import jax_plugins.xla_cuda12 as plugin
  previous = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  try:
    plugin.initialize()
  finally:
    if previous is None:
      del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
    else:
      os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = previous
  return topologies.get_topology_desc(platform="cuda", target_config=config, topology=topology)


# The device_kind a TPU chip of the registry reports, real or compile-only.
_TPU_KINDS = {"TPU v5 lite": "tpu-v5e", "TPU v6 lite": "tpu-v6e", "TPU v5": "tpu-v5p",
              "TPU v4": "tpu-v4"}


def accelerator_kind() -> str | None:
  """The registry's name of this machine's TPU or GPU, or ``None`` (no accelerator, or one the
  registry does not know): its device kind as a TPU reports it, or a GPU's words ("NVIDIA H100
  80GB HBM3": h100)."""
  if jax.default_backend() not in ("tpu", "gpu"):
    return None
  kind = jax.devices()[0].device_kind
  if kind in _TPU_KINDS:
    return _TPU_KINDS[kind]
  words = set(re.split(r"[^a-z0-9]+", kind.lower()))
  return next((name for name, spec in SPECS.items()
               if spec.platform == "cuda" and set(name.split("-")) <= words), None)


def _allocator_limit(device) -> int | None:
  try:
    stats = device.memory_stats()
  except (AttributeError, RuntimeError, NotImplementedError, jax.errors.JaxRuntimeError):
    return None  # compile-only devices have no allocator
  return (stats or {}).get("bytes_limit")


def _from_devices(devices: Sequence[Any], name: str) -> Target:
  devices = tuple(devices)
  named = _TPU_KINDS.get(devices[0].device_kind)
  if named is not None:
    return Target(name, devices[0].platform, devices, SPECS[named].memory_bytes,
                  f"the HBM limit the TPU compiler states for {named}")
  limit = _allocator_limit(devices[0])
  return Target(name, devices[0].platform, devices, limit,
                "the device's allocator limit" if limit else "unknown")


def resolve(target: Any) -> Target | None:
  """The ``Target`` of what the user gave (see the module docstring); ``None`` stays ``None``.

  Raises:
    TargetError: an unknown name, a topology that cannot be read, or a target whose compiler is
      not installed (the message says which extra installs it).
  """
  if target is None or isinstance(target, Target):
    return target
  if isinstance(target, str):
    try:
      return _named(target.strip().lower())
    except jax.errors.JaxRuntimeError as e:
      raise TargetError(f"the compiler of target {target!r} refused its topology: {e}") from None
  if isinstance(target, Mesh):
    return _from_devices(target.devices.flat, f"mesh {dict(target.shape)}")
  devices = getattr(target, "devices", target)
  if isinstance(devices, Sequence) and devices and all(
      isinstance(d, jax.Device) for d in devices):
    return _from_devices(devices, f"{len(devices)} x {devices[0].device_kind}")
  raise TargetError(f"cannot compile for {target!r}: a target is None, a name of "
                    "optfuse.targets(), a jax Mesh, a TopologyDescription or a sequence of "
                    "devices.")


def target_mesh(target: Any, axis_names: Sequence[str] = ("devices",),
                axis_shape: Sequence[int] | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` over a compile target's devices, to build and place a model on.

  Models that take their mesh when they are built (a MaxText-style NNX decoder, Flax
  ``nnx.with_partitioning`` rules under ``jax.set_mesh``) are built on this mesh before they are
  planned; inputs sharded over it lower for the target's compiler from this machine.

  Args:
    target: a name of ``optfuse.targets()`` with its topology (``"tpu-v5e:2x2"``), a
      ``TopologyDescription``, a ``Mesh`` or a sequence of devices.
    axis_names: the mesh's axis names.
    axis_shape: the mesh's shape (its product is the number of devices); by default every
      device on the last axis, the others of size 1.

  Returns:
    The mesh, its devices the target's compile-only devices in the target's order.

  Raises:
    TargetError: an unknown target, a compiler not installed, or a shape that does not hold the
      target's devices.

  Examples:
    >>> import jax, optfuse
    >>> dict(optfuse.target_mesh(jax.devices()[:1], ("data", "model")).shape)
    {'data': 1, 'model': 1}
  """
  resolved = resolve(target)
  if resolved is None:
    raise TargetError("target_mesh needs a target, not None.")
  n = len(resolved.devices)
  shape = tuple(axis_shape) if axis_shape is not None else (1,) * (len(axis_names) - 1) + (n,)
  if len(shape) != len(axis_names) or math.prod(shape) != n:
    raise TargetError(f"a mesh of shape {shape} with axes {tuple(axis_names)} does not hold the "
                      f"{n} devices of {resolved.name}: give one size per axis, their product "
                      f"{n}.")
  return Mesh(np.array(resolved.devices, dtype=object).reshape(shape), tuple(axis_names))


def host_memory_bytes() -> int | None:
  """This machine's physical memory, the CPU backend's budget."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def default_budget() -> tuple[int | None, str]:
  """The memory budget of the default backend's first device, and where it comes from."""
  device = jax.devices()[0]
  limit = _allocator_limit(device)
  if limit:
    return int(limit), "the device's allocator limit"
  if device.platform == "cpu":
    return host_memory_bytes(), "this machine's physical memory"
  return None, "unknown"
