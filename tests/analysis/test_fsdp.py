"""FSDP's layout (``optfuse._analysis._fsdp``): which axis each leaf is sharded along, and the
gradient bytes one device holds, in all and at once in a fused step."""

from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._analysis._fsdp import grad_share_bytes, live_grad_share_bytes, param_specs
from optfuse.bench import _models
from optfuse.bench._fit_table import TINY_DECODER


def test_fsdp_never_shards_the_layer_axis_and_replicates_what_does_not_divide():
  assert optfuse.fsdp_axis((16, 1024, 4096), 8, stacked=True) == 2
  assert optfuse.fsdp_axis((64, 8, 3), 8, stacked=True) == 1
  assert optfuse.fsdp_axis((64, 3), 8, stacked=True) is None
  assert optfuse.fsdp_axis((32000, 1024), 8, stacked=False) == 0
  assert optfuse.fsdp_axis((3,), 8, stacked=False) is None


def test_a_device_holds_an_eighth_of_each_sharded_gradient_and_one_layer_of_it_at_once():
  model = _models.decoder(TINY_DECODER._replace(dim=64, ff=128, vocab=256), scanned=True,
                          remat=True)
  specs = param_specs(model.params, 8)
  # Stacked leaves keep their layer axis whole; the rest shard along their largest axis.
  assert specs["layers"]["up"] == P(None, None, "fsdp") and specs["embed"] == P("fsdp")
  assert specs["norm"] == P("fsdp")
  share = grad_share_bytes(model.params, specs, 8)
  assert share == _models.grad_bytes(model.params) // 8  # every leaf here divides by 8
  layers = TINY_DECODER.layers
  stacks = _models.grad_bytes(model.params["layers"]) // 8
  assert live_grad_share_bytes(model.params, specs, 8) == share - stacks + stacks // layers
