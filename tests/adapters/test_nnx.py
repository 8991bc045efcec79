"""optfuse.nnx.Optimizer: the fused step trains an NNX model exactly like nnx.Optimizer.update.

The reference is the canonical NNX step, ``nnx.value_and_grad`` then ``optimizer.update``; the
fused step is ``optimizer.value_and_update``. Both run under ``nnx.jit`` from the same seed, and
after N steps the whole model state (params, batch statistics, RNG counters), the optimizer state
and its step count must agree.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optfuse
import optfuse.nnx
from tests import criteria
from tests._subprocess import checkout_env

STEPS = 50


class ConvNet(nnx.Module):
  """Conv (no bias: BatchNorm follows), BatchNorm, Dropout with RNGs stored in the model, Linear."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.head = nnx.Linear(4 * 6 * 6, 3, rngs=rngs)

  def __call__(self, x):
    h = self.dropout(nnx.relu(self.norm(self.conv(x))))
    return self.head(h.reshape(h.shape[0], -1))


class TiedLm(nnx.Module):
  """Embedding used for the lookup and (tied) the output projection; dropout RNGs come as an
  argument, so their counter lives outside the model."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(11, 8, rngs=rngs)
    self.hidden = nnx.Linear(8, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.2)

  def __call__(self, tokens, rngs: nnx.Rngs):
    h = self.embed(tokens)
    h = h + self.dropout(nnx.gelu(self.hidden(h)), rngs=rngs)
    return self.embed.attend(self.norm(h))


class Block(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.linear = nnx.Linear(8, 8, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return x + self.dropout(nnx.gelu(self.linear(self.norm(x))))


class ScannedBlocks(nnx.Module):
  """Three blocks stacked with ``nnx.vmap`` and applied with ``nnx.scan`` (dropout in the loop)."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(rngs)

    self.inp = nnx.Linear(4, 8, rngs=rngs)
    self.blocks = make_blocks(rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def apply_blocks(h, block):
      return block(h)

    return self.out(apply_blocks(self.inp(x), self.blocks))


def _cnn_case():
  x = jax.random.normal(jax.random.key(1), (5, 6, 6, 1))
  y = jnp.arange(5) % 3

  def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  return ConvNet(nnx.Rngs(0, dropout=1)), loss_fn, (x, y)


def _tied_lm_case():
  tokens = jax.random.randint(jax.random.key(2), (4, 7), 0, 11)

  def loss_fn(model, tokens, rngs):
    logits = model(tokens[:, :-1], rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return TiedLm(nnx.Rngs(0)), loss_fn, (tokens, nnx.Rngs(dropout=3))


def _scanned_case():
  x = jax.random.normal(jax.random.key(3), (6, 4))
  y = jnp.sin(x[:, :2])

  def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  return ScannedBlocks(nnx.Rngs(0, dropout=1)), loss_fn, (x, y)


CASES = {"conv_batchnorm_dropout": _cnn_case, "tied_embed_lm": _tied_lm_case,
         "scanned_blocks": _scanned_case}


def _pure(tree):
  """``tree`` as plain arrays (RNG keys as their key data)."""
  return jax.tree.map(
      lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
      nnx.as_pure(tree))


def _train(case: str, fused: bool, mode: str = "backward", steps: int = STEPS,
           guard: bool = False, offload: str | None = None, jit: bool = True):
  """Trains ``steps`` steps; returns the losses and the trained state in optax's layout."""
  model, loss_fn, args = CASES[case]()
  tx = optax.adamw(1e-2, weight_decay=1e-2)
  if fused:
    optimizer = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param, mode=mode, guard=guard,
                                      offload=offload)

    def train_step(model, optimizer, args):
      return optimizer.value_and_update(model, loss_fn, *args)
  else:
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def train_step(model, optimizer, args):
      loss, grads = nnx.value_and_grad(loss_fn)(model, *args)
      optimizer.update(model, grads)
      return loss

  if jit:
    # With offloaded state, the model and optimizer donated as a training loop donates them.
    train_step = nnx.jit(train_step, donate_argnums=(0, 1) if offload else None)
  losses = [train_step(model, optimizer, args) for _ in range(steps)]
  opt_state = nnx.as_pure(optimizer.opt_state)
  if mode == "forward":
    optimizer.flush(model)
    opt_state = nnx.as_pure(optimizer.opt_state).opt_state
  trained = {"model": nnx.state(model), "opt_state": opt_state, "step": optimizer.step,
             "args": nnx.state(args)}
  return np.asarray(losses), _pure(trained)


@functools.cache
def _reference(case: str, steps: int = STEPS):
  return _train(case, fused=False, steps=steps)




# Every model in backward and forward mode (forward: compared after ``flush``); mode="off" is
# optax itself, so one model checks that the adapter passes it through.
RUNS = [(case, mode) for case in CASES for mode in ("backward", "forward")]
RUNS += [("conv_batchnorm_dropout", "off")]


@pytest.mark.parametrize(("case", "mode"), RUNS)
def test_fused_step_matches_nnx_optimizer_update_over_50_steps(case, mode):
  ref_losses, ref_state = _reference(case)
  losses, state = _train(case, fused=True, mode=mode)
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(state, ref_state, **criteria.F32)


@pytest.mark.jax_upgrades
def test_guarded_scanned_blocks_match_nnx_optimizer_update():
  ref_losses, ref_state = _reference("scanned_blocks")
  losses, state = _train("scanned_blocks", fused=True, guard=True)
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(state, ref_state, **criteria.F32)


def test_opt_state_has_the_layout_of_nnx_optimizer():
  model, _, _ = _cnn_case()
  tx = optax.adam(1e-3)
  fused = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param)
  plain = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert jax.tree.structure(nnx.state(fused)) == jax.tree.structure(nnx.state(plain))
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state(fused)), nnx.as_pure(nnx.state(plain)))


def test_update_with_gradients_still_works_after_an_eager_fused_step():
  def run(fused_first: bool):
    model, loss_fn, args = _cnn_case()
    cls = optfuse.nnx.Optimizer if fused_first else nnx.Optimizer
    optimizer = cls(model, optax.adam(1e-2), wrt=nnx.Param)
    if fused_first:
      optimizer.value_and_update(model, loss_fn, *args)
    else:
      optimizer.update(model, nnx.grad(loss_fn)(model, *args))
    optimizer.update(model, nnx.grad(loss_fn)(model, *args))
    return _pure((nnx.state(model), nnx.state(optimizer)))

  # Eager float32 ops, same order: a few ulps.
  chex.assert_trees_all_close(run(True), run(False), rtol=1e-6, atol=1e-7)


def test_has_aux_returns_loss_and_aux_and_writes_back_batch_stats():
  model, loss_fn, (x, y) = _cnn_case()
  optimizer = optfuse.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  mean_before = model.norm.mean[...]

  def loss_and_logits(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

  loss, logits = optimizer.value_and_update(model, loss_and_logits, x, y, has_aux=True)
  assert loss.shape == () and logits.shape == (5, 3)
  assert not np.allclose(model.norm.mean[...], mean_before)
  assert int(optimizer.step[...]) == 1


def test_params_outside_wrt_are_neither_trained_nor_in_the_opt_state():
  model, loss_fn, args = _cnn_case()
  frozen_kernel = model.conv.kernel[...]
  optimizer = optfuse.nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.PathContains("head"))
  optimizer.value_and_update(model, loss_fn, *args)
  np.testing.assert_array_equal(model.conv.kernel[...], frozen_kernel)
  assert not np.allclose(model.head.kernel[...], _cnn_case()[0].head.kernel[...])
  assert set(optimizer.opt_state[0].mu) == {"head"}


_SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import optfuse.nnx

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("model",))
init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
loss_fn = lambda model, x: jnp.mean(jnp.tanh(model(x)) ** 2)
x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
results = []
for fused in (False, True):
  with jax.set_mesh(mesh):
    model = nnx.Linear(4, 2, kernel_init=init, rngs=nnx.Rngs(0))
    if fused:
      optimizer = optfuse.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
      step = nnx.jit(lambda m, o, x: o.value_and_update(m, loss_fn, x))
    else:
      optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
      def step(m, o, x):
        loss, grads = nnx.value_and_grad(loss_fn)(m, x)
        o.update(m, grads)
        return loss
      step = nnx.jit(step)
    for _ in range(5):
      step(model, optimizer, x)
  mu = optimizer.opt_state[0].mu["kernel"]
  assert mu.get_metadata()["out_sharding"] == (None, "model")
  results.append((model.kernel[...], mu[...]))
(ref, ref_mu), (got, got_mu) = results
assert got.sharding.spec == ref.sharding.spec == jax.sharding.PartitionSpec(None, "model")
assert got_mu.sharding.spec == ref_mu.sharding.spec == jax.sharding.PartitionSpec(None, "model")
np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
print("ok")
"""


def test_sharding_annotations_are_kept_on_a_two_device_mesh():
  # Two host devices need XLA_FLAGS before jax starts, hence a fresh interpreter.
  env = checkout_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("ok")


def test_unknown_mode_is_refused_at_construction():
  with pytest.raises(optfuse.UnknownModeError):
    optfuse.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), mode="sideways")


def test_two_pass_clipping_matches_nnx_optimizer_update():
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
  x = jax.random.normal(jax.random.key(1), (8, 4))
  y = jax.random.normal(jax.random.key(2), (8, 2))
  loss_fn = lambda model, x, y: jnp.mean((model(x) - y) ** 2)
  models = []
  for fused in (False, True):
    model = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)), nnx.tanh,
                           nnx.Linear(16, 2, rngs=nnx.Rngs(1)))
    if fused:
      optimizer = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param, global_ops="two_pass")
      step = nnx.jit(lambda m, o, x, y: o.value_and_update(m, loss_fn, x, y))
    else:
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

      def step(m, o, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(m, x, y)
        o.update(m, grads)
        return loss

      step = nnx.jit(step)
    for t in range(20):
      step(model, optimizer, x if t % 2 else -x, y)
    models.append(nnx.state(model, nnx.Param))
  # float32: the same update in another XLA program, a few ulps per step.
  chex.assert_trees_all_close(_pure(models[1]), _pure(models[0]), rtol=1e-5, atol=1e-6)


def _slot_memory_kinds(opt_state) -> set:
  """The memory kinds of the slots (float leaves with an axis) of an optax state."""
  return {x.sharding.memory_kind for x in jax.tree.leaves(opt_state)
          if x.ndim and jnp.issubdtype(x.dtype, jnp.floating)}


# Offloaded state: every model in backward and forward mode (forward compared after ``flush``,
# which leaves the slots in host memory too), and mode="off" (optax's update on the state
# fetched whole).
OFFLOAD_STEPS = 30
OFFLOAD_RUNS = [(case, mode) for case in CASES for mode in ("backward", "forward")]
OFFLOAD_RUNS += [("conv_batchnorm_dropout", "off")]


@pytest.mark.parametrize(("case", "mode"), OFFLOAD_RUNS)
def test_offloaded_state_follows_nnx_optimizer_update_over_30_jitted_donated_steps(case, mode):
  ref_losses, ref_state = _reference(case, OFFLOAD_STEPS)
  losses, state = _train(case, fused=True, mode=mode, steps=OFFLOAD_STEPS, offload="state")
  assert _slot_memory_kinds(state["opt_state"]) == {"pinned_host"}
  # Moving slots to the host and back is exact: the tolerance of the device-resident runs.
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(state, ref_state, **criteria.F32)


# Without jit each fused step is traced again (seconds a step), so a few steps: what they check
# is that eager steps read and write host-resident state, which needs no long run.
@pytest.mark.parametrize("case, mode", [
    ("scanned_blocks", "backward"),
    pytest.param("tied_embed_lm", "forward", marks=pytest.mark.slow)])
def test_offloaded_state_follows_nnx_optimizer_update_without_jit(case, mode):
  ref_losses, ref_state = _reference(case, 3)
  losses, state = _train(case, fused=True, mode=mode, steps=3, offload="state", jit=False)
  assert _slot_memory_kinds(state["opt_state"]) == {"pinned_host"}
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(state, ref_state, **criteria.F32)


def test_offload_builds_the_slots_in_host_memory_with_nnx_optimizers_values():
  model, _, _ = _cnn_case()
  tx = optax.adam(1e-3)
  fused = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param, offload="state")
  plain = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert fused.offload == "state" and fused.fused.offload == "state"
  assert _slot_memory_kinds(nnx.as_pure(fused.opt_state)) == {"pinned_host"}
  assert fused.opt_state[0].count[...].sharding.memory_kind == "device"
  assert jax.tree.structure(nnx.state(fused)) == jax.tree.structure(nnx.state(plain))
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state(fused)), nnx.as_pure(nnx.state(plain)))


def test_forward_flush_mid_training_keeps_offloaded_state_on_the_host_and_follows_nnx():
  model, loss_fn, args = _scanned_case()
  optimizer = optfuse.nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=1e-2), wrt=nnx.Param,
                                    mode="forward", offload="state")
  step = nnx.jit(lambda m, o, args: o.value_and_update(m, loss_fn, *args), donate_argnums=(0, 1))
  flush = nnx.jit(lambda m, o: o.flush(m), donate_argnums=(0, 1))
  losses = []
  for t in range(6):
    if t == 3:  # an evaluation in the middle of training
      flush(model, optimizer)
      assert _slot_memory_kinds(nnx.as_pure(optimizer.opt_state)) == {"pinned_host"}
    losses.append(step(model, optimizer, args))
  optimizer.flush(model)
  ref_losses, ref_state = _reference("scanned_blocks", 6)
  state = _pure({"model": nnx.state(model), "opt_state": nnx.as_pure(optimizer.opt_state).opt_state,
                 "step": optimizer.step, "args": nnx.state(args)})
  np.testing.assert_allclose(np.asarray(losses), ref_losses, **criteria.F32)
  chex.assert_trees_all_close(state, ref_state, **criteria.F32)


def test_update_with_gradients_on_offloaded_state_matches_nnx_and_leaves_it_on_the_host():
  def run(cls, **kwargs):
    model, loss_fn, args = _cnn_case()
    optimizer = cls(model, optax.adam(1e-2), wrt=nnx.Param, **kwargs)
    if kwargs:
      nnx.jit(lambda m, o: o.value_and_update(m, loss_fn, *args), donate_argnums=(0, 1))(
          model, optimizer)
    else:
      optimizer.update(model, nnx.grad(loss_fn)(model, *args))
    nnx.jit(lambda m, o: o.update(m, nnx.grad(loss_fn)(m, *args)), donate_argnums=(0, 1))(
        model, optimizer)
    return optimizer, _pure((nnx.state(model), nnx.state(optimizer)))

  optimizer, fused = run(optfuse.nnx.Optimizer, offload="state")
  assert _slot_memory_kinds(nnx.as_pure(optimizer.opt_state)) == {"pinned_host"}
  # float32, the same operations in other XLA programs: a few ulps.
  chex.assert_trees_all_close(fused, run(nnx.Optimizer)[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("offload", ["grads", "optimizer", True])
def test_an_unknown_offload_is_refused_at_construction_like_fuse(offload):
  with pytest.raises(optfuse.OffloadError, match=f"unknown offload {offload!r}; use None"):
    optfuse.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), offload=offload)


def test_offload_with_two_pass_is_refused_and_the_error_says_to_use_forward_mode():
  with pytest.raises(optfuse.OffloadError, match='use mode="forward"'):
    optfuse.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.adam(0.1),
                          global_ops="two_pass", offload="state")
