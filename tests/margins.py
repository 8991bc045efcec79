"""The margins of the equivalence criteria: ``python -m tests.margins``.

For each criterion of ``tests/test_fault_rejection.py`` (and FSDP on eight simulated devices,
from ``tests/_sharding_worker.py``), prints the criterion's distance in units of its tolerance
for the passing fused run (at most 1 passes) and for the fused run of each injected error
(``tests/faults.py``). The tests run at ``--xla_backend_optimization_level=0``
(``tests/conftest.py``); set ``XLA_FLAGS`` to measure at that level, leave it unset for XLA's
default.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests import criteria, faults, test_fault_rejection, test_sharding  # noqa: E402

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


def main() -> None:
  rows = {name: criteria.margins(make(), faults.faults(make().stacked))
          for name, (make, _) in test_fault_rejection.CRITERIA.items()}
  rows["fsdp"] = fsdp_margins()
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; each criterion's distance in units "
        "of its tolerance (a run passes at <= 1), over the whole run / over losses and params")
  print(f"{'criterion':<18}" + "".join(f"{c:>22}" for c in COLUMNS))
  for name, row in rows.items():
    cells = (f"{row[c][0]:.3g} / {row[c][1]:.3g}" for c in COLUMNS)
    print(f"{name:<18}" + "".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
  sys.exit(main())
