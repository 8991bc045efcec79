"""Preconditioned optimizers on stacked leaves: Shampoo-like Kronecker factors and a PSGD-like
preconditioner fitted on random probes, updated layer by layer inside the backward loop.

Both test optimizers are written for a stacked (L, m, n) leaf as optax code would be written on
it: batched over the leading axes (``einsum``, ``@`` and ``jnp.linalg.eigh`` broadcast over
them), so that layer ``l``'s update reads only layer ``l``. Their state is per layer with other
axes than the param's ((L, m, m), (L, n, n)); the row check takes it, and the row evaluator runs
``eigh``, the Newton iteration's ``fori_loop`` and the ``lax.cond`` that recomputes the inverse
roots every few steps on one layer. PSGD's probes (and ``optax.add_noise``'s noise, trained here
too) are drawn from one key for the whole stacked leaf; inside the loop each layer's numbers are
drawn alone, the same numbers as that layer's slice of the whole draw, which holds under
``jax_threefry_partitionable`` (JAX's default); without it the leaf is updated after the loop,
and ``describe`` says to set the flag (``tests/jaxpr/test_draws.py`` checks the draws alone).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import optfuse
from tests import criteria, faults, models

pytestmark = pytest.mark.equivalence  # CI runs these again under another ISA

LAYERS, DIM, STEPS = 6, 16, 20
LR = 1e-2
W, B = "['layers']['w']", "['layers']['b']"


def _eye(x, n: int) -> jax.Array:
  """Identity matrices of size ``n``, one per matrix of ``x``'s leading axes."""
  return jnp.broadcast_to(jnp.eye(n, dtype=x.dtype), x.shape[:-2] + (n, n))


def _transpose(x) -> jax.Array:
  return jnp.swapaxes(x, -1, -2)


def _frobenius(x) -> jax.Array:
  return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def _damped(a, eps: float) -> jax.Array:
  """``a + eps mean(eig(a)) I``: every eigenvalue of the PSD ``a`` raised above ``eps`` times
  their mean, which bounds the condition number of its roots."""
  n = a.shape[-1]
  return a + (eps * jnp.einsum("...ii->...", a)[..., None, None] / n + 1e-30) * _eye(a, n)


def _eigh_inverse_fourth_root(a, eps: float) -> jax.Array:
  """The damped ``a``'s inverse fourth root by its eigendecomposition."""
  w, v = jnp.linalg.eigh(_damped(a, eps))
  return jnp.einsum("...ij,...j,...kj->...ik", v, w ** -0.25, v)


def _newton_inverse_fourth_root(a, eps: float, iterations: int = 15) -> jax.Array:
  """The damped ``a``'s inverse fourth root by the coupled Newton iteration (as Distributed
  Shampoo computes it): matrix products only, a smooth function of ``a``."""
  p, a = 4, _damped(a, eps)
  eye = _eye(a, a.shape[-1])
  z = (1 + p) / (2 * _frobenius(a))  # ||a||_F bounds the largest eigenvalue

  def step(_, xm):
    x, m = xm
    mi = (1 + 1 / p) * eye - m / p
    return x @ mi, jnp.linalg.matrix_power(mi, p) @ m

  return lax.fori_loop(0, iterations, step, (z ** (1 / p) * eye, z * a))[0]


class ShampooState(NamedTuple):
  count: jax.Array
  left: optax.Params       # sum of beta^t G G^T per matrix, (..., m, m)
  right: optax.Params      # sum of beta^t G^T G per matrix, (..., n, n)
  left_root: optax.Params  # left^(-1/4), recomputed every ``every`` steps
  right_root: optax.Params


ROOTS = {"eigh": _eigh_inverse_fourth_root, "newton": _newton_inverse_fourth_root}


def shampoo(lr: float = LR, beta: float = 0.95, every: int = 5, eps: float = 1.0,
            root: str = "newton") -> optax.GradientTransformation:
  """A Shampoo-like test optimizer for leaves that are matrices over their last two axes
  (batched over the others, e.g. the layers of a stacked leaf).

  Each matrix ``G`` accumulates its Kronecker factors ``L = beta L + G G^T`` and
  ``R = beta R + G^T G``; every ``every`` steps (under ``lax.cond``) the inverse fourth roots of
  the factors, damped by ``eps`` times their mean eigenvalue, are recomputed (``root``: by
  ``eigh``, or by the coupled Newton iteration, a ``fori_loop``); the update
  ``P = L^(-1/4) G R^(-1/4)`` is grafted onto SGD's norm, ``-lr ||G|| P / ||P||``.
  """

  def init(params):
    factor = lambda p, k: jnp.zeros(p.shape[:-2] + (p.shape[k], p.shape[k]), p.dtype)
    return ShampooState(jnp.zeros([], jnp.int32),
                        jax.tree.map(lambda p: factor(p, -2), params),
                        jax.tree.map(lambda p: factor(p, -1), params),
                        jax.tree.map(lambda p: _eye(p, p.shape[-2]), params),
                        jax.tree.map(lambda p: _eye(p, p.shape[-1]), params))

  def update(grads, state, params=None):
    del params
    left = jax.tree.map(lambda f, g: beta * f + g @ _transpose(g), state.left, grads)
    right = jax.tree.map(lambda f, g: beta * f + _transpose(g) @ g, state.right, grads)

    def recompute(factors):
      return jax.tree.map(lambda f: ROOTS[root](f, eps), factors[:2])

    roots = lax.cond(state.count % every == 0, recompute, lambda factors: factors[2:],
                     (left, right, state.left_root, state.right_root))

    def precondition(g, lroot, rroot):
      p = lroot @ g @ rroot
      return -lr * p * _frobenius(g) / (_frobenius(p) + 1e-12)

    updates = jax.tree.map(precondition, grads, *roots)
    return updates, ShampooState(optax.safe_increment(state.count), left, right, *roots)

  return optax.GradientTransformation(init, update)


class PsgdState(NamedTuple):
  key: jax.Array         # raw threefry key data, split every step
  q: optax.Params        # the left preconditioner factor per matrix, (..., m, m)


def psgd(lr: float = LR, lr_precond: float = 0.1, seed: int = 0) -> optax.GradientTransformation:
  """A PSGD-like test optimizer (one-sided Kronecker factor, gradient whitening) for leaves that
  are matrices over their last two axes.

  Each step draws a probe ``V`` of each gradient's shape (``jax.random.normal`` from a key split
  off the state's, one per leaf) and moves each matrix's factor ``Q`` towards whitening the
  gradient against the probe: with ``A = Q G``, ``E = A A^T - V V^T``, ``Q <- Q - lr_precond
  E Q / max|E|``; the update is ``-lr Q^T Q G``.
  """

  def init(params):
    return PsgdState(jax.random.key_data(jax.random.key(seed)),
                     jax.tree.map(lambda p: _eye(p, p.shape[-2]), params))

  def update(grads, state, params=None):
    del params
    key, probes = jax.random.split(jax.random.wrap_key_data(state.key))
    leaves, treedef = jax.tree.flatten(grads)
    keys = jax.tree.unflatten(treedef, list(jax.random.split(probes, len(leaves))))

    def one(g, q, k):
      v = jax.random.normal(k, g.shape, g.dtype)
      a = q @ g
      e = a @ _transpose(a) - v @ _transpose(v)
      q = q - lr_precond * (e / (jnp.max(jnp.abs(e), axis=(-2, -1), keepdims=True) + 1e-12)) @ q
      return -lr * _transpose(q) @ q @ g, q

    out = jax.tree.map(one, grads, state.q, keys)
    pick = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)
    return pick(0), PsgdState(jax.random.key_data(key), pick(1))

  return optax.GradientTransformation(init, update)


def _matrices_preconditioned(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` on the matrices (embed, head, the stacked (L, d, d) weights), Adam on the stacked
  (L, d) biases."""
  labels = {"embed": "matrix", "head": "matrix", "layers": {"w": "matrix", "b": "vector"}}
  return optax.multi_transform({"matrix": tx, "vector": optax.adam(LR)}, labels)


# Trained against optax. Shampoo's roots by ``eigh`` are placed, not trained: LAPACK's
# eigendecomposition is accurate normwise, and the inputs of the fused and optax steps, an ulp
# apart, give roots up to 1.1 times the float32 tolerance apart in their small elements after
# one step (XLA:CPU), where the Newton iteration's roots are 0.09 times apart.
OPTIMIZERS = {
    "shampoo": lambda: _matrices_preconditioned(shampoo()),
    "psgd": lambda: _matrices_preconditioned(psgd()),
    # optax's own draw of each leaf's shape: noise that dominates the update, drawn by layer.
    "add_noise": lambda: optax.chain(optax.add_noise(0.01, 0.55, 0), optax.sgd(LR)),
}
PLACED = {**OPTIMIZERS, "shampoo_eigh": lambda: _matrices_preconditioned(shampoo(root="eigh"))}


def _params():
  return models.stacked_params(LAYERS, DIM)


def _key_data(run):
  """``run`` with each typed key (optax's ``add_noise`` state holds one) as its raw data, which
  the criteria compare as integers."""
  is_key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, run)


def _describe(tx):
  return optfuse.describe(tx, models.scanned_loss, _params(), *models.tied_lm_batches(1)[0])


@pytest.mark.parametrize("name", sorted(PLACED))
def test_describe_updates_the_stacked_leaves_of_a_preconditioned_optimizer_in_the_loop(name):
  where = _describe(PLACED[name]())
  assert (where[W], where[B]) == ("loop", "loop"), (where.table(), where.reasons)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_backward_fused_preconditioned_optimizer_matches_optax_and_rejects_a_1pct_lr_error(name):
  """20 jitted, donated fused steps equal optax's (losses, params, state), and a learning rate
  1 % off is at least ``criteria.REJECTED_BY`` times the tolerance away."""
  tx, batches = OPTIMIZERS[name], models.tied_lm_batches(3)
  want = _key_data(models.run_optax(tx(), _params(), batches, STEPS, models.scanned_loss))
  got = models.run_fused(tx(), "backward", _params(), batches, STEPS, models.scanned_loss)
  criteria.assert_matches_optax(_key_data(got), want)
  wrong = models.run_fused(faults.lr_off(tx()), "backward", _params(), batches, STEPS,
                           models.scanned_loss)
  distance, where = criteria.matches_optax_distance(_key_data(wrong), want)
  assert distance >= criteria.REJECTED_BY, (distance, where)


def test_without_threefry_partitionable_psgd_updates_after_the_loop_and_says_to_set_the_flag():
  """A row of a whole-leaf draw is not drawn alone without the flag: the stacked weight is
  updated after the loop, exactly, and its reason names the flag."""
  with jax.threefry_partitionable(False):
    where = _describe(OPTIMIZERS["psgd"]())
    assert (where[W], where[B]) == ("tap", "loop"), where.table()
    assert "jax_threefry_partitionable" in where.reasons[W], where.reasons
    batches = models.tied_lm_batches(3)
    want = models.run_optax(OPTIMIZERS["psgd"](), _params(), batches, 5, models.scanned_loss)
    got = models.run_fused(OPTIMIZERS["psgd"](), "backward", _params(), batches, 5,
                           models.scanned_loss)
  criteria.assert_matches_optax(got, want)


@pytest.mark.parametrize("name", ["psgd", "add_noise"])
def test_forward_fused_optimizer_with_a_key_in_its_state_matches_optax(name):
  """Forward fusion applies the pending update before each layer, the probes drawn by layer
  there too, with a typed key in its state (its pending update cast the key, and failed)."""
  tx, batches = OPTIMIZERS[name], models.tied_lm_batches(3)
  want = _key_data(models.run_optax(tx(), _params(), batches, 10, models.scanned_loss))
  fx = optfuse.fuse(tx(), mode="forward")
  losses, params, state = models.run_steps(fx.value_and_update(models.scanned_loss), _params(),
                                           fx.init(_params()), batches, 10)
  got = (losses, *optfuse.to_optax_state(fx, params, state))  # the last update applied
  criteria.assert_matches_optax(_key_data(got), want)
