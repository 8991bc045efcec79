"""FSDP's layout of a params tree and the gradient one device holds under it.

FSDP here shards every param leaf along its largest axis that the devices divide (``fsdp_axis``,
which ``smallest_slices`` uses too), never along the layer axis of a stacked leaf (the fused
loops slice stacked leaves row by row along it), and replicates the leaves no axis of which
divides. For ``param_specs`` a leaf under a ``"layers"`` key is stacked, as in a scanned
decoder. The params may be arrays,
``jax.ShapeDtypeStruct``s, or anything with a ``shape`` and a ``dtype`` (the benchmark's
``Leaf``).

``python -m optfuse.bench --fsdp`` compiles the steps under this layout and reports these bytes
beside their compiled peaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optfuse._base._leaves import nbytes


def fsdp_axis(shape: Sequence[int], chips: int, stacked: bool | None = None) -> int | None:
  """The axis FSDP shards a leaf of ``shape`` along over ``chips``, or ``None`` (replicated).

  Args:
    shape: the leaf's shape.
    chips: the number of chips it is sharded over.
    stacked: whether axis 0 is the layer axis of a scanned stack, which is never sharded (the
      fused loops slice it row by row); ``None``: a leaf of three or more axes is stacked.

  Returns:
    The largest axis that ``chips`` divides (the first of equal ones), or ``None`` if none.

  Examples:
    >>> import optfuse as fx
    >>> fx.fsdp_axis((32000, 2048), 4), fx.fsdp_axis((24, 2048, 8192), 4), fx.fsdp_axis((3, 5), 4)
    (0, 2, None)
  """
  skip = len(shape) >= 3 if stacked is None else stacked
  axes = [a for a in range(1 if skip else 0, len(shape)) if shape[a] % chips == 0]
  return max(axes, key=lambda a: shape[a], default=None)


def _is_stacked(path) -> bool:
  return any(getattr(k, "key", None) == "layers" for k in path)


def param_specs(params, devices: int, axis_name: str = "fsdp") -> Any:
  """The FSDP ``PartitionSpec`` of every leaf of ``params`` over ``devices`` devices of the
  mesh axis ``axis_name``.

  Leaves under a ``"layers"`` key are stacked: their axis 0 is the scan's layer axis.

  Examples:
    >>> specs = param_specs({"embed": jax.ShapeDtypeStruct((64, 16), jnp.float32),
    ...                      "layers": {"w": jax.ShapeDtypeStruct((4, 16, 32), jnp.float32)}}, 8)
    >>> tuple(specs["embed"]), tuple(specs["layers"]["w"])
    (('fsdp',), (None, None, 'fsdp'))
  """

  def spec(path, leaf):
    axis = fsdp_axis(leaf.shape, devices, stacked=_is_stacked(path))
    return P() if axis is None else P(*(axis_name if a == axis else None
                                        for a in range(axis + 1)))

  return jax.tree_util.tree_map_with_path(spec, params)


def grad_share_bytes(params, specs, devices: int) -> int:
  """Per-device bytes of the gradient: a sharded leaf's bytes over ``devices``, others whole.

  Args:
    params: a tree of arrays, ``jax.ShapeDtypeStruct``s or the benchmark's ``Leaf``.
    specs: their ``PartitionSpec``s, as ``param_specs`` gives them.
    devices: the size of the mesh axis.

  Returns:
    The bytes of the float leaves' gradient that one device holds.

  Examples:
    >>> params = {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32),
    ...           "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    >>> grad_share_bytes(params, param_specs(params, 8), 8)  # 64 * 16 * 4 / 8 + 3 * 4
    524
  """
  leaves = jax.tree.leaves(params)
  parts = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  return sum(nbytes(p) // (devices if any(s) else 1)
             for p, s in zip(leaves, parts, strict=True) if jnp.issubdtype(p.dtype, jnp.inexact))


def live_grad_share_bytes(params, specs, devices: int) -> int:
  """Per-device bytes of the gradient a fused step must hold at once, for a scanned decoder.

  As ``Model.live_grad_bytes`` of the benchmark's ``decoder(scanned=True)``, on one device: the
  leaves outside the loop (the tied embedding's gradient is complete only at the end of the
  backward pass) plus one layer's rows of the stacked leaves under ``params["layers"]``.

  Args:
    params: a dict with the stacked leaves under ``"layers"``.
    specs: their ``PartitionSpec``s.
    devices: the size of the mesh axis.

  Returns:
    Bytes per device.
  """
  outside = [k for k in params if k != "layers"]
  layers = jax.tree.leaves(params["layers"])[0].shape[0]
  return (grad_share_bytes([params[k] for k in outside], [specs[k] for k in outside], devices)
          + grad_share_bytes(params["layers"], specs["layers"], devices) // layers)
