"""Device, host and host-link bytes a step with the optimizer state in 32, 8 or 4 bits.

Compiles (compile-only, nothing allocated) the bench's scanned remat decoders with AdamW, the
state as optax keeps it (float32) or in ``optfuse.low_bit(tx, bits=8|4)``, for each target, and
prints one markdown table per table asked:

- ``state``: backward fusion with and without ``offload="state"``, per model, target and bits;
- ``clip``: ``clip_by_global_norm(1.0)`` before AdamW on the 1.3B decoder: optax, two-pass
  backward fusion, forward fusion, and forward fusion with the state and pending gradient
  streamed, per bits (docs/modes.md);
- ``hide``: the 1.3B decoder's backward fusion with ``offload="state"``: the bytes a step moves
  across the host link, and the tokens a step above which that transfer hides behind compute on
  each GPU of the registry (docs/offload.md's cost model, with NVIDIA's published figures:
  arithmetic, not a timing).

Usage::

  python examples/low_bit_memory.py --table state --targets cpu,tpu-v5e,h100
  python examples/low_bit_memory.py --table clip --targets tpu-v5e,h100
  python examples/low_bit_memory.py --table hide --targets h100

Every figure is XLA's buffer assignment for the target's compiler: deterministic for given
versions of jax, libtpu and the CUDA plugin.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import optax

import optfuse
from optfuse._analysis import _memory
from optfuse._targets._compiled import format_bytes
from optfuse.bench import _models, _suite, _what_fits

MODELS = {"1.3b": _suite.DECODER_1_3B, "6.6b": _suite.DECODER_6_6B,
          "tiny": _models.DecoderConfig(layers=4, dim=256, heads=2, ff=512, vocab=256, seq=8,
                                        batch=1)}
BITS = (32, 8, 4)
# step name -> (mode, offload, global_ops, clipped)
STATE_STEPS = {"backward": ("backward", None, None, False),
               "backward + offload": ("backward", "state", None, False)}
CLIP_STEPS = {"optax": ("off", None, None, True),
              "two-pass backward": ("backward", None, "two_pass", True),
              "forward": ("forward", None, None, True),
              "forward + offload": ("forward", "state", None, True)}
HIDE_STEPS = {"backward + offload": STATE_STEPS["backward + offload"]}
# NVIDIA's datasheets: dense bf16 (T4: fp16) tensor FLOP/s, and the PCIe host link's bytes/s
# each way (half the bidirectional figure they print). Google publishes no host-link figure for
# its TPUs, so they have no row.
GPUS = {"T4": (65e12, 16e9, "PCIe Gen3 x16"), "L4": (121e12, 32e9, "PCIe Gen4 x16"),
        "A100 SXM": (312e12, 32e9, "PCIe Gen4 x16"), "H100 SXM": (989e12, 64e9, "PCIe Gen5 x16"),
        "H200 SXM": (989e12, 64e9, "PCIe Gen5 x16")}
# FLOPs a step spends per parameter and token: 6 (forward and backward). Remat adds a forward
# (8), which hides more, so 6 is the conservative count.
FLOPS_PER_PARAM_TOKEN = 6


def tx_of(clipped: bool) -> optax.GradientTransformation:
  adamw = optax.adamw(1e-3)
  return optax.chain(optax.clip_by_global_norm(1.0), adamw) if clipped else adamw


def measure(model_name: str, target: str, step: str, bits: int, steps: dict) -> dict[str, Any]:
  """One compile: the row of (model, target, step, bits)."""
  mode, offload, global_ops, clipped = steps[step]
  c = MODELS[model_name]
  model = _models.decoder(c, scanned=True, remat=True)
  params = _models.abstract(model.params)
  tx = _memory.with_state_bits(tx_of(clipped), bits)
  fx = optfuse.fuse(tx, mode=mode, global_ops=global_ops, offload=offload)
  row = {"model": model_name, "target": target, "step": step, "bits": bits,
         "params": _models._num_params(model.params),
         "state_bytes": _state_bytes(fx, params)}
  try:
    memory = _memory.step_memory(fx, model.loss, params, _models.abstract(model.batch),
                                 target=_what_fits.resolve(target))
  except _memory.UNAVAILABLE_ERRORS as e:
    return {**row, "unavailable": _memory.error_line(e)}
  if isinstance(memory, _memory.DoesNotFit):
    return {**row, "needs_bytes": memory.needed_bytes}
  return {**row, **memory}


def _state_bytes(fx, params) -> int:
  import jax
  init = optfuse.fuse(fx.tx, fx.mode, fx.global_ops).init
  return sum(_models.nbytes(x) for x in jax.tree.leaves(jax.eval_shape(init, params)))


def _cell(row: dict[str, Any]) -> str:
  if "unavailable" in row:
    return "refused"
  if "peak_bytes" not in row:
    return f"needs {format_bytes(row['needs_bytes'])}" if row["needs_bytes"] else "does not fit"
  host = f" + {format_bytes(row['host_bytes'])} host" if row["host_bytes"] else ""
  return f"{format_bytes(row['peak_bytes'])}{host}"


def markdown(rows: list[dict[str, Any]]) -> str:
  """One line per (model, step, bits): the state's bytes, then per target device (+ host) bytes
  and link bytes a step."""
  targets = list(dict.fromkeys(r["target"] for r in rows))
  out = ["| model | step | state | state bytes | "
         + " | ".join(f"{t}: device (+ host) | {t}: link a step" for t in targets) + " |",
         "|---|---|---|---:|" + "---:|---:|" * len(targets)]
  keys = dict.fromkeys((r["model"], r["step"], r["bits"]) for r in rows)
  for model, step, bits in keys:
    got = {r["target"]: r for r in rows
           if (r["model"], r["step"], r["bits"]) == (model, step, bits)}
    first = next(iter(got.values()))
    cells = []
    for t in targets:
      r = got.get(t)
      link = r.get("host_transfer_bytes") if r else None
      cells += [_cell(r) if r else "-", format_bytes(link) if link else "-"]
    label = "f32" if bits == 32 else f"{bits}-bit"
    out.append(f"| {model} | {step} | {label} | {format_bytes(first['state_bytes'])} | "
               + " | ".join(cells) + " |")
  return "\n".join(out)


def hide_markdown(rows: list[dict[str, Any]]) -> str:
  """The link bytes a step per state width (``memory_report``'s ``host_transfer_bytes`` of the
  first target measured: a TPU's loops read one row of each stack more than a GPU's, their
  prefetch), then per GPU the tokens a step above which the transfer hides
  (``bytes each way / bandwidth <= 6 params tokens / (FLOP/s x MFU)``)."""
  link = {}
  for r in rows:
    if r.get("host_transfer_bytes"):
      width = "f32" if r["bits"] == 32 else f"{r['bits']}-bit"
      link.setdefault(width, (r["host_transfer_bytes"], r["params"]))
  first = link.get("f32", next(iter(link.values())))[0]
  out = ["| state | link bytes a step | per param, each way | against f32 |",
         "|---|---:|---:|---:|"]
  out += [f"| {w} | {format_bytes(b)} | {b / 2 / n:.2f} B | "
          f"{'-' if b == first else f'{first / b:.2f}x less'} |" for w, (b, n) in link.items()]
  out += ["", "| GPU | dense bf16 | host link, each way | " + " | ".join(
      f"{w}: tokens a step to hide it (100 % / 40 % MFU)" for w in link) + " |",
          "|---|---:|---:|" + "---:|" * len(link)]
  for gpu, (flops, bandwidth, bus) in GPUS.items():
    tokens = [b / 2 / n / FLOPS_PER_PARAM_TOKEN * flops / bandwidth for b, n in link.values()]
    out.append(f"| {gpu} | {flops / 1e12:.0f} TFLOP/s | {bandwidth / 1e9:.0f} GB/s ({bus}) | "
               + " | ".join(f"{t:,.0f} / {0.4 * t:,.0f}" for t in tokens) + " |")
  return "\n".join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--table", choices=("state", "clip", "hide"), default="state")
  parser.add_argument("--targets", default="cpu,tpu-v5e,h100",
                      help="comma-separated: cpu, tpu-v5e, h100 (optfuse.targets())")
  parser.add_argument("--models", default="1.3b,6.6b", help="1.3b, 6.6b (state table)")
  parser.add_argument("--bits", default="32,8,4")
  parser.add_argument("--json", help="append each row to this JSON-lines file as it is measured")
  args = parser.parse_args()
  targets, bits = args.targets.split(","), [int(b) for b in args.bits.split(",")]
  steps = {"clip": CLIP_STEPS, "hide": HIDE_STEPS}.get(args.table, STATE_STEPS)
  models = ["1.3b"] if args.table in ("clip", "hide") else args.models.split(",")
  rows = []
  for model in models:
    for target in targets:
      for step in steps:
        for b in bits:
          rows.append(measure(model, target, step, b, steps))
          print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
          if args.json:
            with open(args.json, "a") as f:
              f.write(json.dumps(rows[-1]) + "\n")
  print(hide_markdown(rows) if args.table == "hide" else markdown(rows))


if __name__ == "__main__":
  main()
