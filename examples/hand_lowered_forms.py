"""A step lowered by hand for a TPU from this machine, against ``memory_report(target=...)``.

For each scanned-decoder form of ``optfuse.bench._forms`` (how MaxText, Levanter and others
write a layer stack) and the plain scanned decoder, the optax step and the backward-fused step
are compiled for the target twice: by ``optfuse.memory_report(target=...)``, and by hand, as
MaxText's ``train_compile.py`` does: ``jax.jit(step).lower(...)`` on ``jax.ShapeDtypeStruct``
inputs placed on the target's compile-only devices (``optfuse.target_mesh``). The fused step
reads the platform of its inputs' devices while it is traced, so both compile the same program.
The table gives each way's share of the stacked gradient that backward fusion saves
(optax's peak minus backward's, over the stacked gradient's bytes).

Usage::

  python examples/hand_lowered_forms.py                  # 16 layers of d=512, TPU v5e
  python examples/hand_lowered_forms.py --size tiny
"""

from __future__ import annotations

import argparse

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse.bench import _forms, _models
from optfuse.bench._models import DecoderConfig

SIZES = {
    # The size the planning issue measured the forms at.
    "issue": DecoderConfig(layers=16, dim=512, heads=8, ff=2048, vocab=4096, seq=256, batch=2),
    "tiny": DecoderConfig(layers=4, dim=64, heads=2, ff=128, vocab=64, seq=8, batch=1),
}
FORMS = {**_forms.FORMS,
         "decoder": lambda c: _models.decoder(c, scanned=True, remat=True, name="decoder")}
MODES = ("off", "backward")


def _placed(tree, mesh):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=NamedSharding(mesh, P())), tree)


def hand_lowered_peak(fx, model, mesh) -> int:
  """The peak of ``model``'s step with ``fx``, lowered by hand on ``mesh``'s devices."""
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  state = jax.eval_shape(fx.init, params)
  step = jax.jit(fx.value_and_update(model.loss), donate_argnums=(0, 1))
  lowered = step.lower(_placed(params, mesh), _placed(state, mesh), *_placed(batch, mesh))
  stats = lowered.compile().memory_analysis()
  # memory_report's peak: what the step's buffers hold at once, inputs and outputs included.
  return (stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes)


def peaks(form: str, config: DecoderConfig, target: str = "tpu-v5e") -> dict[str, dict]:
  """``{"report": {mode: peak}, "by_hand": {mode: peak}, "stacked": bytes}`` for one form."""
  tx = optax.adamw(1e-3)
  model = FORMS[form](config)
  params = _models.abstract(model.params)
  report = optfuse.memory_report(model.loss, tx, params, *_models.abstract(model.batch),
                                 target=target)
  mesh = optfuse.target_mesh(target, ("data",))
  return {"report": {m: report[m]["peak_bytes"] for m in MODES},
          "by_hand": {m: hand_lowered_peak(optfuse.fuse(tx, mode=m), model, mesh) for m in MODES},
          "stacked": _models.grad_bytes(params["layers"])}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="issue")
  parser.add_argument("--target", default="tpu-v5e")
  args = parser.parse_args()
  config = SIZES[args.size]
  print(f"{config.layers} layers of d={config.dim}, ff {config.ff}, vocab {config.vocab}, "
        f"T={config.seq}, batch {config.batch}, AdamW, {args.target}, compile-only\n")
  print("| form | optax peak | backward peak, `memory_report` | backward peak, by hand "
        "| share of the stacked gradient saved: `memory_report` | by hand | same peaks |")
  print("|---|---:|---:|---:|---:|---:|---|")
  fmt = lambda b: f"{b / 1e6:.1f} MB"
  for form in FORMS:
    got = peaks(form, config, args.target)
    saved = {way: (got[way]["off"] - got[way]["backward"]) / got["stacked"]
             for way in ("report", "by_hand")}
    print(f"| {form} | {fmt(got['report']['off'])} | {fmt(got['report']['backward'])} "
          f"| {fmt(got['by_hand']['backward'])} | {saved['report']:.0%} "
          f"| {saved['by_hand']:.0%} | {'yes' if got['report'] == got['by_hand'] else 'no'} |",
          flush=True)


if __name__ == "__main__":
  main()
