"""``_leaf_stats``: a separable update's norms over whole leaves cut out as per-leaf statistics.

The split plan computes optax's update stage by stage (statistics, combine, groups), each
statistic of a stacked leaf is the combination of its rows' partial values, and an update the
split does not cover is left to the separable plan.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

from optfuse._jaxpr import _rows
from optfuse._plan import _leaf_stats, _make, _separable

# One optax update against the plan's stages: the same arithmetic in another order of reduction
# (float32, measured: at most 1.2e-7 apart).
TOL = dict(rtol=1e-6, atol=1e-6)

WHOLE_LEAF = {
    "lamb": lambda: optax.lamb(1e-2, weight_decay=1e-2),
    "lars": lambda: optax.lars(1e-2),
    "clip_by_block_rms+adam": lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-2)),
    "novograd": lambda: optax.novograd(1e-2),
}


def _tree(seed):
  k = jax.random.split(jax.random.PRNGKey(seed), 2)
  return {"w": jax.random.normal(k[0], (5, 3, 4)), "b": jax.random.normal(k[1], (5, 4))}


def _plan(tx, params):
  return _make.make_plan(tx, params, tx.init(params), global_handling="if_needed")


@pytest.mark.parametrize("name", WHOLE_LEAF)
def test_the_split_plan_computes_optax_update(name):
  tx, params, grads = WHOLE_LEAF[name](), _tree(0), _tree(1)
  state = tx.init(params)
  plan = _plan(tx, params)
  assert not plan.is_separable and plan.stats is not None
  updates, new_state = plan.update(jax.tree.leaves(grads), jax.tree.leaves(state),
                                    jax.tree.leaves(params))
  want_updates, want_state = tx.update(grads, state, params)
  chex.assert_trees_all_close(updates, jax.tree.leaves(want_updates), **TOL)
  chex.assert_trees_all_close(new_state, jax.tree.leaves(want_state), **TOL)


def test_lamb_statistics_are_scalars_and_its_cut_is_the_trust_ratio():
  tx, params = WHOLE_LEAF["lamb"](), _tree(0)
  plan = _plan(tx, params)
  # ||param|| and ||update||, then the second norms of optax's safe_norm for both values of
  # "the first norm is zero": six scalars per leaf, and one scalar cut per leaf.
  assert [[s.shape for s in leaf] for leaf in plan.stats.stats] == [[()] * 6] * 2
  assert [c.shape for c in plan.cuts] == [(), ()]


@pytest.mark.parametrize("name", WHOLE_LEAF)
def test_rows_partial_statistics_combine_into_the_whole_leaf_statistics(name):
  tx, params, grads = WHOLE_LEAF[name](), _tree(0), _tree(1)
  state = jax.tree.leaves(tx.init(params))
  plan, flat_p, flat_g = _plan(tx, params), jax.tree.leaves(params), jax.tree.leaves(grads)
  for i, (g, p) in enumerate(zip(flat_g, flat_p)):
    want = plan.run_stats(i, g, state, flat_p)
    got = None
    for row in range(p.shape[0]):
      partials = plan.run_stats_row(i, g[row], state, flat_p, row, p.shape[0])
      got = [v for v, _ in partials] if got is None else [
          _rows.ROW_COMBINE[r].combine(a, v) for a, (v, r) in zip(got, partials)]
    chex.assert_trees_all_close(got, want, **TOL)


def test_novograd_second_moment_is_written_by_the_combine_step():
  tx, params = WHOLE_LEAF["novograd"](), _tree(0)
  plan = _plan(tx, params)
  # nu, one scalar per leaf, is state of the global stage; mu stays with its leaf's rows.
  assert [jnp.shape(jax.tree.leaves(tx.init(params))[k]) for k in plan.global_outs] == [(), ()]
  assert all(len(g.state_outs) == 1 for g in plan.groups)


def test_an_update_without_whole_leaf_norms_keeps_its_separable_plan():
  tx, params = optax.adamw(1e-2), _tree(0)
  assert _plan(tx, params).is_separable


def test_a_norm_of_values_centred_by_another_norm_is_left_to_the_separable_plan():
  # ||g - mean(g)||: the second reduction reads a float computed from the first, which no
  # single sweep can reduce row by row.
  def update(g, state, params=None):
    del params
    centred = jax.tree.map(lambda x: x - jnp.mean(x), g)
    return jax.tree.map(lambda x, c: x / jnp.linalg.norm(c), g, centred), state

  tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  params = _tree(0)
  state = tx.init(params)
  traced = _separable.trace_update(tx, params, state)
  assert _leaf_stats.make_leaf_stats_plan(traced, _separable.make_plan(tx, params, state,
                                                                        traced)) is None
