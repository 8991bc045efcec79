"""``low_bit``: an optax transformation whose float slots are held in 8 or 4 bits.

Its state is the inner transformation's state with each quantized slot replaced by a
``QuantizedSlot`` (packed codes and one scale a block, ``_blocks``); the count, non-float
leaves and slots of fewer than ``min_size`` elements stay as the inner transformation keeps
them. ``update`` dequantizes the slots, runs the inner update and quantizes the new slots.
Which slots are quantized, and with which map, is decided from the inner state's shapes alone
(``jax.eval_shape`` of its ``init``), so it is the same in ``init`` and every ``update``, and
every quantized slot stays stacked like its param (its leading axes are the param's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optfuse._base._errors import LowBitError
from optfuse._low_bit import _blocks, _maps

# Slots whose values are never negative (second moments), quantized with the unsigned map.
UNSIGNED_SLOTS = frozenset({"nu", "nu_max", "sum_of_squares"})
# Slots that hold hyperparameters, not statistics of the gradient: kept as they are, at any size
# (Muon's Newton-Schulz coefficients, (3,) or (steps, 3); ``inject_hyperparams``' values).
HYPERPARAMETER_SLOTS = frozenset({"ns_coeffs", "hyperparams"})
# bitsandbytes keeps a slot of fewer elements in 32 bits (``min_8bit_size``), as torchao does.
MIN_SIZE = 4096

SlotMap = Callable[[str, jax.ShapeDtypeStruct], str | None]


class QuantizedSlot(NamedTuple):
  """A float slot in low bits.

  Attributes:
    codes: the codes packed into float32 words of bits (``_blocks``), shape
      ``(*shape[:-1], ceil(n / block_size) * leaf_block * bits // 32)``, where ``leaf_block``
      (at most ``block_size``) splits ``n`` into equal blocks of a multiple of 8 values.
    scales: one float32 scale a block, shape ``(*shape[:-1], ceil(n / block_size))``.
  """

  codes: jax.Array
  scales: jax.Array


def default_slot_map(path: str, slot: jax.ShapeDtypeStruct) -> str | None:
  """``None`` (kept) for a slot with a name of ``HYPERPARAMETER_SLOTS`` on its path (Muon's
  ``ns_coeffs``), ``"unsigned"`` for one with a name of ``UNSIGNED_SLOTS`` (Adam's ``nu``,
  AdaGrad's ``sum_of_squares``), ``"signed"`` for every other slot (first moments, Muon's
  ``mu``)."""
  del slot
  names = set(path.replace("[", ".").replace("]", ".").split("."))
  if names & HYPERPARAMETER_SLOTS:
    return None
  return "unsigned" if names & UNSIGNED_SLOTS else "signed"


def _check_args(bits: int, block_size: int, min_size: int) -> None:
  if bits not in (4, 8):
    raise LowBitError(f"low_bit takes bits=8 or bits=4, not {bits!r}.")
  if not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
    raise LowBitError(
        f"low_bit's block_size must be a positive multiple of 8 (codes are packed 8 to a "
        f"32-bit word), not {block_size!r}; the anchors use 256 for 8 bits, 128 for 4 bits.")
  if not isinstance(min_size, int) or min_size < 0:
    raise LowBitError(f"low_bit's min_size is a number of elements, 0 or more, not {min_size!r}.")


def _slot_schemes(template, updates, bits: int, min_size: int, slot_map: SlotMap
                  ) -> list:
  """Per leaf of the inner state's ``template`` (in flattening order): its ``Scheme``, or
  ``None`` to keep it."""
  param_shapes = {tuple(jnp.shape(u)) for u in jax.tree.leaves(updates)}

  def choose(path, slot):
    name = jax.tree_util.keystr(path)
    if (not jnp.issubdtype(slot.dtype, jnp.floating) or not slot.shape
        or math.prod(slot.shape) < min_size):
      return None  # counts, scalar hyperparameters and small slots stay as they are
    kind = slot_map(name, slot)
    if kind is None:
      return None
    if kind not in ("signed", "unsigned"):
      raise LowBitError(f"slot_map returned {kind!r} for {name}; it returns "
                        '"signed", "unsigned" or None.')
    if tuple(slot.shape) not in param_shapes:
      raise LowBitError(
          f"low_bit cannot quantize the inner state's slot {name} of shape {slot.shape}: it is "
          "shaped like no parameter, so its update is not elementwise (a factored or global "
          "statistic). Wrap only the elementwise part of the chain in low_bit, or pass a "
          "slot_map that returns None for this slot.")
    return _maps.scheme(bits, kind == "signed")

  return [choose(path, slot) for path, slot in jax.tree_util.tree_flatten_with_path(template)[0]]


def _compress(state, template, schemes: list, block_size: int):
  treedef = jax.tree.structure(template)
  leaves = [x if scheme is None else QuantizedSlot(*_blocks.quantize(x, scheme, block_size))
            for scheme, x in zip(schemes, treedef.flatten_up_to(state))]
  return jax.tree.unflatten(treedef, leaves)


def _at_run_time(state, template, schemes: list, params):
  """``state`` with each slot to quantize computed from ``params`` at run time, its values
  unchanged: an init's slots are constants (zeros), and XLA's constant folding would evaluate
  their quantization at compile time, slowly (measured on CPU: 25 s to compile ``init`` for one
  (8, 1024, 512) leaf, 0.25 s with this). Each slot becomes ``where(pred, slot, slot + 1)``
  for a ``pred`` read from the params that is always true (``(bits | 1) != 0`` of their first
  float leaf's largest value) but that XLA cannot fold."""
  floats = [p for p in jax.tree.leaves(params)
            if jnp.issubdtype(jnp.result_type(p), jnp.floating) and jnp.size(p)]
  if not floats or all(scheme is None for scheme in schemes):
    return state
  bits = lax.bitcast_convert_type(jnp.max(floats[0]).astype(jnp.float32), jnp.int32)
  pred = (bits | 1) != 0
  treedef = jax.tree.structure(template)
  leaves = [x if scheme is None else jnp.where(pred, x, x + 1)
            for scheme, x in zip(schemes, treedef.flatten_up_to(state))]
  return jax.tree.unflatten(treedef, leaves)


def _expand(state, template, schemes: list, block_size: int):
  treedef = jax.tree.structure(template)
  leaves = [x if scheme is None else _blocks.dequantize(
      x.codes, x.scales, scheme, block_size, spec.shape[-1], spec.dtype)
            for scheme, spec, x in zip(schemes, jax.tree.leaves(template),
                                       treedef.flatten_up_to(state))]
  return jax.tree.unflatten(treedef, leaves)


def low_bit(inner: optax.GradientTransformation, bits: int = 8, block_size: int | None = None,
            min_size: int = MIN_SIZE, slot_map: SlotMap = default_slot_map
            ) -> optax.GradientTransformation:
  """Holds the float slots of an elementwise transformation's state in 8 or 4 bits.

  Each quantized slot is cut along its last axis into blocks of at most ``block_size`` values
  (a last axis of ``n`` values into ``ceil(n / block_size)`` equal blocks, each a multiple of
  8, so a short row is not padded to ``block_size``), each stored as one float32 scale (its
  absmax) and ``bits``-bit codes: with 8 bits, bitsandbytes' dynamic maps (signed for first
  moments, unsigned for second moments); with 4 bits, torchao's 4-bit AdamW maps (signed
  dynamic for first moments, linear without zero for second moments).
  ``update`` dequantizes the slots, runs ``inner.update`` and quantizes its new slots. The step
  count, non-float leaves and slots of fewer than 4096 elements stay as ``inner`` keeps them.

  Args:
    inner: an optax transformation whose update is elementwise: each float slot shaped like its
      param and updated from that param's own elements (Adam, AdamW, Lion, SGD with momentum,
      RMSProp...).
    bits: 8 or 4.
    block_size: the most values a block, a positive multiple of 8; ``None`` takes the
      anchors' default, 256 for 8 bits and 128 for 4 bits.
    min_size: float slots of fewer elements stay as ``inner`` keeps them (bitsandbytes'
      ``min_8bit_size``): their codes and scales would save little, and their blocks would be
      mostly padding.
    slot_map: ``slot_map(path, slot) -> "signed" | "unsigned" | None``, the map for the float
      slot of at least ``min_size`` elements at ``path`` (a ``jax.tree_util.keystr``) with
      shape and dtype ``slot``, or ``None`` to keep it; the default (``default_slot_map``)
      quantizes those named ``nu``, ``nu_max`` or ``sum_of_squares`` unsigned, others signed.

  Returns:
    An ``optax.GradientTransformation``, usable as any other and in every mode of
    ``optfuse.fuse``.

  Raises:
    LowBitError: ``bits``, ``block_size`` or ``min_size`` is invalid, or a slot to quantize is
      shaped like no parameter.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optfuse
    >>> tx = optfuse.low_bit(optax.adamw(1e-3), bits=8)
    >>> params = {"w": jnp.ones((8, 1024))}
    >>> state = tx.init(params)
    >>> state[0].mu["w"].codes.shape, state[0].mu["w"].scales.shape
    ((8, 256), (8, 4))
    >>> updates, state = tx.update(params, state, params)

  References:
    Dettmers et al., `8-bit Optimizers via Block-wise Quantization
    <https://arxiv.org/abs/2110.02861>`_, 2021.
    Li et al., `Memory Efficient Optimizers with 4-bit States
    <https://arxiv.org/abs/2309.01507>`_, 2023.
  """
  _check_args(bits, _maps.DEFAULT_BLOCK_SIZE.get(bits, 8) if block_size is None else block_size,
              min_size)
  block_size = _maps.DEFAULT_BLOCK_SIZE[bits] if block_size is None else block_size

  def plan(params):
    template = jax.eval_shape(inner.init, params)
    return template, _slot_schemes(template, params, bits, min_size, slot_map)

  def traced_init(params):
    template, schemes = plan(params)
    state = _at_run_time(inner.init(params), template, schemes, params)
    return _compress(state, template, schemes, block_size)

  def traced_update(updates, state, params=None, **extra_args: Any):
    template, schemes = plan(updates if params is None else params)
    inner_state = _expand(state, template, schemes, block_size)
    updates, new_state = inner.update(updates, inner_state, params, **extra_args)
    return updates, _compress(new_state, template, schemes, block_size)

  # Called outside a trace, init and update run compiled: op by op, quantizing a slot makes
  # a dozen arrays of its size one after the other (measured, a 100M-element leaf: 8-bit
  # init 8.5 s eager, 0.25 s compiled).
  compiled_init, compiled_update = jax.jit(traced_init), jax.jit(traced_update)

  def init_fn(params):
    return (compiled_init if _eager(params) else traced_init)(params)

  def update_fn(updates, state, params=None, **extra_args: Any):
    if not extra_args and _eager((updates, state, params)):
      return compiled_update(updates, state, params)
    return traced_update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _eager(tree) -> bool:
  """Whether ``tree`` holds arrays only, none of them traced: a call outside ``jax.jit``."""
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray))
                              and not isinstance(x, jax.core.Tracer)
                              for x in leaves)
