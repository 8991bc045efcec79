"""Errors injected into a fused step, to show that an equivalence check rejects them.

An equivalence test claims "the optimizer's math, unchanged" only as far as its criterion would
catch a wrong update. Each fault here wraps an optax transformation so that its update is wrong
in one way a fusion bug could make it wrong, while its state keeps the wrapped transformation's
structure (a fused step's state is compared with optax's, and checkpoints load across modes).
A fault is injected into the fused path only: the test fuses ``fault(tx)`` and compares it with
the reference run of ``tx`` by the very criterion that passes for ``fuse(tx)``; the check must
then fail.

Every fault is separable and row-wise (elementwise on the update, an iota mask), so the fused
step runs it where it runs ``tx``: inside the backward loop, at the tap, in forward mode.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

# A learning rate this far off is the smallest error the equivalence checks must catch.
LR_ERROR = 0.01


def _with_update(tx: optax.GradientTransformation, update: Callable
                 ) -> optax.GradientTransformationExtraArgs:
  return optax.GradientTransformationExtraArgs(tx.init, update)


def lr_off(tx: optax.GradientTransformation, error: float = LR_ERROR
           ) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose updates are ``1 + error`` times too large: a learning rate 1 % off."""
  tx = optax.with_extra_args_support(tx)

  def update(updates, state, params=None, **extra):
    updates, state = tx.update(updates, state, params, **extra)
    return jax.tree.map(lambda u: u * jnp.asarray(1 + error, u.dtype), updates), state

  return _with_update(tx, update)


def count_frozen(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose step counts never advance (every integer state leaf keeps its old value): Adam's
  bias correction stays that of the first step, a schedule stays at its first value."""
  tx = optax.with_extra_args_support(tx)

  def update(updates, state, params=None, **extra):
    updates, new_state = tx.update(updates, state, params, **extra)
    keep = lambda new, old: old if jnp.issubdtype(jnp.result_type(old), jnp.integer) else new
    return updates, jax.tree.map(keep, new_state, state)

  return _with_update(tx, update)


def row_skipped(tx: optax.GradientTransformation, where: Callable[[str], bool], row: int = 1,
                axis: int = 0) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose update leaves row ``row`` (along ``axis``) of the leaves whose path
  (``jax.tree_util.keystr``) satisfies ``where`` unchanged: one layer of a scanned stack not
  updated, while its optimizer state still advances.

  Raises:
    ValueError: no leaf of the updates satisfies ``where`` (the fault would inject nothing).
  """
  tx = optax.with_extra_args_support(tx)

  def update(updates, state, params=None, **extra):
    updates, state = tx.update(updates, state, params, **extra)
    hit = []

    def skip(path, u):
      if not where(jax.tree_util.keystr(path)):
        return u
      hit.append(path)
      keep = jax.lax.broadcasted_iota(jnp.int32, u.shape, axis) != row
      return jnp.where(keep, u, jnp.zeros_like(u))

    updates = jax.tree_util.tree_map_with_path(skip, updates)
    if not hit:
      raise ValueError("row_skipped: no update leaf matches `where`; the fault injects nothing")
    return updates, state

  return _with_update(tx, update)


# The three faults every equivalence criterion must reject, by name; ``row_skipped`` needs to
# be told which leaves are stacked, so it is given as ``(where, axis)`` by the caller.
def faults(where: Callable[[str], bool], axis: int = 0
           ) -> dict[str, Callable[[optax.GradientTransformation], optax.GradientTransformation]]:
  """The injected errors, name -> ``fault(tx)``: a learning rate 1 % off, step counts not
  advanced, and row 1 of the stacked leaves ``where`` selects left unchanged."""
  return {
      "lr_1pct_off": lr_off,
      "count_frozen": count_frozen,
      "row_skipped": lambda tx: row_skipped(tx, where, row=1, axis=axis),
  }
