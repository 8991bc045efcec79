"""``python -m optfuse.bench --slices``: the smallest slice of each kind of chip that fits.

``optfuse.smallest_slices`` for one of the ``--fit-models`` decoders with AdamW (optionally its
state in 8 or 4 bits), over the ``--target`` names (by default the TPU v5e and v6e slices of 1,
4 and 8 chips and the registry's GPUs), compile-only. A table is deterministic for given code and
compilers, so it is kept in the disk cache of ``_cache`` (keyed by the model, the targets and
the optimizer as well as the code and compiler versions). ``--quick`` shows the rows of the
accelerator this machine has, if any.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import optax

import optfuse
from optfuse._analysis._slices import SliceFit, SliceReport
from optfuse.bench import _cache, _fit_table, _models, _suite

DEFAULT_MODEL = "decoder_1.3b"
# The ``--quick`` rows: the FSDP layout (one chip is both layouts) of every step.
QUICK_LAYOUTS = ("fsdp",)
POINTER = ("Which slice of TPU or GPU fits a model, and at what batch per chip: "
           "`python -m optfuse.bench --slices` (compile-only).")


def run(model: str, targets: Sequence[str], state_bits: int | None = None,
        layouts: Sequence[str] = ("data", "fsdp"), use_cache: bool = True,
        progress: bool = True, max_batch_per_chip: int | None = None) -> list[dict[str, Any]]:
  """One row per (kind, layout, step) of ``optfuse.smallest_slices`` for the named model with
  AdamW; each row also carries the environment, the compiles the table took and its seconds
  (0 compiles when the table came from the cache)."""
  fit_model = _fit_table.fit_models()[model].model
  key = _cache.key("slices", model, tuple(targets), tuple(layouts), state_bits,
                   max_batch_per_chip)
  cached = _cache.load().get(key) if use_cache else None
  start = time.perf_counter()
  if cached is None:
    report = optfuse.smallest_slices(
        fit_model.loss, optax.adamw(1e-3), _models.abstract(fit_model.params),
        lambda b: _fit_table.batch_args(fit_model, b), tuple(targets), layouts=layouts,
        state_bits=state_bits, max_batch_per_chip=max_batch_per_chip, progress=progress)
    fits, compiles = [f._asdict() for f in report], report.compiles
    if use_cache:
      _cache.store({key: {"fits": fits, "compiles": compiles}})
  else:
    fits, compiles = cached["fits"], 0
  seconds = round(time.perf_counter() - start)
  env = _suite.environment()
  return [{**env, "section": "slices", "model": model, "state_bits": state_bits,
           "max_batch_per_chip": max_batch_per_chip,
           "table_compiles": compiles, "table_seconds": seconds, **f} for f in fits]


def report_of(rows: Sequence[dict[str, Any]]) -> SliceReport:
  """The ``SliceReport`` of ``rows`` (as ``run`` returns them)."""
  return SliceReport([SliceFit(**{k: tuple(r[k]) if k == "tried" else r[k]
                                  for k in SliceFit._fields if k in r}) for r in rows])


def markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The ``--slices`` table with its heading: model, optimizer, versions, compiles."""
  first = rows[0]
  state = f", state in {first['state_bits']} bits" if first["state_bits"] else ""
  if first.get("max_batch_per_chip"):
    state += f", batches searched up to {first['max_batch_per_chip']} per chip"
  costs = (f"{first['table_compiles']} compiles, {first['table_seconds']} s"
           if first["table_compiles"] else "from the disk cache (--no-cache recompiles)")
  return "\n".join([
      f"## optfuse.bench `--slices`: {first['model']}, AdamW{state}: jax "
      f"{first['jax_version']}, optax {first['optax_version']}", "",
      "The fewest chips of each kind on which each step fits at one example per chip, and the "
      "largest batch per chip there (compile-only, deterministic for these versions; "
      f"{costs}).", "", str(report_of(rows)), ""])
