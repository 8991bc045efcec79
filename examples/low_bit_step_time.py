"""The step time of 8- and 4-bit AdamW state against float32 AdamW, fused, on this machine.

For each of the bench's scanned models (``optfuse/bench/_models.py``: the loop-fusion suite's
8-layer d=256 decoder with and without remat, and the residual dense stack), the training step
``optfuse.fuse(tx, mode="backward").value_and_update(loss)`` is compiled three times: with
``optax.adamw``, with ``optfuse.low_bit(optax.adamw, bits=8)`` and with ``bits=4``. The three
steps are then timed interleaved (``optfuse.bench._timing``: a round runs each step back to
back, the order reversed every round), and each round's low-bit time is divided by that round's
float32 time: the ratios' median and range over the rounds are printed, with the system's load
at the start and end (other processes slow every step alike, but noisier).

Usage::

  python examples/low_bit_step_time.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import jax
import optax

import optfuse
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


def run(rounds: int = 7, min_run_s: float = 1.0, quick: bool = False) -> list[dict[str, Any]]:
  return [time_model(m, rounds, min_run_s) for m in models(quick)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (at least 3)")
  parser.add_argument("--min-run-s", type=float, default=1.0, help="seconds a timed run")
  parser.add_argument("--quick", action="store_true", help="a tiny decoder, seconds (tests)")
  args = parser.parse_args()
  print(markdown(run(max(3, args.rounds), args.min_run_s, args.quick), max(3, args.rounds)))


if __name__ == "__main__":
  main()
