"""``host_transfer_bytes``: the bytes a step moves between host and device memory, counted in
the step's own trace and checked against the host copies of the programs the TPU and GPU
compilers build from it.

A scanned model of ``L`` layers streams, per step: the slots of a tapped leaf (outside the
loops) whole, to the device and back; each slot row of a loop stack once to the device (plus the
row the loop prefetches past the last iteration, on a compiler that prefetches) and once back;
with ``offload="params"`` each param row twice to the device (the forward iteration, the
backward one) and once back. XLA:CPU lowers a move between memory spaces to nothing (its host
memory is its device memory), so on the CPU the count is the traced one, and the compilers that
move bytes are checked compile-only.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._analysis import _memory, _transfers
from optfuse._targets import _registry
from tests import models

LAYERS, DIM = 6, 16
PARAMS = models.abstract_stacked_params(LAYERS, DIM)
TOKENS = jax.ShapeDtypeStruct((models.BATCH, models.SEQ), jnp.int32)
BATCH = (TOKENS, TOKENS)
ADAM = optax.adam(1e-3)  # two float32 slots a leaf

ROW = (DIM * DIM + DIM) * 4  # one layer of the stacks: w and b
TAPPED = 2 * models.VOCAB * DIM * 4  # the embedding and the head, outside the loops

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')
needs_gpu = pytest.mark.skipif(not _registry.compiler_installed("cuda"),
                               reason="the GPU compiler is not installed")


def _report(offload: str, target=None):
  return optfuse.memory_report(models.scanned_loss, ADAM, PARAMS, *BATCH, offload=offload,
                               target=target)


def test_state_streams_each_slot_row_once_each_way_and_a_tapped_leafs_slots_whole():
  report = _report("state")
  # On this machine the loops prefetch the next slot rows (as on a TPU): one row past the
  # last iteration is read, and never written.
  slot_rows = 2 * ((LAYERS + 1) * ROW + LAYERS * ROW)
  assert report["backward"]["host_transfer_bytes"] == 2 * 2 * TAPPED + slot_rows
  # Mode "off" fetches every slot whole and writes it back.
  assert report["off"]["host_transfer_bytes"] == 2 * 2 * (TAPPED + LAYERS * ROW)


def test_params_stream_each_param_row_twice_to_the_device_and_once_back():
  report = _report("params")
  state = _report("state")
  # The forward loop reads each row; the backward loop reads it again (prefetched, one past the
  # last), and writes the new row back.
  params_rows = LAYERS * ROW + (LAYERS + 1) * ROW + LAYERS * ROW
  assert (report["backward"]["host_transfer_bytes"]
          == state["backward"]["host_transfer_bytes"] + params_rows)


@pytest.mark.parametrize("mode,offload", [("backward", "state"), ("backward", "params"),
                                          ("forward", "state"), ("forward", "params")])
@pytest.mark.parametrize("k", [2, 3])
def test_with_microbatches_a_sum_in_host_memory_is_written_once_a_microbatch(mode, offload, k):
  # The bytes written to host memory: each microbatch writes each row of a sum that lives there
  # once (backward mode: the loop stacks' sums with the params streamed; forward mode: the
  # pending gradient, every leaf's); the update writes both slots of every leaf and, with the
  # params streamed, each new param row. Nothing is written to zero a sum first: it starts in a
  # buffer the first microbatch writes over (``_accumulate.accumulator``), where zeros written a
  # row at a time crossed the link once more.
  tokens = jax.ShapeDtypeStruct((models.BATCH * k, models.SEQ), jnp.int32)
  fx = optfuse.fuse(ADAM, mode=mode, offload=offload)
  traced = _memory.trace_step(fx, models.scanned_loss, PARAMS, (tokens, tokens), microbatches=k)
  stacks = LAYERS * ROW
  sums = (stacks if offload == "params" else 0) if mode == "backward" else stacks + TAPPED
  update = 2 * (TAPPED + stacks) + (stacks if offload == "params" else 0)
  assert _transfers.traced_transfer_bytes(traced.jaxpr).to_host == k * sums + update


def test_describe_counts_what_memory_report_counts():
  for mode in ("backward", "forward"):
    fx = optfuse.fuse(ADAM, mode=mode, offload="params")
    described = optfuse.describe(fx, models.scanned_loss, PARAMS, *BATCH)
    assert described.host_transfer_bytes == _report("params")[mode]["host_transfer_bytes"]
    assert "host transfers a step" in described.table()
  assert optfuse.describe(ADAM, models.scanned_loss, PARAMS, *BATCH).host_transfer_bytes is None


def test_xla_cpu_compiles_no_host_copy_so_its_count_is_the_traced_one():
  fx = optfuse.fuse(ADAM, offload="params")
  compiled = _memory.lower_step(fx, models.scanned_loss, PARAMS, BATCH).compile()
  assert _transfers.compiled_transfer_bytes(compiled.as_text()) == (0, 0)


def _planned_and_compiled(mode: str, offload: str, target: str, microbatches: int | None = None,
                          params=PARAMS):
  fx = optfuse.fuse(ADAM, mode=mode, offload=offload)
  resolved = _registry.resolve(target)
  tokens = jax.ShapeDtypeStruct((models.BATCH * (microbatches or 1), models.SEQ), jnp.int32)
  traced = _memory.trace_step(fx, models.scanned_loss, params, (tokens, tokens),
                              target=resolved, microbatches=microbatches)
  with _memory.on_target(resolved):
    compiled = traced.lower().compile()
  return (_transfers.traced_transfer_bytes(traced.jaxpr),
          _transfers.compiled_transfer_bytes(compiled.as_text()))


CASES = [(mode, offload) for mode in ("off", "backward", "forward")
         for offload in ("state", "params") if (mode, offload) != ("off", "params")]


@pytest.mark.targets
@needs_tpu
@pytest.mark.parametrize("mode,offload", CASES)
def test_the_tpu_compilers_host_copies_move_the_counted_bytes(mode, offload):
  planned, compiled = _planned_and_compiled(mode, offload, "tpu-v5e")
  assert planned.to_device > 0 and planned.to_host > 0
  assert compiled == planned


@pytest.mark.targets
@needs_gpu
@pytest.mark.parametrize("mode,offload", [("backward", "params"), ("forward", "state")])
def test_the_gpu_compilers_host_copies_move_the_counted_bytes(mode, offload):
  planned, compiled = _planned_and_compiled(mode, offload, "h100")
  assert planned.to_device > 0 and compiled == planned


MICROBATCH_CASES = [("backward", "params"), ("forward", "state"), ("forward", "params")]


@pytest.mark.targets
@needs_gpu
@pytest.mark.parametrize("mode,offload", MICROBATCH_CASES)
def test_with_microbatches_the_gpu_compilers_host_copies_move_the_counted_bytes(mode, offload):
  # The sums in host memory start in buffers the first microbatch writes over: the compiler
  # adds no copy to make them.
  planned, compiled = _planned_and_compiled(mode, offload, "h100", microbatches=2)
  assert planned.to_host > 0 and compiled == planned


@pytest.mark.targets
@needs_tpu
@pytest.mark.parametrize("mode,offload", MICROBATCH_CASES)
def test_with_microbatches_the_tpu_compilers_host_copies_move_the_counted_bytes(mode, offload):
  # On leaves whose every dimension fills the TPU's 128-wide tiles. In forward mode, narrower
  # leaves outside the loops (the 32x16 embedding of PARAMS) are relaid out through the device
  # by host copies no trace holds: 4096 bytes to the host with the state streamed at d=16,
  # 49,152 each way at d=128 with 32 tokens, none at 256 tokens (docs/offload.md).
  params = models.abstract_stacked_params(LAYERS, 128, vocab=256)
  planned, compiled = _planned_and_compiled(mode, offload, "tpu-v5e", microbatches=2,
                                            params=params)
  assert planned.to_host > 0 and compiled == planned


def test_a_host_copy_in_a_while_loop_of_unknown_trip_count_is_refused():
  hlo = """HloModule m

%body (p: (s32[], f32[4]{0:S(5)})) -> (s32[], f32[4]{0:S(5)}) {
  %p = (s32[], f32[4]{0:S(5)}) parameter(0)
  %h = f32[4]{0:S(5)} get-tuple-element(%p), index=1
  %d = f32[4]{0} copy(%h)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4]{0:S(5)}) tuple(%i, %h)
}

%cond (p: (s32[], f32[4]{0:S(5)})) -> pred[] {
  %p = (s32[], f32[4]{0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] parameter(1)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0:S(5)} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0:S(5)}) tuple(%z, %a)
  %w = (s32[], f32[4]{0:S(5)}) while(%t), condition=%cond, body=%body
  ROOT %r = f32[4]{0:S(5)} get-tuple-element(%w), index=1
}
"""
  with pytest.raises(ValueError, match="trip count"):
    _transfers.compiled_transfer_bytes(hlo)
  counted = hlo.replace("%n = s32[] parameter(1)", "%n = s32[] constant(3)")
  assert _transfers.compiled_transfer_bytes(counted) == (3 * 16, 0)
