"""Leaf predicates shared by every layer: which params and state leaves are trained, a leaf's
bytes, and a leaf's key path as names."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def is_float(x) -> bool:
  """Whether an array (or ``jax.ShapeDtypeStruct``) is floating point: a trained leaf."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def nbytes(x) -> int:
  """Bytes of an array, a ``jax.ShapeDtypeStruct`` or anything with a ``shape`` and a ``dtype``.

  Examples:
    >>> nbytes(jax.ShapeDtypeStruct((3, 4), jnp.bfloat16))
    24
  """
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def is_float_aval(v) -> bool:
  """Whether a jaxpr variable holds floating-point values."""
  return jnp.issubdtype(v.aval.dtype, jnp.inexact)


def keep_int_state(new, old):
  """``new``, except where an integer or bool state leaf of ``old`` changed dtype: ``old`` there.

  Integer and bool params are carried unchanged; optax, run on them with a zero gradient,
  promotes their slots (Adam's ``mu``...) to float. Keeping those slots as they were keeps the
  state's signature stable from step to step (``lax.scan`` over steps, jit caches, donation).
  """
  keep = lambda n, o: o if not is_float(o) and jnp.result_type(n) != jnp.result_type(o) else n
  return jax.tree.map(keep, new, old)


def key_names(path) -> tuple[str, ...]:
  """A key path (``jax.tree_util``'s) as names, alike whether a level is a dict, a State, an
  attribute or a sequence: ``(DictKey('layers'), GetAttrKey('value'))`` -> ``('layers', 'value')``.
  """
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
