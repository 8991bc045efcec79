"""Scale-out on JAX SPMD: fused steps on a mesh of eight devices train like optax.

Eight CPU devices are simulated with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
which JAX reads once when it starts, so ``_sharding_worker.py`` runs the sharded steps in a
subprocess and this process (one device) keeps its own configuration. Each configuration is a
layout (data parallel: batch sharded, params replicated; FSDP: params and optimizer state
sharded along "fsdp", batch along "data"), a model (unrolled MLP, MLP scanned over stacked
layers) and a mesh axis type (Auto, Explicit). The default suite runs two configurations that
together cover both layouts, both models and both axis types; the rest, and the run of
``examples/data_parallel.py``, are slow. On the FSDP configuration the worker also trains
backward fusion of each wrong optimizer of ``tests/faults.py``, which the criterion that passes
the fused steps must reject.
"""

from __future__ import annotations

import collections
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
import _sharding_worker as worker  # noqa: E402

from tests import criteria  # noqa: E402
from tests._subprocess import checkout_env  # noqa: E402

WORKER = Path(__file__).parents[1] / "_sharding_worker.py"
STEPS = 50
DEFAULT_CONFIGS = ("fsdp/scan/auto", "data_parallel/mlp/explicit")
SLOW_CONFIGS = tuple(c for c in worker.ALL_CONFIGS if c not in DEFAULT_CONFIGS)
CONFIGS = ([pytest.param(c, id=c) for c in DEFAULT_CONFIGS]
           + [pytest.param(c, id=c, marks=pytest.mark.slow) for c in SLOW_CONFIGS])
FUSED = ("backward", "forward", "backward_offload", "backward_offload_read")
# Where the worker also trains backward fusion of each wrong optimizer of tests/faults.py.
FAULT_CONFIG = "fsdp/scan/auto"


def _run_worker(configs: tuple[str, ...], out: Path) -> tuple[dict, dict]:
  env = checkout_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(WORKER), str(out), "--configs", ",".join(configs),
       "--steps", str(STEPS), "--faults", FAULT_CONFIG],
      env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return json.loads((out / "report.json").read_text()), dict(np.load(out / "results.npz"))


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  """``get(config) -> (report, arrays)``; one worker run for the default configurations and,
  when a slow test asks, one for the others."""
  runs = {}

  def get(config: str) -> tuple[dict, dict]:
    group = DEFAULT_CONFIGS if config in DEFAULT_CONFIGS else SLOW_CONFIGS
    if group not in runs:
      runs[group] = _run_worker(group, tmp_path_factory.mktemp("sharding"))
    report, arrays = runs[group]
    prefix = f"{config}/"
    return ({k[len(prefix):]: v for k, v in report.items() if k.startswith(prefix)},
            {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})

  return get


@functools.cache
def _optax_on_one_device(model: str) -> dict[str, np.ndarray]:
  loss = functools.partial(worker.loss_fn, model=model)
  params = worker.init_params(model, 32)
  state = worker.TX.init(params)
  step = jax.jit(worker.optax_step(loss))
  losses = []
  for x, y in worker.batches(STEPS):
    value, params, state = step(params, state, x, y)
    losses.append(value)
  out = {f"params/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(params))}
  out.update({f"state/{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(state))})
  out["losses"] = np.stack(losses)
  return out


def _impl(report: dict, impl: str) -> dict:
  entry = report[impl]
  assert "error" not in entry, entry["error"]
  return entry


def _only(arrays: dict, impl: str) -> dict:
  return {k[len(impl) + 1:]: v for k, v in arrays.items() if k.startswith(f"{impl}/")}


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("config", CONFIGS)
def test_fused_on_eight_devices_matches_optax_on_eight_and_on_one(config, impl, eight_devices):
  report, arrays = eight_devices(config)
  _impl(report, "optax")
  _impl(report, impl)
  optax_8 = _only(arrays, "optax")
  # Same mesh, same collectives: only XLA's fusion of the update differs (a few ulps).
  criteria.assert_matches_optax(_only(arrays, impl), optax_8)
  # One device sums the batch gradient in another order than eight do; adamw carries those
  # float32 rounding differences through 50 steps.
  criteria.assert_matches_optax(optax_8, _optax_on_one_device(config.split("/")[1]), rtol=1e-4,
                                atol=1e-5)


@pytest.mark.parametrize("fault", worker.FAULTED)
def test_fsdp_criterion_rejects_an_error_injected_into_the_fused_step_only(fault, eight_devices):
  # tests/end_to_end/test_fault_rejection.py does the same for the criteria of one device.
  report, arrays = eight_devices(FAULT_CONFIG)
  _impl(report, fault)
  got, want = _only(arrays, fault), _only(arrays, "optax")
  with pytest.raises(AssertionError):
    criteria.assert_matches_optax(got, want)
  assert criteria.matches_optax_distance(got, want)[0] >= criteria.REJECTED_BY


@pytest.mark.parametrize("impl", ("optax", *FUSED))
@pytest.mark.parametrize("config", CONFIGS)
def test_step_returns_params_and_state_with_their_input_shardings(config, impl, eight_devices):
  report, _ = eight_devices(config)
  assert _impl(report, impl)["resharded"] == []


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("config", CONFIGS)
def test_fused_step_all_gathers_nothing_optax_does_not(config, impl, eight_devices):
  report, _ = eight_devices(config)
  optax_gathers = collections.Counter(_impl(report, "optax")["all_gathers"])
  fused_gathers = collections.Counter(_impl(report, impl)["all_gathers"])
  # An all-gather of a full optimizer-state leaf, or any extra gather, would show up here.
  assert fused_gathers - optax_gathers == collections.Counter()



@pytest.mark.slow  # a fresh interpreter, two trainings and their compiles: about 12 s of CPU
def test_data_parallel_example_runs_fsdp_on_eight_simulated_devices():
  env = checkout_env(drop=("XLA_FLAGS",), JAX_PLATFORMS="cpu")  # the example sets XLA_FLAGS
  example = Path(__file__).parents[2] / "examples" / "data_parallel.py"
  proc = subprocess.run([sys.executable, str(example), "--steps", "5", "--layout", "fsdp"],
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
  assert proc.stdout.startswith("8 devices (cpu), layout fsdp")
  # float32, same operations on the same mesh: a few ulps after 5 steps.
  assert float(lines["max |param difference| after 5 steps"]) < 1e-6
  # Adam's mu of the (64, 128) hidden weight: one eighth of its rows on each device.
  assert lines["adam mu of hidden.w"] == "P('data', None), (8, 128) per device"
