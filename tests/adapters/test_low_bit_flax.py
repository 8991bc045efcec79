"""The Flax adapters with low-bit state train like the same ``optfuse.low_bit`` transformation
through standard Flax.

The reference is the canonical step of each API with ``tx = optfuse.low_bit(optax.adamw(...))``:
``flax.training.train_state.TrainState.apply_gradients`` after ``jax.value_and_grad`` (Linen),
``nnx.Optimizer.update`` after ``nnx.value_and_grad`` (NNX). The fused steps are
``optfuse.linen.TrainState.value_and_update`` and ``optfuse.nnx.Optimizer.value_and_update`` in
backward mode, with the state on the device and offloaded. The stacked kernels are quantized
(``min_size=0``) and updated row by row inside the scan's backward loop.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import optfuse
import optfuse.linen
import optfuse.nnx
from tests import faults, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

STEPS = 20
DIM = 32


def _tx(bits: int, fault=lambda tx: tx) -> optax.GradientTransformation:
  """Low-bit AdamW, with ``fault`` (tests/faults.py) injected into the AdamW it wraps."""
  return optfuse.low_bit(fault(optax.adamw(1e-2, weight_decay=1e-2)), bits=bits, min_size=0)


def _batch():
  x = jax.random.normal(jax.random.key(3), (8, DIM))
  return x, jnp.sin(x[:, :4])


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return h + nn.gelu(nn.Dense(DIM)(nn.LayerNorm()(h))), None


class LinenScanned(nn.Module):
  """Three blocks stacked with ``nn.scan`` (params on axis 0) and a head."""

  @nn.compact
  def __call__(self, x):
    h, _ = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=3)()(x, None)
    return nn.Dense(4)(h)


def _linen_params():
  return LinenScanned().init(jax.random.key(0), _batch()[0])["params"]


def _train_linen(bits: int, fused: bool, offload: str | None = None, nudge: int = 0,
                 fault=lambda tx: tx):
  model, (x, y) = LinenScanned(), _batch()
  params = models.nudge(_linen_params(), nudge)
  loss_fn = lambda params: jnp.mean((model.apply({"params": params}, x) - y) ** 2)
  if fused:
    state = optfuse.linen.TrainState.create(apply_fn=model.apply, params=params,
                                            tx=_tx(bits, fault), mode="backward",
                                            offload=offload)
    step = lambda state: state.value_and_update(loss_fn)[::-1]
  else:
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_tx(bits))

    def step(state):
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

  step = jax.jit(step, donate_argnums=0 if offload else ())
  losses = []
  for _ in range(STEPS):
    state, loss = step(state)
    losses.append(loss)
  return np.asarray(losses), state


class NnxBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(DIM, rngs=rngs)
    self.linear = nnx.Linear(DIM, DIM, rngs=rngs)

  def __call__(self, h):
    return h + nnx.gelu(self.linear(self.norm(h)))


class NnxScanned(nnx.Module):
  """Three blocks stacked with ``nnx.vmap`` and applied with ``nnx.scan``, and a head."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return NnxBlock(rngs)

    self.blocks = make_blocks(rngs)
    self.head = nnx.Linear(DIM, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def apply_blocks(h, block):
      return block(h)

    return self.head(apply_blocks(x, self.blocks))


def _train_nnx(bits: int, fused: bool, offload: str | None = None, nudge: int = 0,
               fault=lambda tx: tx):
  model, (x, y) = NnxScanned(nnx.Rngs(0)), _batch()
  nnx.update(model, models.nudge(nnx.state(model, nnx.Param), nudge))
  loss_fn = lambda model: jnp.mean((model(x) - y) ** 2)
  if fused:
    optimizer = optfuse.nnx.Optimizer(model, _tx(bits, fault), wrt=nnx.Param, mode="backward",
                                      offload=offload)
    step = lambda model, optimizer: optimizer.value_and_update(model, loss_fn)
  else:
    optimizer = nnx.Optimizer(model, _tx(bits), wrt=nnx.Param)

    def step(model, optimizer):
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

  step = nnx.jit(step, donate_argnums=(0, 1) if offload else None)
  losses = np.asarray([step(model, optimizer) for _ in range(STEPS)])
  return losses, (nnx.state(model, nnx.Param), optimizer)


def _codes_and_scales(opt_state) -> list:
  """The leaves of the quantized slots: their fields ``codes`` and ``scales`` (NNX stores a
  ``QuantizedSlot`` as a State of them)."""
  def name(key):
    return str(getattr(key, "key", getattr(key, "name", key)))
  return [x for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]
          if name(path[-1]) in ("codes", "scales")]


# One representative run per adapter by default (8 bits, offloaded); the rest with ``-m slow``.
CASES = [pytest.param(8, "state"), pytest.param(8, None, marks=pytest.mark.slow),
         pytest.param(4, None, marks=pytest.mark.slow)]


@functools.cache
def _linen_spread(bits: int) -> models.Spread:
  """The spread of Flax's runs from the params moved by an ulp or two; measured once per
  process."""
  def reference(ulps):
    losses, state = _train_linen(bits, fused=False, nudge=ulps)
    return losses, state.params

  return models.reference_spread(reference, _linen_params())


@pytest.mark.parametrize("bits,offload", CASES)
def test_linen_train_state_with_low_bit_state_trains_like_flax_apply_gradients(bits, offload):
  got_losses, got = _train_linen(bits, fused=True, offload=offload)
  want = _train_linen(bits, fused=False)[1]
  quantized = _codes_and_scales(got.opt_state)
  assert quantized and len(quantized) == len(_codes_and_scales(want.opt_state))
  kinds = {x.sharding.memory_kind for x in quantized}
  assert kinds == {"pinned_host" if offload else "device"}
  models.assert_within_spread((got_losses, got.params), _linen_spread(bits))


@functools.cache
def _nnx_spread(bits: int) -> models.Spread:
  """The spread of ``nnx.Optimizer``'s runs from the params moved by an ulp or two; measured
  once per process."""
  def reference(ulps):
    losses, (params, _) = _train_nnx(bits, fused=False, nudge=ulps)
    return losses, nnx.as_pure(params)

  return models.reference_spread(reference,
                                 nnx.as_pure(nnx.state(NnxScanned(nnx.Rngs(0)), nnx.Param)))


@pytest.mark.parametrize("bits,offload", CASES)
def test_nnx_optimizer_with_low_bit_state_trains_like_nnx_optimizer_update(bits, offload):
  got_losses, (got_params, got_opt) = _train_nnx(bits, fused=True, offload=offload)
  want_opt = _train_nnx(bits, fused=False)[1][1]
  quantized = _codes_and_scales(nnx.as_pure(got_opt.opt_state))
  assert quantized and len(quantized) == len(_codes_and_scales(nnx.as_pure(want_opt.opt_state)))
  kinds = {x.sharding.memory_kind for x in quantized}
  assert kinds == {"pinned_host" if offload else "device"}
  models.assert_within_spread((got_losses, nnx.as_pure(got_params)), _nnx_spread(bits))


def _fused_linen(fault) -> tuple:
  losses, state = _train_linen(8, fused=True, offload="state", fault=fault)
  return losses, state.params


def _fused_nnx(fault) -> tuple:
  losses, (params, _) = _train_nnx(8, fused=True, offload="state", fault=fault)
  return losses, nnx.as_pure(params)


# adapter -> (its fused run of ``fault(adamw)`` in 8 bits with offloaded state, as ``(losses,
# params)``; the spread of its reference, by bits; the path of its stacked kernel, whose row 1
# the ``row_skipped`` fault leaves unchanged).
ADAPTERS = {
    "linen": (_fused_linen, _linen_spread, "['ScanLinenBlock_0']['Dense_0']['kernel']"),
    "nnx": (_fused_nnx, _nnx_spread, "['blocks']['linear']['kernel']"),
}


@pytest.mark.parametrize("adapter", ["linen", pytest.param("nnx", marks=pytest.mark.slow)])
def test_the_flax_low_bit_check_rejects_each_error_injected_into_the_fused_step(adapter):
  """Each error of tests/faults.py injected into the adapter's fused step only (its
  transformation wraps the faulty AdamW; the Flax reference runs the correct one), judged
  against the spread that passes the fused step (the 8-bit offloaded case above)."""
  fused, spread, kernel = ADAPTERS[adapter]
  for name, fault in faults.faults(lambda path: path == kernel).items():
    models.assert_rejected(fused(fault), spread(8), name)
