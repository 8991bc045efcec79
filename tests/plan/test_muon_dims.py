"""``optfuse.stacked_muon_dims`` and ``describe``'s warnings about Muon on stacked layers.

The helper numbers the decoder of ``test_muon.py`` as its hand-written dimension numbers do
(layer axis 0 and MaxText's 1), from arrays, abstract params and Flax param trees; with it every
stacked matrix is updated in its loop and backward-fused Muon trains like optax's. Without it
``describe`` names the stacked leaves Muon leaves to AdamW or orthogonalises across layers.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers as Dims

import optfuse
from tests import criteria, models
from tests.engines import test_muon as decoder

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

LAYERS = ["['layers']['norm1']", "['layers']['norm2']", *decoder.MATRICES]


def _tuples(dims):
  """Dimension numbers with every side a tuple (``1`` and ``(1,)`` number the same axes)."""
  side = lambda axes: (axes,) if isinstance(axes, int) else tuple(axes)
  return jax.tree.map(lambda d: d if d is None else Dims(side(d[0]), side(d[1])), dims,
                      is_leaf=lambda d: d is None or isinstance(d, Dims))


def _dims(layer_axis: int):
  return functools.partial(optfuse.stacked_muon_dims, layer_axis=layer_axis)


@pytest.mark.parametrize("layer_axis", [0, 1])
def test_stacked_muon_dims_equal_the_hand_written_dims_of_the_decoder(layer_axis):
  params = decoder.decoder_params(layer_axis)
  want = _tuples(decoder.muon_dims(layer_axis)(params))
  assert _tuples(optfuse.stacked_muon_dims(params, layer_axis=layer_axis)) == want
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  assert _tuples(optfuse.stacked_muon_dims(abstract, layer_axis=layer_axis)) == want


def test_an_axis_alone_is_an_int_as_one_writes_it_by_hand():
  dims = optfuse.stacked_muon_dims(decoder.decoder_params())["layers"]
  assert {name: dims[name] for name in decoder.DIMS} == decoder.DIMS


@pytest.mark.parametrize("layer_axis", [0, 1])
def test_describe_with_stacked_muon_dims_puts_every_stacked_leaf_in_its_loop(layer_axis):
  tx = optax.contrib.muon(decoder.LR, muon_weight_dimension_numbers=_dims(layer_axis))
  where = optfuse.describe(tx, decoder._loss(layer_axis), decoder.decoder_params(layer_axis),
                           *decoder._batches()[0])
  assert all(where[path] == "loop" for path in LAYERS), where.table()
  assert not where.reasons and not where.warnings, where.table()


@pytest.mark.parametrize("layer_axis", [0, 1])
def test_backward_fused_muon_with_stacked_muon_dims_trains_like_optax_over_10_steps(layer_axis):
  params, loss = decoder.decoder_params(layer_axis), decoder._loss(layer_axis)
  tx = lambda: optax.contrib.muon(decoder.LR, muon_weight_dimension_numbers=_dims(layer_axis))
  got = models.run_fused(tx(), "backward", params, decoder._batches(), 10, loss)
  want = models.run_optax(tx(), params, decoder._batches(), 10, loss)
  criteria.assert_matches_optax(got[:2], want[:2])


def test_describe_warns_of_muon_without_dims_on_the_stacked_decoder_naming_each_leaf():
  where = optfuse.describe(optax.contrib.muon(decoder.LR), decoder.decoder_loss,
                           decoder.decoder_params(), *decoder._batches()[0])
  assert sorted(where.warnings) == sorted(LAYERS), where.table()
  for path in decoder.MATRICES:  # rank 3 and 4: on AdamW, in the loop
    assert where[path] == "loop" and "AdamW fallback" in where.warnings[path]
  for path in LAYERS[:2]:  # (L, d) norm scales: orthogonalised across layers, after the loop
    assert where[path] == "tap" and "mixes the layers" in where.warnings[path]
  assert all("optfuse.stacked_muon_dims" in why for why in where.warnings.values())
  assert "warning: Muon" in where.table()


def test_describe_warns_of_a_layer_axis_among_muons_matrix_axes():
  dims = lambda p: {**optfuse.stacked_muon_dims(p), "layers": {
      **optfuse.stacked_muon_dims(p)["layers"], "w1": Dims((0, 1), 2)}}
  tx = optax.contrib.muon(decoder.LR, muon_weight_dimension_numbers=dims)
  where = optfuse.describe(tx, decoder.decoder_loss, decoder.decoder_params(),
                           *decoder._batches()[0])
  assert list(where.warnings) == ["['layers']['w1']"], where.table()


def test_describe_warns_when_the_helpers_default_would_not_find_the_stack():
  params = decoder.decoder_params()
  params = {**params, "h": params.pop("layers")}
  loss = lambda p, *batch: decoder.decoder_loss({**p, "layers": p["h"]}, *batch)
  where = optfuse.describe(optax.contrib.muon(decoder.LR), loss, params, *decoder._batches()[0])
  assert "stacked=" in where.warnings["['h']['w1']"], where.table()


def test_describe_has_no_warning_for_optimizers_other_than_muon():
  where = optfuse.describe(optax.adamw(decoder.LR), decoder.decoder_loss,
                           decoder.decoder_params(), *decoder._batches()[0])
  assert where.warnings == {}


def test_maxtexts_scanned_decoder_gets_the_dims_of_maxtexts_own_rules():
  """MaxText's Linen names, layers on axis 1; its ``muon_utils.transform_logic`` gives the query
  ``(0,), (-2, -1)``, the output ``(0, -2), (-1,)``, the MLP ``(0,), (-1,)`` and excludes
  scales, embeddings and ``logits_dense``."""
  d, L, heads, head_dim, ff, vocab = 16, 4, 2, 8, 32, 64
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  layers = {"self_attention": {"query": {"kernel": spec(d, L, heads, head_dim)},
                               "out": {"kernel": spec(heads, L, head_dim, d)}},
            "mlp": {"wi_0": {"kernel": spec(d, L, ff)}, "wo": {"kernel": spec(ff, L, d)}},
            "pre_self_attention_layer_norm": {"scale": spec(d, L)}}
  params = {"params": {"decoder": {"layers": layers, "decoder_norm": {"scale": spec(d)},
                                   "logits_dense": {"kernel": spec(d, vocab)}},
                       "token_embedder": {"embedding": spec(vocab, d)}}}
  dims = optfuse.stacked_muon_dims(params, layer_axis=1)["params"]
  assert dims["decoder"]["layers"] == {
      "self_attention": {"query": {"kernel": Dims(0, (2, 3))},
                         "out": {"kernel": Dims((0, 2), 3)}},
      "mlp": {"wi_0": {"kernel": Dims(0, 2)}, "wo": {"kernel": Dims(0, 2)}},
      "pre_self_attention_layer_norm": {"scale": None}}
  assert dims["decoder"]["logits_dense"] == {"kernel": None}
  assert dims["decoder"]["decoder_norm"] == {"scale": None}
  assert dims["token_embedder"] == {"embedding": None}


def test_experts_stay_a_batch_axis_under_a_mixture_of_experts():
  params = {"layers": {"moe": {"wi": jnp.zeros((4, 3, 8, 16)), "wo": jnp.zeros((4, 3, 16, 8)),
                               "gate": jnp.zeros((4, 8, 3))}}}
  assert optfuse.stacked_muon_dims(params)["layers"]["moe"] == {
      "wi": Dims(2, 3), "wo": Dims(2, 3), "gate": Dims(1, 2)}


def test_the_rules_can_be_replaced():
  params = {"blocks": {"experts": jnp.zeros((4, 3, 8, 16)), "gate": jnp.zeros((4, 8, 3))},
            "proj": jnp.zeros((8, 2, 4)), "wte": jnp.zeros((50, 8))}
  experts = lambda names, shape: Dims(1, 2) if "experts" in names else Dims(0, 1)
  dims = optfuse.stacked_muon_dims(params, matrix=experts, exclude=lambda n, x: "wte" in n,
                                   stacked=lambda names, x: "blocks" in names)
  assert dims == {"blocks": {"experts": Dims(2, 3), "gate": Dims(1, 2)},
                  "proj": Dims(0, 1), "wte": None}


def test_flax_param_trees_linen_scan_and_nnx_state():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.LayerNorm()(nn.Dense(8)(x)), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
      return scan()(x, None)[0]

  linen = jax.eval_shape(Stack().init, jax.random.PRNGKey(0), jnp.ones((2, 8)))
  block = optfuse.stacked_muon_dims(linen)["params"]["ScanBlock_0"]
  assert block == {"Dense_0": {"bias": None, "kernel": Dims(1, 2)},
                   "LayerNorm_0": {"bias": None, "scale": None}}

  class Layer(nnx.Module):
    def __init__(self, rngs):
      self.linear, self.norm = nnx.Linear(8, 8, rngs=rngs), nnx.RMSNorm(8, rngs=rngs)

  class Model(nnx.Module):
    def __init__(self):
      self.layers = nnx.vmap(Layer)(nnx.Rngs(0).fork(split=3))

  state = nnx.state(Model(), nnx.Param)
  tx = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=optfuse.stacked_muon_dims)
  updates, _ = tx.update(state, tx.init(state), state)
  dims = optfuse.stacked_muon_dims(state)
  assert dims["layers"]["linear"]["kernel"].value == Dims(1, 2)
  assert dims["layers"]["norm"]["scale"].value is None
  assert jax.tree.structure(updates) == jax.tree.structure(state)


def test_a_layer_axis_out_of_range_raises_naming_the_leaf():
  with pytest.raises(optfuse.MuonDimsError, match=r"layer_axis=2 .*\['layers'\]\['norm1'\]"):
    optfuse.stacked_muon_dims(decoder.decoder_params(), layer_axis=2)


@pytest.mark.parametrize("rule", [Dims(0, 2), Dims(0, 0), Dims((), 1)],
                         ids=["out_of_range", "on_both_sides", "empty_side"])
def test_a_matrix_rule_that_is_not_a_layers_matrix_raises_naming_the_leaf(rule):
  params = {"layers": {"w": jnp.zeros((4, 8, 16))}}
  with pytest.raises(optfuse.MuonDimsError, match=r"\['layers'\]\['w'\].*not a matrix"):
    optfuse.stacked_muon_dims(params, matrix=lambda names, shape: rule)
