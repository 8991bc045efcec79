"""Train with the optimizer state in host memory, and see what that frees on an accelerator.

``optfuse.fuse(tx, offload="state")`` keeps AdamW's moments in ``pinned_host`` memory between
steps; backward fusion streams one layer's rows of them through the device inside its backward
loop. This script

1. trains a small scanned decoder for a few steps with the state in host memory and checks it
   against plain optax (the same params, on this machine's backend);
2. compiles the bench's scanned decoder for a target (default: Colab's TPU v5e, through the TPU
   compiler, without a TPU) in every mode with and without offload, for AdamW and for
   ``clip_by_global_norm`` + AdamW (forward fusion streams the pending gradient too), and prints
   each step's device peak and host bytes.

Usage::

  python examples/offload_state.py --layers 24 --target tpu-v5e
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

import optfuse
from optfuse.bench import _models, _suite


def train_check(steps: int) -> float:
  """Trains a small decoder with offloaded state and returns the largest difference from optax."""
  model = _models.decoder(_models.DecoderConfig(layers=4), scanned=True, remat=True)
  params, batch = _models.materialize(model.params, 0), _models.materialize(model.batch, 1)
  tx = optax.adamw(1e-3, weight_decay=0.1)
  fx = optfuse.fuse(tx, offload="state")
  fused = jax.jit(fx.value_and_update(model.loss), donate_argnums=(0, 1))
  p, s = jax.tree.map(np.array, params), fx.init(jax.tree.map(np.array, params))
  q, t = params, tx.init(params)

  @jax.jit
  def reference(q, t):
    grads = jax.grad(model.loss)(q, *batch)
    updates, t = tx.update(grads, t, q)
    return optax.apply_updates(q, updates), t

  for _ in range(steps):
    _, p, s = fused(p, s, *batch)
    q, t = reference(q, t)
  print("state lives in:", sorted({x.sharding.memory_kind for x in jax.tree.leaves(s)}))
  return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((q, t))))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=24, help="decoder depth (d=2048, T=2048)")
  parser.add_argument("--target", default="tpu-v5e", help="compile target (optfuse.targets())")
  parser.add_argument("--steps", type=int, default=5, help="training steps of the check")
  args = parser.parse_args()
  print(f"trained {args.steps} steps with the state in host memory: largest difference from "
        f"optax {train_check(args.steps):.2e}")
  c = _suite.DECODER_1_3B._replace(layers=args.layers)
  model = _models.decoder(c, scanned=True, remat=True)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  optimizers = {"AdamW": optax.adamw(1e-3),
                "clip_by_global_norm + AdamW": optax.chain(optax.clip_by_global_norm(1.0),
                                                           optax.adamw(1e-3))}
  for name, tx in optimizers.items():
    for offload in (None, "state"):
      print(f"\n{model.description}, {name}, on {args.target}, offload={offload!r}:")
      print(optfuse.memory_report(model.loss, tx, params, *batch, target=args.target,
                                  offload=offload))


if __name__ == "__main__":
  main()
