"""``per_layer``: an optax transformation applied to each layer of stacked leaves apart.

optax sees a stacked (scanned) leaf as one array: a statistic over the whole leaf (LAMB's and
LARS's trust ratios, Adafactor's block RMS and parameter scale, Muon's matrix of a rank-2 leaf)
then spans every layer, where the same model unrolled takes one per layer. ``per_layer`` runs
the inner transformation under ``jax.vmap`` over the layer axis of the stacked leaves, so that
each layer's slice is updated as optax updates that layer's own leaf on the unrolled model; the
other leaves go through the inner transformation as they are. Row ``l`` of an update then reads
only row ``l`` of the gradient, state and param, which backward fusion updates inside the loop
by construction.

The inner transformation runs once per group of leaves (the unstacked ones, and the stacked ones
of each layer count), each time on the whole params tree with ``optax.MaskedNode()`` at the
leaves of the other groups, as ``optax.masked`` hands them to its inner transformation: masks
and labels that read the tree's paths see the same paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from optfuse._base import _leaves
from optfuse._base._errors import LayerAxesError
from optfuse._optimizers import _muon_dims

# The axis of a leaf's layers, or ``None`` for a leaf that is not stacked.
Axis = int | None
LayerAxes = Any | Callable[[Any], Any]


class PerLayerState(NamedTuple):
  """The state of ``per_layer(tx)``.

  Attributes:
    stacks: one state of ``tx`` per layer count of the stacked leaves (ascending): ``tx``'s
      state for one layer, stacked over the layers. A state leaf whose path ends with a stacked
      param's path and that has as many axes (Adam's ``mu`` and ``nu``) is stacked on that
      param's layer axis; every other one (a step count, a factored moment) on axis 0.
    rest: ``tx``'s state of the leaves that are not stacked, or ``optax.EmptyState()`` when
      every leaf is.
  """

  stacks: tuple[Any, ...]
  rest: Any


def applies_per_layer(state) -> bool:
  """Whether an optimizer state holds a ``PerLayerState``: some of it runs under
  ``per_layer``."""
  is_state = lambda x: isinstance(x, PerLayerState)
  return any(map(is_state, jax.tree.leaves(state, is_leaf=is_state)))


def default_layer_axes(params) -> Any:
  """The default ``layer_axes``: axis 0 of every leaf of rank 1 or more under a key "layers"
  or "blocks", or a key starting with "Scan" (a Flax Linen ``nn.scan`` module); ``None``
  elsewhere. The same leaves ``stacked_muon_dims`` takes as stacked by default."""
  def axis(path, leaf) -> Axis:
    stacked = _muon_dims.under_layer_stack(_leaves.key_names(path), leaf)
    return 0 if stacked and np.ndim(leaf) >= 1 else None

  return jax.tree_util.tree_map_with_path(axis, params)


def per_layer(tx: optax.GradientTransformation, layer_axes: LayerAxes = None
              ) -> optax.GradientTransformationExtraArgs:
  """Applies ``tx`` to each layer of the stacked leaves apart, as optax does on the model
  unrolled.

  On a leaf that stacks ``L`` layers, optax takes one trust ratio (LAMB, LARS), one block RMS
  (Adafactor's update clipping and parameter scale) or one matrix (Muon, over a rank-2 leaf)
  over all the layers; on the unrolled model, each layer's leaf has its own. ``per_layer(tx)``
  is the per-layer form: each layer's slice of a stacked leaf is updated exactly as ``tx``
  updates that layer's leaf on the unrolled model, its state stacked over the layers
  (``jax.vmap`` of ``tx.init`` and ``tx.update`` over the layer axis). This changes the math
  against ``tx`` on the stacked leaves whenever ``tx`` reads a statistic of a whole leaf: use it
  where the per-layer statistic is meant (the LAMB and LARS papers' layer-wise trust ratio,
  Adafactor's RMS of each matrix). On an elementwise optimizer (Adam, SGD) it computes what
  ``tx`` does. Backward fusion updates the stacked leaves inside its loop by construction.

  Leaves that are not stacked go through ``tx`` as they are. ``tx`` must be one whose update
  of a leaf reads that leaf only, plus shared scalars (a step count, a schedule): a transform
  across leaves (``clip_by_global_norm``) would be applied to each layer's leaves and to the
  other leaves apart, so chain it outside: ``optax.chain(optax.clip_by_global_norm(1.0),
  optfuse.per_layer(tx))``. Extra arguments of ``update`` reach every layer's update as they
  are. For Muon, give ``muon_weight_dimension_numbers`` as numbers of one layer's axes: its
  default takes each rank-2 leaf of a layer as a matrix, and
  ``functools.partial(optfuse.stacked_muon_dims, stacked=lambda names, leaf: False)`` numbers
  leaves of higher rank too (attention's (d, heads, head_dim)); ``optfuse.stacked_muon_dims``
  itself numbers the stacked leaves, which ``per_layer`` does not show Muon.

  Args:
    tx: the optax transformation applied to each layer.
    layer_axes: the axis of each leaf's layers, or ``None`` for a leaf that is not stacked:
      a pytree prefix of the params (``{"layers": 0, "head": None}``; an int alone stacks every
      leaf on that axis), or a function that returns one from the params (``init``) or the
      updates (``update``), as ``optax.masked`` takes its mask. ``None``
      (``default_layer_axes``): axis 0 of the leaves under a key "layers", "blocks" or
      "Scan..."; Flax Linen's ``nn.scan(..., variable_axes={"params": 1})`` stacks them on
      axis 1. Every stacked leaf of one layer count is updated in one ``jax.vmap``.

  Returns:
    An optax ``GradientTransformationExtraArgs`` whose state is a ``PerLayerState``.

  Raises:
    LayerAxesError: ``layer_axes`` is not a prefix of the params, or gives a leaf an axis
      out of its range, or one that is not an int.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> def loss(p, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
    ...   return jnp.sum(h @ p["head"])
    >>> params = {"layers": jnp.ones((6, 3, 3)) / 3, "head": jnp.ones((3,))}
    >>> tx = optfuse.per_layer(optax.lamb(1e-3))   # one trust ratio per layer
    >>> state = tx.init(params)
    >>> state.stacks[0][0].count.shape             # LAMB's step count, one per layer
    (6,)
    >>> optfuse.describe(tx, loss, params, jnp.ones(3))
    {"['head']": 'tap', "['layers']": 'loop'}
  """
  tx = optax.with_extra_args_support(tx)

  def init(params) -> PerLayerState:
    flat, treedef = jax.tree.flatten(params)
    axes = _resolve(layer_axes, params, flat, treedef)
    stacks = tuple(_init_stack(tx, treedef, flat, axes, group) for group in _groups(flat, axes))
    rest = [i for i, a in enumerate(axes) if a is None]
    return PerLayerState(stacks, tx.init(_masked(treedef, flat, rest)) if rest
                         else optax.EmptyState())

  def update(updates, state: PerLayerState, params=None, **extra):
    flat_u, treedef = jax.tree.flatten(updates)
    flat_p = None if params is None else treedef.flatten_up_to(params)
    axes = _resolve(layer_axes, updates, flat_u, treedef)
    out, stacks = list(flat_u), []
    for group, stack in zip(_groups(flat_u, axes), state.stacks, strict=True):
      new, stack = _update_stack(tx, treedef, flat_u, flat_p, stack, axes, group, extra)
      out = [new.get(i, u) for i, u in enumerate(out)]
      stacks.append(stack)
    rest, rest_state = [i for i, a in enumerate(axes) if a is None], state.rest
    if rest:
      new_u, rest_state = tx.update(
          _masked(treedef, flat_u, rest), rest_state,
          None if flat_p is None else _masked(treedef, flat_p, rest), **extra)
      got = treedef.flatten_up_to(new_u)
      out = [got[i] if i in rest else u for i, u in enumerate(out)]
    return jax.tree.unflatten(treedef, out), PerLayerState(tuple(stacks), rest_state)

  return optax.GradientTransformationExtraArgs(init, update)


def _resolve(layer_axes: LayerAxes, tree, flat: list, treedef) -> list[Axis]:
  """Each leaf's layer axis (non-negative) or ``None``, from ``layer_axes`` read on ``tree``.

  Raises:
    LayerAxesError: ``layer_axes`` is no prefix of ``tree``, or an axis is out of range.
  """
  if layer_axes is None:
    layer_axes = default_layer_axes
  prefix = layer_axes(tree) if callable(layer_axes) else layer_axes
  try:
    full = jax.tree.map(lambda a, sub: jax.tree.map(lambda _: a, sub), prefix, tree,
                        is_leaf=lambda x: x is None)
    axes = treedef.flatten_up_to(full)
  except (ValueError, TypeError) as e:
    raise LayerAxesError(
        f"per_layer's layer_axes ({prefix!r}) is not a pytree prefix of the params (of "
        f"structure {treedef}): give one axis (an int) or None per leaf or per subtree, e.g. "
        '{"layers": 0, "head": None}') from e
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return [_checked_axis(a, np.shape(x), path) for a, x, path in zip(axes, flat, paths,
                                                                     strict=True)]


def _checked_axis(axis, shape: tuple[int, ...], path: str) -> Axis:
  if axis is None:
    return None
  if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
    raise LayerAxesError(f"per_layer's layer_axes gives the leaf {path} the axis {axis!r}: "
                         "an axis is an int, or None for a leaf that is not stacked")
  if not -len(shape) <= axis < len(shape):
    raise LayerAxesError(
        f"per_layer's layer_axes gives the leaf {path} of shape {shape} the layer axis {axis}, "
        "out of its range: give the axis its layers are stacked on, or None if it is not "
        "stacked")
  return int(axis) % len(shape)


def _groups(flat: list, axes: Sequence[Axis]) -> list[list[int]]:
  """The stacked leaves by layer count (ascending), each group in leaf order."""
  by_length: dict[int, list[int]] = {}
  for i, a in enumerate(axes):
    if a is not None:
      by_length.setdefault(np.shape(flat[i])[a], []).append(i)
  return [by_length[n] for n in sorted(by_length)]


def _masked(treedef, flat: list, keep: Sequence[int]):
  """The tree with the leaves ``keep`` and ``optax.MaskedNode()`` at every other leaf."""
  keep = set(keep)
  return jax.tree.unflatten(treedef, [x if i in keep else optax.MaskedNode()
                                      for i, x in enumerate(flat)])


def _state_axes(state, treedef, flat: list, axes: Sequence[Axis], group: Sequence[int]):
  """The layer axis of each leaf of a stacked state (``state`` of one layer or stacked, with
  ``flat`` alike): the axis of the stacked param whose path ends its path, where it has as
  many axes as that param; 0 elsewhere."""
  params_paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, flat))[0]
  owners = sorted(((tuple(params_paths[i][0]), i) for i in group), key=lambda t: -len(t[0]))

  def axis(path, leaf) -> int:
    for owner, i in owners:
      if tuple(path[len(path) - len(owner):]) == owner and np.ndim(leaf) == np.ndim(flat[i]):
        return axes[i]
    return 0

  return jax.tree_util.tree_map_with_path(axis, state)


def _one_layer(x, axis: int) -> jax.ShapeDtypeStruct:
  shape = np.shape(x)
  return jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], jax.numpy.result_type(x))


def _init_stack(tx, treedef, flat: list, axes: Sequence[Axis], group: list[int]):
  """``tx.init`` of one layer of the stacked leaves ``group``, stacked over the layers."""
  def init_one(leaves):
    return tx.init(_masked(treedef, _put(flat, group, leaves), group))

  one = [_one_layer(flat[i], axes[i]) for i in group]
  layer_state = jax.eval_shape(init_one, one)
  out_axes = _state_axes(layer_state, treedef, _put(flat, group, one), axes, group)
  return jax.vmap(init_one, in_axes=([axes[i] for i in group],), out_axes=out_axes)(
      [flat[i] for i in group])


def _update_stack(tx, treedef, flat_u: list, flat_p: list | None, state, axes: Sequence[Axis],
                  group: list[int], extra: dict) -> tuple[dict[int, Any], Any]:
  """``tx.update`` of each layer of the stacked leaves ``group``: their new updates by leaf
  index, and the new stacked state."""
  def update_one(u, s, p):
    new_u, new_s = tx.update(
        _masked(treedef, _put(flat_u, group, u), group), s,
        None if p is None else _masked(treedef, _put(flat_u, group, p), group), **extra)
    got = treedef.flatten_up_to(new_u)
    return [got[i] for i in group], new_s

  leaf_axes = [axes[i] for i in group]
  state_axes = _state_axes(state, treedef, flat_u, axes, group)
  params = None if flat_p is None else [flat_p[i] for i in group]
  new_u, state = jax.vmap(update_one, in_axes=(leaf_axes, state_axes,
                                               None if params is None else leaf_axes),
                          out_axes=(leaf_axes, state_axes))(
      [flat_u[i] for i in group], state, params)
  return dict(zip(group, new_u, strict=True)), state


def _put(flat: list, where: Sequence[int], values: Sequence[Any]) -> list:
  out = list(flat)
  for i, v in zip(where, values, strict=True):
    out[i] = v
  return out
