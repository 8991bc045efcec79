"""A primitive optfuse has no rule for is never a crash nor a different result.

``optfuse_test_unknown`` is made up here (a linear map, ``x -> 2x``, with its own abstract
evaluation, lowering, JVP and transpose), as a primitive that a later JAX adds or a user writes
would be. Inside the update of a custom optax transformation, the stacked leaves it touches are
updated whole after the loop, exactly, and ``describe`` names the primitive; inside the scan body
of the loss it is a primitive like any other. Either way the fused step trains like optax.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.extend import core as jcore
from jax.interpreters import ad, mlir

import optfuse
from tests import criteria, models
from tests.fusion.test_loops import _batch, _init, _layer

_UNKNOWN = jcore.Primitive("optfuse_test_unknown")
_UNKNOWN.def_impl(lambda x: 2 * x)
_UNKNOWN.def_abstract_eval(lambda x: x)
mlir.register_lowering(_UNKNOWN, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
ad.deflinear2(_UNKNOWN, lambda ct, x: [_UNKNOWN.bind(ct)])



def unknown_scale() -> optax.GradientTransformation:
  """Scales the updates by 2 through the made-up primitive."""
  return optax.GradientTransformation(
      optax.init_empty_state,
      lambda updates, state, params=None: (jax.tree.map(_UNKNOWN.bind, updates), state))


def unknown_loss(p, x, y):
  body = lambda h, lp: (_UNKNOWN.bind(_layer(h, lp, p["shared"])) / 2, None)
  h, _ = jax.lax.scan(body, x, p["layers"])
  return jnp.mean((h @ p["head"] - y) ** 2)


def _scan_loss(p, x, y):
  h, _ = jax.lax.scan(lambda h, lp: (_layer(h, lp, p["shared"]), None), x, p["layers"])
  return jnp.mean((h @ p["head"] - y) ** 2)


CASES = {
    "in_the_update": (optax.chain(optax.scale_by_adam(), unknown_scale(), optax.scale(-1e-2)),
                      _scan_loss),
    "in_the_scan_body": (optax.adamw(1e-2), unknown_loss),
}


def test_describe_names_a_primitive_of_the_update_without_a_row_rule():
  tx, loss = CASES["in_the_update"]
  where = optfuse.describe(tx, loss, _init(jax.random.PRNGKey(0)), *_batch())
  for leaf in ("['layers']['w']", "['layers']['b']"):
    assert where[leaf] == "tap"
    assert "optfuse_test_unknown" in where.reasons[leaf], where.reasons
    assert "no row rule" in where.reasons[leaf]
    assert "its update mixes rows" not in where.reasons[leaf]


def test_an_unknown_primitive_in_the_scan_body_leaves_the_stack_fused_in_its_loop():
  tx, loss = CASES["in_the_scan_body"]
  where = optfuse.describe(tx, loss, _init(jax.random.PRNGKey(0)), *_batch())
  assert where["['layers']['w']"] == where["['layers']['b']"] == "loop"


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_fusion_with_an_unknown_primitive_trains_like_optax(case):
  tx, loss = CASES[case]
  params, batches = _init(jax.random.PRNGKey(0)), [_batch()]
  got = models.run_fused(tx, "backward", params, batches, 10, loss)
  want = models.run_optax(tx, params, batches, 10, loss)
  chex.assert_trees_all_close(got[:2], want[:2], **criteria.F32_FLOOR)
