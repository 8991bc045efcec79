"""Several chips under FSDP: the tools plan the optimizer state sharded like its params.

An FSDP user's state is sharded with the params: ``tx.init`` on placed arrays keeps each param's
sharding (``zeros_like``), and MaxText-style code shards it with ``optax.tree_map_params``. The
tools lay out the state they compile the same way (``_inputs.state_on``), so a report for a TPU
v5e 2x2 mesh is the peak of the step the user runs, not of one with the state replicated.
Streamed (``offload="state"``, ``"params"``), each chip's shards live in its host memory and
pass through the device a layer's rows at a time, so most of their bytes leave its peak.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._analysis import _memory
from optfuse._targets import _inputs, _registry
from optfuse.bench import _models
from tests import models

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')


def _example():
  """``examples/plan_fsdp.py``: the FSDP layout and the optax step a user lowers by hand."""
  return models.load_example("plan_fsdp")


PLAN = _example()


@pytest.fixture(scope="module")
def decoder():
  mesh = optfuse.target_mesh("tpu-v5e:2x2", ("fsdp",))
  # Wide enough that the state (8 bytes a param) is most of each device's memory, so a state
  # planned replicated is far from one sharded four ways.
  model = _models.decoder(PLAN.SIZES["tiny"], scanned=True, remat=True)
  return (mesh, model, *PLAN.fsdp_inputs(model, mesh))


@needs_tpu
@pytest.mark.targets
def test_the_report_on_an_fsdp_mesh_is_the_peak_of_the_users_step_with_state_sharded(decoder):
  mesh, model, params, batch = decoder
  tx = optax.adamw(1e-3)
  report = optfuse.memory_report(model.loss, tx, params, *batch, target=mesh)
  sharded = PLAN.hand_lowered_optax_peak(model.loss, tx, params, batch, mesh, True)
  replicated = PLAN.hand_lowered_optax_peak(model.loss, tx, params, batch, mesh, False)
  # The same program compiled by the same compiler: equal, not merely close.
  assert report["off"]["peak_bytes"] == sharded
  assert replicated > 2 * sharded  # what planning the state replicated used to report
  assert report["backward"]["peak_bytes"] <= report["off"]["peak_bytes"]


@pytest.mark.slow
@needs_tpu
@pytest.mark.targets
def test_max_batch_size_on_an_fsdp_mesh_searches_the_step_with_state_sharded(decoder):
  mesh, model, params, batch = decoder
  tx = optax.adamw(1e-3)
  # Unplaced: each batch is split over the devices where its size divides (``_inputs.batch_on``).
  args_for = lambda b: tuple(jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype) for x in batch)
  report = optfuse.memory_report(model.loss, tx, params, *args_for(8), target=mesh)
  # The budget is the peak at batch 8, which fits it exactly; batch 12 does not.
  fit = optfuse.max_batch_size(model.loss, tx, params, args_for, report["off"]["peak_bytes"],
                               target=mesh, modes=("off",), progress=False)
  assert fit["off"] == 8 and fit.peaks["off"][8] == report["off"]["peak_bytes"]
  # Only batches that split over the four devices are searched: a data-parallel step.
  assert fit.next_batch("off") == 12 and all(b % 4 == 0 for b in fit.peaks["off"])


@pytest.mark.slow
@needs_tpu
@pytest.mark.targets
def test_offloaded_state_on_an_fsdp_mesh_is_sharded_in_host_memory(decoder):
  mesh, model, params, batch = decoder
  tx = optax.adamw(1e-3)
  fx = optfuse.fuse(tx, mode="backward", offload="state")
  lowered = _memory.lower_step(fx, model.loss, params, batch, target=_registry.resolve(mesh))
  shapes = jax.tree.leaves(lowered.args_info[0][1])
  shardings = jax.tree.leaves(lowered.compile().input_shardings[0][1])
  slots = [(s.shape, sh) for s, sh in zip(shapes, shardings, strict=True) if s.shape]
  assert slots and all(sh.memory_kind == "pinned_host" for _, sh in slots)
  by_shape = {p.shape: p.sharding.spec for p in jax.tree.leaves(params)}
  assert all(sh.spec == by_shape[shape] for shape, sh in slots)
  report = optfuse.memory_report(model.loss, tx, params, *batch, target=mesh, offload="state")
  state_bytes = 2 * 4 * _models._num_params(model.params)
  # Host memory per device is this device's quarter of the state, not the whole state.
  assert report["backward"]["host_bytes"] < 0.5 * state_bytes


# 16 layers of d=512 (ff 2048, vocab 2048, 32 tokens, batch 4): as in the 1.3B decoder, the
# params and state are most of each device's memory and one layer's rows a small part of them,
# at compiles of seconds.
STREAMED = PLAN.SIZES["16x512"]
# Streaming moves the per-device state (and params) out of device memory; what the device still
# holds of them is the rows in flight, one layer's and the leaves outside the loop's. Issue 53
# asks for 80 % of the streamed bytes off the peak, what one chip gets (this decoder: 86 % with
# the state streamed, 89 % with the params too).
SAVED_OF_STREAMED = 0.8


@pytest.fixture(scope="module")
def backward_peaks():
  """``(model, peaks)``: ``peaks(offload, mode="backward")`` is the step's compiled memory per
  device on tpu-v5e:2x2."""
  mesh = optfuse.target_mesh("tpu-v5e:2x2", ("fsdp",))
  model = _models.decoder(STREAMED, scanned=True, remat=True)
  params, batch = PLAN.fsdp_inputs(model, mesh)
  target = _registry.resolve(mesh)

  @functools.cache
  def peaks(offload, mode="backward"):
    fx = optfuse.fuse(optax.adamw(1e-3), mode=mode, offload=offload)
    return _memory.step_memory(fx, model.loss, params, batch, target=target)

  return model, peaks


@needs_tpu
@pytest.mark.targets
def test_streaming_the_state_under_fsdp_takes_most_of_each_devices_state_off_its_peak(
    backward_peaks):
  model, peaks = backward_peaks
  kept, streamed = peaks(None), peaks("state")
  state = 2 * 4 * _models._num_params(model.params) / 4
  # The host bytes are this chip's quarter of AdamW's two slots, read from the compiled program.
  assert streamed["host_bytes"] == pytest.approx(state, rel=1e-3)
  assert kept["peak_bytes"] - streamed["peak_bytes"] >= SAVED_OF_STREAMED * streamed["host_bytes"]
  # Never above optax's step: a stream the compiler holds more for than it frees would be.
  assert streamed["peak_bytes"] <= peaks(None, "off")["peak_bytes"]


@pytest.mark.slow
@needs_tpu
@pytest.mark.targets
def test_streaming_the_params_under_fsdp_takes_most_of_each_devices_params_off_its_peak_too(
    backward_peaks):
  _, peaks = backward_peaks
  kept, state, params = (peaks(o) for o in (None, "state", "params"))
  # The host now holds the loop's param stacks as well as the whole state.
  assert params["host_bytes"] > state["host_bytes"]
  assert kept["peak_bytes"] - params["peak_bytes"] >= SAVED_OF_STREAMED * params["host_bytes"]


@needs_tpu
def test_an_init_that_explicit_sharding_rejects_is_laid_out_by_shape():
  mesh = optfuse.target_mesh("tpu-v5e:2x2", ("fsdp",))
  resolved = _registry.resolve(mesh)
  params = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32,
                                      sharding=NamedSharding(mesh, P("fsdp", None)))}

  def init(p):  # a reshape Explicit sharding cannot type: the fallback lays it out by shape
    return {"mu": jax.tree.map(jnp.zeros_like, p), "flat": p["w"].reshape(4, 32)}

  state = _inputs.state_on(init, params, resolved)
  assert state["mu"]["w"].sharding.spec == P("fsdp", None)
  assert state["flat"].sharding.spec == P()


def _slots_with_params(params, slots) -> list:
  """``(param, slot)`` pairs of a state's per-param slots (a slot: an array or QuantizedSlot)."""
  pairs = []
  jax.tree.map(lambda p, s: pairs.append((p, s)), params, slots)
  return pairs


@needs_tpu
@pytest.mark.targets
def test_low_bit_codes_and_scales_on_an_fsdp_mesh_are_sharded_like_their_params(decoder):
  mesh, _, params, _ = decoder
  block = 256
  tx = optfuse.low_bit(optax.adamw(1e-3), bits=8, block_size=block)
  adam = _inputs.state_on(tx.init, params, _registry.resolve(mesh))[0]
  quantized = [(p, s) for slots in (adam.mu, adam.nu) for p, s in _slots_with_params(params, slots)
               if isinstance(s, optfuse.QuantizedSlot)]
  assert quantized  # the decoder's matrices are quantized, its small leaves stay float32
  crossing = 0
  for p, slot in quantized:
    # Blocks run along a row's last axis: codes and scales keep every other axis's sharding,
    # and the last axis's where each shard holds whole blocks; where a block would cross two
    # shards, that axis is gathered (as XLA must to quantize the block).
    spec = (*p.sharding.spec, *(None,) * (len(p.shape) - len(p.sharding.spec)))
    whole = spec[-1] is None or p.shape[-1] % (mesh.size * block) == 0
    crossing += not whole
    want = P(*spec) if whole else P(*spec[:-1], None)
    assert slot.codes.sharding.spec == want, p.shape
    assert slot.scales.sharding.spec == want, p.shape
  assert 0 < crossing < len(quantized)  # the tiny decoder's 768-wide qkv crosses, others do not


@pytest.mark.slow
@needs_tpu
@pytest.mark.targets
def test_an_8_bit_state_on_an_fsdp_mesh_is_planned_sharded_not_replicated(decoder):
  mesh, model, params, batch = decoder
  tx = optax.adamw(1e-3)
  f32 = optfuse.memory_report(model.loss, tx, params, *batch, target=mesh)
  low = optfuse.memory_report(model.loss, tx, params, *batch, target=mesh, state_bits=8)
  params_per_device = 4 * _models._num_params(model.params) / mesh.size
  f32_state = f32["backward"]["argument_bytes"] - params_per_device
  low_state = low["backward"]["argument_bytes"] - params_per_device
  # mu and nu, each sharded like its param (the few leaves no chip count divides replicated)
  assert f32_state == pytest.approx(2 * params_per_device, rel=0.01)
  # A quarter of the bytes, and the codes of the 768-wide leaves (whose blocks would cross
  # shards) whole on every chip: under half. Planned replicated, the 8-bit state on each of
  # the four chips would be as large as f32's sharded one.
  assert low_state < 0.5 * f32_state


@needs_tpu
@pytest.mark.targets
@pytest.mark.parametrize("bits", [8, 4])
def test_low_bit_state_laid_out_for_an_fsdp_mesh_is_updated_row_by_row_in_the_loop(decoder, bits):
  """Under ``AxisType.Explicit`` the low-bit reshapes and lookups name their shardings (JAX
  inserts ``reshard`` equations): each has a row rule, so the stacked leaves still update
  inside the backward loop, not whole after it."""
  mesh, model, params, batch = decoder
  tx = optfuse.low_bit(optax.adamw(1e-3), bits=bits)
  with jax.set_mesh(mesh), optfuse.compiling_for(mesh):
    placements = optfuse.describe(tx, model.loss, params, *batch)
  stacked = [path for path in placements if path.startswith("['layers']")]
  assert stacked and all(placements[path] == "loop" for path in stacked), placements.reasons


# The 1.3B decoder's MLP layers without attention, at a quarter of its width, ff, vocab and T:
# each chip's temporaries far above the TPU v5e's 128 MiB of VMEM, where a smaller decoder's
# (the 16 x d512 above, at 32 tokens) live whole, so that optax's stacked gradient is in HBM.
PROMISED = PLAN.SIZES["24x512-mlp"]


@pytest.mark.slow  # nine compiles of the step for the TPU: about 10 minutes on two cores
@needs_tpu
@pytest.mark.targets
@pytest.mark.parametrize("per_chip", [1, 2, 4])
def test_under_fsdp_backward_and_streamed_state_keep_their_promises_at_each_batch(per_chip):
  """Backward fusion's peak is at least one per-device stacked gradient below optax's; the
  state streamed takes at least ``SAVED_OF_STREAMED`` of the per-device stacked state off
  backward's peak, and is never above optax's."""
  mesh = optfuse.target_mesh("tpu-v5e:2x2", ("fsdp",))
  model = _models.decoder(PROMISED._replace(batch=per_chip * mesh.size), scanned=True,
                          remat=True)
  params, batch = PLAN.fsdp_inputs(model, mesh)
  target = _registry.resolve(mesh)
  peak = lambda mode, offload=None: _memory.step_memory(
      optfuse.fuse(optax.adamw(1e-3), mode=mode, offload=offload), model.loss, params, batch,
      target=target)["peak_bytes"]
  optax_peak, backward, streamed = peak("off"), peak("backward"), peak("backward", "state")
  stacked_grad = _models.grad_bytes(model.params["layers"]) / mesh.size
  assert optax_peak - backward >= stacked_grad
  assert backward - streamed >= SAVED_OF_STREAMED * 2 * stacked_grad
  assert streamed <= optax_peak
