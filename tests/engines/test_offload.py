"""``offload="state"``: the optimizer state's slots in host memory, streamed through the step.

JAX 0.10 runs ``pinned_host`` memory on the CPU backend, so these tests run the same programs
as an accelerator would (host rows moved to the device and back inside the fused loops), and
compare them with plain optax on device-resident state. The compile-only checks on the TPU
compiler, which counts host memory apart from device memory, are marked ``targets``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from optfuse._base import _memory_spaces
from optfuse._targets import _registry
from optfuse.bench import _forms, _models
from tests import criteria, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.05),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
    # Factored moments of another shape than their param's, and the (1,) placeholders of the
    # leaves it does not factor, which the update makes anew on the device.
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}

def _matrix(names: list[tuple], default: set[tuple]) -> list:
  """The cases of a parametrized test; those outside ``default`` run with ``-m slow`` (the
  default suite keeps one case of each code path: taps, loops, clipping, Lion's row loop)."""
  return [pytest.param(*n, marks=() if n in default else pytest.mark.slow) for n in names]


needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')


def _memory_kinds(tree):
  return jax.tree.map(lambda x: x.sharding.memory_kind, tree)


def _tied_lm():
  return models.tied_lm_params(), models.tied_lm_batches(), models.tied_lm_loss


def _scanned():
  return models.stacked_params(layers=6), models.tied_lm_batches(), models.scanned_loss


MODELS = {"tied_lm": _tied_lm, "scanned": _scanned}


def test_init_puts_every_float_slot_in_host_memory_and_the_count_on_the_device():
  params = models.stacked_params()
  state = optfuse.fuse(optax.adamw(1e-2), offload="state").init(params)
  kinds = _memory_kinds(state)
  assert kinds[0].count == "device"
  assert set(jax.tree.leaves((kinds[0].mu, kinds[0].nu))) == {"pinned_host"}
  # The values are optax's own.
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, state),
                              jax.tree.map(np.asarray, optax.adamw(1e-2).init(params)))


@pytest.mark.parametrize("model, optimizer", _matrix(
    [(m, o) for m in sorted(MODELS) for o in sorted(OPTIMIZERS)],
    {("tied_lm", "adamw"), ("scanned", "adamw"), ("scanned", "lion"), ("scanned", "adafactor")}))
def test_backward_fusion_with_offloaded_state_trains_like_optax_over_30_steps(model, optimizer):
  params, batches, loss = MODELS[model]()
  tx = OPTIMIZERS[optimizer]()
  fx = optfuse.fuse(tx, offload="state")
  got = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                         batches, 30)
  want = models.run_optax(tx, params, batches, 30, loss_fn=loss)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                                **criteria.F32)
  slots = [x for x in jax.tree.leaves(got[2]) if x.ndim]
  assert slots and {x.sharding.memory_kind for x in slots} == {"pinned_host"}


def _clipped(make):
  return lambda: optax.chain(optax.clip_by_global_norm(0.5), make())


# Forward fusion runs global clipping: its clipping factor comes from the rows of the pending
# gradient in host memory, reduced one row at a time (``_apply.global_stage``).
FORWARD_OPTIMIZERS = {**OPTIMIZERS, "clip+adamw": _clipped(OPTIMIZERS["adamw"]),
                      "clip+lion": _clipped(OPTIMIZERS["lion"])}


@pytest.mark.parametrize("model, optimizer", _matrix(
    [(m, o) for m in sorted(MODELS) for o in sorted(FORWARD_OPTIMIZERS)],
    {("tied_lm", "adamw"), ("scanned", "clip+adamw"), ("scanned", "clip+lion")}))
def test_forward_fusion_with_offloaded_state_and_gradient_trains_like_optax_over_30_steps(
    model, optimizer):
  params, batches, loss = MODELS[model]()
  tx = FORWARD_OPTIMIZERS[optimizer]()
  fx = optfuse.fuse(tx, mode="forward", offload="state")
  losses, p, state = models.run_steps(fx.value_and_update(loss), params,
                                      fx.init(models.copy(params)), batches, 30)
  pending = [x for x in jax.tree.leaves(state.pending_grads)]
  assert {x.sharding.memory_kind for x in pending} == {"pinned_host"}
  p, opt_state = optfuse.to_optax_state(fx, p, state)
  want = models.run_optax(tx, params, batches, 30, loss_fn=loss)
  # With clipping the global norm sums the rows' squares in another order: a float32 ulp.
  criteria.assert_matches_optax(jax.tree.map(np.asarray, (losses, p, opt_state)),
                                jax.tree.map(np.asarray, want), **criteria.F32)


@pytest.mark.parametrize("mode", _matrix([("backward",), ("forward",), ("off",)],
                                          {("backward",), ("forward",)}))
def test_offloaded_state_without_jit_trains_like_optax(mode):
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx = optfuse.fuse(tx, mode=mode, offload="state")
  got = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                         batches, 3, jit=False)
  got = (got[0], *optfuse.to_optax_state(fx, got[1], got[2]))
  want = models.run_optax(tx, params, batches, 3, loss_fn=loss)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                                **criteria.F32)


def test_optax_step_with_offloaded_state_fetches_it_whole_and_matches_optax():
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx = optfuse.fuse(tx, mode="off", offload="state")
  got = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                         batches, 20)
  want = models.run_optax(tx, params, batches, 20, loss_fn=loss)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                                **criteria.F32)
  assert _memory_kinds(got[2])[0].mu["layers"]["w"] == "pinned_host"


@pytest.mark.parametrize("mode", _matrix([("backward",), ("forward",), ("off",)],
                                          {("backward",), ("forward",)}))
def test_microbatches_with_offloaded_state_match_the_device_resident_step(mode):
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2, weight_decay=0.05)
  if mode != "backward":  # the global transform these modes run
    tx = optax.chain(optax.clip_by_global_norm(0.5), tx)

  def run(fx):
    got = models.run_steps(fx.value_and_update(loss, microbatches=2), params,
                           fx.init(models.copy(params)), batches, 10)
    return (got[0], *optfuse.to_optax_state(fx, got[1], got[2]))

  got = run(optfuse.fuse(tx, mode=mode, offload="state"))
  want = run(optfuse.fuse(tx, mode=mode))
  criteria.assert_matches_optax(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                                **criteria.F32)


@pytest.mark.parametrize("form", _matrix([("linen_axis1",), ("moveaxis",), ("outer_remat",)],
                                          {("linen_axis1",)}))
def test_real_codebase_scan_forms_train_like_optax_with_offloaded_state(form):
  m = _forms.FORMS[form](_models.DecoderConfig(layers=6, dim=16, heads=2, ff=32, vocab=32,
                                               seq=8, batch=2))
  params, batch = _models.materialize(m.params, 0), _models.materialize(m.batch, 1)
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx = optfuse.fuse(tx, offload="state")
  where = optfuse.describe(fx, m.loss, params, *batch)
  assert "loop" in where.values()
  got = models.run_steps(fx.value_and_update(m.loss), params, fx.init(models.copy(params)),
                         [batch], 10)
  reference = lambda ulps: models.run_optax(tx, models.nudge(params, ulps), [batch], 10,
                                            loss_fn=m.loss)[:2]
  if form in ("linen_axis1", "bf16_policy"):
    # These forms compute in bf16 and rounds differently once a step's params differ by an ulp:
    # a chaos whose width depends on the processor, so it is measured (models.nudge).
    models.assert_within_reference_spread(got[:2], reference, criteria.F32, start=params)
  else:
    chex.assert_trees_all_close(got[:2], reference(0), **criteria.F32)


def test_two_pass_refuses_offload_and_says_what_runs_clipping_instead():
  with pytest.raises(optfuse.OffloadError, match='use mode="forward"'):
    optfuse.fuse(optax.adamw(1e-2), global_ops="two_pass", offload="state")


def test_an_unknown_offload_is_an_offload_error():
  with pytest.raises(optfuse.OffloadError, match="unknown offload 'optimizer'"):
    optfuse.fuse(optax.adamw(1e-2), offload="optimizer")


def test_scalar_and_integer_state_stays_on_the_device():
  assert not _memory_spaces.offloaded(jnp.zeros((), jnp.float32))
  assert not _memory_spaces.offloaded(jnp.zeros((3,), jnp.int32))
  assert _memory_spaces.offloaded(jnp.zeros((3,), jnp.bfloat16))


def test_memory_report_with_offload_compiles_every_mode_with_host_bytes():
  params = models.abstract_stacked_params(8, 64)
  args = (jax.ShapeDtypeStruct((4, 6), jnp.int32),) * 2
  report = optfuse.memory_report(models.scanned_loss, optax.adamw(1e-3), params, *args,
                                 offload="state")
  assert set(report) == {"off", "backward", "forward"}
  assert all("host_bytes" in report[mode] for mode in report)


@needs_tpu
@pytest.mark.targets
def test_offload_takes_the_state_off_the_tpu_and_counts_it_in_host_memory():
  # 8 stacked 2048x2048 layers: 134 MB of params, 268 MB of AdamW state.
  params = {"embed": jax.ShapeDtypeStruct((64, 2048), jnp.float32),
            "layers": {"w": jax.ShapeDtypeStruct((8, 2048, 2048), jnp.float32),
                       "b": jax.ShapeDtypeStruct((8, 2048), jnp.float32)}}

  def loss(p, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w["w"] + w["b"]), None), x @ p["embed"],
                        p["layers"])
    return jnp.mean(h**2)

  x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
  tx = optax.adamw(1e-3)
  plain = optfuse.memory_report(loss, tx, params, x, target="tpu-v5e")
  off = optfuse.memory_report(loss, tx, params, x, target="tpu-v5e", offload="state")
  state = 2 * sum(np.prod(p.shape) * 4 for p in jax.tree.leaves(params))
  # The goal: the device holds no state but three layer rows of state and gradient in flight
  # (the prefetched rows, the rows being updated and the rows on their way back).
  row = 3 * (2048 * 2048 + 2048) * 4
  assert off["backward"]["peak_bytes"] <= plain["backward"]["peak_bytes"] - state + 3 * row
  # Forward fusion with global clipping keeps the pending gradient in host memory too, and
  # reads its rows for the clipping factor and the update: the same bound.
  clipped = optfuse.memory_report(loss, optax.chain(optax.clip_by_global_norm(1.0), tx), params,
                                  x, target="tpu-v5e", offload="state")
  assert clipped["forward"]["peak_bytes"] <= plain["backward"]["peak_bytes"] - state + 3 * row
  assert clipped["forward"]["host_bytes"] >= state + state // 2  # the state and the gradient
  assert off["backward"]["host_bytes"] >= state
  assert plain["backward"]["host_bytes"] == 0
  assert "host" in off.table()


@pytest.mark.targets
def test_offload_takes_the_state_off_the_gpu_on_the_deviceless_h100_compiler():
  # The deviceless GPU's devices list no host memory: the state is placed on the target's
  # abstract mesh, where its memory kind survives (``_inputs.offloaded_on``).
  if not _registry.compiler_installed("cuda"):
    pytest.skip('the GPU compiler is not installed: pip install -e ".[cuda]"')
  params = models.abstract_stacked_params(8, 256)
  args = (jax.ShapeDtypeStruct((4, 6), jnp.int32),) * 2
  plain = optfuse.memory_report(models.scanned_loss, optax.adamw(1e-3), params, *args,
                                target="h100")
  off = optfuse.memory_report(models.scanned_loss, optax.adamw(1e-3), params, *args,
                              target="h100", offload="state")
  state = 2 * sum(np.prod(p.shape) * 4 for p in jax.tree.leaves(params))
  assert off["backward"]["host_bytes"] >= state
  assert off["backward"]["peak_bytes"] < plain["backward"]["peak_bytes"] - state // 2


def test_describe_says_where_each_leafs_state_lives():
  params = models.stacked_params()
  batch = models.tied_lm_batches()[0]
  fused = optfuse.describe(optfuse.fuse(optax.adamw(1e-2), offload="state"),
                           models.scanned_loss, params, *batch)
  assert set(fused.state.values()) == {"host"} and "state on host" in fused.table()
  plain = optfuse.describe(optax.adamw(1e-2), models.scanned_loss, params, *batch)
  assert set(plain.state.values()) == {"device"} and "state on" not in plain.table()


def test_orbax_resume_of_offloaded_state_continues_the_same_trajectory(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params, batches, loss = _scanned()
  fx = optfuse.fuse(optax.adamw(1e-2, weight_decay=0.05), offload="state")
  step = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1))
  straight = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                              batches, 8)
  p, s = models.copy(params), fx.init(models.copy(params))
  for t in range(4):
    _, p, s = step(p, s, *batches[t % len(batches)])
  p, s = models.orbax_round_trip(tmp_path / "step_4", (p, s),
                                 (params, fx.init(models.copy(params))))
  assert _memory_kinds(s)[0].mu["layers"]["w"] == "pinned_host"
  for t in range(4, 8):
    _, p, s = step(p, s, *batches[t % len(batches)])
  criteria.assert_matches_optax(jax.tree.map(np.asarray, (p, s)),
                                jax.tree.map(np.asarray, straight[1:]), **criteria.F32)


def test_a_device_resident_state_is_refused_and_from_optax_state_moves_it_to_the_host():
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2)
  fx = optfuse.fuse(tx, offload="state")
  step = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1))
  with pytest.raises(optfuse.OffloadError, match=r"\.mu\['embed'\] is in device memory"):
    step(models.copy(params), tx.init(models.copy(params)), *batches[0])
  state = optfuse.from_optax_state(fx, params, tx.init(models.copy(params)))
  _, _, state = step(models.copy(params), state, *batches[0])
  assert _memory_kinds(state)[0].nu["layers"]["w"] == "pinned_host"


@pytest.mark.parametrize("mu_dtype", _matrix([(jnp.bfloat16,), (jnp.float32,)],
                                              {(jnp.bfloat16,)}))
def test_bf16_moments_and_bf16_params_train_like_optax_with_offloaded_state(mu_dtype):
  params, batches, loss = _scanned()
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  tx = optax.adam(1e-2, mu_dtype=mu_dtype)
  fx = optfuse.fuse(tx, offload="state")
  got = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                         batches, 10)
  want = models.run_optax(tx, params, batches, 10, loss_fn=loss)
  # bf16 params: the same bf16 operations in the same order as optax, the slots moved to the
  # host and back exactly: measured bit-identical (float32 moments too), as without offload.
  criteria.assert_within_ulps(got, want)


# With ``-m slow``: the default suite checks ``max_batch_size`` without offload and the
# offloaded steps' peaks.
@pytest.mark.slow
def test_max_batch_size_with_offload_searches_the_offloaded_steps():
  params = models.abstract_stacked_params(8, 64)
  args_for = lambda b: (jax.ShapeDtypeStruct((b, 6), jnp.int32),) * 2
  fit = optfuse.max_batch_size(models.scanned_loss, optax.adamw(1e-3), params, args_for, "4MB",
                               offload="state", progress=False)
  assert set(fit) == {"off", "backward", "forward"}
  assert fit["backward"] >= fit["off"] > 0


def test_switching_optax_backward_forward_with_offload_follows_optax():
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2)
  p, opt_state, losses = models.copy(params), tx.init(params), []
  for mode in ("off", "backward", "forward"):
    fx = optfuse.fuse(tx, mode=mode, offload="state")
    state = optfuse.from_optax_state(fx, p, opt_state)
    got = models.run_steps(fx.value_and_update(loss), p, state, batches[:1], 8)
    losses.append(got[0])
    p, opt_state = optfuse.to_optax_state(fx, got[1], got[2])
    # Back to a plain optax state, on the device: optax's tree utilities read it.
    assert float(optax.tree.norm(opt_state[0].mu)) > 0
  want = models.run_optax(tx, params, batches[:1], 24, loss_fn=loss)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, (jnp.concatenate(losses), p, opt_state)),
                                jax.tree.map(np.asarray, want), **criteria.F32)


def test_the_gpu_loop_reading_slot_rows_after_the_gradient_trains_like_optax(monkeypatch):
  # The compilers choose the streamed loop per platform (``_backends.STREAMED_PREFETCH``): the
  # TPU's prefetches the slot rows, the GPU's reads them once the gradient row exists. This
  # machine runs the CPU's; here it runs the GPU's.
  from optfuse._targets import _backends
  monkeypatch.setitem(_backends.STREAMED_PREFETCH, "cpu", False)
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx = optfuse.fuse(tx, offload="state")
  got = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                         batches, 20)
  want = models.run_optax(tx, params, batches, 20, loss_fn=loss)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                                **criteria.F32)


def test_a_flushed_forward_state_keeps_training_with_its_state_in_host_memory():
  params, batches, loss = _scanned()
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
  fx = optfuse.fuse(tx, mode="forward", offload="state")
  step = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1))
  p, s = models.copy(params), fx.init(models.copy(params))
  losses = []
  for t in range(6):
    if t == 3:  # an evaluation in the middle of training
      p, s = jax.jit(fx.flush, donate_argnums=(0, 1))(p, s)
      assert _memory_kinds(s.pending_grads)["embed"] == "pinned_host"
    loss_t, p, s = step(p, s, *batches[t % len(batches)])
    losses.append(loss_t)
  want = models.run_optax(tx, params, batches, 6, loss_fn=loss)
  p, opt_state = optfuse.to_optax_state(fx, p, s)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, (jnp.stack(losses), p, opt_state)),
                                jax.tree.map(np.asarray, want), **criteria.F32)
