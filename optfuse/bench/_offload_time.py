"""``--offload-time``: the streamed step's time on this machine, per offload choice.

Backward fusion with AdamW on a scanned remat decoder, compiled once per offload choice
(``CHOICES``: none, the state in host memory, the params and state in host memory), each step
trained from the same params, then timed in interleaved rounds (``_timing.interleaved``: every
choice once a round, the order reversed every other round). Each choice's row has the median
seconds per step and their range over the rounds, and the median and range of its per-round
ratio to the step without offload. On a CPU, host and device memory are the same RAM: the
copies between the memory spaces are real, the link is not, so this measures the streamed
step's own overhead, not a PCIe transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax

from optfuse import _fuse
from optfuse._analysis import _params_memory
from optfuse.bench import _models, _suite, _timing
from optfuse.bench._models import DecoderConfig

# The offload choices timed, ``optfuse.fuse``'s ``offload=``; the first is the reference.
CHOICES: tuple[str | None, ...] = (None, "state", "params")
# A scanned decoder small enough to time in seconds a round on two CPU cores: the loop-fusion
# issue's 8-layer d=256 decoder.
CONFIG = _suite.MEDIUM


def _label(offload: str | None) -> str:
  return "none" if offload is None else offload


def trainer(offload: str | None, model: _models.Model) -> tuple[_timing.Trainer, float]:
  """A trainer of ``model``'s backward-fused AdamW step with ``offload``, its params placed for
  it, and the seconds its compile took."""
  fx = _fuse.fuse(optax.adamw(1e-3), mode="backward", offload=offload)
  params = _models.materialize(model.params, seed=0)
  batch = _models.materialize(model.batch, seed=1)
  params = _params_memory.params_to_host(fx, model.loss, params, *batch)
  compiled, seconds = _timing.compile_step(fx, model.loss, params, batch)
  return _timing.Trainer(compiled, params, fx.init(params), batch), seconds


def run(config: DecoderConfig = CONFIG, choices: Sequence[str | None] = CHOICES,
        rounds: int = 7, warmup: int = 2, min_run_s: float = 0.2) -> list[dict[str, Any]]:
  """One row per offload choice: median seconds per step, their range, and the median and
  range of the per-round ratio to the first choice's step."""
  model = _models.decoder(config, scanned=True, remat=True)
  env = {**_suite.environment(), "load_average_start": _suite.load_average()}
  trainers, compiles = {}, {}
  for offload in choices:
    trainers[_label(offload)], compiles[_label(offload)] = trainer(offload, model)
  timing = _timing.interleaved(trainers, _label(choices[0]), rounds, warmup, min_run_s)
  env["load_average_end"] = _suite.load_average()
  rows = []
  for offload in choices:
    name = _label(offload)
    loss = float(jax.device_get(trainers[name].loss))
    rows.append({**env, "section": "offload_time", "model": model.name,
                 "description": model.description, "offload": name,
                 "step_s": timing.step_s[name], "step_min_s": min(timing.runs[name]),
                 "step_max_s": max(timing.runs[name]), "ratio": timing.ratio[name],
                 "ratio_min": min(timing.ratios[name]), "ratio_max": max(timing.ratios[name]),
                 "rounds": rounds, "steps_per_run": timing.steps_per_run,
                 "compile_s": compiles[name], "final_loss": loss,
                 "steps": trainers[name].steps})
  return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
  """The timing table, with the machine's load before and after."""
  first = rows[0]
  out = [f"Backward fusion, AdamW, {first['model']} ({first['description']}) on "
         f"{first['device_kind']} ({first['cpu_count']} cores; load average "
         f"{first['load_average_start']} before, {first['load_average_end']} after): "
         f"{first['rounds']} interleaved rounds of {first['steps_per_run']} steps a choice.", "",
         "| offload | step, median (range) | against none: median (range) | loss after |",
         "|---|---:|---:|---:|"]
  for r in rows:
    out.append(f"| {r['offload']} | {r['step_s'] * 1e3:.1f} ms ({r['step_min_s'] * 1e3:.1f}-"
               f"{r['step_max_s'] * 1e3:.1f}) | {r['ratio']:.2f}x ({r['ratio_min']:.2f}-"
               f"{r['ratio_max']:.2f}) | {r['final_loss']:.4f} |")
  return "\n".join(out) + "\n"
