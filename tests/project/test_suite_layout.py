"""The suite's split: what the README's test command runs, and what it leaves to CI.

``tests/extended.txt`` lists the slowest cases of the default suite, which ``python -m pytest``
leaves out and CI runs (``-m "extended and not slow"``, ``.ci/run``). An id that names no test
would leave nothing out, silently: each must name a test function that exists.
"""

import ast
import pathlib

from tests import conftest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _functions(path: pathlib.Path) -> set[str]:
  return {n.name for n in ast.walk(ast.parse(path.read_text()))
          if isinstance(n, ast.FunctionDef)}


def test_every_extended_id_names_a_test_that_exists():
  missing = []
  for node_id in sorted(conftest.extended_ids()):
    path, _, name = node_id.partition("::")
    function = name.split("[")[0]
    if not (ROOT / path).is_file() or function not in _functions(ROOT / path):
      missing.append(node_id)
  assert not missing, f"tests/extended.txt names tests that do not exist: {missing}"


def test_ci_runs_the_extended_cases():
  assert 'python -m pytest -m "extended and not slow"' in (ROOT / ".ci" / "run").read_text()
