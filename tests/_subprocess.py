"""The environment of a test's child interpreter: this checkout's optfuse first on its path.

A test that starts a fresh interpreter (eight simulated devices need ``XLA_FLAGS`` before JAX
starts, ``jax.distributed`` needs processes) must run the code under test, not whichever optfuse
the environment has installed elsewhere.
"""

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def checkout_env(drop: tuple[str, ...] = (), **values: str) -> dict[str, str]:
  """``os.environ`` without ``drop``, with ``values``, and this checkout first on ``PYTHONPATH``."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  env.update(values)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
  return env
