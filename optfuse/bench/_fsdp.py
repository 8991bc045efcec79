"""Per-device compiled memory under FSDP: a scanned decoder on eight simulated CPU devices.

``python -m optfuse.bench --fsdp [--fsdp-size SIZE]`` compiles the optax step (mode "off") and
the fused steps ("backward", "forward") of a scanned, rematerialized decoder with adamw on a
one-axis mesh ``("fsdp",)`` of eight devices, and reads each executable's memory per device.
Nothing is allocated: the params, the optimizer state and the batch are
``jax.ShapeDtypeStruct``s that carry their ``NamedSharding``.

FSDP here is ``optfuse._analysis._fsdp``'s layout (every param leaf sharded along its largest
axis that the devices divide, never the layer axis of a stacked leaf); the rows beside each
step's peak are its per-device gradient bytes, and the collectives of the compiled HLO are read
by ``optfuse._analysis._collectives``. The optimizer state is sharded like the params
(``optax.tree_utils.tree_map_params``), the batch along its first axis, and the step returns
params and state with their input shardings, donated (``donate_argnums=(0, 1)``). The axis is
Auto, so XLA's partitioner places the gathers of each layer's weights.

The device count is fixed when JAX initialises, so ``run`` measures in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``python -m optfuse.bench._fsdp``) and
the calling process keeps its own devices.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._analysis import _memory
from optfuse._analysis._collectives import all_gathers, collective_counts
from optfuse._analysis._fsdp import grad_share_bytes, live_grad_share_bytes, param_specs
from optfuse._targets import _compiled
from optfuse.bench import _models, _report, _suite
from optfuse.bench._models import DecoderConfig, Model

DEVICES = 8
AXIS = "fsdp"
MODES = ("off", "backward", "forward")

# The batch is sharded over the devices too, so every size's batch is a multiple of DEVICES.
SIZES: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(layers=4, dim=64, heads=4, ff=256, vocab=256, seq=32, batch=8),
    "16l": DecoderConfig(layers=16, dim=1024, heads=16, ff=4096, vocab=32000, seq=512, batch=8),
    "1.3b": DecoderConfig(layers=24, dim=2048, heads=16, ff=8192, vocab=32000, seq=2048,
                          batch=8),
}


def model_for(size: str) -> Model:
  """The scanned, rematerialized decoder of ``SIZES[size]``, named ``decoder_<size>``."""
  return _models.decoder(SIZES[size], scanned=True, remat=True, name=f"decoder_{size}")


def _with_sharding(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def compile_step(mode: str, model: Model, params, batch: tuple,
                 replicated: NamedSharding) -> tuple[optfuse.FusedTransformation,
                                                     jax.stages.Compiled]:
  """Compiles ``model``'s adamw step in ``mode`` for sharded abstract params and batch.

  Args:
    mode: "off", "backward" or "forward".
    model: the benchmark model.
    params: its params as ``jax.ShapeDtypeStruct``s with their ``NamedSharding``.
    batch: the loss's other arguments, likewise.
    replicated: the replicated sharding of the mesh (the loss, the step count).

  Returns:
    ``(fx, compiled)``: the fused transformation and its step, jitted with
    ``donate_argnums=(0, 1)`` and the params and state returned with their input shardings.
  """
  fx = optfuse.fuse(optax.adamw(1e-3), mode=mode)
  param_shardings = jax.tree.map(lambda p: p.sharding, params)
  # Adam's moments (and forward mode's pending gradient) like the params, the rest (the step
  # count) replicated: optax's idiom for sharding a state.
  state_shardings = optax.tree_utils.tree_map_params(
      fx, lambda _, s: s, jax.eval_shape(fx.init, params), param_shardings,
      transform_non_params=lambda _: replicated)
  state = _with_sharding(jax.eval_shape(fx.init, params), state_shardings)
  step = jax.jit(fx.value_and_update(model.loss), donate_argnums=(0, 1),
                 out_shardings=(replicated, param_shardings, state_shardings))
  return fx, step.lower(params, state, *batch).compile()


def measure(model: Model, devices: int = DEVICES, progress: bool = False) -> list[dict[str, Any]]:
  """Compiles every mode's adamw step for ``model`` under FSDP on this process's devices.

  Args:
    model: a scanned decoder of ``_models.decoder`` (its stacked params under "layers").
    devices: the mesh size; this process must have exactly that many devices.
    progress: print each mode to stderr as it compiles.

  Returns:
    One row per mode: the per-device memory fields of ``optfuse._analysis._compiled.FIELDS``,
    ``peak_ratio`` (to "off"), ``grad_share_bytes`` and ``live_grad_share_bytes`` (the
    gradient's bytes per device, and the part of them a fused step must hold at once),
    ``saved_of_share`` (the peak saved against "off", over the gradient share),
    ``all_gathers`` (their number in the HLO), ``extra_all_gathers`` (those "off" has not),
    ``collectives`` (collective name -> count in the HLO), ``compile_s``, and for the fused
    modes ``stacked_placements`` (placement -> how many of the ``stacked_leaves``
    ``optfuse.describe`` places there). A mode that cannot run is a row with ``unavailable``,
    a library error one with ``failed``.

  Raises:
    RuntimeError: this process does not have ``devices`` devices.
  """
  if jax.device_count() != devices:
    raise RuntimeError(f"FSDP over {devices} devices needs {devices} devices, found "
                       f"{jax.device_count()}: set XLA_FLAGS=--xla_force_host_platform_device_"
                       f"count={devices} before JAX starts (optfuse.bench._fsdp.run does).")
  mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(AxisType.Auto,))
  replicated = NamedSharding(mesh, P())
  specs = param_specs(model.params, devices, AXIS)
  params = _with_sharding(_models.abstract(model.params),
                          jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                       is_leaf=lambda x: isinstance(x, P)))
  batch = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=NamedSharding(mesh, P(AXIS)))
                for b in model.batch)
  share = grad_share_bytes(model.params, specs, devices)
  base = {"section": "fsdp", "model": model.name, "description": model.description,
          "optimizer": "adamw", "devices": devices, "mesh": f"({devices},) {AXIS!r} Auto",
          "grad_bytes": _models.grad_bytes(model.params), "grad_share_bytes": share,
          "live_grad_share_bytes": live_grad_share_bytes(model.params, specs, devices),
          "stacked_leaves": len(jax.tree.leaves(model.params["layers"],
                                                is_leaf=_models._is_leaf))}
  rows, gathers = {}, {}
  for mode in MODES:
    if progress:
      print(f"{model.name}: compiling mode {mode!r}", file=sys.stderr, flush=True)
    row = rows[mode] = {**base, "mode": mode}
    start = time.perf_counter()
    try:
      fx, compiled = compile_step(mode, model, params, batch, replicated)
      row["compile_s"] = time.perf_counter() - start
      if mode != "off":
        placements = optfuse.describe(fx, model.loss, params, *batch)
        row["stacked_placements"] = dict(collections.Counter(
            where for path, where in placements.items() if path.startswith("['layers']")))
    except _memory.UNAVAILABLE_ERRORS as e:
      row["unavailable"] = _memory.error_line(e)
      continue
    except Exception as e:  # a library bug: recorded, the command then exits with an error
      row["failed"] = _memory.error_line(e)
      continue
    row.update(_compiled.compiled_memory(compiled))
    hlo = compiled.as_text()
    gathers[mode] = collections.Counter(all_gathers(hlo))
    row.update(all_gathers=gathers[mode].total(), collectives=collective_counts(hlo))
  if "off" in gathers:
    off = rows["off"]
    for mode in gathers:
      row = rows[mode]
      row["peak_ratio"] = row["peak_bytes"] / off["peak_bytes"]
      row["saved_of_share"] = (off["peak_bytes"] - row["peak_bytes"]) / share
      row["extra_all_gathers"] = sorted((gathers[mode] - gathers["off"]).elements())
  return [rows[mode] for mode in MODES]


def run(size: str = "16l", devices: int = DEVICES, progress: bool = True,
        timeout_s: float | None = None) -> list[dict[str, Any]]:
  """Measures ``model_for(size)`` under FSDP in a subprocess with ``devices`` CPU devices.

  Args:
    size: a key of ``SIZES``.
    devices: the number of simulated CPU devices (the mesh size).
    progress: let the subprocess print its progress on this process's stderr.
    timeout_s: kill the subprocess after this many seconds.

  Returns:
    The rows of ``measure``, each with ``elapsed_s`` (the subprocess's wall time) and the
    environment of ``optfuse.bench._suite.environment`` as the subprocess saw it.

  Raises:
    RuntimeError: the subprocess failed; the message holds its output.
  """
  # The subprocess imports the same optfuse as this process (a checkout may shadow an install).
  root = str(Path(optfuse.__file__).resolve().parent.parent)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                       f"--xla_force_host_platform_device_count={devices}".strip(),
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "rows.json"
    command = [sys.executable, "-m", "optfuse.bench._fsdp", size, str(out),
               "--devices", str(devices)] + (["--progress"] if progress else [])
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True,
                          stderr=None if progress else subprocess.STDOUT, timeout=timeout_s)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
      raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stdout}")
    rows = json.loads(out.read_text())
  return [{**row, "elapsed_s": elapsed} for row in rows]


_COLUMNS = (
    ("model", False, lambda r: r["model"]),
    ("mode", False, lambda r: r["mode"]),
    ("peak / device", True, lambda r: _compiled.format_bytes(r["peak_bytes"])),
    ("peak vs optax", True, lambda r: f"{r['peak_ratio']:.2f}x"),
    ("temp / device", True, lambda r: _compiled.format_bytes(r["temp_bytes"])),
    ("arguments / device", True, lambda r: _compiled.format_bytes(r["argument_bytes"])),
    ("gradient / device", True, lambda r: _compiled.format_bytes(r["grad_share_bytes"])),
    ("saved / gradient (at most)", True,
     lambda r: f"{r['saved_of_share']:.0%} "
               f"({1 - r['live_grad_share_bytes'] / r['grad_share_bytes']:.0%})"),
    ("all-gathers (new)", True,
     lambda r: f"{r['all_gathers']} ({len(r['extra_all_gathers'])})"),
    ("stacked leaves placed", True,
     lambda r: ", ".join(f"{where} {count}/{r['stacked_leaves']}"
                         for where, count in sorted(r["stacked_placements"].items()))
     if "stacked_placements" in r else "-"),
    ("compile", True, lambda r: f"{r['compile_s']:.0f} s"),
)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The FSDP rows as a Markdown section: the environment line, the table, the notes.

  Args:
    rows: the rows of ``run`` (one model or several).

  Returns:
    Markdown text ending in a newline.
  """
  env = rows[0]
  intro = (
      f"adamw, float32, `jax.make_mesh(({env['devices']},), ({AXIS!r},))` with an Auto axis: "
      "every param sharded along its largest divisible axis (never the layer axis of stacked "
      "leaves), the optimizer state like the params, the batch along its rows; compile-only "
      "(`jax.ShapeDtypeStruct` inputs with their `NamedSharding`), the step jitted with "
      "`donate_argnums=(0, 1)` and the input shardings as `out_shardings`. Memory is per device. "
      "Gradient / device: the gradient's bytes on one device (sharded leaves over "
      f"{env['devices']}). Saved / gradient: optax's peak minus this mode's, over that; in "
      "brackets the most a fused step can save, all but the gradient it must hold at once (the "
      "leaves outside the loop and one layer's rows). Forward mode's state carries the pending "
      "gradient between steps, in its arguments. All-gathers: in the compiled HLO (one inside "
      "the loop body counts once), in brackets how many of them optax has not. Stacked leaves "
      "placed (`optfuse.describe`): loop, updated row by row inside the scan; leaf, updated "
      "whole and in place before the loss (forward mode, AdamW).")
  title = (f"### FSDP on {env['devices']} simulated {env['backend']} devices: jax "
           f"{env['jax_version']}, optax {env['optax_version']}, {env['cpu_count']} CPUs")
  out = _report._section(title, intro, _COLUMNS, rows)
  times = {r["model"]: r["elapsed_s"] for r in rows}
  out.append("Wall time (subprocess, mostly XLA compiling): "
             + "; ".join(f"`{m}` {s:.0f} s" for m, s in times.items()) + ".")
  return "\n".join([*out, "", _report.PEAK_NOTE]) + "\n"


def write(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``fsdp.json`` and ``fsdp.md`` into ``out_dir``; returns name -> path."""
  return _report.write_tables(rows, out_dir, "fsdp", markdown)


def main(argv: Sequence[str]) -> None:
  """The subprocess: ``python -m optfuse.bench._fsdp SIZE OUT_JSON [--devices N] [--progress]``.

  Args:
    argv: the command line after the program name.
  """
  parser = argparse.ArgumentParser(prog="python -m optfuse.bench._fsdp",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("size", choices=sorted(SIZES))
  parser.add_argument("out", type=Path)
  parser.add_argument("--devices", type=int, default=DEVICES)
  parser.add_argument("--progress", action="store_true")
  args = parser.parse_args(argv)
  rows = measure(model_for(args.size), args.devices, progress=args.progress)
  env = _suite.environment()
  args.out.write_text(json.dumps([{**env, **row} for row in rows]))


if __name__ == "__main__":
  main(sys.argv[1:])
