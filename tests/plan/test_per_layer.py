"""``optfuse.per_layer``: an optimizer applied to each layer of a stacked leaf apart.

On a scanned model, ``per_layer(tx)`` trains the stacked params exactly as plain optax ``tx``
trains the same model unrolled (one leaf per layer): LAMB's and LARS's trust ratios, Adafactor's
block RMS, Muon's matrices and GaLore's SVDs are taken per layer. Its update of row ``l`` reads
only row ``l``, so backward fusion updates every stacked leaf inside its loop (``describe`` says
"loop"), on layers stacked on axis 0 or 1, under Flax Linen's ``nn.scan``, and composed with
clipping, offload and low-bit state. Plain ``tx`` on the stacked leaves differs from the unrolled
model where it takes a statistic of a whole leaf, and ``describe``'s reason for such a leaf names
``per_layer``.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from tests import criteria, faults, models
from tests.engines import test_muon as decoder

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

# Six layers: a loop shorter than 2 + slots rows is not worth updating row by row
# (``RowChecks.min_rows``: four for AdamW's two slots), which would hide the loop this file checks.
LAYERS, DIM, OUT, STEPS = 6, 16, 4, 20
W, B, HEAD = "['layers']['w']", "['layers']['b']", "['head']"

# id -> the inner optimizer; each takes a statistic of a whole leaf but AdamW (the control).
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),  # each layer's (d, d) matrix, b on AdamW
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-1),
    # Each layer's w projected by its own SVD, refreshed every 5 steps (b is not projected).
    "galore": lambda: optax.contrib.galore(1e-2, rank=4, update_proj_gap=5),
}
# The optimizers whose update of a stacked leaf mixes its layers.
WHOLE_LEAF = ("muon", "adafactor", "lamb", "lars", "galore")


def stacked_params(layer_axis: int = 0) -> dict:
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  w = jax.random.normal(k[0], (LAYERS, DIM, DIM)) / np.sqrt(DIM)
  return {"layers": {"w": jnp.moveaxis(w, 0, layer_axis),
                     "b": 0.1 * jax.random.normal(k[1], (LAYERS, DIM))},
          "head": jax.random.normal(k[2], (DIM, OUT)) / np.sqrt(DIM)}


def scanned_loss(params, x, y, layer_axis: int = 0):
  """A tanh MLP whose layers ``lax.scan`` reads from the stacked params, MSE."""
  layers = {"w": jnp.moveaxis(params["layers"]["w"], layer_axis, 0), "b": params["layers"]["b"]}
  h, _ = jax.lax.scan(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), x, layers)
  return jnp.mean((h @ params["head"] - y) ** 2)


def unrolled_loss(params, x, y):
  """The same model unrolled: a list of layers, each its own leaves, run by a Python loop."""
  h = x
  for p in params["layers"]:
    h = jnp.tanh(h @ p["w"] + p["b"])
  return jnp.mean((h @ params["head"] - y) ** 2)


def unrolled(params) -> dict:
  layers = params["layers"]
  return {"layers": [{"w": layers["w"][i], "b": layers["b"][i]} for i in range(LAYERS)],
          "head": params["head"]}


def restacked(params) -> dict:
  return {"layers": jax.tree.map(lambda *rows: jnp.stack(rows), *params["layers"]),
          "head": params["head"]}


def batches() -> list[tuple[jax.Array, jax.Array]]:
  keys = jax.random.split(jax.random.PRNGKey(1), 6)
  return [(jax.random.normal(keys[2 * t], (8, DIM)), jax.random.normal(keys[2 * t + 1], (8, OUT)))
          for t in range(3)]


def trajectory(step, params, state, steps: int = STEPS, jit: bool = True, flush=None) -> tuple:
  """``(losses, params after each step)`` of ``steps`` calls of ``step``, jitted with donation
  unless ``jit=False``; with ``flush(params, state) -> (params, state)`` (forward mode's pending
  update applied), the params it gives."""
  params, state = models.copy(params), models.copy(state)
  if jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  data, losses, after = batches(), [], []
  for t in range(steps):
    loss, params, state = step(params, state, *data[t % len(data)])
    losses.append(loss)
    done = params if flush is None else flush(params, state)[0]
    after.append(jax.tree.map(np.array, done))  # a copy: the next step donates params
  return jnp.stack(losses), after


def fused_run(tx, mode: str = "backward", steps: int = STEPS, jit: bool = True) -> tuple:
  fx = optfuse.fuse(tx, mode=mode)
  params = stacked_params()
  return trajectory(fx.value_and_update(scanned_loss), params, fx.init(params), steps, jit,
                    jax.jit(fx.flush) if jit else fx.flush)


def unrolled_run(tx, steps: int = STEPS) -> tuple:
  """The reference: plain optax on the unrolled model, its params stacked again."""
  params = unrolled(stacked_params())
  losses, after = trajectory(models.optax_step(tx, unrolled_loss), params, tx.init(params), steps)
  return losses, [restacked(p) for p in after]


@functools.cache
def reference(name: str) -> tuple:
  """``unrolled_run`` of ``OPTIMIZERS[name]``, run once for every test that compares with it."""
  return unrolled_run(OPTIMIZERS[name]())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_backward_fused_per_layer_trains_like_optax_on_the_unrolled_model_over_20_steps(name):
  got = fused_run(optfuse.per_layer(OPTIMIZERS[name]()))
  criteria.assert_matches_optax(got, reference(name))


@pytest.mark.parametrize("mode", ["forward", "off"])
@pytest.mark.parametrize("name", [
    "lamb", *(pytest.param(n, marks=pytest.mark.slow) for n in OPTIMIZERS if n != "lamb")])
def test_per_layer_in_forward_and_off_mode_trains_like_optax_on_the_unrolled_model(name, mode):
  got = fused_run(optfuse.per_layer(OPTIMIZERS[name]()), mode)
  criteria.assert_matches_optax(got, reference(name))


def test_backward_fused_per_layer_without_jit_trains_like_optax_on_the_unrolled_model():
  got = fused_run(optfuse.per_layer(optax.lamb(1e-2)), steps=2, jit=False)
  criteria.assert_matches_optax(got, unrolled_run(optax.lamb(1e-2), steps=2))


@pytest.mark.parametrize("name", WHOLE_LEAF)
def test_the_unrolled_model_check_rejects_the_plain_optimizer_on_the_stacked_leaves(name):
  """The control: without ``per_layer`` the statistic spans the layers, and the check fails."""
  got = fused_run(OPTIMIZERS[name]())
  distance, _ = criteria.matches_optax_distance(got, reference(name))
  assert distance > criteria.REJECTED_BY


def unrolled_criterion(name: str) -> criteria.Criterion:
  """The check of ``per_layer(OPTIMIZERS[name]())`` against optax on the unrolled model, on the
  losses and the params after each step (``python -m tests.margins`` prints its margins)."""
  return criteria.Criterion(
      fused=fused_run, tx=lambda: optfuse.per_layer(OPTIMIZERS[name]()),
      reference=lambda: unrolled_run(OPTIMIZERS[name]()), check=criteria.assert_matches_optax,
      distance=criteria.matches_optax_distance, stacked=lambda path: path.startswith("['layers']"))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_unrolled_model_check_rejects_a_learning_rate_1pct_off_and_a_layer_not_updated(name):
  """Each fault fails the check that passes ``per_layer(tx)`` (the test above), by at least
  ``REJECTED_BY`` times its tolerance. Frozen step counts, the third fault of
  ``tests/faults.py``, show in the state, which this check cannot compare (the per-layer state
  is not the unrolled model's); in the params alone LARS reads no count, and LAMB's trust ratio
  cancels most of the bias correction they freeze."""
  found = faults.faults(unrolled_criterion(name).stacked)
  for fault in ("lr_1pct_off", "row_skipped"):
    got = fused_run(found[fault](optfuse.per_layer(OPTIMIZERS[name]())))
    with pytest.raises(AssertionError):
      criteria.assert_matches_optax(got, reference(name))
    distance, _ = criteria.matches_optax_distance(got, reference(name))
    assert distance >= criteria.REJECTED_BY, (fault, distance)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_describe_puts_every_stacked_leaf_of_per_layer_in_its_loop(name):
  where = optfuse.describe(optfuse.per_layer(OPTIMIZERS[name]()), scanned_loss,
                           stacked_params(), *batches()[0])
  assert (where[W], where[B], where[HEAD]) == ("loop", "loop", "tap"), where.table()
  assert not where.reasons and not where.warnings, where.table()


def _clipped_lamb():
  return optax.chain(optax.clip_by_global_norm(1.0), optfuse.per_layer(optax.lamb(1e-2)))


# id -> (tx, fuse's options): per_layer inside the forms the rest of optfuse composes.
COMPOSED = {
    "clipping, two-pass": (_clipped_lamb, dict(global_ops="two_pass")),
    "clipping, forward": (_clipped_lamb, dict(mode="forward")),
    "state in host memory": (lambda: optfuse.per_layer(optax.lamb(1e-2)), dict(offload="state")),
    "8-bit state outside": (lambda: optfuse.low_bit(optfuse.per_layer(optax.adamw(1e-2)), 8,
                                                    min_size=0), {}),
    # vmap of the codes' bit shifts: an unbatched operand keeps a size-1 axis (its row rule).
    "8-bit state inside": (lambda: optfuse.per_layer(optfuse.low_bit(optax.adamw(1e-2), 8,
                                                                     min_size=0)), {}),
}


@pytest.mark.parametrize("case", COMPOSED)
def test_describe_puts_per_layer_in_the_loop_when_composed(case):
  tx, options = COMPOSED[case]
  where = optfuse.describe(optfuse.fuse(tx(), **options), scanned_loss, stacked_params(),
                           *batches()[0])
  assert (where[W], where[B]) == ("loop", "loop"), where.table()


@pytest.mark.parametrize("name", ("adafactor", "lamb", "lars"))
def test_describe_names_per_layer_where_a_whole_leaf_statistic_mixes_the_layers(name):
  where = optfuse.describe(OPTIMIZERS[name](), scanned_loss, stacked_params(), *batches()[0])
  for leaf in (W, B):
    assert where[leaf] == "tap", where.table()
    assert "its update mixes rows" in where.reasons[leaf], where.reasons
    assert "optfuse.per_layer(tx) applies the optimizer to each layer apart" in (
        where.reasons[leaf]), where.reasons


def test_a_layer_axis_of_1_trains_like_the_unrolled_model_inside_the_loop():
  """Flax Linen's ``nn.scan(variable_axes={"params": 1})`` form: w stacked on axis 1."""
  tx = optfuse.per_layer(optax.lamb(1e-2), {"layers": {"w": 1, "b": 0}, "head": None})
  loss = lambda p, x, y: scanned_loss(p, x, y, layer_axis=1)
  params = stacked_params(layer_axis=1)
  where = optfuse.describe(tx, loss, params, *batches()[0])
  assert (where[W], where[B]) == ("loop", "loop"), where.table()
  assert tx.init(params).stacks[0][0].mu["layers"]["w"].shape == (DIM, LAYERS, DIM)
  fx = optfuse.fuse(tx)
  losses, after = trajectory(fx.value_and_update(loss), params, fx.init(params))
  after = [dict(p, layers=dict(p["layers"], w=np.moveaxis(p["layers"]["w"], 1, 0)))
           for p in after]
  criteria.assert_matches_optax((losses, after), unrolled_run(optax.lamb(1e-2)))


def test_the_default_layer_axes_stack_the_leaves_under_layers_on_axis_0():
  state = optfuse.per_layer(optax.adam(1e-2)).init(stacked_params())
  (adam, _), rest = state.stacks[0], state.rest[0]
  assert adam.count.shape == (LAYERS,)  # one step count per layer, all equal
  assert adam.mu["layers"]["w"].shape == (LAYERS, DIM, DIM)
  assert isinstance(adam.mu["head"], optax.MaskedNode)
  assert rest.count.shape == () and rest.mu["head"].shape == (DIM, OUT)
  assert isinstance(rest.mu["layers"]["w"], optax.MaskedNode)


def test_stacks_of_different_lengths_get_one_state_each():
  params = {"encoder": jnp.ones((3, 4, 4)), "decoder": jnp.ones((5, 4, 4))}
  tx = optfuse.per_layer(optax.lamb(1e-2), layer_axes=0)
  state = tx.init(params)
  assert [s[0].count.shape for s in state.stacks] == [(3,), (5,)]
  assert isinstance(state.rest, optax.EmptyState)
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  want = optax.lamb(1e-2).update({"x": jnp.ones((4, 4))}, optax.lamb(1e-2).init(
      {"x": jnp.ones((4, 4))}), {"x": jnp.ones((4, 4))})[0]["x"]
  for leaf in updates.values():
    criteria.assert_matches_optax(leaf, jnp.broadcast_to(want, leaf.shape))


def test_layer_axes_may_be_a_prefix_holding_lists_and_none_subtrees():
  params = {"stacks": [jnp.ones((3, 4, 4)), jnp.ones((4, 3))], "head": jnp.ones((4,)),
            "none": None}
  state = optfuse.per_layer(optax.adam(1e-2), {"stacks": [0, 1], "head": None,
                                               "none": None}).init(params)
  assert [s[0].count.shape for s in state.stacks] == [(3,)]
  assert state.stacks[0][0].mu["stacks"][1].shape == (4, 3)  # stacked on its axis 1
  assert state.rest[0].mu["head"].shape == (4,)


def test_layer_axes_may_be_a_function_of_the_params():
  tx = optfuse.per_layer(optax.lamb(1e-2), lambda p: jax.tree.map(
      lambda x: 0 if x.ndim >= 2 and x.shape[0] == LAYERS else None, p))
  where = optfuse.describe(tx, scanned_loss, stacked_params(), *batches()[0])
  assert (where[W], where[B]) == ("loop", "loop"), where.table()


@pytest.mark.parametrize("layer_axes, match", [
    ({"layers": 0}, "not a pytree prefix"),
    ({"layers": {"w": 3, "b": 0}, "head": None}, "out of its range"),
    ({"layers": "0", "head": None}, "an axis is an int"),
])
def test_layer_axes_that_do_not_fit_the_params_raise_layer_axes_error(layer_axes, match):
  with pytest.raises(optfuse.LayerAxesError, match=match):
    optfuse.per_layer(optax.adam(1e-2), layer_axes).init(stacked_params())


# Muon under per_layer, on the scanned decoder of test_muon.py: attention's (d, heads, head_dim)
# weights are rank 3 in each layer, which Muon's default leaves to AdamW; stacked_muon_dims with
# no leaf stacked numbers one layer's axes (input first, heads and head_dim the output).
ONE_LAYERS_DIMS = functools.partial(optfuse.stacked_muon_dims, stacked=lambda names, leaf: False)


def _decoder_muon(dims=ONE_LAYERS_DIMS):
  return optax.contrib.muon(decoder.LR, muon_weight_dimension_numbers=dims)


def test_describe_puts_every_matrix_of_the_decoder_in_its_loop_under_per_layer_muon():
  where = optfuse.describe(optfuse.per_layer(_decoder_muon()), decoder.decoder_loss,
                           decoder.decoder_params(), *decoder._batches()[0])
  assert all(where[path] == "loop" for path in where if path.startswith("['layers']")), (
      where.table())
  assert not where.reasons and not where.warnings, where.table()


def test_describe_warns_of_per_layer_muon_leaving_a_layers_rank_3_leaf_to_adamw():
  where = optfuse.describe(optfuse.per_layer(_decoder_muon(None)), decoder.decoder_loss,
                           decoder.decoder_params(), *decoder._batches()[0])
  for name in ("wq", "wk", "wv", "wo"):
    warning = where.warnings[f"['layers']['{name}']"]
    assert "AdamW fallback" in warning and "one layer's axes" in warning, warning
    assert "stacked=lambda names, leaf: False" in warning, warning


def _unrolled_decoder_loss(params, tokens, targets):
  h = params["embed"][tokens]
  for layer in params["layers"]:
    h, _ = decoder._block(h, layer)
  logits = decoder._rms(h, params["final_norm"]) @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.slow
def test_per_layer_muon_trains_the_decoder_like_optax_on_the_unrolled_decoder_over_10_steps():
  """And like optax's Muon on the stacked decoder with ``stacked_muon_dims``: the layer axis a
  batch axis of each matrix is the same math."""
  params, data = decoder.decoder_params(), decoder._batches()
  layers = params["layers"]
  count = len(jax.tree.leaves(layers)[0])
  unrolled_params = dict(params, layers=[jax.tree.map(lambda x, i=i: x[i], layers)
                                         for i in range(count)])
  got = models.run_fused(optfuse.per_layer(_decoder_muon()), "backward", params, data, 10,
                         decoder.decoder_loss)
  want = models.run_optax(_decoder_muon(), unrolled_params, data, 10, _unrolled_decoder_loss)
  stacked = dict(want[1], layers=jax.tree.map(lambda *rows: jnp.stack(rows), *want[1]["layers"]))
  criteria.assert_matches_optax(got[:2], (want[0], stacked))
  stacked_dims = _decoder_muon(optfuse.stacked_muon_dims)
  criteria.assert_matches_optax(got[:2], models.run_optax(stacked_dims, params, data, 10,
                                                          decoder.decoder_loss)[:2])


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(DIM)(x)), None


class LinenStack(nn.Module):
  """Flax Linen's ``nn.scan`` over six blocks, the layers of its params on ``layer_axis``."""
  layer_axis: int = 0

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(Block, variable_axes={"params": self.layer_axis},
                   split_rngs={"params": True}, length=LAYERS)
    return nn.Dense(OUT)(scan()(x, None)[0])


@pytest.mark.parametrize("layer_axis", [0, 1])
def test_a_linen_scan_is_updated_per_layer_inside_its_loop(layer_axis):
  """The default finds ``nn.scan``'s ``ScanBlock_0`` on axis 0; on axis 1 a prefix says so."""
  model, (x, y) = LinenStack(layer_axis), batches()[0]
  params = model.init(jax.random.PRNGKey(0), x)
  layer_axes = None if layer_axis == 0 else {"params": {"ScanBlock_0": 1, "Dense_0": None}}
  tx = optfuse.per_layer(optax.lamb(1e-2), layer_axes)
  loss = lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2)
  where = optfuse.describe(tx, loss, params, x, y)
  scanned = [path for path in where if "ScanBlock_0" in path]
  assert scanned and all(where[path] == "loop" for path in scanned), where.table()
  assert not where.reasons, where.table()
