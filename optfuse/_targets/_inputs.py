"""Where a step's inputs live on a compile target: ``jax.ShapeDtypeStruct`` values with shardings.

A compile-only device has no memory to put an array in, so a step compiled for a target is
lowered from ``jax.ShapeDtypeStruct`` values that carry a sharding on the target's devices. By
default the step is data parallel: params replicated on every device, each argument split along
its leading axis over all devices (replicated when that axis does not divide). A leaf that
already carries a ``NamedSharding`` on exactly the target's devices keeps it, so an FSDP layout
given on a target's mesh is compiled as given; the optimizer state is laid out from the params
as ``init`` lays it out (``state_on``: sharded with them under FSDP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

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


def _one_mesh(shardings: list[NamedSharding], target: Target) -> Mesh | None:
  """The mesh every sharded leaf of ``shardings`` is on (the target's when all are replicated),
  or ``None`` when they are on several."""
  meshes = {s.mesh for s in shardings if any(a is not None for a in s.spec)}
  if len(meshes) > 1:
    return None
  return meshes.pop() if meshes else target.mesh


def _explicit(mesh: Mesh) -> Mesh:
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def _layout_in_types(init: Callable[[Any], Any], params: Any, mesh: Mesh) -> Any:
  """``init``'s output specs, traced with ``params``' shardings in their types: ``zeros_like``
  of a sharded param is sharded like it, as ``init`` on placed arrays makes it eagerly."""
  explicit = _explicit(mesh)
  typed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(explicit, x.sharding.spec)), params)
  with jax.set_mesh(explicit):
    shapes = jax.eval_shape(init, typed)
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(
          mesh, getattr(s.sharding, "spec", None) or PartitionSpec())), shapes)


def _layout_by_shape(init: Callable[[Any], Any], params: Any, target: Target) -> Any:
  """``init``'s output, a leaf with the shape of params that all have one sharding sharded like
  them, any other leaf replicated (for an ``init`` that cannot be traced with shardings in its
  types)."""
  by_shape: dict[tuple, set] = {}
  for p in jax.tree.leaves(params):
    by_shape.setdefault(tuple(p.shape), set()).add(p.sharding)
  rep = replicated(target)
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=(
          next(iter(by_shape[s.shape])) if len(by_shape.get(s.shape, ())) == 1 else rep)),
      jax.eval_shape(init, params))


def state_on(init: Callable[[Any], Any], params: Any, target: Target) -> Any:
  """The state ``init(params)`` builds, laid out as ``init`` on ``params`` placed as given lays
  it out: a slot like a param sharded like it (FSDP state sharded with its params, as optax's
  ``zeros_like`` keeps a placed array's sharding), what depends on no param (the step count)
  replicated.

  ``jax.jit(init)`` would not do: zeros depend on no input, and XLA puts them on one device.
  So ``init`` is traced with the params' shardings in their types (on an Explicit copy of
  their mesh); an ``init`` that cannot be traced so is laid out by shape (``_layout_by_shape``).

  Args:
    init: the optimizer's ``init``.
    params: ``jax.ShapeDtypeStruct`` values placed on ``target`` (``params_on``).
    target: the compile target.

  Returns:
    ``jax.ShapeDtypeStruct`` values of the state with ``NamedSharding``s on ``target``'s devices.
  """
  mesh = _one_mesh([p.sharding for p in jax.tree.leaves(params)], target)
  if mesh is not None:
    try:
      return _layout_in_types(init, params, mesh)
    except Exception:  # noqa: BLE001 - an init whose ops Explicit sharding rejects
      pass
  return _layout_by_shape(init, params, target)


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
