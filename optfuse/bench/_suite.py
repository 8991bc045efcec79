"""The benchmark suites and the loop that measures them.

A *cell* is a model and an optimizer. Every mode of a cell is compiled (the compile time and the
compiled memory are read from that executable), then the modes that compiled are timed together,
interleaved, on the same batch from the same params. A mode that cannot run the optimizer — a
non-separable transform in backward mode, a mode this version does not implement — is recorded
with its reason and not timed.

The ``large`` section compiles big scanned decoders from ``jax.ShapeDtypeStruct``s only, in every
mode, for this machine or for an accelerator's compiler (``optfuse.targets``): nothing is
allocated, so billion-parameter shapes are measured anywhere.

The memory floor of a model (``floor_bytes``) is ``optfuse._analysis._floor``'s estimate, with
the gradient bytes a fused step must still hold at once from ``Model.live_grad_bytes``.
"""

from __future__ import annotations

import inspect
import os
import platform
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from tqdm.auto import tqdm

import optfuse
from optfuse import _fuse
from optfuse._analysis import _floor, _memory, _report
from optfuse._targets import _compiled, _registry
from optfuse.bench import _forms, _models, _timing
from optfuse.bench._models import DecoderConfig, Model

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-3),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}

# Global-gradient transforms (clipping) cannot run in plain backward mode; they are measured in
# the modes that handle them.
SEPARABLE_MODES = ("off", "backward", "forward")
GLOBAL_MODES = ("off", "forward", "two_pass")


def modes_for(optimizer: str) -> tuple[str, ...]:
  """The modes a cell with ``optimizer`` is measured in, "off" (the reference) first."""
  return GLOBAL_MODES if optimizer.startswith("clip") else SEPARABLE_MODES


def make_fused(tx: optax.GradientTransformation, mode: str,
               step_options: dict[str, Any] | None = None) -> _fuse.FusedTransformation:
  """``optfuse.fuse`` for a benchmark mode; "two_pass" is backward mode with two-pass globals.

  Raises:
    NotImplementedError: this optfuse version has no such mode, or its ``value_and_update``
      does not take ``step_options``.
  """
  fx = _make_fused(tx, mode)
  missing = set(step_options or ()) - set(inspect.signature(fx.value_and_update).parameters)
  if missing:
    raise NotImplementedError(
        f"this optfuse version's value_and_update has no option {', '.join(sorted(missing))}")
  return fx


def _make_fused(tx: optax.GradientTransformation, mode: str) -> _fuse.FusedTransformation:
  if mode != "two_pass":
    return optfuse.fuse(tx, mode=mode)
  if "global_ops" not in inspect.signature(optfuse.fuse).parameters:
    raise NotImplementedError("this optfuse version has no two-pass option (global_ops)")
  return optfuse.fuse(tx, mode="backward", global_ops="two_pass")


class Cell(NamedTuple):
  model: Model
  optimizer: str


class Suite(NamedTuple):
  """What one run measures and how long it times each cell.

  Attributes:
    name: "smoke", "quick", "memory" or "full".
    cells: the timed (model, optimizer) pairs.
    large: models measured compile-only with adamw from ``jax.ShapeDtypeStruct``s (the big
      scanned decoders).
    rounds: interleaved timed runs per mode.
    warmup: untimed steps per mode after compiling.
    min_run_s: the least duration of one timed run.
    compile_rounds: interleaved compiles per mode; the compile time is their median, and the
      compile ratio the median over rounds of the ratio to optax's compile in the same round.
  """

  name: str
  cells: tuple[Cell, ...]
  large: tuple[Model, ...]
  rounds: int
  warmup: int
  min_run_s: float
  compile_rounds: int = 1


SEPARABLE = ("sgd_momentum", "adamw", "lion", "adafactor")


def _grid(models, optimizers) -> list[Cell]:
  return [Cell(m, o) for m in models for o in optimizers]


# About 1.3B parameters: the loop-fusion issue's target (24 layers, d=2048, T=2048).
DECODER_1_3B = DecoderConfig(layers=24, dim=2048, heads=16, ff=8192, vocab=32000, seq=2048,
                             batch=1)
# About 6.6B parameters: 32 layers, d=4096 (a plain two-matrix MLP with ff=16384).
DECODER_6_6B = DecoderConfig(layers=32, dim=4096, heads=32, ff=16384, vocab=32000, seq=2048,
                             batch=1)
LARGE_DECODERS = {"decoder_1.3b": DECODER_1_3B, "decoder_6.6b": DECODER_6_6B}


def _large_decoders() -> tuple[Model, ...]:
  return tuple(_models.decoder(c, scanned=True, remat=True, name=name)
               for name, c in LARGE_DECODERS.items())


def smoke_suite() -> Suite:
  """Seconds: the smallest models, for tests."""
  mlp = _models.mlp(depth=2, width=16, inputs=8, batch=4)
  scan_mlp = _models.scan_mlp(depth=3, width=16, inputs=8, batch=4)
  cells = (Cell(scan_mlp, "adamw"), Cell(mlp, "clip_adamw"))
  large = (scan_mlp._replace(name="scan_mlp_tiny"),)
  return Suite("smoke", cells, large, rounds=2, warmup=1, min_run_s=0.001)


def quick_suite() -> Suite:
  """About a minute on two CPU cores, most of it XLA compiling.

  Compiling dominates on CPU (several CPU-seconds per mode for a small transformer, whatever
  its size), so the quick suite sweeps the models with adamw and the optimizers on the scanned
  MLP. The 1.3B decoder is the main job's TPU line (``_what_fits.at_size``); its XLA:CPU peaks
  are ``--memory``'s.
  """
  small = DecoderConfig(layers=4, dim=64, heads=4, ff=256, vocab=256, seq=32, batch=4)
  models = [
      _models.mlp(depth=4, width=256, inputs=128, batch=64),
      _models.decoder(small._replace(layers=2), scanned=False, remat=False),
      _models.decoder(small, scanned=True, remat=False),
      _models.decoder(small, scanned=True, remat=True),
      _models.grad_accum(micro=4, depth=4, width=256, inputs=128, batch=16),
  ]
  # One row per lesson: the CNN repeats the unrolled models', the other separable optimizers
  # the scanned MLP's AdamW row (``--full`` sweeps them); clipping shows forward and two-pass.
  scan_mlp = _models.scan_mlp(depth=8, width=256, inputs=128, batch=64)
  cells = _grid(models, ["adamw"]) + _grid([scan_mlp], ["adamw", "clip_adamw"])
  # One compile per mode: compiling is most of the suite's time, and the main job now also
  # compiles for the targets (``_what_fits``); ``--loops`` and ``--full`` take three rounds.
  return Suite("quick", tuple(cells), (), rounds=11, warmup=2,
               min_run_s=0.015, compile_rounds=1)


# The scanned-model forms of ``_forms`` at the size the loop-fusion issue measured them.
FORM_SIZE = DecoderConfig(layers=16, dim=512, heads=8, ff=2048, vocab=32000, seq=512, batch=4)


def _scanned_forms() -> tuple[Model, ...]:
  forms = tuple(make(FORM_SIZE) for make in _forms.FORMS.values())
  return (*forms, _models.decoder(FORM_SIZE, scanned=True, remat=False, name="no_remat"))


def memory_suite() -> Suite:
  """Compile-only memory of the 1.3B and 6.6B scanned decoders and of the scanned-model forms
  (``_forms``: how MaxText, Levanter and others write a scanned decoder) at 16 layers."""
  return Suite("memory", (), (*_large_decoders(), *_scanned_forms()), rounds=0, warmup=0,
               min_run_s=0.0)


GPT_184M = DecoderConfig(layers=12, dim=1024, heads=16, ff=4096, vocab=32000, seq=512, batch=1)


def gpt_suite() -> Suite:
  """The yardstick alone: the 184M-parameter scanned GPT (remat, AdamW), every mode."""
  gpt = _models.decoder(GPT_184M, scanned=True, remat=True, name="gpt_184m")
  return Suite("gpt", (Cell(gpt, "adamw"),), (), rounds=5, warmup=1, min_run_s=0.0)


MEDIUM = DecoderConfig(layers=8, dim=256, heads=4, ff=1024, vocab=1024, seq=128, batch=8)


def loops_suite() -> Suite:
  """The loop-fusion issue's timing target: an 8-layer, d=256 scanned decoder with AdamW."""
  models = [_models.decoder(MEDIUM, scanned=True, remat=True),
            _models.decoder(MEDIUM, scanned=True, remat=False)]
  return Suite("loops", tuple(_grid(models, ["adamw"])), (), rounds=15, warmup=3, min_run_s=0.05,
               compile_rounds=3)


def full_suite() -> Suite:
  """Larger models, more rounds, and the 184M-parameter scanned GPT with AdamW."""
  medium = MEDIUM
  models = [
      _models.mlp(depth=8, width=1024, inputs=512, batch=128),
      _models.scan_mlp(depth=16, width=1024, inputs=512, batch=128),
      _models.cnn(channels=(32, 64, 128), image=32, batch=32),
      _models.decoder(medium, scanned=False, remat=False),
      _models.decoder(medium, scanned=True, remat=False),
      _models.decoder(medium, scanned=True, remat=True),
      _models.grad_accum(micro=8, depth=8, width=1024, inputs=512, batch=32),
  ]
  cells = _grid(models, SEPARABLE) + [Cell(m, "clip_adamw") for m in models]
  cells.append(gpt_suite().cells[0])
  return Suite("full", tuple(cells), _large_decoders(), rounds=7, warmup=2, min_run_s=0.2,
               compile_rounds=3)


SUITES = {"smoke": smoke_suite, "quick": quick_suite, "memory": memory_suite,
          "gpt": gpt_suite, "loops": loops_suite, "full": full_suite}


ENV_KEYS = ("jax_version", "optax_version", "optfuse_version", "backend", "device_kind",
            "device_count", "python", "machine", "cpu_count", "suite", "load_average_start",
            "load_average_end")


def environment() -> dict[str, Any]:
  """Where the numbers come from."""
  device = jax.devices()[0]
  return {
      "jax_version": jax.__version__,
      "optax_version": optax.__version__,
      "optfuse_version": optfuse.__version__,
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "python": platform.python_version(),
      "machine": platform.machine(),
      "cpu_count": os.cpu_count(),
  }


def load_average() -> float | None:
  """The 1-minute load average (other processes slow the timings down), where known."""
  return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def run_cell(cell: Cell, suite: Suite) -> list[dict[str, Any]]:
  """Compiles and times every mode of one cell; one row per mode.

  A mode that raises one of ``_memory.UNAVAILABLE_ERRORS`` is recorded as unavailable;
  any other exception is recorded as a failure (``row["failed"]``) so that the other cells still
  run, and the command exits with an error.
  """
  model, tx = cell.model, OPTIMIZERS[cell.optimizer]()
  base = {"section": "timing", "model": model.name, "description": model.description,
          "optimizer": cell.optimizer, "grad_bytes": _models.grad_bytes(model.params),
          "scanned": isinstance(model.params, dict)
                     and isinstance(model.params.get("layers"), dict)}
  rows: dict[str, dict[str, Any]] = {}
  trainers: dict[str, _timing.Trainer] = {}
  compilers: dict[str, Callable[[], float]] = {}
  batch = _models.materialize(model.batch, seed=1)
  modes = modes_for(cell.optimizer)
  for mode in (*modes[1:], modes[0]):
    row = rows[mode] = {**base, "mode": mode}
    if mode == "off" and not trainers:
      row["unavailable"] = "no fused mode to compare with"
      continue
    params = _models.materialize(model.params, seed=0)
    try:
      fx = make_fused(tx, mode, model.step_options)
      state = jax.jit(fx.init)(params)
      compiled, row["compile_s"] = _timing.compile_step(fx, model.loss, params, batch,
                                                        **model.step_options)
    except _memory.UNAVAILABLE_ERRORS as e:
      row["unavailable"] = _memory.error_line(e)
      continue
    except Exception as e:  # a library bug: recorded, the command then exits with an error
      row["failed"] = _memory.error_line(e)
      continue
    row.update(_compiled.compiled_memory(compiled))
    trainers[mode] = _timing.Trainer(compiled, params, state, batch)
    compilers[mode] = lambda fx=fx, params=params: _timing.compile_step(
        fx, model.loss, params, batch, **model.step_options)[1]
  if "off" in trainers:
    compile_s, compile_ratio = _timing.interleaved_compiles(
        compilers, {mode: rows[mode]["compile_s"] for mode in compilers}, "off",
        suite.compile_rounds)
    timing = _timing.interleaved(trainers, "off", suite.rounds, suite.warmup, suite.min_run_s)
    off = rows["off"]
    floor = floor_bytes(model, model.params, off)
    for mode, trainer in trainers.items():
      row = rows[mode]
      row.update(step_ms=timing.step_s[mode] * 1e3, time_ratio=timing.ratio[mode],
                 compile_s=compile_s[mode], compile_ratio=compile_ratio[mode],
                 peak_ratio=row["peak_bytes"] / off["peak_bytes"], floor_bytes=floor,
                 peak_vs_floor=row["peak_bytes"] / floor, steps_timed=trainer.steps,
                 steps_per_run=timing.steps_per_run, final_loss=float(trainer.loss))
    off["update_ms"] = 1e3 * _timing.update_time(
        tx, _models.materialize(model.params, seed=0), suite.rounds, suite.min_run_s)
  return [rows[mode] for mode in modes]


def run_suite(suite: Suite, progress: bool = True, targets: tuple[Any, ...] = (None,)
              ) -> list[dict[str, Any]]:
  """Measures every cell and large model of ``suite``; returns the rows with the environment.

  The cells are timed on this machine; the large models are compiled for each of ``targets``
  (``None``: this machine).
  """
  env = {**environment(), "suite": suite.name, "load_average_start": load_average()}
  jobs = [(f"{c.model.name}/{c.optimizer}", lambda c=c: run_cell(c, suite)) for c in suite.cells]
  # The large decoders on an accelerator's compiler also with the state in host memory
  # (XLA:CPU counts host memory as device memory), the other models with the memory guard.
  jobs += [(f"{m.name}/adamw on {t or 'this machine'} (compile only)",
            lambda m=m, t=t: run_large(
                m, t, offload=t is not None and m.name in LARGE_DECODERS,
                guarded=t is not None and m.name not in LARGE_DECODERS))
           for t in targets for m in suite.large]
  rows = []
  with tqdm(jobs, desc=f"optfuse.bench {suite.name}", unit="cell", disable=not progress) as bar:
    for label, job in bar:
      bar.set_postfix_str(label)
      rows.extend(job())
  env["load_average_end"] = load_average()
  for row in rows:
    row.setdefault("time_ratio", None)
    row.setdefault("peak_bytes", None)
    row.update(env)
  return rows

def floor_bytes(model: Model, params, off_memory: dict[str, int]) -> int:
  """The estimated memory floor of a model (``optfuse._analysis._floor``)."""
  return _floor.floor_bytes(off_memory, _models.grad_bytes(params),
                            model.live_grad_bytes(params))


def run_large(model: Model, target: Any = None, offload: bool = False,
              guarded: bool = False) -> list[dict[str, Any]]:
  """Compile-only memory of ``model`` with adamw in every mode, for ``target``'s compiler
  (``None``: this machine); allocates nothing. The floor comes from the same compiler.

  Args:
    model: a benchmark model.
    target: a target name or object (``optfuse._targets._registry.resolve``), or ``None``.
    offload: also every mode with the state in host memory (rows suffixed ``"+offload"``).
    guarded: also the ``"backward+guard"`` row (``optfuse.fuse(tx, guard=True)``).

  Returns:
    One row per mode.
  """
  params = _models.abstract(model.params)
  stacked = _models.grad_bytes(params["layers"]) if "layers" in params else None
  base = {"section": "memory", "model": model.name, "description": model.description,
          "optimizer": "adamw", "grad_bytes": _models.grad_bytes(params),
          "stacked_grad_bytes": stacked,
          "target": getattr(target, "name", target) or jax.default_backend()}
  offloads = (None, "state") if offload else (None,)
  try:
    reports = {o: _report.memory_report(model.loss, optax.adamw(1e-3), params,
                                        *_models.abstract(model.batch), target=target,
                                        offload=o) for o in offloads}
  except Exception as e:  # a library bug: recorded, the command then exits with an error
    return [{**base, "mode": mode, "failed": _memory.error_line(e)} for mode in _memory.MODES]
  report = reports[None]
  off = report["off"]["peak_bytes"] if "off" in report else None
  floor = floor_bytes(model, params, report["off"]) if off else None
  rows = []
  for o, rep in reports.items():
    for mode in _memory.MODES:
      row = {**base, "mode": mode + ("+offload" if o else ""), "target": rep.target,
             "budget_bytes": rep.budget_bytes, "fits": mode in rep and rep.fits(mode)}
      if mode in rep.does_not_fit:
        row["unavailable"] = str(rep.does_not_fit[mode])
      elif mode in rep:
        row.update(rep[mode], **_against(rep[mode]["peak_bytes"], off, floor, stacked))
      else:
        row["unavailable"] = _memory.first_sentence(rep.unavailable[mode])
      rows.append(row)
  if guarded:
    rows.append(_guarded_row(model, params, target, {**base, "target": report.target}, off,
                             floor, stacked))
  return rows


def _against(peak: int, off: int | None, floor: int | None, stacked: int | None
             ) -> dict[str, Any]:
  """A compiled peak against optax's, the floor and the stacked gradient."""
  return {"peak_ratio": peak / off if off else None, "floor_bytes": floor,
          "peak_vs_floor": peak / floor if floor else None,
          "saved_of_stacked": (off - peak) / stacked if stacked and off else None}


def _guarded_row(model: Model, params, target: Any, base: dict, off: int | None,
                 floor: int | None, stacked: int | None) -> dict[str, Any]:
  """The ``"backward+guard"`` row: backward fusion with ``guard=True`` on an accelerator's
  compiler (its loops kept only where they lower the peak there)."""
  fx = optfuse.fuse(optax.adamw(1e-3), guard=True)
  memory = _compiled.compile_memory(_memory.lower_step(
      fx, model.loss, params, _models.abstract(model.batch), target=_registry.resolve(target)))
  row = {**base, "mode": "backward+guard", "budget_bytes": None, "fits": None,
         "floor_bytes": floor}
  if isinstance(memory, _compiled.DoesNotFit):
    return {**row, "unavailable": str(memory)}
  return {**row, **memory, **_against(memory["peak_bytes"], off, floor, stacked)}
