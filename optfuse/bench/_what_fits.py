"""What fits: the largest scanned decoder per compile target, with optax and with optfuse.

For a scanned remat decoder of width 2048 (16 heads, ff=8192, vocab 32000, AdamW, float32
params; the 1.3B decoder's layer), two searches per target and mode, compile-only:

- depth: the most layers whose step fits the target's memory at batch 1, T=2048;
- batch: the largest batch whose step fits at 24 layers (the 1.3B decoder), T=2048.

Both are ``optfuse._analysis._what_fits.seeded_largest``: a scanned model's peak is close to
affine in its depth and its batch, so a search takes about four compiles, two when a previous
target's fit guesses right; the answer is exact (it fits, one more does not). Peaks come from
the disk cache of ``_cache`` where the same code and compilers measured them before.

``--host-fits`` (``_host_fits``) runs the same searches with the params in host memory too.

The main job (``--quick``) asks less: the peak of the 1.3B decoder itself (24 layers, batch 1)
per accelerator target, one compile a step (``at_size``), since a TPU compile of this model takes
one to one and a half CPU-minutes on two cores and the searches take three or four a step. Its
steps (``QUICK_MODES``) are optax's and the one that fits TPU v5e's 16 GiB, backward fusion with
AdamW's state in 8 bits; backward fusion alone (17.33 GB there, one more compile) is
``--what-fits``'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optax
from tqdm.auto import tqdm

from optfuse import _fuse
from optfuse._analysis import _memory
from optfuse._analysis._what_fits import seeded_largest
from optfuse._targets import _compiled, _registry
from optfuse.bench import _cache, _models, _suite
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
# Adafactor with optax's defaults (factored second moments, block RMS clipping, parameter
# scale): its whole-leaf statistics keep the stacked leaves out of one-pass loops, so its fused
# step is two-pass backward (``global_ops="two_pass"``).
ADAFACTOR_STEPS = {"off_adafactor": "off", "backward_adafactor": "backward"}
STEPS.update((m, (mode, None, None)) for m, mode in ADAFACTOR_STEPS.items())
LABELS.update(off_adafactor="optax, Adafactor", backward_adafactor="two-pass backward, Adafactor")
# The optimizer of each step: ``optimizer_of``.
OPTIMIZERS = ("adamw", "adafactor")
# The main job's steps: optax's (the TPU compiler refuses it in about 2 s) and the one that fits.
QUICK_MODES = ("off", "backward_8bit")
SHORT = {"off": "optax", "backward": "backward", OFFLOAD: "backward + offload",
         PARAMS: "backward + params offload",
         **{f"backward_{b}bit": f"backward {b}-bit" for b in (8, 4)},
         **{f"{OFFLOAD}_{b}bit": f"backward + offload {b}-bit" for b in (8, 4)},
         **{f"{PARAMS}_{b}bit": f"backward + params offload {b}-bit" for b in (8, 4)},
         "off_adafactor": "optax Adafactor", "backward_adafactor": "two-pass Adafactor"}


def optimizer_of(mode: str) -> tuple[optax.GradientTransformation, dict[str, str]]:
  """The optimizer of step ``mode`` and the ``optfuse.fuse`` options it adds: AdamW (its state
  in low bits where the step says), or Adafactor's defaults in two passes."""
  if mode in ADAFACTOR_STEPS:
    return optax.adafactor(1e-3), {"global_ops": "two_pass"} if mode != "off_adafactor" else {}
  return _memory.with_state_bits(optax.adamw(1e-3), STEPS[mode][2]), {}


def modes_of(name: str, offload: bool = True, state_bits: int | None = None,
             optimizer: str = "adamw") -> tuple[str, ...]:
  """The modes searched on target ``name``: with ``offload``, backward fusion with the state in
  host memory too where its compiler counts host memory apart (every accelerator's, not
  XLA:CPU's); with ``state_bits``, backward fusion with AdamW's state in that many bits, on
  device and (with ``offload``) in host memory. ``optimizer="adafactor"``: optax's and two-pass
  backward's Adafactor steps only."""
  if optimizer == "adafactor":
    return tuple(ADAFACTOR_STEPS)
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
    step_mode, offload, _ = STEPS[mode]
    tx, options = optimizer_of(mode)
    fx = _fuse.fuse(tx, mode=step_mode, offload=offload, **options)
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
  return seeded_largest(peak, budget, previous, default), seen


def run(names: Sequence[str], axes: Sequence[str] = ("layers",), use_cache: bool = True,
        progress: bool = True, config: DecoderConfig = WIDE,
        budget: int | None = None, offload: bool = True, state_bits: int | None = None,
        only: Sequence[str] | None = None, optimizer: str = "adamw") -> list[dict[str, Any]]:
  """One row per (target, axis, mode): the largest depth or batch of ``config`` that fits each
  target's memory (or ``budget``, for tests), and its peaks; ``offload``: also with the state in
  host memory, ``state_bits``: also with the state in low bits (``modes_of``); ``only``: just
  these of those modes; ``optimizer="adafactor"``: Adafactor's steps instead. Each search's
  compiles are cached as it ends, so an interrupted run resumes where it stopped."""
  rows, previous = [], {}
  with tqdm(desc="optfuse.bench what fits", unit="compile", disable=not progress) as bar:
    peaks = Peaks(use_cache, bar)
    try:
      env = _suite.environment()
      for name in names:
        label, memory, source = _memory.target_budget(resolve(name))
        memory, source = (memory, source) if budget is None else (budget, "given")
        for axis in axes:
          for mode in modes_of(name, offload, state_bits, optimizer):
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
                         "params_at_max": params_label(at) if best else None,
                         "peak_at_max": seen.get(best), "next_peak": seen.get(best + 1),
                         "budget_bytes": memory, "budget_source": source,
                         "compiles_asked": len(seen)})
    finally:
      peaks.save()
  for row in rows:
    row["new_compiles"] = peaks.compiles
  return rows


def params_label(c: DecoderConfig) -> str:
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
    pair = next((p for p in (MODES, tuple(ADAFACTOR_STEPS)) if set(p) <= set(got)), None)
    if pair is None:
      continue
    (off, fused), adafactor = (got[m] for m in pair), pair != MODES
    gain = (f"{fused['max'] / off['max']:.2f}x the {axis}" if off["max"] else
            "optax fits none")
    what = (f"d={off['dim']} decoder, T={off['seq']}, batch 1" if axis == "layers" else
            f"{off['batch_layers']}-layer d={off['dim']} decoder, T={off['seq']}")
    host = (f"; with the state in host memory {_describe(got[OFFLOAD])}" if OFFLOAD in got
            else "")
    host += "".join(f"; {LABELS[m].removeprefix('backward fusion, ')} {_describe(got[m])}"
                    for m in STEPS if m in got and STEPS[m][2] is not None)
    out.append(f"- **{off['target_label']}** ({_compiled.format_bytes(off['budget_bytes'])} per "
               f"device): largest {what} with {'Adafactor' if adafactor else 'AdamW'}: optax "
               f"{_describe(off)}, {'two-pass ' if adafactor else ''}backward fusion "
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
                       "batch": config.batch, "params": params_label(config)})
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
