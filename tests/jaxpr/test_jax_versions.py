"""optfuse reads the equations every supported JAX stages (docs/limits.md, "JAX versions").

What later JAX versions stage differently is checked here with what the installed JAX already
offers: the call-like equations of ``jax.jit``, ``jax.checkpoint``, ``jax.custom_jvp`` and
``jax.custom_vjp``, also under the upgrade flags ``jax_remat3`` and ``jax_custom_vjp3`` that a
later release turns on; primitives found by object, never by a name that a release may change;
JAX 0.11's ``xla_metadata_call``, the real one or one made to stand in for it; the runtime
error class under each of its names. JAX 0.11's scans (``ft_in``) and bodies (a ``Jaxpr``
carrying its consts) go through every walker in ``tests/jaxpr/test_jax011_forms.py``. The suite's
``jax_upgrades`` subset runs whole trainings under each flag (``JAX_REMAT3=1 python -m pytest -m
"jax_upgrades and not slow"``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from optfuse._jaxpr import _interpreter

pytestmark = pytest.mark.jax_upgrades

ROOT = Path(__file__).parents[2]
WORKER = Path(__file__).parents[1] / "_xla_metadata_worker.py"


@pytest.fixture(params=[None, "jax_remat3", "jax_custom_vjp3"])
def upgrade(request):
  """JAX's defaults, or one upgrade flag turned on (each wrapper reads it when it is made)."""
  flag = request.param
  before = flag and getattr(jax.config, flag)
  if flag:
    jax.config.update(flag, True)
  yield flag
  if flag:
    jax.config.update(flag, before)


def _custom_jvp(f):
  g = jax.custom_jvp(f)
  g.defjvp(lambda primals, tangents: (f(*primals), f(*tangents)))  # f is linear in a, b
  return g


def _custom_vjp(f):
  g = jax.custom_vjp(f)
  g.defvjp(lambda *a: (f(*a), a), lambda a, ct: jax.vjp(f, *a)[1](ct))
  return g


WRAPPERS = {
    "jit": (jax.jit, "jit_p"),
    "checkpoint": (jax.checkpoint, "remat_p"),
    "custom_jvp": (_custom_jvp, "custom_jvp_call_p"),
    "custom_vjp": (_custom_vjp, "custom_vjp_call_p"),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_every_call_wrapper_stages_a_call_primitive_whose_body_optfuse_follows(upgrade, wrapper):
  wrap, replaced = WRAPPERS[wrapper]
  f = wrap(lambda a, b: (a * 2.0, a + b))
  jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3)).jaxpr
  (eqn,) = jaxpr.eqns
  primitive = _interpreter.primitive_of(eqn)
  assert primitive is getattr(jax.extend.core.primitives, replaced), eqn.primitive
  assert primitive in _interpreter.CALL_PRIMITIVES
  body = _interpreter.call_body(eqn)
  assert body is not None and len(body.jaxpr.invars) == len(eqn.invars)
  # Exact through the body: the first output reads the first operand only.
  deps = _interpreter.output_dependencies(jaxpr, [frozenset([0]), frozenset([1])])
  assert deps == [frozenset([0]), frozenset([0, 1])]


def test_checkpoint_options_are_read_from_either_form(upgrade):
  policy = jax.checkpoint_policies.dots_saveable
  f = jax.checkpoint(lambda a: jnp.sin(a @ a), policy=policy)
  (eqn,) = jax.make_jaxpr(f)(jnp.ones((3, 3))).jaxpr.eqns
  assert _interpreter.remat_options(eqn)["policy"] is policy


def test_scan_parts_are_read_from_the_equation():
  def loss(k, x, xs):
    return jax.lax.scan(lambda c, w: ((jnp.tanh(c[0] @ w) * k, c[1] + 1), c[0]),
                        (x, 0), xs)

  jaxpr = jax.make_jaxpr(loss)(2.0, jnp.ones(3), jnp.ones((4, 3, 3))).jaxpr
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is jax.extend.core.primitives.scan_p]
  parts = _interpreter.scan_parts(eqn)
  assert (parts.num_consts, parts.num_carry, parts.length) == (1, 2, 4)
  assert len(eqn.invars) == parts.num_consts + parts.num_carry + 1
  assert len(parts.body.jaxpr.invars) == len(eqn.invars)


def _primitive_name_reads(tree: ast.AST) -> list[int]:
  """The lines where a primitive's ``.name`` is compared with something."""
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      for side in [node.left, *node.comparators]:
        if (isinstance(side, ast.Attribute) and side.attr == "name"
            and isinstance(side.value, ast.Attribute) and side.value.attr == "primitive"):
          lines.append(node.lineno)
  return lines


def test_optfuse_finds_primitives_by_object_never_by_name():
  # Primitive names change between releases ("pjit" became "jit" in JAX 0.7); the objects
  # come from jax.extend.core.primitives, or from _interpreter for those it does not export.
  found = {}
  for path in sorted((ROOT / "optfuse").rglob("*.py")):
    text = path.read_text()
    lines = _primitive_name_reads(ast.parse(text))
    if lines or '"pjit"' in text or "'pjit'" in text:
      found[str(path.relative_to(ROOT))] = lines
  assert not found


def test_every_name_of_the_runtime_error_is_the_class_optfuse_catches():
  # optfuse catches jax.errors.JaxRuntimeError (_targets); jaxlib also names it XlaRuntimeError
  # (jaxlib/xla_client.py), an alias through JAX 0.11.
  import jaxlib.xla_client
  names = [getattr(module, name) for module in (jax.errors, jaxlib.xla_client)
           for name in ("JaxRuntimeError", "XlaRuntimeError") if hasattr(module, name)]
  assert names and all(issubclass(cls, jax.errors.JaxRuntimeError) for cls in names)


def test_a_scan_inside_xla_metadata_call_is_updated_after_the_loop_exactly_and_described():
  # JAX 0.11's xla_metadata_call, or on an older JAX a primitive made to stand in for it before
  # optfuse is imported (the worker's docstring): a call-like primitive whose body optfuse does
  # not rewrite, so the stacked leaves it scans get the exact update after the loop.
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
  done = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  assert got["registered"] == "jaxpr"
  assert got["dependencies"] == [[0], [0, 1]]
  assert got["placement"] == "tap"
  assert "inside an xla_metadata_call" in got["reason"]
  # float32, 5 steps, the same operations as optax compiled into another program, where XLA
  # may contract differently (FMA): 1e-5 is ~100 ulps of values of order 1.
  assert max(got["max_diff"].values()) <= 1e-5


@pytest.mark.parametrize("mode", ["backward", "forward", "two_pass"])
def test_no_jaxpr_optfuse_builds_lacks_debug_info(mode):
  """JAX deprecates a ``core.Jaxpr`` built without debug info (jax issue 26480): a later
  release may refuse it. optfuse's jaxprs take the debug info of the one they come from."""
  import optax

  import optfuse
  from tests import models

  tx = optax.adamw(1e-3)
  if mode != "backward":  # a global transform, for forward mode and the two-pass stage
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
  fx = (optfuse.fuse(tx, mode="backward", global_ops="two_pass") if mode == "two_pass"
        else optfuse.fuse(tx, mode=mode))
  params = models.stacked_params()
  batch = models.tied_lm_batches()[0]
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*missing a DebugInfo", category=DeprecationWarning)
    jax.jit(fx.value_and_update(models.scanned_loss)).lower(params, fx.init(params), *batch)
    optfuse.describe(fx, models.scanned_loss, params, *batch)
    optfuse.memory_report(models.scanned_loss, tx, params, *batch,
                          global_ops="two_pass" if mode == "two_pass" else None)
