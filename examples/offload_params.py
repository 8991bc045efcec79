"""Train with the params of the scanned layers in host memory, and see what that frees.

``optfuse.fuse(tx, offload="params")`` keeps the param stacks the fused loops update, and all of
the optimizer state, in ``pinned_host`` memory between steps; each layer's rows pass through
the device for its forward iteration and again for its backward iteration (recompute, gradient,
update), and the new rows go back to the host there. ``optfuse.params_to_host`` places the
params. This script

1. trains a small scanned decoder for a few steps with its params streamed and checks it
   against plain optax (the same params, on this machine's backend), then evaluates its loss
   on the params where they are (``optfuse.streamed``) and checks it against the loss on
   device params;
2. compiles a bench decoder for a target (default: Colab's TPU v5e, through the TPU compiler,
   without a TPU) in the fused modes without offload, with the state streamed and with the
   params streamed too, and prints each step's device peak and host bytes; with
   ``--microbatches k`` each step takes a batch of ``k`` sequences in ``k`` microbatches.

Usage::

  python examples/offload_params.py --model 1.3b --target tpu-v5e
  python examples/offload_params.py --model 1.3b --target tpu-v5e --microbatches 2
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

import optfuse
from optfuse.bench import _models, _suite


def train_check(steps: int) -> float:
  """Trains a small decoder with streamed params and returns the largest difference from
  optax."""
  model = _models.decoder(_models.DecoderConfig(layers=4), scanned=True, remat=True)
  params, batch = _models.materialize(model.params, 0), _models.materialize(model.batch, 1)
  tx = optax.adamw(1e-3, weight_decay=0.1)
  fx = optfuse.fuse(tx, offload="params")
  fused = jax.jit(fx.value_and_update(model.loss), donate_argnums=(0, 1))
  p = optfuse.params_to_host(fx, model.loss, jax.tree.map(np.array, params), *batch)
  s = fx.init(jax.tree.map(np.array, params))
  q, t = params, tx.init(params)

  @jax.jit
  def reference(q, t):
    grads = jax.grad(model.loss)(q, *batch)
    updates, t = tx.update(grads, t, q)
    return optax.apply_updates(q, updates), t

  for _ in range(steps):
    _, p, s = fused(p, s, *batch)
    q, t = reference(q, t)
  print("params live in:", jax.tree.map(lambda x: x.sharding.memory_kind, p))
  # An evaluation on the params where they are: the scans read the host stacks row by row.
  evaluated = jax.jit(optfuse.streamed(model.loss))(p, *batch)
  print(f"loss evaluated on the host-resident params: {float(evaluated):.6f}, on optax's "
        f"device params: {float(model.loss(q, *batch)):.6f}")
  p, s = optfuse.to_optax_state(fx, p, s)
  return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves((evaluated, p, s)),
                             jax.tree.leaves((model.loss(q, *batch), q, t))))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="1.3b", choices=["1.3b", "6.6b"],
                      help="the bench decoder (24 x d2048 or 32 x d4096, T=2048, batch 1)")
  parser.add_argument("--layers", type=int, default=None, help="another depth")
  parser.add_argument("--target", default="tpu-v5e", help="compile target (optfuse.targets())")
  parser.add_argument("--steps", type=int, default=5, help="training steps of the check")
  parser.add_argument("--microbatches", type=int, default=None,
                      help="a batch of this many sequences, one per microbatch")
  args = parser.parse_args()
  print(f"trained {args.steps} steps with the params in host memory: largest difference from "
        f"optax {train_check(args.steps):.2e}")
  c = _suite.LARGE_DECODERS[f"decoder_{args.model}"]
  c = c._replace(layers=args.layers or c.layers, batch=args.microbatches or c.batch)
  model = _models.decoder(c, scanned=True, remat=True)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  for offload in (None, "state", "params"):
    print(f"\n{model.description}, AdamW, on {args.target}, offload={offload!r}:")
    print(optfuse.memory_report(model.loss, optax.adamw(1e-3), params, *batch,
                                target=args.target, offload=offload,
                                microbatches=args.microbatches))


if __name__ == "__main__":
  main()
