"""What ``offload="auto"`` streams of each leaf, and the params and state placed so.

A plan (``_auto.OffloadPlan``) names, per param leaf, one of ``STREAMS``: nothing, its optimizer
state's slots (the state leaves its update owns that offload keeps in host memory,
``_memory_spaces.offloaded``), or its param stack with its slots. ``place_streams`` moves those
to host memory, for the arrays a step runs on or the ``jax.ShapeDtypeStruct`` values a report
compiles.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from optfuse._base import _memory_spaces
from optfuse._base._errors import NonSeparableError
from optfuse._plan import _make

# What ``offload="auto"`` streams of a leaf: nothing, its optimizer state's slots, or its param
# stack (updated in a fused loop) with its slots.
STREAMS = ("none", "state", "params")


def slots_of(tx, params) -> dict[str, tuple[int, ...]]:
  """Param leaf path -> the flat indices of the state leaves its update owns that offload
  keeps in host memory (``_memory_spaces.offloaded``: its slots), for the leaves that have
  any; empty when ``tx`` does not split per leaf.

  Args:
    tx: the optax transformation.
    params: params or their ``jax.ShapeDtypeStruct`` values.
  """
  spec = lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))
  params = jax.tree.map(spec, params)
  state = jax.eval_shape(tx.init, params)
  try:
    plan = _make.make_plan(tx, params, state)
  except NonSeparableError:
    return {}
  flat = jax.tree.leaves(state)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  out = {}
  for i, group in enumerate(plan.groups):
    slots = tuple(k for k in group.state_outs if _memory_spaces.offloaded(flat[k]))
    if slots:
      out[paths[i]] = slots
  return out


def place_streams(tx, params, state, streams, to_host: Callable):
  """``params`` and ``state`` with what ``streams`` streams moved by ``to_host``: the param
  leaves it streams ``"params"`` and the slots (``slots_of``) of those it streams ``"state"``
  or ``"params"``.

  Args:
    tx: the optax transformation ``state`` belongs to.
    params: the params (arrays or ``jax.ShapeDtypeStruct`` values).
    state: their state, as ``tx.init`` (or a step) gives it.
    streams: param leaf path -> one of ``STREAMS``; a leaf it does not name streams nothing.
    to_host: moves one leaf to host memory.

  Returns:
    ``(params, state)`` placed.
  """
  slots = slots_of(tx, params)
  on_host = {k for path, what in streams.items() if what != "none" for k in slots.get(path, ())}
  place = lambda path, x: (to_host(x) if streams.get(jax.tree_util.keystr(path)) == "params"
                           else x)
  params = jax.tree_util.tree_map_with_path(place, params)
  flat, tree = jax.tree.flatten(state)
  state = jax.tree.unflatten(tree, [to_host(x) if k in on_host else x
                                    for k, x in enumerate(flat)])
  return params, state
