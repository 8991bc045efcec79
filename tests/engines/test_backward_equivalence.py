"""Backward fusion trains exactly like optax.

Every test trains ``models.tied_lm`` (several layers, an embedding tied to the output projection,
a parameter the loss never reads) with optfuse and with plain optax code, and compares the
losses of every step, the final params and the final optimizer state.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

from tests import criteria, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

STEPS = 50
LR = 1e-2

# float32: criteria.F32_RTOL / F32_ATOL, measured on these optimizers (see there).
# float64 (adam, lamb, multi_transform): at most 8.9e-16 absolute, a few ulps, i.e. near
# bit-exact; 100x headroom.
RTOL_64, ATOL_64 = 1e-12, 1e-13


def _ndim_mask(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


def _label_by_path(params):
  """Labels leaves by their key path: the tied embedding, other matrices, vectors."""

  def label(path, x):
    if "embed" in jax.tree_util.keystr(path):
      return "embed"
    return "matrix" if x.ndim > 1 else "vector"

  return jax.tree_util.tree_map_with_path(label, params)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(LR),
    "sgd_momentum": lambda: optax.sgd(LR, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(LR, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(LR),
    "adamw": lambda: optax.adamw(LR, weight_decay=1e-2),
    "nadamw": lambda: optax.nadamw(LR, weight_decay=1e-2),
    "adamax": lambda: optax.adamax(LR),
    "amsgrad": lambda: optax.amsgrad(LR),
    "adabelief": lambda: optax.adabelief(LR),
    "adagrad": lambda: optax.adagrad(LR),
    "adadelta": lambda: optax.adadelta(1.0),
    "rmsprop": lambda: optax.rmsprop(LR),
    "lion": lambda: optax.lion(1e-3, weight_decay=1e-2),
    "radam": lambda: optax.radam(LR),
    "yogi": lambda: optax.yogi(LR),
    "sm3": lambda: optax.sm3(LR),
    # Per-leaf trust ratios / per-leaf gradient norms: separable leaf by leaf.
    "lamb": lambda: optax.lamb(LR),
    "lars": lambda: optax.lars(LR),
    "novograd": lambda: optax.novograd(LR),
    # min_dim_size_to_factor=16 so that the 32x16 embedding and the 16x24/24x16 layers use
    # factored second moments (the default, 128, would factor nothing in this model).
    "adafactor": lambda: optax.adafactor(LR, min_dim_size_to_factor=16),
    "adan": lambda: optax.adan(LR),
    "muon": lambda: optax.contrib.muon(LR),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(LR, warmup_steps=5),
    "inject_hyperparams_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, LR, 10, STEPS),
        weight_decay=1e-2),
    "adamw_callable_ndim_mask": lambda: optax.adamw(LR, weight_decay=1e-2, mask=_ndim_mask),
    "chain_with_masks": lambda: optax.chain(
        optax.masked(optax.clip_by_block_rms(0.5), _ndim_mask),
        optax.scale_by_adam(),
        optax.add_decayed_weights(1e-2, mask=_ndim_mask),
        optax.scale(-LR)),
    "multi_transform_key_paths": lambda: optax.multi_transform(
        {"embed": optax.adam(LR), "matrix": optax.adamw(LR, weight_decay=1e-2),
         "vector": optax.sgd(LR, momentum=0.9)},
        _label_by_path),
    # Beyond the list: a step counter choosing between two optimizers inside the update (SAM
    # with a per-leaf adversary), gradient accumulation with a cond (MultiSteps), and per-row
    # norms (adaptive_grad_clip).
    "sam_transparent_sgd_adversary": lambda: optax.contrib.sam(
        optax.adam(LR), optax.sgd(0.05), sync_period=2),
    "multi_steps_adamw": lambda: optax.MultiSteps(optax.adamw(LR, weight_decay=1e-2), 3),
    "adaptive_grad_clip_adam": lambda: optax.chain(optax.adaptive_grad_clip(0.1),
                                                   optax.adam(LR)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_backward_fusion_matches_optax_over_50_steps(name):
  """Losses, params and state equal optax's; the tied embedding gets one update per step with
  its summed gradient and the unused leaf gets optax's zero-gradient update (never zeros)."""
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  want = models.run_optax(OPTIMIZERS[name](), params, batches, STEPS)
  got = models.run_fused(OPTIMIZERS[name](), "backward", params, batches, STEPS)
  criteria.assert_matches_optax(got, want)


def test_unused_param_is_decayed_like_optax_not_left_unchanged():
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  tx = optax.adamw(LR, weight_decay=0.5)
  _, want, _ = models.run_optax(tx, params, batches, 3)
  _, got, _ = models.run_fused(tx, "backward", params, batches, 3)
  assert not jnp.allclose(got["unused"], params["unused"])
  criteria.assert_matches_optax(got["unused"], want["unused"])


@pytest.mark.parametrize("name", ["adamw"])
def test_off_mode_is_plain_optax(name):
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  want = models.run_optax(OPTIMIZERS[name](), params, batches, STEPS)
  got = models.run_fused(OPTIMIZERS[name](), "off", params, batches, STEPS)
  criteria.assert_matches_optax(got, want)


@pytest.mark.parametrize("name", ["adam", "lamb", "multi_transform_key_paths"])
def test_backward_fusion_matches_optax_in_float64_to_a_few_ulps(name):
  with jax.enable_x64(True):
    params = models.tied_lm_params(dtype=jnp.float64)
    batches = models.tied_lm_batches()
    want = models.run_optax(OPTIMIZERS[name](), params, batches, STEPS)
    got = models.run_fused(OPTIMIZERS[name](), "backward", params, batches, STEPS)
    assert jax.tree.leaves(got[1])[0].dtype == jnp.float64
    criteria.assert_matches_optax(got, want, RTOL_64, ATOL_64)


@pytest.mark.jax_upgrades
@pytest.mark.parametrize("name", ["adamw"])
def test_backward_fusion_without_jit_matches_optax(name):
  # Eager steps dispatch op by op (~0.15 s each here): 5 steps show that the unjitted step is
  # the same function; the 50-step claims above run under jit.
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  want = models.run_optax(OPTIMIZERS[name](), params, batches, 5)
  got = models.run_fused(OPTIMIZERS[name](), "backward", params, batches, 5, jit=False)
  criteria.assert_matches_optax(got, want)
