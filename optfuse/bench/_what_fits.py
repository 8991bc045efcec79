"""What fits: the largest scanned decoder per compile target, with optax and with optfuse.

For a scanned remat decoder of width 2048 (16 heads, ff=8192, vocab 32000, AdamW, float32
params; the 1.3B decoder's layer), two searches per target and mode, compile-only:

- depth: the most layers whose step fits the target's memory at batch 1, T=2048;
- batch: the largest batch whose step fits at 24 layers (the 1.3B decoder), T=2048.

Both use ``_fit.largest_affine``: a scanned model's peak is close to affine in its depth
and its batch, so a search takes about four compiles, two when a previous target's fit guesses
right; the answer is exact (it fits, one more does not). Peaks come from the disk cache of
``_cache`` where the same code and compilers measured them before.

``--host-fits`` (``run_host``) runs the same searches with the params in host memory too
(``offload="params"``, or any choice of ``OFFLOAD_MODES``), at d=2048 and d=4096, and sets the
host bytes each answer needs beside the host memory of the machines the target comes in
(``_hosts``), with the 6.6B decoder at its size on TPU v5e and L4.

The main job (``--quick``) asks less: the peak of the 1.3B decoder itself (24 layers, batch 1)
per accelerator target, one compile a step (``at_size``), since a TPU compile of this model takes
one to one and a half CPU-minutes on two cores and the searches take three or four a step. Its
steps (``QUICK_MODES``) are optax's and the one that fits TPU v5e's 16 GiB, backward fusion with
AdamW's state in 8 bits; backward fusion alone (17.33 GB there, one more compile) is
``--what-fits``'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import optax
from tqdm.auto import tqdm

from optfuse import _fuse
from optfuse._analysis import _fit, _memory
from optfuse._targets import _compiled, _registry
from optfuse.bench import _cache, _hosts, _models, _suite
from optfuse.bench._models import DecoderConfig

WIDE = _suite.DECODER_1_3B
MODES = ("off", "backward")
# Backward fusion with the optimizer state in host memory (``offload="state"``), searched on
# the targets whose compiler counts host memory apart from device memory (TPU and GPU; XLA:CPU
# counts both as one).
OFFLOAD = "backward_offload"
# Backward fusion with the params of the fused loops in host memory too (``offload="params"``).
PARAMS = "backward_params"
# The offload choices the host table (``run_host``) compares: ``optfuse.fuse``'s ``offload=``
# -> its backward step's mode here, and its words. Another choice is one entry here.
OFFLOAD_MODES = {"state": OFFLOAD, "params": PARAMS}
OFFLOAD_WORDS = {"state": "{}state in host memory", "params": "params and {}state in host memory"}
LABELS = {"off": "optax", "backward": "backward fusion"}
# mode -> (the step's mode, its offload, its state bits: ``optfuse.low_bit`` AdamW, or None).
STEPS = {"off": ("off", None, None), "backward": ("backward", None, None)}
for _offload, _mode in OFFLOAD_MODES.items():
  STEPS[_mode] = ("backward", _offload, None)
  LABELS[_mode] = f"backward fusion, {OFFLOAD_WORDS[_offload].format('')}"
for _bits in (8, 4):
  STEPS[f"backward_{_bits}bit"] = ("backward", None, _bits)
  LABELS[f"backward_{_bits}bit"] = f"backward fusion, {_bits}-bit state"
  for _offload, _mode in OFFLOAD_MODES.items():
    STEPS[f"{_mode}_{_bits}bit"] = ("backward", _offload, _bits)
    LABELS[f"{_mode}_{_bits}bit"] = (
        f"backward fusion, {OFFLOAD_WORDS[_offload].format(f'{_bits}-bit ')}")
# The main job's steps: optax's (the TPU compiler refuses it in about 2 s) and the one that fits.
QUICK_MODES = ("off", "backward_8bit")
SHORT = {"off": "optax", "backward": "backward", OFFLOAD: "backward + offload",
         PARAMS: "backward + params offload",
         **{f"backward_{b}bit": f"backward {b}-bit" for b in (8, 4)},
         **{f"{OFFLOAD}_{b}bit": f"backward + offload {b}-bit" for b in (8, 4)},
         **{f"{PARAMS}_{b}bit": f"backward + params offload {b}-bit" for b in (8, 4)}}


def modes_of(name: str, offload: bool = True, state_bits: int | None = None
             ) -> tuple[str, ...]:
  """The modes searched on target ``name``: with ``offload``, backward fusion with the state in
  host memory too where its compiler counts host memory apart (every accelerator's, not
  XLA:CPU's); with ``state_bits``, backward fusion with AdamW's state in that many bits, on
  device and (with ``offload``) in host memory."""
  host = offload and resolve(name) is not None
  low = () if state_bits is None else (f"backward_{state_bits}bit",) + (
      (f"{OFFLOAD}_{state_bits}bit",) if host else ())
  return MODES + ((OFFLOAD,) if host else ()) + low


def default_targets() -> tuple[str, ...]:
  """This machine, and TPU v5e (Colab's TPU) where the TPU compiler is installed."""
  return ("cpu", "tpu-v5e") if _registry.compiler_installed("tpu") else ("cpu",)


def resolve(name: str) -> _registry.Target | None:
  """A target of the command line: "cpu" is this machine's default backend."""
  return None if name in ("cpu", "host", "default") else _registry.resolve(name)


class Peaks:
  """Compiled peaks of (target, mode, config), from the cache or the compiler."""

  def __init__(self, use_cache: bool = True, bar: tqdm | None = None):
    self.cached = _cache.load() if use_cache else {}
    self.new: dict[str, Any] = {}
    self.use_cache, self.bar, self.compiles = use_cache, bar, 0

  def __call__(self, name: str, mode: str, c: DecoderConfig) -> int | None:
    """The compiled peak, or ``None`` when the compiler refused the program (out of memory)."""
    key = _cache.key("decoder-remat-adamw", name, mode, tuple(c))
    if key in self.cached:
      return self.cached[key]
    host_key = _cache.key("decoder-remat-adamw-host", name, mode, tuple(c))
    if self.bar is not None:
      self.bar.set_postfix_str(f"{name} {mode} {c.layers}L B{c.batch}")
    model = _models.decoder(c, scanned=True, remat=True)
    step_mode, offload, bits = STEPS[mode]
    fx = _fuse.fuse(_memory.with_state_bits(optax.adamw(1e-3), bits), mode=step_mode,
                    offload=offload)
    lowered = _memory.lower_step(fx, model.loss,
                                 _models.abstract(model.params), _models.abstract(model.batch),
                                 target=resolve(name))
    memory = _memory.compile_memory(lowered)
    refused = isinstance(memory, _memory.DoesNotFit)
    peak = None if refused else memory["peak_bytes"]
    self.cached[key] = self.new[key] = peak
    self.cached[host_key] = self.new[host_key] = None if refused else memory["host_bytes"]
    self.compiles += 1
    if self.bar is not None:
      self.bar.update()
    return peak

  def host(self, name: str, mode: str, c: DecoderConfig) -> int | None:
    """The host bytes of a step ``__call__`` compiled (``None``: refused, or not compiled)."""
    return self.cached.get(_cache.key("decoder-remat-adamw-host", name, mode, tuple(c)))

  def save(self) -> None:
    if self.use_cache and self.new:
      _cache.store(self.new)
      self.new = {}


def _guesses(previous: dict[int, int | None], budget: int, default: tuple[int, int]
             ) -> tuple[tuple[int, int], float | None]:
  """The affine fit of another target's peaks read at this target's budget (the first two
  probes), and its slope."""
  points = sorted(k for k, p in previous.items() if p is not None)
  if len(points) < 2 or previous[points[-1]] == previous[points[0]]:
    return default, None
  a, b = points[0], points[-1]
  slope = (previous[b] - previous[a]) / (b - a)
  guess = max(1, a + math.floor((budget - previous[a]) / slope))
  return (guess, guess + 1), slope


def search(name: str, mode: str, axis: str, peaks: Peaks, budget: int,
           previous: dict[int, int | None] | None, config: DecoderConfig = WIDE
           ) -> tuple[int, dict[int, int | None]]:
  """The largest depth (``axis="layers"``) or batch (``"batch"``) of ``config`` that fits
  ``budget``."""
  seen: dict[int, int | None] = {}
  base = config._replace(batch=1) if axis == "layers" else config

  def peak(k: int) -> int | None:
    seen[k] = peaks(name, mode, base._replace(**{axis: k}))
    return seen[k]

  default = (4, 8) if axis == "layers" else (1, 2)
  guesses, slope = _guesses(previous or {}, budget, default)
  best = _fit.largest_affine(peak, budget, 1, guesses, slope)
  return best, seen


def run(names: Sequence[str], axes: Sequence[str] = ("layers",), use_cache: bool = True,
        progress: bool = True, config: DecoderConfig = WIDE,
        budget: int | None = None, offload: bool = True, state_bits: int | None = None,
        only: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """One row per (target, axis, mode): the largest depth or batch of ``config`` that fits each
  target's memory (or ``budget``, for tests), and its peaks; ``offload``: also with the state in
  host memory, ``state_bits``: also with the state in low bits (``modes_of``); ``only``: just
  these of those modes. Each search's compiles are cached as it ends, so an interrupted run
  resumes where it stopped."""
  rows, previous = [], {}
  with tqdm(desc="optfuse.bench what fits", unit="compile", disable=not progress) as bar:
    peaks = Peaks(use_cache, bar)
    try:
      env = _suite.environment()
      for name in names:
        label, memory, source = _memory.target_budget(resolve(name))
        memory, source = (memory, source) if budget is None else (budget, "given")
        for axis in axes:
          for mode in modes_of(name, offload, state_bits):
            if only is not None and mode not in only:
              continue
            best, seen = search(name, mode, axis, peaks, memory, previous.get((axis, mode)),
                                config)
            peaks.save()
            previous[(axis, mode)] = seen
            at = config._replace(**({"layers": best, "batch": 1} if axis == "layers"
                                    else {"batch": best}))
            rows.append({**env, "section": "fits", "target": name, "target_label": label,
                         "axis": axis, "mode": mode, "max": best, "dim": config.dim,
                         "seq": config.seq, "batch_layers": config.layers,
                         "params_at_max": _params(at) if best else None,
                         "peak_at_max": seen.get(best), "next_peak": seen.get(best + 1),
                         "budget_bytes": memory, "budget_source": source,
                         "compiles_asked": len(seen)})
    finally:
      peaks.save()
  for row in rows:
    row["new_compiles"] = peaks.compiles
  return rows


def _params(c: DecoderConfig) -> str:
  return _models.param_count(_models.decoder(c, scanned=True, remat=True).params)


def _describe(row: dict[str, Any]) -> str:
  if row["axis"] == "layers":
    return f"{row['max']} layers ({row['params_at_max']} params)" if row["max"] else "nothing"
  return f"batch {row['max']}" if row["max"] else "not batch 1"


def lines(rows: Sequence[dict[str, Any]], axis: str = "layers") -> list[str]:
  """One line per target: the largest decoder that fits with optax and with optfuse."""
  out = []
  for name in dict.fromkeys(r["target"] for r in rows):
    got = {r["mode"]: r for r in rows if r["target"] == name and r["axis"] == axis}
    if not set(MODES) <= set(got):
      continue
    off, fused = got["off"], got["backward"]
    gain = (f"{fused['max'] / off['max']:.2f}x the {axis}" if off["max"] else
            "optax fits none")
    what = (f"d={off['dim']} decoder, T={off['seq']}, batch 1" if axis == "layers" else
            f"{off['batch_layers']}-layer d={off['dim']} decoder, T={off['seq']}")
    host = (f"; with the state in host memory {_describe(got[OFFLOAD])}" if OFFLOAD in got
            else "")
    host += "".join(f"; {LABELS[m].removeprefix('backward fusion, ')} {_describe(got[m])}"
                    for m in STEPS if m in got and STEPS[m][2] is not None)
    out.append(f"- **{off['target_label']}** ({_compiled.format_bytes(off['budget_bytes'])} per "
               f"device): largest {what} with AdamW: optax {_describe(off)}, backward fusion "
               f"{_describe(fused)} ({gain}){host}")
  return out


def markdown(rows: Sequence[dict[str, Any]], header: Callable[[], str] | None = None) -> str:
  """The what-fits table: per target, the largest depth and batch of each mode."""
  modes = [m for m in STEPS if any(r["mode"] == m for r in rows)]
  columns = [(a, m) for a in ("layers", "batch") for m in modes]
  out = ["| target | memory per device | budget from | "
         + " | ".join(f"{SHORT[m]}: {'layers' if a == 'layers' else 'batch at 24 layers'}"
                      for a, m in columns) + " |",
         "|---|---:|---|" + "---:|" * len(columns)]
  for name in dict.fromkeys(r["target"] for r in rows):
    cell = {(r["axis"], r["mode"]): r for r in rows if r["target"] == name}
    first = next(iter(cell.values()))
    values = [str(cell[c]["max"]) if c in cell else "-" for c in columns]
    out.append(f"| {first['target_label']} | {_compiled.format_bytes(first['budget_bytes'])} "
               f"| {first['budget_source']} | " + " | ".join(values) + " |")
  return "\n".join(out) + "\n"


def at_size(names: Sequence[str], modes: Sequence[str] = QUICK_MODES, use_cache: bool = True,
            progress: bool = True, config: DecoderConfig = WIDE) -> list[dict[str, Any]]:
  """One row per (accelerator target, mode): the compiled peak of ``config`` itself and whether
  it fits the target's memory (one compile each, or none from the cache); ``"cpu"`` is left to
  the suite's own memory rows."""
  rows = []
  with tqdm(desc="optfuse.bench 1.3B decoder on the targets", unit="compile",
            disable=not progress) as bar:
    peaks = Peaks(use_cache, bar)
    try:
      env = _suite.environment()
      for name in names:
        if resolve(name) is None:
          continue
        label, memory, source = _memory.target_budget(resolve(name))
        for mode in modes:
          peak = peaks(name, mode, config)
          rows.append({**env, "section": "sized", "target": name, "target_label": label,
                       "mode": mode, "peak": peak, "fits": peak is not None and peak <= memory,
                       "host_bytes": peaks.host(name, mode, config),
                       "budget_bytes": memory, "budget_source": source,
                       "layers": config.layers, "dim": config.dim, "seq": config.seq,
                       "batch": config.batch, "params": _params(config)})
    finally:
      peaks.save()
  return rows


def _sized(row: dict[str, Any]) -> str:
  if row["peak"] is None:
    return f"{LABELS[row['mode']]}: does not fit (out of memory)"
  verdict = "fits" if row["fits"] else "does not fit"
  return f"{LABELS[row['mode']]}: {_compiled.format_bytes(row['peak'])}, {verdict}"


def sized_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
  """One line per target, led by the step that fits (the smallest peak that does), then the
  steps that do not and what they need."""
  out = []
  for name in dict.fromkeys(r["target"] for r in rows):
    got = [r for r in rows if r["target"] == name]
    first, fitting = got[0], sorted((r for r in got if r["fits"]), key=lambda r: r["peak"])
    memory = _compiled.format_bytes(first["budget_bytes"])
    lead = (f"fits with {LABELS[fitting[0]['mode']]}: {_compiled.format_bytes(fitting[0]['peak'])}"
            f" of {memory}" if fitting else "fits with none of these steps")
    rest = [_sized(r) for r in got if not fitting or r is not fitting[0]]
    out.append(f"- **{first['target_label']}** ({memory} per device), the "
               f"{first['params']}-parameter decoder ({first['layers']} layers of "
               f"d={first['dim']}, T={first['seq']}, batch {first['batch']}) with AdamW: "
               + "; ".join([lead, *rest]))
  return out


# The host table (``run_host``): the deepest d=2048 and d=4096 decoders at batch 1 and the
# largest batch of the 24-layer d=2048 decoder, each offload choice's backward step.
WIDE_4096 = _suite.DECODER_6_6B
HOST_SEARCHES = (("layers", WIDE), ("layers", WIDE_4096), ("batch", WIDE))
# The 6.6B decoder at its size on one chip of each (the TPU v5e and L4).
SIZED_TARGETS = ("tpu-v5e", "l4")


def host_depth(hosts: dict[int, int | None], memory: int | None, best: int) -> int | None:
  """The deepest decoder, up to ``best`` layers, whose host bytes ``memory`` holds.

  A layer adds its rows of params and state to the host, so the host bytes are affine in the
  depth: the line through the two deepest of ``hosts`` (layers -> host bytes, as compiled)
  gives them at every depth the loops fuse. ``None`` when ``memory`` is unknown or fewer than
  two depths were compiled.

  Examples:
    >>> host_depth({4: 1_000, 8: 1_800}, memory=2_000, best=50)  # 200 + 200 a layer
    9
  """
  points = sorted(k for k, h in hosts.items() if h is not None)
  if memory is None or len(points) < 2:
    return None
  a, b = points[-2], points[-1]
  per_layer = Fraction(hosts[b] - hosts[a], b - a)
  if per_layer <= 0:
    return best
  base = hosts[a] - per_layer * a
  return max(0, min(best, math.floor((memory - base) / per_layer)))


def run_host(names: Sequence[str], offloads: Sequence[str] = ("params",),
             use_cache: bool = True, progress: bool = True, state_bits: int | None = None,
             searches: Sequence[tuple[str, DecoderConfig]] = HOST_SEARCHES,
             sized: DecoderConfig | None = _suite.DECODER_6_6B,
             budget: int | None = None) -> list[dict[str, Any]]:
  """The host table: per accelerator target (``"cpu"`` is skipped: XLA:CPU counts host memory
  as device memory) and offload choice, each search of ``searches`` (the deepest decoder at
  batch 1, the largest batch at its depth) with the host bytes its answer needs and, per
  machine of ``_hosts.hosts_of(target)``, whether that machine holds them and (depth searches)
  the deepest decoder it holds. Then ``sized`` (the 6.6B decoder) at its size on the targets of
  ``SIZED_TARGETS`` among ``names``, with each offload choice's step, in float32 and with
  ``state_bits``-bit state. ``budget`` replaces each target's memory (for tests)."""
  names = [n for n in names if resolve(n) is not None]
  rows, previous = [], {}
  with tqdm(desc="optfuse.bench host fits", unit="compile", disable=not progress) as bar:
    peaks = Peaks(use_cache, bar)
    try:
      env = _suite.environment()
      for name in names:
        label, memory, source = _memory.target_budget(resolve(name))
        memory, source = (memory, source) if budget is None else (budget, "given")
        for axis, config in searches:
          for offload in offloads:
            mode = OFFLOAD_MODES[offload]
            best, seen = search(name, mode, axis, peaks, memory,
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
                         "params_at_max": (_params(base._replace(**{axis: best}))
                                           if best else None),
                         "peak_at_max": seen.get(best), "next_peak": seen.get(best + 1),
                         "host_at_max": need, "budget_bytes": memory,
                         "budget_source": source, "machines": machines})
    finally:
      peaks.save()
  if sized is not None:
    modes = [OFFLOAD_MODES[o] + suffix for o in offloads
             for suffix in ("", *(() if state_bits is None else (f"_{state_bits}bit",)))]
    targets = [n for n in names if n.partition(":")[0] in SIZED_TARGETS]
    for row in at_size(targets, modes, use_cache, progress, sized):
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
  """The host table (one row per target, machine and offload choice; a column per search),
  then the 6.6B decoder's rows, then where each machine's memory comes from."""
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
                 f"{LABELS[r['mode']]} | {peak} | {'yes' if r['fits'] else '**no**'} | {host} "
                 f"| {held} |")
  machines = {m["machine"] for r in rows for m in r["machines"]}
  out += ["", "Host memory: a machine's whole memory, of which the system and the process take "
          "some; sources:", ""]
  out += [f"- {h.machine}: {h.source}" for h in _hosts.HOSTS if h.machine in machines]
  return "\n".join(out) + "\n"
