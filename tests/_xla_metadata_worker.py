"""A scanned model whose scan sits inside ``xla_metadata_call``, trained with optfuse.

Usage::

  python tests/_xla_metadata_worker.py

JAX 0.11 added ``jax.experimental.xla_metadata.xla_metadata_call``, a higher-order primitive
(``xla_metadata_call_p``, jax/_src/xla_metadata.py) whose body is an open jaxpr on the
equation's operands. optfuse registers it as a call-like primitive when it imports, where JAX
has it. On an older JAX, this script first installs a primitive made here under that name,
registered as JAX 0.11 registers its own (multiple results; params ``jaxpr``, ``xla_metadata``
and ``ad_metadata``), and only then imports optfuse: the same import-time path. It prints one
JSON line: whether the primitive is the real one, whether optfuse registered it, the dependency
labels of a call's outputs, the placement and reason ``describe`` gives the stacked leaf, and
the largest difference between optfuse's and optax's params after a few steps of each mode.
Nothing here depends on pytest: ``test_jax_versions.py`` runs this file as a script.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src import xla_metadata
from jax.extend import core as jcore
from jax.interpreters import mlir

REAL = hasattr(xla_metadata, "xla_metadata_call_p")


def _install_stand_in() -> None:
  """``xla_metadata_call_p`` for a JAX without it: evaluates its body, differentiated through
  the body's own rules."""
  prim = jcore.Primitive("xla_metadata_call")
  prim.multiple_results = True

  def impl(*args, jaxpr, xla_metadata, ad_metadata):
    del xla_metadata, ad_metadata
    return jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, ()))(*args)

  def jvp(primals, tangents, **params):
    tangents = [jnp.zeros_like(p) if type(t).__name__ == "Zero" else t
                for p, t in zip(primals, tangents)]
    return jax.jvp(lambda *a: impl(*a, **params), list(primals), tangents)

  prim.def_impl(impl)
  prim.def_abstract_eval(lambda *a, jaxpr, **_: [v.aval for v in jaxpr.outvars])
  jax.interpreters.ad.primitive_jvps[prim] = jvp
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
  xla_metadata.xla_metadata_call_p = prim


if not REAL:
  _install_stand_in()

import optfuse  # noqa: E402  (after the stand-in: optfuse registers what JAX has when imported)
from optfuse._jaxpr import _interpreter  # noqa: E402

PRIM = xla_metadata.xla_metadata_call_p
L, D, B, STEPS = 5, 8, 4, 5


def metadata_call(f):
  """``f`` staged as one ``xla_metadata_call`` equation."""
  if REAL:
    return xla_metadata.xla_metadata_call(f, tag="stack")

  def wrapped(*args):
    flat, tree = jax.tree.flatten(args)
    closed, out = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)),
                                 return_shape=True)(*flat)
    jaxpr = jcore.Jaxpr([], [*closed.jaxpr.constvars, *closed.jaxpr.invars],
                        closed.jaxpr.outvars, closed.jaxpr.eqns, closed.jaxpr.effects)
    outs = PRIM.bind(*closed.consts, *flat, jaxpr=jaxpr, xla_metadata=(("tag", "stack"),),
                     ad_metadata="same")
    return jax.tree.unflatten(jax.tree.structure(out), outs)

  return wrapped


def loss(p, x, y):
  stack = metadata_call(lambda layers, h: jax.lax.scan(
      lambda h, w: (jnp.tanh(h @ w["w"] + w["b"]), None), h, layers)[0])
  return jnp.mean((stack(p["layers"], x) @ p["head"] - y) ** 2)


def _dependencies() -> list[list[int]]:
  """The labels of each output of a call whose first output reads only its first operand."""
  f = metadata_call(lambda a, b: (a * 2.0, a + b))
  jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3)).jaxpr
  deps = _interpreter.output_dependencies(jaxpr, [frozenset([0]), frozenset([1])])
  return [sorted(d) for d in deps]


def _train(fx, params, batch):
  state = fx.init(params)
  step = jax.jit(fx.value_and_update(loss))
  for _ in range(STEPS):
    _, params, state = step(params, state, *batch)
  return fx.flush(params, state)[0]  # forward mode applies its last update here


def main() -> None:
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"layers": {"w": jax.random.normal(k[0], (L, D, D)) / np.sqrt(D),
                       "b": 0.1 * jax.random.normal(k[1], (L, D))},
            "head": jax.random.normal(k[2], (D, 2)) / np.sqrt(D)}
  batch = (jax.random.normal(k[3], (B, D)), jnp.ones((B, 2)))
  tx = optax.adamw(1e-2)
  where = optfuse.describe(tx, loss, params, *batch)
  reference = _train(optfuse.fuse(tx, mode="off"), params, batch)
  diffs = {}
  for mode in ("backward", "forward"):
    got = _train(optfuse.fuse(tx, mode=mode), params, batch)
    diffs[mode] = max(float(jnp.max(jnp.abs(a - b)))
                      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)))
  print(json.dumps({
      "real": REAL, "registered": _interpreter.CALL_PRIMITIVES.get(PRIM),
      "dependencies": _dependencies(), "placement": where["['layers']['w']"],
      "reason": where.reasons.get("['layers']['w']"), "max_diff": diffs}))


if __name__ == "__main__":
  main()
