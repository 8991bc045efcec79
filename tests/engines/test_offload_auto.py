"""``offload="auto"``: what each leaf streams, planned to fit a budget with the fewest bytes
moved, and a step that takes the mixed placement.

The step is checked on the CPU, whose ``pinned_host`` memory is real: with some leaves' params
and slots in host memory, some leaves' slots alone, and the others on the device, it trains like
plain optax. The plan is made from compiled device peaks, which XLA:CPU does not split from host
memory, so the planner is checked on the TPU compiler (compile-only, marked ``targets``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optfuse
import optfuse.linen
import optfuse.nnx
from optfuse._analysis import _streams
from optfuse._base import _memory_spaces
from optfuse._targets import _registry
from tests import criteria, models
from tests.engines import test_offload_params

STEPS = 20
# A mixed placement of the scanned model: one stack's params and slots streamed, the other's
# slots alone, a tapped leaf's slots, and a leaf left on the device.
MIXED = {"['layers']['w']": "params", "['layers']['b']": "state", "['embed']": "state",
         "['head']": "none"}

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')


def _kinds(tree):
  return jax.tree.map(lambda x: x.sharding.memory_kind, tree)


def _mixed_start(tx):
  params = models.stacked_params(layers=6)
  fx = optfuse.fuse(tx, offload="auto")
  placed = _streams.place_streams(tx, models.copy(params), fx.init(models.copy(params)), MIXED,
                                  _memory_spaces.to_host)
  return fx, params, placed


def test_init_leaves_the_state_on_the_device_and_a_plan_places_what_it_streams():
  tx = optax.adamw(1e-2)
  fx, params, (p, s) = _mixed_start(tx)
  assert set(jax.tree.leaves(_kinds(fx.init(params)))) == {"device"}
  assert _kinds(p) == {"embed": "device", "head": "device",
                       "layers": {"w": "pinned_host", "b": "device"}}
  mu = _kinds(s[0].mu)
  assert mu == {"embed": "pinned_host", "head": "device",
                "layers": {"w": "pinned_host", "b": "pinned_host"}}


@pytest.mark.equivalence
@pytest.mark.parametrize("jit", [True, False], ids=["jit_donated", "eager"])
def test_a_mixed_placement_trains_like_optax(jit):
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx, params, (p, s) = _mixed_start(tx)
  steps = STEPS if jit else 2  # eagerly, a step runs op by op: two show the same program
  batches = models.tied_lm_batches()
  losses, p_out, s_out = models.run_steps(fx.value_and_update(models.scanned_loss), p, s,
                                          batches, steps, jit=jit)
  # Each leaf comes back where it was: the streamed rows are written back to the host stacks.
  assert _kinds(p_out) == _kinds(p) and _kinds(s_out) == _kinds(s)
  got = (losses, *optfuse.to_optax_state(fx, p_out, s_out))
  want = models.run_optax(tx, params, batches, steps, loss_fn=models.scanned_loss)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))


@pytest.mark.equivalence
@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["jit_donated", "eager"])
def test_a_mixed_placement_with_microbatches_trains_like_optax_accumulating(jit):
  # The stack whose params are in host memory keeps the sum of its gradients there too and is
  # updated row by row after the loop over the microbatches; the stack on the device sums on
  # the device, from zeros, its slots in host memory. Against optax's own loop: the mean of the
  # microbatch gradients, then one update.
  tx = optax.adamw(1e-2, weight_decay=0.05)
  fx, params, (p, s) = _mixed_start(tx)
  steps = STEPS if jit else 2
  batches = models.tied_lm_batches()
  step = fx.value_and_update(models.scanned_loss, microbatches=2)
  losses, p_out, s_out = models.run_steps(step, p, s, batches, steps, jit=jit)
  assert _kinds(p_out) == _kinds(p) and _kinds(s_out) == _kinds(s)
  got = (losses, *optfuse.to_optax_state(fx, p_out, s_out))
  want = test_offload_params._optax_over_microbatches(tx, params, batches, steps,
                                                      models.scanned_loss, k=2)
  criteria.assert_matches_optax(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                                **criteria.MICROBATCH)
  # Its trace streams the stack in host memory, and only that one.
  found = []
  traced = lambda p, s, *batch: found.append(
      fx.value_and_update.placed(models.scanned_loss, False, 2)(p, s, *batch)[1])
  jax.jit(traced).trace(p, s, *batches[0])
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
  assert {paths[i] for i in found[0].streamed} == {"['layers']['w']"}
  assert found[0].where[paths.index("['layers']['w']")] == "rows"


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(256)(h)), None


class _LinenScanned(nn.Module):
  """An ``nn.scan`` stack of 8 layers of width 256: wide enough that streaming frees more of
  the TPU's tiled memory than its rows in flight take."""

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=8)()
    h, _ = blocks(nn.Dense(256)(x), None)
    return nn.Dense(2)(h)


def _linen_loss(params, x, y):
  return jnp.mean((_LinenScanned().apply({"params": params}, x) - y) ** 2)


_nnx_loss = test_offload_params._nnx_loss


def _linen_batch():
  x = jax.random.normal(jax.random.key(3), (8, 4))
  return x, jnp.sin(x[:, :2])


@pytest.mark.slow  # the plan's compiles and 20 steps: 18 s
@pytest.mark.targets
@needs_tpu
def test_a_linen_train_state_placed_by_its_plan_trains_like_flax():
  # ``TrainState.place`` plans on the TPU compiler for a byte less than the step needs with
  # nothing streamed; the state so placed trains here (each leaf staying where the plan put it)
  # like Flax's own optax step.
  params = _LinenScanned().init(jax.random.key(0), _linen_batch()[0])["params"]
  tx = optax.adamw(1e-2, weight_decay=0.05)
  state = optfuse.linen.TrainState.create(apply_fn=None, params=models.copy(params), tx=tx,
                                          offload="auto")
  need = optfuse.memory_report(_linen_loss, tx, params, *_linen_batch(),
                               target="tpu-v5e")["backward"]["peak_bytes"]
  state, plan = state.place(_linen_loss, *_linen_batch(), budget=need - 1, target="tpu-v5e")
  assert plan.device_peak_bytes < need and set(plan.streams.values()) != {"none"}
  kinds = (_kinds(state.params), _kinds(state.opt_state))
  assert "pinned_host" in jax.tree.leaves(kinds)
  step, losses = jax.jit(lambda s, x, y: s.value_and_update(_linen_loss, x, y),
                         donate_argnums=0), []
  for _ in range(STEPS):
    loss, state = step(state, *_linen_batch())
    losses.append(loss)
  assert (_kinds(state.params), _kinds(state.opt_state)) == kinds
  got = (jnp.stack(losses), *optfuse.to_optax_state(state.fused, state.params, state.opt_state))
  criteria.assert_matches_optax(got, test_offload_params._linen_reference(
      tx, params, STEPS, _linen_loss, _linen_batch))
  with pytest.raises(optfuse.OffloadError, match="plans offload='auto'"):
    optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=tx).place(
        _linen_loss, *_linen_batch(), budget="tpu-v5e")


class _NnxScanned(nnx.Module):
  """``_LinenScanned`` in NNX: an ``nnx.scan`` over 8 vmapped layers of width 256."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=8)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return nnx.Linear(256, 256, rngs=rngs)

    self.inp, self.blocks, self.out = (nnx.Linear(4, 256, rngs=rngs), blocks(rngs),
                                       nnx.Linear(256, 2, rngs=rngs))

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def apply(h, block):
      return h + jnp.tanh(block(h))

    return self.out(apply(self.inp(x), self.blocks))


@pytest.mark.slow  # the plan's compiles and 20 steps
@pytest.mark.targets
@needs_tpu
def test_an_nnx_optimizer_placed_by_its_plan_trains_like_nnx():
  # ``Optimizer.place`` plans on the TPU compiler for a byte less than the step needs with
  # nothing streamed, and moves the model's params and the optimizer's state; so placed, the
  # model trains here like NNX's own optax optimizer.
  tx = optax.adamw(1e-2, weight_decay=0.05)
  model = _NnxScanned(nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  need = optfuse.memory_report(
      lambda p, x, y: _nnx_loss(nnx.merge(nnx.graphdef(model), p), x, y), tx, params,
      *_linen_batch(), target="tpu-v5e")["backward"]["peak_bytes"]
  optimizer = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param, offload="auto")
  plan = optimizer.place(model, _nnx_loss, *_linen_batch(), budget=need - 1, target="tpu-v5e")
  assert plan.device_peak_bytes < need and set(plan.streams.values()) != {"none"}
  kinds = _kinds(nnx.as_pure(nnx.state(model, nnx.Param)))
  assert "pinned_host" in jax.tree.leaves((kinds, _kinds(nnx.as_pure(optimizer.opt_state))))

  @nnx.jit
  def fused_step(model, optimizer, x, y):
    return optimizer.value_and_update(model, _nnx_loss, x, y)

  got = jnp.stack([fused_step(model, optimizer, *_linen_batch()) for _ in range(STEPS)])
  assert _kinds(nnx.as_pure(nnx.state(model, nnx.Param))) == kinds
  want = test_offload_params._nnx_reference(tx, STEPS, _NnxScanned, _linen_batch)
  criteria.assert_matches_optax((got, nnx.as_pure(nnx.state(model, nnx.Param))), want[:2])


def test_a_param_in_host_memory_that_no_loop_updates_is_refused():
  tx = optax.adam(1e-2)
  fx, _, (p, s) = _mixed_start(tx)
  p = {**p, "head": jax.device_put(p["head"], jax.memory.Space.Host)}
  with pytest.raises(optfuse.OffloadError, match=r"param leaf \['head'\] is in host memory"):
    fx.value_and_update(models.scanned_loss)(p, s, *models.tied_lm_batches()[0])


@pytest.mark.parametrize("options, match", [
    (dict(mode="off"), "not backward fusion"),
    (dict(mode="forward"), "not backward fusion"),
    (dict(global_ops="two_pass"), "runs two"),
])
def test_auto_refuses_the_options_it_does_not_plan(options, match):
  with pytest.raises(optfuse.OffloadError, match=match):
    optfuse.fuse(optax.adam(1e-2), offload="auto", **options)


def test_auto_refuses_planning_on_xla_cpu():
  fx = optfuse.fuse(optax.adam(1e-2), offload="auto")
  params, batch = models.stacked_params(), models.tied_lm_batches()[0]
  with pytest.raises(optfuse.OffloadError, match="XLA:CPU counts host memory"):
    optfuse.place(fx, models.scanned_loss, params, *batch, budget=10**6)
  with pytest.raises(optfuse.OffloadError, match="plans offload='auto'"):
    optfuse.plan_offload(optfuse.fuse(optax.adam(1e-2)), models.scanned_loss, params, *batch,
                         budget="tpu-v5e")


def _tpu_report(offload, params, batch, tx):
  return optfuse.memory_report(models.scanned_loss, tx, params, *batch, target="tpu-v5e",
                               offload=offload)["backward"]


@pytest.mark.slow  # eight compiles of the step: 40 s
@pytest.mark.targets
@needs_tpu
def test_the_plan_fits_the_budget_with_fewer_bytes_moved_than_streaming_everything():
  params = models.abstract_stacked_params(8, 256)
  batch = (jax.ShapeDtypeStruct((models.BATCH, models.SEQ), jnp.int32),) * 2
  tx = optax.adam(1e-3)
  none, state, everything = (_tpu_report(o, params, batch, tx) for o in (None, "state",
                                                                          "params"))
  assert everything["peak_bytes"] < state["peak_bytes"] < none["peak_bytes"]
  fx = optfuse.fuse(tx, offload="auto")
  planned = lambda budget: optfuse.plan_offload(fx, models.scanned_loss, params, *batch,
                                             budget=budget, target="tpu-v5e")
  # A budget between streaming the state and streaming everything: the plan fits it moving
  # fewer bytes than either (it streams the large stack's slots, not the small leaves').
  mid = planned((state["peak_bytes"] + everything["peak_bytes"]) // 2)
  assert mid.device_peak_bytes <= mid.budget_bytes
  assert 0 < mid.host_transfer_bytes < state["host_transfer_bytes"]
  # At what streaming everything needs, it streams params too, and moves no more.
  low = planned(everything["peak_bytes"])
  assert low.device_peak_bytes <= everything["peak_bytes"]
  assert "params" in low.streams.values()
  assert low.host_transfer_bytes <= everything["host_transfer_bytes"]
  plan = low
  streamed = [p for p, w in plan.streams.items() if w != "none"]
  assert all("needed to fit" in plan.why[p] for p in streamed)
  assert "device peak" in plan.table()
  # describe says where each leaf lives, and why.
  where = optfuse.describe(fx, models.scanned_loss, params, *batch, plan=plan)
  assert where.params == {p: "host" if w == "params" else "device"
                          for p, w in plan.streams.items()}
  assert all(f"({plan.why[p]})" in where.table() for p in streamed)
  # A budget the step fits as it is streams nothing; one below what streaming everything
  # needs is refused, saying by how much.
  assert set(planned(none["peak_bytes"]).streams.values()) == {"none"}
  with pytest.raises(optfuse.OffloadError, match="even with every leaf it can stream"):
    planned(everything["peak_bytes"] // 2)


@pytest.mark.slow  # five compiles of the step: 25 s
@pytest.mark.targets
@needs_tpu
def test_with_microbatches_the_plan_fits_the_budget_and_describe_says_what_streams():
  params, k = models.abstract_stacked_params(8, 256), 2
  batch = (jax.ShapeDtypeStruct((models.BATCH * k, models.SEQ), jnp.int32),) * 2
  tx = optax.adam(1e-3)
  everything = optfuse.memory_report(models.scanned_loss, tx, params, *batch, target="tpu-v5e",
                                     offload="params", microbatches=k)["backward"]
  fx = optfuse.fuse(tx, offload="auto")
  plan = optfuse.plan_offload(fx, models.scanned_loss, params, *batch,
                              budget=everything["peak_bytes"], target="tpu-v5e",
                              microbatches=k)
  assert plan.device_peak_bytes <= everything["peak_bytes"]
  assert 0 < plan.host_transfer_bytes <= everything["host_transfer_bytes"]
  streamed = {path for path, what in plan.streams.items() if what == "params"}
  assert streamed
  # The plan's stacks keep their sums in host memory and are updated row by row after the
  # loop: describe traces the step on the params and state the plan places.
  where = optfuse.describe(fx, models.scanned_loss, params, *batch, plan=plan, microbatches=k)
  assert {path for path, on in where.params.items() if on == "host"} == streamed
  assert all(where[path] == "rows" for path in streamed)


@pytest.mark.targets
@needs_tpu
@pytest.mark.parametrize("microbatches", [None, 2])
def test_memory_report_plans_auto_for_the_target_and_reports_its_plan(microbatches):
  params = models.abstract_stacked_params(8, 256)
  batch = (jax.ShapeDtypeStruct((models.BATCH * (microbatches or 1), models.SEQ),
                                jnp.int32),) * 2
  report = optfuse.memory_report(models.scanned_loss, optax.adam(1e-3), params, *batch,
                                 target="tpu-v5e", offload="auto", microbatches=microbatches)
  # The model fits the v5e's 16.91 GB as it is: nothing streams, nothing moves.
  assert set(report) == {"backward"} and set(report.unavailable) == {"off", "forward"}
  assert set(report.offload_plan.streams.values()) == {"none"}
  assert report["backward"]["host_transfer_bytes"] == 0 and report.fits("backward")


def _peaks_where_streaming_raises(raising: set):
  """A stand-in for the compiled peak of each placement: 10 MB, less the state (and params)
  bytes of each stream, but for the ``(path, what)`` streams of ``raising``, which add 1 MB (a
  compiler that keeps what it streams, and more, in device memory)."""
  params = models.abstract_stacked_params(8, 256)
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  size = lambda path: 4 * int(np.prod(flat[path].shape))

  def step_memory(*_, streams, **__):
    peak = 10 * 2**20
    for path, what in streams.items():
      freed = 2 * size(path) + (size(path) if what == "params" else 0)
      peak += 2**20 if (path, what) in raising else -freed
    return {"peak_bytes": peak, "host_bytes": 0, "host_transfer_bytes": 0}

  return params, step_memory


@needs_tpu
@pytest.mark.targets
def test_the_plan_does_not_stream_what_does_not_lower_the_compiled_peak(monkeypatch):
  """A stream whose compiled peak is not below the peak without it is not chosen (a compiler
  may hold more than it streams, as the TPU compiler did under FSDP), and the plan says so."""
  w = "['layers']['w']"
  params, step_memory = _peaks_where_streaming_raises({(w, "state")})
  monkeypatch.setattr(optfuse._analysis._memory, "step_memory", step_memory)
  batch = (jax.ShapeDtypeStruct((models.BATCH, models.SEQ), jnp.int32),) * 2
  fx = optfuse.fuse(optax.adam(1e-3), offload="auto")
  # 100 KB to free: w's slots (4 MB) are the smallest that cover it by their bytes, but raise
  # the peak; the embedding's and head's (64 KB each) cover it together.
  plan = optfuse.plan_offload(fx, models.scanned_loss, params, *batch,
                              budget=10 * 2**20 - 100_000, target="tpu-v5e")
  assert plan.device_peak_bytes <= plan.budget_bytes
  assert plan.streams[w] == "none" and "did not lower the compiled peak" in plan.why[w]
  assert {plan.streams[p] for p in ("['embed']", "['head']")} == {"state"}
  # Where nothing else frees enough, the plan refuses, naming what did not lower the peak.
  _, raising_everywhere = _peaks_where_streaming_raises({(w, "state"), (w, "params")})
  monkeypatch.setattr(optfuse._analysis._memory, "step_memory", raising_everywhere)
  with pytest.raises(optfuse.OffloadError, match=r"did not lower the compiled peak"):
    optfuse.plan_offload(fx, models.scanned_loss, params, *batch, budget=5 * 2**20,
                         target="tpu-v5e")
