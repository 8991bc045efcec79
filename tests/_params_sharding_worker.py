"""The sharded runs behind ``test_offload_params.py``, on eight simulated CPU devices.

Usage::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python tests/_params_sharding_worker.py OUT_DIR [--steps N]

The scanned MLP of ``_sharding_worker.py``, seven layers deep (six stacked blocks, which the
fused loops take), on each layout of ``LAYOUTS`` (Auto mesh axes): data parallel (params and
AdamW state replicated) and FSDP (sharded along "fsdp"). Each runs plain optax, then backward
and forward fusion with ``offload="params"``, each leaf its fused loop streams in
host memory and sharded like its device-resident twin; then the same three with two
microbatches (``*_mb``: optax's mean of the two microbatch gradients, then one update), and on
FSDP backward fusion with a learning rate 1 % off (``FAULTED``). For
each the worker records the output shardings that differ from the inputs', the all-gathers of
its compiled HLO and the memory kinds of the params it returns, trains ``N`` steps, and writes
``OUT_DIR/report.json`` and the losses and final params and state (on the device) to
``OUT_DIR/results.npz``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
import _sharding_worker as worker  # noqa: E402
import faults  # noqa: E402  (tests/faults.py)

import optfuse  # noqa: E402

DEPTH = 7
# ``backward_read``: backward fusion reading the host rows in the iteration that uses them, as
# the TPU compiler's step does on several devices (``worker.rows_read_in_iteration``).
IMPLS = ("optax", "backward", "forward", "backward_read", "optax_mb", "backward_mb",
         "forward_mb")
# Backward fusion of AdamW whose updates are 1 % too large (``faults.lr_off``), FSDP only: the
# criterion of ``test_offload_params.py`` must reject it.
FAULTED = "backward+lr_1pct_off"
MICROBATCHES = 2


def _optax_microbatched(loss):
  """optax's step on the mean gradient of ``MICROBATCHES`` slices of the batch."""
  def step(params, state, x, y):
    xs, ys = (a.reshape(MICROBATCHES, -1, *a.shape[1:]) for a in (x, y))
    grads = [jax.value_and_grad(loss)(params, xs[i], ys[i]) for i in range(MICROBATCHES)]
    mean = jax.tree.map(lambda *g: sum(g) / MICROBATCHES, *[g for _, g in grads])
    updates, state = worker.TX.update(mean, state, params)
    value = sum(v for v, _ in grads) / MICROBATCHES
    return value, optax.apply_updates(params, updates), state

  return step
LAYOUTS = ("fsdp", "data_parallel")


def _host_like(shardings, tree):
  """``shardings`` in ``pinned_host`` memory where ``tree``'s leaves are."""
  return jax.tree.map(lambda sh, x: sh.with_memory_kind("pinned_host")
                      if x.sharding.memory_kind == "pinned_host" else sh, shardings, tree)


def run(layout: str, impl: str, steps: int) -> tuple[dict, dict]:
  """Compiles and trains one implementation; returns ``(report, arrays)``."""
  worker.DEPTH = DEPTH
  mesh = worker.make_mesh(layout, "auto")
  loss = functools.partial(worker.loss_fn, model="scan")
  params = worker.init_params("scan", 32)
  data = worker.batches(steps)
  mode, microbatched = impl.removesuffix("_mb"), impl.endswith("_mb")
  mode, read = mode.removesuffix("_read"), mode.endswith("_read")
  mode, _, fault = mode.partition("+")
  tx = faults.faults(lambda path: True)[fault](worker.TX) if fault else worker.TX
  if mode == "optax":
    initable, placed = worker.TX, params
    step = _optax_microbatched(loss) if microbatched else worker.optax_step(loss)
  else:
    fx = optfuse.fuse(tx, mode, offload="params")
    initable = fx
    step = fx.value_and_update(loss, microbatches=MICROBATCHES if microbatched else None)
    placed = optfuse.params_to_host(fx, loss, params, *data[0])
  state = initable.init(params)
  opt_state = state.opt_state if mode == "forward" else state
  with jax.set_mesh(mesh), worker.rows_read_in_iteration(read):
    param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                                   worker.param_specs(params, layout))
    state_shardings = optax.tree_utils.tree_map_params(
        worker.TX, lambda _, sharding: sharding, opt_state, param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    if mode == "forward":
      state_shardings = optfuse.ForwardState(state_shardings, param_shardings,
                                             NamedSharding(mesh, P()))
    params = jax.device_put(placed, _host_like(param_shardings, placed))
    state = jax.device_put(state, _host_like(state_shardings, state))
    rows = NamedSharding(mesh, P("data"))
    data = [jax.device_put(batch, rows) for batch in data]
    jitted = jax.jit(step, donate_argnums=(0, 1))
    compiled = jitted.lower(params, state, *data[0]).compile()
    ins = jax.tree.leaves((params, state))
    outs = jax.tree.leaves(compiled.output_shardings[1:])
    moved = [f"leaf {i}: {a.sharding} -> {b}" for i, (a, b) in enumerate(zip(ins, outs))
             if not a.sharding.is_equivalent_to(b, a.ndim)]
    losses = []
    for t in range(steps):
      value, params, state = jax.block_until_ready(jitted(params, state, *data[t]))
      losses.append(value)
    kinds = jax.tree.map(lambda x: x.sharding.memory_kind, params)
    if mode != "optax":
      params, state = optfuse.to_optax_state(fx, params, state)
  report = {"resharded": moved, "all_gathers": worker.all_gathers(compiled.as_text()),
            "memory_kinds": kinds}
  arrays = {f"params/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(params))}
  arrays.update({f"state/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(state))})
  arrays["losses"] = np.stack([np.asarray(v) for v in losses])
  return report, arrays


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out", type=Path)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args(argv)
  if jax.device_count() != worker.DEVICES:
    raise SystemExit(f"needs {worker.DEVICES} devices, found {jax.devices()}: set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={worker.DEVICES}.")
  report, arrays = {}, {}
  for layout in LAYOUTS:
    for impl in IMPLS + ((FAULTED,) if layout == "fsdp" else ()):
      report[f"{layout}/{impl}"], out = run(layout, impl, args.steps)
      arrays.update({f"{layout}/{impl}/{k}": v for k, v in out.items()})
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "report.json").write_text(json.dumps(report, indent=1))
  np.savez(args.out / "results.npz", **arrays)


if __name__ == "__main__":
  main(sys.argv[1:])
