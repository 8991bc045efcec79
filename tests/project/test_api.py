"""The public API: ``optfuse.__all__`` is exactly what ``optfuse/__init__.py`` re-exports, each
name is documented in the API reference (docs/api.md), and ``from optfuse import *`` binds them
without importing Flax."""

import ast
import pathlib
import re
import subprocess
import sys

import optfuse
from tests._subprocess import checkout_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _reexported() -> list[str]:
  """The names ``optfuse/__init__.py`` binds with ``from ... import name as name``."""
  tree = ast.parse((ROOT / "optfuse" / "__init__.py").read_text())
  return [a.asname for n in tree.body if isinstance(n, ast.ImportFrom)
          for a in n.names if a.asname == a.name]


def test_all_lists_exactly_the_reexported_names_once_each():
  assert len(optfuse.__all__) == len(set(optfuse.__all__))
  assert sorted(optfuse.__all__) == sorted(_reexported())
  assert all(hasattr(optfuse, name) for name in optfuse.__all__)


def test_every_public_name_has_an_entry_in_the_api_reference():
  api = (ROOT / "docs" / "api.md").read_text()
  missing = [n for n in optfuse.__all__ if not re.search(rf"\boptfuse\.{n}\b", api)]
  assert not missing, f"docs/api.md documents none of {missing}"


def test_a_star_import_binds_the_api_and_leaves_flax_unimported():
  code = ("import sys\nfrom optfuse import *\nimport optfuse\n"
          "assert all(n in globals() for n in optfuse.__all__)\n"
          "print(sorted(m for m in sys.modules if m == 'flax' or m.startswith('flax.')))")
  out = subprocess.run([sys.executable, "-c", code], env=checkout_env(JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"
