"""Forward fusion: every optax transform, the same losses as optax, optax's state after flush."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from optfuse._plan._global_stage import make_global_plan
from tests import criteria, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

STEPS = 50

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: optax.lion(1e-3, weight_decay=1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "clip_by_global_norm+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                                     optax.adamw(1e-2)),
    "normalize_by_update_norm": lambda: optax.chain(optax.normalize_by_update_norm(1e-2),
                                                    optax.trace(0.9)),
}


def scaled_loss(params, tokens, targets, scale):
  """``tied_lm_loss`` times ``scale``: a NaN scale makes every gradient NaN."""
  return models.tied_lm_loss(params, tokens, targets) * scale


def train(fx, params, batches, steps, loss_fn=models.tied_lm_loss, jit=True):
  """``steps`` steps of ``fx`` (jitted with donation unless ``jit=False``); returns the losses and
  the flushed params and optax state."""
  losses, params, state = models.run_steps(fx.value_and_update(loss_fn), params,
                                           fx.init(params), batches, steps, jit)
  to_optax = lambda params, state: optfuse.to_optax_state(fx, params, state)
  params, opt_state = (jax.jit(to_optax) if jit else to_optax)(params, state)
  return losses, params, opt_state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_forward_fusion_matches_optax_over_50_steps(name):
  tx = OPTIMIZERS[name]()
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  expected = models.run_optax(tx, params, batches, STEPS)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, STEPS)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


def test_forward_fusion_without_jit_matches_optax_over_50_steps():
  tx = OPTIMIZERS["clip_by_global_norm+adamw"]()
  params, batches = models.mlp_params_and_batches()
  expected = models.run_optax(tx, params, batches, STEPS, loss_fn=models.mlp_loss, jit=False)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, STEPS, loss_fn=models.mlp_loss,
              jit=False)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


def test_forward_apply_if_finite_skips_nan_steps_exactly_as_optax():
  tx = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
                             max_consecutive_errors=3)
  nan_steps = {4, 17, 18, 30}
  batches = [(*batch, jnp.float32(np.nan if t in nan_steps else 1.0))
             for t, batch in enumerate(models.tied_lm_batches(STEPS))]
  params = models.tied_lm_params()
  expected = models.run_optax(tx, params, batches, STEPS, loss_fn=scaled_loss)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, STEPS, loss_fn=scaled_loss)
  losses = np.asarray(got[0])
  assert np.isnan(losses[sorted(nan_steps)]).all()
  assert np.isfinite(np.delete(losses, sorted(nan_steps))).all()
  assert int(got[2].total_notfinite) == len(nan_steps)
  # NaN losses compare equal to NaN.
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


def train_microbatches(tx, mode, params, batches, steps, loss_fn, k, has_aux=False):
  """``steps`` jitted, donated steps of ``k`` microbatches; returns the values (losses, or
  ``(loss, aux)`` pairs) and the flushed params and optax state."""
  fx = optfuse.fuse(tx, mode=mode)
  step = jax.jit(fx.value_and_update(loss_fn, has_aux, microbatches=k), donate_argnums=(0, 1))
  p, state, values = models.copy(params), fx.init(params), []
  for t in range(steps):
    value, p, state = step(p, state, *batches[t % len(batches)])
    values.append(value)
  return values, *optfuse.to_optax_state(fx, p, state)


def test_forward_fusion_with_microbatches_matches_optax_accumulation_over_50_steps():
  tx = OPTIMIZERS["clip_by_global_norm+adamw"]()
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  expected = train_microbatches(tx, "off", params, batches, STEPS, models.tied_lm_loss, 2)
  got = train_microbatches(tx, "forward", params, batches, STEPS, models.tied_lm_loss, 2)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


def scanned_loss_with_aux(params, tokens, targets):
  return models.scanned_loss(params, tokens, targets), {"tokens": tokens.sum(axis=-1)}


def test_forward_fusion_with_microbatches_of_a_scanned_model_matches_optax_accumulation():
  # The pending update is applied before the loop over microbatches (whole, from the clipped
  # gradient staged over the pending buffer), then each of the four adds its gradient into the
  # new pending buffer inside its backward loop.
  tx = OPTIMIZERS["clip_by_global_norm+adamw"]()
  params, batches = models.stacked_params(), models.tied_lm_batches()
  expected = train_microbatches(tx, "off", params, batches, 20, scanned_loss_with_aux, 4, True)
  got = train_microbatches(tx, "forward", params, batches, 20, scanned_loss_with_aux, 4, True)
  # The aux of each microbatch, stacked: (microbatches, examples per microbatch).
  assert got[0][0][1]["tokens"].shape == (4, batches[0][0].shape[0] // 4)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


@pytest.mark.parametrize("name", ["adamw", "clip_by_global_norm+adamw"])
def test_forward_fusion_with_microbatches_accumulates_into_the_pending_buffer(name):
  # Compile-only: 16 stacked 256x256 layers, 4 microbatches. Optax's accumulation loop holds the
  # accumulator and each microbatch's gradient; forward fusion adds each gradient row into the
  # pending buffer it already holds. Measured on CPU: optax 22.24 MB, forward 18.28 MB (both
  # optimizers; 21.39 MB with AdamW when the slots were updated whole after the row loop).
  params, batch = models.residual_stack_specs()
  peaks = {mode: models.compiled_peak(
      optfuse.fuse(OPTIMIZERS[name](), mode=mode),
      models.residual_stack_loss, params, *batch, microbatches=4) for mode in ("off", "forward")}
  stack_bytes = models.RESIDUAL_LAYERS * models.RESIDUAL_DIM ** 2 * 4
  assert peaks["forward"] <= peaks["off"] - stack_bytes / 2


SCANNED = {**OPTIMIZERS, "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
           "ema_of_params": models.ema_of_params,
           "clip_by_global_norm+lion": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                                           optax.lion(1e-3))}


@pytest.mark.parametrize("name", ["adamw", "clip_by_global_norm+adamw", "lion", "sgd_momentum",
                                  "ema_of_params", "clip_by_global_norm+lion"])
def test_forward_fusion_of_a_scanned_model_matches_optax_over_50_steps(name):
  # The 4 stacked layers are updated whole and in place before the loss (adamw,
  # sgd_momentum, and clipped adamw from its clipped gradient), or row by row in the forward
  # loop: the params alone and their slots whole after the loop (lion), or both row by row
  # (clipped lion: the slots read the clipping factor; ema_of_params: they read the param).
  tx = SCANNED[name]()
  params, batches = models.stacked_params(), models.tied_lm_batches()
  expected = models.run_optax(tx, params, batches, STEPS, loss_fn=models.scanned_loss)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, STEPS, loss_fn=models.scanned_loss)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


@pytest.mark.parametrize("name,where", [("adamw", "leaf"), ("sgd_momentum", "leaf"),
                                        ("clip_by_global_norm+adamw", "leaf"), ("lion", "loop"),
                                        ("clip_by_global_norm+lion", "loop"),
                                        ("ema_of_params", "loop")])
def test_forward_fusion_updates_scanned_layers_in_place_whole_or_inside_the_forward_loop(
    name, where):
  # Updated whole, AdamW's step is in place (it reads the old moments only through the new
  # ones); with clipping too, once the clipped gradient has taken over the pending gradient's
  # buffer. Lion's step reads the old momentum beside the new, ema_of_params' slots read the
  # param: whole, each would hold a full-size temporary, so their rows are updated inside the
  # forward loop.
  fx = optfuse.fuse(SCANNED[name](), mode="forward")
  params, (tokens, targets) = models.stacked_params(), models.tied_lm_batches()[0]
  assert optfuse.describe(fx, models.scanned_loss, params, tokens, targets) == {
      "['embed']": "leaf", "['head']": "leaf", "['layers']['b']": where,
      "['layers']['w']": where}
  # The update adds no loop of its own: the step has the forward scan and its backward loop, as
  # optax's step has.
  # Counted in the lowered program: the traced step holds each platform's placement
  # (``_backends.FORWARD_STACKED_ROWS``), the lowering for this one only.
  step = fx.value_and_update(models.scanned_loss)
  fused = jax.jit(step).lower(params, fx.init(params), tokens, targets).as_text()
  optax_step = jax.jit(jax.value_and_grad(models.scanned_loss)).lower(params, tokens,
                                                                       targets).as_text()
  assert fused.count("stablehlo.while") == optax_step.count("stablehlo.while") == 2


def reversed_remat_loss(params, tokens, targets):
  """``scanned_loss`` with the layers run last to first, each rematerialised."""
  body = jax.checkpoint(lambda h, layer: (h + jnp.tanh(h @ layer["w"] + layer["b"]), None))
  h, _ = jax.lax.scan(body, params["embed"][tokens], params["layers"], reverse=True)
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], targets).mean()


def scaled_scanned_loss(params, tokens, targets, scale):
  return models.scanned_loss(params, tokens, targets) * scale


@pytest.mark.jax_upgrades
def test_in_loop_forward_fusion_of_a_reversed_rematerialised_scan_matches_optax():
  tx = OPTIMIZERS["clip_by_global_norm+adamw"]()
  params, batches = models.stacked_params(), models.tied_lm_batches()
  expected = models.run_optax(tx, params, batches, STEPS, loss_fn=reversed_remat_loss)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, STEPS,
              loss_fn=reversed_remat_loss)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


def remat_stack_loss(params, tokens, targets):
  """``scanned_loss`` with ``jax.checkpoint`` around the whole scan."""
  body = lambda h, layer: (h + jnp.tanh(h @ layer["w"] + layer["b"]), None)
  stack = jax.checkpoint(lambda h, layers: jax.lax.scan(body, h, layers)[0])
  h = stack(params["embed"][tokens], params["layers"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], targets).mean()


@pytest.mark.parametrize("name,where", [("adamw", "leaf"), ("lion", "rows"),
                                        ("clip_by_global_norm+adamw", "leaf"),
                                        ("clip_by_global_norm+lion", "rows"),
                                        ("ema_of_params", "rows")])
@pytest.mark.jax_upgrades
@models.CUSTOM_VJP3_REMAT_BUG
def test_stacked_leaves_of_a_rematerialised_stack_are_updated_before_it(name, where):
  # Inside the checkpoint the forward loop runs again in the backward pass, so the rows are
  # updated before the loss: whole and in place (adamw, clipped adamw), or params and slots
  # row by row.
  tx = SCANNED[name]()
  params, batches = models.stacked_params(), models.tied_lm_batches()
  fx = optfuse.fuse(tx, mode="forward")
  placements = optfuse.describe(fx, remat_stack_loss, params, *batches[0])
  assert placements["['layers']['w']"] == placements["['layers']['b']"] == where
  expected = models.run_optax(tx, params, batches, STEPS, loss_fn=remat_stack_loss)
  got = train(fx, params, batches, STEPS, loss_fn=remat_stack_loss)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


@pytest.mark.parametrize("name", ["adamw", "lion", "clip_by_global_norm+adamw"])
def test_stacked_leaves_updated_before_a_rematerialised_stack_need_about_optax_peak_memory(
    name):
  # Compile-only. The update runs inside the conditional that skips the first step's: whole
  # and in place for AdamW, row by row for Lion and clipping, whose row loop keeps its slots
  # (updated whole after it, XLA copied the param stack twice: 49.96 MB with AdamW). Measured on
  # CPU: optax 42.73 / 34.21 / 42.80 MB, forward 43.65 / 35.11 / 44.70 MB (AdamW row by row:
  # 43.65 MB too).
  layers, dim = 8, 512
  params = models.abstract_stacked_params(layers, dim)
  tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
  peaks = {mode: models.compiled_peak(optfuse.fuse(SCANNED[name](), mode=mode), remat_stack_loss,
                                      params, tokens, tokens) for mode in ("off", "forward")}
  layer_bytes = (dim * dim + dim) * 4
  assert peaks["forward"] <= peaks["off"] + 2.5 * layer_bytes


def test_in_loop_forward_fusion_skips_nan_steps_of_apply_if_finite_as_optax():
  # The all-finite flag is computed once before the loop; every row of the stacked layers
  # reads it (and the first step, with nothing pending, keeps every row).
  tx = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
                             max_consecutive_errors=3)
  nan_steps = {0, 4, 17, 18}
  batches = [(*batch, jnp.float32(np.nan if t in nan_steps else 1.0))
             for t, batch in enumerate(models.tied_lm_batches(30))]
  params = models.stacked_params()
  expected = models.run_optax(tx, params, batches, 30, loss_fn=scaled_scanned_loss)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, 30,
              loss_fn=scaled_scanned_loss)
  assert int(got[2].total_notfinite) == len(nan_steps)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


@pytest.mark.slow
def test_in_loop_forward_fusion_without_jit_matches_optax():
  tx = OPTIMIZERS["adamw"]()
  params, batches = models.stacked_params(), models.tied_lm_batches()
  expected = models.run_optax(tx, params, batches, 3, loss_fn=models.scanned_loss, jit=False)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, 3, loss_fn=models.scanned_loss,
              jit=False)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


def test_stacked_leaves_of_a_loop_too_short_to_fuse_are_updated_row_by_row_before_it():
  # Two layers: the backward loop keeps the stacked gradient (a loop needs 3 iterations to pay
  # for its rows in flight), and ema_of_params' update (no slots of its own: its average is
  # state it reads beside the param, so neither in place whole nor staged) is applied row by
  # row before the loop.
  tx = models.ema_of_params()
  params, batches = models.stacked_params(layers=2), models.tied_lm_batches()
  tokens, targets = batches[0]
  fx = optfuse.fuse(tx, mode="forward")
  placements = optfuse.describe(fx, models.scanned_loss, params, tokens, targets)
  assert placements["['layers']['w']"] == placements["['layers']['b']"] == "rows"
  expected = models.run_optax(tx, params, batches, 20, loss_fn=models.scanned_loss)
  got = train(fx, params, batches, 20, loss_fn=models.scanned_loss)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


def test_stacked_leaves_whose_update_mixes_rows_are_updated_whole_before_the_loop():
  tx = optax.lamb(1e-2)  # the trust ratio is a norm over the whole stacked leaf
  params, batches = models.stacked_params(), models.tied_lm_batches()
  tokens, targets = batches[0]
  fx = optfuse.fuse(tx, mode="forward")
  placements = optfuse.describe(fx, models.scanned_loss, params, tokens, targets)
  assert set(placements.values()) == {"leaf"}
  expected = models.run_optax(tx, params, batches, 20, loss_fn=models.scanned_loss)
  got = train(optfuse.fuse(tx, mode="forward"), params, batches, 20, loss_fn=models.scanned_loss)
  criteria.assert_matches_optax(got, expected, **criteria.F32_FLOOR)


@pytest.mark.parametrize("name", ["adamw", "clip_by_global_norm+adamw"])
def test_forward_step_on_a_scanned_model_needs_about_optax_peak_memory(name):
  # Compile-only. The pending gradient is an argument of the step (optax's gradient is a
  # temporary), so the new one must be written into its donated buffer, not into a fresh one
  # copied there afterwards. AdamW's stacked leaves are updated whole, in place; with clipping
  # row by row inside the forward loop (the clipped gradient, read by both of Adam's moments,
  # would be a full temporary). Measured on CPU, peak: optax 42.73 MB (adamw) and 42.80 MB
  # (clipping); forward 43.65 and 44.44 MB, the same for AdamW row by row in the loop (before
  # the pending gradient was captured in its donated buffer, a whole-leaf update took 50.2 and
  # 57.5 MB). What is left is rows in flight in the loops: the bound is optax's peak plus 2.5
  # layers.
  layers, dim = 8, 512
  params = models.abstract_stacked_params(layers, dim)
  tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
  report = optfuse.memory_report(models.scanned_loss, OPTIMIZERS[name](), params, tokens, tokens)
  layer_bytes = (dim * dim + dim) * 4
  assert report["forward"]["peak_bytes"] <= report["off"]["peak_bytes"] + 2.5 * layer_bytes


def test_forward_state_holds_optax_state_and_the_pending_gradient():
  tx = optax.adam(1e-2)
  fx = optfuse.fuse(tx, mode="forward")
  params = models.tied_lm_params()
  state = fx.init(params)
  assert isinstance(state, optfuse.ForwardState)
  chex.assert_trees_all_equal(state.opt_state, tx.init(params))
  assert not state.has_pending
  batch = models.tied_lm_batches()[0]
  loss, new_params, state = fx.value_and_update(models.tied_lm_loss)(params, state, *batch)
  # The first step has nothing to apply: it evaluates the initial params and keeps the gradient.
  chex.assert_trees_all_equal(new_params, params)
  expected_loss, grads = jax.value_and_grad(models.tied_lm_loss)(params, *batch)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
  chex.assert_trees_all_close(state.pending_grads, grads, rtol=1e-6, atol=1e-7)
  assert state.has_pending


def test_flush_applies_the_pending_update_once():
  tx = OPTIMIZERS["clip_by_global_norm+adamw"]()
  fx = optfuse.fuse(tx, mode="forward")
  params, batch = models.tied_lm_params(), models.tied_lm_batches()[0]
  _, params, state = fx.value_and_update(models.tied_lm_loss)(params, fx.init(params), *batch)
  flushed = fx.flush(params, state)
  assert not flushed[1].has_pending
  chex.assert_trees_all_equal(fx.flush(*flushed), flushed)
  grads = state.pending_grads
  updates, opt_state = tx.update(grads, tx.init(params), params)
  chex.assert_trees_all_close(flushed, (optax.apply_updates(params, updates),
                                        optfuse.ForwardState(
                                            opt_state, jax.tree.map(jnp.zeros_like, grads),
                                            jnp.bool_(False))), rtol=1e-6, atol=1e-7)


def test_optax_state_round_trip_continues_the_same_trajectory():
  tx = optax.adamw(1e-2)
  fx = optfuse.fuse(tx, mode="forward")
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  step = jax.jit(fx.value_and_update(models.tied_lm_loss))
  state = fx.init(params)
  for batch in batches:
    _, params, state = step(params, state, *batch)
  params, opt_state = optfuse.to_optax_state(fx, params, state)
  assert jax.tree.structure(opt_state) == jax.tree.structure(tx.init(params))
  state = optfuse.from_optax_state(fx, params, opt_state)
  chex.assert_trees_all_equal(optfuse.to_optax_state(fx, params, state), (params, opt_state))


def test_forward_step_rejects_a_plain_optax_state():
  fx = optfuse.fuse(optax.adam(1e-2), mode="forward")
  params = models.tied_lm_params()
  step = fx.value_and_update(models.tied_lm_loss)
  with pytest.raises(optfuse.StateMismatchError, match="from_optax_state"):
    step(params, optax.adam(1e-2).init(params), *models.tied_lm_batches()[0])


def test_forward_mode_refuses_transforms_that_need_the_loss():
  fx = optfuse.fuse(optax.chain(optax.sgd(1e-2), optax.contrib.reduce_on_plateau()),
                    mode="forward")
  params = models.tied_lm_params()
  with pytest.raises(optfuse.NonSeparableError, match='mode="off"'):
    fx.value_and_update(models.tied_lm_loss)(params, fx.init(params), *models.tied_lm_batches()[0])


@pytest.mark.parametrize("tx", [
    optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)), 2),
    optax.chain(optax.normalize_by_update_norm(), optax.sgd(0.1)),
    optax.lamb(1e-2),
    optax.novograd(1e-2),
    optax.MultiSteps(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)), 3),
    optax.chain(optax.clip(0.1), optax.scale_by_rss(), optax.zero_nans()),
], ids=["clip+adamw", "apply_if_finite(clip+adam)", "normalize", "lamb", "novograd",
        "MultiSteps(clip+adam)", "clip+rss+zero_nans"])
def test_global_plan_stage_by_stage_equals_tx_update(tx):
  params = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": [jnp.ones(4), jnp.zeros(())]}
  state = tx.init(params)
  plan = make_global_plan(tx, params, state)
  staged = jax.jit(lambda g, s, p: plan.update(jax.tree.leaves(g), jax.tree.leaves(s),
                                               jax.tree.leaves(p)))
  reference = jax.jit(tx.update)
  grads = jax.tree.map(lambda p: jnp.sin(3 * p) + 0.1, params)
  for _ in range(3):  # a few updates, so that counters and accumulators move
    updates, new_state = staged(grads, state, params)
    expected_updates, expected_state = reference(grads, state, params)
    # The same operations in another XLA program: equal up to float32 rounding.
    chex.assert_trees_all_close(
        (updates, new_state), (jax.tree.leaves(expected_updates), jax.tree.leaves(expected_state)),
        rtol=1e-6, atol=1e-7)
    state, grads = expected_state, jax.tree.map(lambda g: 1.5 * g, grads)


def test_global_plan_splits_clipping_into_a_scalar_global_stage():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  params = models.tied_lm_params()
  plan = make_global_plan(tx, params, tx.init(params))
  # The groups read only the norm and the "no clipping needed" flag, never another gradient.
  assert all(c.shape == () for c in plan.cuts) and plan.cuts
  n, c = plan.num_params, len(plan.consts)
  for i, group in enumerate(plan.groups):
    assert [j for j in range(n) if group.reads[c + j]] in ([i], [])


@pytest.mark.parametrize("name", ["adamw", "clip_by_global_norm+adamw"])
def test_forward_fusion_of_the_accelerators_placement_matches_optax(monkeypatch, name):
  # On TPU and GPU every stacked leaf is updated row by row (``_backends.FORWARD_STACKED_ROWS``:
  # the GPU compiler copies params and state around the conditional of a whole update), and on
  # GPU the pending update is chosen by a select (``PENDING_SELECT``); this machine runs the
  # CPU's entries, so here it runs theirs.
  from optfuse._targets import _backends
  monkeypatch.setitem(_backends.FORWARD_STACKED_ROWS, "cpu", True)
  monkeypatch.setitem(_backends.PENDING_SELECT, "cpu", True)
  tx = SCANNED[name]()
  params, batches = models.stacked_params(), models.tied_lm_batches()
  fx = optfuse.fuse(tx, mode="forward")
  losses, got, state = models.run_steps(fx.value_and_update(models.scanned_loss), params,
                                        fx.init(models.copy(params)), batches, 30)
  got, opt_state = optfuse.to_optax_state(fx, got, state)
  want = models.run_optax(tx, params, batches, 30, loss_fn=models.scanned_loss)
  criteria.assert_matches_optax((losses, got, opt_state), want)


# The GPU's choice of the pending update (``_backends.PENDING_SELECT``: a select per leaf, the
# update computed at every step and kept only when a gradient is pending; the stacked leaves
# updated row by row, ``FORWARD_STACKED_ROWS``, each row chosen in its loop), run here on the
# CPU: the first step's unchanged params, the NaN steps of ``apply_if_finite``, microbatches,
# and the pending update of a scanned model's stacks before its microbatches (row loops).
@pytest.mark.parametrize("check", [
    lambda: test_forward_fusion_matches_optax_over_50_steps("clip_by_global_norm+adamw"),
    test_forward_apply_if_finite_skips_nan_steps_exactly_as_optax,
    test_forward_fusion_with_microbatches_matches_optax_accumulation_over_50_steps,
    test_forward_fusion_with_microbatches_of_a_scanned_model_matches_optax_accumulation,
], ids=["clip_adamw", "apply_if_finite", "microbatches", "scanned_microbatches"])
def test_the_pending_update_chosen_by_a_select_matches_optax(monkeypatch, check):
  from optfuse._targets import _backends
  monkeypatch.setitem(_backends.PENDING_SELECT, "cpu", True)
  monkeypatch.setitem(_backends.FORWARD_STACKED_ROWS, "cpu", _backends.FORWARD_STACKED_ROWS["cuda"])
  check()
