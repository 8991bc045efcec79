"""Each equivalence criterion rejects the errors a fused step could make.

A criterion that passes the fused step proves "optax's math, unchanged" only as far as it would
fail a wrong update. Each criterion below runs a model with stacked layers (their update runs
inside the fused loop) and the optimizer its passing tests use; the fused step of
``fault(tx)`` (``tests/faults.py``: a learning rate 1 % off, step counts not advanced, one
layer's row not updated) is compared with the plain optax run of ``tx`` by the very criterion
and tolerance that pass ``fuse(tx)``: the check must fail, and by many times its tolerance
(``python -m tests.margins`` prints the distances). FSDP on eight devices is checked in
``test_sharding.py``, whose worker process has the devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from tests import criteria, faults, models
from tests.fusion import test_accumulate, test_loops

pytestmark = pytest.mark.equivalence

STEPS = 20
FAULTS = tuple(faults.faults(lambda path: True))


def _fused_run(params, batches, loss, mode: str = "backward", steps: int = STEPS,
               **fuse_kwargs):
  """``tx -> (losses, params, optax state)`` of ``steps`` fused steps, jitted once."""

  def run(tx):
    fx = optfuse.fuse(tx, mode=mode, **fuse_kwargs)
    losses, p, state = models.run_steps(fx.value_and_update(loss), params,
                                        fx.init(models.copy(params)), batches, steps)
    return (losses, *optfuse.to_optax_state(fx, p, state))

  return run


def _scanned(mode: str = "backward", dtype=jnp.float32, check=criteria.assert_matches_optax,
             distance=criteria.matches_optax_distance, tx=None, **fuse_kwargs):
  """A criterion on ``models.scanned_loss`` (four stacked layers) over STEPS steps."""
  params = jax.tree.map(lambda x: x.astype(dtype), models.stacked_params())
  batches, loss = models.tied_lm_batches(), models.scanned_loss
  tx = tx or (lambda: optax.adamw(1e-2, weight_decay=1e-2))
  return criteria.Criterion(
      fused=_fused_run(params, batches, loss, mode, **fuse_kwargs), tx=tx,
      reference=lambda: models.run_optax(tx(), params, batches, STEPS, loss_fn=loss),
      check=check, distance=distance, stacked=lambda path: path.startswith("['layers']"))


def _microbatches():
  """test_accumulate's criterion: K microbatches against optax's mean of K gradients."""
  params, data = test_loops._init(jax.random.PRNGKey(0)), test_accumulate._data()
  tx = lambda: optax.adamw(1e-2, weight_decay=0.1)
  loss = test_loops.scan_loss
  return criteria.Criterion(
      fused=lambda t: test_accumulate._fused(t, loss, "backward", params, STEPS, *data),
      tx=tx, reference=lambda: test_accumulate._manual_optax(tx(), loss, params, STEPS, *data),
      check=functools.partial(criteria.assert_matches_optax, **criteria.MICROBATCH),
      distance=functools.partial(criteria.matches_optax_distance, **criteria.MICROBATCH),
      stacked=lambda path: path.startswith("['layers']"))


_BF16 = dict(dtype=jnp.bfloat16, check=criteria.assert_within_ulps,
             distance=criteria.ulp_distance,
             tx=lambda: optax.adam(1e-2, mu_dtype=jnp.bfloat16))

# name -> (criterion factory, marks): the default suite runs one case of each criterion.
CRITERIA = {
    "float32": (_scanned, ()),
    "float32_forward": (functools.partial(_scanned, "forward"), (pytest.mark.slow,)),
    "offload": (functools.partial(_scanned, offload="state"), ()),
    "microbatches": (_microbatches, ()),
    "bfloat16": (functools.partial(_scanned, **_BF16), ()),
    "bfloat16_offload": (functools.partial(_scanned, offload="state", **_BF16),
                         (pytest.mark.slow,)),
}


@functools.cache
def _case(name: str) -> tuple[criteria.Criterion, object]:
  """The criterion and its reference run, built once per process."""
  criterion = CRITERIA[name][0]()
  return criterion, criterion.reference()


def _params(names):
  return [pytest.param(n, marks=CRITERIA[n][1]) for n in names]


@pytest.mark.parametrize("name", _params(CRITERIA))
def test_criterion_passes_the_fused_step_of_the_unchanged_optimizer(name):
  criterion, want = _case(name)
  criterion.check(criterion.fused(criterion.tx()), want)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("name", _params(CRITERIA))
def test_criterion_rejects_an_error_injected_into_the_fused_step_only(name, fault):
  criterion, want = _case(name)
  got = criterion.fused(faults.faults(criterion.stacked)[fault](criterion.tx()))
  with pytest.raises(AssertionError):
    criterion.check(got, want)
  distance, _ = criterion.distance(got, want)
  assert distance >= criteria.REJECTED_BY
