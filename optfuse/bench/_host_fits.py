"""What fits with the params in host memory, beside the machines' host memory.

``--host-fits`` (``run_host``) runs ``_what_fits``'s depth and batch searches with the params in
host memory too (``offload="params"``, or any choice of ``_what_fits.OFFLOAD_MODES``), at d=2048
and d=4096, and sets the host bytes each answer needs beside the host memory of the machines the
target comes in (``optfuse._targets._hosts``), with the 6.6B decoder at its size on TPU v5e and
L4; ``optfuse._analysis._what_fits.host_depth`` reads the deepest decoder each machine holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from optfuse._analysis import _memory
from optfuse._analysis._what_fits import host_depth
from optfuse._targets import _compiled, _hosts
from optfuse.bench import _suite, _what_fits
from optfuse.bench._models import DecoderConfig

# The host table (``run_host``): the deepest d=2048 and d=4096 decoders at batch 1 and the
# largest batch of the 24-layer d=2048 decoder, each offload choice's backward step.
WIDE_4096 = _suite.DECODER_6_6B
HOST_SEARCHES = (("layers", _what_fits.WIDE), ("layers", WIDE_4096),
                 ("batch", _what_fits.WIDE))
# The 6.6B decoder at its size on one chip of each (the TPU v5e and L4).
SIZED_TARGETS = ("tpu-v5e", "l4")


def run_host(names: Sequence[str], offloads: Sequence[str] = ("params",),
             use_cache: bool = True, progress: bool = True, state_bits: int | None = None,
             searches: Sequence[tuple[str, DecoderConfig]] = HOST_SEARCHES,
             sized: DecoderConfig | None = _suite.DECODER_6_6B,
             budget: int | None = None) -> list[dict[str, Any]]:
  """The host table: per accelerator target (``"cpu"`` is skipped: XLA:CPU counts host memory
  as device memory) and offload choice, each search of ``searches`` (the deepest decoder
  at batch 1, the largest batch at its depth) with the host bytes its answer needs and, per
  machine of ``_hosts.hosts_of(target)``, whether that machine holds them and (depth searches)
  the deepest decoder it holds. Then ``sized`` (the 6.6B decoder) at its size on the targets of
  ``SIZED_TARGETS`` among ``names``, with each offload choice's step, in float32 and with
  ``state_bits``-bit state. ``budget`` replaces each target's memory (for tests)."""
  names = [n for n in names if _what_fits.resolve(n) is not None]
  rows, previous = [], {}
  with tqdm(desc="optfuse.bench host fits", unit="compile", disable=not progress) as bar:
    peaks = _what_fits.Peaks(use_cache, bar)
    try:
      env = _suite.environment()
      for name in names:
        label, memory, source = _memory.target_budget(_what_fits.resolve(name))
        memory, source = (memory, source) if budget is None else (budget, "given")
        for axis, config in searches:
          for offload in offloads:
            mode = _what_fits.OFFLOAD_MODES[offload]
            best, seen = _what_fits.search(name, mode, axis, peaks, memory,
                                previous.get((axis, config, mode)), config)
            peaks.save()
            previous[(axis, config, mode)] = seen
            base = config._replace(batch=1) if axis == "layers" else config
            hosts = {k: peaks.host(name, mode, base._replace(**{axis: k})) for k in seen}
            need = hosts.get(best)
            machines = [{"machine": h.machine, "memory_bytes": h.memory_bytes,
                         "source": h.source, "holds": _hosts.holds(h, need),
                         "depth_held": (host_depth(hosts, h.memory_bytes, best)
                                        if axis == "layers" else None)}
                        for h in _hosts.hosts_of(name)]
            rows.append({**env, "section": "host_fits", "target": name, "target_label": label,
                         "axis": axis, "mode": mode, "offload": offload, "max": best,
                         "dim": config.dim, "seq": config.seq, "batch_layers": config.layers,
                         "params_at_max": (_what_fits.params_label(base._replace(**{axis: best}))
                                           if best else None),
                         "peak_at_max": seen.get(best), "next_peak": seen.get(best + 1),
                         "host_at_max": need, "budget_bytes": memory,
                         "budget_source": source, "machines": machines})
    finally:
      peaks.save()
  if sized is not None:
    modes = [_what_fits.OFFLOAD_MODES[o] + suffix for o in offloads
             for suffix in ("", *(() if state_bits is None else (f"_{state_bits}bit",)))]
    targets = [n for n in names if n.partition(":")[0] in SIZED_TARGETS]
    for row in _what_fits.at_size(targets, modes, use_cache, progress, sized):
      rows.append({**row, "section": "host_sized",
                   "machines": [{"machine": h.machine, "memory_bytes": h.memory_bytes,
                                 "holds": _hosts.holds(h, row["host_bytes"])}
                                for h in _hosts.hosts_of(row["target"])]})
  return rows


def _holds(flag: bool | None) -> str:
  return {True: "yes", False: "**no**", None: "unknown"}[flag]


def _host_cell(row: dict[str, Any], machine: dict[str, Any]) -> str:
  if not row["max"]:
    return "none fits"
  what = (f"{row['max']} layers ({row['params_at_max']})" if row["axis"] == "layers"
          else f"batch {row['max']}")
  cell = (f"{what}: {_compiled.format_bytes(row['host_at_max'])} host, "
          f"{_holds(machine['holds'])}")
  if machine.get("depth_held") is not None and not machine["holds"]:
    cell += f"; holds {machine['depth_held']} layers"
  return cell


def host_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The host table (one row per target, machine and offload choice; a column per
  search), then the 6.6B decoder's rows, then where each machine's memory comes from."""
  fits = [r for r in rows if r["section"] == "host_fits"]
  searches = list(dict.fromkeys((r["axis"], r["dim"], r["batch_layers"]) for r in fits))
  head = [f"d={d}: layers at batch 1" if a == "layers" else f"d={d}: batch at {n} layers"
          for a, d, n in searches]
  out = ["| target (device memory) | machine | host memory | offload | " + " | ".join(head)
         + " |", "|---|---|---:|---|" + "---|" * len(head)] if fits else []
  for name in dict.fromkeys(r["target"] for r in fits):
    got = [r for r in fits if r["target"] == name]
    first = got[0]
    for i, machine in enumerate(first["machines"]):
      for offload in dict.fromkeys(r["offload"] for r in got):
        cell = {(r["axis"], r["dim"], r["batch_layers"]): r for r in got
                if r["offload"] == offload}
        values = [_host_cell(cell[k], cell[k]["machines"][i]) if k in cell else "-"
                  for k in searches]
        memory = ("not found" if machine["memory_bytes"] is None
                  else _compiled.format_bytes(machine["memory_bytes"]))
        out.append(f"| {first['target_label']} "
                   f"({_compiled.format_bytes(first['budget_bytes'])}) | {machine['machine']} | "
                   f"{memory} | {offload} | " + " | ".join(values) + " |")
  sized = [r for r in rows if r["section"] == "host_sized"]
  if sized:
    first = sized[0]
    out += ["", f"The {first['params']}-parameter decoder ({first['layers']} layers of "
            f"d={first['dim']}, T={first['seq']}, batch {first['batch']}) with AdamW:", "",
            "| target (device memory) | step | device peak | fits the chip | host bytes | "
            "machines that hold them |", "|---|---|---:|---|---:|---|"]
    for r in sized:
      held = ", ".join(f"{m['machine']}: {_holds(m['holds'])}" for m in r["machines"])
      peak = "refused" if r["peak"] is None else _compiled.format_bytes(r["peak"])
      host = "-" if r["host_bytes"] is None else _compiled.format_bytes(r["host_bytes"])
      out.append(f"| {r['target_label']} ({_compiled.format_bytes(r['budget_bytes'])}) | "
                 f"{_what_fits.LABELS[r['mode']]} | {peak} | "
                 f"{'yes' if r['fits'] else '**no**'} | {host} | {held} |")
  machines = {m["machine"] for r in rows for m in r["machines"]}
  out += ["", "Host memory: a machine's whole memory, of which the system and the process take "
          "some; sources:", ""]
  out += [f"- {h.machine}: {h.source}" for h in _hosts.HOSTS if h.machine in machines]
  return "\n".join(out) + "\n"
