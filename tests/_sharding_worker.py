"""The multi-device runs behind ``test_sharding.py``, on eight simulated CPU devices.

Usage::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python tests/_sharding_worker.py OUT_DIR [--configs C,...] [--steps N] [--width W] \\
      [--faults C,...]

The device count is fixed when JAX initialises, so these runs live in their own process and the
flag never leaks into the test process. For every layout (data parallel, FSDP), model (unrolled
MLP, scanned MLP), mesh axis type (Auto, Explicit) and implementation (plain optax, each
optfuse mode, backward fusion with the optimizer state in host memory) the worker compiles one
jitted step, records its output shardings, the all-gathers in its compiled HLO and its
compiled memory per device, then trains ``N`` steps
(``jax.jit`` recompiles a step whose outputs come back resharded, as it would in user code). It
also trains backward fusion of each optimizer of ``tests/faults.py`` on the configurations
``--faults`` names. It writes ``OUT_DIR/report.json`` and the losses and final params and state to
``OUT_DIR/results.npz``. The models, batches and optimizer are defined here so the test can
train the same ones on one device.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import faults  # tests/faults.py: this script's directory is on sys.path
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._analysis._collectives import all_gathers
from optfuse._targets import _backends

DEVICES = 8
BATCH = 16
IN, OUT = 16, 8
DEPTH = 3
TX = optax.adamw(1e-2, weight_decay=1e-2)
LAYOUTS = ("data_parallel", "fsdp")
MODELS = ("mlp", "scan")
AXIS_TYPES = ("auto", "explicit")
IMPLS = ("optax", "backward", "forward", "backward_offload", "backward_offload_read")
# ``backward_offload_read``: backward fusion with the state in host memory, its rows read in the
# iteration that uses them rather than prefetched, as the TPU and GPU compilers' steps read them
# on several devices (``rows_read_in_iteration``); this CPU runs that choice here.
# Backward fusion of a wrong optimizer (``tests/faults.py``), for the configurations named by
# ``--faults``: the test shows the criterion that passes the fused steps rejecting each.
FAULTED = tuple(f"backward+{name}" for name in faults.faults(lambda path: True))


def stacked(path: str) -> bool:
  """The scanned model's stacked layers, by ``jax.tree_util.keystr`` path."""
  return path.startswith("['blocks']")


def init_params(model: str, width: int) -> dict:
  """Params of ``model``: ``DEPTH`` hidden layers of ``width`` units between IN and OUT."""
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 2 * DEPTH + 2))
  dense = lambda m, n: {"w": jax.random.normal(next(keys), (m, n)) / np.sqrt(m),
                        "b": jax.random.normal(next(keys), (n,)) * 0.1}
  if model == "mlp":
    dims = [IN] + [width] * DEPTH + [OUT]
    return {"layers": [dense(m, n) for m, n in zip(dims[:-1], dims[1:])]}
  blocks = [dense(width, width) for _ in range(DEPTH - 1)]
  return {"embed": dense(IN, width), "head": dense(width, OUT),
          "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """One fixed ``(x, y)`` batch per step."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(steps):
    x = rng.normal(size=(BATCH, IN)).astype(np.float32)
    out.append((x, np.sin(x[:, :OUT]).astype(np.float32)))
  return out


def loss_fn(params: dict, x: jax.Array, y: jax.Array, model: str,
            gather: Callable = lambda a: a) -> jax.Array:
  """Mean squared error of the MLP; ``gather`` replicates one layer's params before its use.

  With Explicit mesh axes, a sharded weight cannot meet a batch-sharded activation in a matmul
  without saying how: ``gather`` is ``reshard(a, P())`` there (FSDP's per-layer all-gather,
  inside the scan for the scanned model) and the identity otherwise.
  """
  layer = lambda p, h: jnp.tanh(h @ gather(p["w"]) + gather(p["b"]))
  if model == "mlp":
    h = x
    for p in params["layers"][:-1]:
      h = layer(p, h)
    last = params["layers"][-1]
  else:
    h = layer(params["embed"], x)
    h, _ = jax.lax.scan(lambda h, p: (h + layer(p, h), None), h, params["blocks"])
    last = params["head"]
  pred = h @ gather(last["w"]) + gather(last["b"])
  return jnp.mean((pred - y) ** 2)


def make_mesh(layout: str, axis_type: str) -> jax.sharding.Mesh:
  kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
  if layout == "data_parallel":
    return jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))
  return jax.make_mesh((4, DEVICES // 4), ("fsdp", "data"), axis_types=(kind, kind))


def param_specs(params: dict, layout: str) -> dict:
  """Replicated for data parallelism; FSDP shards every leaf's first per-layer axis."""
  if layout == "data_parallel":
    return jax.tree.map(lambda _: P(), params)

  def spec(path, leaf):
    stacked = any(getattr(k, "key", None) == "blocks" for k in path)
    return P(None, "fsdp") if stacked else P("fsdp")

  return jax.tree_util.tree_map_with_path(spec, params)


def optax_step(loss: Callable) -> Callable:
  def step(params, state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, state = TX.update(grads, state, params)
    return value, optax.apply_updates(params, updates), state

  return step


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device compiled memory; peak = arguments + temporaries + outputs - aliased outputs."""
  stats = compiled.memory_analysis()
  out = {"argument": stats.argument_size_in_bytes, "temp": stats.temp_size_in_bytes,
         "output": stats.output_size_in_bytes, "alias": stats.alias_size_in_bytes}
  out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
  return {k: int(v) for k, v in out.items()}


@contextlib.contextmanager
def rows_read_in_iteration(read: bool):
  """Steps traced inside read host-resident slot and param rows in the iteration that uses
  them, if ``read``, as the TPU compiler's steps do on several devices."""
  tables = (_backends.SHARDED_STREAMED_PREFETCH, _backends.SHARDED_STREAMED_PARAM_PREFETCH)
  prefetch = [table["cpu"] for table in tables]
  for table in tables:
    table["cpu"] = table["cpu"] and not read
  try:
    yield
  finally:
    for table, was in zip(tables, prefetch):
      table["cpu"] = was


def run(layout: str, model: str, axis_type: str, impl: str, steps: int, width: int):
  """Compiles and trains one configuration; returns ``(report, arrays)``."""
  mesh = make_mesh(layout, axis_type)
  gather = (lambda a: jax.sharding.reshard(a, P())) if axis_type == "explicit" else (lambda a: a)
  loss = functools.partial(loss_fn, model=model, gather=gather)
  offload = "state" if "_offload" in impl else None
  if impl == "optax":
    initable, step = TX, optax_step(loss)
  elif impl in FAULTED:
    fx = optfuse.fuse(faults.faults(stacked)[impl.removeprefix("backward+")](TX), "backward")
    initable, step = fx, fx.value_and_update(loss)
  else:
    fx = optfuse.fuse(TX, impl.split("_")[0], offload=offload)
    initable, step = fx, fx.value_and_update(loss)
  # Built on the default device and then placed: eager ops under the mesh would each compile.
  params = init_params(model, width)
  state = initable.init(params)
  with jax.set_mesh(mesh), rows_read_in_iteration(impl.endswith("_read")):
    param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, layout))
    # The optimizer state's copies of the params (Adam's mu, nu...) are sharded like them, the
    # rest (count) replicated: optax's idiom for sharding a state.
    state_shardings = optax.tree_utils.tree_map_params(
        initable, lambda _, sharding: sharding, state, param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    if offload:  # the slots in host memory, each sharded like its param
      state_shardings = jax.tree.map(
          lambda sh, x: sh.with_memory_kind("pinned_host") if x.sharding.memory_kind ==
          "pinned_host" else sh, state_shardings, state)
    params = jax.device_put(params, param_shardings)
    state = jax.device_put(state, state_shardings)
    rows = NamedSharding(mesh, P("data"))
    data = [jax.device_put(batch, rows) for batch in batches(max(steps, 1))]
    jitted = jax.jit(step, donate_argnums=(0, 1))
    compiled = jitted.lower(params, state, *data[0]).compile()
    ins = jax.tree.leaves((params, state))
    in_shardings = [a.sharding for a in ins]
    out_shardings = jax.tree.leaves(compiled.output_shardings[1:])
    moved = [f"leaf {i}: {a} -> {b}" for i, (x, a, b) in
             enumerate(zip(ins, in_shardings, out_shardings))
             if not a.is_equivalent_to(b, x.ndim)]
    report = {"resharded": moved, "all_gathers": all_gathers(compiled.as_text()),
              "memory": memory(compiled)}
    losses = []
    for t in range(steps):
      # One step in flight at a time: with many steps queued, the CPU client's threads can all
      # wait in one step's collective while the devices it needs are queued behind them
      # (a rendezvous timeout seen on a loaded two-core machine).
      value, params, state = jax.block_until_ready(jitted(params, state, *data[t]))
      losses.append(value)
    if impl != "optax":
      params, state = jax.jit(fx.flush)(params, state)
      if impl == "forward":
        state = state.opt_state  # after flush nothing is pending: the optax state
  arrays = {f"params/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(params))}
  arrays.update({f"state/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(state))})
  if losses:
    arrays["losses"] = np.stack([np.asarray(v) for v in losses])
  return report, arrays


ALL_CONFIGS = tuple(f"{layout}/{model}/{axis_type}" for layout in LAYOUTS for model in MODELS
                    for axis_type in AXIS_TYPES)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out", type=Path)
  parser.add_argument("--configs", default=",".join(ALL_CONFIGS),
                      help="comma-separated LAYOUT/MODEL/AXIS_TYPE, default: all of them")
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--faults", default="",
                      help="comma-separated configurations to train with each fault too")
  args = parser.parse_args(argv)
  if jax.device_count() != DEVICES:
    raise SystemExit(f"needs {DEVICES} devices, found {jax.devices()}: set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={DEVICES} before JAX starts.")
  report, arrays = {}, {}
  faulted = args.faults.split(",") if args.faults else []
  for config in args.configs.split(","):
    for impl in IMPLS + (FAULTED if config in faulted else ()):
      key = f"{config}/{impl}"
      print(key, file=sys.stderr, flush=True)
      try:
        report[key], out = run(*config.split("/"), impl, args.steps, args.width)
      except Exception as e:  # noqa: BLE001 - reported per configuration, checked by the tests
        report[key], out = {"error": f"{type(e).__name__}: {e}"}, {}
      arrays.update({f"{key}/{k}": v for k, v in out.items()})
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "report.json").write_text(json.dumps(report, indent=1))
  np.savez(args.out / "results.npz", **arrays)


if __name__ == "__main__":
  main(sys.argv[1:])
