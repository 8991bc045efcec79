"""Test-wide settings.

The suite runs on the CPU, in one process per core (``pytest-xdist``: ``-n auto --dist
loadscope`` in ``pyproject.toml``; a module's tests stay in one process, so its module-scoped
fixtures, such as the executed notebook, run once). With the TPU compiler (libtpu) or the CUDA
plugin installed for the compile-target tests, JAX would otherwise probe for a TPU or a GPU when
it starts and log its failure; ``JAX_PLATFORMS=cpu`` (unless set already) keeps the default
backend on the CPU, and the targets' compile-only devices still come from their plugins
(``optfuse._targets._registry``).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu lets one process at a time hold it unless told that compile-only sharing is fine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The tests check that fused and unfused steps compute the same thing and hold the same buffers,
# never how fast the code runs: LLVM's optimisation level changes neither the HLO nor XLA's
# buffer assignment (``memory_analysis()``), and without it XLA:CPU compiles about a third
# faster (``tests/test_model_forms.py`` and ``tests/test_forward.py``: 202 s -> 131 s). The
# benchmark's figures never come from the tests.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()
