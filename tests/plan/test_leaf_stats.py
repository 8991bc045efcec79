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
from optfuse._plan import _make

# One optax update against the plan's stages: the same arithmetic in another order of reduction
# (float32, measured: at most 1.2e-7 apart).
TOL = dict(rtol=1e-6, atol=1e-6)

WHOLE_LEAF = {
    "lamb": lambda: optax.lamb(1e-2, weight_decay=1e-2),
    "lars": lambda: optax.lars(1e-2),
    "clip_by_block_rms+adam": lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-2)),
    "novograd": lambda: optax.novograd(1e-2),
    "sm3": lambda: optax.sm3(1e-2),
}


def _tree(seed):
  k = jax.random.split(jax.random.PRNGKey(seed), 2)
  return {"w": jax.random.normal(k[0], (5, 3, 4)), "b": jax.random.normal(k[1], (5, 4))}


def _plan(tx, params):
  return _make.make_plan(tx, params, tx.init(params), global_handling="if_needed")


def _assert_split_plan_computes_optax_update(tx):
  params, grads = _tree(0), _tree(1)
  state = tx.init(params)
  plan = _plan(tx, params)
  assert not plan.is_separable and plan.stats is not None
  updates, new_state = plan.update(jax.tree.leaves(grads), jax.tree.leaves(state),
                                    jax.tree.leaves(params))
  want_updates, want_state = tx.update(grads, state, params)
  chex.assert_trees_all_close(updates, jax.tree.leaves(want_updates), **TOL)
  chex.assert_trees_all_close(new_state, jax.tree.leaves(want_state), **TOL)


@pytest.mark.parametrize("name", WHOLE_LEAF)
def test_the_split_plan_computes_optax_update(name):
  _assert_split_plan_computes_optax_update(WHOLE_LEAF[name]())


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


def test_sm3_accumulators_of_the_non_layer_axes_are_written_by_the_combine_step():
  tx, params = WHOLE_LEAF["sm3"](), _tree(0)
  plan = _plan(tx, params)
  state = jax.tree.leaves(tx.init(params))
  # b (5, 4): its accumulator of axis 1, (4,); w (5, 3, 4): those of axes 1 and 2. Each is a
  # maximum over the layers; the accumulators of axis 0, (5,), and the momenta stay with rows.
  assert sorted(jnp.shape(state[k]) for k in plan.global_outs) == [(3,), (4,), (4,)]
  assert [sorted(jnp.shape(state[k]) for k in g.state_outs) for g in plan.groups] == [
      [(5,), (5, 4)], [(5,), (5, 3, 4)]]


def test_novograd_second_moment_is_written_by_the_combine_step():
  tx, params = WHOLE_LEAF["novograd"](), _tree(0)
  plan = _plan(tx, params)
  # nu, one scalar per leaf, is state of the global stage; mu stays with its leaf's rows.
  assert [jnp.shape(jax.tree.leaves(tx.init(params))[k]) for k in plan.global_outs] == [(), ()]
  assert all(len(g.state_outs) == 1 for g in plan.groups)


def test_an_update_without_whole_leaf_norms_keeps_its_separable_plan():
  tx, params = optax.adamw(1e-2), _tree(0)
  assert _plan(tx, params).is_separable


# Adafactor's defaults factor every leaf here (min_dim_size_to_factor=3): w (5, 3, 4) over its
# axes 2 and 0, b (5, 4) over both, so the block RMS of each update reads the mean of a factored
# moment, itself a reduction of the whole leaf: a statistic reduced whole.
NESTED = {
    "adafactor, factored": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=3),
    "norm of centred values": lambda: optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda g, state, params=None: (jax.tree.map(
            lambda x: x / jnp.linalg.norm(x - jnp.mean(x)), g), state)),
}


@pytest.mark.parametrize("name", NESTED)
def test_a_statistic_read_by_another_is_reduced_whole_and_exact(name):
  _assert_split_plan_computes_optax_update(NESTED[name]())


@pytest.mark.parametrize("name", NESTED)
def test_a_statistic_read_by_another_is_refused_row_by_row_with_its_reason(name):
  # ||g - mean(g)||: the second reduction reads a float computed from the first, which no
  # single sweep can reduce row by row, so the leaf's loop is refused and says why.
  tx, params = NESTED[name](), _tree(0)
  plan, flat_p = _plan(tx, params), jax.tree.leaves(params)
  state = jax.tree.leaves(tx.init(params))
  for i in range(len(flat_p)):
    why = plan.row_refusal(i, state, flat_p, stats=True)
    assert why is not None and ("mixes rows" in why or "not stacked" in why), why
