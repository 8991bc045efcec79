"""``python -m optfuse.bench``: the smoke suite writes every output, with honest, complete rows;
``--fit`` prints the largest batch per mode."""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import pytest

from optfuse._analysis import _memory
from optfuse._targets import _compiled, _registry
from optfuse.bench import __main__ as bench_main
from optfuse.bench import _fit_table as bench_fit
from optfuse.bench import _fsdp, _host_fits, _models, _suite

REQUIRED = ("model", "optimizer", "mode", "time_ratio", "peak_bytes", "jax_version", "backend",
            "device_kind")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    code = bench_main.main(["--smoke", "--out", str(out), "--no-progress"])
  return code, out, stdout.getvalue()


def test_smoke_run_succeeds_and_writes_json_markdown_and_png(smoke_run):
  code, out, _ = smoke_run
  assert code == 0
  assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out / "results.md").read_text().startswith("## optfuse.bench `smoke`")


def test_results_json_is_a_list_of_rows_with_the_required_fields(smoke_run):
  _, out, _ = smoke_run
  rows = json.loads((out / "results.json").read_text())
  assert isinstance(rows, list) and rows
  for row in rows:
    assert set(REQUIRED) <= set(row), row
    assert not row.get("failed"), row
  suite = _suite.smoke_suite()
  expected = {(c.model.name, c.optimizer, mode)
              for c in suite.cells for mode in _suite.modes_for(c.optimizer)}
  expected |= {(m.name, "adamw", mode)
               for m in suite.large for mode in ("off", "backward", "forward")}
  assert {(r["model"], r["optimizer"], r["mode"]) for r in rows} == expected


def test_every_row_is_measured_or_says_why_not(smoke_run):
  _, out, _ = smoke_run
  for row in json.loads((out / "results.json").read_text()):
    if row.get("unavailable"):
      assert row["peak_bytes"] is None and row["time_ratio"] is None
      continue
    assert row["peak_bytes"] == (row["argument_bytes"] + row["temp_bytes"] + row["output_bytes"]
                                 - row["alias_bytes"])
    if row["section"] == "timing":
      assert row["time_ratio"] > 0 and row["step_ms"] > 0 and row["compile_s"] > 0
      if row["mode"] == "off":
        assert row["peak_ratio"] == 1.0 and row["compile_ratio"] == 1.0
    else:
      assert row["time_ratio"] is None
    assert 0 < row["floor_bytes"] <= row["peak_bytes"] / row["peak_ratio"]


def test_every_mode_trains_to_the_same_loss_as_optax(smoke_run):
  _, out, _ = smoke_run
  rows = [r for r in json.loads((out / "results.json").read_text()) if "final_loss" in r]
  for row in rows:
    off = next(r for r in rows if r["model"] == row["model"] and r["optimizer"] == row["optimizer"]
               and r["mode"] == "off")
    # Same params, batch and number of steps (a few dozen); float32 with different fusion order.
    assert row["final_loss"] == pytest.approx(off["final_loss"], rel=1e-4), row["mode"]


def test_the_markdown_table_is_printed_at_the_end(smoke_run):
  _, out, printed = smoke_run
  assert (out / "results.md").read_text().strip() in printed
  assert "| model | optimizer | mode | step |" in printed


def test_floor_of_a_scanned_model_keeps_one_layer_of_gradient():
  model = _models.scan_mlp(depth=4, width=8, inputs=2, classes=3, batch=1)
  layers = _models.grad_bytes(model.params["layers"])
  outside = _models.grad_bytes(model.params) - layers
  off = {"peak_bytes": 10_000, "argument_bytes": 100, "output_bytes": 100, "alias_bytes": 100}
  floor = _suite.floor_bytes(model, model.params, off)
  assert floor == 10_000 - _models.grad_bytes(model.params) + outside + layers // 4


@pytest.fixture(scope="module")
def fsdp_tiny_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("fsdp")
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    code = bench_main.main(["--fsdp", "--fsdp-size", "tiny", "--out", str(out), "--no-progress"])
  return code, json.loads((out / "fsdp.json").read_text()), stdout.getvalue()


def test_fsdp_run_prints_a_row_per_mode_from_eight_devices(fsdp_tiny_run):
  code, rows, printed = fsdp_tiny_run
  assert code == 0, printed
  assert [r["mode"] for r in rows] == list(_fsdp.MODES)
  assert all(r["device_count"] == 8 and not r.get("failed") for r in rows), rows
  assert "| model | mode | peak / device |" in printed
  for mode in _fsdp.MODES:
    assert f"| decoder_tiny | {mode} |" in printed


def test_fsdp_backward_fusion_needs_no_more_memory_per_device_than_optax(fsdp_tiny_run):
  _, rows, _ = fsdp_tiny_run
  peak = {r["mode"]: r["peak_bytes"] for r in rows}
  assert peak["backward"] <= peak["off"]


def test_fsdp_fuses_every_stacked_leaf_without_new_collectives(fsdp_tiny_run):
  # Backward fusion updates every stacked leaf in its loop; forward fusion's AdamW update is
  # in place whole, before the loss, while the backward loop writes the gradient rows.
  _, rows, _ = fsdp_tiny_run
  off, *fused = rows
  for row in fused:
    where = "leaf" if row["mode"] == "forward" else "loop"
    assert row["stacked_placements"] == {where: row["stacked_leaves"]} and row[
        "stacked_leaves"] == 6, row["mode"]
    assert row["extra_all_gathers"] == [], row["mode"]
    assert row["collectives"] == off["collectives"], row["mode"]


def _run_fit(budget, out):
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    code = bench_main.main(["--fit", budget, "--fit-models", "decoder_tiny", "--out", str(out),
                            "--no-progress"])
  return code, json.loads((out / "fit.json").read_text()), stdout.getvalue()


# With ``-m slow``: ``tests/analysis/test_fit.py`` checks the search by default, this its command
# line.
@pytest.mark.slow
def test_fit_prints_the_largest_batch_per_mode_and_the_tokens_it_allows(tmp_path):
  # Under every mode's peak at batch 1: nothing fits, and each mode compiles once.
  code, rows, printed = _run_fit("1kB", tmp_path / "none")
  assert code == 0 and [r["mode"] for r in rows] == ["off", "backward", "forward"]
  assert all(r["max_batch"] == 0 and r["next_batch"] == 1 and r["compiles"] == 1 for r in rows)
  # optax's peak at batch 1 as the budget: optax fits exactly one sequence.
  budget = rows[0]["next_peak_bytes"]
  code, rows, printed = _run_fit(f"{budget} B", tmp_path / "one")
  assert code == 0
  assert (tmp_path / "one" / "fit.md").read_text().strip() in printed
  assert f"fits {_compiled.format_bytes(budget)} ({budget} bytes)" in printed
  seq = bench_fit.TINY_DECODER.seq
  for row in rows:
    assert not row.get("failed") and row["budget_bytes"] == budget, row
    assert row["tokens_per_step"] == row["max_batch"] * seq
    assert row["peak_bytes"] is None or row["peak_bytes"] <= budget < row["next_peak_bytes"]
    line = f"| decoder_tiny | {row['mode']} | {row['max_batch']} | "
    assert line in printed, line
  assert rows[0]["max_batch"] == 1 and rows[0]["batch_ratio"] == 1.0
  assert rows[1]["max_batch"] >= 1  # backward fusion's peak is below optax's


def test_the_fit_batch_is_the_leading_axis_of_every_batch_leaf():
  model = bench_fit.fit_models()["decoder_tiny"].model
  args = bench_fit.batch_args(model, 5)
  assert [a.shape for a in args] == [(5, bench_fit.TINY_DECODER.seq)] * 2
  assert [a.dtype for a in args] == [leaf.dtype for leaf in model.batch]


@pytest.mark.slow
def test_what_fits_finds_the_largest_depth_per_mode_and_reuses_the_cache(tmp_path, monkeypatch):
  from optfuse.bench import _what_fits
  monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path / "cache.json"))
  tiny = bench_fit.TINY_DECODER
  first = _what_fits.run(["cpu"], ("layers",), progress=False, config=tiny, budget=2_000_000)
  by_mode = {r["mode"]: r for r in first}
  for row in first:
    # Exact: the depth fits the budget, one more layer does not.
    assert row["peak_at_max"] <= 2_000_000 < row["next_peak"], row
  # Backward fusion never holds the stacked gradient: it fits at least as many layers.
  assert by_mode["backward"]["max"] >= by_mode["off"]["max"] >= 1
  assert first[0]["new_compiles"] > 0
  again = _what_fits.run(["cpu"], ("layers",), progress=False, config=tiny, budget=2_000_000)
  assert again[0]["new_compiles"] == 0 and [r["max"] for r in again] == [r["max"] for r in first]
  line = _what_fits.lines(first)[0]
  assert f"optax {by_mode['off']['max']} layers" in line and "backward fusion" in line
  # --quick appends these rows to the suite's: the report leads with their lines.
  from optfuse.bench import _report, _suite
  env = {"suite": "quick", "load_average_start": None, "load_average_end": None}
  rows = [{**_suite.environment(), **env, "section": "timing", "model": "m", "description": "",
           "optimizer": "adamw", "mode": "off", "time_ratio": None, "peak_bytes": None},
          *({**r, **env} for r in first)]
  assert line in _report.markdown(rows)


def test_what_fits_reports_offload_beside_each_mode_on_accelerator_targets():
  from optfuse.bench import _what_fits
  assert _what_fits.modes_of("cpu") == _what_fits.MODES  # XLA:CPU counts host memory as device
  row = lambda mode, best: {"target": "tpu-v5e", "target_label": "tpu-v5e", "axis": "layers",
                            "mode": mode, "max": best, "dim": 2048, "seq": 2048,
                            "batch_layers": 24, "params_at_max": "1B", "budget_bytes": 16e9,
                            "budget_source": "test"}
  rows = [row("off", 15), row("backward", 21), row(_what_fits.OFFLOAD, 47)]
  assert "with the state in host memory 47 layers" in _what_fits.lines(rows)[0]
  table = _what_fits.markdown(rows)
  assert "backward + offload: layers" in table and "| 15 | 21 | 47 |" in table


def test_what_fits_with_adafactor_searches_optax_and_two_pass_backward(tmp_path, monkeypatch):
  from optfuse.bench import _what_fits
  monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path / "cache.json"))
  assert _what_fits.modes_of("tpu-v5e", optimizer="adafactor") == (
      "off_adafactor", "backward_adafactor")
  tx, options = _what_fits.optimizer_of("backward_adafactor")
  assert options == {"global_ops": "two_pass"} and _what_fits.optimizer_of("off_adafactor")[1] == {}
  # optax.adafactor's defaults: the state's leaves are Adafactor's, not AdamW's.
  params = {"w": jnp.zeros((4, 256, 256))}
  assert [x.shape for x in jax.tree.leaves(tx.init(params))] == [
      (), (4, 256), (4, 256), (1,)]
  tiny = bench_fit.TINY_DECODER
  rows = _what_fits.run(["cpu"], ("layers",), progress=False, config=tiny, budget=2_000_000,
                        optimizer="adafactor")
  by_mode = {r["mode"]: r for r in rows}
  assert set(by_mode) == {"off_adafactor", "backward_adafactor"}
  for row in rows:
    assert row["peak_at_max"] <= 2_000_000 < row["next_peak"], row
  assert "with Adafactor: optax" in _what_fits.lines(rows)[0]
  assert "two-pass Adafactor: layers" in _what_fits.markdown(rows)


def test_what_fits_with_state_bits_adds_low_bit_state_on_device_and_in_host_memory():
  from optfuse.bench import _what_fits
  assert _what_fits.modes_of("cpu", state_bits=8) == (*_what_fits.MODES, "backward_8bit")
  assert _what_fits.modes_of("tpu-v5e", state_bits=4) == (
      *_what_fits.MODES, _what_fits.OFFLOAD, "backward_4bit", "backward_offload_4bit")
  assert _what_fits.STEPS["backward_offload_8bit"] == ("backward", "state", 8)
  row = lambda mode, best: {"target": "h100", "target_label": "h100", "axis": "layers",
                            "mode": mode, "max": best, "dim": 2048, "seq": 2048,
                            "batch_layers": 24, "params_at_max": "1B", "budget_bytes": 64e9,
                            "budget_source": "test"}
  rows = [row("off", 60), row("backward", 80), row(_what_fits.OFFLOAD, 200),
          row("backward_8bit", 150), row("backward_offload_8bit", 210)]
  line = _what_fits.lines(rows)[0]
  assert "8-bit state 150 layers" in line and "8-bit state in host memory 210 layers" in line
  table = _what_fits.markdown(rows)
  # One column a mode present, in STEPS' order; the 4-bit modes, absent, take none.
  assert "| backward 8-bit: layers | backward + offload 8-bit: layers |" in table
  assert "4-bit" not in table and "| 60 | 80 | 200 | 150 | 210 |" in table


def test_a_fit_that_raises_is_recorded_as_failed_rows_not_raised(monkeypatch):
  def broken(*args, **kwargs):
    raise ValueError("a library bug. More detail here.")

  monkeypatch.setattr(bench_fit.optfuse, "max_batch_size", broken)
  rows = bench_fit.run_fit(["decoder_tiny"], "1GB", progress=False)
  assert [r["mode"] for r in rows] == list(_memory.MODES)
  assert {r["failed"] for r in rows} == {"ValueError: a library bug."}


def _sized_row(mode, peak, budget=16_910_000_000):
  return {"target": "tpu-v5e", "target_label": "TPU v5e", "mode": mode, "peak": peak,
          "fits": peak is not None and peak <= budget, "budget_bytes": budget, "layers": 24,
          "dim": 2048, "seq": 2048, "batch": 1, "params": "1.3B"}


def test_the_main_jobs_accelerator_line_leads_with_the_step_that_fits_then_the_refusals():
  from optfuse.bench import _what_fits
  rows = [_sized_row("off", None), _sized_row("backward", 17_330_000_000),
          _sized_row("backward_offload", 9_130_000_000),
          _sized_row("backward_8bit", 10_180_000_000)]
  line = _what_fits.sized_lines(rows)[0]
  # The smallest peak that fits leads, with the memory it is measured against; then each step
  # that does not fit, in the order compiled.
  assert line == (
      "- **TPU v5e** (16.91 GB per device), the 1.3B-parameter decoder (24 layers of d=2048, "
      "T=2048, batch 1) with AdamW: fits with backward fusion, state in host memory: 9.13 GB of "
      "16.91 GB; optax: does not fit (out of memory); backward fusion: 17.33 GB, does not fit; "
      "backward fusion, 8-bit state: 10.18 GB, fits")
  nothing = _what_fits.sized_lines(rows[:2])[0]
  assert "fits with none of these steps; optax: does not fit" in nothing


def test_the_main_job_compiles_optax_and_the_8_bit_state_step_for_the_accelerators():
  from optfuse.bench import _what_fits
  assert _what_fits.QUICK_MODES == ("off", "backward_8bit")
  assert _what_fits.STEPS["backward_8bit"] == ("backward", None, 8)
  assert _suite.quick_suite().large == ()  # the 1.3B decoder's XLA:CPU peaks are --memory's


@pytest.mark.targets
@pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                    reason='the TPU compiler is not installed: pip install -e ".[tpu]"')
def test_the_main_job_leads_with_the_step_that_fits_each_accelerator_one_compile_a_step(
    tmp_path, monkeypatch):
  from optfuse.bench import _report, _what_fits
  monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path / "cache.json"))
  tiny = bench_fit.TINY_DECODER
  rows = _what_fits.at_size(["cpu", "tpu-v5e"], progress=False, config=tiny)
  # "cpu" is the suite's own rows; the accelerator gets one row (one compile) a step.
  assert [(r["target"], r["mode"]) for r in rows] == [
      ("tpu-v5e", m) for m in _what_fits.QUICK_MODES]
  for row in rows:
    assert 0 < row["peak"] <= row["budget_bytes"] and row["fits"], row
  line = _what_fits.sized_lines(rows)[0]
  smallest = min(rows, key=lambda r: r["peak"])
  assert line.startswith("- **tpu-v5e**") and (
      f"with AdamW: fits with {_what_fits.LABELS[smallest['mode']]}: "
      f"{_compiled.format_bytes(smallest['peak'])} of ") in line
  # The cache answers the next run without compiling.
  again = _what_fits.at_size(["tpu-v5e"], progress=False, config=tiny)
  assert [r["peak"] for r in again] == [r["peak"] for r in rows]
  env = {"suite": "quick", "load_average_start": None, "load_average_end": None}
  timing = {**_suite.environment(), **env, "section": "timing", "model": "m", "description": "",
            "optimizer": "adamw", "mode": "off", "time_ratio": None, "peak_bytes": None}
  text = _report.markdown([timing, *({**r, **env} for r in rows)])
  assert "**On the accelerators**" in text and line in text


# --- offload: the host table, the transfer model, the CPU timing ---------------------------


def test_offload_cost_prints_each_choice_and_chip_with_its_sources(monkeypatch):
  from optfuse.bench import _offload_cost, _report
  monkeypatch.setattr(_offload_cost, "MODELS", {"tiny": bench_fit.TINY_DECODER})
  rows = _offload_cost.run(chips=("tpu-v5e", "h100"))
  assert {(r["offload"], r["mode"], r["chip"]) for r in rows} == {
      (o, m, c) for o in _offload_cost.OFFLOADS for m in _offload_cost.STEP_MODES
      for c in ("tpu-v5e", "h100")}
  text = _report.offload_cost_markdown(rows)
  assert "A model, not a timing" in text and "| params | backward |" in text
  assert "needs " in text  # TPU v5e's link is not published: the link it would need
  assert "glennklockwood.com/garden/processors/h100" in text


def _host_row(axis, dim, best, host, holds, depth=None):
  machine = {"machine": "VM", "memory_bytes": 48 * 10**9, "source": "s", "holds": holds,
             "depth_held": depth}
  return {"section": "host_fits", "target": "tpu-v5e", "target_label": "tpu-v5e",
          "axis": axis, "mode": "backward_params", "offload": "params", "max": best,
          "dim": dim, "seq": 2048, "batch_layers": 24, "params_at_max": "5B",
          "host_at_max": host, "budget_bytes": 16.91e9, "machines": [machine]}


def test_the_host_table_says_per_machine_whether_it_holds_each_answer():
  rows = [_host_row("layers", 2048, 100, 60e9, False, 70),
          _host_row("layers", 4096, 30, 40e9, True), _host_row("batch", 2048, 9, 15e9, True)]
  table = _host_fits.host_markdown(rows)
  assert ("| d=2048: layers at batch 1 | d=4096: layers at batch 1 | d=2048: batch at 24 "
          "layers |") in table
  assert ("| tpu-v5e (16.91 GB) | VM | 48.00 GB | params | 100 layers (5B): 60.00 GB host, "
          "**no**; holds 70 layers | 30 layers (5B): 40.00 GB host, yes | batch 9: 15.00 GB "
          "host, yes |") in table


@pytest.mark.slow
@pytest.mark.targets
@pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                    reason='the TPU compiler is not installed: pip install -e ".[tpu]"')
def test_host_fits_finds_the_deepest_decoder_with_its_host_bytes_on_tpu(tmp_path, monkeypatch):
  monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path / "cache.json"))
  tiny = bench_fit.TINY_DECODER
  rows = _host_fits.run_host(["cpu", "tpu-v5e"], ("state", "params"), progress=False,
                             searches=(("layers", tiny),), sized=tiny, budget=8_000_000)
  fits = {r["offload"]: r for r in rows if r["section"] == "host_fits"}
  assert set(fits) == {"state", "params"}  # "cpu" has no host memory apart: no rows
  for row in fits.values():
    assert row["peak_at_max"] <= 8_000_000 < row["next_peak"], row  # exact
    assert row["host_at_max"] > 0 and len(row["machines"]) == 2
    # Both machines hold these few megabytes (or say their memory is unknown).
    assert [m["holds"] for m in row["machines"]] == [None, True]
  sized = [r for r in rows if r["section"] == "host_sized"]
  assert [r["mode"] for r in sized] == ["backward_offload", "backward_params"]
  assert all(r["host_bytes"] > 0 for r in sized)
  assert "| tpu-v5e (8.00 MB) | Cloud TPU v5e-1 VM" in _host_fits.host_markdown(rows)


@pytest.mark.slow
def test_offload_time_times_each_choice_interleaved_on_the_same_trajectory():
  from optfuse.bench import _offload_time, _report
  rows = _offload_time.run(config=bench_fit.TINY_DECODER._replace(batch=2), rounds=3, warmup=1,
                           min_run_s=0.001)
  assert [r["offload"] for r in rows] == ["none", "state", "params"]
  for row in rows:
    assert row["step_min_s"] <= row["step_s"] <= row["step_max_s"], row
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"], row
    assert row["final_loss"] == rows[0]["final_loss"] and row["steps"] == rows[0]["steps"]
  assert rows[0]["ratio"] == 1.0
  assert "| params |" in _report.offload_time_markdown(rows)


def test_host_fits_without_an_accelerator_target_says_it_needs_one(capsys):
  with pytest.raises(SystemExit):
    bench_main.main(["--host-fits", "--target", "cpu"])
  assert "--host-fits needs an accelerator --target" in capsys.readouterr().err


def test_the_offload_choices_of_the_command_line_are_the_host_tables():
  from optfuse.bench import _what_fits
  assert bench_main._offloads("params,state") == ("params", "state")
  with pytest.raises(Exception, match="choose from state, params"):
    bench_main._offloads("everything")
  # Each choice is one backward step of the searches, in host memory per its words.
  for offload, mode in _what_fits.OFFLOAD_MODES.items():
    assert _what_fits.STEPS[mode] == ("backward", offload, None)
    assert _what_fits.STEPS[f"{mode}_8bit"] == ("backward", offload, 8)
  assert _what_fits.LABELS["backward_params_8bit"] == (
      "backward fusion, params and 8-bit state in host memory")


def test_the_host_table_cites_every_machine_it_names_the_sized_rows_too():
  sized = {"section": "host_sized", "target": "l4", "target_label": "l4", "mode":
           "backward_params", "peak": 6e9, "fits": True, "budget_bytes": 17.69e9,
           "host_bytes": 78e9, "layers": 32, "dim": 4096, "seq": 2048, "batch": 1,
           "params": "6.6B", "machines": [{"machine": "GCP g2-standard-* (1 L4)",
                                           "memory_bytes": None, "holds": None}]}
  table = _host_fits.host_markdown([sized])
  assert "| l4 (17.69 GB) | backward fusion, params and state in host memory | 6.00 GB | yes | " \
      "78.00 GB | GCP g2-standard-* (1 L4): unknown |" in table
  assert "- GCP g2-standard-* (1 L4): not found:" in table
