"""optfuse.linen.TrainState and optfuse.train_step train a Linen model exactly like Flax.

The reference is the canonical Flax step on ``flax.training.train_state.TrainState``:
``jax.value_and_grad`` then ``state.apply_gradients``, with the updated ``batch_stats`` returned
as aux and a dropout key folded from the step. The fused steps are
``optfuse.linen.TrainState.value_and_update`` and ``optfuse.train_step`` on a plain Flax
``TrainState``; after N jitted steps the params, batch statistics, optimizer state and step must
agree.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

import optfuse
import optfuse._train_step
import optfuse.linen
from tests import criteria

STEPS = 50
DROPOUT_KEY = jax.random.key(42)


class FlaxState(train_state.TrainState):
  batch_stats: Any


class FusedState(optfuse.linen.TrainState):
  batch_stats: Any


class ConvNet(nn.Module):
  """Conv (no bias: BatchNorm follows), BatchNorm, Dropout, Dense."""

  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.Conv(4, (3, 3), use_bias=False)(x)
    h = nn.relu(nn.BatchNorm(use_running_average=not train)(h))
    h = nn.Dropout(0.3, deterministic=not train)(h)
    return nn.Dense(3)(h.reshape(h.shape[0], -1))


class TiedLm(nn.Module):
  """Embedding used for the lookup and (tied) the output projection, with dropout."""

  @nn.compact
  def __call__(self, tokens, train: bool):
    embed = nn.Embed(11, 8)
    h = embed(tokens)
    h = h + nn.Dropout(0.2, deterministic=not train)(nn.gelu(nn.Dense(8)(h)))
    return embed.attend(nn.LayerNorm()(h))


class Block(nn.Module):
  train: bool

  @nn.compact
  def __call__(self, h, _):
    z = nn.Dropout(0.1, deterministic=not self.train)(nn.gelu(nn.Dense(8)(nn.LayerNorm()(h))))
    return h + z, None


class ScannedBlocks(nn.Module):
  """Three blocks stacked with ``nn.scan`` (params stacked on axis 0, dropout in the loop)."""

  @nn.compact
  def __call__(self, x, train: bool):
    blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True,
                                                                     "dropout": True},
                     length=3)(train)
    h, _ = blocks(nn.Dense(8)(x), None)
    return nn.Dense(2)(h)


def _classify(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _cnn_case():
  x = jax.random.normal(jax.random.key(1), (5, 6, 6, 1))
  return ConvNet(), (x, jnp.arange(5) % 3), _classify


def _tied_lm_case():
  tokens = jax.random.randint(jax.random.key(2), (4, 7), 0, 11)
  return TiedLm(), (tokens[:, :-1], tokens[:, 1:]), _classify


def _scanned_case():
  x = jax.random.normal(jax.random.key(3), (6, 4))
  return ScannedBlocks(), (x, jnp.sin(x[:, :2])), lambda out, y: jnp.mean((out - y) ** 2)


CASES = {"conv_batchnorm_dropout": _cnn_case, "tied_embed_lm": _tied_lm_case,
         "scanned_blocks": _scanned_case}


def _setup(case: str):
  """The model's variables and ``loss_fn(params, batch_stats, batch, key) -> (loss, stats)``."""
  model, batch, criterion = CASES[case]()
  variables = model.init(jax.random.key(0), batch[0], train=False)

  def loss_fn(params, batch_stats, batch, key):
    x, y = batch
    out, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                               rngs={"dropout": key}, mutable=["batch_stats"])
    return criterion(out, y), updates.get("batch_stats", {})

  return model, variables["params"], variables.get("batch_stats", {}), batch, loss_fn


def _train(case: str, variant: str, mode: str = "backward", steps: int = STEPS,
           guard: bool = False, offload: str | None = None, jit: bool = True):
  model, params, batch_stats, batch, loss_fn = _setup(case)
  tx = optax.adamw(1e-2, weight_decay=1e-2)
  if variant == "flax":
    state = FlaxState.create(apply_fn=model.apply, params=params, tx=tx, batch_stats=batch_stats)

    def train_step(state, batch):
      key = jax.random.fold_in(DROPOUT_KEY, state.step)
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      (loss, stats), grads = grad_fn(state.params, state.batch_stats, batch, key)
      state = state.apply_gradients(grads=grads)
      return state.replace(batch_stats=stats), loss
  elif variant == "train_state":
    state = FusedState.create(apply_fn=model.apply, params=params, tx=tx, mode=mode,
                              guard=guard, offload=offload, batch_stats=batch_stats)
    train_step = _fused_train_step(loss_fn)
  else:
    state = FlaxState.create(apply_fn=model.apply, params=params, tx=tx, batch_stats=batch_stats)
    if offload is not None:  # a Flax state's opt_state moves to the host once, before training
      state = state.replace(opt_state=optfuse.from_optax_state(
          optfuse.fuse(tx, mode, offload=offload), state.params, state.opt_state))
    fused_step = optfuse._train_step.train_step(loss_fn, has_aux=True, mode=mode, guard=guard,
                                                offload=offload)

    def train_step(state, batch):
      key = jax.random.fold_in(DROPOUT_KEY, state.step)
      (loss, stats), state = fused_step(state, state.batch_stats, batch, key)
      return state.replace(batch_stats=stats), loss

  if jit:
    # With offloaded state, donated as a training loop donates it: the new host slots may reuse
    # the old ones' buffers.
    train_step = jax.jit(train_step, donate_argnums=0 if offload else ())
  losses = []
  for _ in range(steps):
    state, loss = train_step(state, batch)
    losses.append(loss)
  if mode == "forward":
    state = state.flush()
    state = state.replace(opt_state=state.opt_state.opt_state)
  return np.asarray(losses), state


def _fused_train_step(loss_fn):
  """The step of an ``optfuse.linen.TrainState`` (``FusedState``): loss, new batch stats."""

  def train_step(state, batch):
    key = jax.random.fold_in(DROPOUT_KEY, state.step)
    (loss, stats), state = state.value_and_update(loss_fn, state.batch_stats, batch, key,
                                                  has_aux=True)
    return state.replace(batch_stats=stats), loss

  return train_step


@functools.cache
def _reference(case: str, steps: int = STEPS):
  return _train(case, "flax", steps=steps)


def _trained(state) -> dict:
  """What training changes, as NumPy arrays (host-resident slots included)."""
  return jax.tree.map(np.asarray, {"params": state.params, "batch_stats": state.batch_stats,
                                   "opt_state": state.opt_state, "step": state.step})




# Every model in backward mode through both entry points, and in forward mode (compared after
# ``flush``, in optax's layout); mode="off" is optax itself, so one model checks that the adapters
# pass it through.
RUNS = [(case, variant, "backward") for case in CASES for variant in ("train_state", "decorator")]
RUNS += [(case, "train_state", "forward") for case in CASES]
RUNS += [("conv_batchnorm_dropout", variant, "off") for variant in ("train_state", "decorator")]


@pytest.mark.parametrize(("case", "variant", "mode"), RUNS)
def test_fused_step_matches_flax_apply_gradients_over_50_steps(case, variant, mode):
  ref_losses, ref_state = _reference(case)
  losses, state = _train(case, variant, mode)
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(_trained(state), _trained(ref_state), **criteria.F32)


@pytest.mark.jax_upgrades
@pytest.mark.parametrize("variant", ["train_state", "decorator"])
def test_guarded_scanned_blocks_match_flax_apply_gradients(variant):
  ref_losses, ref_state = _reference("scanned_blocks")
  losses, state = _train("scanned_blocks", variant, guard=True)
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(_trained(state), _trained(ref_state), **criteria.F32)


def test_create_builds_the_optax_opt_state_and_a_static_mode():
  _, params, _, _, _ = _setup("tied_embed_lm")
  tx = optax.adam(1e-3)
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=tx)
  chex.assert_trees_all_equal(state.opt_state, tx.init(params))
  assert state.step == 0 and state.mode == "backward"
  assert len(jax.tree.leaves(state)) == 1 + 3 * len(jax.tree.leaves(params)) + 1


def test_jitted_step_is_traced_once():
  _, params, _, batch, loss_fn = _setup("tied_embed_lm")
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  traces = []

  @jax.jit
  def train_step(state, batch):
    traces.append(None)
    (loss, _), state = state.value_and_update(loss_fn, {}, batch, DROPOUT_KEY, has_aux=True)
    return state, loss

  for _ in range(3):
    state, _ = train_step(state, batch)
  assert len(traces) == 1
  assert int(state.step) == 3


def _fused_then_plain_and_plain_twice(loss_fn, batch, donate: bool = False):
  """Two jitted steps of a Linen train state: a fused step then Flax's ``apply_gradients``
  (donating the state with ``donate``), and ``apply_gradients`` twice, the reference."""
  grad_fn = jax.grad(lambda p: loss_fn(p, {}, batch, DROPOUT_KEY)[0])

  @functools.partial(jax.jit, donate_argnums=0 if donate else ())
  def fused_then_plain(state):
    _, state = state.value_and_update(loss_fn, {}, batch, DROPOUT_KEY, has_aux=True)
    return state.apply_gradients(grads=grad_fn(state.params))

  @jax.jit
  def plain_twice(state):
    state = state.apply_gradients(grads=grad_fn(state.params))
    return state.apply_gradients(grads=grad_fn(state.params))

  return fused_then_plain, plain_twice


def test_apply_gradients_and_replace_still_work_after_a_fused_step():
  _, params, _, batch, loss_fn = _setup("tied_embed_lm")
  tx = optax.adam(1e-2)
  fused_then_plain, plain_twice = _fused_then_plain_and_plain_twice(loss_fn, batch)
  fused = fused_then_plain(optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=tx))
  plain = plain_twice(train_state.TrainState.create(apply_fn=None, params=params, tx=tx))
  # float32, same operations, different XLA fusions: a few ulps.
  chex.assert_trees_all_close((fused.params, fused.opt_state, fused.step),
                              (plain.params, plain.opt_state, plain.step), rtol=1e-6, atol=1e-7)
  assert fused.replace(step=7).step == 7 and fused.replace(step=7).mode == "backward"


def test_train_step_defers_to_the_mode_of_an_optfuse_train_state():
  _, params, _, batch, loss_fn = _setup("tied_embed_lm")
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                                          mode="off")
  step = optfuse._train_step.train_step(loss_fn, has_aux=True)
  (loss, _), new_state = step(state, {}, batch, DROPOUT_KEY)
  assert new_state.mode == "off" and int(new_state.step) == 1
  with pytest.raises(ValueError, match="mode='off'"):
    optfuse._train_step.train_step(loss_fn, has_aux=True, mode="backward")(
        state, {}, batch, DROPOUT_KEY)


def test_create_refuses_fp8_overwrite_with_gradient_params():
  params = {"params": {"w": jnp.ones(2)}, OVERWRITE_WITH_GRADIENT: {"scale": jnp.ones(())}}
  with pytest.raises(optfuse.ParamsStructureError, match=OVERWRITE_WITH_GRADIENT):
    optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))


CLIP = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))


def _dense_params_and_batches():
  model = nn.Sequential([nn.Dense(16), nn.tanh, nn.Dense(2)])
  x = jax.random.normal(jax.random.key(1), (8, 4))
  y = jax.random.normal(jax.random.key(2), (8, 2))
  params = model.init(jax.random.key(0), x)["params"]
  # A root mean square: the mean of its microbatch gradients is not its full-batch gradient,
  # so a step that ignored ``microbatches`` would not match the reference.
  loss = lambda params, x, y: jnp.sqrt(jnp.mean((model.apply({"params": params}, x) - y) ** 2))
  return params, [(x, y), (-x, y)], loss


def _train_reference(params, batches, loss, microbatches, steps=20):
  """Mode "off" (optax's update, and optax's accumulation loop with microbatches)."""
  fx = optfuse.fuse(CLIP, mode="off")
  step = jax.jit(fx.value_and_update(loss, microbatches=microbatches))
  state = fx.init(params)
  for t in range(steps):
    _, params, state = step(params, state, *batches[t % 2])
  return params, state


@pytest.mark.parametrize("microbatches", [None, 2])
def test_train_state_with_two_pass_clipping_matches_optax(microbatches):
  params, batches, loss = _dense_params_and_batches()
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=CLIP,
                                          global_ops="two_pass")
  step = jax.jit(lambda s, x, y: s.value_and_update(loss, x, y, microbatches=microbatches))
  for t in range(20):
    _, state = step(state, *batches[t % 2])
  # float32, the same update in another XLA program (and the accumulated sum in another
  # order): a few ulps per step.
  chex.assert_trees_all_close((state.params, state.opt_state),
                              _train_reference(params, batches, loss, microbatches),
                              rtol=1e-5, atol=1e-6)


def test_train_step_passes_global_ops_and_microbatches_to_a_flax_train_state():
  params, batches, loss = _dense_params_and_batches()
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=CLIP)
  step = jax.jit(optfuse.train_step(loss, global_ops="two_pass", microbatches=2))
  for t in range(20):
    _, state = step(state, *batches[t % 2])
  chex.assert_trees_all_close((state.params, state.opt_state),
                              _train_reference(params, batches, loss, 2), rtol=1e-5, atol=1e-6)


def test_train_step_refuses_global_ops_that_contradict_the_state():
  params, batches, loss = _dense_params_and_batches()
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  with pytest.raises(ValueError, match="global_ops"):
    optfuse.train_step(loss, global_ops="two_pass")(state, *batches[0])


def _slot_memory_kinds(opt_state) -> set:
  """The memory kinds of the slots (float leaves with an axis) of an optax state."""
  return {x.sharding.memory_kind for x in jax.tree.leaves(opt_state) if x.ndim}


# Offloaded state: every model in backward and forward mode (forward compared after ``flush``,
# which leaves the slots in host memory too), ``optfuse.train_step`` on a Flax state whose
# opt_state was moved to the host, and mode="off" (optax's update on the state fetched whole).
OFFLOAD_STEPS = 30
OFFLOAD_RUNS = [(case, "train_state", mode) for case in CASES for mode in ("backward", "forward")]
OFFLOAD_RUNS += [(case, "decorator", "backward") for case in CASES]
OFFLOAD_RUNS += [("conv_batchnorm_dropout", "train_state", "off")]


@pytest.mark.parametrize(("case", "variant", "mode"), OFFLOAD_RUNS)
def test_offloaded_state_follows_flax_apply_gradients_over_30_jitted_donated_steps(
    case, variant, mode):
  ref_losses, ref_state = _reference(case, OFFLOAD_STEPS)
  losses, state = _train(case, variant, mode, steps=OFFLOAD_STEPS, offload="state")
  assert _slot_memory_kinds(state.opt_state) == {"pinned_host"}
  # Moving slots to the host and back is exact: the tolerance of the device-resident runs.
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(_trained(state), _trained(ref_state), **criteria.F32)


# Without jit each fused step is traced again (seconds a step), so a few steps: what they check
# is that eager steps read and write host-resident state, which needs no long run.
@pytest.mark.parametrize("case, mode", [
    ("scanned_blocks", "backward"),
    pytest.param("tied_embed_lm", "forward", marks=pytest.mark.slow)])
def test_offloaded_state_follows_flax_apply_gradients_without_jit(case, mode):
  ref_losses, ref_state = _reference(case, 3)
  losses, state = _train(case, "train_state", mode, steps=3, offload="state", jit=False)
  assert _slot_memory_kinds(state.opt_state) == {"pinned_host"}
  np.testing.assert_allclose(losses, ref_losses, **criteria.F32)
  chex.assert_trees_all_close(_trained(state), _trained(ref_state), **criteria.F32)


def test_create_with_offload_puts_the_slots_in_host_memory_and_the_count_on_the_device():
  _, params, _, _, _ = _setup("tied_embed_lm")
  tx = optax.adam(1e-3)
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=tx, offload="state")
  assert state.offload == "state" and state.fused.offload == "state"
  assert _slot_memory_kinds(state.opt_state) == {"pinned_host"}
  assert state.opt_state[0].count.sharding.memory_kind == "device"
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, state.opt_state), tx.init(params))


def test_forward_flush_mid_training_keeps_offloaded_state_on_the_host_and_follows_flax():
  model, params, batch_stats, batch, loss_fn = _setup("scanned_blocks")
  state = FusedState.create(apply_fn=model.apply, params=params,
                            tx=optax.adamw(1e-2, weight_decay=1e-2), mode="forward",
                            offload="state", batch_stats=batch_stats)
  step = jax.jit(_fused_train_step(loss_fn), donate_argnums=0)
  losses = []
  for t in range(6):
    if t == 3:  # an evaluation in the middle of training
      state = jax.jit(lambda s: s.flush(), donate_argnums=0)(state)
      assert _slot_memory_kinds(state.opt_state.pending_grads) == {"pinned_host"}
      assert _slot_memory_kinds(state.opt_state.opt_state) == {"pinned_host"}
    state, loss = step(state, batch)
    losses.append(loss)
  state = state.flush()
  ref_losses, ref_state = _reference("scanned_blocks", 6)
  np.testing.assert_allclose(np.asarray(losses), ref_losses, **criteria.F32)
  chex.assert_trees_all_close(_trained(state.replace(opt_state=state.opt_state.opt_state)),
                              _trained(ref_state), **criteria.F32)


def test_orbax_resume_of_a_train_state_with_offloaded_state_continues_the_same_trajectory(
    tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  model, params, batch_stats, batch, loss_fn = _setup("conv_batchnorm_dropout")

  def create():
    return FusedState.create(apply_fn=model.apply, params=jax.tree.map(jnp.copy, params),
                             tx=optax.adamw(1e-2, weight_decay=1e-2), offload="state",
                             batch_stats=batch_stats)

  state = create()
  step = jax.jit(_fused_train_step(loss_fn), donate_argnums=0)
  for _ in range(4):
    state, _ = step(state, batch)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "step_4", state)
    checkpointer.wait_until_finished()
    # A new state is the template: its shardings carry memory_kind="pinned_host" for the slots
    # (its step is the Python int 0, an int32 scalar once trained).
    template = create()
    template = template.replace(step=jnp.asarray(template.step))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            template)
    state = checkpointer.restore(tmp_path / "step_4", abstract)
  assert _slot_memory_kinds(state.opt_state) == {"pinned_host"} and int(state.step) == 4
  # JAX builds arrays on a single-device sharding with the device memory space in their type
  # whatever the sharding's memory kind (a NamedSharding keeps it), so a traced step would see
  # them in device memory; from_optax_state places them in host memory again.
  state = state.replace(opt_state=optfuse.from_optax_state(state.fused, state.params,
                                                           state.opt_state))
  step = jax.jit(_fused_train_step(loss_fn), donate_argnums=0)  # traced anew, as on a restart
  for _ in range(4):
    state, _ = step(state, batch)
  _, ref_state = _reference("conv_batchnorm_dropout", 8)
  chex.assert_trees_all_close(_trained(state), _trained(ref_state), **criteria.F32)


def test_apply_gradients_on_offloaded_state_matches_flax_and_leaves_it_on_the_host():
  _, params, _, batch, loss_fn = _setup("tied_embed_lm")
  tx = optax.adam(1e-2)
  fused_then_plain, plain_twice = _fused_then_plain_and_plain_twice(loss_fn, batch,
                                                                    donate=True)
  fused = fused_then_plain(optfuse.linen.TrainState.create(
      apply_fn=None, params=jax.tree.map(jnp.copy, params), tx=tx, offload="state"))
  plain = plain_twice(train_state.TrainState.create(apply_fn=None, params=params, tx=tx))
  assert _slot_memory_kinds(fused.opt_state) == {"pinned_host"}
  # float32, same operations, different XLA fusions: a few ulps.
  chex.assert_trees_all_close(jax.tree.map(np.asarray, (fused.params, fused.opt_state)),
                              (plain.params, plain.opt_state), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("offload", ["grads", "optimizer", True])
def test_an_unknown_offload_is_refused_by_create_and_train_step_like_fuse(offload):
  _, params, _, _, loss_fn = _setup("tied_embed_lm")
  match = f"unknown offload {offload!r}; use None, \"state\", \"params\" or \"auto\""
  with pytest.raises(optfuse.OffloadError, match=match):
    optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3),
                                    offload=offload)
  with pytest.raises(optfuse.OffloadError, match=match):
    optfuse.train_step(loss_fn, offload=offload)


def test_offload_with_two_pass_is_refused_and_the_error_says_to_use_forward_mode():
  _, params, _, _, loss_fn = _setup("tied_embed_lm")
  with pytest.raises(optfuse.OffloadError, match='use mode="forward"'):
    optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=CLIP,
                                    global_ops="two_pass", offload="state")
  with pytest.raises(optfuse.OffloadError, match='use mode="forward"'):
    optfuse.train_step(loss_fn, global_ops="two_pass", offload="state")


def test_train_step_refuses_an_offload_that_contradicts_the_state():
  params, batches, loss = _dense_params_and_batches()
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  with pytest.raises(optfuse.OptionsError, match="offload='state'.*offload=None"):
    optfuse.train_step(loss, offload="state")(state, *batches[0])


def test_train_step_with_offload_on_a_device_resident_flax_state_says_how_to_move_it():
  params, batches, loss = _dense_params_and_batches()
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  with pytest.raises(optfuse.OffloadError, match=r"is in device memory.*from_optax_state"):
    jax.jit(optfuse.train_step(loss, offload="state"))(state, *batches[0])
