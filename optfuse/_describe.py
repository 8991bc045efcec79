"""Where each parameter leaf's update runs: a diagnostic for users and tests."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from optfuse import _backward, _forward, _global, _loops, _plan, _two_pass


def describe(tx, loss_fn: Callable, params, *args, **kwargs) -> dict[str, str]:
  """Says where each parameter leaf is updated, without running anything.

  Args:
    tx: an optax transformation (placements of backward mode), or a ``FusedTransformation``
      (placements of its mode).
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    params: params or their ``jax.ShapeDtypeStruct``s.
    *args: the loss's other arguments (arrays or ``jax.ShapeDtypeStruct``s).
    **kwargs: its keyword arguments.

  Returns:
    A dict from leaf path (``jax.tree_util.keystr``) to where its update runs. Backward mode:
    ``"loop"`` (row by row inside the backward loop of a scan, in place) or ``"tap"`` (in the
    backward pass once its whole gradient is complete). Forward mode: ``"loop"`` (row by row
    inside the forward loop of a scan, in place, just before the layer runs), ``"rows"`` (row
    by row in place before the loss) or ``"leaf"`` (whole, before the loss). Mode "off":
    ``"optax"``. Every mode: ``"carried"`` (not a float leaf: carried unchanged).

  Raises:
    NonSeparableError: ``tx`` cannot run in backward mode (without ``global_ops="two_pass"``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> def loss(p, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
    ...   return jnp.sum(h @ p["head"])
    >>> params = {"layers": jnp.zeros((4, 3, 3)), "head": jnp.zeros((3,))}
    >>> optfuse.describe(optax.adam(1e-3), loss, params, jnp.ones(3))
    {"['head']": 'tap', "['layers']": 'loop'}
  """
  from optfuse._fuse import FusedTransformation  # the API module imports this one

  mode, global_ops = "backward", None
  if isinstance(tx, FusedTransformation):
    mode, tx, global_ops = tx.mode, tx.tx, tx.global_ops
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  params = jax.tree.map(spec, params)
  args, kwargs = jax.tree.map(spec, (args, kwargs))
  leaves, params_def = jax.tree.flatten(params)
  diff = [i for i, p in enumerate(leaves) if _backward.is_float(p)]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  label = lambda i, where: where.get(i, "leaf" if mode == "forward" else "tap") if i in diff \
      else "carried"
  if mode == "off":
    return {path: "optax" if i in diff else "carried" for i, path in enumerate(paths)}
  found: list = []
  if mode == "forward":
    state = jax.eval_shape(_forward.transformation(tx)[0], params)
    plan = _global.make_global_plan(tx, params, state.opt_state)

    def analyze(p, s, a, kw):
      where = _forward.placement(plan, loss_fn, p, s, a, kw)
      return {**dict.fromkeys(where.rows, "rows"), **dict.fromkeys(where.in_loop, "loop")}
  else:
    state = jax.eval_shape(tx.init, params)
    plan = (_two_pass.make_plan if global_ops == "two_pass" else _plan.make_plan)(tx, params,
                                                                                  state)

    def analyze(p, s, a, kw):
      s = jax.tree.leaves(s)
      fusible = None
      if isinstance(plan, _global.GlobalPlan):  # two-pass: as _two_pass.value_and_update
        fusible = lambda leaf, length: plan.rowwise(leaf, s, plan.params_def.flatten_up_to(p),
                                                    stats=True)
      fused = _loops.analyze(loss_fn, plan, p, s, a, kw, diff, fusible=fusible).fused_leaves
      return dict.fromkeys(fused, "loop")

  jax.eval_shape(lambda *xs: found.append(analyze(*xs)), params, state, args, kwargs)
  return {path: label(i, found[0]) for i, path in enumerate(paths)}
