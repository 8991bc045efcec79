"""The compile-only memory section: big models compiled in every mode for a target.

Nothing is allocated: the models are ``jax.ShapeDtypeStruct``s compiled with
``optfuse.memory_report`` for this machine or for an accelerator's compiler (``optfuse._targets``),
so billion-parameter shapes are measured anywhere.

The memory floor of a model is an estimate: optax's compiled peak, minus the whole gradient, plus
the gradient bytes that must be live at once even when every update is fused at the earliest
point (``Model.live_grad_bytes``: one layer's slice of the stacked leaves plus the leaves outside
the loop for scanned decoders, the largest leaf for unrolled models, the whole accumulator for
gradient accumulation), and never less than the step's inputs plus outputs. It assumes optax
holds the whole gradient at its peak: true when the backward pass is a scan (the stacked gradient
is the scan's output), optimistic for unrolled models, where XLA already frees gradient buffers
early and optax's peak can be below optax-minus-gradient plus the live part, and on compilers
that write the stacked gradient into buffers dead by optax's peak (the TPU compiler's, for the
bfloat16 forms: README, "At the floor on TPU v5e").
"""

from __future__ import annotations

from typing import Any

import jax
import optax

import optfuse
from optfuse import _compiled, _memory, _targets
from optfuse.bench import _models
from optfuse.bench._models import Model


def floor_bytes(model: Model, params, off_memory: dict[str, int]) -> int:
  """The estimated memory floor of a model (see the module docstring)."""
  grads = _models.grad_bytes(params)
  persistent = (off_memory["argument_bytes"] + off_memory["output_bytes"]
                - off_memory["alias_bytes"])
  return max(persistent, off_memory["peak_bytes"] - grads + model.live_grad_bytes(params))


def run_large(model: Model, target: Any = None, offload: bool = False,
              guarded: bool = False) -> list[dict[str, Any]]:
  """Compile-only memory of ``model`` with adamw in every mode, for ``target``'s compiler
  (``None``: this machine); allocates nothing. The floor comes from the same compiler.

  Args:
    model: a benchmark model.
    target: a target name or object (``optfuse._targets.resolve``), or ``None``.
    offload: also every mode with the state in host memory (rows suffixed ``"+offload"``).
    guarded: also the ``"backward+guard"`` row (``optfuse.fuse(tx, guard=True)``).

  Returns:
    One row per mode.
  """
  params = _models.abstract(model.params)
  stacked = _models.grad_bytes(params["layers"]) if "layers" in params else None
  base = {"section": "memory", "model": model.name, "description": model.description,
          "optimizer": "adamw", "grad_bytes": _models.grad_bytes(params),
          "stacked_grad_bytes": stacked,
          "target": getattr(target, "name", target) or jax.default_backend()}
  offloads = (None, "state") if offload else (None,)
  try:
    reports = {o: _memory.memory_report(model.loss, optax.adamw(1e-3), params,
                                        *_models.abstract(model.batch), target=target,
                                        offload=o) for o in offloads}
  except Exception as e:  # a library bug: recorded, the command then exits with an error
    return [{**base, "mode": mode, "failed": _memory.error_line(e)} for mode in _memory.MODES]
  report = reports[None]
  off = report["off"]["peak_bytes"] if "off" in report else None
  floor = floor_bytes(model, params, report["off"]) if off else None
  rows = []
  for o, rep in reports.items():
    for mode in _memory.MODES:
      row = {**base, "mode": mode + ("+offload" if o else ""), "target": rep.target,
             "budget_bytes": rep.budget_bytes, "fits": mode in rep and rep.fits(mode)}
      if mode in rep.does_not_fit:
        row["unavailable"] = str(rep.does_not_fit[mode])
      elif mode in rep:
        row.update(rep[mode], **_against(rep[mode]["peak_bytes"], off, floor, stacked))
      else:
        row["unavailable"] = _memory.first_sentence(rep.unavailable[mode])
      rows.append(row)
  if guarded:
    rows.append(_guarded_row(model, params, target, {**base, "target": report.target}, off,
                             floor, stacked))
  return rows


def _against(peak: int, off: int | None, floor: int | None, stacked: int | None
             ) -> dict[str, Any]:
  """A compiled peak against optax's, the floor and the stacked gradient."""
  return {"peak_ratio": peak / off if off else None, "floor_bytes": floor,
          "peak_vs_floor": peak / floor if floor else None,
          "saved_of_stacked": (off - peak) / stacked if stacked and off else None}


def _guarded_row(model: Model, params, target: Any, base: dict, off: int | None,
                 floor: int | None, stacked: int | None) -> dict[str, Any]:
  """The ``"backward+guard"`` row: backward fusion with ``guard=True`` on an accelerator's
  compiler (its loops kept only where they lower the peak there)."""
  fx = optfuse.fuse(optax.adamw(1e-3), guard=True)
  memory = _compiled.compile_memory(_memory.lower_step(
      fx, model.loss, params, _models.abstract(model.batch), target=_targets.resolve(target)))
  row = {**base, "mode": "backward+guard", "budget_bytes": None, "fits": None,
         "floor_bytes": floor}
  if isinstance(memory, _compiled.DoesNotFit):
    return {**row, "unavailable": str(memory)}
  return {**row, **memory, **_against(memory["peak_bytes"], off, floor, stacked)}
