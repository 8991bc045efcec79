"""The step time of 8- and 4-bit AdamW state against float32 AdamW, fused, on this machine.

For each of the bench's scanned models (``optfuse/bench/_models.py``: the loop-fusion suite's
8-layer d=256 decoder with and without remat, and the residual dense stack), the training step
``optfuse.fuse(tx, mode="backward").value_and_update(loss)`` is compiled three times: with
``optax.adamw``, with ``optfuse.low_bit(optax.adamw, bits=8)`` and with ``bits=4``. The three
steps are then timed interleaved (``optfuse.bench._timing``: a round runs each step back to
back, the order reversed every round), and each round's low-bit time is divided by that round's
float32 time: the ratios' median and range over the rounds are printed, with the system's load
at the start and end (other processes slow every step alike, but noisier).

``--parts`` times instead where an 8-bit update's time goes, on one leaf of 8 rows of 256x256
(the dense stack's shape): float32 AdamW's update, the 8-bit one, and each piece of the 8-bit
update alone (the block absmax, the code search, packing, the table read of dequantization),
with the code search also by the compact bucket tables that TPU and GPU steps use, and the
4-bit map's search by each method (``optfuse/_low_bit/_search.py``), interleaved rounds, median
and range.

Usage::

  python examples/low_bit_step_time.py --rounds 7
  python examples/low_bit_step_time.py --parts --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optfuse
from optfuse._low_bit import _blocks, _maps, _search
from optfuse.bench import _models, _suite, _timing

VARIANTS = ("f32", "8-bit", "4-bit")


def optimizer(variant: str) -> optax.GradientTransformation:
  """AdamW as the bench times it, its state in float32 or quantized."""
  tx = optax.adamw(1e-3)
  return tx if variant == "f32" else optfuse.low_bit(tx, bits=int(variant.split("-")[0]))


def models(quick: bool) -> list[_models.Model]:
  """The bench's scanned models (``--quick``: tiny ones, for tests)."""
  if quick:
    small = _models.DecoderConfig(layers=2, dim=64, heads=2, ff=128, vocab=128, seq=16, batch=2)
    return [_models.decoder(small, scanned=True, remat=True)]
  return [_models.decoder(_suite.MEDIUM, scanned=True, remat=True),
          _models.decoder(_suite.MEDIUM, scanned=True, remat=False),
          _models.scan_mlp(depth=8, width=256, inputs=128, batch=64)]


def _load() -> float:
  return round(os.getloadavg()[0], 2)


def time_model(model: _models.Model, rounds: int, min_run_s: float) -> dict[str, Any]:
  """Compiles and times the three variants of ``model``'s fused backward step.

  Returns:
    ``{"model", "description", "step_ms": {variant: median}, "ratio": {variant: (median, low,
    high)}, "steps_per_run", "load": (start, end)}``, the ratios over rounds to the float32
    step of the same round.
  """
  params, batch = _models.materialize(model.params, 0), _models.materialize(model.batch, 1)
  trainers = {}
  load_start = _load()
  for variant in VARIANTS:
    fx = optfuse.fuse(optimizer(variant), mode="backward")
    compiled, _ = _timing.compile_step(fx, model.loss, params, batch)
    p = jax.tree.map(lambda x: x.copy(), params)
    trainers[variant] = _timing.Trainer(compiled, p, fx.init(p), batch)
  for trainer in trainers.values():
    trainer.run(2)
  steps = max(1, round(min_run_s / max(t.run(1) for t in trainers.values())))
  times: dict[str, list[float]] = {v: [] for v in VARIANTS}
  for r in range(rounds):
    for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
      times[variant].append(trainers[variant].run(steps))
  ratios = {v: [a / b for a, b in zip(times[v], times["f32"], strict=True)] for v in VARIANTS}
  return {"model": model.name, "description": model.description,
          "step_ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
          "ratio": {v: (statistics.median(r), min(r), max(r)) for v, r in ratios.items()},
          "steps_per_run": steps, "load": (load_start, _load())}


def markdown(rows: list[dict[str, Any]], rounds: int) -> str:
  lines = ["| model | f32 step (ms) | 8-bit / f32 | 4-bit / f32 | load (start, end) |",
           "|---|---|---|---|---|"]
  for row in rows:
    cells = [f"{row['ratio'][v][0]:.3f} ({row['ratio'][v][1]:.3f}-{row['ratio'][v][2]:.3f})"
             for v in VARIANTS[1:]]
    lines.append(f"| {row['model']} ({row['description']}) | {row['step_ms']['f32']:.1f} | "
                 f"{' | '.join(cells)} | {row['load'][0]}, {row['load'][1]} |")
  lines.append(f"\nmedian (range) over {rounds} interleaved rounds of "
               f"{', '.join(str(r['steps_per_run']) for r in rows)} steps; "
               f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores")
  return "\n".join(lines)


def _per_call_ms(f: Callable, args: tuple, calls: int) -> float:
  out = f(*args)
  start = time.perf_counter()
  for _ in range(calls):
    out = f(*args)
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - start) / calls


def parts(rounds: int = 5, min_run_s: float = 0.5, shape=(8, 256, 256)) -> dict[str, tuple]:
  """Milliseconds per call of float32 and 8-bit AdamW's update of one leaf, and of the pieces
  of the 8-bit one: ``{name: (median, low, high)}`` over interleaved rounds (each piece jitted
  alone, so XLA fuses it as it can; inside the update they fuse with their neighbours)."""
  x = 1e-3 * jax.random.normal(jax.random.key(0), shape)
  signed, signed4 = _maps.scheme(8, True), _maps.scheme(4, True)
  y = x / jnp.max(jnp.abs(x))
  words, scales = _blocks.quantize(x, signed, 256)
  codes = _search.lookup(y, signed)
  f32, low = optax.adamw(1e-3), optfuse.low_bit(optax.adamw(1e-3), bits=8)
  grads, params = {"w": 0.1 * x}, {"w": x}
  pieces = {
      "AdamW update, float32 state": (f32.update, (grads, f32.init(params), params)),
      "AdamW update, 8-bit state": (low.update, (grads, low.init(params), params)),
      "8-bit: quantize one slot (all below)": (
          lambda x: _blocks.quantize(x, signed, 256), (x,)),
      "of which: block absmax": (
          lambda x: jnp.max(jnp.abs(x.reshape(*shape[:-1], -1, 256)), -1), (x,)),
      "of which: code search (bucket, then the thresholds)": (
          lambda y: _search.lookup(y, signed), (y,)),
      "code search with the compact tables (TPU, GPU)": (
          lambda y: _search.lookup(y, signed, "compact"), (y,)),
      "4-bit code search by comparing (XLA:CPU)": (
          lambda y: _search.lookup(y, signed4, "compare"), (y,)),
      "4-bit code search, raw tables": (lambda y: _search.lookup(y, signed4, "raw"), (y,)),
      "4-bit code search, compact tables (TPU, GPU)": (
          lambda y: _search.lookup(y, signed4, "compact"), (y,)),
      "of which: pack codes into words": (lambda c: _blocks._pack(c, 8), (codes,)),
      "8-bit: dequantize one slot": (
          lambda w, s: _blocks.dequantize(w, s, signed, 256, shape[-1]), (words, scales)),
  }
  jitted = {name: (jax.jit(f), a) for name, (f, a) in pieces.items()}
  calls = {name: max(1, round(min_run_s / max(_per_call_ms(f, a, 1) / 1e3, 1e-6)))
           for name, (f, a) in jitted.items()}
  times: dict[str, list[float]] = {name: [] for name in jitted}
  for r in range(rounds):
    for name in list(jitted) if r % 2 == 0 else reversed(list(jitted)):
      f, a = jitted[name]
      times[name].append(_per_call_ms(f, a, calls[name]))
  return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}


def parts_markdown(rows: dict[str, tuple], rounds: int, shape=(8, 256, 256)) -> str:
  lines = [f"one leaf of shape {shape} ({shape[0] * shape[1] * shape[2]:,} values), "
           f"median (range) over {rounds} interleaved rounds; jax {jax.__version__}, "
           f"{os.cpu_count()} cores, load {_load()}", "", "| piece | ms per call |", "|---|---:|"]
  lines += [f"| {name} | {m:.3f} ({lo:.3f}-{hi:.3f}) |" for name, (m, lo, hi) in rows.items()]
  return "\n".join(lines)


def run(rounds: int = 7, min_run_s: float = 1.0, quick: bool = False) -> list[dict[str, Any]]:
  return [time_model(m, rounds, min_run_s) for m in models(quick)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (at least 3)")
  parser.add_argument("--min-run-s", type=float, default=1.0, help="seconds a timed run")
  parser.add_argument("--quick", action="store_true", help="a tiny decoder, seconds (tests)")
  parser.add_argument("--parts", action="store_true",
                      help="where an 8-bit update's time goes, on one leaf")
  args = parser.parse_args()
  if args.parts:
    print(parts_markdown(parts(max(3, args.rounds)), max(3, args.rounds)))
    return
  print(markdown(run(max(3, args.rounds), args.min_run_s, args.quick), max(3, args.rounds)))


if __name__ == "__main__":
  main()
