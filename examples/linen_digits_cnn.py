"""A Linen CNN on scikit-learn's handwritten digits, trained with optax and with optfuse.

The data is ``sklearn.datasets.load_digits`` (1797 real 8x8 scans that ship inside scikit-learn,
so this runs offline). The model has convolutions, BatchNorm (a mutable ``batch_stats``
collection) and Dropout. Both runs start from the same initial variables and see the same
batches and dropout keys:

* optax: ``flax.training.train_state.TrainState`` with ``jax.value_and_grad`` and
  ``state.apply_gradients``;
* optfuse: ``optfuse.linen.TrainState`` with ``state.value_and_update`` (the update of every
  parameter runs inside the backward pass).

They reach the same training loss and test accuracy curves; the script prints the final
comparison and writes ``examples/out/linen_digits_cnn.png``.

Usage::

  python examples/linen_digits_cnn.py --steps 600 --width 16 --batch-size 64 --mode backward
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import optfuse.linen

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"


class Cnn(nn.Module):
  """Two conv blocks (conv without bias, BatchNorm, ReLU, max-pool), dropout, a dense head."""

  width: int
  dropout: float = 0.2

  @nn.compact
  def __call__(self, x, train: bool):
    for features in (self.width, 2 * self.width):
      x = nn.Conv(features, (3, 3), use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = nn.Dropout(self.dropout, deterministic=not train)(x.reshape(x.shape[0], -1))
    return nn.Dense(10)(x)


class OptaxState(train_state.TrainState):
  batch_stats: Any


class FusedState(optfuse.linen.TrainState):
  batch_stats: Any


def load_data(seed: int = 0):
  """Digits as ``(train_x, train_y, test_x, test_y)``: 8x8x1 images in [0, 1], 20% held out."""
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  train_x, test_x, train_y, test_y = train_test_split(
      images, digits.target.astype(np.int32), test_size=0.2, random_state=seed,
      stratify=digits.target)
  return train_x, train_y, test_x, test_y


def batch_indices(num_examples: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
  """``steps`` batches of indices, reshuffled every epoch (the same for every run)."""
  rng = np.random.default_rng(seed)
  per_epoch = num_examples // batch_size
  epochs = -(-steps // per_epoch)
  order = np.concatenate([rng.permutation(num_examples)[:per_epoch * batch_size]
                          for _ in range(epochs)])
  return order.reshape(-1, batch_size)[:steps]


def make_loss(model: Cnn):
  def loss_fn(params, batch_stats, images, labels, dropout_key):
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                  train=True, rngs={"dropout": dropout_key},
                                  mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, updates["batch_stats"]

  return loss_fn


def train(name: str, state, loss_fn, data, indices: np.ndarray, eval_every: int, seed: int,
          progress: bool) -> dict[str, Any]:
  """Trains ``state`` on the batches ``indices``; returns losses, accuracies and final state."""
  train_x, train_y, test_x, test_y = data
  fused = isinstance(state, optfuse.linen.TrainState)
  base_key = jax.random.key(seed)

  @jax.jit
  def train_step(state, images, labels):
    key = jax.random.fold_in(base_key, state.step)
    if fused:
      (loss, stats), state = state.value_and_update(loss_fn, state.batch_stats, images, labels,
                                                    key, has_aux=True)
    else:
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      (loss, stats), grads = grad_fn(state.params, state.batch_stats, images, labels, key)
      state = state.apply_gradients(grads=grads)
    return state.replace(batch_stats=stats), loss

  @jax.jit
  def accuracy(state):
    if fused:
      state = state.flush()  # forward mode holds one pending update; the others: no-op
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, test_x,
                            train=False)
    return jnp.mean(jnp.argmax(logits, -1) == test_y)

  losses, eval_steps, accuracies = [], [], []
  bar = tqdm(indices, desc=f"{name:>18}", disable=not progress, leave=True)
  for t, idx in enumerate(bar, start=1):
    state, loss = train_step(state, train_x[idx], train_y[idx])
    losses.append(float(loss))
    if t % eval_every == 0 or t == len(indices):
      eval_steps.append(t)
      accuracies.append(float(accuracy(state)))
      bar.set_postfix(loss=f"{losses[-1]:.4f}", test_acc=f"{accuracies[-1]:.3f}")
  if fused:
    state = state.flush()
  return {"losses": np.array(losses), "eval_steps": np.array(eval_steps),
          "accuracy": np.array(accuracies), "params": state.params}


def plot(results: dict[str, dict], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  for (name, r), style in zip(results.items(), ("-", "--")):
    steps = np.arange(1, len(r["losses"]) + 1)
    ax_loss.plot(steps, r["losses"], style, label=name, alpha=0.8)
    ax_acc.plot(r["eval_steps"], r["accuracy"], style, marker=".", label=name)
  ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="Training loss")
  ax_acc.set(xlabel="step", ylabel="test accuracy", title="Test accuracy (360 digits)")
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle("Linen CNN on sklearn digits: optax vs optfuse")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(steps: int = 600, width: int = 16, batch_size: int = 64, learning_rate: float = 3e-3,
        mode: str = "backward", eval_every: int = 25, seed: int = 0,
        out_dir: pathlib.Path = OUT_DIR, progress: bool = True) -> dict[str, Any]:
  """Trains the CNN with optax and with optfuse and compares them.

  Args:
    steps: training steps of each run.
    width: channels of the first conv (the second has twice as many).
    batch_size: examples per step.
    learning_rate: AdamW learning rate (cosine decay to 0 over ``steps``).
    mode: the optfuse mode, "backward", "forward" or "off".
    eval_every: steps between test-accuracy evaluations.
    seed: seed of the initial variables, the batch order and the dropout keys.
    out_dir: where the PNG goes.
    progress: show tqdm progress bars.

  Returns:
    A dict with the per-run results (``"optax"``, ``"optfuse"``), the comparison numbers
    (``max_loss_diff``, ``max_accuracy_diff``, ``max_param_diff``) and ``plot`` (the PNG path).
  """
  data = load_data(seed)
  model = Cnn(width)
  variables = model.init(jax.random.key(seed), data[0][:1], train=False)
  tx = optax.adamw(optax.cosine_decay_schedule(learning_rate, steps), weight_decay=1e-4)
  loss_fn = make_loss(model)
  indices = batch_indices(len(data[0]), batch_size, steps, seed)
  kwargs = {"apply_fn": model.apply, "params": variables["params"], "tx": tx,
            "batch_stats": variables["batch_stats"]}
  results = {
      "optax": train("optax", OptaxState.create(**kwargs), loss_fn, data, indices, eval_every,
                     seed, progress),
      f"optfuse ({mode})": train(f"optfuse ({mode})", FusedState.create(mode=mode, **kwargs),
                                 loss_fn, data, indices, eval_every, seed, progress),
  }
  ref, fused = results.values()
  param_diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), ref["params"],
                            fused["params"])
  path = pathlib.Path(out_dir) / "linen_digits_cnn.png"
  plot(results, path)
  return {"runs": results,
          "max_loss_diff": float(np.max(np.abs(ref["losses"] - fused["losses"]))),
          "max_accuracy_diff": float(np.max(np.abs(ref["accuracy"] - fused["accuracy"]))),
          "max_param_diff": max(jax.tree.leaves(param_diff)),
          "plot": path}


def main(argv=None) -> None:
  defaults = {k: v.default for k, v in inspect.signature(run).parameters.items()}
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=defaults["steps"])
  parser.add_argument("--width", type=int, default=defaults["width"])
  parser.add_argument("--batch-size", type=int, default=defaults["batch_size"])
  parser.add_argument("--learning-rate", type=float, default=defaults["learning_rate"])
  parser.add_argument("--mode", default=defaults["mode"], choices=("backward", "forward", "off"))
  parser.add_argument("--eval-every", type=int, default=defaults["eval_every"])
  parser.add_argument("--seed", type=int, default=defaults["seed"])
  parser.add_argument("--out-dir", type=pathlib.Path, default=defaults["out_dir"])
  args = parser.parse_args(argv)
  out = run(**vars(args))
  print(f"\n{'run':<20} {'final loss':>10} {'final test acc':>15} {'best test acc':>14}")
  for name, r in out["runs"].items():
    print(f"{name:<20} {r['losses'][-1]:>10.4f} {r['accuracy'][-1]:>15.4f} "
          f"{r['accuracy'].max():>14.4f}")
  print(f"\nmax |loss difference| over {args.steps} steps: {out['max_loss_diff']:.2e}")
  print(f"max |test accuracy difference| over {len(out['runs']['optax']['accuracy'])} "
        f"evaluations: {out['max_accuracy_diff']:.4f}")
  print(f"max |param difference| after training: {out['max_param_diff']:.2e}")
  print(f"plot: {out['plot']}")


if __name__ == "__main__":
  main()
