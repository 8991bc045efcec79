"""The package's structure, as the README's Design section states it.

Each module belongs to one layer and imports optfuse modules of its own layer or the layers
below only; no module is longer than 400 lines and no function than 80 (besides its docstring);
no function imports an optfuse module (an import that would hide a cycle).
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "optfuse"

# Top to bottom, as in the README's Design table.
LAYERS = [
    ["__init__", "_fuse", "_describe", "_memory", "_fit", "_train_step", "linen", "nnx"],
    ["_engine", "_off", "_backward", "_guard", "_two_pass", "_forward", "_forward_state",
     "_forward_placement", "_offload_engine"],
    ["_fused_step", "_tap", "_loops", "_sites", "_fused_scan", "_scan_body", "_row_buffers",
     "_accumulate", "_apply"],
    ["_plan", "_split", "_global"],
    ["_jaxpr", "_rows", "_row_rules", "_in_place"],
    ["_checks", "_leaves", "_errors", "_targets", "_placement", "_offload", "_backends",
     "_compiled"],
]
LAYER_OF = {module: depth for depth, modules in enumerate(LAYERS) for module in modules}
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def _tree(module: str) -> ast.Module:
  return ast.parse((PACKAGE / f"{module}.py").read_text())


def _optfuse_imports(node: ast.AST) -> set[str]:
  found = set()
  for n in ast.walk(node):
    if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "optfuse":
      parts = n.module.split(".")
      found |= {a.name for a in n.names} if len(parts) == 1 else {parts[1]}
    elif isinstance(n, ast.Import):
      found |= {a.name.split(".")[1] for a in n.names if a.name.startswith("optfuse.")}
  return found - {"bench"}


def test_every_module_has_a_layer():
  assert sorted(LAYER_OF) == MODULES


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module):
  up = {m for m in _optfuse_imports(_tree(module)) if LAYER_OF[m] < LAYER_OF[module]}
  assert not up, f"{module} imports {sorted(up)} from a layer above it"


def test_no_import_cycle():
  deps = {m: _optfuse_imports(_tree(m)) for m in MODULES}
  done, active = set(), []

  def visit(m):
    assert m not in active, f"import cycle: {' -> '.join([*active, m])}"
    if m in done:
      return
    active.append(m)
    for d in sorted(deps[m]):
      visit(d)
    active.pop()
    done.add(m)

  for m in MODULES:
    visit(m)


@pytest.mark.parametrize("module", MODULES)
def test_small_modules_and_functions(module):
  text = (PACKAGE / f"{module}.py").read_text()
  assert text.count("\n") <= 400, f"{module} has {text.count(chr(10))} lines"
  for fn in ast.walk(_tree(module)):
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    body = fn.body
    if (len(body) > 1 and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      body = body[1:]
    lines = fn.end_lineno - body[0].lineno + 1
    assert lines <= 80, f"{module}.{fn.name} has {lines} lines besides its docstring"
    nested = {i for n in fn.body for i in _optfuse_imports(n)}
    assert not nested, f"{module}.{fn.name} imports {sorted(nested)} inside the function"
