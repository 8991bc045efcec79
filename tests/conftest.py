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
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu lets one process at a time hold it unless told that compile-only sharing is fine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# A row rule's own error (anything but ``NotRowwise``) refuses its leaf in a user's run, which is
# then updated after the loop (``optfuse._jaxpr._row_params.run_rule``); the tests see it raised.
os.environ.setdefault("OPTFUSE_RAISE_ROW_RULE_ERRORS", "1")
# The tests check that fused and unfused steps compute the same thing and hold the same buffers,
# never how fast the code runs: LLVM's optimisation level changes neither the HLO nor XLA's
# buffer assignment (``memory_analysis()``), and without it XLA:CPU compiles about a third
# faster (``tests/fusion/test_model_forms.py`` and ``tests/engines/test_forward.py``: 202 s ->
# 131 s). The benchmark's figures never come from the tests. Users run XLA's default level, whose
# code may round differently: ``OPTFUSE_TESTS_XLA_DEFAULT_OPT=1`` leaves XLA_FLAGS alone, and CI
# runs the equivalence tests so (``.ci/run``).
if (os.environ.get("OPTFUSE_TESTS_XLA_DEFAULT_OPT") != "1"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

# Many tests compile the same program (the optax reference of every mode, a step checked in
# several ways): JAX's persistent compilation cache, in a directory fresh for each run and shared
# by its xdist workers (the first process to import this file makes it, the workers inherit the
# variable), compiles each once: the whole suite took 755 s without it, 569 s with it, on two CPU
# cores; the cache is keyed by the program, the compile options and XLA_FLAGS, so nothing one run
# checks comes from another run or another ISA. Subprocesses the tests start use no cache.
_CACHE = "OPTFUSE_TESTS_COMPILATION_CACHE"
if _CACHE not in os.environ:
  import atexit
  import shutil
  import tempfile

  os.environ[_CACHE] = tempfile.mkdtemp(prefix="optfuse-tests-xla-cache-")
  atexit.register(shutil.rmtree, os.environ[_CACHE], True)

import jax  # noqa: E402  (after the environment above)
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)



def extended_ids() -> frozenset[str]:
  """The test ids of ``tests/extended.txt``: cases the README's command leaves to CI."""
  text = (pathlib.Path(__file__).parent / "extended.txt").read_text()
  return frozenset(line.split("#")[0].strip() for line in text.splitlines()
                   if line.split("#")[0].strip())


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items):
  """Marks ``rejection`` every test named for rejecting an error (``..._rejects_...``): the
  fault-injection tests of ``tests/faults.py``, which CI runs under ``-m slow`` too; and
  ``extended`` the cases ``tests/extended.txt`` lists."""
  extended = extended_ids()
  for item in items:
    if "_rejects_" in item.name:
      item.add_marker(pytest.mark.rejection)
    if item.nodeid in extended:
      item.add_marker(pytest.mark.extended)
