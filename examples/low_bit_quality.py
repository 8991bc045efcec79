"""Does 8- or 4-bit AdamW state train as well as float32? A scanned decoder, three seeds each.

The model is the bench's scanned decoder (``optfuse/bench/_models.py``: pre-norm blocks stacked
under ``lax.scan``, tied embedding), trained on next-byte prediction over real text available
offline on every machine: the ``.py`` sources of the Python standard library, read as bytes
(``examples/nnx_transformer_lm.py``'s corpus), the last tenth held out for validation.

Each seed draws its own initial params and its own batches; float32 AdamW, 8-bit and 4-bit
``optfuse.low_bit`` AdamW (default blocks: 256 and 128) train from the same seed, all fused
(``optfuse.fuse(tx, mode="backward")``). The script prints

1. the final validation loss per variant: the mean over seeds, the seed-to-seed spread (max -
   min) and the mean paired difference to float32, against the goal (8-bit within float32's
   spread, 4-bit within twice it);
2. the relative error of each quantized slot (``mu``, ``nu``) after one update against float32
   AdamW's, per block size and bits, on the model's gradient at its initial params, the share
   of nonzero second moments stored as zero, and the relative error of the next update (the
   first that reads the stored slots);
3. how much of the state a tiny model quantizes (slots under ``min_size`` stay float32);

and writes the loss curves to ``docs/_static/low_bit_quality.png``.

``--optimizer muon`` runs the same study with ``optax.contrib.muon`` (each stacked matrix
orthogonalised per layer, ``examples/muon_memory.py``'s dimension numbers; the rest on its AdamW
fallback): its one slot, the momentum ``mu``, in float32 or low bits; part 1 and 3 only, the
curves to ``docs/_static/low_bit_quality_muon.png``. ``--variants`` picks the variants.

Usage::

  python examples/low_bit_quality.py            # about 10 minutes on two shared CPU cores
  python examples/low_bit_quality.py --quick    # a tiny run, seconds, no plot
  python examples/low_bit_quality.py --optimizer muon --variants f32,8-bit
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optfuse
from optfuse._low_bit import _blocks, _maps
from optfuse.bench import _models

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from muon_memory import muon_dims  # noqa: E402  (the bench decoder's Muon dimension numbers)
from nnx_transformer_lm import load_corpus  # noqa: E402  (the examples' shared corpus)

STATIC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "_static"
PLOT = STATIC / "low_bit_quality.png"
PLOTS = {"adamw": PLOT, "muon": STATIC / "low_bit_quality_muon.png"}
VARIANTS = {"f32": None, "8-bit": 8, "4-bit": 4}
# Muon's matrices take a larger step than AdamW's (Jordan et al. 2024 use 0.02); the rest of the
# params, on its AdamW fallback, the AdamW recipe's peak rate.
MUON_LEARNING_RATE = 0.02
BLOCK_SIZES = (64, 128, 256, 2048)

CONFIG = dict(model=_models.DecoderConfig(layers=4, dim=128, heads=4, ff=512, vocab=256, seq=64,
                                          batch=16),
              steps=300, seeds=3, learning_rate=3e-3, corpus_mb=2.0, val_windows=64)
QUICK = dict(model=_models.DecoderConfig(layers=2, dim=64, heads=2, ff=128, vocab=256, seq=32,
                                         batch=8),
             steps=40, seeds=2, learning_rate=3e-3, corpus_mb=0.2, val_windows=16)


def adamw(learning_rate: float, steps: int, bits: int | None) -> optax.GradientTransformation:
  """The LM recipe's AdamW (warmup, cosine decay, b2=0.95, weight decay 0.1), its state in
  float32 (``bits=None``) or low bits."""
  return optimizer("adamw", learning_rate, steps, bits)


def optimizer(name: str, learning_rate: float, steps: int, bits: int | None
              ) -> optax.GradientTransformation:
  """``"adamw"``: the LM recipe's AdamW (warmup, cosine decay, b2=0.95, weight decay 0.1);
  ``"muon"``: Muon on the stacked matrices (peak rate MUON_LEARNING_RATE, the same schedule and
  weight decay), the rest on its AdamW fallback at ``learning_rate``. The state in float32
  (``bits=None``) or low bits."""
  warmup = max(1, steps // 10)
  schedule = lambda peak: optax.warmup_cosine_decay_schedule(0.0, peak, warmup, steps)
  if name == "adamw":
    tx = optax.adamw(schedule(learning_rate), b2=0.95, weight_decay=0.1)
  elif name == "muon":
    tx = optax.contrib.muon(schedule(MUON_LEARNING_RATE), weight_decay=0.1,
                            adam_learning_rate=schedule(learning_rate), adam_b2=0.95,
                            adam_weight_decay=0.1, muon_weight_dimension_numbers=muon_dims)
  else:
    raise ValueError(f"optimizer {name!r}: the study runs 'adamw' or 'muon'")
  return tx if bits is None else optfuse.low_bit(tx, bits=bits)


def split_corpus(corpus_mb: float) -> tuple[np.ndarray, np.ndarray]:
  data, _ = load_corpus(int(corpus_mb * 1e6))
  cut = len(data) * 9 // 10
  return data[:cut], data[cut:]


def windows(data: np.ndarray, starts, length: int) -> np.ndarray:
  return np.stack([data[s:s + length] for s in starts]).astype(np.int32)


def trainer(config: dict, bits: int | None, name: str = "adamw"):
  """The model and the jitted fused step of one variant (compiled once, for every seed)."""
  model = _models.decoder(config["model"], scanned=True, remat=False)
  tx = optimizer(name, config["learning_rate"], config["steps"], bits)
  fx = optfuse.fuse(tx, mode="backward")
  return model, fx, jax.jit(fx.value_and_update(model.loss), donate_argnums=(0, 1))


def train(config: dict, variant, seed: int, train_data: np.ndarray,
          val_tokens: np.ndarray) -> dict[str, Any]:
  """Trains one ``trainer`` from one seed; returns its per-step losses and final validation
  loss."""
  c, (model, fx, step) = config["model"], variant
  params = _models.materialize(model.params, seed)
  state = fx.init(params)
  rng = np.random.default_rng(1000 + seed)
  losses = []
  for _ in range(config["steps"]):
    tokens = windows(train_data, rng.integers(0, len(train_data) - c.seq - 1, c.batch),
                     c.seq + 1)
    loss, params, state = step(params, state, tokens[:, :-1], tokens[:, 1:])
    losses.append(loss)
  val = jax.jit(model.loss)(params, val_tokens[:, :-1], val_tokens[:, 1:])
  return {"losses": np.asarray(jax.device_get(losses)), "val_loss": float(val)}


def quality(config: dict, name: str = "adamw", variants: tuple[str, ...] = tuple(VARIANTS)
            ) -> dict[str, Any]:
  """Every variant (float32 first) from every seed: ``{"runs": {variant: [run per seed]},
  "table": rows}``."""
  c = config["model"]
  train_data, val_data = split_corpus(config["corpus_mb"])
  starts = np.linspace(0, len(val_data) - c.seq - 1, config["val_windows"]).astype(int)
  val_tokens = windows(val_data, starts, c.seq + 1)
  runs = {}
  for variant in variants:
    step = trainer(config, VARIANTS[variant], name)
    runs[variant] = [train(config, step, seed, train_data, val_tokens)
                     for seed in range(config["seeds"])]
  final = {variant: [r["val_loss"] for r in rs] for variant, rs in runs.items()}
  spread = max(final["f32"]) - min(final["f32"])
  rows = []
  for variant, values in final.items():
    diff = statistics.mean(v - f for v, f in zip(values, final["f32"], strict=True))
    allowed = {"f32": None, "8-bit": spread, "4-bit": 2 * spread}[variant]
    rows.append({"variant": variant, "mean": statistics.mean(values),
                 "spread": max(values) - min(values), "paired_diff": diff, "allowed": allowed,
                 "met": None if allowed is None else abs(diff) <= allowed})
  return {"runs": runs, "table": rows}


def _rel(got, want) -> float:
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def _dequantized(slots, bits: int, block_size: int, signed: bool, like) -> jax.Array:
  """The quantized leaves of ``slots`` (``like``: the float32 slots) dequantized, flattened."""
  scheme = _maps.scheme(bits, signed)
  return jnp.concatenate([
      _blocks.dequantize(q.codes, q.scales, scheme, block_size, w.shape[-1]).ravel()
      for q, w in zip(jax.tree.leaves(slots, is_leaf=_is_slot), jax.tree.leaves(like),
                      strict=True) if isinstance(q, optfuse.QuantizedSlot)])


def _quantized_only(slots, like) -> jax.Array:
  """The float32 slots of the leaves that low bits quantize, flattened."""
  return jnp.concatenate([w.ravel() for q, w in zip(jax.tree.leaves(slots, is_leaf=_is_slot),
                                                    jax.tree.leaves(like), strict=True)
                          if isinstance(q, optfuse.QuantizedSlot)])


def slot_errors(bits: int, block_size: int, params, grads: tuple) -> dict[str, float]:
  """After one AdamW update from zero state: the relative errors (over every quantized leaf)
  of the stored ``mu`` and ``nu`` against float32 AdamW's, and the share of nonzero ``nu``
  stored as zero; then the relative error of the second update, the first one that reads the
  stored slots (the first update is exact)."""
  base = optax.adamw(1e-3, b2=0.95, weight_decay=0.1)
  tx = optfuse.low_bit(base, bits=bits, block_size=block_size)

  # The zero states are arguments: built inside the jit, XLA would constant-fold their
  # quantization (a slow fold, and a warning on every run).
  @jax.jit
  def errors(params, grads, want_state, got_state):
    updates = []
    for g in grads:
      want, want_state = base.update(g, want_state, params)
      got, got_state = tx.update(g, got_state, params)
      if not updates:
        first = (got_state[0], want_state[0])
      updates.append((got, want))
    (got, want), rel = first, lambda a, b: jnp.linalg.norm(a - b) / jnp.linalg.norm(b)
    mu = _dequantized(got.mu, bits, block_size, True, want.mu)
    nu = _dequantized(got.nu, bits, block_size, False, want.nu)
    mu_ref, nu_ref = _quantized_only(got.mu, want.mu), _quantized_only(got.nu, want.nu)
    flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
    return {"mu": rel(mu, mu_ref), "nu": rel(nu, nu_ref),
            "nu_to_zero": jnp.mean((nu == 0) & (nu_ref > 0)),
            "update": rel(flat(updates[1][0]), flat(updates[1][1]))}

  states = jax.jit(lambda p: (base.init(p), tx.init(p)))(params)
  return {k: float(v) for k, v in errors(params, grads, *states).items()}


def _is_slot(x) -> bool:
  return isinstance(x, optfuse.QuantizedSlot)


def error_table(config: dict) -> list[dict[str, Any]]:
  """``slot_errors`` per bits and block size, on the model's gradients at seed 0's params on
  two batches."""
  c = config["model"]
  model = _models.decoder(c, scanned=True, remat=False)
  params = _models.materialize(model.params, 0)
  train_data, _ = split_corpus(config["corpus_mb"])
  rng, grad = np.random.default_rng(0), jax.jit(jax.grad(model.loss))
  grads = []
  for _ in range(2):
    tokens = windows(train_data, rng.integers(0, len(train_data) - c.seq - 1, c.batch),
                     c.seq + 1)
    grads.append(grad(params, tokens[:, :-1], tokens[:, 1:]))
  return [{"bits": bits, "block_size": block, **slot_errors(bits, block, params, tuple(grads))}
          for bits in (8, 4) for block in BLOCK_SIZES]


def state_bytes(c: _models.DecoderConfig, name: str = "adamw") -> dict[str, int]:
  """The optimizer's state bytes for the decoder of ``c``, in float32 and in low bits
  (compile-free)."""
  params = _models.abstract(_models.decoder(c, scanned=True, remat=False).params)
  out = {}
  for variant, bits in VARIANTS.items():
    tx = optimizer(name, 1e-3, 10, bits)
    out[variant] = sum(math.prod(x.shape) * x.dtype.itemsize
                       for x in jax.tree.leaves(jax.eval_shape(tx.init, params)))
  return out


def plot(runs: dict[str, list[dict]], path: pathlib.Path, config: dict, name: str = "adamw"
         ) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  c, window = config["model"], max(1, config["steps"] // 30)
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for (name, rs), color in zip(runs.items(), ("black", "tab:blue", "tab:orange")):
    # Each seed's training loss smoothed over ``window`` steps; the band spans the seeds.
    smooth = np.stack([np.convolve(r["losses"], np.ones(window) / window, "valid") for r in rs])
    x = np.arange(window, config["steps"] + 1)
    ax.plot(x, smooth.mean(0), color=color, label=f"{name} (mean of {len(rs)} seeds)")
    ax.fill_between(x, smooth.min(0), smooth.max(0), color=color, alpha=0.2)
  ax.set(xlabel="step", ylabel=f"training loss (nats/byte, mean over {window} steps)",
         yscale="log", title=f"{'AdamW' if name == 'adamw' else 'Muon'} state in "
                             f"{', '.join(runs)}: scanned decoder {c.layers}x{c.dim}, "
                             "stdlib bytes")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run(quick: bool = False, plot_path: pathlib.Path | None = PLOT, name: str = "adamw",
        variants: tuple[str, ...] = tuple(VARIANTS)) -> dict[str, Any]:
  """The whole study of optimizer ``name`` (``quick``: a tiny configuration) over ``variants``
  (float32 first); writes the plot unless ``plot_path`` is ``None``. The slot-error table is
  AdamW's (its ``mu`` and ``nu``)."""
  if not variants or variants[0] != "f32" or not set(variants) <= set(VARIANTS):
    raise ValueError(f"variants {variants!r}: 'f32' first, then any of {list(VARIANTS)[1:]}")
  config = QUICK if quick else CONFIG
  out = quality(config, name, variants)
  out["errors"] = error_table(config) if name == "adamw" else []
  out["bytes"] = {"tiny (QUICK)": state_bytes(QUICK["model"], name),
                  "trained (CONFIG)": state_bytes(CONFIG["model"], name)}
  out["config"], out["optimizer"] = config, name
  if plot_path is not None:
    plot(out["runs"], plot_path, config, name)
    out["plot"] = plot_path
  return out


def markdown(out: dict[str, Any]) -> str:
  lines = ["| state | final val loss, mean | seed spread (max - min) | mean paired diff to f32 |"
           " goal: within | met |", "|---|---|---|---|---|---|"]
  for r in out["table"]:
    lines.append(f"| {r['variant']} | {r['mean']:.4f} | {r['spread']:.4f} | "
                 f"{r['paired_diff']:+.4f} | "
                 + ("- | - |" if r["allowed"] is None else
                    f"{r['allowed']:.4f} | {'yes' if r['met'] else 'no'} |"))
  if out["errors"]:
    lines += ["", "| bits | block | mu rel. error | nu rel. error | nonzero nu stored as 0 |"
              " 2nd update rel. error |", "|---|---|---|---|---|---|"]
  for e in out["errors"]:
    lines.append(f"| {e['bits']} | {e['block_size']} | {e['mu']:.2e} | {e['nu']:.2e} | "
                 f"{100 * e['nu_to_zero']:.2f} % | {e['update']:.2e} |")
  title = "AdamW" if out.get("optimizer", "adamw") == "adamw" else "Muon"
  lines += ["", f"| model | {title} state f32 | 8-bit | 4-bit |", "|---|---|---|---|"]
  for name, b in out["bytes"].items():
    lines.append(f"| {name} | {b['f32']:,} B | {b['8-bit']:,} B ({b['8-bit'] / b['f32']:.0%}) | "
                 f"{b['4-bit']:,} B ({b['4-bit'] / b['f32']:.0%}) |")
  c = out["config"]
  rate = (f"peak lr {c['learning_rate']}" if out.get("optimizer", "adamw") == "adamw" else
          f"Muon peak lr {MUON_LEARNING_RATE}, fallback {c['learning_rate']}")
  lines.append(f"\n{c['model']}, {c['steps']} steps, {c['seeds']} seeds, {rate}; "
               f"jax {jax.__version__}, optax {optax.__version__}")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a tiny configuration, seconds; writes no plot")
  parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
  parser.add_argument("--optimizer", choices=sorted(PLOTS), default="adamw")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="comma-separated, f32 first (default: %(default)s)")
  args = parser.parse_args()
  plot_path = None if args.no_plot or args.quick else PLOTS[args.optimizer]
  out = run(args.quick, plot_path, args.optimizer, tuple(args.variants.split(",")))
  print(markdown(out))
  if "plot" in out:
    print(f"wrote {out['plot']}")


if __name__ == "__main__":
  main()
