"""Every example runs end to end in a tiny configuration, so none of them can rot.

The examples live in ``examples/`` (not a package); each is loaded from its file and its
``run`` function called with a few steps of a tiny model, writing into a temporary directory.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from tests import criteria

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"examples.{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses (Flax structs) look their module up there
  spec.loader.exec_module(module)
  return module


def test_linen_digits_cnn_trains_optax_and_optfuse_alike(tmp_path):
  example = _load("linen_digits_cnn")
  out = example.run(steps=4, width=2, batch_size=8, eval_every=2, out_dir=tmp_path,
                    progress=False)
  assert out["plot"].exists()
  assert list(out["runs"]) == ["optax", "optfuse (backward)"]
  for run in out["runs"].values():
    assert run["losses"].shape == (4,) and run["accuracy"].shape == (2,)
  assert max(out["max_loss_diff"], out["max_param_diff"]) < criteria.EXAMPLE_DIFF
  assert out["max_accuracy_diff"] == 0.0


def test_nnx_transformer_lm_reports_every_variant(tmp_path):
  example = _load("nnx_transformer_lm")
  out = example.run(steps=3, dim=16, heads=2, layers=2, seq_len=16, batch_size=2,
                    corpus_mb=0.05, timing_rounds=2, out_dir=tmp_path, progress=False)
  assert out["plot"].exists()
  assert out["corpus"][0] == 50_000 and out["corpus"][1] > 0
  assert {"optax", "backward"} <= set(out["runs"])
  assert set(out["runs"]) | set(out["unavailable"]) == set(example.VARIANTS)
  ref = out["runs"]["optax"]
  for run in out["runs"].values():
    np.testing.assert_allclose(run["losses"], ref["losses"], rtol=criteria.EXAMPLE_DIFF)
    np.testing.assert_allclose(run["val_loss"], ref["val_loss"], rtol=criteria.EXAMPLE_DIFF)
    assert run["step_ms"] > 0 and run["peak_bytes"] >= run["temp_bytes"] > 0


def test_port_train_step_is_a_two_line_change_that_trains_alike():
  example = _load("port_train_step")
  out = example.run(steps=3, batch_size=8, progress=False)
  assert set(out) == {"Linen", "NNX"}
  for port in out.values():
    added = [line for line in port["diff"] if line.startswith("+")]
    removed = [line for line in port["diff"] if line.startswith("-")]
    assert 1 <= len(added) <= 2 and len(removed) <= 3
    assert port["max_param_diff"] < criteria.EXAMPLE_DIFF


def test_offload_state_trains_like_optax_with_the_state_in_host_memory():
  example = _load("offload_state")
  assert example.train_check(steps=3) < criteria.EXAMPLE_DIFF


@pytest.mark.slow  # TPU and GPU compiles, which the tests' compilation cache cannot serve
def test_low_bit_memory_transfer_bytes_drop_with_the_state_bits_and_the_clip_table_is_complete():
  example = _load("low_bit_memory")
  rows = [example.measure("tiny", "cpu", "backward + offload", bits, example.HIDE_STEPS)
          for bits in example.BITS]
  table = example.hide_markdown(rows)
  per_param = {w: float(line.split("|")[3].split()[0]) for line in table.splitlines()
               for w in ("f32", "8-bit", "4-bit") if line.startswith(f"| {w} |")}
  # AdamW's two float32 slots, each way: 8 bytes a parameter; 8 bits are a quarter plus the
  # blocks' scales, 4 bits an eighth plus theirs (leaves under 4096 elements stay float32).
  assert per_param["f32"] == 8.0
  assert 3 < 8 / per_param["8-bit"] <= 4 and 6 < 8 / per_param["4-bit"] <= 8
  assert table.count("TFLOP/s") == len(example.GPUS)
  clip = [example.measure("tiny", "cpu", step, 8, example.CLIP_STEPS)
          for step in example.CLIP_STEPS]
  assert all("peak_bytes" in r for r in clip), clip
  assert clip[-1]["host_bytes"] == 0 < clip[-1]["host_transfer_bytes"]  # XLA:CPU: host is device


# With ``-m slow``: ``tests/fusion/test_penzai.py`` trains the same model against optax by default.
@pytest.mark.slow
def test_penzai_layer_stack_trains_like_optax_with_and_without_the_guard():
  pytest.importorskip("penzai")
  example = _load("penzai_layer_stack")
  assert all(diff < criteria.EXAMPLE_DIFF for diff in example.train_check(steps=3).values())


# With ``-m slow`` (about a minute of compiles): ``tests/low_bit/test_low_bit*.py`` check the
# transformation itself by default.
@pytest.mark.slow
def test_low_bit_quality_study_reports_every_variant_and_writes_its_plot(tmp_path):
  example = _load("low_bit_quality")
  out = example.run(quick=True, plot_path=tmp_path / "quality.png")
  assert [r["variant"] for r in out["table"]] == ["f32", "8-bit", "4-bit"]
  assert all(np.isfinite(r["mean"]) for r in out["table"])
  errors = {(e["bits"], e["block_size"]): e for e in out["errors"]}
  for block in example.BLOCK_SIZES:
    # 8-bit codes resolve a slot about ten times finer than 4-bit ones.
    assert errors[8, block]["mu"] < errors[4, block]["mu"] / 5
    assert errors[8, block]["nu"] < errors[4, block]["nu"] / 5
  trained = out["bytes"]["trained (CONFIG)"]
  assert trained["8-bit"] < 0.27 * trained["f32"] and trained["4-bit"] < 0.14 * trained["f32"]
  assert (tmp_path / "quality.png").stat().st_size > 0
  assert "| 8-bit |" in example.markdown(out)


@pytest.mark.slow
def test_low_bit_quality_study_of_muon_reports_its_variants_and_its_state_bytes(tmp_path):
  example = _load("low_bit_quality")
  out = example.run(quick=True, plot_path=tmp_path / "muon.png", name="muon",
                    variants=("f32", "8-bit"))
  assert [r["variant"] for r in out["table"]] == ["f32", "8-bit"]
  assert all(np.isfinite(r["mean"]) for r in out["table"]) and out["errors"] == []
  trained = out["bytes"]["trained (CONFIG)"]  # Muon's one slot: a quarter, then an eighth
  assert trained["8-bit"] < 0.27 * trained["f32"] and trained["4-bit"] < 0.14 * trained["f32"]
  assert (tmp_path / "muon.png").stat().st_size > 0
  assert "| Muon state f32 |" in example.markdown(out)
  with pytest.raises(ValueError, match="'f32' first"):
    example.run(quick=True, plot_path=None, name="muon", variants=("8-bit",))


def test_muon_memory_puts_the_stacked_matrices_in_the_loop_and_times_both_steps():
  from optfuse.bench import _models
  example = _load("muon_memory")
  config = _models.DecoderConfig(layers=4, dim=64, heads=4, ff=256, vocab=256, seq=32, batch=2)
  model = _models.decoder(config, scanned=True, remat=True)
  example.check_placement(model)
  rows = [example.measure(model, "muon", step, None) for step in example.STEPS]
  assert all("peak_bytes" in r for r in rows), rows
  assert rows[1]["peak_bytes"] < rows[0]["peak_bytes"]
  assert rows[2]["host_bytes"] == 0 < rows[2]["host_transfer_bytes"]  # XLA:CPU: host is device
  table = example.markdown(rows, *example.stacked_bytes(model.params), {"muon": "f32"})
  assert table.count("| muon |") == len(example.STEPS)
  # --state-bits 8: Muon's momentum in 8 bits, still in the loop, a quarter of the state's bytes
  # for the stacked matrices.
  example.check_placement(model, state_bits=8)
  low = example.measure(model, "muon", "backward", None, state_bits=8)
  assert low["peak_bytes"] < rows[1]["peak_bytes"], (low, rows[1])
  params = _models.abstract(model.params)
  assert example.state_bytes("muon", params, 8) < example.state_bytes("muon", params, 32) / 3
  seconds = example.time_steps(rounds=1, steps_per_round=1, config=config)
  assert all(len(s) == 1 and s[0] > 0 for s in seconds.values())


def test_optimizer_memory_fuses_whole_leaf_statistics_in_two_passes_only():
  from optfuse.bench import _models
  example = _load("optimizer_memory")
  config = _models.DecoderConfig(layers=4, dim=64, heads=4, ff=128, vocab=64, seq=16, batch=2)
  model = _models.decoder(config, scanned=True, remat=True)
  rows = {name: example.measure(model, name, min_dim_size_to_factor=32)
          for name in ("adafactor (factoring only)", "adafactor (defaults)", "sm3")}
  factored, defaults, sm3 = rows.values()
  assert factored["backward in loop"] == factored["two-pass in loop"] == (6, 6), factored
  assert factored["backward"] < factored["optax"]
  # A block RMS and SM3's maxima over the layers: after the loop in one pass, in it in two.
  for row in (defaults, sm3):
    assert row["backward in loop"] == (0, 6) and row["two-pass in loop"] == (6, 6), row
    assert not row["two-pass reasons"]
  assert example.markdown(list(rows.values())).count("| cpu |") == 3
  timed = example.time_optimizer(model, "sm3", rounds=1, min_run_s=0.0)
  assert set(timed["ratio"]) == {"optax", "backward", "two-pass"}
  assert timed["ratio"]["two-pass"][0] > 0 and timed["optax_ms"] > 0
  assert "| sm3 |" in example.time_markdown(model, [timed], 1)


def test_offload_params_trains_like_optax_with_the_params_in_host_memory():
  example = _load("offload_params")
  assert example.train_check(steps=3) < criteria.EXAMPLE_DIFF


@pytest.mark.slow  # a dozen compiles for the TPU compiler and a training run: about 2 minutes
@pytest.mark.targets
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='the TPU compiler is not installed: pip install -e ".[tpu]"')
def test_offload_auto_plans_for_the_tpu_compiler_and_trains_like_optax_here():
  example = _load("offload_auto")
  diff, plan = example.train_check(steps=3)
  assert diff < criteria.EXAMPLE_DIFF
  assert plan.device_peak_bytes <= plan.budget_bytes
  assert set(plan.streams.values()) != {"none"}  # the budget is below the step's own peak
