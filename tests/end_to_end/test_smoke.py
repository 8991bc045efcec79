"""The public API in one test: a fused step trains like optax."""

import chex
import jax
import jax.numpy as jnp
import optax

import optfuse


def _loss(params, x):
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2)


def test_backward_fusion_matches_optax_adam_over_20_steps():
  key1, key2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"w1": jax.random.normal(key1, (4, 8)), "w2": jax.random.normal(key2, (8, 2))}
  x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
  results = {}
  for mode in ("off", "backward"):
    fx = optfuse.fuse(optax.adam(1e-2), mode=mode)
    p = jax.tree.map(jnp.copy, params)  # the step donates its inputs
    s = fx.init(p)
    step = jax.jit(fx.value_and_update(_loss), donate_argnums=(0, 1))
    for _ in range(20):
      _, p, s = step(p, s, x)
    results[mode] = (p, s)
  # float32: the same operations in the same order, up to XLA fusion differences (few ulps).
  chex.assert_trees_all_close(results["off"], results["backward"], rtol=1e-6, atol=1e-6)
