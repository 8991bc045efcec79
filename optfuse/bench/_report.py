"""Benchmark output: the Markdown tables, ``results.json``, ``results.md`` and the ratio plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from optfuse._memory import format_bytes

FLOOR_NOTE = (
    "Floor (estimate): optax's compiled peak minus the whole gradient plus the gradient that must "
    "be live at once even with every update fused at the earliest point (one layer's slice of the "
    "stacked leaves plus the leaves outside the loop for scanned decoders, the largest leaf for "
    "unrolled models, the whole accumulator for gradient accumulation), and at least the step's "
    "inputs plus outputs. It assumes optax holds the whole gradient at its peak: true for scanned "
    "models, optimistic for unrolled ones, where XLA already frees gradients early.")

PEAK_NOTE = ("Peak = argument + temp + output - alias bytes of the compiled step "
             "(`jax.jit(step, donate_argnums=(0, 1))`, `compiled.memory_analysis()`).")


def _ratio(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}x"


def _label(row: dict[str, Any]) -> str:
  return f"{row['model']}/{row['optimizer']}"


def _table(header: Sequence[str], align: str, lines: Sequence[Sequence[str]]) -> list[str]:
  out = ["| " + " | ".join(header) + " |",
         "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
  out += ["| " + " | ".join(cells) + " |" for cells in lines]
  return out


def _unavailable_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
  """One line per (mode, reason): which cells it covers ("every cell" when all)."""
  cells = {_label(r) for r in rows}
  groups: dict[tuple[str, str], list[str]] = {}
  for row in rows:
    for kind in ("unavailable", "failed"):
      if row.get(kind):
        groups.setdefault((kind, row["mode"], row[kind]), []).append(_label(row))
  notes = []
  for (kind, mode, reason), labels in groups.items():
    where = "every cell" if len(labels) == len(cells) else ", ".join(labels)
    what = "not measured" if kind == "unavailable" else "**FAILED**"
    notes.append(f"- `{mode}` {what} ({where}): {reason}")
  return notes


def markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The results as Markdown: the timing table, the compile-only memory table, the notes."""
  env = rows[0]
  out = [f"## optfuse.bench `{env['suite']}`: jax {env['jax_version']}, optax "
         f"{env['optax_version']}, backend {env['backend']} ({env['device_kind']}, "
         f"{env['device_count']} device(s)), {env['cpu_count']} CPUs, load average "
         f"{env['load_average_start']} at the start, {env['load_average_end']} at the end", ""]
  timing = [r for r in rows if r["section"] == "timing"]
  if timing:
    out += ["### Step time, compile time and compiled peak memory (ratios to optax = mode `off`)",
            "", "Step time: median of interleaved runs after warm-up.", ""]
    lines = []
    for r in timing:
      if "step_ms" not in r:
        continue
      lines.append([r["model"], r["optimizer"], r["mode"], f"{r['step_ms']:.2f} ms",
                    _ratio(r["time_ratio"]), f"{r['compile_s']:.2f} s", _ratio(r["compile_ratio"]),
                    format_bytes(r["peak_bytes"]), _ratio(r["peak_ratio"]),
                    format_bytes(r["floor_bytes"]), _ratio(r["peak_vs_floor"])])
    out += _table(["model", "optimizer", "mode", "step", "time vs optax", "compile",
                   "compile vs optax", "peak", "peak vs optax", "floor", "peak vs floor"],
                  "lllrrrrrrrr", lines)
    out += ["", *_unavailable_notes(timing)]
    models = {r["model"]: r["description"] for r in timing}
    out += ["", "Models: " + "; ".join(f"`{m}` {d}" for m, d in models.items()) + "."]
  memory = [r for r in rows if r["section"] == "memory"]
  if memory:
    out += ["", "### Compile-only memory (adamw, float32, `jax.ShapeDtypeStruct` inputs: nothing "
            "allocated)", ""]
    lines = []
    for r in memory:
      if "peak_ratio" not in r:
        continue
      lines.append([r["model"], r["mode"], format_bytes(r["peak_bytes"]),
                    _ratio(r["peak_ratio"]), format_bytes(r["temp_bytes"]),
                    format_bytes(r["grad_bytes"]), format_bytes(r["floor_bytes"]),
                    _ratio(r["peak_vs_floor"])])
    out += _table(["model", "mode", "peak", "peak vs optax", "temp", "gradient", "floor",
                   "peak vs floor"], "llrrrrrr", lines)
    out += ["", *_unavailable_notes(memory)]
    models = {r["model"]: r["description"] for r in memory}
    out += ["", "Models: " + "; ".join(f"`{m}` {d}" for m, d in models.items()) + "."]
  out += ["", PEAK_NOTE, "", FLOOR_NOTE]
  return "\n".join(out) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
  """Writes a PNG of the fused modes' step-time and peak-memory ratios to optax."""
  measured = [r for r in rows if r.get("peak_ratio") is not None and r["mode"] != "off"]
  panels = [("step time / optax", "time_ratio", [r for r in measured if r["time_ratio"]]),
            ("compiled peak memory / optax", "peak_ratio", measured)]
  height = max(3.0, 0.32 * max(len({_label(r) for r in p[2]}) for p in panels) + 1.5)
  # A bare Figure (no pyplot): no global backend or figure state is touched.
  fig = Figure(figsize=(13, height))
  axes = fig.subplots(1, 2)
  modes = sorted({r["mode"] for r in measured})
  for ax, (title, key, panel) in zip(axes, panels, strict=True):
    labels = list(dict.fromkeys(
        _label(r) + (" (compile only)" if r["section"] == "memory" else "") for r in panel))
    width = 0.8 / max(1, len(modes))
    for k, mode in enumerate(modes):
      ys, xs = [], []
      for r in panel:
        if r["mode"] == mode:
          name = _label(r) + (" (compile only)" if r["section"] == "memory" else "")
          ys.append(labels.index(name) + (k - (len(modes) - 1) / 2) * width)
          xs.append(r[key])
      ax.barh(ys, xs, height=width, label=mode)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel("ratio (1.0 = optax)")
    ax.legend(loc="best", fontsize=8)
  env = rows[0]
  fig.suptitle(f"optfuse.bench {env['suite']}: {env['backend']} ({env['device_kind']}), "
               f"jax {env['jax_version']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def write(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``results.json``, ``results.md`` and ``results.png`` into ``out_dir``.

  Returns:
    name -> path of the files written.
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {name: os.path.join(out_dir, f"results.{name}") for name in ("json", "md", "png")}
  with open(paths["json"], "w") as f:
    json.dump(list(rows), f, indent=1)
  with open(paths["md"], "w") as f:
    f.write(markdown(rows))
  plot(rows, paths["png"])
  return paths
