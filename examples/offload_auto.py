"""Let optfuse choose, per leaf, what to keep in host memory so that a step fits a chip.

``optfuse.fuse(tx, offload="auto")`` streams, per leaf, nothing, its optimizer state or its params
and state; ``optfuse.place(fx, loss_fn, params, *args, budget="tpu-v5e")`` compiles the step for
the budget's compiler, streams the leaves that free the most device memory per byte moved until
it fits, and places the params and state accordingly. This script

1. plans a small scanned decoder for a byte budget on the TPU compiler (compile-only), trains
   it here with the planned mixed placement and checks it against plain optax;
2. compiles the bench's 1.3B decoder (24 x d2048, T=2048, batch 1, AdamW) for a target (default:
   the TPU v5e) with nothing, the state, the params and state, and ``"auto"`` streamed, and
   prints each step's device peak, host bytes and host transfer bytes a step; with
   ``--microbatches k`` each step takes a batch of ``k`` sequences in ``k`` microbatches.

Usage::

  python examples/offload_auto.py --model 1.3b --target tpu-v5e
  python examples/offload_auto.py --model 1.3b --target tpu-v5e --microbatches 2
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

import optfuse
from optfuse._analysis import _memory
from optfuse._targets import _registry
from optfuse._targets._compiled import format_bytes
from optfuse.bench import _models, _suite


def train_check(steps: int, target: str = "tpu-v5e") -> tuple[float, optfuse.OffloadPlan]:
  """Plans a small decoder for a budget between its peaks with nothing and with the state
  streamed, trains the placed step ``steps`` steps, and returns the largest difference from
  optax and the plan."""
  # Wide enough that streaming frees device memory on the TPU compiler (at d=64 the rows'
  # padding to its tiles costs more than the slots free).
  config = _models.DecoderConfig(layers=4, dim=256, ff=1024, seq=32, batch=2)
  model = _models.decoder(config, scanned=True, remat=True)
  params, batch = _models.materialize(model.params, 0), _models.materialize(model.batch, 1)
  tx = optax.adamw(1e-3, weight_decay=0.1)
  peaks = {o: optfuse.memory_report(model.loss, tx, params, *batch, target=target,
                                    offload=o)["backward"]["peak_bytes"] for o in (None, "state")}
  fx = optfuse.fuse(tx, offload="auto")
  p, s, plan = optfuse.place(fx, model.loss, jax.tree.map(np.array, params), *batch,
                             budget=(peaks[None] + peaks["state"]) // 2, target=target)
  fused = jax.jit(fx.value_and_update(model.loss), donate_argnums=(0, 1))
  q, t = params, tx.init(params)

  @jax.jit
  def reference(q, t):
    grads = jax.grad(model.loss)(q, *batch)
    updates, t = tx.update(grads, t, q)
    return optax.apply_updates(q, updates), t

  for _ in range(steps):
    _, p, s = fused(p, s, *batch)
    q, t = reference(q, t)
  p, s = optfuse.to_optax_state(fx, p, s)
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((q, t))))
  return diff, plan


def compare(model_name: str, target: str, microbatches: int | None = None) -> str:
  """A markdown table of the backward step of ``model_name`` on ``target`` with each offload
  (each compiled once: ``memory_report`` would compile every mode), and the auto plan; with
  ``microbatches``, a batch of that many sequences split into as many microbatches."""
  c = _suite.LARGE_DECODERS[f"decoder_{model_name}"]
  c = c._replace(batch=microbatches or c.batch)
  model = _models.decoder(c, scanned=True, remat=True)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  tx = optax.adamw(1e-3)
  resolved = _registry.resolve(target)
  lines = ["| offload | device peak | host bytes | host transfers a step |",
           "|---|---:|---:|---:|"]
  for offload in (None, "state", "params"):
    fx = optfuse.fuse(tx, offload=offload)
    row = _memory.step_memory(fx, model.loss, params, batch, target=resolved,
                              microbatches=microbatches)
    if isinstance(row, optfuse.DoesNotFit):
      lines.append(f"| {offload} | {row} | - | - |")
      continue
    if resolved.memory_bytes is not None and row["peak_bytes"] > resolved.memory_bytes:
      lines.append(f"| {offload} | {format_bytes(row['peak_bytes'])}: does not fit | - | - |")
      continue
    lines.append(f"| {offload} | {format_bytes(row['peak_bytes'])} | "
                 f"{format_bytes(row['host_bytes'])} | "
                 f"{format_bytes(row['host_transfer_bytes'])} |")
  plan = optfuse.plan_offload(optfuse.fuse(tx, offload="auto"), model.loss, params, *batch,
                              budget=target, microbatches=microbatches)
  lines.append(f"| auto | {format_bytes(plan.device_peak_bytes)} | "
               f"{format_bytes(plan.host_bytes)} | {format_bytes(plan.host_transfer_bytes)} |")
  return "\n".join([*lines, "", "offload='auto' plan:", plan.table()])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="1.3b", choices=["1.3b", "6.6b"],
                      help="the bench decoder (24 x d2048 or 32 x d4096, T=2048, batch 1)")
  parser.add_argument("--target", default="tpu-v5e", help="compile target (optfuse.targets())")
  parser.add_argument("--steps", type=int, default=5, help="training steps of the check")
  parser.add_argument("--microbatches", type=int, default=None,
                      help="a batch of k sequences in k microbatches (default: one sequence)")
  args = parser.parse_args()
  diff, plan = train_check(args.steps)
  print(f"trained {args.steps} steps with a planned mixed placement: largest difference from "
        f"optax {diff:.2e}\n{plan}\n")
  split = f", {args.microbatches} microbatches" if args.microbatches else ""
  print(f"{args.model} decoder, AdamW, backward fusion{split}, on {args.target}:")
  print(compare(args.model, args.target, args.microbatches))


if __name__ == "__main__":
  main()
