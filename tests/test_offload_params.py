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
import os
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from optfuse._targets import _registry
from optfuse.bench import _forms, _models
from tests import models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

# The tolerances of tests/test_offload.py (offload="state"): moving a row to the host and back
# is exact, so the only differences are XLA's own reassociations of the fused program.
TOL = dict(rtol=1e-5, atol=1e-6)

STEPS = 20

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
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                              **TOL)


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
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                              **TOL)


@pytest.mark.parametrize("mode", _matrix([("backward",), ("forward",)], {("backward",)}))
def test_streamed_params_without_jit_train_like_optax(mode):
  params, batches, loss = _scanned()
  tx = optax.adamw(1e-2, weight_decay=0.05)
  got = _train(optfuse.fuse(tx, mode=mode, offload="params"), params, batches, loss, 3,
               jit=False)
  want = models.run_optax(tx, params, batches, 3, loss_fn=loss)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                              **TOL)


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
    models.assert_within_reference_spread(got, reference, TOL)
  else:
    chex.assert_trees_all_close(got, reference(0), **TOL)


@pytest.mark.parametrize("which, mode", _matrix(
    [("low_bit", "backward"), ("low_bit", "forward"), ("muon", "backward"), ("muon", "forward")],
    {("muon", "backward")}))
def test_low_bit_state_and_muon_stream_their_params_like_the_state_only_offload(which, mode):
  # The reference is the same step with offload="state" (tested against optax in
  # tests/test_offload.py, tests/test_low_bit.py and tests/test_muon.py): streaming the params
  # changes where their rows are read and written, not the update.
  params, batches, loss = _scanned()
  tx = (optfuse.low_bit(optax.adamw(1e-2), bits=8) if which == "low_bit" else
        optax.contrib.muon(1e-2, muon_weight_dimension_numbers=optfuse.stacked_muon_dims))
  got = _train(optfuse.fuse(tx, mode=mode, offload="params"), params, batches, loss, 10)
  fx = optfuse.fuse(tx, mode=mode, offload="state")
  want = models.run_steps(fx.value_and_update(loss), params, fx.init(models.copy(params)),
                          batches, 10)
  want = (want[0], *optfuse.to_optax_state(fx, want[1], want[2]))
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                              **TOL)


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
  chex.assert_trees_all_close(
      jax.tree.map(np.asarray, (jnp.stack(losses), *optfuse.to_optax_state(fx, p, s))),
      jax.tree.map(np.asarray, want), **TOL)


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


def test_offload_params_refuses_mode_off_and_microbatches_and_says_what_runs_instead():
  with pytest.raises(optfuse.OffloadError, match='mode="off" has none. Use offload="state"'):
    optfuse.fuse(optax.adamw(1e-2), mode="off", offload="params")
  fx = optfuse.fuse(optax.adamw(1e-2), offload="params")
  with pytest.raises(optfuse.OffloadError, match="Use offload='state' with microbatches"):
    fx.value_and_update(models.scanned_loss, microbatches=2)


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
  chex.assert_trees_all_close(
      jax.tree.map(np.asarray, (jnp.concatenate([first[0], second[0]]), *second[1:])),
      jax.tree.map(np.asarray, want), **TOL)


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
  chex.assert_trees_all_close(jax.tree.map(np.asarray, (p, s)),
                              jax.tree.map(np.asarray, straight[1:]), **TOL)


# About 50 s: a subprocess on eight simulated devices compiles optax, both fused modes and
# backward fusion reading its host rows in the iteration (the TPU compiler's choice) on two
# layouts and trains each 20 steps.
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "data_parallel"])
def test_sharded_streamed_params_train_like_optax_on_the_same_mesh(layout, sharded_runs):
  report, arrays = sharded_runs
  prefix = lambda impl: f"{layout}/{impl}/"
  want = {k.removeprefix(prefix("optax")): v for k, v in arrays.items()
          if k.startswith(prefix("optax"))}
  for mode in ("backward", "forward", "backward_read"):
    got = {k.removeprefix(prefix(mode)): v for k, v in arrays.items()
           if k.startswith(prefix(mode))}
    assert sorted(got) == sorted(want)
    for key in want:  # the same mesh and collectives: only XLA's fusion of the update differs
      np.testing.assert_allclose(got[key], want[key], err_msg=f"{mode} {key}", **TOL)
    # Each host stack keeps its sharding, and the step gathers nothing optax does not.
    ran, optax_ran = report[f"{layout}/{mode}"], report[f"{layout}/optax"]
    assert ran["resharded"] == []
    assert (collections.Counter(ran["all_gathers"])
            - collections.Counter(optax_ran["all_gathers"])) == collections.Counter()
    assert ran["memory_kinds"]["blocks"] == {"w": "pinned_host", "b": "pinned_host"}
    assert ran["memory_kinds"]["embed"] == {"w": "device", "b": "device"}


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
  """``(report, arrays)`` of one run of ``_params_sharding_worker.py`` on eight CPU devices."""
  out = tmp_path_factory.mktemp("sharded")
  root = pathlib.Path(__file__).resolve().parent.parent
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
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
def test_the_tpu_step_peak_does_not_grow_with_depth_when_the_params_stream():
  # 512x512 layers (1 MiB a row of w): without offload each layer adds its params and state to
  # the device peak; streamed, the device holds a few rows in flight whatever the depth, and the
  # host holds the stacks and their state.
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
                                      target="tpu-v5e", offload="params")
             for n in (4, 16)}
  row = 512 * 512 * 4
  for mode in ("backward", "forward"):
    deep, shallow = reports[16][mode], reports[4][mode]
    assert deep["host_bytes"] >= 3 * 16 * row  # the params, mu and nu of the layers
    # Measured (libtpu 0.0.42.1): 11.9 rows of w at 4 layers and 11.6 at 16 in backward mode
    # (the param row read, its prefetched successor, the gradient row, the slot rows read and
    # written, the new rows on their way back), 8.6 and 9.3 in forward mode: the compiler's
    # temporaries vary a little with the loop length, the stacks are not on the device.
    assert deep["peak_bytes"] <= 1.1 * shallow["peak_bytes"]
    assert deep["peak_bytes"] < 16 * row  # less than the stack of w alone
  assert "off" in reports[4].unavailable
