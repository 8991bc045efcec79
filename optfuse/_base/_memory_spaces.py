"""Where optimizer state lives: device memory, or host memory streamed through the step.

With ``optfuse.fuse(tx, offload="state")`` every float state leaf with at least one axis (Adam's
``mu`` and ``nu``: the slots of the param leaves) lives in ``pinned_host`` memory between steps;
the scalars (the step count, injected hyperparameters) stay on the device. Memory spaces are
part of JAX's types, so a host-resident value is moved to the device before any computation
reads it and a new value is moved back to the space of the value it replaces. Two helpers
carry that out everywhere a step reads or writes state:

* ``to_device`` on every read (a leaf's whole slots at its tap, a row of a slot stack in a
  backward loop: ``_row_buffers.row_at``);
* ``like`` on every write (``_row_buffers.write_row`` writes a row into a host stack in host
  memory, a tap returns new slots in the space of the old ones).

Nothing else changes: the update runs on the device, on exactly the values optax's would.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optfuse._base._errors import OffloadError


def _memory_space(x) -> Any:
  try:
    return jax.typeof(x).memory_space
  except TypeError:  # not an array-like value
    return None


def is_host(x) -> bool:
  """Whether ``x`` (an array, a tracer or a ``jax.ShapeDtypeStruct``) lives in host memory."""
  return x is not None and _memory_space(x) == jax.memory.Space.Host


def host_leaves(tree) -> frozenset[int]:
  """The indices of ``tree``'s leaves (``jax.tree.leaves`` order) that live in host memory."""
  return frozenset(i for i, x in enumerate(jax.tree.leaves(tree)) if is_host(x))


def to_device(x):
  """``x`` in device memory (``x`` itself when it is there already)."""
  return jax.device_put(x, jax.memory.Space.Device) if is_host(x) else x


def to_host(x):
  """``x`` in pinned host memory."""
  return x if is_host(x) else jax.device_put(x, jax.memory.Space.Host)


def like(x, ref):
  """``x`` in the memory space of ``ref`` (host or device)."""
  return to_host(x) if is_host(ref) else to_device(x)


def offloaded(x) -> bool:
  """Whether a state leaf is kept in host memory: a float array with at least one axis (the
  slots of param leaves; the step count and scalar hyperparameters stay on the device, where
  every leaf's update reads them)."""
  return jnp.ndim(x) > 0 and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def state_to_host(state):
  """``state`` with every leaf ``offloaded`` accepts in host memory."""
  return jax.tree.map(lambda s: to_host(s) if offloaded(s) else s, state)


def check_on_host(state) -> None:
  """Raises ``OffloadError`` naming the first leaf of ``state`` that ``offloaded`` accepts but
  that lives in device memory.

  The step cannot move it to the host itself: with donation, XLA would alias the donated
  device buffer to the host output (the CPU runtime aborts on it).
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if offloaded(leaf) and not is_host(leaf):
      raise OffloadError(
          f"state leaf {jax.tree_util.keystr(path)} is in device memory, and offload='state' "
          "keeps it in host memory. Use the state fx.init returns, convert a plain optax state "
          "with optfuse.from_optax_state(fx, params, opt_state), and restore checkpoints with "
          "the shardings of fx.init's state (memory_kind='pinned_host').")


def tree_to_device(tree):
  """Every leaf of ``tree`` in device memory."""
  return jax.tree.map(to_device, tree)


def tree_like(tree, ref):
  """Every leaf of ``tree`` in the memory space of the matching leaf of ``ref``."""
  return jax.tree.map(like, tree, ref)


def check_params_placed(params, streamed: set[int], mixed: bool = False) -> None:
  """Raises ``OffloadError`` naming the first param leaf not where ``offload="params"`` keeps
  it: a leaf of ``streamed`` (updated inside a fused loop) in device memory, or another float
  leaf in host memory. ``mixed`` (``offload="auto"``, whose plan streams some of the leaves of
  ``streamed``): only the latter.

  The step cannot move a leaf itself: with donation, XLA would alias the donated buffer to an
  output in the other memory space (the CPU runtime aborts on it).
  """
  for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
    name = jax.tree_util.keystr(path)
    if i in streamed and not is_host(leaf) and not mixed:
      raise OffloadError(
          f"param leaf {name} is in device memory, and offload='params' keeps the leaves "
          "updated inside a fused loop in host memory. Place the params with "
          "optfuse.params_to_host(fx, loss_fn, params, *args) before the first step.")
    if i not in streamed and is_host(leaf) and mixed:
      raise OffloadError(
          f"param leaf {name} is in host memory, and offload='auto' streams only leaves "
          "updated inside a fused loop (optfuse.describe(fx, loss_fn, params, *args) says "
          "which); the others stay on the device. Place the params with optfuse.place(fx, "
          "loss_fn, params, *args, budget=...).")
    if i not in streamed and is_host(leaf):
      raise OffloadError(
          f"param leaf {name} is in host memory, and offload='params' streams only the leaves "
          "updated inside a fused loop (optfuse.describe(fx, loss_fn, params, *args) says "
          "which); the others stay on the device. Place the params with "
          "optfuse.params_to_host(fx, loss_fn, params, *args).")
