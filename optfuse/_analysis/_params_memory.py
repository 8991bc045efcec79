"""Where the params of ``offload="params"`` live: the helpers that place them.

``fx.init`` returns the optimizer state, and cannot move the params, which the user owns:
``params_to_host`` moves the leaves the step updates inside a fused loop (``describe``'s
"loop" placements) to ``pinned_host`` memory, where the step streams them one row at a time,
and ``params_to_device`` moves every leaf back (an evaluation outside the step, a checkpoint
written from the device, a switch to ``offload=None`` or ``"state"``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from optfuse._analysis._describe import describe
from optfuse._base import _memory_spaces
from optfuse._targets import _inputs, _registry


def params_to_host(fx, loss_fn: Callable, params, *args, **kwargs):
  """``params`` placed for ``fx``'s step: with ``offload="params"``, the leaves it updates
  inside a fused loop in host memory and the others on the device.

  Args:
    fx: a ``FusedTransformation``.
    loss_fn: the loss its step runs, ``loss_fn(params, *args, **kwargs)``.
    params: the params, anywhere.
    *args: the loss's other arguments (arrays or ``jax.ShapeDtypeStruct`` values).
    **kwargs: its keyword arguments.

  Returns:
    The params, each leaf ``describe(fx, loss_fn, params, *args, **kwargs)`` places "loop" in
    ``pinned_host`` memory when ``fx.offload == "params"``, every other leaf in device memory.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> def loss(p, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x @ p["embed"], p["layers"])
    ...   return jnp.sum(h)
    >>> fx = optfuse.fuse(optax.adam(1e-3), offload="params")
    >>> params = {"embed": jnp.ones((2, 3)), "layers": jnp.zeros((4, 3, 3))}
    >>> params = optfuse.params_to_host(fx, loss, params, jnp.ones(2))
    >>> jax.tree.map(lambda x: x.sharding.memory_kind, params)
    {'embed': 'device', 'layers': 'pinned_host'}
  """
  return _placed(fx, loss_fn, params_to_device(params), args, kwargs, _memory_spaces.to_host)


def abstract_params_on_host(fx, loss_fn: Callable, params, args: tuple, kwargs: dict,
                            target: _registry.Target | None):
  """``params_to_host`` for ``jax.ShapeDtypeStruct`` params placed on ``target`` (``None``:
  this machine's backend), as ``memory_report`` lowers a step: each leaf in host memory laid
  out as ``_inputs.offloaded_on`` lays out the offloaded state."""
  return _placed(fx, loss_fn, params, args, kwargs,
                 lambda x: _inputs.offloaded_on(x, target))


def _placed(fx, loss_fn: Callable, params, args: tuple, kwargs: dict, to_host: Callable):
  """``params`` with the leaves ``fx``'s step updates in a fused loop moved by ``to_host``,
  when ``fx.offload == "params"``."""
  if fx.offload != "params":
    return params
  where = describe(fx, loss_fn, params, *args, **kwargs).params
  place = lambda path, x: to_host(x) if where.get(jax.tree_util.keystr(path)) == "host" else x
  return jax.tree_util.tree_map_with_path(place, params)


def params_to_device(params):
  """Every leaf of ``params`` in device memory (a leaf there already is returned as it is).

  Args:
    params: the params, some leaves possibly in host memory (``offload="params"``).

  Returns:
    The params in device memory, where any JAX computation reads them.
  """
  return _memory_spaces.tree_to_device(params)
