"""The slice planner's choices that need no compiler: the FSDP axis of a leaf and the refusals.

The planner's answers on TPU slices come from compiles of minutes for the bench's decoders;
docs/targets.md has their tables and commands.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._analysis import _fit
from optfuse._targets import _registry

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason="the TPU compiler (libtpu) is not installed")


def test_fsdp_shards_the_largest_axis_the_chips_divide_and_never_a_stacked_layer_axis():
  assert optfuse.fsdp_axis((32000, 2048), 4) == 0
  assert optfuse.fsdp_axis((24, 2048, 8192), 4) == 2
  assert optfuse.fsdp_axis((24, 2048), 8) == 1
  assert optfuse.fsdp_axis((2048, 2048), 4) == 0  # the first of equal axes, as bench._fsdp
  assert optfuse.fsdp_axis((64, 8), 8, stacked=True) == 1
  assert optfuse.fsdp_axis((3, 5), 4) is None


def _plan(**kwargs):
  loss = lambda p, x: jnp.mean(x * p["w"])
  return optfuse.smallest_slices(loss, optax.sgd(0.1), {"w": jnp.ones(())},
                                 lambda b: (jnp.ones((b,)),), **kwargs)


def test_unknown_layouts_steps_and_targets_are_refused_by_name():
  with pytest.raises(optfuse.TargetError, match=r"unknown layouts \['zero3'\]"):
    _plan(targets=("tpu-v5e",), layouts=("zero3",))
  with pytest.raises(optfuse.UnknownModeError, match=r"unknown steps \['forward'\]"):
    _plan(targets=("tpu-v5e",), steps=("forward",))
  with pytest.raises(optfuse.TargetError, match="unknown compile target 'tpu-v9'"):
    _plan(targets=("tpu-v9",))
  with pytest.raises(optfuse.TargetError, match="names of optfuse.targets"):
    _plan(targets=(object(),))
  with pytest.raises(optfuse.LowBitError):
    _plan(targets=("tpu-v5e",), state_bits=3)
  with pytest.raises(optfuse.BudgetError, match="max_batch_per_chip must be a positive int"):
    _plan(targets=("tpu-v5e",), max_batch_per_chip=0)


@needs_tpu
@pytest.mark.targets
def test_a_model_far_smaller_than_the_chip_answers_the_cap_on_one_chip_in_three_compiles():
  params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
  loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
  report = optfuse.smallest_slices(
      loss, optax.adamw(1e-3), params, lambda b: (jax.ShapeDtypeStruct((b, 512), jnp.float32),),
      ("tpu-v5e", "tpu-v5e:2x2"), layouts=("fsdp",), steps=("backward",), max_batch_per_chip=64,
      progress=False)
  (row,) = report
  assert (row.target, row.chips, row.batch_per_chip, row.capped) == ("tpu-v5e", 1, 64, True)
  assert report.compiles == 3 and "64 (the cap)" in str(report)


def test_every_step_is_searched_with_the_options_given_in_its_own_mode_and_offload(monkeypatch):
  searched = {}

  def max_batch_size(loss_fn, tx, params, args_for, budget_bytes, *, modes, options, **kwargs):
    (mode,) = modes
    searched[(mode, options.offload)] = options.for_mode(mode)
    return _fit.FitReport({mode: 4}, {mode: {4: 100}}, {}, 1000)

  monkeypatch.setattr(_fit, "max_batch_size", max_batch_size)
  guarded = optfuse.FuseOptions(guard=True)
  _plan(targets=("tpu-v5e",), layouts=("data",), options=guarded)
  assert searched == {("off", None): optfuse.FuseOptions("off"),
                      ("backward", None): guarded,
                      ("backward", "state"): optfuse.FuseOptions(offload="state", guard=True)}
  # Two-pass runs without offload, as fuse says: that step is unavailable, with fuse's error.
  report = _plan(targets=("tpu-v5e",), layouts=("data",),
                 options=optfuse.FuseOptions(global_ops="two_pass"))
  offloaded = next(row for row in report if row.step == "backward + offload")
  assert offloaded.unavailable.startswith("OffloadError: offload=\"state\" runs")
  with pytest.raises(optfuse.OptionsError, match="must be an optfuse.FuseOptions"):
    _plan(targets=("tpu-v5e",), options={"mode": "backward"})
