"""The one entry that builds an update plan, whatever the transform and the mode asks of it."""

from __future__ import annotations

from typing import Literal

import optax

from optfuse._base._errors import NonSeparableError
from optfuse._plan import _global_stage, _leaf_stats, _separable
from optfuse._plan._plan import Plan

# What a mode does with a global stage (clipping, ``apply_if_finite``):
# - "refuse": the plan is separable or ``NonSeparableError`` says why (backward fusion);
# - "tree": a global stage computed once from the gradient tree (forward fusion);
# - "per_leaf": the global stage split into per-leaf statistics and a combine step, which a
#   backward pass or a row loop can carry (forward fusion with the pending gradient on host);
# - "if_needed": per-leaf statistics where the transform is global, or where its update of a leaf
#   reads norms over the whole leaf (``_leaf_stats``), separable otherwise (two-pass).
GlobalHandling = Literal["refuse", "tree", "per_leaf", "if_needed"]


def make_plan(tx: optax.GradientTransformation, params, state,
              global_handling: GlobalHandling = "refuse") -> Plan:
  """Traces ``tx.update`` for these params/state once and splits it per parameter leaf.

  Args:
    tx: any optax transformation.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    state: ``tx.init(params)`` or a state of the same structure.
    global_handling: what to do with a global stage (see ``GlobalHandling``).

  Returns:
    The ``Plan``.

  Raises:
    NonSeparableError: ``"refuse"`` and some leaf's update reads other leaves' gradients;
      ``"per_leaf"`` or ``"if_needed"`` and the global stage does not split into per-leaf
      statistics.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    >>> make_plan(optax.adam(0.1), params, optax.adam(0.1).init(params)).is_separable
    True
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    >>> make_plan(tx, params, tx.init(params), global_handling="if_needed").is_separable
    False
  """
  if global_handling not in ("refuse", "tree", "per_leaf", "if_needed"):
    raise ValueError(f"unknown global_handling {global_handling!r}")
  traced = _separable.trace_update(tx, params, state)
  if global_handling == "refuse":
    return _separable.make_plan(tx, params, state, traced)
  if global_handling == "if_needed":
    try:
      separable = _separable.make_plan(tx, params, state, traced)
    except NonSeparableError:
      pass
    else:
      return _leaf_stats.make_leaf_stats_plan(traced, separable) or separable
  return _global_stage.make_global_plan(tx, params, state, two_pass=global_handling != "tree",
                                        traced=traced)
