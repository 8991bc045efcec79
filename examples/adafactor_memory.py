"""Adafactor's factored moments updated layer by layer: the compiled peaks against optax's.

Compiles (compile-only, nothing allocated) an 8-layer scanned remat decoder (d=512, ff 2048,
vocab 1024, batch 4 x 128 tokens, float32) with ``optax.adafactor`` as optax's step (mode
"off") and with backward fusion. Each stacked matrix, (8, 512, 2048) say, has its second moment
factored over its two largest axes, so its moments v_row (8, 512) and v_col (8, 2048) keep the
layer axis: with ``clipping_threshold=None, multiply_by_parameter_scale=False`` (factoring only)
every stacked leaf is updated inside the backward loop, and the stacked gradient never exists.
Adafactor's defaults are the comparison row: their two block RMS statistics (of each whole
stacked update and param) mix the layers, so the stacked leaves are updated after the loop.

Usage::

  python examples/adafactor_memory.py                    # XLA:CPU
  python examples/adafactor_memory.py --target tpu-v5e   # the TPU compiler (pip extra "tpu")

Every memory figure is XLA's buffer assignment for the target's compiler: deterministic for given
versions of jax, optax and the target's compiler.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import optax

import optfuse
from optfuse._targets._compiled import format_bytes
from optfuse.bench import _models

LR = 1e-3
CONFIG = _models.DecoderConfig(layers=8, dim=512, heads=8, ff=2048, vocab=1024, seq=128, batch=4)
OPTIMIZERS = {
    "adafactor, factoring only": dict(clipping_threshold=None, multiply_by_parameter_scale=False),
    "adafactor, defaults": {},
}


def optimizer(name: str, min_dim_size_to_factor: int = 128) -> optax.GradientTransformation:
  """``optax.adafactor`` with the options ``OPTIMIZERS[name]``."""
  return optax.adafactor(LR, min_dim_size_to_factor=min_dim_size_to_factor, **OPTIMIZERS[name])


def measure(model: _models.Model, name: str, target: str | None = None,
            min_dim_size_to_factor: int = 128) -> dict[str, Any]:
  """The stacked leaves' placements (``describe``) and the peaks of optax's and the
  backward-fused step (``memory_report``) of optimizer ``name`` on ``model``."""
  tx = optimizer(name, min_dim_size_to_factor)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  where = optfuse.describe(tx, model.loss, params, *batch)
  stacked = [leaf for leaf in where if leaf.startswith("['layers']")]
  report = optfuse.memory_report(model.loss, tx, params, *batch, target=target)
  return {"optimizer": name, "target": target or "cpu",
          "in_loop": sum(where[leaf] == "loop" for leaf in stacked), "stacked": len(stacked),
          "reasons": sorted({where.reasons[leaf] for leaf in stacked if leaf in where.reasons}),
          "optax": report["off"]["peak_bytes"], "backward": report["backward"]["peak_bytes"],
          "stacked_grad": _models.grad_bytes(params["layers"])}


def markdown(rows: list[dict[str, Any]]) -> str:
  """One line per (optimizer, target): the stacked leaves in the loop, both peaks, the saving
  and its share of the stacked gradient."""
  out = ["| optimizer | target | stacked leaves in the loop | optax | backward | saved "
         "| saved / stacked gradient |", "|---|---|---|---:|---:|---:|---:|"]
  for r in rows:
    saved = r["optax"] - r["backward"]
    out.append(f"| {r['optimizer']} | {r['target']} | {r['in_loop']} of {r['stacked']} "
               f"| {format_bytes(r['optax'])} | {format_bytes(r['backward'])} "
               f"| {format_bytes(saved)} | {saved / r['stacked_grad']:.2f} |")
  reasons = sorted({why for r in rows for why in r["reasons"]})
  return "\n".join(out + [f"\nafter the loop: {why}" for why in reasons])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", help="a compile target (default: this machine)")
  args = parser.parse_args()
  model = _models.decoder(CONFIG, scanned=True, remat=True)
  rows = [measure(model, name, args.target) for name in OPTIMIZERS]
  print(f"{model.description}; stacked gradient "
        f"{format_bytes(rows[0]['stacked_grad'])}; jax {jax.__version__}, "
        f"optax {optax.__version__}")
  print(markdown(rows))


if __name__ == "__main__":
  main()
