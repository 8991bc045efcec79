"""Muon fused layer by layer: the compiled peaks against optax's Muon, and the step time.

Compiles (compile-only, nothing allocated) the bench's 1.3B scanned remat decoder (24 layers,
d=2048, ff 8192, T=2048, batch 1) with ``optax.contrib.muon``, its dimension numbers leaving the
layer axis a batch axis of each stacked matrix (``qkv``, ``proj``, ``up``, ``down``) and the
norms, the position table and the tied embedding on Muon's AdamW fallback; AdamW on the same
decoder is the comparison row. Each optimizer's step is compiled as optax's (mode "off"), with
backward fusion, and with backward fusion and ``offload="state"``. The table also gives the
bytes of the largest stacked gradient (``up``/``down``: one (24, 2048, 8192) float32 leaf) and of
all the stacked matrices' gradients together.

``--time`` instead times the fused step of Muon (and AdamW) against optax's on this machine: a
decoder of 8 layers, d=256 (about half a second a step on two CPU cores), each step jitted with
the params and state donated, interleaved A/B rounds after a warmup; it prints the median and
range of each and their ratio.

``--state-bits 8`` holds each optimizer's float state in 8 bits (``optfuse.low_bit``: Muon's
momentum and the fallback's moments; AdamW's two moments), and the table's first line gives the
state's bytes in float32 and in 8 bits.

Usage::

  python examples/muon_memory.py                     # XLA:CPU
  python examples/muon_memory.py --target tpu-v5e    # the TPU compiler (pip extra "tpu")
  python examples/muon_memory.py --target h100       # the GPU compiler (CUDA plugin)
  python examples/muon_memory.py --state-bits 8      # the optimizer state in 8 bits
  python examples/muon_memory.py --time --rounds 9   # the step time on this machine

Every memory figure is XLA's buffer assignment for the target's compiler: deterministic for given
versions of jax, libtpu and the CUDA plugin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers as Dims

import optfuse
from optfuse._analysis import _memory
from optfuse._targets import _registry
from optfuse._targets._compiled import format_bytes
from optfuse.bench import _models, _suite

LR = 1e-3
MATRICES = ("qkv", "proj", "up", "down")
# step name -> (mode, offload)
STEPS = {"optax": ("off", None), "backward": ("backward", None),
         "backward + offload": ("backward", "state")}
TIMED = _models.DecoderConfig(layers=8, dim=256, heads=4, ff=1024, vocab=1024, seq=128, batch=4)


def muon_dims(params) -> dict:
  """Each stacked (L, fan_in, fan_out) matrix: the layer axis a batch axis, so each layer's
  matrix is orthogonalised on its own; every other leaf (``None``) on Muon's AdamW fallback."""
  layers = {name: Dims(1, 2) if name in MATRICES else None for name in params["layers"]}
  return {**{name: None for name in params if name != "layers"}, "layers": layers}


OPTIMIZERS = {"muon": lambda: optax.contrib.muon(LR, muon_weight_dimension_numbers=muon_dims),
              "adamw": lambda: optax.adamw(LR)}


def optimizer(name: str, state_bits: int = 32) -> optax.GradientTransformation:
  """``OPTIMIZERS[name]``, its float state in ``state_bits`` bits (``optfuse.low_bit``)."""
  tx = OPTIMIZERS[name]()
  return tx if state_bits == 32 else optfuse.low_bit(tx, state_bits)


def state_bytes(name: str, params, state_bits: int) -> int:
  """The bytes of the optimizer's state for ``params`` (abstract), as its ``init`` makes it."""
  state = jax.eval_shape(optimizer(name, state_bits).init, params)
  return sum(_models.nbytes(x) for x in jax.tree.leaves(state))


def stacked_bytes(params) -> tuple[int, int]:
  """The bytes of the largest stacked matrix and of all of them: the gradients the backward
  loop need not hold at once."""
  sizes = [_models.nbytes(params["layers"][name]) for name in MATRICES]
  return max(sizes), sum(sizes)


def check_placement(model: _models.Model, state_bits: int = 32) -> None:
  """Every stacked matrix updated in its backward loop iteration, or stop."""
  params = _models.abstract(model.params)
  where = optfuse.describe(optimizer("muon", state_bits), model.loss, params,
                           *_models.abstract(model.batch))
  stacked = [f"['layers']['{name}']" for name in MATRICES]
  if any(where[leaf] != "loop" for leaf in stacked):
    raise SystemExit(f"a stacked matrix is not updated in the loop:\n{where.table()}")
  print(f"describe: {', '.join(MATRICES)} at loop", file=sys.stderr, flush=True)


def measure(model: _models.Model, name: str, step: str, target: str | None, state_bits: int = 32
            ) -> dict[str, Any]:
  """One compile: the row of (optimizer ``name``, step, target)."""
  mode, offload = STEPS[step]
  fx = optfuse.fuse(optimizer(name, state_bits), mode=mode, offload=offload)
  row = {"optimizer": name, "state_bits": state_bits, "step": step, "target": target or "cpu"}
  try:
    memory = _memory.step_memory(fx, model.loss, _models.abstract(model.params),
                                 tuple(_models.abstract(model.batch)),
                                 target=None if target is None else _registry.resolve(target))
  except _memory.UNAVAILABLE_ERRORS as e:
    return {**row, "unavailable": _memory.error_line(e)}
  if isinstance(memory, _memory.DoesNotFit):
    return {**row, "needs_bytes": memory.needed_bytes}
  return {**row, **memory}


def _cell(row: dict[str, Any]) -> str:
  if "unavailable" in row:
    return f"unavailable ({row['unavailable']})"
  if "peak_bytes" not in row:
    return f"needs {format_bytes(row['needs_bytes'])}" if row["needs_bytes"] else "does not fit"
  host = f" + {format_bytes(row['host_bytes'])} host" if row["host_bytes"] else ""
  if row["host_transfer_bytes"] and not row["host_bytes"]:
    host = " (host memory is device memory: nothing offloaded)"
  return f"{format_bytes(row['peak_bytes'])}{host}"


def _below(row: dict[str, Any], optax_row: dict[str, Any]) -> str:
  """How far the row's peak is below optax's peak, or below the bytes the compiler said optax's
  step needs where it refused it."""
  if row is optax_row or "peak_bytes" not in row:
    return "-"
  if "peak_bytes" in optax_row:
    return format_bytes(optax_row["peak_bytes"] - row["peak_bytes"])
  if optax_row.get("needs_bytes"):
    return f"{format_bytes(optax_row['needs_bytes'] - row['peak_bytes'])} (below what optax needs)"
  return "-"


def markdown(rows: list[dict[str, Any]], largest: int, total: int, states: dict[str, str]
             ) -> str:
  """One line per (optimizer, step): the peak (+ host bytes) and how far below optax's;
  ``states`` gives each optimizer's state bytes."""
  out = [f"largest stacked gradient: {format_bytes(largest)}; all stacked matrices' gradients: "
         f"{format_bytes(total)}; optimizer state: "
         + "; ".join(f"{name} {text}" for name, text in states.items()), "",
         "| optimizer | step | target | peak (+ host) | below optax |", "|---|---|---|---:|---:|"]
  for r in rows:
    optax_row = next(o for o in rows if (o["optimizer"], o["target"], o["step"])
                     == (r["optimizer"], r["target"], "optax"))
    out.append(f"| {r['optimizer']} | {r['step']} | {r['target']} | {_cell(r)} "
               f"| {_below(r, optax_row)} |")
  return "\n".join(out)


def time_steps(rounds: int, steps_per_round: int, config: _models.DecoderConfig = TIMED,
               optimizer: str = "muon") -> dict[str, list[float]]:
  """Interleaved A/B rounds of the fused and optax steps of ``optimizer`` on ``config``, after
  one warmup round each: the seconds a step of each round, per step name."""
  model = _models.decoder(config, scanned=True, remat=True)
  batch = _models.materialize(model.batch, 1)
  runs = {}
  for name, mode in (("optax", "off"), ("backward", "backward")):
    fx = optfuse.fuse(OPTIMIZERS[optimizer](), mode=mode)
    params = _models.materialize(model.params, 0)
    runs[name] = [jax.jit(fx.value_and_update(model.loss), donate_argnums=(0, 1)),
                  params, fx.init(params)]
  seconds = {name: [] for name in runs}

  def one_round(name: str) -> float:
    step, params, state = runs[name]
    start = time.perf_counter()
    for _ in range(steps_per_round):
      loss, params, state = step(params, state, *batch)
    jax.block_until_ready((loss, params, state))
    runs[name][1:] = params, state
    return (time.perf_counter() - start) / steps_per_round

  for name in runs:
    one_round(name)
  for _ in range(rounds):
    for name in runs:
      seconds[name].append(one_round(name))
  med = {name: statistics.median(s) for name, s in seconds.items()}
  print(f"{optimizer}, {model.description}; {rounds} rounds of "
        f"{steps_per_round} steps each, interleaved, after a warmup round")
  for name, s in seconds.items():
    print(f"{name}: median {med[name] * 1e3:.0f} ms a step, range "
          f"{min(s) * 1e3:.0f}-{max(s) * 1e3:.0f} ms")
  ratios = [b / o for b, o in zip(seconds["backward"], seconds["optax"], strict=True)]
  print(f"backward / optax: {med['backward'] / med['optax']:.3f} (per round "
        f"{min(ratios):.3f}-{max(ratios):.3f})")
  return seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", help="a compile target (default: this machine)")
  parser.add_argument("--optimizers", default="muon,adamw")
  parser.add_argument("--json", help="append each row to this JSON-lines file as it is measured")
  parser.add_argument("--state-bits", type=int, choices=(32, 8, 4), default=32,
                      help="hold the optimizer's float state in 8 or 4 bits (optfuse.low_bit)")
  parser.add_argument("--time", action="store_true", help="time the steps instead")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=5, help="steps a timed round")
  args = parser.parse_args()
  if args.time:
    for name in args.optimizers.split(","):
      time_steps(args.rounds, args.steps, optimizer=name)
    return
  model = _models.decoder(_suite.DECODER_1_3B, scanned=True, remat=True)
  check_placement(model, args.state_bits)
  names = args.optimizers.split(",")
  params = _models.abstract(model.params)
  states = {}
  for name in names:
    states[name] = format_bytes(state_bytes(name, params, 32)) + " in float32"
    if args.state_bits != 32:
      states[name] += (f", {format_bytes(state_bytes(name, params, args.state_bits))} in "
                       f"{args.state_bits} bits")
  rows = []
  for name in names:
    for step in STEPS:
      rows.append(measure(model, name, step, args.target, args.state_bits))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
      if args.json:
        with open(args.json, "a") as f:
          f.write(json.dumps(rows[-1]) + "\n")
  print(markdown(rows, *stacked_bytes(model.params), states))


if __name__ == "__main__":
  main()
