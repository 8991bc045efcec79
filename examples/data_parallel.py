"""Data-parallel and FSDP training with optfuse on every device of the machine.

optfuse needs nothing special to scale out: the fused step is an ordinary function of arrays, so
``jax.jit`` partitions it over a ``Mesh`` like any other step, from the shardings of its
arguments. This script trains an MLP on scikit-learn's digits with the batch sharded over all
devices, params and optimizer state either replicated (``--layout data_parallel``) or sharded
along the same axis (``--layout fsdp``), once with plain optax and once fused, and prints how far
apart they end up and where the optimizer state lives.

Without accelerators the script asks XLA for eight simulated CPU devices (the flag must be set
before JAX starts, hence the lines above ``import jax``); on GPU or TPU it uses the real ones.

Usage::

  python examples/data_parallel.py --steps 200 --layout fsdp --mode backward
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Only the host (CPU) platform reads this flag: harmless where accelerators exist.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import optfuse  # noqa: E402

HIDDEN = 128


def init_params(key: jax.Array) -> dict:
  k1, k2 = jax.random.split(key)
  return {"hidden": {"w": jax.random.normal(k1, (64, HIDDEN)) / 8, "b": jnp.zeros((HIDDEN,))},
          "out": {"w": jax.random.normal(k2, (HIDDEN, 10)) / np.sqrt(HIDDEN),
                  "b": jnp.zeros((10,))}}


def loss_fn(params: dict, images: jax.Array, labels: jax.Array) -> jax.Array:
  # The mesh axes are Explicit (jax.make_mesh's default): FSDP says where each layer's params
  # are gathered; replicated params (data parallel) are left as they are.
  params = jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)
  h = jax.nn.relu(images @ params["hidden"]["w"] + params["hidden"]["b"])
  logits = h @ params["out"]["w"] + params["out"]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def param_sharding(mesh: jax.sharding.Mesh, layout: str, leaf: jax.Array) -> NamedSharding:
  """FSDP shards a leaf's first axis over the devices when it divides evenly, else replicates."""
  if layout == "fsdp" and leaf.ndim and leaf.shape[0] % mesh.size == 0:
    return NamedSharding(mesh, P("data"))
  return NamedSharding(mesh, P())


def train(tx: optax.GradientTransformation, mode: str | None, layout: str, steps: int,
          batch_size: int) -> tuple[np.ndarray, dict, dict]:
  """Trains ``steps`` steps with plain optax (``mode=None``) or ``optfuse.fuse(tx, mode)``.

  Returns:
    ``(losses, params, state)``, the state as optax's (flushed in forward mode).
  """
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)

  if mode is None:
    def step(params, state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, state = tx.update(grads, state, params)
      return loss, optax.apply_updates(params, updates), state
    initable = tx
  else:
    fx = optfuse.fuse(tx, mode)
    step, initable = fx.value_and_update(loss_fn), fx

  params = init_params(jax.random.key(0))
  state = initable.init(params)
  shardings = jax.tree.map(lambda p: param_sharding(mesh, layout, p), params)
  # The optimizer state's copies of the params (Adam's mu and nu) follow the params' shardings.
  state_shardings = optax.tree_utils.tree_map_params(
      initable, lambda _, s: s, state, shardings,
      transform_non_params=lambda _: NamedSharding(mesh, P()))
  rows = NamedSharding(mesh, P("data"))  # every device gets batch_size / devices rows
  step = jax.jit(step, donate_argnums=(0, 1))
  rng = np.random.default_rng(0)
  losses = []
  on_cpu = jax.default_backend() == "cpu"
  with jax.set_mesh(mesh):
    params = jax.device_put(params, shardings)
    state = jax.device_put(state, state_shardings)
    for _ in range(steps):
      idx = rng.choice(len(images), batch_size, replace=False)
      x, y = jax.device_put((images[idx], labels[idx]), rows)
      loss, params, state = step(params, state, x, y)
      if on_cpu:
        # The simulated CPU devices share one thread pool: with several steps queued, XLA:CPU can
        # deadlock in a collective on a machine with few cores. One step in flight avoids it.
        jax.block_until_ready(loss)
      losses.append(loss)
    if mode is not None:
      params, state = jax.jit(fx.flush)(params, state)
      state = state.opt_state if mode == "forward" else state
  return np.asarray(jnp.stack(losses)), params, state


def run(steps: int = 200, layout: str = "data_parallel", mode: str = "backward",
        batch_size: int = 64) -> dict:
  """Trains optax and optfuse side by side; returns losses, differences and shardings."""
  tx = optax.adamw(3e-3, weight_decay=1e-4)
  optax_losses, optax_params, _ = train(tx, None, layout, steps, batch_size)
  fused_losses, fused_params, fused_state = train(tx, mode, layout, steps, batch_size)
  diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), optax_params, fused_params)
  mu = fused_state[0].mu["hidden"]["w"]  # adamw's state is (ScaleByAdamState, ...)
  return {"devices": jax.device_count(), "optax_losses": optax_losses,
          "fused_losses": fused_losses, "max_param_diff": max(jax.tree.leaves(diffs)),
          "mu_sharding": mu.sharding, "mu_shard_shape": mu.addressable_shards[0].data.shape}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--layout", choices=("data_parallel", "fsdp"), default="data_parallel")
  parser.add_argument("--mode", choices=("backward", "forward", "off"), default="backward")
  parser.add_argument("--batch-size", type=int, default=64)
  args = parser.parse_args()
  out = run(args.steps, args.layout, args.mode, args.batch_size)
  print(f"{out['devices']} devices ({jax.devices()[0].platform}), layout {args.layout}, "
        f"mode {args.mode}")
  print(f"final loss: optax {out['optax_losses'][-1]:.4f}, optfuse {out['fused_losses'][-1]:.4f}")
  print(f"max |param difference| after {args.steps} steps: {out['max_param_diff']:.2e}")
  print(f"adam mu of hidden.w: {out['mu_sharding'].spec}, "
        f"{out['mu_shard_shape']} per device")


if __name__ == "__main__":
  main()
