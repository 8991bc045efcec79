"""Muon's dimension numbers for stacked (scanned) layers, and the check of a Muon's.

``optax.contrib.muon`` orthogonalises a leaf's momentum as the matrices its
``MuonDimensionNumbers`` name (reduction axes by output axes); every other axis is a batch
axis, each of its slices orthogonalised on its own. Without dimension numbers Muon takes the
rank-2 leaves only and gives every other leaf to its AdamW fallback. On layers stacked for
``lax.scan`` that is rarely what was meant: a stacked (L, d, ff) weight goes to AdamW, and a
stacked (L, d) norm scale is orthogonalised across layers (each layer's update reads every
layer's momentum, and backward fusion can only update it after the loop).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, MuonState

from optfuse._base import _leaves
from optfuse._base._errors import MuonDimsError

Names = tuple[str, ...]
# Key names the defaults read; each list is documented in ``stacked_muon_dims``.
LAYER_STACK_KEYS = ("layers", "blocks")
NOT_MATRIX_KEYS = ("head", "lm_head", "logits_dense", "bias", "scale")
OUTPUT_PROJECTION_KEYS = ("wo", "out", "o_proj", "out_proj")
EXPERTS_KEYS = ("moe", "expert")  # parts of a key name, in any case
# What ``describe``'s warnings tell a user of Muon with stacked layers to do.
_FIX = ("muon_weight_dimension_numbers=optfuse.stacked_muon_dims (with layer_axis if the layers "
        "are not stacked on axis 0)")
# The same under ``optfuse.per_layer``, where Muon's dimension numbers number one layer's axes.
_FIX_PER_LAYER = ("dimension numbers of one layer's axes (under optfuse.per_layer): "
                  "muon_weight_dimension_numbers=functools.partial(optfuse.stacked_muon_dims, "
                  "stacked=lambda names, leaf: False)")


def under_layer_stack(names: Names, leaf: Any) -> bool:
  """The default ``stacked``: a key of the path is "layers" or "blocks", or starts with "Scan"
  (Flax Linen names an ``nn.scan`` module ``ScanBlock_0``)."""
  return any(n in LAYER_STACK_KEYS or n.startswith("Scan") for n in names)


def embedding_or_head(names: Names, leaf: Any) -> bool:
  """The default ``exclude``: a key of the path contains "embed" (embedding and unembedding
  tables) or is one of ``NOT_MATRIX_KEYS``."""
  return any("embed" in n.lower() or n in NOT_MATRIX_KEYS for n in names)


def input_first(names: Names, shape: tuple[int, ...]) -> MuonDimensionNumbers:
  """The default ``matrix``: the first axis of a layer's weight is its input (reduction) and
  the rest its output; an output projection (a key in ``OUTPUT_PROJECTION_KEYS``, such as
  attention's (heads, head_dim, d) ``wo``) takes every axis but the last as its input; under a
  mixture of experts (a key containing one of ``EXPERTS_KEYS``) the last two axes are each
  expert's matrix and the leading ones (the experts) batch axes."""
  axes = tuple(range(len(shape)))
  if any(k in n.lower() for n in names for k in EXPERTS_KEYS):
    return MuonDimensionNumbers(axes[-2], axes[-1])
  split = len(shape) - 1 if any(n in OUTPUT_PROJECTION_KEYS for n in names) else 1
  return MuonDimensionNumbers(_packed(axes[:split]), _packed(axes[split:]))


def stacked_muon_dims(params, *, layer_axis: int = 0,
                      stacked: Callable[[Names, Any], bool] | None = None,
                      exclude: Callable[[Names, Any], bool] | None = None,
                      matrix: Callable[[Names, tuple[int, ...]], MuonDimensionNumbers | None]
                      | None = None):
  """Muon's dimension numbers that orthogonalise each layer's matrix of stacked layers on its own.

  For ``optax.contrib.muon(..., muon_weight_dimension_numbers=...)``, as the tree or as the
  function itself (optax calls it with the params). Each leaf is read from its key path, as a
  tuple of names (dict keys, attribute names, sequence indices as strings), and its shape:

  - stacked leaves (``stacked``) have their layers on ``layer_axis``, which becomes a batch axis,
    so that row ``l`` of the update reads only layer ``l`` (and backward fusion runs it in the
    loop iteration of layer ``l``); the other leaves are one layer's weights as they are;
  - a leaf with fewer than two axes besides its layer axis (norm scales, biases) or that
    ``exclude`` names (embeddings, the output head) gets ``None``: Muon's AdamW fallback;
  - any other leaf is a matrix: ``matrix`` numbers its axes of one layer (the layer axis left
    out), reduction then output, and those are moved past the layer axis.

  Args:
    params: the params, arrays or ``jax.ShapeDtypeStruct`` values, in any pytree (nested dicts,
      Flax Linen's, an ``nnx.State``).
    layer_axis: the axis of a stacked leaf that indexes its layers: 0 when the layers were
      stacked with ``jax.vmap`` or ``nn.scan``'s default, 1 for MaxText's ``param_scan_axis=1``.
      Negative values count from the end.
    stacked: ``stacked(names, leaf)``, whether a leaf is stacked. Default: a key of its path is
      "layers" or "blocks", or starts with "Scan" (a Flax Linen ``nn.scan`` module's name).
    exclude: ``exclude(names, leaf)``, whether a leaf stays on AdamW. Default: a key of its
      path contains "embed" (embedding and unembedding tables) or is "head", "lm_head",
      "logits_dense", "bias" or "scale".
    matrix: ``matrix(names, shape)``, a layer's matrix as ``MuonDimensionNumbers`` over the
      axes of ``shape`` (the leaf's shape without its layer axis), or ``None`` for AdamW.
      Default: the first axis is the reduction axis and the rest the output axes, except for
      output projections (a key "wo", "out", "o_proj" or "out_proj"): every axis but the last
      is the reduction, the last the output. So attention's (L, d, heads, head_dim) ``wq``
      gets ``MuonDimensionNumbers(1, (2, 3))`` and its (L, heads, head_dim, d) ``wo``
      ``MuonDimensionNumbers((1, 2), 3)``. Under a key containing "moe" or "expert" (any
      case), the last two axes are the matrix and the leading ones (the experts) batch axes,
      so (L, experts, d, ff) gets ``MuonDimensionNumbers(2, 3)``.

  Returns:
    A pytree of ``params``' structure with a ``MuonDimensionNumbers`` (an axis alone as an
    int, several as a tuple) or ``None`` at each leaf. It is a plain tree: to override one leaf,
    replace its entry.

  Raises:
    MuonDimsError: ``layer_axis`` is out of range for a stacked leaf, or ``matrix`` returned
      axes out of range of one layer's axes, an axis on both sides, or an empty side.

  Examples:
    >>> import functools, jax.numpy as jnp, optax, optfuse
    >>> params = {"embed": jnp.zeros((64, 8)),
    ...           "layers": {"norm": jnp.ones((4, 8)), "w1": jnp.zeros((4, 8, 32)),
    ...                      "wq": jnp.zeros((4, 8, 2, 4)), "wo": jnp.zeros((4, 2, 4, 8))}}
    >>> dims = optfuse.stacked_muon_dims(params)
    >>> dims["embed"], dims["layers"]["norm"]
    (None, None)
    >>> dims["layers"]["w1"]
    MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    >>> dims["layers"]["wq"], dims["layers"]["wo"]
    (MuonDimensionNumbers(reduction_axis=1, output_axis=(2, 3)),
     MuonDimensionNumbers(reduction_axis=(1, 2), output_axis=3))
    >>> tx = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=optfuse.stacked_muon_dims)

    With the layers stacked on axis 1 (MaxText), give the axis:

    >>> by_1 = functools.partial(optfuse.stacked_muon_dims, layer_axis=1)
    >>> by_1({"layers": {"w1": jnp.zeros((8, 4, 32))}})["layers"]["w1"]
    MuonDimensionNumbers(reduction_axis=0, output_axis=2)
  """
  stacked = under_layer_stack if stacked is None else stacked
  exclude = embedding_or_head if exclude is None else exclude
  matrix = input_first if matrix is None else matrix

  def dims(path, leaf):
    names, where = _leaves.key_names(path), jax.tree_util.keystr(path)
    shape = tuple(leaf.shape if hasattr(leaf, "shape") else np.shape(leaf))
    axis = _layer_axis(layer_axis, shape, where) if stacked(names, leaf) else None
    layer_shape = shape if axis is None else shape[:axis] + shape[axis + 1:]
    if len(layer_shape) < 2 or exclude(names, leaf):
      return None
    layer = matrix(names, layer_shape)
    return None if layer is None else _stored(layer, axis, len(layer_shape), where)

  return jax.tree_util.tree_map_with_path(dims, params)


def _packed(axes: Sequence[int]) -> int | tuple[int, ...]:
  """One axis as an int, several as a tuple: dimension numbers as one writes them by hand."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def _layer_axis(layer_axis: int, shape: tuple[int, ...], where: str) -> int:
  if not -len(shape) <= layer_axis < len(shape):
    raise MuonDimsError(
        f"layer_axis={layer_axis} is out of range for the stacked leaf {where} of shape {shape}: "
        "pass the axis its layers are stacked on, or a `stacked` predicate that leaves it out")
  return layer_axis % len(shape)


def _stored(layer: MuonDimensionNumbers, axis: int | None, rank: int, where: str
            ) -> MuonDimensionNumbers:
  """``layer``'s axes of one layer's ``rank`` axes as axes of the stored leaf, whose layer axis
  is ``axis`` (``None``: not stacked)."""
  sides = [(side,) if isinstance(side, (int, np.integer)) else tuple(side) for side in layer]
  bad = [a for side in sides for a in side if not -rank <= a < rank]
  sides = [tuple(int(a) % rank for a in side) for side in sides]
  if bad or not all(sides) or set(sides[0]) & set(sides[1]):
    raise MuonDimsError(
        f"the `matrix` rule gave {where} {layer}, which is not a matrix of a layer's {rank} "
        "axes (numbered without the layer axis): every axis in range, none on both sides, "
        "neither side empty")
  shift = lambda a: a + 1 if axis is not None and a >= axis else a
  return MuonDimensionNumbers(*(_packed([shift(a) for a in side]) for side in sides))


def muon_warnings(tx: optax.GradientTransformation, params, stacked: Collection[int],
                  mixing: Collection[int], per_layer: bool = False) -> dict[int, str]:
  """Leaf index -> what a Muon in ``tx`` does to a stacked leaf that was likely not meant, and
  what to do instead; empty when ``tx`` runs no Muon.

  Args:
    tx: the optimizer.
    params: its params (``jax.ShapeDtypeStruct`` values will do).
    stacked: the leaves a scan reads as its stacked input.
    mixing: the leaves whose update mixes rows of the stacked axis.
    per_layer: whether the Muon runs under ``optfuse.per_layer``, on each layer apart: its
      dimension numbers are then those of one layer.
  """
  on_muon = _on_muon(jax.eval_shape(tx.init, params), params)
  if on_muon is None:
    return {}
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  found = {}
  for i in sorted(stacked):
    names, leaf = _leaves.key_names(flat[i][0]), flat[i][1]
    # The helper's default finds stacks by key name: say so where it would miss this one.
    fix = _FIX_PER_LAYER if per_layer else _FIX + (
        "" if under_layer_stack(names, leaf) else
        ", and stacked= a predicate that takes this leaf (no key of its path is 'layers' or "
        "'blocks')")
    if i not in on_muon and len(leaf.shape) >= 3 and not embedding_or_head(names, leaf):
      found[i] = (f"Muon leaves this rank-{len(leaf.shape)} stacked leaf to its AdamW fallback "
                  "(it takes rank-2 leaves only, unless its dimension numbers name the leaf's "
                  f"matrix); to orthogonalise each layer's matrix, pass {fix}")
    elif i in on_muon and i in mixing:
      found[i] = ("Muon's dimension numbers do not leave its layer axis a batch axis of its own "
                  "(as a reduction or output axis it mixes the layers; merged with another batch "
                  "axis it is not fused), so it is updated after the loop; to orthogonalise each "
                  f"layer's matrix apart and leave vectors to AdamW, pass {fix}")
  return found


def _on_muon(state, params) -> set[int] | None:
  """The leaves a Muon of ``state`` orthogonalises (its momentum is no ``MaskedNode`` there), or
  ``None`` when ``state`` holds no Muon state shaped like ``params``."""
  treedef = jax.tree.structure(params)
  found = None
  muons = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MuonState))
  for muon in (m for m in muons if isinstance(m, MuonState)):
    try:
      mu = treedef.flatten_up_to(muon.mu)
    except (ValueError, TypeError):
      continue
    found = (found or set()) | {i for i, m in enumerate(mu) if not isinstance(m, optax.MaskedNode)}
  return found
