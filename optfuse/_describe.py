"""Where each parameter leaf's update runs: a diagnostic for users and tests."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from optfuse import _backward, _loops, _plan


def describe(tx: optax.GradientTransformation, loss_fn: Callable, params, *args,
             **kwargs) -> dict[str, str]:
  """Says where backward fusion updates each parameter leaf, without running anything.

  Args:
    tx: the optax transformation.
    loss_fn: ``loss_fn(params, *args, **kwargs)``.
    params: params or their ``jax.ShapeDtypeStruct``s.
    *args: the loss's other arguments (arrays or ``jax.ShapeDtypeStruct``s).
    **kwargs: its keyword arguments.

  Returns:
    A dict from leaf path (``jax.tree_util.keystr``) to one of
    ``"loop"`` (updated row by row inside the backward loop of a scan, in place),
    ``"tap"`` (updated in the backward pass once its whole gradient is complete) or
    ``"carried"`` (not a float leaf: carried unchanged).

  Raises:
    NonSeparableError: ``tx`` cannot run in backward mode.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> def loss(p, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
    ...   return jnp.sum(h @ p["head"])
    >>> params = {"layers": jnp.zeros((4, 3, 3)), "head": jnp.zeros((3,))}
    >>> optfuse.describe(optax.adam(1e-3), loss, params, jnp.ones(3))
    {"['head']": 'tap', "['layers']": 'loop'}
  """
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  params = jax.tree.map(spec, params)
  args, kwargs = jax.tree.map(spec, (args, kwargs))
  state = jax.eval_shape(tx.init, params)
  plan = _plan.make_plan(tx, params, state)
  leaves = plan.params_def.flatten_up_to(params)
  diff = [i for i, p in enumerate(leaves) if _backward.is_float(p)]

  def analyze(p, s, a, kw):
    return _loops.analyze(loss_fn, plan, p, jax.tree.leaves(s), a, kw, diff).fused_leaves

  fused: list = []
  jax.eval_shape(lambda *xs: fused.append(analyze(*xs)), params, state, args, kwargs)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  return {path: "loop" if i in fused[0] else "tap" if i in diff else "carried"
          for i, path in enumerate(paths)}
