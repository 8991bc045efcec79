"""The parameter rules of row evaluation on their own (``optfuse._jaxpr._row_params``): for an
equation traced on stacked values and the stacked axis of each operand, the params it runs with
on rows, how a whole operand is sliced, and where the stacked axis of its output is; or
``NotRowwise`` where rows would mix. ``tests/jaxpr/test_row_rules.py`` checks the same rules by
their results, a row against the row of the whole evaluation."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.extend.core import primitives as P

from optfuse._jaxpr import _row_params, _rows

L = 4


def _eqn(fn, *shapes):
  """The one equation ``fn`` stages on float32 values of ``shapes``."""
  (eqn,) = jax.make_jaxpr(fn)(*(jnp.zeros(s) for s in shapes)).jaxpr.eqns
  return eqn


def test_broadcast_in_dim_drops_the_stacked_axis_from_its_shape():
  eqn = _eqn(lambda x: lax.broadcast_in_dim(x, (L, 5, 3), (0, 2)), (L, 3))
  how = _row_params.row_params(eqn, [0], L)
  assert how.params["shape"] == (5, 3) and how.params["broadcast_dimensions"] == (1,)
  assert how.out_axes == (0,)


def test_a_broadcast_along_the_stacked_axis_mixes_rows():
  # A stacked axis of size 1 broadcast to L + 1: no output row is one input row.
  eqn = _eqn(lambda x: lax.broadcast_in_dim(x, (L + 1, 3), (0, 1)), (1, 3))
  with pytest.raises(_row_params.NotRowwise, match="broadcast_in_dim of the stacked axis"):
    _row_params.row_params(eqn, [0], L)


def test_a_reduction_keeps_the_stacked_axis_out_of_its_axes():
  eqn = _eqn(lambda x: jnp.sum(x, axis=(0, 2)), (3, L, 5))
  how = _row_params.row_params(eqn, [1], L)
  assert how.params["axes"] == (0, 1) and how.out_axes == (0,)
  with pytest.raises(_row_params.NotRowwise, match="over the stacked axis"):
    _row_params.row_params(eqn, [0], 3)


def test_dot_general_moves_a_free_stacked_axis_and_refuses_a_contracted_one():
  eqn = _eqn(lambda a, b: a @ b, (L, 3), (3, 5))
  how = _row_params.row_params(eqn, [0, None], L)
  assert how.params["dimension_numbers"] == (((0,), (0,)), ((), ()))
  assert how.full_axes == (None, None) and how.out_axes == (0,)
  with pytest.raises(_row_params.NotRowwise, match="contracting the stacked axis"):
    _row_params.row_params(_eqn(lambda a, b: a @ b, (3, L), (L, 5)), [1, 0], L)


def test_an_elementwise_operand_given_whole_is_sliced_along_the_rows_axis():
  eqn = _eqn(lambda a, b: a + b, (L, 3), (L, 3))
  how = _row_params.row_params(eqn, [0, None], L)
  assert how.full_axes == (None, 0) and how.out_axes == (0,)


def test_a_reshape_keeps_the_stacked_axis_unless_it_merges_it():
  how = _row_params.row_params(_eqn(lambda x: x.reshape(L, 6), (L, 2, 3)), [0], L)
  assert how.params["new_sizes"] == (6,) and how.out_axes == (0,)
  with pytest.raises(_row_params.NotRowwise, match="merges the stacked axis"):
    _row_params.row_params(_eqn(lambda x: x.reshape(2 * L, 3), (L, 2, 3)), [0], L)


def test_the_stacked_axis_is_followed_along_a_path_of_row_preserving_equations():
  jaxpr = jax.make_jaxpr(lambda x: jnp.moveaxis(x, 1, 0).astype(jnp.bfloat16))(
      jnp.zeros((3, L, 5))).jaxpr
  assert all(e.primitive in _row_params.PATH_PRIMITIVES for e in jaxpr.eqns)
  assert _row_params.path_axis(jaxpr.eqns, 1, L) == 0


def test_a_primitive_without_a_parameter_rule_raises_no_row_rule():
  eqn = _eqn(lambda x: lax.fori_loop(0, 2, lambda i, c: c * 2.0, x), (L, 3))
  assert eqn.primitive is P.scan_p  # its rule runs its body (``_rows``), no parameter rule
  with pytest.raises(_row_params.NoRowRule, match="scan has no row rule"):
    _row_params.row_params(eqn, [0], L)


def test_a_rules_own_error_is_a_row_rule_error_naming_it(monkeypatch):
  monkeypatch.delenv(_row_params.RAISE_RULE_ERRORS)
  monkeypatch.setitem(_row_params.PARAMS_RULES, P.exp_p, lambda eqn, axes, length: 1 / 0)
  with pytest.raises(_row_params.RowRuleError, match="exp raised ZeroDivisionError"):
    _row_params.row_params(_eqn(jnp.exp, (L, 3)), [0], L)


def test_every_parameter_rule_is_a_row_rule():
  assert set(_row_params.PARAMS_RULES) <= set(_rows.ROW_RULES)
  assert all(isinstance(_rows.ROW_RULES[p], _rows.ParamsRowRule)
             for p in set(_row_params.PARAMS_RULES) - set(_row_params.REDUCTIONS))
