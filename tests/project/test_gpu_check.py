"""``.ci/gpu_check``, the script for a GPU machine with a newer JAX, is valid bash and names
only what exists: the pytest markers of its marker expressions, the test it runs by node id, and
the benchmark's options. The script runs on a GPU only; this checks it without one."""

import pathlib
import re
import shlex
import subprocess

from optfuse.bench import __main__ as bench

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "gpu_check"


def _assigned(name: str) -> str:
  """The value the script assigns to ``name`` at its top level (``NAME="..."``)."""
  (value,) = re.findall(rf'^{name}="([^"]*)"$', SCRIPT.read_text(), re.MULTILINE)
  return value


def _markers_of(expression: str) -> set[str]:
  return set(re.findall(r"\w+", expression)) - {"and", "or", "not"}


def test_the_script_is_valid_bash():
  subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_its_marker_expressions_name_declared_markers():
  # pyproject's markers list, '  "name: what it marks",' a line (Python 3.10 has no tomllib).
  declared = set(re.findall(r'^\s+"(\w+):', (REPO / "pyproject.toml").read_text(), re.MULTILINE))
  assert {"slow", "equivalence"} <= declared
  expressions = [_assigned("EQUIVALENCE_MARKERS"),
                 *re.findall(r'-m "([^"$]+)"', SCRIPT.read_text())]
  assert expressions
  for expression in expressions:
    assert _markers_of(expression) <= declared, expression
  tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
  assert "pytest.mark.equivalence" in tests


def test_the_test_it_runs_by_node_id_exists():
  path, function = _assigned("LOW_BIT_TESTS").split("::")
  assert re.search(rf"^def {function}\(", (REPO / path).read_text(), re.MULTILINE), path


def test_its_benchmark_options_are_the_benchmarks():
  args = bench._parser().parse_args(shlex.split(_assigned("BENCH_ARGS")))
  assert args.suite == "loops"


def test_the_docs_say_how_to_run_it():
  assert "bash .ci/gpu_check" in (REPO / "docs" / "limits.md").read_text()
