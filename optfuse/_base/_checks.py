"""Checks of a step's inputs, shared by every mode: params, optimizer state, microbatches.

Each raises a named error (``_errors``) that says what to do instead, while the step is
traced and before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from optfuse._base._errors import (
    LossOutputError,
    ParamsStructureError,
    StateMismatchError,
)


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def signature(tree) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)


def is_tracing(tree) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def check_params(params) -> None:
  """Raises ``ParamsStructureError`` if a params leaf is not an array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and not hasattr(leaf, "dtype"):
      raise ParamsStructureError(
          f"params leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array; "
          "convert it with jnp.asarray or move it out of the params tree.")


def _params_def_in_state(expected, got, params_def):
  """The structure of the params ``got`` was built for, where it differs from ``params_def``.

  Walks ``expected`` (the structure of ``tx.init(params)``) and ``got`` together; where
  ``expected`` holds a copy of the params structure (Adam's ``mu``...) and ``got`` holds another
  tree, the state was built for other params. ``None`` if no such place is found.
  """
  if expected == got or params_def.num_leaves == 0:
    return None
  if expected == params_def:
    return got
  if (expected.node_data() != got.node_data()
      or len(expected.children()) != len(got.children())):
    return None
  for e, g in zip(expected.children(), got.children()):
    found = _params_def_in_state(e, g, params_def)
    if found is not None:
      return found
  return None


def check_state(tx: optax.GradientTransformation, params, state) -> None:
  """Raises ``StateMismatchError`` unless ``state`` looks like ``tx.init(params)``."""
  expected = jax.eval_shape(tx.init, abstract(params))
  exp_def, got_def = jax.tree.structure(expected), jax.tree.structure(state)
  built_for = _params_def_in_state(exp_def, got_def, jax.tree.structure(params))
  if built_for is not None:
    raise ParamsStructureError(
        "the params do not have the tree structure the optimizer state was built for.\n"
        f"  params:           {jax.tree.structure(params)}\n  state built for:  {built_for}\n"
        "Pass params with the structure they had at init, or rebuild the state with "
        "fx.init(params).")
  if exp_def != got_def:
    raise StateMismatchError(
        "the optimizer state does not have the structure tx.init(params) gives for these params "
        f"and this optimizer.\n  expected: {exp_def}\n  got:      {got_def}\nBuild the state "
        "with fx.init(params) for the same optimizer and params (after fx.flush, a forward-mode "
        "state converts with optfuse.to_optax_state).")
  for path, exp, got in zip(
      (jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]),
      jax.tree.leaves(expected), jax.tree.leaves(state)):
    if jnp.shape(got) != exp.shape:
      raise StateMismatchError(
          f"optimizer state leaf {path} has shape {jnp.shape(got)} but tx.init(params) gives "
          f"{exp.shape}: the state was built for other params. Rebuild it with fx.init(params).")


def is_positive_int(value) -> bool:
  """Whether ``value`` is an int of at least 1 (``True`` and ``False`` are not)."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_loss(value, has_aux: bool):
  """Splits ``value`` into ``(loss, aux)`` and checks that the loss is a float scalar."""
  if has_aux:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
      returned = (f"an array of shape {jnp.shape(value)}" if hasattr(value, "shape")
                  else f"a {type(value).__name__}")
      raise LossOutputError(
          "has_aux=True but the loss function did not return a (loss, aux) pair; it returned "
          f"{returned}. Return (loss, aux) or use has_aux=False.")
    loss, aux = value
  else:
    loss, aux = value, None
  if isinstance(loss, (tuple, list, dict)):
    raise LossOutputError(
        f"the loss function returned a {type(loss).__name__}, not a scalar; if it returns "
        "(loss, aux), pass has_aux=True.")
  shape, dtype = jnp.shape(loss), jnp.result_type(loss)
  if shape != () or not jnp.issubdtype(dtype, jnp.floating):
    raise LossOutputError(
        f"the loss must be a float scalar, got shape {shape} and dtype {dtype}; reduce it "
        "(e.g. with .mean()) and make it floating point.")
  return loss, aux


def returns_pair(loss_fn: Callable, params, args: tuple, kwargs: dict) -> bool:
  """Whether ``loss_fn`` returns a ``(loss, aux)`` pair, decided from its abstract output."""
  out = jax.eval_shape(lambda p, a, kw: loss_fn(p, *a, **kw), params, args, kwargs)
  return isinstance(out, (tuple, list)) and len(out) == 2


def checked_step(tx: optax.GradientTransformation, inner):
  """``inner`` behind the input checks of a step on a plain optax state: the params' leaves are
  arrays (``check_params``) and the state is ``tx``'s for them (``check_state``)."""
  def step(params, state, *args, **kwargs):
    check_params(params)
    check_state(tx, params, state)
    return inner(params, state, *args, **kwargs)

  return step
