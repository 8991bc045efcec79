"""``optfuse.low_bit`` as a plain optax transformation: its state, its update, its refusals."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from optfuse._low_bit import _blocks, _maps


def _params():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"w": jax.random.normal(k[0], (4, 2048)), "v": jax.random.normal(k[1], (8192,)),
          "small": jax.random.normal(k[2], (16, 16)), "steps": jnp.zeros((3,), jnp.int32)}


def _grads(params, seed):
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4))
  return jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape) if p.dtype == jnp.float32
                      else jnp.zeros_like(p), params)


def test_adam_slots_become_codes_and_scales_and_the_rest_stays_as_adam_keeps_it():
  params = _params()
  state = optfuse.low_bit(optax.adam(1e-3), bits=8).init(params)
  adam = state[0]
  assert adam.count.dtype == jnp.int32
  for slot in (adam.mu, adam.nu):
    assert isinstance(slot["w"], optfuse.QuantizedSlot)
    assert slot["w"].codes.shape == (4, 512) and slot["w"].scales.shape == (4, 8)
    assert slot["v"].codes.shape == (2048,) and slot["v"].scales.shape == (32,)
    # Fewer than 4096 elements (bitsandbytes' min_8bit_size) or not float: as adam keeps them.
    assert slot["small"].shape == (16, 16) and slot["small"].dtype == jnp.float32
    assert slot["steps"].shape == (3,)


@pytest.mark.parametrize("bits,bytes_per_value", [(8, 1 + 4 / 256), (4, 0.5 + 4 / 128)])
def test_a_slot_costs_its_bits_and_one_float32_scale_a_block(bits, bytes_per_value):
  params = {"w": jnp.zeros((16, 4096))}
  state = optfuse.low_bit(optax.adam(1e-3), bits=bits).init(params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state[0].mu))
  assert nbytes == 16 * 4096 * bytes_per_value


@pytest.mark.parametrize("bits", [8, 4])
def test_an_update_is_the_inner_update_of_the_dequantized_state_requantized(bits):
  params = _params()
  tx = optfuse.low_bit(optax.adamw(1e-3, weight_decay=0.1), bits=bits)
  state = tx.init(params)
  for t in range(3):
    state = jax.jit(tx.update)(_grads(params, t), state, params)[1]
  block = _maps.DEFAULT_BLOCK_SIZE[bits]
  unsigned = {"mu": False, "nu": True}

  def dequantized(name, slot):
    scheme = _maps.scheme(bits, not unsigned[name])
    return {k: _blocks.dequantize(v.codes, v.scales, scheme, block, params[k].shape[-1])
            if isinstance(v, optfuse.QuantizedSlot) else v for k, v in slot.items()}

  adam = state[0]
  plain = (adam._replace(mu=dequantized("mu", adam.mu), nu=dequantized("nu", adam.nu)),
           *state[1:])
  grads = _grads(params, 7)
  # Both compiled (low_bit runs compiled outside jit too): XLA's fusion of Adam's arithmetic
  # rounds as it likes, the same for both.
  want_updates, want_state = jax.jit(optax.adamw(1e-3, weight_decay=0.1).update)(
      grads, plain, params)
  got_updates, got_state = tx.update(grads, state, params)
  chex.assert_trees_all_equal(got_updates, want_updates)
  mu = want_state[0].mu["w"]
  want_codes, want_scales = _blocks.quantize(mu, _maps.scheme(bits, True), block)
  np.testing.assert_array_equal(got_state[0].mu["w"].codes, want_codes)
  np.testing.assert_array_equal(got_state[0].mu["w"].scales, want_scales)


def test_called_outside_jit_init_and_update_run_compiled_and_equal_their_jitted_selves():
  """Op by op, quantizing a slot would make a dozen arrays of its size in turn; outside a
  trace ``low_bit`` traces its init and update (the inner transformation sees tracers) and
  runs them compiled, with the jitted result bit for bit. Extra args take the traced path."""
  seen = []
  adamw = optax.adamw(1e-3)

  def init(params):
    seen.append(all(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)))
    return adamw.init(params)

  tx = optfuse.low_bit(optax.GradientTransformation(init, adamw.update), bits=8)
  params = _params()
  state = tx.init(params)
  assert seen and all(seen)  # traced (jax.eval_shape of the plan, then the compiled init)
  jitted = jax.jit(tx.init)(params)
  chex.assert_trees_all_equal(state, jitted)
  grads = _grads(params, 0)
  chex.assert_trees_all_equal(tx.update(grads, state, params), jax.jit(tx.update)(grads, jitted,
                                                                                   params))
  calls = []
  extra = optax.GradientTransformationExtraArgs(
      adamw.init, lambda u, s, p=None, **kw: (calls.append(sorted(kw)), adamw.update(u, s, p))[1])
  low = optfuse.low_bit(extra, bits=8)
  low.update(grads, low.init(params), params, value=jnp.float32(1.0))
  assert calls == [["value"]]


@pytest.mark.parametrize("bits", [8, 4])
def test_a_compiled_init_quantizes_its_zeros_at_run_time_not_by_constant_folding(bits):
  """An init's slots are constants, and XLA would fold their quantization at compile time
  (25 s for one (8, 1024, 512) leaf on CPU): in the compiled init the codes and scales are
  computed, not broadcast from a folded constant."""
  tx = optfuse.low_bit(optax.adamw(1e-3), bits=bits)
  params = {"w": jax.ShapeDtypeStruct((4, 512, 512), jnp.float32)}
  slot = jax.eval_shape(tx.init, params)[0].mu["w"]
  hlo = jax.jit(tx.init).lower(params).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]  # the program's own instructions, not fusions' insides
  for part in (slot.codes, slot.scales):
    shape = re.escape("f32[" + ",".join(map(str, part.shape)) + "]")
    # Folded, a slot's codes or scales are a broadcast of one constant: nothing else.
    folded = shape + r"\{[^}]*\} (fusion|broadcast)\(%constant[.\d]*\)"
    assert not re.search(folded, entry), part.shape


def test_8_bit_adamw_follows_float32_adamw_closely_over_20_steps():
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 1024))}
  target = jax.random.normal(jax.random.PRNGKey(1), (8, 1024))
  loss = lambda p: jnp.mean((p["w"] - target) ** 2)

  def train(tx):
    state, p = tx.init(params), params
    for _ in range(20):
      updates, state = tx.update(jax.grad(loss)(p), state, p)
      p = optax.apply_updates(p, updates)
    return p["w"]

  exact = train(optax.adamw(1e-2))
  low = train(optfuse.low_bit(optax.adamw(1e-2), bits=8))
  moved = jnp.abs(exact - params["w"]).mean()
  # A sanity bound, not the quality study: the moments' 8-bit rounding moves the weights by
  # 2.2 % of their mean movement here (measured); 5 % leaves room for XLA's reassociations.
  assert jnp.abs(low - exact).mean() < 0.05 * moved


def test_the_slot_map_chooses_the_map_of_each_slot_or_keeps_it():
  params = {"w": jnp.ones((4, 2048))}
  keep_nu = lambda path, slot: None if ".nu" in path else "signed"
  state = optfuse.low_bit(optax.adam(1e-3), slot_map=keep_nu).init(params)
  assert isinstance(state[0].mu["w"], optfuse.QuantizedSlot)
  assert state[0].nu["w"].shape == (4, 2048)
  assert optfuse.low_bit.__doc__ and "References" in optfuse.low_bit.__doc__


def test_min_size_zero_quantizes_every_float_slot_but_scalars():
  params = {"w": jnp.ones((3, 5))}
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2, momentum=0.9)
  state = optfuse.low_bit(tx, bits=4, min_size=0).init(params)
  trace = state.inner_state[0].trace["w"]
  assert trace.codes.shape == (3, 1) and trace.scales.shape == (3, 1)  # 5 values: 8 codes, a word
  assert state.hyperparams["learning_rate"].shape == ()


def test_hyperparameters_in_the_state_are_kept_as_they_are_at_any_size():
  """An array hyperparameter shaped like a param (here a per-column learning rate) would pass
  the shape check: the default slot map keeps it, as it keeps Muon's ``ns_coeffs``
  (tests/engines/test_muon.py)."""
  params = {"w": jnp.ones((3, 5)), "b": jnp.ones((5,))}
  rate = jnp.linspace(1e-3, 1e-2, 5)
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=rate, momentum=0.9)
  state = optfuse.low_bit(tx, bits=8, min_size=0).init(params)
  np.testing.assert_array_equal(np.asarray(state.hyperparams["learning_rate"]), np.asarray(rate))
  assert isinstance(state.inner_state[0].trace["b"], optfuse.QuantizedSlot)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=3), "bits=8 or bits=4"),
    (dict(bits=16), "bits=8 or bits=4"),
    (dict(block_size=100), "multiple of 8"),
    (dict(block_size=0), "multiple of 8"),
    (dict(min_size=-1), "min_size"),
])
def test_bad_arguments_raise_low_bit_error(kwargs, match):
  with pytest.raises(optfuse.LowBitError, match=match):
    optfuse.low_bit(optax.adam(1e-3), **kwargs)


def test_a_slot_map_answer_other_than_signed_unsigned_or_none_is_refused():
  tx = optfuse.low_bit(optax.adam(1e-3), slot_map=lambda path, slot: "linear")
  with pytest.raises(optfuse.LowBitError, match='"signed", "unsigned" or None'):
    tx.init({"w": jnp.ones((4, 2048))})


def test_a_factored_slot_is_refused_and_the_error_says_what_to_do():
  tx = optfuse.low_bit(optax.adafactor(1e-3, min_dim_size_to_factor=8), min_size=0)
  with pytest.raises(optfuse.LowBitError, match=r"shaped like no parameter.*slot_map"):
    tx.init({"w": jnp.ones((64, 128))})
