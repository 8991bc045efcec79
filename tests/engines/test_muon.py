"""Muon fused layer by layer: each stacked matrix orthogonalised in its backward loop iteration.

``optax.contrib.muon`` with dimension numbers that leave the stacked layer axis a batch axis
orthogonalises each layer's matrix on its own (``jax.vmap`` over the batch axes), so row ``l``
of its update reads only row ``l`` of the gradient and momentum. Its Newton-Schulz iterations
are a loop (``scan``; ``fori_loop`` unrolled; a ``cond`` in the first step with AOL
preconditioning) that the row evaluator runs on one layer's matrix. The model is a scanned
remat decoder shaped as LLMs are: RMSNorm scales (L, d), attention ``wq/wk/wv`` (L, d, heads,
head_dim) and ``wo`` (L, heads, head_dim, d), a SwiGLU MLP ``w1/w3`` (L, d, ff) and ``w2``
(L, ff, d); norms, embedding and head on Muon's AdamW fallback. It is also stored with the layer
axis second (MaxText's ``param_scan_axis=1``), moved first for the scan, and trained with
microbatches, with the optimizer state offloaded to host memory, in forward mode (each layer's
update just before its use in the next step), and on an FSDP mesh of eight simulated CPU
devices (``_muon_fsdp_worker.py``, in its own process).
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from optax.contrib import MuonDimensionNumbers as Dims

import optfuse
from optfuse._jaxpr import _rows
from tests import criteria, faults, models
from tests._subprocess import checkout_env

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

L, DIM, HEADS, HEAD_DIM, FF, VOCAB, SEQ, BATCH = 4, 16, 2, 8, 32, 32, 8, 2
LR = 1e-3
# Dimension numbers of each stacked matrix with the layer axis at 0, a batch axis.
DIMS = {"wq": Dims(1, (2, 3)), "wk": Dims(1, (2, 3)), "wv": Dims(1, (2, 3)),
        "wo": Dims((1, 2), 3), "w1": Dims(1, 2), "w3": Dims(1, 2), "w2": Dims(1, 2)}
MATRICES = [f"['layers']['{name}']" for name in sorted(DIMS)]
# Float32, 20 steps: a row's update is the same arithmetic as its slice of the whole update
# (bit for bit, test_a_row_of_muons_update_equals_the_row_of_its_whole_update), but XLA fuses
# the step's program differently around the loop (FMA contraction), as it does for AdamW: a few
# ulps per step. The learning rate keeps the decoder's trajectory from amplifying them: at 1e-2
# params one ulp apart end 20 steps ~1e-3 apart under plain optax, at 1e-3 ~2e-6.
RTOL, ATOL = 1e-5, 1e-6


def _rms(x, scale):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _block(h, p):
  x = _rms(h, p["norm1"])
  q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[w]) for w in ("wq", "wk", "wv"))
  s = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(HEAD_DIM)
  s = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), s, -1e9)
  a = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(s, -1), v)
  h = h + jnp.einsum("bqhk,hkd->bqd", a, p["wo"])
  x = _rms(h, p["norm2"])
  return h + (jax.nn.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"], None


def decoder_loss(params, tokens, targets, layer_axis: int = 0):
  layers = jax.tree.map(lambda x: jnp.moveaxis(x, layer_axis, 0), params["layers"])
  h, _ = lax.scan(jax.checkpoint(_block), params["embed"][tokens], layers)
  logits = _rms(h, params["final_norm"]) @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def decoder_params(layer_axis: int = 0) -> dict:
  k = iter(jax.random.split(jax.random.PRNGKey(0), 10))
  normal = lambda *shape, fan_in: jax.random.normal(next(k), shape) / np.sqrt(fan_in)
  layers = {"norm1": jnp.ones((L, DIM)), "norm2": jnp.ones((L, DIM)),
            **{w: normal(L, DIM, HEADS, HEAD_DIM, fan_in=DIM) for w in ("wq", "wk", "wv")},
            "wo": normal(L, HEADS, HEAD_DIM, DIM, fan_in=HEADS * HEAD_DIM),
            "w1": normal(L, DIM, FF, fan_in=DIM), "w3": normal(L, DIM, FF, fan_in=DIM),
            "w2": normal(L, FF, DIM, fan_in=FF)}
  return {"embed": normal(VOCAB, DIM, fan_in=DIM), "final_norm": jnp.ones((DIM,)),
          "head": normal(DIM, VOCAB, fan_in=DIM),
          "layers": jax.tree.map(lambda x: jnp.moveaxis(x, 0, layer_axis), layers)}


def _moved(axis: int, layer_axis: int) -> int:
  """Where an axis of a stack stored layer axis first is, stored with it at ``layer_axis``."""
  order = [a for a in range(8) if a != 0]
  order.insert(layer_axis, 0)
  return order.index(axis)


def muon_dims(layer_axis: int = 0):
  """Dimension numbers for ``decoder_params(layer_axis)``: the layer axis a batch axis of every
  stacked matrix; norms, embedding and head (``None``) on Muon's AdamW fallback."""
  move = lambda axes: tuple(_moved(a, layer_axis) for a in np.atleast_1d(axes))
  layers = {name: None for name in ("norm1", "norm2")}
  layers.update({name: Dims(move(d.reduction_axis), move(d.output_axis))
                 for name, d in DIMS.items()})
  return lambda params: {"embed": None, "final_norm": None, "head": None, "layers": layers}


def _batches(num: int = 3) -> list:
  out = []
  for key in jax.random.split(jax.random.PRNGKey(1), num):
    seq = jax.random.randint(key, (BATCH, SEQ + 1), 0, VOCAB)
    out.append((seq[:, :-1], seq[:, 1:]))
  return out


def _muon(layer_axis: int = 0, **kwargs) -> optax.GradientTransformation:
  return optax.contrib.muon(LR, muon_weight_dimension_numbers=muon_dims(layer_axis), **kwargs)


def _loss(layer_axis: int):
  return lambda params, tokens, targets: decoder_loss(params, tokens, targets, layer_axis)


@pytest.mark.parametrize("layer_axis", [0, 1])
def test_describe_puts_every_stacked_muon_matrix_in_its_loop(layer_axis):
  where = optfuse.describe(_muon(layer_axis), _loss(layer_axis), decoder_params(layer_axis),
                           *_batches()[0])
  assert all(where[m] == "loop" for m in MATRICES), where.table()
  assert where["['layers']['norm1']"] == where["['layers']['norm2']"] == "loop"
  assert not where.reasons, where.reasons


def test_muon_across_layers_stays_after_the_loop_because_it_mixes_rows():
  """The layer axis a reduction axis: each layer's update reads every layer's momentum."""
  dims = lambda p: {**muon_dims()(p), "layers": {
      **muon_dims()(p)["layers"], "w1": Dims((0, 1), 2)}}
  tx = optax.contrib.muon(LR, muon_weight_dimension_numbers=dims)
  where = optfuse.describe(tx, decoder_loss, decoder_params(), *_batches()[0])
  assert where["['layers']['w1']"] == "tap"
  assert "its update mixes rows" in where.reasons["['layers']['w1']"]


@pytest.mark.parametrize("variant", [
    dict(), dict(preconditioning="aol"), dict(ns_coeffs="dion"), dict(nesterov=False)])
def test_a_row_of_muons_update_equals_the_row_of_its_whole_update(variant):
  """Bit for bit: the row evaluator reorders none of the Newton-Schulz arithmetic (a ``scan``
  of batched products; a ``cond`` with AOL; a ``scan`` over coefficients with Dion's)."""
  k = jax.random.split(jax.random.PRNGKey(2), 3)
  g, mu, w = (jax.random.normal(key, (L, DIM, FF)) for key in k)
  tx = optax.contrib.muon(LR, muon_weight_dimension_numbers={"w": Dims(1, 2)}, **variant)
  state = tx.init({"w": w})

  def update(g, mu, w):
    muon = state.inner_states["muon"].inner_state
    muon = (muon[0]._replace(mu={"w": mu}), *muon[1:])
    inner = {**state.inner_states,
             "muon": state.inner_states["muon"]._replace(inner_state=muon)}
    return tx.update({"w": g}, state._replace(inner_states=inner), {"w": w})[0]["w"]

  closed = jax.make_jaxpr(update)(g, mu, w)
  whole = jax.jit(update)(g, mu, w)
  row = jax.jit(lambda i, *rows: _rows.evaluate_rows(closed.jaxpr, closed.consts, list(rows),
                                                     [True] * 3, i, L)[0])
  for i in range(L):
    np.testing.assert_array_equal(np.asarray(row(i, g[i], mu[i], w[i])), np.asarray(whole[i]))


@pytest.mark.parametrize("layer_axis", [0, 1])
def test_backward_fused_muon_trains_like_optax_over_20_steps(layer_axis):
  params, loss = decoder_params(layer_axis), _loss(layer_axis)
  got = models.run_fused(_muon(layer_axis), "backward", params, _batches(), 20, loss)
  want = models.run_optax(_muon(layer_axis), params, _batches(), 20, loss)
  chex.assert_trees_all_close(got[:2], want[:2], rtol=RTOL, atol=ATOL)


def _run(fx, microbatches=None):
  params = decoder_params()
  step = fx.value_and_update(decoder_loss, microbatches=microbatches)
  losses, params, state = models.run_steps(step, params, fx.init(params), _batches(), 20)
  return losses, (fx.flush(params, state)[0] if hasattr(fx, "flush") else params), state


def optax_microbatched_step(tx: optax.GradientTransformation, microbatches: int = 1):
  """The hand-written step a fused one is judged against: the loss and gradient of each
  microbatch (consecutive slices of the batch), their means, ``tx.update`` of the mean gradient
  and ``optax.apply_updates``; with one microbatch, plain optax."""

  def step(params, state, tokens, targets):
    size = tokens.shape[0] // microbatches
    parts = [jax.value_and_grad(decoder_loss)(params, tokens[i * size:(i + 1) * size],
                                              targets[i * size:(i + 1) * size])
             for i in range(microbatches)]
    loss = sum(value for value, _ in parts) / microbatches
    grads = jax.tree.map(lambda *g: sum(g) / microbatches, *(grad for _, grad in parts))
    updates, state = tx.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state

  return step


def optax_reference(tx: optax.GradientTransformation, microbatches: int = 1):
  """20 steps of ``optax_microbatched_step`` from the decoder's params: ``(losses, params)``."""
  params = decoder_params()
  return models.run_steps(optax_microbatched_step(tx, microbatches), params, tx.init(params),
                          _batches(), 20)[:2]


# Microbatched, offloaded and forward-fused Muon against the hand-written optax loop; the faults
# of tests/faults.py injected into the fused run only must fail the same comparison (a learning
# rate 1 % off moves the weights ~1e-2 of their 20 steps' movement, two orders of magnitude
# beyond RTOL and ATOL; a skipped row leaves one layer's matrix a whole step behind).
FUSED_OPTIONS = {"backward_microbatches": dict(mode="backward", microbatches=2),
                 "backward_offload_state": dict(mode="backward", offload="state"),
                 "forward": dict(mode="forward")}


def _fused_run(options: str, tx: optax.GradientTransformation):
  options = dict(FUSED_OPTIONS[options])
  microbatches = options.pop("microbatches", None)
  return _run(optfuse.fuse(tx, **options), microbatches)[:2]


def muon_faults(layer_axis: int = 0) -> dict:
  """The errors of tests/faults.py, the skipped row one layer of the stacked ``w1``; Muon's
  momentum and its AdamW fallback both count steps for their bias correction."""
  return faults.faults(lambda path: path == "['layers']['w1']", layer_axis)


@pytest.mark.parametrize("options", sorted(FUSED_OPTIONS))
def test_fused_muon_trains_like_the_hand_written_optax_loop(options):
  microbatches = FUSED_OPTIONS[options].get("microbatches", 1)
  chex.assert_trees_all_close(_fused_run(options, _muon()), optax_reference(_muon(), microbatches),
                              rtol=RTOL, atol=ATOL)


FAULT_CASES = [pytest.param(options, fault, marks=() if (options, fault) in {
                   ("backward_microbatches", "lr_1pct_off"), ("forward", "row_skipped")}
                   else pytest.mark.slow)
               for options in sorted(FUSED_OPTIONS) for fault in sorted(muon_faults())]


@pytest.mark.parametrize("options,fault", FAULT_CASES)
def test_the_comparison_with_the_optax_loop_rejects_an_error_injected_into_the_fused_muon(
    options, fault):
  microbatches = FUSED_OPTIONS[options].get("microbatches", 1)
  got = _fused_run(options, muon_faults()[fault](_muon()))
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(got, optax_reference(_muon(), microbatches), rtol=RTOL, atol=ATOL)


def test_forward_fusion_puts_every_stacked_muon_matrix_in_its_loop():
  fx = optfuse.fuse(_muon(), mode="forward")
  where = optfuse.describe(fx, decoder_loss, decoder_params(), *_batches()[0])
  assert all(where[m] == "loop" for m in MATRICES), where.table()


def test_backward_fused_muon_on_an_fsdp_mesh_of_eight_devices_trains_like_the_unfused_step():
  """The worker checks ``describe`` and the 20 steps on the mesh (the device count is fixed when
  JAX starts, hence the subprocess; the XLA flags of this process travel with it)."""
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "_muon_fsdp_worker.py")],
                        env=checkout_env(XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr


# Muon's one slot, its momentum ``mu``, in 8 or 4 bits (``optfuse.low_bit``): each stacked
# matrix's codes and scales stay stacked like it (blocks run along its last axis), so the
# quantize, the Newton-Schulz iterations and the dequantize run on one layer's matrix in its loop
# iteration. A low-bit trajectory is chaotic (a flipped code moves a weight by a fraction of a
# step). In 4 bits the fused run is judged against the spread of the unfused low-bit runs started
# an ulp or two apart (models.assert_same_low_bit_trajectory), as
# tests/low_bit/test_low_bit_fusion.py does, from eight starts instead of four: Muon orthogonalises
# the whole matrix, so one flipped code moves every element of a layer's matrix and the distances
# between runs are heavy-tailed. In 8 bits that spread is 1e-2 to 4.3e-2 of how far the matrices
# move in 20 steps (still 0.7e-2 to 1.4e-2 in 10, 0.4e-2 to 1e-2 in 5), beyond the cap
# (models.SPREAD_CAP) under which it can tell a learning rate 1 % off, so 8-bit Muon is judged one
# step at a time instead: every fused step from the unfused run's own params and state, against that
# run's step (criteria.assert_each_step_matches).
MUON_NUDGES = (1, -1, 2, -2, 3, -3, 4)
# (layer axis, microbatches): the 2 microbatches against the hand-written optax loop.
ONE_STEP_CASES = [pytest.param(0, 1, id="axis0"),
                  pytest.param(1, 1, id="axis1", marks=pytest.mark.slow),
                  pytest.param(0, 2, id="axis0-2-microbatches", marks=pytest.mark.slow)]


def low_bit_muon(layer_axis: int = 0, bits: int = 8, fault=lambda tx: tx
                 ) -> optax.GradientTransformation:
  """Muon with its momentum in ``bits`` bits, and ``fault`` (tests/faults.py) injected into the
  Muon that ``low_bit`` wraps."""
  return optfuse.low_bit(fault(_muon(layer_axis)), bits, min_size=0)  # the matrices are small


def _momentum(state) -> dict:
  return state.inner_states["muon"].inner_state[0].mu


def low_bit_reference(tx, layer_axis: int = 0, steps: int = 20):
  """The unfused low-bit run from the params moved by ``ulps``, as ``(losses, params)``: one
  compile for every start."""
  fx = optfuse.fuse(tx, mode="off")
  step = jax.jit(fx.value_and_update(_loss(layer_axis)), donate_argnums=(0, 1))

  def run(ulps):
    params = models.nudge(decoder_params(layer_axis), ulps)
    return models.run_steps(step, params, fx.init(params), _batches(), steps, jit=False)[:2]

  return run


@pytest.mark.parametrize("layer_axis,bits", [(0, 8), (1, 8), (0, 4)])
def test_describe_puts_the_matrices_of_low_bit_muon_in_their_loop(layer_axis, bits):
  tx = low_bit_muon(layer_axis, bits)
  momentum = _momentum(tx.init(decoder_params(layer_axis)))
  assert all(isinstance(momentum["layers"][name], optfuse.QuantizedSlot) for name in DIMS)
  where = optfuse.describe(tx, _loss(layer_axis), decoder_params(layer_axis), *_batches()[0])
  assert all(where[m] == "loop" for m in MATRICES), where.table()
  norms = ["['layers']['norm1']", "['layers']['norm2']"]
  if layer_axis == 0:
    assert not where.reasons, where.reasons
  else:  # a (d, L) scale's blocks run along L, across the layers
    assert all(where[n] == "tap" for n in norms), where.table()
    assert all("not stacked along the layer axis" in where.reasons[n] for n in norms), where.reasons


def test_low_bit_keeps_muons_newton_schulz_coefficients_as_they_are():
  """``ns_coeffs`` is a hyperparameter, not a statistic: kept in float32 at any ``min_size``,
  even beside a param of its shape (where quantizing it would pass the shape check)."""
  params = {"w": jnp.ones((4, 16, 16)), "coeffs_shaped": jnp.ones((3,))}
  dims = lambda p: {"w": Dims(1, 2), "coeffs_shaped": None}
  inner = optax.contrib.muon(LR, muon_weight_dimension_numbers=dims)
  state = optfuse.low_bit(inner, 8, min_size=0).init(params)
  coeffs = state.inner_states["muon"].inner_state[0].ns_coeffs
  want = inner.init(params).inner_states["muon"].inner_state[0].ns_coeffs
  np.testing.assert_array_equal(np.asarray(coeffs), np.asarray(want))
  assert isinstance(_momentum(state)["w"], optfuse.QuantizedSlot)


def test_backward_fused_4bit_muon_trains_like_the_unfused_4bit_muon():
  tx = low_bit_muon(bits=4)
  got = models.run_fused(tx, "backward", decoder_params(), _batches(), 20, decoder_loss)
  models.assert_same_low_bit_trajectory(got[:2], low_bit_reference(tx), start=decoder_params(),
                                        nudges=MUON_NUDGES)


def test_the_spread_check_rejects_each_error_injected_into_the_backward_fused_4bit_muon():
  """Judged against the spread that passes the fused run
  (test_backward_fused_4bit_muon_trains_like_the_unfused_4bit_muon)."""
  spread = models.reference_spread(low_bit_reference(low_bit_muon(bits=4)), decoder_params(),
                                   MUON_NUDGES)
  for name, fault in muon_faults().items():
    got = models.run_fused(low_bit_muon(bits=4, fault=fault), "backward", decoder_params(),
                           _batches(), 20, decoder_loss)
    models.assert_rejected(got[:2], spread, name)


def _reference_step(layer_axis: int, microbatches: int):
  """8-bit Muon's hand-written optax step: plain optax on the whole batch, or the mean
  gradient of ``microbatches`` (layer axis 0 only)."""
  tx = low_bit_muon(layer_axis)
  if microbatches > 1:
    return optax_microbatched_step(tx, microbatches)
  return models.optax_step(tx, _loss(layer_axis))


@functools.cache
def one_step_reference(layer_axis: int = 0, microbatches: int = 1):
  """20 steps of 8-bit Muon's hand-written optax step taken apart (``models.reference_steps``):
  ``(starts, run, widths)``, the widths measured from the starts moved by an ulp or two
  (criteria.STEP_NUDGES); built once per process."""
  step = _reference_step(layer_axis, microbatches)
  params = decoder_params(layer_axis)
  starts, run = models.reference_steps(step, params, low_bit_muon(layer_axis).init(params),
                                       _batches(), 20)
  nudged = {}
  for ulps in criteria.STEP_NUDGES:
    moved = [(models.nudge(p, ulps), s) for p, s in starts]
    nudged[ulps] = (moved, models.steps_from(step, moved, _batches()))
  return starts, run, criteria.step_widths(nudged, run, starts)


def fused_steps(tx: optax.GradientTransformation, layer_axis: int = 0, microbatches: int = 1):
  """The backward-fused step of ``tx`` from each start of ``one_step_reference``."""
  step = optfuse.fuse(tx, mode="backward").value_and_update(
      _loss(layer_axis), microbatches=None if microbatches == 1 else microbatches)
  return models.steps_from(step, one_step_reference(layer_axis, microbatches)[0], _batches())


@pytest.mark.parametrize("layer_axis,microbatches", ONE_STEP_CASES)
def test_each_backward_fused_step_of_8bit_muon_lands_where_the_optax_step_lands(layer_axis,
                                                                                microbatches):
  starts, want, widths = one_step_reference(layer_axis, microbatches)
  got = fused_steps(low_bit_muon(layer_axis), layer_axis, microbatches)
  criteria.assert_each_step_matches(got, want, starts, widths, bits=8)


@pytest.mark.parametrize("layer_axis,microbatches", ONE_STEP_CASES)
def test_the_one_step_check_rejects_each_error_injected_into_the_backward_fused_8bit_muon(
    layer_axis, microbatches):
  """A learning rate 1 % off and a skipped row move the step's update, a frozen count leaves
  the new state's count behind: each at least criteria.REJECTED_BY times the tolerance."""
  starts, want, widths = one_step_reference(layer_axis, microbatches)
  for name, fault in muon_faults(layer_axis).items():
    got = fused_steps(low_bit_muon(layer_axis, fault=fault), layer_axis, microbatches)
    with pytest.raises(AssertionError):
      criteria.assert_each_step_matches(got, want, starts, widths, bits=8)
    distance, where = criteria.one_step_distance(got, want, starts, widths, bits=8)
    assert distance >= criteria.REJECTED_BY, (name, distance, where)


def test_offloaded_low_bit_muon_momentum_lives_on_the_host_and_trains_like_the_unfused_step():
  tx = low_bit_muon(bits=4)  # 8 bits: too chaotic for the spread check
  fx = optfuse.fuse(tx, mode="backward", offload="state")
  momentum = _momentum(fx.init(decoder_params()))["layers"]
  assert {x.sharding.memory_kind for name in DIMS for x in momentum[name]} == {"pinned_host"}
  got = _run(fx)
  models.assert_same_low_bit_trajectory(got[:2], low_bit_reference(tx), start=decoder_params(),
                                        nudges=MUON_NUDGES)


