"""Port a Flax train step to optfuse: the change is two lines.

Below, each canonical Flax training loop (written as in the Flax documentation) sits next to its
optfuse port. The script prints the diff between the two sources, which is the whole change,
trains both on scikit-learn's digits and prints how far apart they end up.

* Linen: ``jax.value_and_grad`` + ``state.apply_gradients`` become one call,
  ``optfuse.train_step(loss_fn)(state)``; the loss function and the (plain Flax) ``TrainState``
  stay as they are.
* NNX: ``nnx.Optimizer`` becomes ``optfuse.nnx.Optimizer`` and ``nnx.value_and_grad`` +
  ``optimizer.update`` become ``optimizer.value_and_update``.

Usage::

  python examples/port_train_step.py --steps 200
"""

from __future__ import annotations

import argparse
import difflib
import inspect

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from sklearn.datasets import load_digits
from tqdm import tqdm

import optfuse
import optfuse.nnx


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


class NnxMlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 64, rngs=rngs)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def linen_optax(batches, tx):
  model = LinenMlp()
  params = model.init(jax.random.key(0), batches[0]["image"])["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  @jax.jit
  def train_step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["image"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=grads)
    return state, loss

  for batch in batches:
    state, loss = train_step(state, batch)
  return state.params, loss


def linen_optfuse(batches, tx):
  model = LinenMlp()
  params = model.init(jax.random.key(0), batches[0]["image"])["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  @jax.jit
  def train_step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["image"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, state = optfuse.train_step(loss_fn)(state)
    return state, loss

  for batch in batches:
    state, loss = train_step(state, batch)
  return state.params, loss


def nnx_optax(batches, tx):
  model = NnxMlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["image"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  for batch in batches:
    loss = train_step(model, optimizer, batch)
  return nnx.state(model, nnx.Param), loss


def nnx_optfuse(batches, tx):
  model = NnxMlp(nnx.Rngs(0))
  optimizer = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["image"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss = optimizer.value_and_update(model, loss_fn)
    return loss

  for batch in batches:
    loss = train_step(model, optimizer, batch)
  return nnx.state(model, nnx.Param), loss


PORTS = {"Linen": (linen_optax, linen_optfuse), "NNX": (nnx_optax, nnx_optfuse)}


def source_diff(before, after) -> list[str]:
  """The changed lines between two functions' bodies (their ``def`` lines excluded)."""
  a = inspect.getsource(before).splitlines()[1:]
  b = inspect.getsource(after).splitlines()[1:]
  return [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
          if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def digit_batches(steps: int, batch_size: int, seed: int = 0) -> list[dict]:
  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  rng = np.random.default_rng(seed)
  idx = [rng.choice(len(images), batch_size, replace=False) for _ in range(steps)]
  return [{"image": images[i], "label": digits.target[i].astype(np.int32)} for i in idx]


def run(steps: int = 200, batch_size: int = 64, progress: bool = True) -> dict[str, dict]:
  """Trains every port and its original; returns per framework the diff and the differences.

  Returns:
    ``{"Linen": {...}, "NNX": {...}}`` each with ``diff`` (changed lines), ``losses``
    (``(original, port)`` final losses) and ``max_param_diff``.
  """
  batches = digit_batches(steps, batch_size)
  tx = optax.adamw(1e-3)
  out = {}
  for name, (before, after) in tqdm(PORTS.items(), desc="ports", disable=not progress):
    (ref_params, ref_loss), (params, loss) = before(batches, tx), after(batches, tx)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ref_params, params)
    out[name] = {"diff": source_diff(before, after), "losses": (float(ref_loss), float(loss)),
                 "max_param_diff": max(jax.tree.leaves(diffs))}
  return out


def main(argv=None) -> None:
  defaults = {k: v.default for k, v in inspect.signature(run).parameters.items()}
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=defaults["steps"])
  parser.add_argument("--batch-size", type=int, default=defaults["batch_size"])
  args = parser.parse_args(argv)
  for name, r in run(**vars(args)).items():
    removed, added = (sum(line[0] == sign for line in r["diff"]) for sign in "-+")
    print(f"\n{name}: the port replaces {removed} lines with {added}")
    print("\n".join(r["diff"]))
    print(f"after {args.steps} AdamW steps on digits: final loss {r['losses'][0]:.6f} (Flax) vs "
          f"{r['losses'][1]:.6f} (optfuse), max |param difference| {r['max_param_diff']:.2e}")


if __name__ == "__main__":
  main()
