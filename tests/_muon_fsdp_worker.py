"""Backward-fused Muon on an FSDP mesh of eight simulated CPU devices, behind ``test_muon.py``.

Usage::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_muon_fsdp_worker.py

The device count is fixed when JAX initialises, so this run lives in its own process. Every leaf
of ``test_muon``'s decoder is sharded along its first per-layer axis of size 16 or 32 (the
model dimension, or ff) over an ``Auto`` mesh axis, as FSDP shards weights; the step is jitted
with the mesh set. It checks that ``describe`` puts
every stacked Muon matrix in its loop and that 20 backward-fused steps equal 20 unfused ones on
the same mesh (``criteria.F32``), and exits with an error otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import chex
import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optfuse  # noqa: E402
from tests import criteria, models  # noqa: E402
from tests.engines import test_muon as m  # noqa: E402

DEVICES = 8


def fsdp_spec(path, leaf) -> P:
  """The first axis divisible by the device count, the layer axis (0) of a stack excepted."""
  first = 1 if any(getattr(k, "key", None) == "layers" for k in path) else 0
  axis = next(a for a in range(first, leaf.ndim) if leaf.shape[a] % DEVICES == 0)
  return P(*[None] * axis, "fsdp")


def main() -> None:
  assert jax.device_count() == DEVICES, "run with --xla_force_host_platform_device_count=8"
  mesh = jax.make_mesh((DEVICES,), ("fsdp",), axis_types=(AxisType.Auto,))
  params = m.decoder_params()
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(path, x))), params)
  with jax.set_mesh(mesh):
    where = optfuse.describe(m._muon(), m.decoder_loss, params, *m._batches()[0])
    assert all(where[k] == "loop" for k in m.MATRICES), where.table()
    runs = []
    for mode in ("backward", "off"):
      fx = optfuse.fuse(m._muon(), mode=mode)
      step = fx.value_and_update(m.decoder_loss)
      runs.append(models.run_steps(step, params, fx.init(params), m._batches(), 20))
  chex.assert_trees_all_close(runs[0][:2], runs[1][:2], **criteria.F32)
  print("ok")


if __name__ == "__main__":
  main()
