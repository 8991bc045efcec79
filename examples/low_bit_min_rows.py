"""From how many layers does a low-bit state pay to update row by row? Compiled peaks, both ways.

Backward fusion of a scanned remat decoder (d=512, ff 2048, vocab 4096, T=256, batch 2) with
AdamW in float32, 8 and 4 bits, compiled with every stacked leaf updated whole after the loop
and row by row inside it (the planner's threshold, ``Plan.min_rows``, set to never and to 2);
compile-only, so any target of ``optfuse.targets()`` answers from this CPU. The docs' low-bit
page shows the table.

Usage::

  python examples/low_bit_min_rows.py                    # XLA:CPU, about a minute
  python examples/low_bit_min_rows.py --target tpu-v5e   # the TPU compiler (pip extra "tpu")
"""

from __future__ import annotations

import argparse

import optax

import optfuse
from optfuse._analysis import _memory
from optfuse._plan import _row_checks
from optfuse._targets import _registry
from optfuse.bench import _models


def peak(layers: int, bits: int | None, rows: bool, target) -> float:
  """The compiled peak (MB) of the fused step, its stacked leaves updated row by row (``rows``)
  or whole."""
  config = _models.DecoderConfig(layers=layers, dim=512, heads=8, ff=2048, vocab=4096, seq=256,
                                 batch=2)
  model = _models.decoder(config, scanned=True, remat=True)
  threshold = _row_checks.RowChecks.min_rows
  _row_checks.RowChecks.min_rows = lambda self, i: 2 if rows else layers + 1
  try:
    fx = optfuse.fuse(_memory.with_state_bits(optax.adamw(1e-3), bits), mode="backward")
    memory = _memory.step_memory(fx, model.loss, _models.abstract(model.params),
                                 tuple(_models.abstract(model.batch)), target=target)
  finally:
    _row_checks.RowChecks.min_rows = threshold
  return memory["peak_bytes"] / 1e6


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", help="a compile target (default: this machine)")
  args = parser.parse_args()
  target = None if args.target is None else _registry.resolve(args.target)
  print("| layers | state | whole | row by row |\n|---:|---|---:|---:|")
  for layers in (2, 3, 4, 5):
    for bits in (None, 8, 4):
      whole, rows = (peak(layers, bits, looped, target) for looped in (False, True))
      print(f"| {layers} | {'float32' if bits is None else f'{bits}-bit'} | {whole:.1f} MB "
            f"| {rows:.1f} MB |", flush=True)


if __name__ == "__main__":
  main()
