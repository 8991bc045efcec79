"""The margins of the equivalence criteria: ``python -m tests.margins``.

For each criterion of ``tests/end_to_end/test_fault_rejection.py`` (and FSDP on eight simulated
devices, from ``tests/_sharding_worker.py``, and ``optfuse.per_layer`` of each optimizer of
``tests/plan/test_per_layer.py`` against optax on the unrolled model), prints the criterion's
distance in units of its tolerance for the passing fused run (at most 1 passes) and for the fused
run of each injected error (``tests/faults.py``); then the widest passing distance over the
optimizers of ``tests/engines/test_backward_equivalence.py`` and ``tests/engines/test_forward.py``.
The tests run at ``--xla_backend_optimization_level=0`` (``tests/conftest.py``); set ``XLA_FLAGS``
to measure at that level, leave it unset for XLA's default.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optfuse  # noqa: E402
from tests import criteria, faults, models  # noqa: E402
from tests.end_to_end import test_fault_rejection  # noqa: E402
from tests.engines import test_backward_equivalence, test_forward, test_sharding  # noqa: E402
from tests.plan import test_per_layer  # noqa: E402

COLUMNS = ("passing", *faults.faults(lambda path: True))


def fsdp_margins() -> dict[str, tuple[float, float]]:
  """The FSDP criterion's distances (as ``criteria.margins``): the sharding worker's fused and
  faulted runs against its optax run on the same mesh."""
  config = test_sharding.FAULT_CONFIG
  with tempfile.TemporaryDirectory() as out:
    _, arrays = test_sharding._run_worker((config,), Path(out))
  run = lambda impl: test_sharding._only({k.removeprefix(f"{config}/"): v
                                          for k, v in arrays.items()}, impl)
  trajectory = lambda arrays: {k: v for k, v in arrays.items() if not k.startswith("state/")}
  want = run("optax")
  return {column: (criteria.matches_optax_distance(run(impl), want)[0],
                   criteria.matches_optax_distance(trajectory(run(impl)), trajectory(want))[0])
          for column, impl in zip(COLUMNS, ("backward", *test_sharding.worker.FAULTED))}


def per_layer_margins() -> dict[str, dict[str, tuple[float, float]]]:
  """The margins of ``optfuse.per_layer(tx)`` against optax on the unrolled model
  (``tests/plan/test_per_layer.py``), one row per inner optimizer; its check compares the
  losses and the params after each step, so both columns are that distance."""
  return {f"per_layer {name}": criteria.margins(test_per_layer.unrolled_criterion(name),
                                                faults.faults(lambda path: path.startswith(
                                                    "['layers']")))
          for name in test_per_layer.OPTIMIZERS}


def optimizer_margins(mode: str) -> tuple[float, str]:
  """The widest float32 distance (in units of the tolerance the tests use) over the optimizers
  that ``mode``'s equivalence tests train on ``models.tied_lm`` for 50 steps, and its
  optimizer."""
  params, batches = models.tied_lm_params(), models.tied_lm_batches()
  module = test_backward_equivalence if mode == "backward" else test_forward
  tol = {} if mode == "backward" else criteria.F32_FLOOR
  worst = (0.0, "")
  for name, make in module.OPTIMIZERS.items():
    want = models.run_optax(make(), params, batches, module.STEPS)
    if mode == "backward":
      got = models.run_fused(make(), mode, params, batches, module.STEPS)
    else:
      got = test_forward.train(optfuse.fuse(make(), mode=mode), params, batches, module.STEPS)
    worst = max(worst, (criteria.matches_optax_distance(got, want, **tol)[0], name))
  return worst


def main() -> None:
  rows = {name: criteria.margins(make(), faults.faults(make().stacked))
          for name, (make, _) in test_fault_rejection.CRITERIA.items()}
  rows["fsdp"] = fsdp_margins()
  rows.update(per_layer_margins())
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; each criterion's distance in units "
        "of its tolerance (a run passes at <= 1), over the whole run / over losses and params")
  print(f"{'criterion':<18}" + "".join(f"{c:>22}" for c in COLUMNS))
  for name, row in rows.items():
    cells = (f"{row[c][0]:.3g} / {row[c][1]:.3g}" for c in COLUMNS)
    print(f"{name:<18}" + "".join(f"{cell:>22}" for cell in cells))
  for mode in ("backward", "forward"):
    distance, name = optimizer_margins(mode)
    print(f"widest passing distance of the {mode} equivalence tests' optimizers: "
          f"{distance:.3g} ({name})")


if __name__ == "__main__":
  sys.exit(main())
