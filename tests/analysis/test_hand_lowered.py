"""A step lowered by hand for a target takes that target's compiler choices.

MaxText's ``train_compile.py`` and axlearn's AOT checks plan a run by lowering the step from a CPU
on ``jax.ShapeDtypeStruct`` values sharded over a topology's devices. A fused step reads the
platform of its inputs' devices while it is traced, so ``jax.jit(step).lower(...)`` there
compiles the program ``memory_report(target=...)`` compiles, not this machine's choices.
"""


import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._analysis import _memory
from optfuse._targets import _backends, _compiled, _registry
from optfuse.bench import _forms, _models
from optfuse.bench._models import DecoderConfig
from tests import models

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')
# The smallest size found at which the TPU and the CPU choices compile to different peaks
# (604 MB and 508 MB for moveaxis), so that the check can tell which choices were taken.
SIZE = DecoderConfig(layers=12, dim=512, heads=8, ff=2048, vocab=1024, seq=128, batch=2)


def _placed(tree, mesh):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=NamedSharding(mesh, P())), tree)


def _example():
  """``examples/hand_lowered_forms.py``: each form's peaks by memory_report and by hand."""
  return models.load_example("hand_lowered_forms")


def test_inputs_placed_on_a_platform_give_its_choices_while_traced():
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("devices",))
  seen = []

  def f(x):
    with _backends.traced_on(x):
      seen.append(_backends.platform())
    return x

  jax.jit(f).trace(_placed(jax.ShapeDtypeStruct((2,), jnp.float32), mesh))
  assert seen == [jax.default_backend()] and _backends.platform() == jax.default_backend()


@needs_tpu
@pytest.mark.targets
def test_a_step_lowered_by_hand_for_tpu_v5e_compiles_what_memory_report_compiles(monkeypatch):
  target = _registry.resolve("tpu-v5e")
  model = _forms.FORMS["moveaxis"](SIZE)
  fx = optfuse.fuse(optax.adamw(1e-3))
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  report = _compiled.compiled_memory(
      _memory.lower_step(fx, model.loss, params, batch, target=target).compile())["peak_bytes"]
  assert _example().hand_lowered_peak(fx, model, target.mesh) == report
  # Without the platform read from the inputs, the same lowering takes this machine's choices.
  monkeypatch.setattr(_backends, "inputs_placement", lambda tree: _backends.Placement(None, None))
  assert _example().hand_lowered_peak(fx, model, target.mesh) != report


@pytest.mark.slow
@needs_tpu
@pytest.mark.targets
@pytest.mark.parametrize("form", ["linen_axis1", "bf16_policy", "outer_remat", "decoder"])
def test_every_form_lowered_by_hand_compiles_what_memory_report_compiles(form):
  got = _example().peaks(form, SIZE)
  assert got["by_hand"] == got["report"], got


@needs_tpu
@pytest.mark.targets
def test_compiling_for_a_target_gives_its_choices_and_the_guard_its_devices():
  with optfuse.compiling_for("tpu-v5e") as target:
    assert _backends.platform() == "tpu" and _backends.target() is target
  assert _backends.platform() == jax.default_backend()


@needs_tpu
@pytest.mark.targets
def test_the_guard_of_a_step_lowered_by_hand_for_another_platform_asks_for_its_target():
  target = _registry.resolve("tpu-v5e")
  model = _forms.FORMS["outer_remat"](SIZE._replace(layers=4, dim=64, ff=128, vocab=64, seq=8))
  fx = optfuse.fuse(optax.adamw(1e-3), guard=True)
  with pytest.raises(optfuse.GuardError, match=r"lowered for tpu devices.*compiling_for"):
    _example().hand_lowered_peak(fx, model, target.mesh)


@needs_tpu
@pytest.mark.targets
def test_target_mesh_lays_a_targets_devices_out_over_named_axes():
  mesh = optfuse.target_mesh("tpu-v5e:2x2", ("data", "fsdp"), (1, 4))
  assert mesh.shape == {"data": 1, "fsdp": 4}
  assert {d.platform for d in mesh.devices.flat} == {"tpu"}
  with pytest.raises(optfuse.TargetError, match="does not hold the 4 devices"):
    optfuse.target_mesh("tpu-v5e:2x2", ("data", "fsdp"), (2, 3))
