"""Leaf predicates shared by every layer: which params and state leaves are trained."""

from __future__ import annotations

import jax.numpy as jnp


def is_float(x) -> bool:
  """Whether an array (or ``jax.ShapeDtypeStruct``) is floating point: a trained leaf."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def is_float_aval(v) -> bool:
  """Whether a jaxpr variable holds floating-point values."""
  return jnp.issubdtype(v.aval.dtype, jnp.inexact)
