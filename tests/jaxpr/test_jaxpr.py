"""``_interpreter.shared_scalars``: a training step traces the update's scalar prelude once,
not once per leaf, and never reuses a value across traces."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from optfuse._jaxpr import _interpreter


def _prelude():
  """A jaxpr whose scalar part (``c + 1``, ``0.9 ** (c + 1)``) feeds an array output."""
  def f(c, x):
    t = c + 1.0
    return x * (1.0 - 0.9 ** t)

  return jax.make_jaxpr(f)(1.0, jnp.ones(3)).jaxpr


def _count(jaxpr, name: str) -> int:
  return sum(e.primitive.name == name for e in jaxpr.eqns)


def test_inside_the_block_a_scalar_equation_is_traced_once_per_trace():
  jaxpr = _prelude()

  def twice(c, x):
    return [_interpreter.evaluate(jaxpr, (), [c, x])[0],
            _interpreter.evaluate(jaxpr, (), [c, 2 * x])[0]]

  def in_block(c, x):
    with _interpreter.shared_scalars():
      return twice(c, x)

  outside = jax.make_jaxpr(twice)(1.0, jnp.ones(3)).jaxpr
  inside = jax.make_jaxpr(in_block)(1.0, jnp.ones(3)).jaxpr
  assert _count(outside, "pow") == 2
  assert _count(inside, "pow") == 1
  np.testing.assert_array_equal(jax.jit(in_block)(3.0, jnp.ones(3))[1],
                                jax.jit(twice)(3.0, jnp.ones(3))[1])


def test_a_value_is_never_reused_in_another_trace():
  """A scalar first computed in the outer trace is computed again inside a loop body, which
  cannot read the outer trace's value, and each result is the unshared one."""
  jaxpr = _prelude()

  def f(c, x):
    with _interpreter.shared_scalars():
      outer = _interpreter.evaluate(jaxpr, (), [c, x])[0]
      inner = jax.lax.fori_loop(
          0, 2, lambda i, acc: acc + _interpreter.evaluate(jaxpr, (), [c, x])[0], jnp.zeros(3))
      return outer, inner

  outer, inner = jax.jit(f)(2.0, jnp.ones(3))
  expected = 1.0 - 0.9 ** 3.0
  np.testing.assert_allclose(outer, expected * np.ones(3), rtol=1e-6)
  np.testing.assert_allclose(inner, 2 * expected * np.ones(3), rtol=1e-6)


def test_without_tracers_equations_run_as_they_are():
  jaxpr = _prelude()
  with _interpreter.shared_scalars():
    a = _interpreter.evaluate(jaxpr, (), [jnp.float32(2.0), jnp.ones(3)])[0]
    b = _interpreter.evaluate(jaxpr, (), [jnp.float32(3.0), jnp.ones(3)])[0]
  np.testing.assert_allclose(a, (1.0 - 0.9 ** 3.0) * np.ones(3), rtol=1e-6)
  np.testing.assert_allclose(b, (1.0 - 0.9 ** 4.0) * np.ones(3), rtol=1e-6)


def _mlp_params(n: int = 5):
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  return {f"w{i}": jax.random.normal(k, (8, 8)) / 8 for i, k in enumerate(keys)}


def _mlp_loss(params, x):
  for i in range(len(params)):
    x = jnp.tanh(x @ params[f"w{i}"])
  return jnp.mean(x ** 2)


@pytest.mark.parametrize("mode", ["backward", "forward"])
def test_a_fused_step_traces_adams_bias_corrections_once_like_optax(mode):
  """Five leaves, one ``count``: the fused step's program has optax's number of ``pow``s."""
  tx = optax.adamw(1e-2)
  params, x = _mlp_params(), jnp.ones((4, 8))

  def pows(fx):
    state = fx.init(params)
    text = jax.jit(fx.value_and_update(_mlp_loss)).lower(params, state, x).as_text()
    return text.count("stablehlo.power")

  assert pows(optfuse.fuse(tx, mode=mode)) == pows(optfuse.fuse(tx, mode="off")) > 0
