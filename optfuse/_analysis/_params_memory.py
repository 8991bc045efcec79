"""Where the params of ``offload="params"`` live: the helpers that place them.

``fx.init`` returns the optimizer state, and cannot move the params, which the user owns:
``params_to_host`` moves the leaves the step updates inside a fused loop (``describe``'s
"loop" placements) to ``pinned_host`` memory, where the step streams them one row at a time,
and ``params_to_device`` moves every leaf back (a checkpoint written from the device, a switch
to ``offload=None`` or ``"state"``). ``streamed(fn)`` runs any other function of the params (an
evaluation, a generation step) on them where they are: its scans read the host stacks a row at
a time, as the training step's forward loops do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from optfuse._analysis._describe import describe
from optfuse._base import _leaves, _memory_spaces
from optfuse._base._errors import OffloadError
from optfuse._fusion import _accumulate, _loops
from optfuse._plan import _make
from optfuse._targets import _backends, _inputs, _registry


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


def streamed(fn: Callable) -> Callable:
  """``fn(params, *args, **kwargs)`` run on params whose loop stacks live in host memory
  (``offload="params"``), each stack streamed through the scan that reads it.

  The training step's forward loops read each layer's param rows to the device in the
  iteration that uses them; ``streamed(fn)`` runs any other function of the params the same
  way: an evaluation loss, a model's logits, one step of generation. Every leaf in host memory
  must reach a ``lax.scan`` (``nn.scan``, ``nnx.scan``) as its stacked input, as the step's
  stacks do (read nowhere else, through the row-preserving operations the step follows); the
  device holds a few rows of them at a time, never a stack. Leaves in device memory are read as
  usual. Use it eagerly or under ``jax.jit``; the params are not moved (nothing to donate).

  A generation loop that calls the model inside a ``lax.while_loop`` reads the stacks outside
  any scan of its own: wrap one decoding step (``jax.jit(optfuse.streamed(decode_step))``) and
  loop over it, or fetch the params whole with ``optfuse.params_to_device`` (the stacks on the
  device: one copy of the params' bytes across the host link, and their device memory).

  Args:
    fn: ``fn(params, *args, **kwargs)``, returning a pytree of arrays.

  Returns:
    ``run(params, *args, **kwargs)``: ``fn``'s outputs, the same values as ``fn`` on the params
    in device memory.

  Raises:
    OffloadError: (when ``run`` is called) a param leaf in host memory is read outside the
      stacked input of a scan.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> def loss(p, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x @ p["embed"], p["layers"])
    ...   return jnp.sum(h)
    >>> fx = optfuse.fuse(optax.adam(1e-3), offload="params")
    >>> params = {"embed": jnp.ones((2, 3)), "layers": jnp.full((4, 3, 3), 0.1)}
    >>> on_host = optfuse.params_to_host(fx, loss, params, jnp.ones(2))
    >>> bool(jax.jit(optfuse.streamed(loss))(on_host, jnp.ones(2)) == loss(params, jnp.ones(2)))
    True
  """

  @functools.wraps(fn)
  def run(params, *args, **kwargs):
    leaves, treedef = jax.tree.flatten(params)
    host = sorted(_memory_spaces.host_leaves(leaves))
    if not host:
      return fn(params, *args, **kwargs)
    with _backends.traced_on(params):
      # Every stacked input a scan reads row by row: the plan of the gradient sum, whose
      # update never mixes rows, finds them (``_loops.analyze``) as it does for the step.
      shapes = _accumulate.sum_shapes(params)
      plan = _make.make_plan(_accumulate.accumulator(), shapes.sum, shapes)
      diff = [i for i, x in enumerate(leaves) if _leaves.is_float(x)]
      loop_plan = _loops.analyze(fn, plan, params, jax.tree.leaves(shapes), args, kwargs, diff)
      _check_streamed(params, host, loop_plan)
      inputs = _loops.LoopInputs(None, _backends.loop_policy(),
                                 dict.fromkeys(loop_plan.fused_leaves, ()))
      return loop_plan.call(inputs, leaves, args, kwargs)[0]

  return run


def _check_streamed(params, host: list[int], loop_plan: _loops.LoopPlan) -> None:
  """Raises ``OffloadError`` naming the first leaf of ``host`` no scan reads row by row."""
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for i in host:
    if i not in loop_plan.fused_leaves:
      why = loop_plan.reasons.get(i, "it is not the stacked input of a scan")
      raise OffloadError(
          f"param leaf {paths[i]} is in host memory, and optfuse.streamed reads a host leaf "
          f"only a row at a time through the scan it is stacked for; here it cannot ({why}). "
          "Move the params to the device for this function: optfuse.params_to_device(params).")
