"""``--offload-cost``: the transfer model of ``optfuse._analysis._offload_cost`` on the big
scanned decoders, per offload choice, mode and chip, and its table.

For each decoder of ``MODELS`` at batch 1, each offload choice and each mode, the bytes the step
moves come from its plan (``plan_bytes``, compile-free), its matmul FLOPs from ``step_flops``;
each chip of ``optfuse._targets._hosts.CHIPS`` then gives the transfer and matmul times and the
batch from which the transfer hides (``cost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optax

from optfuse import _fuse
from optfuse._analysis._offload_cost import cost, moved_bytes, plan_bytes, step_flops
from optfuse._targets import _compiled, _hosts
from optfuse.bench import _models, _suite

# The offload choices the model and the CPU timing compare; each is ``optfuse.fuse``'s
# ``offload=``.
OFFLOADS = ("state", "params")
STEP_MODES = ("backward", "forward")
MODELS = {"decoder_1.3b": _suite.DECODER_1_3B, "decoder_6.6b": _suite.DECODER_6_6B}


def run(models: Sequence[str] | None = None, offloads: Sequence[str] = OFFLOADS,
        modes: Sequence[str] = STEP_MODES, chips: Sequence[str] = tuple(_hosts.CHIPS)
        ) -> list[dict[str, Any]]:
  """One row per (model, offload, mode, chip): the bytes the step moves (AdamW, float32), its
  transfer and matmul times at batch 1 and the batch from which the transfer hides;
  ``models``: names of ``MODELS`` (default all)."""
  env = _suite.environment()
  rows = []
  for name in MODELS if models is None else models:
    c = MODELS[name]._replace(batch=1)
    model = _models.decoder(c, scanned=True, remat=True)
    params, batch = _models.abstract(model.params), _models.abstract(model.batch)
    flops = step_flops(c)
    for offload in offloads:
      for mode in modes:
        fx = _fuse.fuse(optax.adamw(1e-3), mode=mode, offload=offload)
        param, other = plan_bytes(fx, model.loss, params, batch)
        moved = moved_bytes(param, other)
        for chip in chips:
          spec = _hosts.CHIPS[chip]
          rows.append({**env, "section": "offload_cost", "model": name, "offload": offload,
                       "mode": mode, "chip": chip, "chip_label": spec.name,
                       "param_host_bytes": param, "other_host_bytes": other,
                       "reads": moved.reads, "writes": moved.writes, "flops_batch_1": flops,
                       **cost(moved, flops, spec)._asdict(), "layers": c.layers, "dim": c.dim,
                       "seq": c.seq})
  return rows


def _seconds(s: float | None) -> str:
  return "-" if s is None else f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.0f} ms"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
  """Per model: the bytes of each step, then per chip the transfer and matmul times at batch 1
  and the batch from which the transfer hides; then the chips' figures and their sources."""
  out = []
  chips = list(dict.fromkeys(r["chip"] for r in rows))
  for name in dict.fromkeys(r["model"] for r in rows):
    got = [r for r in rows if r["model"] == name]
    first = got[0]
    out += [f"**{name}** ({first['layers']} layers of d={first['dim']}, T={first['seq']}, "
            "AdamW, float32). Per chip: transfer / matmuls at batch 1, and the batch from which "
            "the transfer hides (link not published: the link it needs at batch 1).", "",
            "| offload | mode | read a step | written a step | "
            + " | ".join(_hosts.CHIPS[c].name for c in chips) + " |",
            "|---|---|---:|---:|" + "---|" * len(chips)]
    for key in dict.fromkeys((r["offload"], r["mode"]) for r in got):
      by_chip = {r["chip"]: r for r in got if (r["offload"], r["mode"]) == key}
      cells = []
      for chip in chips:
        r = by_chip[chip]
        if r["hiding_batch"] is None:
          cells.append(f"needs {r['link_needed'] / 1e9:.0f} GB/s at batch 1")
        else:
          cells.append(f"{_seconds(r['transfer_s'])} / {_seconds(r['matmul_s'])}: batch "
                       f"{r['hiding_batch']}")
      any_row = next(iter(by_chip.values()))
      out.append(f"| {key[0]} | {key[1]} | {_compiled.format_bytes(any_row['reads'])} | "
                 f"{_compiled.format_bytes(any_row['writes'])} | " + " | ".join(cells) + " |")
    out.append("")
  out += ["Sources (peak FLOP/s; host link each way):", ""]
  out += [f"- {_hosts.CHIPS[c].name}: {_hosts.CHIPS[c].peak_flops / 1e12:.0f} TFLOP/s, "
          f"{_hosts.CHIPS[c].flops_source}; link "
          + ("not published" if _hosts.CHIPS[c].link_bytes_per_s is None else
             f"{_hosts.CHIPS[c].link_bytes_per_s / 1e9:.0f} GB/s")
          + f", {_hosts.CHIPS[c].link_source}" for c in chips]
  return "\n".join(out) + "\n"
