"""Property: for any params tree and any separable optax chain, every mode trains like optax.

Hypothesis draws the params tree (nested dicts, lists and tuples, ``None`` leaves, scalars and
zero-size arrays, leaves the loss never reads) and a chain of one to three transforms from a
catalog of separable ones; the chain ends with a learning rate. Each mode trains 50 steps inside
one ``lax.scan`` (one compile per mode) and must end where plain optax ends.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optfuse

MODES = ("backward", "forward", "off")
STEPS = 50

# Per-leaf transforms: each leaf's update reads only that leaf's gradient, state and param.
CATALOG = {
    "adam": lambda: optax.scale_by_adam(),
    "rms": lambda: optax.scale_by_rms(),
    "belief": lambda: optax.scale_by_belief(),
    "amsgrad": lambda: optax.scale_by_amsgrad(),
    "momentum": lambda: optax.trace(decay=0.9),
    "nesterov": lambda: optax.trace(decay=0.9, nesterov=True),
    "ema": lambda: optax.ema(decay=0.9),
    "clip": lambda: optax.clip(0.5),
    "clip_block_rms": lambda: optax.clip_by_block_rms(0.5),
    "weight_decay": lambda: optax.add_decayed_weights(1e-2),
    "schedule": lambda: optax.scale_by_schedule(optax.cosine_decay_schedule(1.0, STEPS)),
    "trust_ratio": lambda: optax.scale_by_trust_ratio(),
    "injected_adamw": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1.0),
}



@dataclasses.dataclass(frozen=True)
class Shape:
  """A drawn leaf (not a pytree node, unlike the tuples that are containers here)."""

  dims: tuple[int, ...]


SHAPES = [Shape(s) for s in [(), (0,), (3,), (2, 3), (1, 0, 2), (4, 1)]]
LEAF = st.one_of(st.none(), st.sampled_from(SHAPES))
TREES = st.recursive(
    LEAF,
    lambda children: st.one_of(
        st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple)),
    max_leaves=6)


def _materialise(tree, seed: int):
  """Arrays of the drawn shapes, with values fixed by ``seed``; ``None`` stays ``None``."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda leaf: jnp.asarray(rng.normal(size=leaf.dims), jnp.float32), tree)


def _make_loss(params, used: list[bool]):
  """A smooth loss reading the ``used`` leaves; each is weighted by the first used scalar sum."""
  def loss(params, x):
    leaves = [leaf for leaf, u in zip(jax.tree.leaves(params), used) if u]
    terms = [jnp.sum(jnp.sin(leaf * x) ** 2) for leaf in leaves]
    coupling = 1.0 + 0.1 * jnp.tanh(jnp.sum(leaves[0])) if leaves else 1.0
    return coupling * sum(terms, jnp.zeros((), jnp.float32))

  return loss


def _train(run_step, init, params, xs):
  def body(carry, x):
    params, state = carry
    _, params, state = run_step(params, state, x)
    return (params, state), None

  (params, state), _ = jax.lax.scan(body, (params, init(params)), xs)
  return params, state


def _optax(tx, loss):
  def step(params, state, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return value, optax.apply_updates(params, updates), state

  return step


def _assert_every_mode_trains_like_optax(params, tx, loss) -> None:
  xs = jnp.linspace(0.5, 1.5, STEPS)
  want = jax.jit(lambda p: _train(_optax(tx, loss), tx.init, p, xs))(params)
  for mode in MODES:
    fx = optfuse.fuse(tx, mode)

    def run(p, fx=fx):
      params, state = _train(fx.value_and_update(loss), fx.init, p, xs)
      params, state = fx.flush(params, state)
      return params, state.opt_state if fx.mode == "forward" else state

    got = jax.jit(run)(params)
    # float32, the same operations per leaf; XLA may fuse them differently, a few ulps per
    # step that the chain carries through 50 steps.
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6, custom_message=f"mode={mode}")


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(tree=TREES, names=st.lists(st.sampled_from(sorted(CATALOG)), min_size=1, max_size=3),
       used=st.lists(st.booleans(), min_size=6, max_size=6), seed=st.integers(0, 2**16))
def test_every_mode_trains_like_optax_on_random_trees_and_separable_chains(tree, names, used,
                                                                          seed):
  params = _materialise(tree, seed)
  tx = optax.chain(*(CATALOG[name]() for name in names), optax.scale_by_learning_rate(1e-2))
  _assert_every_mode_trains_like_optax(params, tx, _make_loss(params, used))


def test_every_mode_trains_like_optax_with_the_whole_catalog_chained():
  # The draws above are few and fixed (derandomized); this covers every entry deterministically.
  tree = {"scalar": Shape(()), "empty": Shape((0,)), "layers": [Shape((2, 3)), None, Shape((3,))],
          "unused": Shape((4, 1))}
  params = _materialise(tree, seed=0)
  tx = optax.chain(*(make() for make in CATALOG.values()), optax.scale_by_learning_rate(1e-2))
  _assert_every_mode_trains_like_optax(params, tx, _make_loss(params, [True] * 4 + [False]))


def test_catalog_is_separable_so_backward_mode_accepts_every_entry():
  params = {"w": jnp.ones((2, 3)), "b": jnp.ones((3,))}
  for name, make in CATALOG.items():
    try:
      optfuse.check_separable(make(), params)
    except optfuse.NonSeparableError as e:
      pytest.fail(f"{name}: {e}")
