"""JAX 0.11's forms of the control-flow equations through every walker of optfuse, on JAX 0.10.

JAX 0.11 stages a ``scan`` with ``ft_in`` in place of ``num_consts``/``num_carry`` and every
body (a scan's, a ``while``'s, a ``cond``'s branches, a ``jit``'s) as a ``Jaxpr`` carrying its
consts; ``tests/_jax011.py`` stages those forms on the installed JAX. Under them Muon (whose
update runs its Newton-Schulz iterations in a ``fori_loop``, a scan) is fused in the loop of a
scanned decoder whose layers are ``jax.checkpoint``-ed under ``jax_remat3`` (a
``call_hi_primitive``): site finding, the plan's row checks, the row evaluator and the backward,
forward and two-pass engines all read them, and ``describe`` says where each leaf is updated.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optfuse
from optfuse._jaxpr import _interpreter, _rows
from tests import _jax011, criteria, models
from tests.engines import test_muon

pytestmark = pytest.mark.jax_upgrades

L = 4


UPGRADES = ("jax_remat3", "jax_custom_vjp3")


@pytest.fixture
def jax011(monkeypatch):
  """JAX 0.11's forms staged from here on, with the upgrade flags on (``jax.checkpoint`` and
  ``jax.custom_vjp`` staged as ``call_hi_primitive``); yields the jaxprs staged."""
  seen: list = []
  _jax011.stage_as_jax011(monkeypatch, seen)
  before = {flag: getattr(jax.config, flag) for flag in UPGRADES}
  for flag in UPGRADES:
    jax.config.update(flag, True)
  yield seen
  for flag, value in before.items():
    jax.config.update(flag, value)


def _halved(y):
  return y * 0.5


def _halved_custom_vjp():
  f = jax.custom_vjp(_halved)  # made inside the test: the flag is read when it is made
  f.defvjp(lambda y: (_halved(y), None), lambda _, ct: (_halved(ct),))
  return f


def _update(x, n):
  """A loop of each kind on rows: a ``fori_loop`` with static bounds (a scan) around a
  ``jax.checkpoint`` and a ``jax.custom_vjp``, one with traced bounds (a ``while``), a ``cond``
  on a scalar shared by every row, inside a ``jit``."""
  halved = _halved_custom_vjp()
  x = lax.fori_loop(0, 3, lambda i, c: halved(jax.checkpoint(lambda c: c * c)(c)) + x, x)
  x = lax.fori_loop(0, n, lambda i, c: jnp.tanh(c) + 0.1 * x, x)
  return jax.jit(lambda y: lax.cond(n > 1, lambda: y @ jnp.swapaxes(y, -1, -2) @ y, lambda: y))(x)


def test_the_stand_ins_stage_ft_in_and_jaxprs_carrying_their_consts(jax011):
  closed = jax.make_jaxpr(_update)(jnp.ones((L, 3, 3)), 2)
  counts = _jax011.count_011(closed.jaxpr)
  assert counts["ft_in"] == 1 and counts["merged"] >= 5, counts  # scan, while x2, jit, cond x2
  prims = jax.extend.core.primitives
  (scan,) = [e for e in closed.jaxpr.eqns if _interpreter.primitive_of(e) is prims.scan_p]
  assert "num_consts" not in scan.params and "num_carry" not in scan.params
  parts = _interpreter.scan_parts(scan)
  assert (parts.num_consts, parts.num_carry, parts.length) == (1, 2, 3)
  assert parts.body.jaxpr is scan.params["jaxpr"] and parts.body.consts == []
  # The checkpoint and the custom_vjp in its body, as the upgrade flags stage them.
  inner = [e.primitive.name for e in parts.body.jaxpr.eqns]
  assert inner.count("call_hi_primitive") == 2, inner
  assert {_interpreter.primitive_of(e) for e in parts.body.jaxpr.eqns} >= {
      prims.remat_p, prims.custom_vjp_call_p}


def test_the_row_evaluator_runs_each_loop_of_the_new_forms_on_rows(jax011):
  x = jax.random.normal(jax.random.PRNGKey(0), (L, 3, 3)) * 0.3
  closed = jax.make_jaxpr(_update)(x, 2)
  assert _jax011.holds_011(closed.jaxpr)
  whole = _update(x, 2)
  for i in range(L):
    (row,) = _rows.evaluate_rows(closed.jaxpr, closed.consts, [x[i], 2], [True, False], i, L)
    # The same operations on the same values: a row rule reorders no arithmetic.
    np.testing.assert_array_equal(np.asarray(row), np.asarray(whole[i]))


def test_describe_puts_every_stacked_muon_matrix_in_its_loop(jax011):
  where = optfuse.describe(test_muon._muon(), test_muon.decoder_loss, test_muon.decoder_params(),
                           *test_muon._batches()[0])
  assert all(where[m] == "loop" for m in test_muon.MATRICES), where.table()
  assert not where.reasons, where.reasons
  # What optfuse read was staged in the new forms: the Newton-Schulz loop's scan with
  # ``ft_in``, the decoder's scan with its body carrying its consts.
  assert sum(_jax011.count_011(c.jaxpr)["ft_in"] for c in jax011) >= 2


# Float32, 3 steps, compared with optax's own update (no stand-in): the same tolerances as the
# Muon equivalence tests of ``tests/engines/test_muon.py`` over 20 steps. Backward mode is the case
# the default suite runs (about 12 s on one CPU core); forward and two-pass run with ``-m slow``.
@pytest.mark.equivalence
@pytest.mark.parametrize("options", [
    dict(mode="backward"),
    pytest.param(dict(mode="forward"), marks=pytest.mark.slow),
    pytest.param(dict(mode="backward", global_ops="two_pass"), marks=pytest.mark.slow),
], ids=["backward", "forward", "two_pass"])
def test_fused_muon_trains_like_optax_with_the_new_forms(jax011, options, monkeypatch):
  # Two-pass mode fuses what needs a global statistic (the clip's norm) in a second pass.
  tx = (optax.chain(optax.clip_by_global_norm(1.0), test_muon._muon())
        if "global_ops" in options else test_muon._muon())
  params, batches = test_muon.decoder_params(), test_muon._batches()
  fx = optfuse.fuse(tx, **options)
  got = models.run_steps(fx.value_and_update(test_muon.decoder_loss), params, fx.init(params),
                         batches, 3)
  got_params = fx.flush(got[1], got[2])[0] if options["mode"] == "forward" else got[1]
  assert _jax011.holds_011(jax011[-1].jaxpr)
  monkeypatch.undo()  # optax's reference, traced by the installed JAX as it is
  want = models.run_optax(tx, params, batches, 3, test_muon.decoder_loss)
  # Forward mode's losses follow optax's one update behind the params, which ``flush`` catches up.
  criteria.assert_matches_optax((got[0], got_params), want[:2])
