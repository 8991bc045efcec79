"""Benchmark output: the Markdown tables, ``results.json``, ``results.md``, the ratio plot, and
the ``--fit`` table (``fit.json``, ``fit.md``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib.patches
from matplotlib.figure import Figure

from optfuse._targets._compiled import format_bytes
from optfuse.bench import _host_fits, _offload_cost, _offload_time, _slices, _what_fits

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
  on = f" on {row['target']}" if row.get("section") == "memory" and row.get("target") else ""
  return f"{row['model']}/{row['optimizer']}{on}"


def _fits(row: dict[str, Any]) -> str:
  return "-" if row.get("budget_bytes") is None else ("yes" if row.get("fits") else "no")


# (header, right-aligned, cell) of the two tables.
_TIMING_COLUMNS = (
    ("model", False, lambda r: r["model"]),
    ("optimizer", False, lambda r: r["optimizer"]),
    ("mode", False, lambda r: r["mode"]),
    ("step", True, lambda r: f"{r['step_ms']:.2f} ms"),
    ("time vs optax", True, lambda r: _ratio(r["time_ratio"])),
    ("compile", True, lambda r: f"{r['compile_s']:.2f} s"),
    ("compile vs optax", True, lambda r: _ratio(r["compile_ratio"])),
    ("peak", True, lambda r: format_bytes(r["peak_bytes"])),
    ("peak vs optax", True, lambda r: _ratio(r["peak_ratio"])),
    ("floor", True, lambda r: format_bytes(r["floor_bytes"])),
    ("peak vs floor", True, lambda r: _ratio(r["peak_vs_floor"])),
)
_MEMORY_COLUMNS = (
    ("model", False, lambda r: r["model"]),
    ("mode", False, lambda r: r["mode"]),
    ("peak", True, lambda r: format_bytes(r["peak_bytes"])),
    ("peak vs optax", True, lambda r: _ratio(r["peak_ratio"])),
    ("temp", True, lambda r: format_bytes(r["temp_bytes"])),
    ("host", True, lambda r: format_bytes(r.get("host_bytes") or None)),
    ("gradient", True, lambda r: format_bytes(r["grad_bytes"])),
    ("floor", True, lambda r: format_bytes(r["floor_bytes"])),
    ("peak vs floor", True, lambda r: _ratio(r["peak_vs_floor"])),
    ("saved / stacked gradient", True,
     lambda r: "-" if r.get("saved_of_stacked") is None else f"{r['saved_of_stacked']:.0%}"),
    ("fits", True, _fits),
    ("target", False, lambda r: r.get("target", "-")),
)


def _unavailable_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
  """One line per (mode, reason): which cells it covers ("every cell" when all)."""
  cells = {_label(r) for r in rows}
  groups: dict[tuple[str, str, str], list[str]] = {}
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


def _section(title: str, intro: str, columns, rows: Sequence[dict[str, Any]],
             measured: str = "peak_ratio") -> list[str]:
  """A titled table of the rows with a ``measured`` value, the notes on the others, the models."""
  out = [title, "", intro, "",
         "| " + " | ".join(header for header, _, _ in columns) + " |",
         "|" + "|".join("---:" if right else "---" for _, right, _ in columns) + "|"]
  out += ["| " + " | ".join(cell(r) for _, _, cell in columns) + " |"
          for r in rows if r.get(measured) is not None]
  notes = _unavailable_notes(rows)
  out += ["", *notes] if notes else []
  models = {r["model"]: r["description"] for r in rows}
  return [*out, "", "Models: " + "; ".join(f"`{m}` {d}" for m, d in models.items()) + ".", ""]


def _range(values: Sequence[float]) -> str:
  values = sorted(values)
  median = values[len(values) // 2] if len(values) % 2 else sum(
      values[len(values) // 2 - 1:len(values) // 2 + 1]) / 2
  return (f"{median:.2f}x" if len(values) == 1
          else f"{median:.2f}x (range {values[0]:.2f}x–{values[-1]:.2f}x, {len(values)} cells)")


def summary(rows: Sequence[dict[str, Any]]) -> list[str]:
  """What the run shows, in a few lines: memory of the scanned and of the unrolled models,
  backward fusion's step time against optax's."""
  fused = [r for r in rows if r["mode"] == "backward" and r.get("peak_ratio") is not None]
  if not fused:
    return []
  scanned = [r for r in fused if r.get("scanned") or r["section"] == "memory"]
  unrolled = [r for r in fused if r not in scanned]
  timed = [r["time_ratio"] for r in fused if r.get("time_ratio") is not None]
  out = ["**What this run shows** (backward fusion against optax):", ""]
  if scanned:
    out.append("- scanned models, compiled peak memory: " + ", ".join(
        f"`{_label(r)}` {r['peak_ratio']:.2f}x" for r in scanned))
  if unrolled:
    out.append("- unrolled models under jit, compiled peak memory: "
               + _range([r["peak_ratio"] for r in unrolled])
               + " (XLA already updates each leaf right after its gradient)")
  if timed:
    out.append("- step time: " + _range(timed) + "; a ratio within the spread of repeated "
               "runs (the docs' benchmarks page gives it for a 2-core CPU) is parity, not a gain")
  out += _update_share(rows)
  return [*out, ""]


# Below this gradient size a step's time is mostly dispatch and small kernels, not the update.
MIN_UPDATE_BYTES = 50e6


def _update_share(rows: Sequence[dict[str, Any]]) -> list[str]:
  """Per model: how long optax's update alone takes, and the most fusion can save of it.

  An AdamW update makes about 7 passes over parameter-sized buffers (read the gradient, read
  and write the param and both moments); the backward pass writes the gradient once more.
  Fusion removes the gradient's write and read, about 2 of those 7 passes: on a CPU, where the
  update is memory-bound, that is the physical floor of the saving.
  """
  out = []
  for off in (r for r in rows if r["mode"] == "off" and r.get("update_ms") is not None):
    fused = next((r for r in rows if r["model"] == off["model"] and r["mode"] == "backward"
                  and r["optimizer"] == off["optimizer"] and r.get("step_ms") is not None), None)
    if fused is None or off["optimizer"] != "adamw" or off["grad_bytes"] < MIN_UPDATE_BYTES:
      continue
    floor = 2 / 7 * off["update_ms"]
    saved = off["step_ms"] - fused["step_ms"]
    out.append(f"- `{off['model']}`: AdamW's update alone takes {off['update_ms']:.1f} ms, "
               f"{off['update_ms'] / off['step_ms']:.0%} of optax's step; the gradient's write "
               f"and read (2 of its 7 passes over the params) are about {floor:.1f} ms "
               f"({floor / off['step_ms']:.1%} of the step), the most fusion saves on CPU; "
               f"backward fusion's step was {abs(saved):.1f} ms "
               f"{'faster' if saved >= 0 else 'slower'} than optax's ("
               + (f"{saved / floor:.0%} of that floor" if saved <= floor else
                  f"{saved / floor:.1f} times that floor: the rest comes from how XLA compiles "
                  "the two steps, not from the update's memory traffic")
               + "; a difference within the run-to-run spread is parity)")
  return out


def markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The results as Markdown: the timing table, the compile-only memory table, the notes."""
  env = rows[0]
  out = [f"## optfuse.bench `{env['suite']}`: jax {env['jax_version']}, optax "
         f"{env['optax_version']}, backend {env['backend']} ({env['device_kind']}, "
         f"{env['device_count']} device(s)), {env['cpu_count']} CPUs, load average "
         f"{env['load_average_start']} at the start, {env['load_average_end']} at the end", ""]
  loads = [x for x in (env["load_average_start"], env["load_average_end"]) if x is not None]
  if env["backend"] == "cpu" and loads and max(loads) > env["cpu_count"]:
    out += [f"**Busy machine**: the load average ({max(loads)}) exceeded the {env['cpu_count']} "
            "CPUs, so other processes shared them: step and compile times are noisy (compiled "
            "memory is exact).", ""]
  fits = [r for r in rows if r["section"] == "fits"]
  if fits:
    out += ["**What fits** (compile-only, so exact and deterministic for these versions: the "
            "largest depth whose step fits each target's memory, one layer more does not):", "",
            *_what_fits.lines(fits), ""]
  sized = [r for r in rows if r["section"] == "sized"]
  if sized:
    out += ["**On the accelerators** (compile-only, so exact and deterministic for these "
            "versions; backward fusion alone, the state in host memory and the largest depth and "
            "batch that fit: `python -m optfuse.bench --what-fits --state-bits 8`):", "",
            *_what_fits.sized_lines(sized), ""]
  slices = [r for r in rows if r["section"] == "slices"]
  if slices:
    out += [f"**The smallest slice of this machine's chip** ({slices[0]['model']}, AdamW, FSDP; "
            "compile-only; `--slices` for every kind):", "", str(_slices.report_of(slices)), ""]
  out += summary([r for r in rows if r["section"] not in ("fits", "sized", "slices")])
  timing = [r for r in rows if r["section"] == "timing"]
  if timing:
    out += _section(
        "### Step time, compile time and compiled peak memory, fused vs optax (mode `off`)",
        "Step: median time per step over interleaved runs after warm-up. Time vs optax: median "
        "over the rounds of the ratio of back-to-back runs. Compile: trace, lower and compile, "
        "the median of interleaved compiles when the suite makes several (`--loops`, `--full`: 3), "
        "and its ratio the median over rounds.",
        _TIMING_COLUMNS, timing)
  memory = [r for r in rows if r["section"] == "memory"]
  if memory:
    out += _section(
        "### Compile-only memory (large models, nothing allocated)",
        "adamw, float32, `optfuse.memory_report` on `jax.ShapeDtypeStruct` inputs: nothing is "
        "allocated, the numbers are XLA's buffer assignment by each target's compiler (per "
        "device), and the floor is computed from optax's peak on the same compiler.",
        _MEMORY_COLUMNS, memory, measured="peak_bytes")
  return "\n".join([*out, PEAK_NOTE, "", FLOOR_NOTE]) + "\n"


_FIT_COLUMNS = (
    ("model", False, lambda r: r["model"]),
    ("mode", False, lambda r: r["mode"]),
    ("max batch", True, lambda r: str(r["max_batch"])),
    ("batch vs optax", True, lambda r: _ratio(r["batch_ratio"])),
    ("tokens per step", True,
     lambda r: "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:,}"),
    ("peak at max batch", True, lambda r: format_bytes(r["peak_bytes"])),
    ("next batch", True, lambda r: str(r["next_batch"])),
    ("its peak", True, lambda r: format_bytes(r["next_peak_bytes"])),
    ("compiles", True, lambda r: str(r["compiles"])),
    ("target", False, lambda r: r.get("target", "-")),
)

MARGIN_NOTE = (
    "These are XLA's buffer assignments for this backend: on a GPU leave a margin below the "
    "memory the process gets (the allocator fragments, XLA and the CUDA libraries reserve "
    "workspace, and JAX preallocates 75 % of the card unless `XLA_PYTHON_CLIENT_MEM_FRACTION` "
    "says otherwise).")


def fit_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The ``--fit`` results as Markdown: the largest batch per model and mode, the notes."""
  env = rows[0]
  budgets = {(r["target"], r["budget_bytes"], r.get("budget_source", "given")) for r in rows
             if "budget_bytes" in r}
  within = "; ".join(f"{format_bytes(b)} ({b} bytes) on {t}" + ("" if s == "given" else f" ({s})")
                     for t, b, s in sorted(budgets, key=str))
  out = [f"## optfuse.bench `--fit`: jax {env['jax_version']}, optax {env['optax_version']}, "
         f"backend {env['backend']} ({env['device_kind']}, {env['device_count']} device(s))", ""]
  out += _section(
      f"### Largest batch whose compiled step fits {within} per device",
      "adamw, float32, `optfuse.max_batch_size` on `jax.ShapeDtypeStruct` inputs (doubling, "
      "then bisection; nothing is allocated): the step at the max batch fits, the step at the "
      "next batch does not. Tokens per step: max batch x sequence length.",
      _FIT_COLUMNS, rows, measured="max_batch")
  return "\n".join([*out, PEAK_NOTE, "", MARGIN_NOTE]) + "\n"


def write_tables(rows: Sequence[dict[str, Any]], out_dir: str, stem: str,
                 render: Callable[[Sequence[dict[str, Any]]], str]) -> dict[str, str]:
  """Writes ``STEM.json`` (the rows) and ``STEM.md`` (``render(rows)``) into ``out_dir``.

  Returns:
    name -> path of the files written.
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {name: os.path.join(out_dir, f"{stem}.{name}") for name in ("json", "md")}
  with open(paths["json"], "w") as f:
    json.dump(list(rows), f, indent=1)
  with open(paths["md"], "w") as f:
    f.write(render(rows))
  return paths


def what_fits_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The ``--what-fits`` results: one line per target, then the table."""
  env = rows[0]
  return "\n".join([
      f"## optfuse.bench `--what-fits`: jax {env['jax_version']}, optax {env['optax_version']}",
      "", "Compile-only (exact and deterministic for these versions): a scanned remat decoder "
      "of width 2048 (16 heads, ff=8192, vocab 32000), AdamW (or the optimizer a line names), "
      "float32 params, T=2048. Layers: "
      "the most layers that fit at batch 1; batch: the largest batch at 24 layers (the 1.3B "
      "decoder). Each fits the target's memory per device and one more does not.", "",
      *_what_fits.lines(rows), "", _what_fits.markdown(rows), MARGIN_NOTE]) + "\n"


def write_what_fits(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``what_fits.json`` and ``what_fits.md`` into ``out_dir``; returns name -> path."""
  return write_tables(rows, out_dir, "what_fits", what_fits_markdown)


def host_fits_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The ``--host-fits`` results: the host table and the 6.6B decoder's rows."""
  env = rows[0]
  return "\n".join([
      f"## optfuse.bench `--host-fits`: jax {env['jax_version']}, optax {env['optax_version']}",
      "", "Compile-only (exact and deterministic for these versions): scanned remat decoders of "
      "width 2048 (16 heads, ff=8192) and 4096 (32 heads, ff=16384), vocab 32000, AdamW, "
      "float32 params, T=2048. Each cell: the deepest decoder at batch 1 (or the largest batch "
      "at 24 layers) whose step fits the target's device memory, the host bytes that step "
      "needs, whether the machine's host memory holds them and, where it does not, the deepest "
      "decoder it holds (the host bytes are affine in the depth).", "",
      _host_fits.host_markdown(rows)]) + "\n"


def write_host_fits(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``host_fits.json`` and ``host_fits.md`` into ``out_dir``; returns name -> path."""
  return write_tables(rows, out_dir, "host_fits", host_fits_markdown)


def offload_cost_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The ``--offload-cost`` model: bytes a step, transfer and matmul times, hiding batch."""
  env = rows[0]
  return "\n".join([
      f"## optfuse.bench `--offload-cost`: jax {env['jax_version']}, optax "
      f"{env['optax_version']}", "",
      "A model, not a timing (`optfuse/_analysis/_offload_cost.py`): bytes from the plan (a "
      "host param row read twice and written once, a state or pending gradient row read once "
      "and written once); transfer = bytes read / the host link each "
      "way; matmuls = the step's matmul FLOPs / the chip's peak. Peak FLOP/s is an upper "
      "bound: at 40 % of it the transfers hide from 0.4 times the batch given.", "",
      _offload_cost.markdown(rows)]) + "\n"


def write_offload_cost(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``offload_cost.json`` and ``offload_cost.md`` into ``out_dir``."""
  return write_tables(rows, out_dir, "offload_cost", offload_cost_markdown)


def offload_time_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The ``--offload-time`` timings."""
  env = rows[0]
  return "\n".join([
      f"## optfuse.bench `--offload-time`: jax {env['jax_version']}, optax "
      f"{env['optax_version']}", "", _offload_time.markdown(rows), "A ratio whose range holds "
      "1.00 is parity: other processes on the machine move single runs more than the choice "
      "does."]) + "\n"


def write_offload_time(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``offload_time.json`` and ``offload_time.md`` into ``out_dir``."""
  return write_tables(rows, out_dir, "offload_time", offload_time_markdown)


def write_slices(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``slices.json`` and ``slices.md`` into ``out_dir``; returns name -> path."""
  return write_tables(rows, out_dir, "slices", _slices.markdown)


def write_fit(rows: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
  """Writes ``fit.json`` and ``fit.md`` into ``out_dir``; returns name -> path."""
  return write_tables(rows, out_dir, "fit", fit_markdown)


def _plot_label(row: dict[str, Any]) -> str:
  return _label(row) + (" (compile only)" if row["section"] == "memory" else "")


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
  """Writes a PNG of the fused modes' step-time and peak-memory ratios to optax."""
  measured = [r for r in rows if r.get("peak_ratio") is not None and r["mode"] != "off"]
  panels = [("step time / optax", "time_ratio", [r for r in measured if r["time_ratio"]]),
            ("compiled peak memory / optax", "peak_ratio", measured)]
  modes = list(dict.fromkeys(r["mode"] for r in measured))
  colors = {mode: f"C{k}" for k, mode in enumerate(modes)}
  cells = max(len({_plot_label(r) for r in panel}) for _, _, panel in panels)
  # A bare Figure (no pyplot): no global backend or figure state is touched.
  fig = Figure(figsize=(13, max(3.0, 0.32 * cells + 2.0)), layout="constrained")
  width = 0.8 / max(1, len(modes))
  for ax, (title, key, panel) in zip(fig.subplots(1, 2), panels, strict=True):
    labels = list(dict.fromkeys(_plot_label(r) for r in panel))
    for k, mode in enumerate(modes):
      bars = [(labels.index(_plot_label(r)) + (k - (len(modes) - 1) / 2) * width, r[key])
              for r in panel if r["mode"] == mode]
      ax.barh([y for y, _ in bars], [x for _, x in bars], height=width, color=colors[mode],
              label=mode)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel("ratio (1.0 = optax)")
  handles = [matplotlib.patches.Patch(color=colors[m], label=m) for m in modes]
  fig.legend(handles=handles, loc="outside lower center", ncols=max(1, len(modes)))
  env = rows[0]
  fig.suptitle(f"optfuse.bench {env['suite']}: {env['backend']} ({env['device_kind']}), "
               f"jax {env['jax_version']}")
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
