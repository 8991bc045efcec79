"""The package's structure, as the docs' design page states it.

``optfuse/`` is laid out by layer: each subpackage (and each top-level module) is one layer, and
a module imports optfuse modules of its own layer or the layers below only. No import cycle; no
function longer than 80 lines (besides its docstring); no function imports an optfuse module (an
import that would hide a cycle). Modules are split by role, not by count: a module over the
soft budget of code lines is read for a second role, not cut at a line number.
"""

import ast
import io
import pathlib
import tokenize

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "optfuse"

# Top to bottom. A layer is a subpackage of optfuse or one of its top-level modules.
LAYERS = [
    ["bench"],                                         # the benchmark: may use everything
    ["__init__", "linen", "nnx", "_train_step"],       # the public face and the Flax adapters
    ["_analysis"],                                     # describe, memory_report, max_batch_size
    ["_fuse"],                                         # fuse(): a mode's engine behind one API
    ["_engines"],                                      # one engine per mode, offload, the guard
    ["_fusion"],                                       # taps, fused scans, row buffers, sums
    ["_plan"],                                         # tx.update split per leaf
    ["_jaxpr"],                                        # the interpreter, row evaluation
    ["_low_bit"],                                      # low-bit optimizer state
    ["_optimizers"],                                   # optax optimizers set up for stacks
    ["_targets"],                                      # compile targets, per-backend choices
    ["_base"],                                         # errors, input checks, leaf predicates
]
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
# Code lines (docstrings, comments and blank lines not counted) past which a module is read
# again for a second role. A module that holds one role may stay above it, named here with why.
CODE_LINE_BUDGET = 300
ONE_ROLE_ABOVE_BUDGET: dict[str, str] = {}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE).with_suffix("").parts
  return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py"))


def _path(module: str) -> pathlib.Path:
  path = PACKAGE.joinpath(*module.split("."))
  return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _unit(module: str) -> str:
  return module.split(".")[0]


def _tree(module: str) -> ast.Module:
  return ast.parse(_path(module).read_text())


def _resolve(dotted: str) -> str | None:
  """The optfuse module a dotted import names (``optfuse.x.y`` -> ``x.y``), or its package."""
  parts = dotted.split(".")[1:]
  while parts and ".".join(parts) not in MODULES:
    parts.pop()
  return ".".join(parts) if parts else "__init__"


def _optfuse_imports(node: ast.AST) -> set[str]:
  found = set()
  for n in ast.walk(node):
    if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "optfuse":
      for alias in n.names:
        found.add(_resolve(f"{n.module}.{alias.name}"))
    elif isinstance(n, ast.Import):
      found |= {_resolve(a.name) for a in n.names if a.name.split(".")[0] == "optfuse"}
  return found


def _code_lines(module: str) -> int:
  """Lines with code on them: docstrings, comments and blank lines are not counted."""
  source = _path(module).read_text()
  docstrings = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        docstrings |= set(range(body[0].lineno, body[0].end_lineno + 1))
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
      lines |= set(range(tok.start[0], tok.end[0] + 1))
  return len(lines - docstrings)


def test_every_module_belongs_to_a_layer():
  assert {_unit(m) for m in MODULES} == set(LAYER_OF)


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module):
  here = LAYER_OF[_unit(module)]
  up = {m for m in _optfuse_imports(_tree(module)) if LAYER_OF[_unit(m)] < here}
  assert not up, f"{module} imports {sorted(up)} from a layer above it"


def test_no_import_cycle():
  deps = {m: _optfuse_imports(_tree(m)) - {m} for m in MODULES}
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
def test_short_functions_and_no_imports_inside_them(module):
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


@pytest.mark.parametrize("module", MODULES)
def test_modules_within_the_code_line_budget_or_of_one_named_role(module):
  lines = _code_lines(module)
  assert lines <= CODE_LINE_BUDGET or module in ONE_ROLE_ABOVE_BUDGET, (
      f"{module} has {lines} lines of code: if it holds two roles, split it by role; if it holds "
      f"one, name it in ONE_ROLE_ABOVE_BUDGET with that role")


# The equation params whose form differs between JAX releases (a scan's counts became ``ft_in``
# in 0.11, its body and every other body a ``Jaxpr`` carrying its consts; ``call_hi_primitive``
# wraps a checkpoint's body under ``jax_remat3``): read in ``_jaxpr._interpreter`` only.
VERSION_SPECIFIC_PARAMS = frozenset({
    "num_consts", "num_carry", "ft_in", "ft_out", "jaxpr", "cond_nconsts", "body_nconsts",
    "cond_jaxpr", "body_jaxpr", "branches", "call_jaxpr", "_prim", "linear", "unroll", "reverse",
    "length",
})
INTERPRETER = "_jaxpr._interpreter"


def _is_primitive(node: ast.AST) -> bool:
  return isinstance(node, ast.Attribute) and node.attr == "primitive"


def _version_specific_reads(tree: ast.AST) -> list[str]:
  """Where ``tree`` reads a version-specific param by name or looks an equation's primitive up
  (``eqn.primitive is/==/in ...``, ``RULES.get(eqn.primitive)``, ``RULES[eqn.primitive]``)
  instead of asking the interpreter (``primitive_of``, ``scan_parts``...)."""
  found = []
  for n in ast.walk(tree):
    key = None
    if isinstance(n, ast.Subscript):
      key = n.slice
      if _is_primitive(key):
        found.append(f"line {n.lineno}: a table indexed by .primitive")
    elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
      key = n.args[0]
      if n.func.attr == "get" and _is_primitive(key):
        found.append(f"line {n.lineno}: a table looked up by .primitive")
      if n.func.attr != "get":
        key = None
      if n.func.attr == "jaxprs_in_params":
        found.append(f"line {n.lineno}: jaxprs_in_params")
    elif isinstance(n, ast.Compare):
      if any(_is_primitive(x) for x in (n.left, *n.comparators)):
        found.append(f"line {n.lineno}: a comparison of .primitive")
      if any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops):
        key = n.left
    if (isinstance(key, ast.Constant) and isinstance(key.value, str)
        and key.value in VERSION_SPECIFIC_PARAMS):
      found.append(f"line {n.lineno}: the param {key.value!r}")
  return found


def test_the_structural_check_finds_each_kind_of_read():
  snippet = ast.parse(
      'n = eqn.params["num_consts"]\n'
      'b = p.get("branches")\n'
      'ok = "ft_in" in eqn.params\n'
      'if eqn.primitive is P.scan_p: pass\n'
      'if eqn.primitive in TABLE: pass\n'
      'rule = RULES.get(eqn.primitive)\n'
      'rule = RULES[eqn.primitive]\n'
      'name, outs = eqn.primitive.name, eqn.params["shape"]\n')
  assert len(_version_specific_reads(snippet)) == 7


@pytest.mark.parametrize("module", [m for m in MODULES if m != INTERPRETER])
def test_version_specific_forms_are_read_in_the_interpreter_only(module):
  found = _version_specific_reads(_tree(module))
  assert not found, (f"{module} reads forms that differ between JAX versions: {found}; ask "
                     f"{INTERPRETER} (primitive_of, scan_parts, while_parts, cond_branches, "
                     "call_body, inner_jaxprs, bind)")


# The benchmark command runs, times and prints; the models it reports (hardware tables, cost
# and fit models) live in the library's layers, where users and tests reach them. Each bench
# module has one of these roles, and names the analysis and target modules whose models it
# runs or prints: a new model is written there and named here, not written in the bench.
BENCH_ROLES = {
    "bench": ("command", set()),                           # SUITES, run_suite
    "bench.__main__": ("command", {"_analysis._fit", "_analysis._slices", "_targets._registry"}),
    "bench._models": ("workload", set()),                  # the models it runs, in plain JAX
    "bench._forms": ("workload", set()),                   # scanned decoders as codebases write
    "bench._timing": ("timer", {"_analysis._memory"}),
    "bench._cache": ("runner", set()),                     # compile-only peaks on disk
    "bench._suite": ("runner", {"_analysis._floor", "_analysis._memory", "_analysis._report",
                                "_targets._compiled", "_targets._registry"}),
    "bench._fit_table": ("runner", {"_analysis._memory"}),
    "bench._slices": ("runner", {"_analysis._slices"}),
    "bench._what_fits": ("runner", {"_analysis._memory", "_analysis._what_fits",
                                    "_targets._compiled", "_targets._registry"}),
    "bench._host_fits": ("runner", {"_analysis._memory", "_analysis._what_fits",
                                    "_targets._compiled", "_targets._hosts"}),
    "bench._offload_cost": ("runner", {"_analysis._offload_cost", "_targets._compiled",
                                       "_targets._hosts"}),
    "bench._offload_time": ("timer", {"_analysis._params_memory"}),
    "bench._fsdp": ("runner", {"_analysis._collectives", "_analysis._fsdp", "_analysis._memory",
                               "_targets._compiled"}),
    "bench._report": ("printer", {"_targets._compiled"}),
}
BENCH_MODULES = [m for m in MODULES if _unit(m) == "bench"]


def test_nothing_in_the_library_imports_the_bench():
  importers = {m: sorted(i for i in _optfuse_imports(_tree(m)) if _unit(i) == "bench")
               for m in MODULES if _unit(m) != "bench"}
  assert not {m: i for m, i in importers.items() if i}


def test_every_bench_module_has_a_role_that_runs_times_or_prints():
  assert set(BENCH_MODULES) == set(BENCH_ROLES)
  assert {role for role, _ in BENCH_ROLES.values()} <= {
      "command", "workload", "runner", "timer", "printer"}


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_a_bench_module_reaches_the_models_it_reports_in_the_layers_below(module):
  below = {i for i in _optfuse_imports(_tree(module)) if _unit(i) in ("_analysis", "_targets")}
  assert below == BENCH_ROLES[module][1], (
      f"{module} uses {sorted(below)}: name them in BENCH_ROLES (a model the bench needs is "
      "written in _analysis or _targets, where users and tests reach it)")


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_no_bench_module_holds_a_worked_example(module):
  # A function with a doctest is one a user or a test calls on its own: a model, and the bench's
  # docstrings are not run (tests/project/test_docstrings.py), so it belongs below the bench.
  examples = [n.name for n in ast.walk(_tree(module))
              if isinstance(n, (ast.FunctionDef, ast.ClassDef))
              and ">>>" in (ast.get_docstring(n) or "")]
  assert not examples, f"{module} holds worked examples in {examples}: move them below the bench"


TESTS = pathlib.Path(__file__).resolve().parents[1]
TEST_FOLDERS = {"jaxpr", "plan", "fusion", "engines", "low_bit", "adapters", "analysis",
                "end_to_end", "project"}


def test_every_test_module_lives_in_the_folder_of_its_layer():
  # A flat tests/test_*.py has no layer; a folder not listed in tests/__init__.py is one the
  # reader is not told about.
  assert not sorted(p.name for p in TESTS.glob("test_*.py"))
  folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
  assert folders == TEST_FOLDERS
  described = ast.get_docstring(ast.parse((TESTS / "__init__.py").read_text()))
  assert all(f"``{folder}``" in described for folder in TEST_FOLDERS)
# The engines that wrap a mode's engine (the memory guard, offload), stacked around it by
# ``_fuse.make_engine``. A wrapper imports what it wraps and no module of the engines layer
# imports a wrapper: a mode's engine knows nothing of the wrappers, and a loss followed through
# a mode's step meets none of them.
ENGINE_WRAPPERS = frozenset({"_engines._guard", "_engines._offload"})


@pytest.mark.parametrize("module", [m for m in MODULES if _unit(m) == "_engines"])
def test_no_engine_imports_a_wrapper_stacked_around_it(module):
  wrappers = (_optfuse_imports(_tree(module)) & ENGINE_WRAPPERS) - {module}
  assert not wrappers, (f"{module} imports {sorted(wrappers)}: a wrapper is stacked around a "
                        "mode's engine by _fuse.make_engine, not called from inside one")


# What tracing learns travels as values (docs/design.md, "What crosses a custom_vjp"): a custom_vjp
# rule (a function given to ``defvjp``, or a tap's rule given to ``make_tap``) writes nothing to a
# Python object that outlives it, where a rule of another trace could read it. The objects a rule
# may touch, each checked where it is declared:
CHECKED_CHANNELS = {
    "phase": "two-pass backward's TwoPassPhase: the static pass and the cuts a step hands its "
             "rules between pullbacks; read() raises outside an open pass, and a pass that "
             "closes with a rule missing raises (_fusion._tap)",
}
MUTATING_METHODS = frozenset({"append", "extend", "add", "update", "insert", "setdefault", "pop",
                              "popitem", "clear", "discard", "remove", "ran"})


def _names_bound(fn: ast.AST) -> set[str]:
  """Names a function (and what it nests) binds: parameters, assignments, loop targets, defs."""
  bound = set()
  for n in ast.walk(fn):
    if isinstance(n, ast.arg):
      bound.add(n.arg)
    elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
      bound.add(n.id)
    elif isinstance(n, (ast.FunctionDef, ast.Lambda)) and hasattr(n, "name"):
      bound.add(n.name)
  return bound


def _custom_vjp_rules(tree: ast.Module) -> list[ast.FunctionDef]:
  """The functions given to ``defvjp`` or ``make_tap`` (directly, or as what a local factory
  called there returns), found in the scope that defines them."""
  rules = []
  for scope in ast.walk(tree):
    if not isinstance(scope, (ast.Module, ast.FunctionDef)):
      continue
    defs = {n.name: n for n in scope.body if isinstance(n, ast.FunctionDef)}
    for call in ast.walk(scope):
      if not isinstance(call, ast.Call):
        continue
      f = call.func
      if not ((isinstance(f, ast.Attribute) and f.attr == "defvjp")
              or (isinstance(f, ast.Name) and f.id == "make_tap")):
        continue
      for arg in call.args:
        if isinstance(arg, ast.Name) and arg.id in defs:
          rules.append(defs[arg.id])
        elif (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name)
              and arg.func.id in defs):  # a factory: the functions it returns by name
          factory = defs[arg.func.id]
          inner = {n.name: n for n in factory.body if isinstance(n, ast.FunctionDef)}
          rules += [inner[r.value.id] for r in ast.walk(factory) if isinstance(r, ast.Return)
                    and isinstance(r.value, ast.Name) and r.value.id in inner]
  return list({id(r): r for r in rules}.values())


def _outside_writes(rule: ast.FunctionDef) -> list[str]:
  """What ``rule`` writes to objects it did not make: a mutating method called on, an item or
  attribute assigned to, a free name; ``nonlocal`` and ``global``."""
  bound, found = _names_bound(rule), []
  for n in ast.walk(rule):
    target = None
    if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and n.func.attr in MUTATING_METHODS):
      target = n.func.value
    elif isinstance(n, (ast.Assign, ast.AugAssign)):
      for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
        if isinstance(t, (ast.Subscript, ast.Attribute)):
          target = t.value
    elif isinstance(n, (ast.Nonlocal, ast.Global)):
      found.append(f"{rule.name}, line {n.lineno}: {type(n).__name__.lower()} {n.names}")
    while isinstance(target, (ast.Attribute, ast.Subscript)):
      target = target.value
    if isinstance(target, ast.Name) and target.id not in bound:
      found.append(f"{rule.name}, line {n.lineno}: writes to {target.id!r}")
  return found


def _checked_reads(rule: ast.FunctionDef) -> set[str]:
  return {n.id for n in ast.walk(rule) if isinstance(n, ast.Name) and n.id in CHECKED_CHANNELS
          and n.id not in _names_bound(rule)}


def test_the_side_channel_check_finds_a_record_written_by_one_rule():
  snippet = ast.parse(
      "def fused(record):\n"
      "  info = []\n"
      "  def fwd(x):\n"
      "    info.append(x.shape)\n"
      "    record.fired[-1].add(0)\n"
      "    return x, ()\n"
      "  def bwd(res, ct):\n"
      "    nonlocal info\n"
      "    record.cuts = info[-1]\n"
      "    return (ct,)\n"
      "  def rule_of(i):\n"
      "    def rule(g, p, o):\n"
      "      record.ran(i)\n"
      "      return g, None\n"
      "    return rule\n"
      "  f.defvjp(fwd, bwd)\n"
      "  make_tap(rule_of(0))\n")
  rules = _custom_vjp_rules(snippet)
  assert sorted(r.name for r in rules) == ["bwd", "fwd", "rule"]
  assert len([w for r in rules for w in _outside_writes(r)]) == 5


@pytest.mark.parametrize("module", MODULES)
def test_no_custom_vjp_rule_writes_to_an_object_another_trace_reads(module):
  rules = _custom_vjp_rules(_tree(module))
  found = [w for rule in rules for w in _outside_writes(rule)]
  assert not found, (f"{module}: custom_vjp rules write to objects that outlive them: {found}. "
                     "Return what a rule finds as values: the forward rule's residuals (static "
                     "structure as a static pytree), the backward rule's cotangents")


def test_every_checked_channel_is_read_by_a_rule():
  read = {name for m in MODULES for rule in _custom_vjp_rules(_tree(m))
          for name in _checked_reads(rule)}
  assert read == set(CHECKED_CHANNELS)


def test_every_fault_injection_test_is_named_for_what_it_rejects():
  # CI runs the slow fault-injection tests by the ``rejection`` marker, which tests/conftest.py
  # sets on each test named ``..._rejects_...``: a test that injects a fault (``faults.``) or
  # requires a rejection margin (``REJECTED_BY``) under another name would never run there.
  tests = PACKAGE.parent / "tests"
  unnamed = []
  for path in sorted(tests.rglob("test_*.py")):
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
        body = ast.get_source_segment(text, node)
        injects = "faults." in body and "lr_off" in body or "REJECTED_BY" in body
        if injects and "_rejects_" not in node.name and not node.name.endswith("_rejects"):
          unnamed.append(f"{path.relative_to(tests)}::{node.name}")
  assert not unnamed, f"fault-injection tests the rejection marker misses: {unnamed}"
