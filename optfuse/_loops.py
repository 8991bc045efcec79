"""Fusion across loops (placeholder: no loop is fused yet)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class LoopPlan(NamedTuple):
  params_def: Any
  loss_fn: Any
  fused_leaves: tuple[int, ...]

  def call(self, updater, leaves, slots, args, kwargs):
    del updater, slots
    return self.loss_fn(jax.tree.unflatten(self.params_def, leaves), *args, **kwargs)


def analyze(loss_fn, plan, params, args, kwargs, diff) -> LoopPlan:
  del params, args, kwargs, diff
  return LoopPlan(plan.params_def, loss_fn, ())
