"""Backward fusion on a model nobody here wrote: penzai's Llama-like transformer.

penzai's ``LayerStack`` stacks the decoder blocks' params on a leading axis and runs them with
``jax.lax.scan(..., unroll=True)``, without remat. optfuse rolls that loop and stacks only the
blocks' narrow weight-matmul outputs (the q/k/v/out and down projections), recomputing the rest
in its backward loop, so each block's params and AdamW moments are updated as soon as the
block's gradient exists. This script

1. trains a small configuration for a few steps with backward fusion, with and without the
   memory guard, and checks it against plain optax;
2. compiles the penzai issue's configuration (12 blocks of d=512, tokens (2, 256)) for each
   target and prints each mode's peak and how much of the model's gradient backward fusion
   saves against optax;
3. with ``--time ROUNDS``, times optax's and backward fusion's steps on this machine,
   interleaved, and prints the medians.

Usage::

  python examples/penzai_layer_stack.py --target cpu,tpu-v5e,h100 --time 7
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

import optfuse
from optfuse.bench import _timing

ISSUE = dict(num_kv_heads=2, query_head_multiplier=2, embedding_dim=512, projection_dim=128,
             mlp_hidden_dim=2048, num_decoder_blocks=12, vocab_size=8000,
             mlp_variant="geglu_approx", tie_embedder_and_logits=True, use_layer_stack=True)
SMALL = {**ISSUE, "embedding_dim": 32, "projection_dim": 8, "mlp_hidden_dim": 64,
         "num_decoder_blocks": 4, "vocab_size": 64}
TX = optax.adamw(3e-3, weight_decay=0.05)


def build(config: dict, seed: int = 0):
  """``(loss_fn, params)``: next-token cross-entropy and the unbound params, as penzai's
  training examples bind them (``pz.unbind_params``, ``pz.bind_variables``)."""
  cfg = llamalike_common.LlamalikeTransformerConfig(**config)
  model = llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(seed))
  unbound, params = pz.unbind_params(model, freeze=True)

  def loss_fn(params, tokens):
    logits = pz.bind_variables(unbound, params)(pz.nx.wrap(tokens).tag("batch", "seq"))
    logp = jax.nn.log_softmax(logits.untag("batch", "seq", "vocabulary").unwrap(), axis=-1)
    picked = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked)

  return loss_fn, params


def _tokens(config: dict, batch: int, seq: int, seed: int = 0) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, config["vocab_size"], (batch, seq)), jnp.int32)


def train_check(steps: int) -> dict[str, float]:
  """The largest difference from optax after ``steps`` steps, per fused variant."""
  loss_fn, params = build(SMALL)
  tokens = _tokens(SMALL, 2, 16)

  def train(step, state):
    step, p = jax.jit(step, donate_argnums=(0, 1)), jax.tree.map(jnp.copy, params)
    for _ in range(steps):
      _, p, state = step(p, state, tokens)
    return p, state

  def optax_step(p, s, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
    updates, s = TX.update(grads, s, p)
    return loss, optax.apply_updates(p, updates), s

  want = train(optax_step, TX.init(params))
  diffs = {}
  for name, fx in {"backward": optfuse.fuse(TX),
                   "backward, guard=True": optfuse.fuse(TX, guard=True)}.items():
    got = train(fx.value_and_update(loss_fn), fx.init(params))
    diffs[name] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  return diffs


def memory(target: str) -> tuple[optfuse.MemoryReport, int]:
  """The issue configuration's compile-only report on ``target``, and its gradient's bytes."""
  loss_fn, params = build(ISSUE)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  report = optfuse.memory_report(loss_fn, TX, params, tokens,
                                 target=None if target == "cpu" else target)
  return report, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def timing(rounds: int) -> _timing.Timing:
  """optax's and backward fusion's step times on this machine, interleaved."""
  loss_fn, params = build(ISSUE)
  tokens = _tokens(ISSUE, 2, 256)
  trainers = {}
  for name, mode in (("optax", "off"), ("backward", "backward")):
    fx = optfuse.fuse(TX, mode=mode)
    compiled, _ = _timing.compile_step(fx, loss_fn, params, (tokens,))
    p = jax.tree.map(jnp.copy, params)
    trainers[name] = _timing.Trainer(compiled, p, fx.init(p), (tokens,))
  return _timing.interleaved(trainers, "optax", rounds, warmup=2, min_run_s=0.5)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="cpu", help="compile targets, comma-separated")
  parser.add_argument("--steps", type=int, default=10, help="training steps of the check")
  parser.add_argument("--time", type=int, default=0, metavar="ROUNDS",
                      help="time optax and backward fusion on this machine (0: do not)")
  args = parser.parse_args()
  for name, diff in train_check(args.steps).items():
    print(f"{name}: largest difference from optax after {args.steps} steps {diff:.2e}")
  for target in args.target.split(","):
    report, gradient = memory(target)
    saved = report["off"]["peak_bytes"] - report["backward"]["peak_bytes"]
    print(f"\n{target}: backward fusion saves {saved / 1e6:.1f} MB, {saved / gradient:.0%} of "
          f"the model's {gradient / 1e6:.1f} MB gradient\n{report}")
  if args.time:
    t = timing(args.time)
    print(f"\nstep time on this machine ({args.time} interleaved rounds, medians): optax "
          f"{t.step_s['optax'] * 1e3:.0f} ms, backward {t.step_s['backward'] * 1e3:.0f} ms, "
          f"ratio {t.ratio['backward']:.2f}x")


if __name__ == "__main__":
  main()
