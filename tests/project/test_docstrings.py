"""Every example in the library's docstrings runs and shows what it says it shows."""

import doctest
import importlib
import pkgutil

import pytest

import optfuse

# The benchmark is not library API (and its plotting extra is not a test dependency).
MODULES = sorted(m.name for m in pkgutil.walk_packages(optfuse.__path__, "optfuse.")
                 if not m.name.startswith("optfuse.bench"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run_as_written(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
