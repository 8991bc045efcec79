"""GaLore and Adafactor on stacked leaves: which layers' updates run in the backward loop.

Both optimizers see a leaf as a matrix: GaLore projects it onto a low-rank subspace (an SVD,
refreshed every ``update_proj_gap`` steps), Adafactor factors its second moment over the two
largest axes. On a scanned model (``models.scanned_loss``: ``w`` (L, d, d), ``b`` (L, d)) a
stacked leaf is updated row by row inside the backward loop only where its update keeps the
layers apart and its state is stacked like it; ``describe`` says why where not. Either way the
fused step trains like optax's. Muon, whose dimension numbers can keep the layer axis a batch
axis, has its own file (``test_muon.py``).
"""

import chex
import optax
import pytest
from optax.contrib import GaLoreDimensionNumbers as GaLoreDims

import optfuse
from tests import criteria, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

# Eight layers: GaLore's per-leaf state makes a four-layer loop too short to pay (the planner's
# threshold, ``RowChecks.min_rows``), which would hide the reasons this file checks.
LAYERS, DIM = 8, 16
LR = 1e-2
W, B = "['layers']['w']", "['layers']['b']"
NOT_STACKED = "its optimizer state is not stacked like the param"
MIXES_ROWS = "its update mixes rows"


def _galore(dims=None) -> optax.GradientTransformation:
  # A projector refreshed every 5 steps, so 20 steps run four SVDs.
  return optax.contrib.galore(LR, rank=4, update_proj_gap=5, weight_dimension_numbers=dims)


def _galore_dims(w, b):
  return lambda params: {"embed": GaLoreDims(0, 1), "head": GaLoreDims(0, 1),
                         "layers": {"w": w, "b": b}}


# id -> (tx, where w and b are updated, a reason each leaf after the loop is given)
CASES = {
    # clip_by_block_rms and scale_by_param_block_rms: an RMS over the whole leaf, layers included.
    "adafactor": (lambda: optax.adafactor(LR), ("tap", "tap"), (MIXES_ROWS, MIXES_ROWS)),
    "adafactor_unfactored": (lambda: optax.adafactor(LR, factored=False), ("tap", "tap"),
                             (MIXES_ROWS, MIXES_ROWS)),
    # Neither block RMS: the second moment of a leaf with no two axes of 128 is elementwise.
    "adafactor_without_block_rms": (
        lambda: optax.adafactor(LR, clipping_threshold=None, multiply_by_parameter_scale=False),
        ("loop", "loop"), (None, None)),
    # w's two largest axes (16, 16) factored (b's 8 layers are too few): per layer, but its
    # moments (L, d) are not stacked like the (L, d, d) param.
    "adafactor_factored_per_layer": (
        lambda: optax.adafactor(LR, min_dim_size_to_factor=16, clipping_threshold=None,
                                multiply_by_parameter_scale=False),
        ("tap", "loop"), (NOT_STACKED, None)),
    # GaLore's default projects the rank-2 leaves: b (L, d), the layer axis a matrix axis.
    "galore": (lambda: _galore(), ("loop", "tap"), (None, NOT_STACKED)),
    # The layer axis merged into w's reduction axis: one SVD across the layers.
    "galore_across_layers": (lambda: _galore(_galore_dims(GaLoreDims((0, 1), 2), None)),
                             ("tap", "loop"), (NOT_STACKED, None)),
    # The stacked leaves on the base optimizer (Adam), only embed and head projected.
    "galore_stacked_on_adam": (lambda: _galore(_galore_dims(None, None)), ("loop", "loop"),
                               (None, None)),
}


def _params():
  return models.stacked_params(LAYERS, DIM)


@pytest.mark.parametrize("case", CASES)
def test_describe_says_where_each_stacked_leaf_is_updated_and_why(case):
  tx, places, reasons = CASES[case]
  where = optfuse.describe(tx(), models.scanned_loss, _params(), *models.tied_lm_batches(1)[0])
  assert (where[W], where[B]) == places, where.table()
  for leaf, reason in zip((W, B), reasons, strict=True):
    if reason is None:
      assert leaf not in where.reasons, where.reasons
    else:
      assert reason in where.reasons[leaf], where.reasons


@pytest.mark.parametrize("case", CASES)
def test_backward_fused_per_matrix_optimizer_trains_like_optax_over_20_steps(case):
  tx, batches = CASES[case][0], models.tied_lm_batches(3)
  got = models.run_fused(tx(), "backward", _params(), batches, 20, models.scanned_loss)
  want = models.run_optax(tx(), _params(), batches, 20, models.scanned_loss)
  chex.assert_trees_all_close(got[:2], want[:2], **criteria.F32)


def test_galore_cannot_leave_the_layer_axis_a_batch_axis():
  """optax 0.2.8's GaLore reshapes every leaf to one matrix: each axis is a reduction or an
  output axis, so a stacked leaf is projected across its layers or not at all."""
  tx = _galore(_galore_dims(GaLoreDims(1, 2), None))
  with pytest.raises(ValueError, match="All axes must be specified"):
    tx.init(_params())
