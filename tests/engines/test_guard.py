"""The memory guard (``optfuse.fuse(tx, guard=True)``): a fused loop is kept only where the
compiled step peaks no higher with it than with its leaves tapped, decided once per input
shapes, and the step still trains like optax (to the suite's criterion)."""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optfuse
from optfuse._engines import _guard
from optfuse._targets import _backends, _registry
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


# The decision is cached under ``shapes_key``: whatever changes the loop policy or the peaks the
# guard compares must change the key, or a step traced anew reuses a decision made for other
# inputs. Each test below changes one thing alone.

def _key(*batch):
  params = _params()
  return _guard.shapes_key(params, TX.init(params), batch, {})


@contextlib.contextmanager
def _inputs_placed_on(devices):
  """Traces as if the step's inputs were placed on a mesh of ``devices`` CPU devices."""
  token = _backends._INPUTS.set(_backends.Placement("cpu", devices))
  try:
    yield
  finally:
    _backends._INPUTS.reset(token)


def test_the_decision_is_keyed_on_the_device_count_the_loop_policy_reads():
  batch = _batches()[0]
  with _inputs_placed_on(1):
    one, one_policy = _key(*batch), _backends.loop_policy()
  with _inputs_placed_on(8):
    eight, eight_policy = _key(*batch), _backends.loop_policy()
  assert one_policy != eight_policy
  assert one != eight


def test_the_decision_is_keyed_on_each_inputs_sharding():
  x, y = _batches()[0]
  mesh = jax.make_mesh((1,), ("data",))
  sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
  assert _key(x, y) != _key(sharded, y)
  assert _key(sharded, y) == _key(jax.device_put(x, NamedSharding(mesh, P("data"))), y)
  struct = lambda spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  assert _key(struct(P()), y) != _key(struct(P("data")), y)


def test_the_decision_is_keyed_on_each_inputs_memory_kind():
  x, y = _batches()[0]
  on_device = x.sharding.with_memory_kind("device")
  on_host = jax.device_put(x, on_device.with_memory_kind("pinned_host"))
  assert _key(jax.device_put(x, on_device), y) != _key(on_host, y)
  # Inside a jitted step the memory kind is the aval's; its sharding is the same for both.
  traced = []
  keyed = jax.jit(lambda x: traced.append(_key(x, y)) or x)
  keyed(jax.device_put(x, on_device))
  keyed(on_host)
  assert len(traced) == 2 and traced[0] != traced[1]


def test_the_decision_is_keyed_on_the_target_by_value_not_by_id():
  batch = _batches()[0]
  keys = []
  for _ in range(2):  # a new, equal Target each time
    with optfuse.compiling_for(jax.devices()):
      keys.append(_key(*batch))
  assert keys[0] == keys[1]
  other = _registry.resolve(jax.devices())._replace(memory_bytes=1 << 30)
  with _backends.lowering_for(other):
    assert _key(*batch) != keys[0]


def test_the_guard_decides_again_for_inputs_placed_otherwise(monkeypatch):
  calls = []
  real = _guard.peak
  monkeypatch.setattr(_guard, "peak", lambda *a: calls.append(1) or real(*a))
  fx = optfuse.fuse(TX, guard=True)
  params, ((x, y),) = _params(), _batches()
  step = jax.jit(fx.value_and_update(_stack_loss))
  step(params, fx.init(params), x, y)
  assert len(calls) == 2
  # Replicated over a mesh of one device: the same bytes, placed otherwise.
  on_mesh = NamedSharding(jax.make_mesh((1,), ("data",)), P())
  params, x, y = jax.device_put((params, x, y), on_mesh)
  step(params, jax.device_put(fx.init(params), on_mesh), x, y)
  assert len(calls) == 4
