"""An error raised inside a row rule (anything but ``NotRowwise``) never crashes a step nor makes
a wrong update: the leaf is refused, updated after its loop as any leaf whose update mixes rows,
and ``describe`` names the error. The tests run with ``OPTFUSE_RAISE_ROW_RULE_ERRORS=1``
(``conftest.py``), under which the error propagates, so that the suite sees every such error."""

import jax
import optax
import pytest
from jax.extend.core import primitives as P

import optfuse
from optfuse._jaxpr import _row_params, _rows
from tests.fusion.test_loops import _assert_matches_optax, _batch, _init, scan_loss

STACKED = "['layers']['w']"


def _broken_rule(rows, eqn, ins):
  raise ValueError("a rule that fails")


@pytest.fixture
def broken_sqrt(monkeypatch):
  """Adam's ``sqrt`` (of its second moment) with a row rule that raises."""
  monkeypatch.setitem(_rows.ROW_RULES, P.sqrt_p, _broken_rule)
  return monkeypatch


def test_the_error_becomes_a_reason_and_the_leaf_is_updated_after_the_loop(broken_sqrt):
  broken_sqrt.delenv(_row_params.RAISE_RULE_ERRORS)
  where = optfuse.describe(optax.adam(1e-2), scan_loss, _init(jax.random.PRNGKey(0)), *_batch())
  assert where[STACKED] == "tap", where.table()
  reason = where.reasons[STACKED]
  assert "the row rule of sqrt raised ValueError: a rule that fails" in reason, reason
  # The whole update after the loop: optax's trajectory (test_loops' tolerance, 30 steps).
  _assert_matches_optax(optax.adam(1e-2), scan_loss)


def test_the_tests_see_the_error_itself(broken_sqrt):
  with pytest.raises(ValueError, match="a rule that fails"):
    optfuse.describe(optax.adam(1e-2), scan_loss, _init(jax.random.PRNGKey(0)), *_batch())
