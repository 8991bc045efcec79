"""Where a step's inputs live on a compile target: ``jax.ShapeDtypeStruct`` values with shardings.

A compile-only device has no memory to put an array in, so a step compiled for a target is
lowered from ``jax.ShapeDtypeStruct`` values that carry a sharding on the target's devices. By
default the step is data parallel: params and optimizer state replicated on every device, each
argument split along its leading axis over all devices (replicated when that axis does not
divide). A leaf that already carries a ``NamedSharding`` on exactly the target's devices keeps
it, so an FSDP layout given on a target's mesh is compiled as given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from optfuse._base._memory_spaces import offloaded
from optfuse._targets._registry import Target


def _is_array_like(x: Any) -> bool:
  """An array or ``jax.ShapeDtypeStruct`` (anything with a shape and a dtype)."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _kept(x: Any, target: Target) -> NamedSharding | None:
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and set(sharding.mesh.devices.flat) == set(
      target.devices):
    return sharding
  return None


def _struct(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def replicated(target: Target) -> NamedSharding:
  """Every device holds the whole array."""
  return NamedSharding(target.mesh, PartitionSpec())


def params_on(tree: Any, target: Target) -> Any:
  """Params (or state) on ``target``: replicated unless they carry a sharding of its devices."""
  rep = replicated(target)
  return jax.tree.map(lambda x: _struct(x, _kept(x, target) or rep) if _is_array_like(x) else x,
                      tree)


def batch_on(tree: Any, target: Target) -> Any:
  """Arguments on ``target``: split along the leading axis over every device where it divides."""
  n, rep = len(target.devices), replicated(target)
  split = NamedSharding(target.mesh, PartitionSpec("devices"))

  def place(x):
    if not _is_array_like(x):
      return x
    kept = _kept(x, target)
    if kept is not None:
      return _struct(x, kept)
    return _struct(x, split if x.shape and x.shape[0] % n == 0 else rep)

  return jax.tree.map(place, tree)


def state_on(init: Callable[[Any], Any], params: Any, target: Target) -> Any:
  """The state ``init(params)`` builds, laid out as the compiler propagates it from ``params``.

  ``jax.eval_shape`` keeps no shardings, so ``init`` is compiled (it is cheap: zeros) and its
  output shardings read back: state like a param is sharded like it; what depends on no param
  (the step count) is replicated on the target, where JAX would have put it on its default
  device.
  """
  shapes = jax.eval_shape(init, params)
  shardings = jax.jit(init).lower(params).compile().output_shardings
  rep, devices = replicated(target), set(target.devices)
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(
          s.shape, s.dtype, sharding=sh if set(sh.device_set) <= devices else rep),
      shapes, shardings)


def _host_memory_kinds(target: Target | None) -> bool:
  """Whether the devices of ``target`` (``None``: this machine's) list a ``pinned_host``
  memory. The deviceless GPU compiler's devices list none (``default_memory()`` is
  unimplemented there), and a ``NamedSharding`` on them drops its memory kind."""
  device = jax.devices()[0] if target is None else target.devices[0]
  try:
    return any(m.kind == "pinned_host" for m in device.addressable_memories())
  except Exception:  # noqa: BLE001 - compile-only devices raise for unimplemented memories
    return False


def offloaded_on(state: Any, target: Target | None) -> Any:
  """``state`` (``jax.ShapeDtypeStruct`` values) with the leaves ``offload="state"`` keeps in host
  memory (``_memory_spaces.offloaded``) in ``pinned_host`` memory, sharded as they were (on this
  machine's first device when they carry no ``NamedSharding``; on the target's abstract mesh
  when its devices list no host memory, as the deviceless GPU compiler's do).

  The state is laid out from the device-resident ``init`` first: ``jax.eval_shape`` keeps no
  memory space, and an ``init`` that moves its output to the host gives it the default
  device's sharding, not its param's.
  """
  devices = jax.devices()[:1] if target is None else target.devices[:1]
  mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("devices",))
  abstract = not _host_memory_kinds(target)

  def place(s):
    if not offloaded(s):
      return s
    sharding = s.sharding if isinstance(s.sharding, NamedSharding) else NamedSharding(
        mesh, PartitionSpec())
    if abstract:  # the memory kind survives on the abstract mesh (lowered under the target's)
      sharding = NamedSharding(sharding.mesh.abstract_mesh, sharding.spec)
    return jax.ShapeDtypeStruct(s.shape, s.dtype,
                                sharding=sharding.with_memory_kind("pinned_host"))

  return jax.tree.map(place, state)
