"""``offload="params"``: the param stacks of the fused loops in host memory, streamed a row per
iteration with their optimizer state.

JAX 0.10 runs ``pinned_host`` memory on the CPU backend, so these tests run the programs an
accelerator would (each layer's param and state rows moved to the device for the forward and
the backward iteration, the new rows written back to the host stacks), and compare them with
plain optax on device-resident params and state. The compile-only checks on the TPU compiler,
which counts host memory apart from device memory, are marked ``targets``.
"""

import collections
import json
import pathlib
import subprocess
import sys

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
from optfuse._targets import _registry
from optfuse.bench import _forms, _models
from tests import criteria, models
from tests._subprocess import checkout_env

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

STEPS = 20
K = 2  # microbatches

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.05),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                      optax.adamw(1e-2, weight_decay=0.05)),
    "clip+lion": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.lion(1e-3)),
}

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')


def _matrix(names: list[tuple], default: set[tuple]) -> list:
  """The cases of a parametrized test; those outside ``default`` run with ``-m slow``."""
  return [pytest.param(*n, marks=() if n in default else pytest.mark.slow) for n in names]


def _memory_kinds(tree):
  return jax.tree.map(lambda x: x.sharding.memory_kind, tree)


def _scanned():
  return models.stacked_params(layers=6), models.tied_lm_batches(), models.scanned_loss


def _placed(fx, params, batches, loss):
  return optfuse.params_to_host(fx, loss, models.copy(params), *batches[0])


def _train(fx, params, batches, loss, steps: int, jit: bool = True):
  """``steps`` steps of ``fx`` from host-placed params, as ``(losses, params, optax state)`` on
  the device."""
  losses, p, state = models.run_steps(fx.value_and_update(loss), _placed(fx, params, batches,
                                                                         loss),
                                      fx.init(models.copy(params)), batches, steps, jit=jit)
  # The streamed stacks come back in host memory, the other leaves on the device.
  assert _memory_kinds(p) == _memory_kinds(_placed(fx, params, batches, loss))
  return (losses, *optfuse.to_optax_state(fx, p, state))


def test_params_to_host_puts_the_loop_stacks_in_host_memory_and_the_rest_on_the_device():
  params, batches, loss = _scanned()
  fx = optfuse.fuse(optax.adamw(1e-2), offload="params")
  kinds = _memory_kinds(_placed(fx, params, batches, loss))
  assert kinds == {"embed": "device", "head": "device",
                   "layers": {"w": "pinned_host", "b": "pinned_host"}}
  where = optfuse.describe(fx, loss, params, *batches[0])
  assert where.params == {"['embed']": "device", "['head']": "device",
                          "['layers']['b']": "host", "['layers']['w']": "host"}
  assert "['layers']['w']  loop  params on host  state on host" in where.table()
  # Other offloads keep every param on the device.
  state_fx = optfuse.fuse(optax.adamw(1e-2), offload="state")
  assert set(jax.tree.leaves(_memory_kinds(_placed(state_fx, params, batches, loss)))) == {
      "device"}
  assert set(optfuse.describe(state_fx, loss, params, *batches[0]).params.values()) == {"device"}


@pytest.mark.parametrize("optimizer", _matrix([("adamw",), ("sgd_momentum",), ("lion",)],
                                               {("adamw",)}))
def test_backward_fusion_with_streamed_params_trains_like_optax_over_20_steps(optimizer):
  params, batches, loss = _scanned()
  tx = OPTIMIZERS[optimizer]()
  got = _train(optfuse.fuse(tx, offload="params"), params, batches, loss, STEPS)
  want = models.run_optax(tx, params, batches, STEPS, loss_fn=loss)
  criteria.assert_matches_optax(got, want)


@pytest.mark.parametrize("optimizer", _matrix([("clip+adamw",), ("adamw",), ("clip+lion",)],
                                               {("clip+adamw",)}))
def test_forward_fusion_with_streamed_params_trains_like_optax_over_20_steps(optimizer):
  params, batches, loss = _scanned()
  tx = OPTIMIZERS[optimizer]()
  fx = optfuse.fuse(tx, mode="forward", offload="params")
  assert optfuse.describe(fx, loss, params, *batches[0])["['layers']['w']"] == "loop"
  got = _train(fx, params, batches, loss, STEPS)
  want = models.run_optax(tx, params, batches, STEPS, loss_fn=loss)
  # With clipping the global norm sums the rows' squares in another order: a float32 ulp.
  criteria.assert_matches_optax(got, want)


@pytest.mark.parametrize("mode", _matrix([("backward",), ("forward",)], {("backward",)}))
def test_streamed_params_without_jit_train_like_optax(mode):
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2, weight_decay=0.05)
  got = _train(optfuse.fuse(tx, mode=mode, offload="params"), params, batches, loss, 3,
               jit=False)
  want = models.run_optax(tx, params, batches, 3, loss_fn=loss)
  criteria.assert_matches_optax(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("form, mode", [(f, m) for f in ("linen_axis1", "moveaxis")
                                        for m in ("backward", "forward")])
def test_real_codebase_scan_forms_train_like_optax_with_streamed_params(form, mode):
  m = _forms.FORMS[form](_models.DecoderConfig(layers=6, dim=16, heads=2, ff=32, vocab=32,
                                               seq=8, batch=2))
  params, batch = _models.materialize(m.params, 0), _models.materialize(m.batch, 1)
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx = optfuse.fuse(tx, mode=mode, offload="params")
  assert "host" in optfuse.describe(fx, m.loss, params, *batch).params.values()
  got = _train(fx, params, [batch], m.loss, 10)[:2]
  reference = lambda ulps: models.run_optax(tx, models.nudge(params, ulps), [batch], 10,
                                            loss_fn=m.loss)[:2]
  if form == "linen_axis1":
    # It computes in bf16 and rounds differently once a step's params differ by an ulp: a
    # chaos whose width depends on the processor, so it is measured (models.nudge).
    models.assert_within_reference_spread(got, reference, criteria.F32, start=params)
  else:
    criteria.assert_matches_optax(got, reference(0))


@pytest.mark.parametrize("which, mode, microbatches", _matrix(
    [("low_bit", "backward", None), ("low_bit", "forward", None), ("muon", "backward", None),
     ("muon", "forward", None), ("low_bit", "backward", K), ("muon", "backward", K),
     ("low_bit", "forward", K), ("muon", "forward", K)],
    {("muon", "backward", None), ("low_bit", "backward", K)}))
def test_low_bit_state_and_muon_stream_their_params_like_the_state_only_offload(
    which, mode, microbatches):
  # The reference is the same step with offload="state" (tested against optax in
  # tests/engines/test_offload.py, tests/low_bit/test_low_bit.py and tests/engines/test_muon.py,
  # with microbatches in tests/low_bit/test_low_bit_fusion.py and tests/engines/test_muon.py):
  # streaming the params changes where their rows are read and written, not the update.
  params, batches, loss = _scanned()
  tx = (optfuse.low_bit(optax.adamw(1e-2), bits=8) if which == "low_bit" else
        optax.contrib.muon(1e-2, muon_weight_dimension_numbers=optfuse.stacked_muon_dims))
  streamed = optfuse.fuse(tx, mode=mode, offload="params")
  got = (_train(streamed, params, batches, loss, 10) if microbatches is None
         else _train_microbatched(streamed, params, batches, loss, 10, k=microbatches))
  fx = optfuse.fuse(tx, mode=mode, offload="state")
  want = models.run_steps(fx.value_and_update(loss, microbatches=microbatches), params,
                          fx.init(models.copy(params)), batches, 10)
  want = (want[0], *optfuse.to_optax_state(fx, want[1], want[2]))
  criteria.assert_matches_optax(got, want)


@pytest.mark.slow
def test_a_jitted_flush_keeps_the_streamed_params_in_host_memory_and_training_follows_optax():
  params, batches, loss = _scanned()
  tx = OPTIMIZERS["clip+adamw"]()
  fx = optfuse.fuse(tx, mode="forward", offload="params")
  step = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1))
  flush = jax.jit(fx.flush, donate_argnums=(0, 1))
  p, s, losses = _placed(fx, params, batches, loss), fx.init(models.copy(params)), []
  for t in range(6):
    if t == 3:  # an evaluation in the middle of training
      p, s = flush(p, s)
      assert _memory_kinds(p)["layers"]["w"] == "pinned_host"
    loss_t, p, s = step(p, s, *batches[t % len(batches)])
    losses.append(loss_t)
  want = models.run_optax(tx, params, batches, 6, loss_fn=loss)
  criteria.assert_matches_optax((jnp.stack(losses), *optfuse.to_optax_state(fx, p, s)), want)


def test_a_device_resident_loop_stack_is_refused_and_params_to_host_places_it():
  params, batches, loss = _scanned()
  fx = optfuse.fuse(optax.adamw(1e-2), offload="params")
  step = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1))
  with pytest.raises(optfuse.OffloadError,
                     match=r"\['layers'\]\['b'\] is in device memory.*optfuse.params_to_host"):
    step(models.copy(params), fx.init(models.copy(params)), *batches[0])
  host_embed = {**_placed(fx, params, batches, loss),
                "embed": jax.device_put(params["embed"], jax.memory.Space.Host)}
  with pytest.raises(optfuse.OffloadError, match=r"\['embed'\] is in host memory"):
    step(host_embed, fx.init(models.copy(params)), *batches[0])
  _, p, _ = step(_placed(fx, params, batches, loss), fx.init(models.copy(params)), *batches[0])
  assert _memory_kinds(p)["layers"]["w"] == "pinned_host"


def test_offload_params_refuses_mode_off_and_the_guard_and_says_what_runs_instead():
  with pytest.raises(optfuse.OffloadError, match='mode="off" has none. Use offload="state"'):
    optfuse.fuse(optax.adamw(1e-2), mode="off", offload="params")
  # The guard would take a stack out of its loop, onto the device whole.
  for build in (lambda: optfuse.fuse(optax.adamw(1e-2), offload="params", guard=True),
                lambda: optfuse.linen.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(
                    0.1), offload="params", guard=True),
                lambda: optfuse.train_step(models.scanned_loss, offload="params", guard=True)):
    with pytest.raises(optfuse.GuardError,
                       match='Use guard=False with offload="params", or guard=True with '
                             'offload="state"'):
      build()


def _optax_over_microbatches(tx, params, batches, steps, loss, k=K):
  """The reference written with optax alone: the mean of ``k`` microbatch gradients, then one
  update, ``steps`` times."""
  def step(params, state, *batch):
    grads, values = [], []
    for i in range(k):
      part = [x.reshape(k, -1, *x.shape[1:])[i] for x in batch]
      value, g = jax.value_and_grad(loss)(params, *part)
      grads.append(g)
      values.append(value)
    mean = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
    updates, state = tx.update(mean, state, params)
    return jnp.mean(jnp.stack(values)), optax.apply_updates(params, updates), state

  return models.run_steps(step, models.copy(params), tx.init(models.copy(params)), batches,
                          steps)


def _train_microbatched(fx, params, batches, loss, steps, jit=True, k=K):
  p = optfuse.params_to_host(fx, loss, models.copy(params), *batches[0])
  losses, p, state = models.run_steps(fx.value_and_update(loss, microbatches=k), p,
                                      fx.init(models.copy(params)), batches, steps, jit=jit)
  assert _memory_kinds(p) == _memory_kinds(_placed(fx, params, batches, loss))
  return (losses, *optfuse.to_optax_state(fx, p, state))


def test_with_microbatches_the_same_stacks_stream_and_are_updated_row_by_row_after_the_loop():
  params, batches, loss = _scanned()
  for mode in ("backward", "forward"):
    fx = optfuse.fuse(optax.adamw(1e-2), mode=mode, offload="params")
    one = optfuse.describe(fx, loss, params, *batches[0])
    split = optfuse.describe(fx, loss, params, *batches[0], microbatches=K)
    # The leaves in host memory are those the step without microbatches streams, so that
    # params_to_host places them for either step.
    assert split.params == one.params
    assert {path for path, where in split.params.items() if where == "host"} == {
        "['layers']['b']", "['layers']['w']"}
    assert split["['layers']['w']"] == "rows"
    assert "['layers']['w']  rows  params on host  state on host" in split.table()


@pytest.mark.parametrize("mode, optimizer", _matrix(
    [("backward", "adamw"), ("forward", "clip+adamw"), ("backward", "lion"),
     ("forward", "adamw"), ("forward", "clip+lion")],
    {("backward", "adamw"), ("forward", "clip+adamw")}))
def test_microbatches_with_streamed_params_train_like_optax_over_20_steps(mode, optimizer):
  params, batches, loss = _scanned()
  tx = OPTIMIZERS[optimizer]()
  got = _train_microbatched(optfuse.fuse(tx, mode=mode, offload="params"), params, batches,
                            loss, STEPS)
  criteria.assert_matches_optax(got, _optax_over_microbatches(tx, params, batches, STEPS, loss),
                                **criteria.MICROBATCH)


@pytest.mark.parametrize("mode", _matrix([("backward",), ("forward",)], {("backward",)}))
def test_microbatches_with_streamed_params_without_jit_train_like_optax(mode):
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2, weight_decay=0.05)
  got = _train_microbatched(optfuse.fuse(tx, mode=mode, offload="params"), params, batches,
                            loss, 3, jit=False)
  criteria.assert_matches_optax(got, _optax_over_microbatches(tx, params, batches, 3, loss),
                                **criteria.MICROBATCH)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["backward", "forward"])
def test_microbatches_of_a_checkpointed_stack_stream_like_the_step_without_them(mode):
  # Forward fusion updates no row inside jax.checkpoint: that stack stays on the device, with
  # or without microbatches; backward fusion streams it through the recomputed loop too.
  params, batches, _ = _scanned()
  loss = lambda p, *batch: jax.checkpoint(models.scanned_loss)(p, *batch)
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx = optfuse.fuse(tx, mode=mode, offload="params")
  where = optfuse.describe(fx, loss, params, *batches[0], microbatches=K).params
  assert where["['layers']['w']"] == ("host" if mode == "backward" else "device")
  assert where == optfuse.describe(fx, loss, params, *batches[0]).params
  got = _train_microbatched(fx, params, batches, loss, STEPS)
  criteria.assert_matches_optax(got, _optax_over_microbatches(tx, params, batches, STEPS, loss),
                                **criteria.MICROBATCH)


def test_switching_to_device_params_and_offload_none_follows_optax():
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2)
  streamed = optfuse.fuse(tx, offload="params")
  first = models.run_steps(streamed.value_and_update(loss), _placed(streamed, params, batches,
                                                                     loss),
                           streamed.init(models.copy(params)), batches[:1], 6)
  p, opt_state = optfuse.params_to_device(first[1]), optfuse.to_optax_state(
      streamed, first[1], first[2])[1]
  assert set(jax.tree.leaves(_memory_kinds(p))) == {"device"}
  # Back on the device, any JAX code reads the params: an evaluation, a plain optax step.
  assert np.isfinite(float(jax.jit(loss)(p, *batches[0])))
  plain = optfuse.fuse(tx)
  second = models.run_steps(plain.value_and_update(loss), p, opt_state, batches[:1], 6)
  want = models.run_optax(tx, params, batches[:1], 12, loss_fn=loss)
  criteria.assert_matches_optax((jnp.concatenate([first[0], second[0]]), *second[1:]), want)


def test_orbax_resume_of_streamed_params_continues_the_same_trajectory(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params, batches, loss = _scanned()
  fx = optfuse.fuse(optax.adamw(1e-2, weight_decay=0.05), offload="params")
  step = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1))
  straight = models.run_steps(fx.value_and_update(loss), _placed(fx, params, batches, loss),
                              fx.init(models.copy(params)), batches, 8)
  p, s = _placed(fx, params, batches, loss), fx.init(models.copy(params))
  for t in range(4):
    _, p, s = step(p, s, *batches[t % len(batches)])
  p, s = models.orbax_round_trip(tmp_path / "step_4", (p, s),
                                 (_placed(fx, params, batches, loss),
                                  fx.init(models.copy(params))))
  assert _memory_kinds(p)["layers"]["w"] == "pinned_host"
  for t in range(4, 8):
    _, p, s = step(p, s, *batches[t % len(batches)])
  criteria.assert_matches_optax((p, s), straight[1:])


# About 90 s: a subprocess on eight simulated devices compiles optax, both fused modes and
# backward fusion reading its host rows in the iteration (the TPU compiler's choice), on two
# layouts, with and without two microbatches (the last without it), and trains each 20 steps.
@pytest.mark.slow
@pytest.mark.parametrize("layout, suffix", [(layout, suffix) for layout in ("fsdp",
                                                                            "data_parallel")
                                            for suffix in ("", "_mb")])
def test_sharded_streamed_params_train_like_optax_on_the_same_mesh(layout, suffix,
                                                                   sharded_runs):
  report, arrays = sharded_runs
  prefix = lambda impl: f"{layout}/{impl}{suffix}/"
  want = {k.removeprefix(prefix("optax")): v for k, v in arrays.items()
          if k.startswith(prefix("optax"))}
  # With microbatches, the microbatch tolerance.
  tol = criteria.MICROBATCH if suffix else criteria.F32
  for mode in ("backward", "forward") + (() if suffix else ("backward_read",)):
    got = {k.removeprefix(prefix(mode)): v for k, v in arrays.items()
           if k.startswith(prefix(mode))}
    assert sorted(got) == sorted(want)
    for key in want:  # the same mesh and collectives: only XLA's fusion of the update differs
      np.testing.assert_allclose(got[key], want[key], err_msg=f"{mode} {key}", **tol)
    # Each host stack keeps its sharding, and the step gathers nothing optax does not.
    ran, optax_ran = report[f"{layout}/{mode}{suffix}"], report[f"{layout}/optax{suffix}"]
    assert ran["resharded"] == []
    more = collections.Counter(ran["all_gathers"]) - collections.Counter(optax_ran["all_gathers"])
    # With microbatches the fused step gathers two arrays more than optax's Python loop over
    # the slices, both stacked along the microbatch axis (``_accumulate.split`` adds it to the
    # batch), none a param or a param stack (whose leading axis is the 6 layers or absent).
    # Measured: data parallel f32[2,2,16] and f32[2,2,8] (x and y), FSDP f32[2,8,2] and
    # f32[2,8,4]; not traced further.
    if suffix:
      assert sum(more.values()) == 2 and all(s.startswith(f"f32[{K},") for s in more), more
    else:
      assert more == collections.Counter()
    assert ran["memory_kinds"]["blocks"] == {"w": "pinned_host", "b": "pinned_host"}
    assert ran["memory_kinds"]["embed"] == {"w": "device", "b": "device"}


@pytest.mark.slow
def test_sharded_streamed_params_criterion_rejects_a_one_percent_learning_rate_error(
    sharded_runs):
  # The check above, on FSDP with the params streamed, must fail for an update 1 % too large,
  # by REJECTED_BY tolerances at least.
  _, arrays = sharded_runs
  only = lambda impl: {k.removeprefix(f"fsdp/{impl}/"): v for k, v in arrays.items()
                       if k.startswith(f"fsdp/{impl}/")}
  got, want = only("backward+lr_1pct_off"), only("optax")
  assert sorted(got) == sorted(want)
  assert criteria.matches_optax_distance(got, want, **criteria.F32)[0] >= criteria.REJECTED_BY


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
  """``(report, arrays)`` of one run of ``_params_sharding_worker.py`` on eight CPU devices."""
  out = tmp_path_factory.mktemp("sharded")
  root = pathlib.Path(__file__).resolve().parents[2]
  env = checkout_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(root / "tests" / "_params_sharding_worker.py"),
                         str(out)], env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return json.loads((out / "report.json").read_text()), dict(np.load(out / "results.npz"))


def test_the_lowered_step_takes_and_returns_the_loop_stacks_in_host_memory():
  # XLA:CPU counts host memory as device memory (its compiled sizes put both in one), so on
  # this machine the check is the program's signature: the stacks are its host arguments and
  # results, aliased (donated), and every other param stays in device memory.
  params, batches, loss = _scanned()
  fx = optfuse.fuse(optax.adamw(1e-2), offload="params")
  lowered = jax.jit(fx.value_and_update(loss), donate_argnums=(0, 1)).lower(
      _placed(fx, params, batches, loss), fx.init(models.copy(params)), *batches[0])
  main = next(line for line in lowered.as_text().splitlines() if "func.func public @main" in line)
  host_args = main.count('mhlo.memory_kind = "pinned_host", sdy.sharding')
  host_results = main.count('mhlo.memory_kind = "pinned_host"}')
  slots = 2 * len(jax.tree.leaves(params))  # AdamW's mu and nu, in host memory too
  assert host_args == host_results == len(jax.tree.leaves(params["layers"])) + slots
  assert "result[1]['layers']['w']\", mhlo.memory_kind = \"pinned_host\"" in main
  assert "result[1]['embed']\", mhlo.memory_kind = \"device\"" in main


@needs_tpu
@pytest.mark.targets
@pytest.mark.parametrize("microbatches", [None, 2])
def test_the_tpu_step_peak_does_not_grow_with_depth_when_the_params_stream(microbatches):
  # 512x512 layers (1 MiB a row of w): without offload each layer adds its params and state to
  # the device peak; streamed, the device holds a few rows in flight whatever the depth, and the
  # host holds the stacks and their state (with microbatches, the sum of their gradients too,
  # which starts in a copy of the param stack that the first microbatch writes over: zeros
  # made whole were a stack on the device).
  def loss(p, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w["w"] + w["b"]), None),
                        x @ p["embed"], p["layers"])
    return jnp.mean(h**2)

  def params_of(layers):
    return {"embed": jax.ShapeDtypeStruct((64, 512), jnp.float32),
            "layers": {"w": jax.ShapeDtypeStruct((layers, 512, 512), jnp.float32),
                       "b": jax.ShapeDtypeStruct((layers, 512), jnp.float32)}}

  x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
  reports = {n: optfuse.memory_report(loss, optax.adamw(1e-3), params_of(n), x,
                                      target="tpu-v5e", offload="params",
                                      microbatches=microbatches)
             for n in (4, 16)}
  row = 512 * 512 * 4
  for mode in ("backward", "forward"):
    deep, shallow = reports[16][mode], reports[4][mode]
    assert deep["host_bytes"] >= 3 * 16 * row  # the params, mu and nu of the layers
    # Measured (libtpu 0.0.42.1): 11.9 rows of w at 4 layers and 11.6 at 16 in backward mode
    # (the param row read, its prefetched successor, the gradient row, the slot rows read and
    # written, the new rows on their way back), 8.6 and 9.3 in forward mode: the compiler's
    # temporaries vary a little with the loop length, the stacks are not on the device. With
    # two microbatches 9.6 at both depths in backward mode, 12.6 and 12.5 in forward mode (9.8,
    # and 13.0 at both, with zeros written a row at a time before the loop); with the sum's
    # zeros made whole, 10.1 and 22.2 (backward), 16.6 and 28.6 (forward).
    assert deep["peak_bytes"] <= 1.1 * shallow["peak_bytes"]
    assert deep["peak_bytes"] < 16 * row  # less than the stack of w alone
  assert "off" in reports[4].unavailable


# The Flax adapters: an nn.scan and an nnx.scan model of six residual blocks (four or more
# layers: AdamW's loops fuse from four rows, ``Plan.min_rows``), trained through the adapters
# with the stacks in host memory and compared with Flax's own optax step on device params.
FLAX_LAYERS = 6


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(8)(nn.LayerNorm()(h))), None


class _LinenScanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=FLAX_LAYERS)()
    h, _ = blocks(nn.Dense(8)(x), None)
    return nn.Dense(2)(h)


class _NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.linear = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, h):
    return h + jnp.tanh(self.linear(self.norm(h)))


class _NnxScanned(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=FLAX_LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return _NnxBlock(rngs)

    self.inp, self.blocks, self.out = nnx.Linear(4, 8, rngs=rngs), blocks(rngs), nnx.Linear(
        8, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def apply(h, block):
      return block(h)

    return self.out(apply(self.inp(x), self.blocks))


def _flax_batch():
  x = jax.random.normal(jax.random.key(3), (6, 4))
  return x, jnp.sin(x[:, :2])


def _linen_loss(params, x, y):
  return jnp.mean((_LinenScanned().apply({"params": params}, x) - y) ** 2)


def _linen_reference(tx, params, steps, loss_fn=None, batch=None):
  """Flax's own optax step of ``loss_fn`` (``_linen_loss``) on ``batch()`` (``_flax_batch``),
  ``steps`` times: ``(losses, params, opt_state)``."""
  loss_fn, batch = loss_fn or _linen_loss, batch or _flax_batch
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  step = jax.jit(lambda s, x, y: (lambda lg: (lg[0], s.apply_gradients(grads=lg[1])))(
      jax.value_and_grad(loss_fn)(s.params, x, y)))
  losses = []
  for _ in range(steps):
    loss, state = step(state, *batch())
    losses.append(loss)
  return jnp.stack(losses), state.params, state.opt_state


@pytest.mark.parametrize("entry, mode", _matrix(
    [("train_state", "backward"), ("train_state", "forward"), ("train_step", "backward")],
    {("train_state", "backward"), ("train_step", "backward")}))
def test_the_linen_adapters_stream_an_nn_scan_stack_and_train_like_optax(entry, mode):
  params = _LinenScanned().init(jax.random.key(0), _flax_batch()[0])["params"]
  tx = optax.adamw(1e-2, weight_decay=0.05)
  if entry == "train_state":
    state = optfuse.linen.TrainState.create(apply_fn=None, params=models.copy(params), tx=tx,
                                            mode=mode, offload="params")
    state = state.params_to_host(_linen_loss, *_flax_batch())
    run = lambda s, x, y: s.value_and_update(_linen_loss, x, y)
  else:  # a plain Flax state: its params and opt_state placed once, out of jit
    fx = optfuse.fuse(tx, mode=mode, offload="params")
    state = train_state.TrainState.create(apply_fn=None, params=models.copy(params), tx=tx)
    state = state.replace(params=optfuse.params_to_host(fx, _linen_loss, state.params,
                                                        *_flax_batch()),
                          opt_state=optfuse.from_optax_state(fx, state.params, state.opt_state))
    run = optfuse.train_step(_linen_loss, mode=mode, offload="params")
  kinds = _memory_kinds(state.params)
  assert kinds["Scan_LinenBlock_0"]["Dense_0"]["kernel"] == "pinned_host"
  assert kinds["Dense_0"]["kernel"] == "device"
  step, losses = jax.jit(run, donate_argnums=0), []
  for _ in range(STEPS):
    loss, state = step(state, *_flax_batch())
    losses.append(loss)
  fx = state.fused if entry == "train_state" else optfuse.fuse(tx, mode=mode, offload="params")
  got = (jnp.stack(losses), *optfuse.to_optax_state(fx, state.params, state.opt_state))
  # An evaluation of the nn.scan model on the params where they are (a float32 ulp, as in
  # test_streamed_evaluates_on_host_params_what_the_function_gives_on_device_params).
  np.testing.assert_allclose(optfuse.streamed(_linen_loss)(state.params, *_flax_batch()),
                             _linen_loss(optfuse.params_to_device(state.params), *_flax_batch()),
                             rtol=1e-6, atol=1e-7)
  criteria.assert_matches_optax(got, _linen_reference(tx, params, STEPS), **criteria.F32)


def _nnx_reference(tx, steps, model_class=None, batch=None):
  """NNX's own ``Optimizer`` on ``model_class(nnx.Rngs(0))`` (``_NnxScanned``) and ``batch()``
  (``_flax_batch``), ``steps`` times: ``(losses, params, opt_state)``."""
  model, batch = (model_class or _NnxScanned)(nnx.Rngs(0)), batch or _flax_batch
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss

  losses = jnp.stack([step(model, optimizer, *batch()) for _ in range(steps)])
  return losses, nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)


def _nnx_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("mode, jit", _matrix(
    [("backward", True), ("forward", True), ("backward", False)],
    {("backward", True), ("backward", False)}))
def test_the_nnx_optimizer_streams_an_nnx_scan_stack_and_trains_like_optax(mode, jit):
  model = _NnxScanned(nnx.Rngs(0))
  tx = optax.adamw(1e-2, weight_decay=0.05)
  optimizer = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param, mode=mode, offload="params")
  optimizer.params_to_host(model, _nnx_loss, *_flax_batch())
  kinds = _memory_kinds(nnx.as_pure(nnx.state(model, nnx.Param)))
  assert kinds["blocks"]["linear"]["kernel"] == "pinned_host"
  assert kinds["inp"]["kernel"] == "device"
  step = lambda m, o, x, y: o.value_and_update(m, _nnx_loss, x, y)
  step = nnx.jit(step, donate_argnums=(0, 1)) if jit else step
  steps = STEPS if jit else 3  # eagerly each step is traced again: seconds a step
  losses = jnp.stack([step(model, optimizer, *_flax_batch()) for _ in range(steps)])
  assert _memory_kinds(nnx.as_pure(nnx.state(model, nnx.Param))) == kinds
  optimizer.flush(model)
  params, opt_state = nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)
  if mode == "forward":
    opt_state = opt_state.opt_state
  want_losses, want_params, want_opt_state = _nnx_reference(tx, steps)
  # The optimizer state's leaves, in one order: NNX keeps optax's tuples as States of theirs.
  criteria.assert_matches_optax((losses, params, jax.tree.leaves(opt_state)),
                                (want_losses, want_params, jax.tree.leaves(want_opt_state)),
                                **criteria.F32)


def _logits(params, tokens):
  """The scanned model's next-token logits: one step of generation."""
  body = lambda h, layer: (h + jnp.tanh(h @ layer["w"] + layer["b"]), None)
  h, _ = jax.lax.scan(body, params["embed"][tokens], params["layers"])
  return h[:, -1] @ params["head"]


@pytest.mark.parametrize("jit", [True, False])
def test_streamed_evaluates_on_host_params_what_the_function_gives_on_device_params(jit):
  params, batches, loss = _scanned()
  fx = optfuse.fuse(optax.adamw(1e-2), offload="params")
  _, trained, _ = models.run_steps(fx.value_and_update(loss), _placed(fx, params, batches, loss),
                                   fx.init(models.copy(params)), batches, 3)
  assert _memory_kinds(trained)["layers"]["w"] == "pinned_host"
  on_device = optfuse.params_to_device(trained)
  wrap = jax.jit if jit else (lambda f: f)
  for fn, args in ((loss, batches[1]), (_logits, batches[1][:1]),
                   (jax.checkpoint(loss), batches[2])):
    got = wrap(optfuse.streamed(fn))(trained, *args)
    # The same operations on the same rows, the loop written as the step's forward loop:
    # XLA may fuse its body differently, a float32 ulp.
    np.testing.assert_allclose(got, wrap(fn)(on_device, *args), rtol=1e-6, atol=1e-7)
  # The params are read where they are, not moved.
  assert _memory_kinds(trained)["layers"]["w"] == "pinned_host"


def test_streamed_refuses_a_host_leaf_read_outside_a_scan_and_says_to_fetch_the_params():
  params, batches, loss = _scanned()
  host_embed = {**params, "embed": jax.device_put(params["embed"], jax.memory.Space.Host)}
  with pytest.raises(optfuse.OffloadError,
                     match=r"\['embed'\] is in host memory.*optfuse.params_to_device"):
    optfuse.streamed(loss)(host_embed, *batches[0])
