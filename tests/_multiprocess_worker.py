"""One process of the two-process training run of ``test_multiprocess.py``.

Usage::

  python tests/_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES MODES STEPS OUT

Joins a ``jax.distributed`` cluster whose coordinator listens on ``127.0.0.1:PORT`` (CPU devices,
gloo collectives), builds one global data-parallel mesh over every process's devices (params and
optimizer state replicated, the batch sharded), and for each of the comma-separated ``MODES``
trains ``STEPS`` steps of ``optfuse.fuse(TX, mode)``. Process 0 writes the losses and the final
params and state of each mode to the ``.npz`` file ``OUT`` (keys ``MODE/losses``,
``MODE/params/i``, ``MODE/state/i``). Nothing here depends on pytest: the test runs this file
as a script.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse

BATCH = 16
IN, HIDDEN, OUT = 8, 16, 4
TX = optax.adamw(1e-2, weight_decay=1e-2)


def init_params() -> dict:
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN), "b1": jnp.zeros((HIDDEN,)),
          "w2": jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN), "b2": jnp.zeros((OUT,))}


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
  """The whole batch of ``step``, the same in every process (each keeps its own rows)."""
  rng = np.random.default_rng(step)
  x = rng.normal(size=(BATCH, IN)).astype(np.float32)
  return x, np.tanh(x[:, :OUT] * 2.0).astype(np.float32)


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def train(mode: str, mesh: jax.sharding.Mesh, steps: int) -> dict[str, np.ndarray]:
  """``steps`` fused steps over ``mesh``; this process's copy of the results, flat."""
  replicated = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, P("data"))
  fx = optfuse.fuse(TX, mode)
  params = jax.device_put(init_params(), replicated)
  state = jax.device_put(fx.init(init_params()), replicated)
  step = jax.jit(fx.value_and_update(loss_fn), donate_argnums=(0, 1))
  losses = []
  for t in range(steps):
    x, y = global_batch(t)
    # Every process holds the whole batch; each device takes its rows of the global array.
    x, y = (jax.make_array_from_callback(a.shape, rows, lambda idx, a=a: a[idx]) for a in (x, y))
    loss, params, state = jax.block_until_ready(step(params, state, x, y))
    losses.append(loss)
  params, state = fx.flush(params, state)
  if mode == "forward":
    state = state.opt_state  # after flush nothing is pending: the optax state
  local = lambda a: np.asarray(a.addressable_data(0))
  out = {f"{mode}/losses": np.stack([local(loss) for loss in losses])}
  out.update({f"{mode}/params/{i}": local(a) for i, a in enumerate(jax.tree.leaves(params))})
  out.update({f"{mode}/state/{i}": local(a) for i, a in enumerate(jax.tree.leaves(state))})
  return out


def main(process_id: int, num_processes: int, port: int, local_devices: int, modes: str,
         steps: int, out: str) -> None:
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", local_devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                             initialization_timeout=60)
  assert jax.device_count() == num_processes * local_devices, jax.devices()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  results = {}
  for mode in modes.split(","):
    results.update(train(mode, mesh, steps))
  if process_id == 0:
    np.savez(out, **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  pid, nproc, port, ndev, modes, steps, out = sys.argv[1:]
  main(int(pid), int(nproc), int(port), int(ndev), modes, int(steps), out)
