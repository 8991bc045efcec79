"""The separable split: ``tx.update`` traced once and cut into one group per parameter leaf.

Every output of the traced update depends on the gradient of exactly one leaf ``i`` (it belongs
to leaf ``i``'s group: Adam's ``mu`` and ``nu``, the update itself) or on no gradient (shared:
``count``, injected hyperparameters). An output that depends on the gradients of two or more
leaves makes the transform non-separable (global-norm clipping, trust ratios across leaves...):
``make_plan`` refuses it, naming the transform, and ``_global_stage`` splits it instead.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore

from optfuse._base._errors import NonSeparableError
from optfuse._base._leaves import is_float
from optfuse._jaxpr import _interpreter
from optfuse._plan._plan import LeafGroup, Plan

# optax transforms whose update requires the loss (line searches, Polyak step sizes,
# reduce_on_plateau) fail with this TypeError when called without ``value``/``grad``/``value_fn``.
_MISSING_EXTRA_ARGS = re.compile(r"([\w.]+)\.<locals>\.\w+\(\) missing \d+ required keyword-only")


def _loss_stand_in(value):
  """A ``value_fn`` for analysis only: like any loss, it reads every float param."""
  def value_fn(params, *args, **kwargs):
    del args, kwargs
    floats = [x for x in jax.tree.leaves(params) if is_float(x)]
    return value + sum(jnp.sum(x).astype(value.dtype) for x in floats)

  return value_fn


def trace_update(tx: optax.GradientTransformation, params, state):
  """The jaxpr of ``tx.update`` on flat leaves, and the transform that needs the loss, if any.

  A transform that needs ``value``/``grad``/``value_fn`` is traced with stand-ins (one more
  input, the loss value) only so that ``make_plan`` can say why it refuses it.

  Returns:
    ``(closed_jaxpr, params_def, state_def, num_params, num_state, needs_loss)``.
  """
  params_leaves, params_def = jax.tree.flatten(params)
  state_leaves, state_def = jax.tree.flatten(state)
  n, m = len(params_leaves), len(state_leaves)

  def flat_update(flat_g, flat_s, flat_p, *value):
    extra = {}
    if value:
      extra = dict(value=value[0], grad=jax.tree.unflatten(params_def, flat_g),
                   value_fn=_loss_stand_in(value[0]))
    updates, new_state = tx.update(jax.tree.unflatten(params_def, flat_g),
                                   jax.tree.unflatten(state_def, flat_s),
                                   jax.tree.unflatten(params_def, flat_p), **extra)
    new_leaves, new_def = jax.tree.flatten(new_state)
    if new_def != state_def:
      raise NonSeparableError(
          "tx.update returned an optimizer state whose tree structure differs from its input "
          f"({new_def} vs {state_def}); optfuse needs update to keep the state structure. "
          'Use mode="off".')
    return jax.tree.leaves(updates), new_leaves

  abstract = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  specs = ([abstract(p) for p in params_leaves], [abstract(s) for s in state_leaves],
           [abstract(p) for p in params_leaves])
  try:
    return jax.make_jaxpr(flat_update)(*specs), params_def, state_def, n, m, None
  except TypeError as e:
    needs_loss = _MISSING_EXTRA_ARGS.search(str(e))
    if needs_loss is None:
      raise
  value = jax.ShapeDtypeStruct((), jnp.float32)
  closed = jax.make_jaxpr(flat_update)(*specs, value)
  return closed, params_def, state_def, n, m, needs_loss.group(1)


def update_needs_loss(tx: optax.GradientTransformation, grads, state, params) -> bool:
  """Whether ``tx.update(grads, state, params)`` requires the loss (``value``, ``grad``,
  ``value_fn``: line searches, Polyak step sizes, ``reduce_on_plateau``): its abstract trace
  without them fails with the ``TypeError`` of a missing keyword-only argument. Nothing runs.

  Raises:
    TypeError: the update fails for another reason (its own error, raised as it is).
  """
  try:
    jax.eval_shape(lambda g, s, p: tx.update(g, s, p), grads, state, params)
  except TypeError as e:
    if _MISSING_EXTRA_ARGS.search(str(e)) is None:
      raise
    return True
  return False


_TRANSFORM_FRAME = re.compile(r"([\w.]+)\.<locals>\.(update_fn|update)$")


def _transform_name(eqn: jcore.JaxprEqn) -> str:
  """Names the optax transform that emitted ``eqn``, from the source traceback."""
  frames = list(eqn.source_info.traceback.frames) if eqn.source_info.traceback else []
  for frame in frames:
    match = _TRANSFORM_FRAME.search(frame.function_name)
    if match and not frame.file_name.endswith(("_combining.py", "base.py", "_wrappers.py")):
      return match.group(1)
  for frame in frames:
    if "/optax/" in frame.file_name:
      return f"{frame.function_name} ({frame.file_name.split('/optax/')[-1]}:{frame.line_num})"
  return "an unknown part of the update"


def paths(tree) -> list[str]:
  """The ``keystr`` path of every leaf of ``tree``."""
  return [jax.tree_util.keystr(path) or "<root>" for path, _ in
          jax.tree_util.tree_flatten_with_path(tree)[0]]


def make_plan(tx: optax.GradientTransformation, params, state, traced=None) -> Plan:
  """Traces ``tx.update`` for these params/state and splits it per leaf.

  Args:
    tx: any optax transformation.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    state: ``tx.init(params)`` or a state of the same structure.
    traced: ``trace_update(tx, params, state)``, when the caller has it already.

  Returns:
    The ``Plan``, without a global stage.

  Raises:
    NonSeparableError: the update of some leaf depends on the gradients of other leaves.
  """
  traced = trace_update(tx, params, state) if traced is None else traced
  closed, params_def, state_def, n, m, needs_loss = traced
  # Constants become leading inputs, so that pruning can drop the ones a leaf does not read.
  jaxpr, c = _interpreter.consts_as_inputs(closed.jaxpr), len(closed.consts)
  in_deps = [frozenset()] * c + [frozenset([i]) for i in range(n)] + [frozenset()] * (
      m + n + (needs_loss is not None))
  out_deps = _interpreter.output_dependencies(jaxpr, in_deps)
  update_deps, state_deps = out_deps[:n], out_deps[n:]

  bad = [k for k, d in enumerate(out_deps) if len(d) > 1]
  bad += [i for i, d in enumerate(update_deps) if d and d != frozenset([i])]
  if bad:
    eqn = _interpreter.first_mixing_equation(jaxpr, in_deps)
    where = _transform_name(eqn) if eqn is not None else "the update"
    names = paths(jax.tree.unflatten(params_def, list(range(n))))
    k = bad[0]
    mixed = sorted(out_deps[k])[:4]
    raise NonSeparableError(
        f"optfuse backward fusion cannot fuse {where}: the update of one parameter leaf depends on "
        f"the gradients of other leaves ({', '.join(names[j] for j in mixed)}"
        f"{', ...' if len(out_deps[k]) > 4 else ''}). Backward fusion updates each leaf as soon as "
        'its own gradient is complete, so this transform needs mode="forward" (exact for every '
        'optax transform), the two-pass opt-in global_ops="two_pass", or mode="off".')
  if needs_loss is not None:
    raise NonSeparableError(
        f"optfuse backward fusion cannot fuse {needs_loss}: its update needs the loss (the extra "
        "arguments value, grad or value_fn of tx.update), which the backward pass does not pass "
        'to the update of a single leaf. Use mode="off", which passes value, grad and value_fn.')

  state_leaves, params_leaves = jax.tree.leaves(state), jax.tree.leaves(params)
  groups = []
  for i in range(n):
    outs = tuple(k for k in range(m) if state_deps[k] == frozenset([i]))
    # A non-float param has no tap: its state is updated after the backward pass, any dtype.
    for k in outs if is_float(params_leaves[i]) else ():
      if not is_float(state_leaves[k]):
        raise NonSeparableError(
            f"optimizer state leaf {paths(state)[k]} has dtype {jnp.result_type(state_leaves[k])} "
            "and depends on a gradient; backward fusion can only carry float state in the "
            'backward pass. Use mode="forward" or mode="off".')
    used = [j == i for j in range(n)] + [k in outs for k in range(m)]
    pruned, reads = _interpreter.prune(jaxpr, used)
    groups.append(LeafGroup(i, outs, pruned, tuple(reads), bool(update_deps[i])))

  shared_outs = tuple(k for k in range(m) if not state_deps[k])
  shared_used = [False] * n + [k in shared_outs for k in range(m)]
  shared_jaxpr, shared_reads = _interpreter.prune(jaxpr, shared_used)
  return Plan(params_def, state_def, n, m, tuple(closed.consts), tuple(groups), shared_outs,
              shared_jaxpr, tuple(shared_reads))
