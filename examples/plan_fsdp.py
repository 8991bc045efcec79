"""Plan an FSDP run on a TPU slice from this machine: per-device memory of every mode.

The params are ``jax.ShapeDtypeStruct`` values sharded FSDP-style on the slice's compile-only
devices (``optfuse.target_mesh``): each leaf along its largest axis the devices divide, never a
stacked layer axis. ``optfuse.memory_report`` then compiles the step of each mode for that mesh,
with the optimizer state laid out as ``tx.init`` lays it out from those params (sharded like
them), without offload, with ``offload="state"`` and with ``offload="params"`` (each device's
shards in its host memory, streamed a layer at a time), and says how much of the streamed bytes
leave backward fusion's peak. To check that this is the step you would run, the
script also lowers the plain optax step by hand, with the state sharded like its params
(``optax.tree_utils.tree_map_params``, as MaxText-style code does) and, for comparison, with the
state replicated.

Usage::

  python examples/plan_fsdp.py                      # 1.3B decoder, tpu-v5e:2x2, batch 4
  python examples/plan_fsdp.py --batch 28           # 7 sequences a chip
  python examples/plan_fsdp.py --size tiny --target tpu-v5e:2x2
  python examples/plan_fsdp.py --size 16x1024 --target h100:1x1x4   # four H100s
  python examples/plan_fsdp.py --size 24x2048-mlp --batch 16        # no attention, 4 a chip
"""

from __future__ import annotations

import argparse

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._analysis import _memory
from optfuse._targets import _compiled
from optfuse.bench import _models
from optfuse.bench._models import DecoderConfig

SIZES = {
    "tiny": DecoderConfig(layers=4, dim=256, heads=4, ff=1024, vocab=1024, seq=128, batch=4),
    "16x512": DecoderConfig(layers=16, dim=512, heads=8, ff=2048, vocab=2048, seq=32, batch=4),
    "16x1024": DecoderConfig(layers=16, dim=1024, heads=8, ff=4096, vocab=4096, seq=64, batch=4),
    "1.3b": DecoderConfig(layers=24, dim=2048, heads=16, ff=8192, vocab=32000, seq=2048, batch=4),
    # Without attention (a d x d projection in its place): the 1.3B decoder's MLP layers, and a
    # quarter of its width, ff, vocab and T (each param and activation a sixteenth; the test's).
    "24x2048-mlp": DecoderConfig(layers=24, dim=2048, heads=16, ff=8192, vocab=32000, seq=2048,
                                 batch=4, attention=False),
    "24x512-mlp": DecoderConfig(layers=24, dim=512, heads=8, ff=2048, vocab=8000, seq=512,
                                batch=4, attention=False),
}


def fsdp_inputs(model: _models.Model, mesh: jax.sharding.Mesh) -> tuple:
  """``model``'s params sharded FSDP-style over ``mesh``'s one axis, its batch split over it."""
  axis = mesh.axis_names[0]

  def place(path, x):
    spec = [None] * len(x.shape)
    at = optfuse.fsdp_axis(x.shape, mesh.size, stacked="layers" in jax.tree_util.keystr(path))
    if at is not None:
      spec[at] = axis
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(*spec)))

  params = jax.tree_util.tree_map_with_path(place, _models.abstract(model.params))
  batch = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=NamedSharding(mesh, P(axis)))
                for b in _models.abstract(model.batch))
  return params, batch


def hand_lowered_optax_peak(loss, tx, params, batch, mesh, state_like_params: bool) -> int:
  """The per-device peak of the plain optax step, lowered by hand for ``mesh``."""
  def step(params, state, *batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  struct = lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
  replicated = NamedSharding(mesh, P())
  abstract = jax.eval_shape(tx.init, params)
  if state_like_params:
    state = optax.tree_utils.tree_map_params(
        tx, lambda s, p: struct(s, p.sharding), abstract, params,
        transform_non_params=lambda s: struct(s, replicated))
  else:
    state = jax.tree.map(lambda s: struct(s, replicated), abstract)
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *batch)
  return _memory.compile_memory(lowered)["peak_bytes"]


def streamed_share(kept: dict, streamed: dict) -> str:
  """How far streaming lowers backward fusion's peak per device, against what it streams."""
  saved, host = kept["peak_bytes"] - streamed["peak_bytes"], streamed["host_bytes"]
  return (f"backward fusion's peak falls by {_compiled.format_bytes(saved)} per device, "
          f"{saved / host:.0%} of the {_compiled.format_bytes(host)} each device streams")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="1.3b")
  parser.add_argument("--target", default="tpu-v5e:2x2",
                      help="a slice of optfuse.targets(): 'tpu-v5e:2x2', 'h100:1x1x4'...")
  parser.add_argument("--batch", type=int, help="the global batch (default: the size's, 4)")
  args = parser.parse_args(argv)
  config = SIZES[args.size]._replace(batch=args.batch or SIZES[args.size].batch)
  model = _models.decoder(config, scanned=True, remat=True)
  mesh = optfuse.target_mesh(args.target, ("fsdp",))
  params, batch = fsdp_inputs(model, mesh)
  tx = optax.adamw(1e-3)
  print(f"{_models.param_count(model.params)} params, {config.layers} layers of d={config.dim}, "
        f"T={config.seq}, batch {config.batch}, AdamW, FSDP over {mesh.size} chips of "
        f"{args.target}")
  kept = optfuse.memory_report(model.loss, tx, params, *batch, target=mesh)
  print(kept)
  for offload in ("state", "params"):
    print(f"with offload={offload!r}:")
    report = optfuse.memory_report(model.loss, tx, params, *batch, target=mesh, offload=offload)
    print(report)
    print(streamed_share(kept["backward"], report["backward"]))
  for like_params, label in ((True, "sharded like its params"), (False, "replicated")):
    peak = hand_lowered_optax_peak(model.loss, tx, params, batch, mesh, like_params)
    print(f"optax step lowered by hand, state {label}: {_compiled.format_bytes(peak)} per device")


if __name__ == "__main__":
  main()
