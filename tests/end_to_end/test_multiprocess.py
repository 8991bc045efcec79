"""Multi-process training: two ``jax.distributed`` processes train like one.

The test starts two copies of ``_multiprocess_worker.py`` on localhost (a coordinator on a free
port, CPU devices, gloo collectives, two devices per process) that train a data-parallel MLP
with a fused step over one global four-device mesh, and compares what they learned with the same
steps run here in a single process on one device. Slow: one cluster run costs about 16 s of CPU
(two interpreters, a distributed handshake and a compile per mode).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import optfuse

sys.path.insert(0, str(Path(__file__).parents[1]))
import _multiprocess_worker as worker  # noqa: E402

from tests._subprocess import checkout_env  # noqa: E402

WORKER = Path(__file__).parents[1] / "_multiprocess_worker.py"
STEPS = 8
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


MODES = ("backward", "forward", "off")


def _run_cluster(out: Path, num_processes: int = 2, local_devices: int = 2) -> None:
  port = _free_port()
  env = checkout_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
  procs = [subprocess.Popen(
      [sys.executable, str(WORKER), str(pid), str(num_processes), str(port), str(local_devices),
       ",".join(MODES), str(STEPS), str(out)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for pid in range(num_processes)]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
  assert not failed, f"worker processes failed: {failed}\n" + "\n".join(logs)


@pytest.fixture(scope="module")
def cluster_results(tmp_path_factory) -> dict[str, np.ndarray]:
  """What two processes with two CPU devices each learned, for every mode (one cluster run)."""
  out = tmp_path_factory.mktemp("cluster") / "result.npz"
  _run_cluster(out)
  return dict(np.load(out))


def _single_process(mode: str) -> dict[str, np.ndarray]:
  fx = optfuse.fuse(worker.TX, mode)
  params = worker.init_params()
  state = fx.init(params)
  step = jax.jit(fx.value_and_update(worker.loss_fn))
  losses = []
  for t in range(STEPS):
    loss, params, state = step(params, state, *worker.global_batch(t))
    losses.append(loss)
  params, state = fx.flush(params, state)
  if mode == "forward":
    state = state.opt_state  # after flush nothing is pending: the optax state
  out = {f"{mode}/losses": np.stack(losses)}
  out.update({f"{mode}/params/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(params))})
  out.update({f"{mode}/state/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(state))})
  return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_two_processes_train_like_one_process(mode, cluster_results):
  got = {k: v for k, v in cluster_results.items() if k.startswith(f"{mode}/")}
  want = _single_process(mode)
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    # float32; the cluster sums the batch gradient over four devices in another order than one
    # device does: a few ulps per step, carried by adamw over the steps.
    np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=2e-6, err_msg=key)
