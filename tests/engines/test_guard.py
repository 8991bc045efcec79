"""The memory guard (``optfuse.fuse(tx, guard=True)``): a fused loop is kept only where the
compiled step peaks no higher with it than with its leaves tapped, decided once per input
shapes, and the step still trains exactly like optax."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from optfuse._engines import _guard
from tests import criteria
from tests.models import run_optax, run_steps

L, D, B = 6, 16, 4
TX = optax.adamw(1e-2, weight_decay=0.1)


def _params(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  return {"layers": {"w": jax.random.normal(k[0], (L, D, D)) / np.sqrt(D),
                     "b": 0.1 * jax.random.normal(k[1], (L, D))},
          "head": jax.random.normal(k[2], (D, 2)) / np.sqrt(D)}


def _stack_loss(p, x, y):
  h, _ = jax.lax.scan(lambda h, lp: (jnp.tanh(h @ lp["w"] + lp["b"]), None), x, p["layers"])
  return jnp.mean((h @ p["head"] - y) ** 2)


def _two_stacks_loss(p, x, y):
  h, _ = jax.lax.scan(lambda h, lp: (jnp.tanh(h @ lp["w"] + lp["b"]), None), x, p["layers"])
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["more"])
  return jnp.mean((h @ p["head"] - y) ** 2)


def _batches():
  k1, k2 = jax.random.split(jax.random.PRNGKey(7))
  return [(jax.random.normal(k1, (B, D)), jax.random.normal(k2, (B, 2)))]


def _compiler_says(monkeypatch, peaks):
  """Stands in for the compiler: ``peaks(tapped)`` is the step's peak with the fused leaves
  ``tapped`` (leaf indices) tapped."""
  decide = _guard.decide
  monkeypatch.setattr(_guard, "decide", lambda sites, peak_of: decide(sites, peaks))


def test_decide_keeps_every_loop_when_fused_peaks_no_higher():
  assert _guard.decide([(1, 2)], lambda tapped: 100) == {}
  assert _guard.decide([(1, 2)], lambda tapped: 90 if not tapped else 100) == {}


def test_decide_taps_the_loop_when_fused_peaks_higher_and_says_both_peaks():
  refused = _guard.decide([(1, 2)], lambda tapped: 120_000_000 if not tapped else 100_000_000)
  assert sorted(refused) == [1, 2]
  assert "120.00 MB" in refused[1] and "100.00 MB" in refused[1] and "guard=True" in refused[1]


def test_decide_taps_only_the_scan_that_costs_memory():
  peaks = {frozenset(): 150, frozenset({1, 2, 3}): 140, frozenset({1, 2}): 120,
           frozenset({3}): 160}
  refused = _guard.decide([(1, 2), (3,)], lambda tapped: peaks[tapped])
  assert sorted(refused) == [1, 2]


def test_decide_compiles_nothing_without_a_fused_loop():
  assert _guard.decide([], lambda tapped: pytest.fail("compiled")) == {}


@pytest.mark.parametrize("jit", [pytest.param(True, id="jit_donated"),
                                 pytest.param(False, id="eager", marks=pytest.mark.slow)])
def test_a_guarded_step_that_keeps_its_loop_trains_like_optax(jit):
  params, batches = _params(), _batches()
  want = run_optax(TX, params, batches, 20, loss_fn=_stack_loss, jit=jit)
  fx = optfuse.fuse(TX, guard=True)
  got = run_steps(fx.value_and_update(_stack_loss), params, fx.init(params), batches, 20, jit)
  chex.assert_trees_all_close(got, want, **criteria.F32_FLOOR)
  assert optfuse.describe(fx, _stack_loss, params, *batches[0])["['layers']['w']"] == "loop"


def test_the_guard_compiles_once_per_input_shapes(monkeypatch):
  calls = []
  real = _guard.peak
  monkeypatch.setattr(_guard, "peak", lambda *a: calls.append(1) or real(*a))
  fx = optfuse.fuse(TX, guard=True)
  params, (batch,) = _params(), _batches()
  step = jax.jit(fx.value_and_update(_stack_loss))
  state = fx.init(params)
  for _ in range(3):
    _, params, state = step(params, state, *batch)
  assert len(calls) == 2  # every loop fused, every fused leaf tapped
  wider = tuple(jnp.concatenate([x, x]) for x in batch)
  step(params, state, *wider)
  assert len(calls) == 4


def test_describe_reads_the_decision_of_the_step_it_describes_without_compiling(monkeypatch):
  calls = []
  real = _guard.peak
  monkeypatch.setattr(_guard, "peak", lambda *a: calls.append(1) or real(*a))
  fx = optfuse.fuse(TX, guard=True)
  params, (batch,) = _params(), _batches()
  jax.jit(fx.value_and_update(_stack_loss)).trace(params, fx.init(params), *batch)
  assert len(calls) == 2
  assert optfuse.describe(fx, _stack_loss, params, *batch)["['layers']['w']"] == "loop"
  assert len(calls) == 2


def test_a_loop_that_peaks_above_its_taps_is_tapped_and_trains_like_optax(monkeypatch):
  # Fused, this model peaks below its taps on XLA:CPU; the stand-in says the opposite.
  _compiler_says(monkeypatch, lambda tapped: 100 if tapped else 200)
  params, batches = _params(), _batches()
  fx = optfuse.fuse(TX, guard=True)
  described = optfuse.describe(fx, _stack_loss, params, *batches[0])
  assert described["['layers']['w']"] == described["['layers']['b']"] == "tap"
  why = described.reasons["['layers']['w']"]
  assert "guard=True" in why and "200 B" in why and "100 B" in why
  want = run_optax(TX, params, batches, 20, loss_fn=_stack_loss)
  got = run_steps(fx.value_and_update(_stack_loss), params, fx.init(params), batches, 20)
  chex.assert_trees_all_close(got, want, **criteria.F32_FLOOR)


def test_with_two_scans_the_guard_taps_the_one_that_costs_memory(monkeypatch):
  # Leaves: head 0, layers.b 1, layers.w 2, more 3; fusing "more" costs memory.
  _compiler_says(monkeypatch, lambda tapped: 100 if 3 in tapped and 2 not in tapped else 150)
  params = {**_params(), "more": jax.random.normal(jax.random.PRNGKey(3), (L, D, D)) / 4}
  fx = optfuse.fuse(TX, guard=True)
  described = optfuse.describe(fx, _two_stacks_loss, params, *_batches()[0])
  assert described["['more']"] == "tap"
  assert described["['layers']['w']"] == "loop"


def test_guard_runs_in_backward_mode_only():
  with pytest.raises(optfuse.GuardError, match="backward"):
    optfuse.fuse(TX, mode="forward", guard=True)
  with pytest.raises(optfuse.GuardError, match="True or False"):
    optfuse.fuse(TX, guard="yes")


def test_a_loss_that_closes_over_a_traced_value_is_guarded_too():
  params, batches = _params(), _batches()
  fx = optfuse.fuse(TX, guard=True)

  @jax.jit
  def outer(params, state, x, y, scale):
    return fx.value_and_update(lambda p, x, y: scale * _stack_loss(p, x, y))(params, state, x, y)

  _, new_params, _ = outer(params, fx.init(params), *batches[0], 2.0)
  doubled = lambda p, x, y: 2.0 * _stack_loss(p, x, y)
  _, want_params, _ = run_optax(TX, params, batches, 1, loss_fn=doubled)
  chex.assert_trees_all_close(new_params, want_params, **criteria.F32_FLOOR)
