"""The optimizers chosen for memory or per-layer adaptivity, fused layer by layer: compiled peaks.

Compiles (compile-only, nothing allocated) an 8-layer scanned remat decoder (d=512, ff 2048,
vocab 1024, batch 4 x 128 tokens, float32, donated params and state) for each optimizer, as
optax's step (mode "off"), as backward fusion in one pass, and as two-pass backward
(``global_ops="two_pass"``), and says where each stacked leaf is updated (``describe``).

* Adafactor's factored moments of an (L, d, ff) leaf, v_row (L, d) and v_col (L, ff), have a
  row per layer, so factoring alone fuses in one pass.
* Statistics over a whole stacked leaf mix the layers: LAMB's and LARS's trust ratios,
  Adafactor's block RMS and parameter scale, ``clip_by_block_rms``, novograd's per-leaf second
  moment, SM3's accumulators of a leaf's non-layer axes (maxima over the layers). One pass
  updates those leaves after the loop; two-pass backward reduces the statistics row by row in
  a first sweep and updates row by row in the second, so the stacked gradient never exists.

``--time`` times instead what the two passes cost on this machine: for each optimizer, optax's
step, the one-pass backward step and the two-pass one on the bench's 8-layer d=256 decoder
(``_suite.MEDIUM``, remat), run interleaved (``optfuse.bench._timing``: a round runs each step
back to back, the order reversed every round); each round's time is divided by that round's
optax time, and the ratios' median and range over the rounds are printed with the load.

Usage::

  python examples/optimizer_memory.py                    # XLA:CPU
  python examples/optimizer_memory.py --target tpu-v5e   # the TPU compiler (pip extra "tpu")
  python examples/optimizer_memory.py --only adafactor   # the optimizers whose name has it
  python examples/optimizer_memory.py --time --rounds 7  # step time against optax's, here

Every memory figure is XLA's buffer assignment for the target's compiler: deterministic for given
versions of jax, optax and the target's compiler.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import jax
import optax

import optfuse
from optfuse._targets._compiled import format_bytes
from optfuse.bench import _models, _suite, _timing

LR = 1e-3
CONFIG = _models.DecoderConfig(layers=8, dim=512, heads=8, ff=2048, vocab=1024, seq=128, batch=4)
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": lambda **_: optax.adamw(LR),
    "adafactor (defaults)": lambda **kw: optax.adafactor(LR, **kw),
    "adafactor (factoring only)": lambda **kw: optax.adafactor(
        LR, clipping_threshold=None, multiply_by_parameter_scale=False, **kw),
    "lamb": lambda **_: optax.lamb(LR),
    "lars": lambda **_: optax.lars(LR),
    "novograd": lambda **_: optax.novograd(LR),
    "sm3": lambda **_: optax.sm3(LR),
    "chain(clip_by_block_rms(1.0), adam)": lambda **_: optax.chain(optax.clip_by_block_rms(1.0),
                                                                   optax.adam(LR)),
}
FUSED = {"backward": {}, "two-pass": {"global_ops": "two_pass"}}


def optimizer(name: str, min_dim_size_to_factor: int | None = None
              ) -> optax.GradientTransformation:
  """``OPTIMIZERS[name]``; Adafactor's with ``min_dim_size_to_factor`` where given."""
  kw = {} if min_dim_size_to_factor is None else {"min_dim_size_to_factor": min_dim_size_to_factor}
  return OPTIMIZERS[name](**kw)


def measure(model: _models.Model, name: str, target: str | None = None,
            min_dim_size_to_factor: int | None = None) -> dict[str, Any]:
  """Where ``describe`` puts the stacked leaves, one pass and two-pass, and the compiled peaks
  of optax's step and of both fused steps (``memory_report``)."""
  tx = optimizer(name, min_dim_size_to_factor)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  row: dict[str, Any] = {"optimizer": name, "target": target or "cpu",
                         "stacked_grad": _models.grad_bytes(params["layers"])}
  for form, options in FUSED.items():
    where = optfuse.describe(tx, model.loss, params, *batch,
                             options=optfuse.FuseOptions(**options))
    stacked = [leaf for leaf in where if leaf.startswith("['layers']")]
    report = optfuse.memory_report(model.loss, tx, params, *batch, target=target, **options)
    row["optax"] = report["off"]["peak_bytes"]
    row[form] = report["backward"]["peak_bytes"]
    row[f"{form} in loop"] = (sum(where[leaf] == "loop" for leaf in stacked), len(stacked))
    row[f"{form} reasons"] = sorted({where.reasons[leaf] for leaf in stacked
                                     if leaf in where.reasons})
  return row


def markdown(rows: list[dict[str, Any]]) -> str:
  """One line per (optimizer, target): the peaks, the best fused step's saving as a share of
  the stacked gradient, and how many stacked leaves each fused step updates in its loop."""
  out = ["| optimizer | target | optax | backward | two-pass | saved / stacked gradient "
         "| stacked leaves in the loop (backward, two-pass) |",
         "|---|---|---:|---:|---:|---:|---|"]
  for r in rows:
    saved = r["optax"] - min(r[form] for form in FUSED)
    loops = ", ".join("{} of {}".format(*r[f"{form} in loop"]) for form in FUSED)
    out.append(f"| {r['optimizer']} | {r['target']} | {format_bytes(r['optax'])} "
               f"| {format_bytes(r['backward'])} | {format_bytes(r['two-pass'])} "
               f"| {saved / r['stacked_grad']:.0%} | {loops} |")
  reasons = sorted({why for r in rows for why in r["two-pass reasons"]})
  return "\n".join(out + [f"\ntwo-pass, after the loop: {why}" for why in reasons])


STEPS = {"optax": {"mode": "off"}, "backward": {"mode": "backward"},
         "two-pass": {"mode": "backward", "global_ops": "two_pass"}}


def time_optimizer(model: _models.Model, name: str, rounds: int, min_run_s: float,
                   min_dim_size_to_factor: int | None = None) -> dict[str, Any]:
  """Each step of ``STEPS`` with optimizer ``name``, timed interleaved: ``{"ratio": {step:
  (median, low, high)}}`` over the rounds of its time over optax's in the same round, the
  median optax step in ms, the steps per run and the load at the start and end."""
  params, batch = _models.materialize(model.params, 0), _models.materialize(model.batch, 1)
  load_start, trainers = round(os.getloadavg()[0], 2), {}
  for step, options in STEPS.items():
    fx = optfuse.fuse(optimizer(name, min_dim_size_to_factor), **options)
    compiled, _ = _timing.compile_step(fx, model.loss, params, batch)
    p = jax.tree.map(lambda x: x.copy(), params)
    trainers[step] = _timing.Trainer(compiled, p, fx.init(p), batch)
  timing = _timing.interleaved(trainers, "optax", rounds, warmup=2, min_run_s=min_run_s)
  return {"optimizer": name, "optax_ms": 1e3 * timing.step_s["optax"],
          "ratio": {s: (statistics.median(r), min(r), max(r)) for s, r in timing.ratios.items()},
          "steps_per_run": timing.steps_per_run, "load": (load_start, round(os.getloadavg()[0], 2))}


def time_markdown(model: _models.Model, rows: list[dict[str, Any]], rounds: int) -> str:
  out = [f"{model.description}; median (range) over {rounds} interleaved rounds; jax "
         f"{jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores",
         "| optimizer | optax step (ms) | backward / optax | two-pass / optax | steps a run "
         "| load (start, end) |", "|---|---:|---|---|---:|---|"]
  for r in rows:
    cells = " | ".join("{:.2f}x ({:.2f}-{:.2f})".format(*r["ratio"][s])
                       for s in ("backward", "two-pass"))
    out.append(f"| {r['optimizer']} | {r['optax_ms']:.1f} | {cells} | {r['steps_per_run']} "
               f"| {r['load'][0]}, {r['load'][1]} |")
  return "\n".join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", help="a compile target (default: this machine)")
  parser.add_argument("--only", default="", help="measure the optimizers whose name has this")
  parser.add_argument("--time", action="store_true", help="time the steps here instead")
  parser.add_argument("--rounds", type=int, default=7, help="--time's interleaved rounds")
  args = parser.parse_args()
  if args.time:
    model = _models.decoder(_suite.MEDIUM, scanned=True, remat=True)
    rows = [time_optimizer(model, name, args.rounds, min_run_s=1.0)
            for name in OPTIMIZERS if args.only in name]
    print(time_markdown(model, rows, args.rounds))
    return
  model = _models.decoder(CONFIG, scanned=True, remat=True)
  rows = [measure(model, name, args.target) for name in OPTIMIZERS if args.only in name]
  print(f"{model.description}; stacked gradient {format_bytes(rows[0]['stacked_grad'])}; "
        f"jax {jax.__version__}, optax {optax.__version__}")
  print(markdown(rows))


if __name__ == "__main__":
  main()
