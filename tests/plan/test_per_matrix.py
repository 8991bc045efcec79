"""GaLore, Adafactor and a Kronecker factor on stacked leaves: which layers' updates run in the
backward loop.

These optimizers see a leaf as a matrix: GaLore projects it onto a low-rank subspace (an SVD,
refreshed every ``update_proj_gap`` steps), Adafactor factors its second moment over the two
largest axes, the Kronecker test optimizer (``kronecker``) keeps a (d, d) factor per matrix.
On a scanned model (``models.scanned_loss``: ``w`` (L, d, d), ``b`` (L, d)) a stacked leaf is
updated row by row inside the backward loop where its update keeps the layers apart and each
of its state slots is stacked along the layer axis, whatever its other axes (Adafactor's (L, d)
moments, the (L, d, d) factor); ``describe`` says why where not. Either way the fused step
trains like optax's. Muon, whose dimension numbers can keep the layer axis a batch axis, has
its own file (``test_muon.py``).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from optax.contrib import GaLoreDimensionNumbers as GaLoreDims

import optfuse
from tests import criteria, faults, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

# Eight layers: GaLore's per-leaf state makes a four-layer loop too short to pay (the planner's
# threshold, ``RowChecks.min_rows``), which would hide the reasons this file checks.
LAYERS, DIM = 8, 16
LR = 1e-2
W, B = "['layers']['w']", "['layers']['b']"
NOT_STACKED = "its optimizer state is not stacked along the layer axis"
MIXES_ROWS = "its update mixes rows"


def _galore(dims=None) -> optax.GradientTransformation:
  # A projector refreshed every 5 steps, so 20 steps run four SVDs.
  return optax.contrib.galore(LR, rank=4, update_proj_gap=5, weight_dimension_numbers=dims)


class KroneckerState(NamedTuple):
  factor: dict


def kronecker(lr: float = LR, beta: float = 0.9, eps: float = 1e-8
              ) -> optax.GradientTransformation:
  """A test optimizer with Kronecker-factor-like state: for a rank-3 leaf (L, d, f), a factor
  ``F_l = beta F_l + G_l G_l^T`` per layer (L, d, d) and the update ``-lr G_l / sqrt(tr F_l /
  d + eps)``; for a rank-2 leaf (L, d), ``F = beta F + G G^T`` (L, L), across the layers; SGD
  for the others."""

  def init(params):
    def factor(p):
      return jnp.zeros(p.shape[:-1] + p.shape[-2:-1]) if p.ndim in (2, 3) else jnp.zeros(())

    return KroneckerState(jax.tree.map(factor, params))

  def update(grads, state, params=None):
    del params

    def one(g, f):
      if g.ndim not in (2, 3):
        return -lr * g, f
      f = beta * f + jnp.einsum("...ij,...kj->...ik", g, g)
      scale = jnp.einsum("...ii->...", f)[..., None, None] / f.shape[-1]
      return -lr * g / jnp.sqrt(scale + eps) if g.ndim == 3 else -lr * g, f

    out = jax.tree.map(one, grads, state.factor)
    pick = lambda k: jax.tree.map(lambda o: o[k], out, is_leaf=lambda o: isinstance(o, tuple))
    return pick(0), KroneckerState(pick(1))

  return optax.GradientTransformation(init, update)


def _adafactor_factoring(min_dim_size_to_factor: int = 16) -> optax.GradientTransformation:
  """Adafactor's factored second moment alone: neither block RMS (each over a whole leaf)."""
  return optax.adafactor(LR, min_dim_size_to_factor=min_dim_size_to_factor,
                         clipping_threshold=None, multiply_by_parameter_scale=False)


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
    # w's two largest axes (16, 16) factored (b's 8 layers are too few): its moments v_row and
    # v_col, (L, d) each, are per layer, each row the means of one layer's squared gradient.
    "adafactor_factored_per_layer": (lambda: _adafactor_factoring(16), ("loop", "loop"),
                                     (None, None)),
    # b (L, d) factored too, over its layer axis: its column moment (d,) has no layer axis.
    "adafactor_factored_across_layers": (lambda: _adafactor_factoring(8), ("loop", "tap"),
                                         (None, NOT_STACKED)),
    # w's (L, d, d) factor is per layer; b's (L, L) factor has a row per layer, but row l reads
    # every layer's gradient.
    "kronecker": (kronecker, ("loop", "tap"), (None, MIXES_ROWS)),
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
  criteria.assert_matches_optax(got[:2], want[:2])


@pytest.mark.parametrize("case", ["adafactor_factored_per_layer", "kronecker"])
def test_state_of_another_shape_updated_in_the_loop_matches_optax_and_a_1pct_lr_error_does_not(
    case):
  """The per-layer state updated row by row (Adafactor's (L, d) moments, the (L, d, d) factor)
  equals optax's, and a learning rate 1 % off is at least criteria.REJECTED_BY times the
  tolerance away."""
  tx, batches = CASES[case][0], models.tied_lm_batches(3)
  want = models.run_optax(tx(), _params(), batches, 20, models.scanned_loss)
  got = models.run_fused(tx(), "backward", _params(), batches, 20, models.scanned_loss)
  criteria.assert_matches_optax(got, want)
  wrong = models.run_fused(faults.lr_off(tx()), "backward", _params(), batches, 20,
                           models.scanned_loss)
  distance, where = criteria.matches_optax_distance(wrong, want)
  assert distance >= criteria.REJECTED_BY, (distance, where)


def test_galore_cannot_leave_the_layer_axis_a_batch_axis():
  """optax 0.2.8's GaLore reshapes every leaf to one matrix: each axis is a reduction or an
  output axis, so a stacked leaf is projected across its layers or not at all."""
  tx = _galore(_galore_dims(GaLoreDims(1, 2), None))
  with pytest.raises(ValueError, match="All axes must be specified"):
    tx.init(_params())
