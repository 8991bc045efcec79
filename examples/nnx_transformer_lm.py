"""An NNX decoder-only transformer language model with scanned layers, trained three ways.

The corpus is real text available offline on every machine: the ``.py`` source files of the
Python standard library (found through ``sysconfig``), read as bytes (a 256-symbol vocabulary).
The model embeds bytes with a tied embedding (the output projection is ``embed.attend``), adds
learned positions and runs ``--layers`` pre-norm blocks (causal ``nnx.MultiHeadAttention`` and
an MLP) stacked with ``nnx.vmap`` and applied with ``nnx.scan``.

The same model, batches and AdamW schedule are trained with

* optax: ``nnx.Optimizer`` with ``nnx.value_and_grad`` then ``optimizer.update``;
* backward fusion: ``optfuse.nnx.Optimizer(mode="backward")`` with ``value_and_update``;
* forward fusion: ``optfuse.nnx.Optimizer(mode="forward")`` (skipped, and said so, on an optfuse
  version that does not implement it).

It prints a table of the final training and validation losses, the median step time and the
compiled peak memory of each step (from XLA's buffer assignment: arguments + temporaries +
outputs - donated aliases), and writes ``examples/out/nnx_transformer_lm.png``.

Usage::

  python examples/nnx_transformer_lm.py --steps 200 --dim 256 --layers 4 --seq-len 64 --batch-size 8
"""

from __future__ import annotations

import argparse
import inspect
import os
import pathlib
import sysconfig
import time
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import optfuse.nnx

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"
VARIANTS = ("optax", "backward", "forward")


def load_corpus(max_bytes: int) -> tuple[np.ndarray, int]:
  """The standard library's ``.py`` files (sorted paths, no site-packages), as uint8 bytes.

  Returns:
    ``(data, num_files)`` with at most ``max_bytes`` bytes.
  """
  root = sysconfig.get_paths()["stdlib"]
  chunks, total, files = [], 0, 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames
                         if d not in ("site-packages", "dist-packages", "__pycache__"))
    for name in sorted(f for f in filenames if f.endswith(".py")):
      chunk = pathlib.Path(dirpath, name).read_bytes()
      chunks.append(chunk[:max_bytes - total])
      total += len(chunks[-1])
      files += 1
      if total >= max_bytes:
        return np.frombuffer(b"".join(chunks), np.uint8), files
  return np.frombuffer(b"".join(chunks), np.uint8), files


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention and a 4x MLP, both residual."""

  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.attn_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.attn_norm(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLm(nnx.Module):
  """Byte-level decoder-only LM with a tied embedding and ``layers`` scanned blocks."""

  def __init__(self, dim: int, heads: int, layers: int, seq_len: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(dim, heads, rngs)

    self.embed = nnx.Embed(256, dim, rngs=rngs)
    self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, dim)))
    self.blocks = make_blocks(rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.positions[...][:tokens.shape[1]]
    mask = nnx.make_causal_mask(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
    def apply_blocks(x, block, mask):
      return block(x, mask)

    return self.embed.attend(self.norm(apply_blocks(x, self.blocks, mask)))


def loss_fn(model: TransformerLm, tokens) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of ``tokens[:, 1:]`` given ``tokens[:, :-1]``."""
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  return np.stack([data[s:s + length] for s in starts]).astype(np.int32)


def compiled_memory(compiled) -> dict[str, int]:
  """Peak (argument + temp + output - alias) and temp bytes from XLA's buffer assignment."""
  stats = compiled.memory_analysis()
  peak = (stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes)
  return {"peak_bytes": int(peak), "temp_bytes": int(stats.temp_size_in_bytes)}


def train(variant: str, config: dict, batches: np.ndarray, val_tokens: np.ndarray,
          progress: bool) -> dict[str, Any]:
  """Trains one variant; raises NotImplementedError if optfuse lacks its mode."""
  model = TransformerLm(config["dim"], config["heads"], config["layers"], config["seq_len"],
                        nnx.Rngs(config["seed"]))
  schedule = optax.warmup_cosine_decay_schedule(0.0, config["learning_rate"],
                                                max(1, len(batches) // 10), len(batches))
  tx = optax.adamw(schedule, b2=0.95, weight_decay=0.1)
  if variant == "optax":
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  else:
    optimizer = optfuse.nnx.Optimizer(model, tx, wrt=nnx.Param, mode=variant)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    if variant == "optax":
      loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
      optimizer.update(model, grads)
    else:
      loss = optimizer.value_and_update(model, loss_fn, tokens)
    return nnx.state((model, optimizer)), loss

  @jax.jit
  def evaluate(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    if variant != "optax":
      optimizer.flush(model)  # forward mode holds one pending update; the others: no-op
    return loss_fn(model, tokens)

  compiled = jax.jit(train_step, donate_argnums=0).lower(state, batches[0]).compile()
  losses = []
  bar = tqdm(batches, desc=f"{variant:>8}", disable=not progress)
  for tokens in bar:
    state, loss = compiled(state, tokens)
    losses.append(float(loss))
    bar.set_postfix(loss=f"{losses[-1]:.3f}")
  return {"losses": np.array(losses), "val_loss": float(evaluate(state, val_tokens)),
          **compiled_memory(compiled), "step": compiled, "state": state}


def time_steps(runs: dict[str, dict], tokens: np.ndarray, rounds: int) -> dict[str, float]:
  """Median wall-clock milliseconds of one step per variant.

  The variants take turns (one step each per round, after training), so a load change on a
  shared machine hits all of them alike instead of whichever ran at that moment.
  """
  times = {name: [] for name in runs}
  for _ in range(rounds):
    for name, run in runs.items():
      start = time.perf_counter()
      run["state"], loss = run["step"](run["state"], tokens)
      loss.block_until_ready()
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def plot(results: dict[str, dict], path: pathlib.Path, config: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for (name, r), style in zip(results.items(), ("-", "--", ":")):
    ax.plot(np.arange(1, len(r["losses"]) + 1), r["losses"], style, label=name, alpha=0.85)
  ax.set(xlabel="step", ylabel="training loss (nats/byte)", yscale="log",
         title=f"NNX transformer LM on the stdlib sources ({config['layers']} scanned layers, "
               f"dim {config['dim']})")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(steps: int = 200, dim: int = 256, heads: int = 4, layers: int = 4, seq_len: int = 64,
        batch_size: int = 8, learning_rate: float = 2e-3, corpus_mb: float = 8.0,
        seed: int = 0, timing_rounds: int = 20, variants=VARIANTS,
        out_dir: pathlib.Path = OUT_DIR, progress: bool = True) -> dict[str, Any]:
  """Trains the LM with each variant and compares them.

  Args:
    steps: training steps of each variant.
    dim: model width.
    heads: attention heads.
    layers: scanned transformer blocks.
    seq_len: bytes of context per example.
    batch_size: examples per step.
    learning_rate: peak AdamW learning rate (10% linear warmup, cosine decay).
    corpus_mb: megabytes of stdlib source to read; the last 5% are held out for validation.
    seed: seed of the initial params and the batch positions.
    timing_rounds: extra steps per variant, taken in turns after training, to time a step.
    variants: a subset of ``("optax", "backward", "forward")``.
    out_dir: where the PNG goes.
    progress: show tqdm progress bars.

  Returns:
    A dict with ``runs`` (per variant: ``losses``, ``val_loss``, ``step_ms``, ``peak_bytes``,
    ``temp_bytes``), ``unavailable`` (variant -> reason), ``corpus`` (bytes, files), ``plot``.
  """
  data, files = load_corpus(int(corpus_mb * 1e6))
  split = int(0.95 * len(data))
  rng = np.random.default_rng(seed)
  batches = windows(data[:split], rng.integers(0, split - seq_len - 1, steps * batch_size),
                    seq_len + 1).reshape(steps, batch_size, seq_len + 1)
  val_tokens = windows(data[split:], rng.integers(0, len(data) - split - seq_len - 1, 64),
                       seq_len + 1)
  config = {"dim": dim, "heads": heads, "layers": layers, "seq_len": seq_len,
            "learning_rate": learning_rate, "seed": seed}
  results, unavailable = {}, {}
  for variant in variants:
    try:
      results[variant] = train(variant, config, batches, val_tokens, progress)
    except NotImplementedError as e:
      unavailable[variant] = str(e)
  for name, step_ms in time_steps(results, batches[0], timing_rounds).items():
    del results[name]["step"], results[name]["state"]
    results[name]["step_ms"] = step_ms
  path = pathlib.Path(out_dir) / "nnx_transformer_lm.png"
  plot(results, path, config)
  return {"runs": results, "unavailable": unavailable, "corpus": (len(data), files),
          "plot": path}


def main(argv=None) -> None:
  defaults = {k: v.default for k, v in inspect.signature(run).parameters.items()}
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=defaults["steps"])
  parser.add_argument("--dim", type=int, default=defaults["dim"])
  parser.add_argument("--heads", type=int, default=defaults["heads"])
  parser.add_argument("--layers", type=int, default=defaults["layers"])
  parser.add_argument("--seq-len", type=int, default=defaults["seq_len"])
  parser.add_argument("--batch-size", type=int, default=defaults["batch_size"])
  parser.add_argument("--learning-rate", type=float, default=defaults["learning_rate"])
  parser.add_argument("--corpus-mb", type=float, default=defaults["corpus_mb"])
  parser.add_argument("--seed", type=int, default=defaults["seed"])
  parser.add_argument("--timing-rounds", type=int, default=defaults["timing_rounds"])
  parser.add_argument("--out-dir", type=pathlib.Path, default=defaults["out_dir"])
  args = parser.parse_args(argv)
  out = run(**vars(args))
  size, files = out["corpus"]
  print(f"\ncorpus: {size / 1e6:.1f} MB from {files} stdlib files; {args.steps} steps of "
        f"{args.batch_size} x {args.seq_len} bytes; backend: {jax.default_backend()}; load "
        f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; step time: median of "
        f"{args.timing_rounds} steps per variant, taken in turns")
  print(f"{'variant':<10} {'train loss':>10} {'val loss':>9} {'step (ms)':>10} "
        f"{'peak MB':>9} {'temp MB':>9} {'max |loss - optax|':>19}")
  ref = out["runs"].get("optax")
  for name, r in out["runs"].items():
    diff = "-" if ref is None else f"{np.max(np.abs(r['losses'] - ref['losses'])):.2e}"
    print(f"{name:<10} {r['losses'][-1]:>10.4f} {r['val_loss']:>9.4f} {r['step_ms']:>10.1f} "
          f"{r['peak_bytes'] / 1e6:>9.2f} {r['temp_bytes'] / 1e6:>9.2f} {diff:>19}")
  for name, reason in out["unavailable"].items():
    print(f"{name:<10} not run: this optfuse does not implement it ({reason})")
  print(f"plot: {out['plot']}")


if __name__ == "__main__":
  main()
