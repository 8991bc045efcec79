"""``python -m optfuse.bench --fit BUDGET``: the largest batch per mode within a memory budget.

For each model (by default the 1.3B and 6.6B scanned decoders), ``optfuse.max_batch_size`` with
AdamW compiles the training step of every mode for the batch sizes its search asks for, from
``jax.ShapeDtypeStruct``s only: nothing is allocated, so models too large for this machine can
be measured (for this backend: run it on the kind of device you will train on). A model's batch
is the leading axis of its batch leaves; for a decoder, the tokens per step are the batch times
the sequence length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import optax

import optfuse
from optfuse._analysis import _memory
from optfuse.bench import _models, _suite
from optfuse.bench._models import DecoderConfig, Model


class FitModel(NamedTuple):
  """A model to fit, with the tokens one example holds (``None`` when not a sequence model)."""

  model: Model
  seq: int | None
  description: str


# A decoder small enough to search in seconds (for the tests); its 4 layers are the shortest loop
# AdamW fuses.
TINY_DECODER = DecoderConfig(layers=4, dim=16, heads=2, ff=32, vocab=64, seq=8, batch=1)


def _decoder(name: str, c: DecoderConfig) -> FitModel:
  model = _models.decoder(c, scanned=True, remat=True, name=name)
  return FitModel(model, c.seq, f"{_models.param_count(model.params)} params, {c.layers}L "
                  f"d{c.dim} ff{c.ff} vocab {c.vocab} T{c.seq}, remat")


def fit_models() -> dict[str, FitModel]:
  """The models ``--fit-models`` can name: the scanned decoders of the suites and a tiny one."""
  configs = {**_suite.LARGE_DECODERS, "gpt_184m": _suite.GPT_184M, "decoder_tiny": TINY_DECODER}
  return {name: _decoder(name, c) for name, c in configs.items()}


# Each compile of a large decoder takes seconds on CPU whatever its batch, so both fit quickly.
DEFAULT_MODELS = tuple(_suite.LARGE_DECODERS)


def batch_args(model: Model, b: int) -> tuple:
  """The ``jax.ShapeDtypeStruct``s of ``model``'s batch with leading axis ``b``."""
  return _models.abstract(tuple(dataclasses.replace(leaf, shape=(b, *leaf.shape[1:]))
                                for leaf in model.batch))


def run_fit(names: Sequence[str], budget: int | str | None, progress: bool = True,
            target: Any = None) -> list[dict[str, Any]]:
  """The largest batch of every mode of each named model with AdamW; one row per mode.

  ``target`` is a compile target (``None``: this machine); ``budget`` ``None`` is its memory.

  A mode that cannot run AdamW is recorded as unavailable; any other exception as a failure
  (``row["failed"]``), so that the other models still run and the command exits with an error.
  """
  env = _suite.environment()
  models = fit_models()
  rows = []
  for name in names:
    model, seq, description = models[name]
    base = {"section": "fit", "model": name, "description": description, "optimizer": "adamw",
            "seq": seq, **env, "target": getattr(target, "name", None) or env["backend"]}
    try:
      fit = optfuse.max_batch_size(model.loss, optax.adamw(1e-3), _models.abstract(model.params),
                                   lambda b, model=model: batch_args(model, b), budget,
                                   target=target, progress=progress)
    except Exception as e:  # a library bug: recorded, the command then exits with an error
      rows += [{**base, "mode": mode, "failed": _memory.error_line(e)} for mode in _memory.MODES]
      continue
    for mode in _memory.MODES:
      row = {**base, "mode": mode, "budget_bytes": fit.budget_bytes,
             "budget_source": fit.budget_source}
      if mode in fit:
        batch, nxt = fit[mode], fit.next_batch(mode)
        row.update(max_batch=batch, tokens_per_step=None if seq is None else batch * seq,
                   batch_ratio=batch / fit["off"] if fit.get("off") else None,
                   peak_bytes=fit.peaks[mode].get(batch), next_batch=nxt,
                   next_peak_bytes=fit.peaks[mode].get(nxt), compiles=len(fit.peaks[mode]))
      else:
        row["unavailable"] = _memory.first_sentence(fit.unavailable[mode])
      rows.append(row)
  return rows
