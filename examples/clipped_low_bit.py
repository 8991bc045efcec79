"""The clipped run with 8-bit state: which mode saves what on TPU v5e and H100, and the host link.

LLM training clips by the global norm before AdamW by default (MaxText-style). Backward fusion
refuses that optimizer (each leaf's update reads every gradient through the norm), so the modes
that save memory for it are two-pass backward fusion (the backward pass twice: about 1.9x the step
time) and forward fusion with the state and the pending gradient streamed from host memory. This
script compiles, for each target and without running anything, the bench's 1.3B scanned remat
decoder (24 layers of d=2048, ff 8192, vocab 32000, T 2048, B 1) with
``clip_by_global_norm(1.0)`` + AdamW, its state in float32 and in 8 bits
(``optfuse.low_bit``):

1. optax's step, two-pass backward fusion, forward fusion, and forward fusion with
   ``offload="state"``: device peak, host bytes and bytes a step across the host link;
2. ``--link``: backward fusion with ``offload="state"`` for plain AdamW in 32, 8 and 4 bits:
   the bytes a step moves across the host link, and the tokens per step above which that
   transfer hides behind the step's compute on each GPU of the registry (arithmetic from
   NVIDIA's published figures, not a timing).

Usage::

  python examples/clipped_low_bit.py --target tpu-v5e,h100
  python examples/clipped_low_bit.py --link --target h100
"""

from __future__ import annotations

import argparse

import jax
import optax

import optfuse
from optfuse.bench import _models, _suite

CLIPPED = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
# NVIDIA's datasheets: dense bf16 (T4: fp16) tensor FLOP/s, and the PCIe host link's bytes/s in
# each direction (half the bidirectional figure they print).
GPUS = {"T4": (65e12, 16e9, "PCIe Gen3 x16"), "L4": (121e12, 32e9, "PCIe Gen4 x16"),
        "A100 SXM": (312e12, 32e9, "PCIe Gen4 x16"), "H100 SXM": (989e12, 64e9, "PCIe Gen5 x16"),
        "H200 SXM": (989e12, 64e9, "PCIe Gen5 x16")}
# FLOPs a step spends per parameter and token: 6 (forward and backward); remat adds a forward
# (8), which hides more, so 6 is the conservative count.
FLOPS_PER_PARAM_TOKEN = 6


def _gb(x: int | None) -> str:
  return "-" if x is None else f"{x / 1e9:.2f} GB"


def _cell(report: optfuse.MemoryReport, mode: str) -> str:
  """A mode's device peak, host bytes and link bytes, or what the compiler needed."""
  if mode in report.does_not_fit:
    return f"needs {_gb(report.does_not_fit[mode].needed_bytes)}"
  if mode not in report:
    return f"refused ({report.unavailable[mode].partition(':')[0]})"
  row = report[mode]
  cell = f"{_gb(row['peak_bytes'])}"
  if row["host_bytes"] or row["link_bytes"]:
    cell += f" + {_gb(row['host_bytes'])} host, {_gb(row['link_bytes'])} link"
  return cell


def _target(name: str) -> str | None:
  return None if name == "cpu" else name  # "cpu": this machine's backend


def clipped_table(model: _models.Model, targets: list[str]) -> str:
  """The markdown table of part 1: one row per step, a column per (target, state bits)."""
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  columns, cells = [], {}
  for target in targets:
    for bits in (None, 8):
      name = f"{target}, {'float32' if bits is None else f'{bits}-bit'} state"
      two_pass = optfuse.memory_report(model.loss, CLIPPED, params, *batch,
                                       target=_target(target), state_bits=bits,
                                       global_ops="two_pass")
      offload = optfuse.memory_report(model.loss, CLIPPED, params, *batch,
                                      target=_target(target), state_bits=bits, offload="state")
      columns.append(name)
      cells[name] = {"optax": _cell(two_pass, "off"),
                     "two-pass backward fusion": _cell(two_pass, "backward"),
                     "forward fusion": _cell(two_pass, "forward"),
                     "forward fusion, state and gradient streamed": _cell(offload, "forward")}
      print(f"compiled {name}", flush=True)
  steps = list(cells[columns[0]])
  lines = ["| step | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
  lines += [f"| {step} | " + " | ".join(cells[c][step] for c in columns) + " |" for step in steps]
  return "\n".join(lines)


def link_table(model: _models.Model, target: str) -> str:
  """The markdown tables of part 2: link bytes per state width, and where they hide."""
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  count = sum(x.size for x in jax.tree.leaves(params))
  rows, per_step = [], {}
  for bits in (None, 8, 4):
    report = optfuse.memory_report(model.loss, optax.adamw(1e-3), params, *batch,
                                   target=_target(target), state_bits=bits, offload="state")
    row = report["backward"]
    width = "float32" if bits is None else f"{bits}-bit"
    per_step[width] = row["link_bytes"]
    rows.append(f"| {width} | {_gb(row['host_bytes'])} | {_gb(row['link_bytes'])} | "
                f"{row['link_bytes'] / count:.2f} | {_gb(row['peak_bytes'])} |")
  first = per_step["float32"]
  lines = [f"{model.description}: {count / 1e9:.2f}B params, backward fusion with "
           f"offload='state', AdamW, on {target}", "",
           "| state | host bytes | link bytes a step | link bytes per param | device peak |",
           "|---|---:|---:|---:|---:|", *rows, "",
           "reduction of the link bytes against float32: " + ", ".join(
               f"{w} {first / b:.2f}x" for w, b in per_step.items() if w != "float32"), "",
           "| GPU | dense bf16 | host link, each way | " + " | ".join(
               f"tokens a step to hide it, {w} (100 % / 40 % MFU)" for w in per_step) + " |",
           "|---|---:|---:|" + "---:|" * len(per_step)]
  for gpu, (flops, link, bus) in GPUS.items():
    # The link moves half the bytes each way at once; the step computes 6 FLOPs/param/token.
    need = {w: b / 2 / link * flops / (FLOPS_PER_PARAM_TOKEN * count) for w, b in per_step.items()}
    lines.append(f"| {gpu} | {flops / 1e12:.0f} TFLOP/s | {link / 1e9:.0f} GB/s ({bus}) | "
                 + " | ".join(f"{n:,.0f} / {0.4 * n:,.0f}" for n in need.values()) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="tpu-v5e,h100",
                      help="comma-separated compile targets (optfuse.targets())")
  parser.add_argument("--layers", type=int, default=24, help="decoder depth (d=2048, T=2048)")
  parser.add_argument("--link", action="store_true",
                      help="part 2 only: the host-link bytes of AdamW in 32, 8 and 4 bits")
  args = parser.parse_args()
  model = _models.decoder(_suite.DECODER_1_3B._replace(layers=args.layers), scanned=True,
                          remat=True)
  targets = args.target.split(",")
  print(f"jax {jax.__version__}, optax {optax.__version__}")
  if args.link:
    print(link_table(model, targets[0]))
  else:
    print(f"{model.description}, clip_by_global_norm(1.0) + AdamW: device peak per chip, host "
          "bytes, bytes a step across the host link")
    print(clipped_table(model, targets))


if __name__ == "__main__":
  main()
