"""Each equivalence criterion rejects the errors a fused step could make.

A criterion that passes the fused step proves "optax's math, unchanged" only as far as it would
fail a wrong update. Each criterion below runs a model with stacked layers (their update runs
inside the fused loop) and the optimizer its passing tests use; the fused step of
``fault(tx)`` (``tests/faults.py``: a learning rate 1 % off, step counts not advanced, one
layer's row not updated) is compared with the plain optax run of ``tx`` by the very criterion
and tolerance that pass ``fuse(tx)``: the check must fail, and by many times its tolerance
(``python -m tests.margins`` prints the distances). Every path of the fused step has its row:
each mode, each ``offload`` (the state, the params streamed, a mixed ``"auto"`` placement),
microbatches, bfloat16, the two-pass global norm, the memory guard, and Muon and the low-bit
state with their params streamed (the low-bit row against the unfused low-bit transformation
run by optax, by the low-bit spread criterion). FSDP on eight devices is checked in
``test_sharding.py``, whose worker process has the devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._analysis import _streams
from optfuse._base import _memory_spaces
from tests import criteria, faults, models
from tests.engines import test_offload_auto
from tests.fusion import test_accumulate, test_loops
from tests.low_bit import test_low_bit_fusion as low_bit_fusion

pytestmark = pytest.mark.equivalence

STEPS = 20
FAULTS = tuple(faults.faults(lambda path: True))


def _on_device(tx, fx, params, state, loss, batches):
  return params, state


def _params_on_host(tx, fx, params, state, loss, batches):
  """``offload="params"``: the loop stacks placed in host memory, as the step requires."""
  return optfuse.params_to_host(fx, loss, params, *batches[0]), state


def _mixed_placement(tx, fx, params, state, loss, batches):
  """``offload="auto"``: test_offload_auto's mixed plan (one stack's params and slots in host
  memory, the other's slots alone, a tapped leaf's slots, a leaf on the device)."""
  return _streams.place_streams(tx, params, state, test_offload_auto.MIXED,
                                _memory_spaces.to_host)


PLACE = {"state": _on_device, "params": _params_on_host, "auto": _mixed_placement}


def _fused_run(params, batches, loss, mode: str = "backward", steps: int = STEPS,
               wrap=lambda tx: tx, **fuse_kwargs):
  """``tx -> (losses, params, optax state)`` of ``steps`` fused steps of ``wrap(tx)``, jitted
  once, from params and state placed as its ``offload`` requires."""
  place = PLACE[fuse_kwargs.get("offload", "state")]

  def run(tx):
    tx = wrap(tx)
    fx = optfuse.fuse(tx, mode=mode, **fuse_kwargs)
    p, s = place(tx, fx, models.copy(params), fx.init(models.copy(params)), loss, batches)
    losses, p, state = models.run_steps(fx.value_and_update(loss), p, s, batches, steps)
    return (losses, *optfuse.to_optax_state(fx, p, state))

  return run


def _scanned(mode: str = "backward", dtype=jnp.float32, check=criteria.assert_matches_optax,
             distance=criteria.matches_optax_distance, tx=None, layers: int = 4, **fuse_kwargs):
  """A criterion on ``models.scanned_loss`` (``layers`` stacked layers) over STEPS steps."""
  params = jax.tree.map(lambda x: x.astype(dtype), models.stacked_params(layers=layers))
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
_CLIP_ADAMW = dict(tx=lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                          optax.adamw(1e-2, weight_decay=1e-2)))
_MUON = dict(tx=lambda: optax.contrib.muon(
    1e-2, muon_weight_dimension_numbers=optfuse.stacked_muon_dims), layers=6)


def _low_bit_streamed(mode: str = "backward"):
  """The 8-bit AdamW of ``optfuse.low_bit`` with its loop stacks streamed (``offload="params"``)
  against the same low-bit transformation run by plain optax code, by the low-bit spread
  criterion (its trajectory is chaotic: tests/low_bit/test_low_bit_fusion.py). The fault is
  injected into the transformation ``low_bit`` wraps, as in tests/low_bit/."""
  params, loss = low_bit_fusion.MODELS["axis0"]()
  batches, steps = models.tied_lm_batches(), low_bit_fusion.STEPS
  inner, bits = low_bit_fusion.INNER["adamw_8bit"]
  wrap = lambda tx: optfuse.low_bit(tx, bits, min_size=0)
  reference = lambda ulps: models.run_optax(wrap(inner()), models.nudge(params, ulps), batches,
                                            steps, loss_fn=loss)[:2]
  return criteria.Criterion(
      fused=_fused_run(params, batches, loss, mode, steps, wrap, offload="params"), tx=inner,
      reference=lambda: models.reference_spread(reference, params),
      check=lambda got, spread: models.assert_within_spread(got[:2], spread),
      distance=lambda got, spread: models.spread_distance(got[:2], spread),
      stacked=lambda path: path == "['layers']['w']", trajectory=lambda run: run)


# name -> (criterion factory, marks): the default suite runs one case of each criterion.
CRITERIA = {
    "float32": (_scanned, ()),
    "float32_forward": (functools.partial(_scanned, "forward"), (pytest.mark.slow,)),
    "offload": (functools.partial(_scanned, offload="state"), ()),
    "microbatches": (_microbatches, ()),
    "bfloat16": (functools.partial(_scanned, **_BF16), ()),
    "bfloat16_offload": (functools.partial(_scanned, offload="state", **_BF16),
                         (pytest.mark.slow,)),
    "offload_params": (functools.partial(_scanned, offload="params"), ()),
    "offload_params_forward": (functools.partial(_scanned, "forward", offload="params"),
                               (pytest.mark.slow,)),
    "offload_auto": (functools.partial(_scanned, offload="auto"), ()),
    "two_pass": (functools.partial(_scanned, global_ops="two_pass", **_CLIP_ADAMW), ()),
    "guard": (functools.partial(_scanned, guard=True), ()),
    "muon_offload_params": (functools.partial(_scanned, offload="params", **_MUON), ()),
    "low_bit_offload_params": (_low_bit_streamed, ()),
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
