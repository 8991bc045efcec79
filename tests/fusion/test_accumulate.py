"""Gradient accumulation: one update from the mean gradient of k microbatches, like optax."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._fusion import _accumulate
from optfuse.bench import _models
from tests import criteria, models
from tests.fusion.test_loops import _init, scan_loss

K, B, D = 4, 8, 8


def _data():
  k1, k2 = jax.random.split(jax.random.PRNGKey(5))
  return jax.random.normal(k1, (K * B, D)), jax.random.normal(k2, (K * B, 2))


def _manual_optax(tx, loss, params, steps, x, y):
  """The reference written with optax alone: average k microbatch gradients, then update."""
  state = tx.init(params)
  value_and_grad = jax.jit(jax.value_and_grad(loss))
  losses = []
  for _ in range(steps):
    grads, values = [], []
    for i in range(K):
      value, g = value_and_grad(params, x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
      grads.append(g)
      values.append(value)
    mean = jax.tree.map(lambda *gs: sum(gs) / K, *grads)
    updates, state = tx.update(mean, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(jnp.mean(jnp.stack(values)))
  return jnp.stack(losses), params, state


def _fused(tx, loss, mode, params, steps, x, y):
  fx = optfuse.fuse(tx, mode=mode)
  p = jax.tree.map(jnp.copy, params)
  s = fx.init(p)
  step = jax.jit(fx.value_and_update(loss, microbatches=K), donate_argnums=(0, 1))
  losses = []
  for _ in range(steps):
    value, p, s = step(p, s, x, y)
    losses.append(value)
  return jnp.stack(losses), p, s


@pytest.mark.equivalence
@pytest.mark.parametrize("mode", ["off", "backward"])
@pytest.mark.parametrize("remat", [False, True])
def test_microbatched_step_matches_optax_manual_accumulation(mode, remat):
  loss = functools.partial(scan_loss, remat=remat)
  params = _init(jax.random.PRNGKey(0))
  tx = optax.adamw(1e-2, weight_decay=0.1)
  ref = _manual_optax(tx, loss, params, 20, *_data())
  criteria.assert_matches_optax(_fused(tx, loss, mode, params, 20, *_data()), ref,
                                **criteria.MICROBATCH)


@pytest.mark.equivalence
def test_microbatched_step_matches_optax_multisteps():
  loss = functools.partial(scan_loss, remat=True)
  params = _init(jax.random.PRNGKey(0))
  x, y = _data()
  multi = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K)
  p, s = params, multi.init(params)

  @jax.jit
  def mini_step(p, s, x, y):
    updates, s = multi.update(jax.grad(loss)(p, x, y), s, p)
    return optax.apply_updates(p, updates), s

  for _ in range(10):
    for i in range(K):
      p, s = mini_step(p, s, x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
  _, fused_params, fused_state = _fused(optax.adam(1e-2), loss, "backward", params, 10, x, y)
  criteria.assert_matches_optax(fused_params, p, **criteria.MICROBATCH)
  criteria.assert_matches_optax(fused_state, s.inner_opt_state, **criteria.MICROBATCH)


def test_accumulation_fused_inside_the_layer_loop_saves_a_gradient_buffer():
  layers, width = 32, 128
  params = {"layers": jax.ShapeDtypeStruct((layers, width, width), jnp.float32)}

  def loss(p, x):
    h, _ = jax.lax.scan(jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None)), x, p["layers"])
    return jnp.mean(h ** 2)

  temps = {}
  for mode, k in (("off", K), ("backward", K), ("single", 1)):
    fx = optfuse.fuse(optax.adam(1e-3), mode="off" if mode == "off" else "backward")
    batch = jax.ShapeDtypeStruct((k * 8, width), jnp.float32)
    temps[mode] = models.compiled_memory(fx, loss, params, batch,
                                         microbatches=k).temp_size_in_bytes
  grad_bytes, row_bytes = layers * width * width * 4, width * width * 4
  # optax holds the running sum and each microbatch's gradient: two gradient buffers.
  assert temps["off"] >= 2 * grad_bytes, temps
  # Fused accumulation costs the running sum over a single fused step, plus O(one layer).
  assert temps["backward"] <= grad_bytes + temps["single"] + 8 * row_bytes, temps


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_accumulating_an_unrolled_mlp_never_peaks_above_optax(k):
  # The bench's grad_accum model, small: one loop over every microbatch, then the update, as
  # optax's loop does. (Fusing the update into the last microbatch's backward pass peaked above
  # optax from k=3 until XLA was kept from starting that microbatch before the loop.)
  model = _models.grad_accum(micro=k, depth=4, width=64, inputs=32, batch=8)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  peaks = {mode: models.compiled_peak(optfuse.fuse(optax.adamw(1e-3, weight_decay=0.1), mode),
                                      model.loss, params, *batch, microbatches=k)
           for mode in ("off", "backward")}
  assert peaks["backward"] <= peaks["off"], peaks


def test_a_written_sum_starts_in_any_buffer_and_sums_bit_for_bit_as_from_zeros():
  # A streamed leaf's sum starts in a copy of its host param stack (``accumulator(written)``):
  # whatever that buffer holds, NaN and infinities included, the first gradient replaces it, and
  # the sums are those of zeros plus each gradient, bit for bit.
  grads = [{"a": jax.random.normal(jax.random.PRNGKey(i), (3, 4)),
            "b": jnp.array([-0.0, 1e-30, 3.0])} for i in range(3)]
  params = grads[0]
  garbage = {"a": jnp.full((3, 4), jnp.nan), "b": jnp.array([jnp.inf, -jnp.inf, 7.0])}

  def run(tx, state):
    for g in grads:
      _, state = tx.update(g, state, params)
    return state.sum

  from_zeros = run(_accumulate.accumulator(), _accumulate.accumulator().init(params))
  written = _accumulate.accumulator(frozenset({0, 1}))
  from_garbage = run(written, _accumulate.sum_state(garbage, frozenset({0, 1})))
  expected = jax.tree.map(lambda *gs: functools.reduce(jnp.add, gs, jnp.zeros_like(gs[0])),
                          *grads)
  for got in (from_zeros, from_garbage):
    for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      assert leaf.tobytes() == want.tobytes()


def test_microbatches_must_divide_the_batch():
  fx = optfuse.fuse(optax.sgd(0.1))
  params = _init(jax.random.PRNGKey(0))
  step = fx.value_and_update(scan_loss, microbatches=3)
  with pytest.raises(optfuse.MicrobatchError, match="divisible by microbatches=3"):
    step(params, fx.init(params), *_data())


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_microbatches_must_be_a_positive_int(bad):
  with pytest.raises(optfuse.MicrobatchError):
    optfuse.fuse(optax.sgd(0.1)).value_and_update(scan_loss, microbatches=bad)
