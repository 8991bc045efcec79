"""Small jaxpr utilities: gradient-dependency analysis, slicing and evaluation.

optfuse never guesses what an optax transform does from its name. It traces ``tx.update`` to a
jaxpr and follows data dependencies: which gradient leaves each output depends on. The same
jaxpr, sliced down to the outputs of one parameter leaf, is what runs in that leaf's backward rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: DCE through cond/calls
from jax.extend import core as jcore
from jax.extend.core import primitives as P

Deps = frozenset

# Higher-order primitives whose body is a single jaxpr taking the same operands as the equation
# itself, with the name of the param that holds it: dependencies are followed through the body
# exactly, and the row evaluator and the loss interpreter evaluate the body on their own values.
CALL_PRIMITIVES: dict[jcore.Primitive, str] = {
    P.jit_p: "jaxpr",
    P.closed_call_p: "call_jaxpr",
    P.call_p: "call_jaxpr",
    P.remat_p: "jaxpr",
    P.custom_jvp_call_p: "call_jaxpr",
    P.custom_vjp_call_p: "call_jaxpr",
}


def call_body(eqn: jcore.JaxprEqn) -> jcore.ClosedJaxpr | None:
  """The body of a call-like equation (``CALL_PRIMITIVES``) as a closed jaxpr, else ``None``."""
  name = CALL_PRIMITIVES.get(eqn.primitive)
  inner = None if name is None else eqn.params.get(name)
  if inner is None:
    return None
  body = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())
  return body if len(body.jaxpr.invars) == len(eqn.invars) else None


def _read_deps(env: dict, atom: Any) -> Deps:
  if isinstance(atom, jcore.Literal):
    return Deps()
  return env.get(atom, Deps())


def _equation_dependencies(eqn: jcore.JaxprEqn, ins: list[Deps]) -> list[Deps]:
  """Labels of ``eqn``'s outputs from the labels of its inputs."""
  body = call_body(eqn)
  if body is not None:
    return output_dependencies(body.jaxpr, ins)
  if eqn.primitive is P.cond_p:
    index, ops = ins[0], ins[1:]
    branch_outs = [output_dependencies(b.jaxpr, ops) for b in eqn.params["branches"]]
    return [index.union(*col) for col in zip(*branch_outs)]
  return [Deps().union(*ins)] * len(eqn.outvars)


def _propagate(jaxpr: jcore.Jaxpr, in_deps: Sequence[Deps]):
  """Yields each equation with its output labels, after recording them."""
  env: dict = dict(zip(jaxpr.invars, in_deps))
  for eqn in jaxpr.eqns:
    outs = _equation_dependencies(eqn, [_read_deps(env, v) for v in eqn.invars])
    for v, d in zip(eqn.outvars, outs):
      env[v] = d
    yield eqn, outs
  yield None, [_read_deps(env, v) for v in jaxpr.outvars]


def output_dependencies(jaxpr: jcore.Jaxpr, in_deps: Sequence[Deps]) -> list[Deps]:
  """Propagates labels from the inputs of ``jaxpr`` to its outputs.

  Args:
    jaxpr: an open jaxpr (constvars carry no labels).
    in_deps: one set of labels per invar.

  Returns:
    One set of labels per outvar: the union of the labels of every input it depends on.
    Dependencies through ``cond`` and call-like primitives are exact; through loops
    (``scan``, ``while``) every output depends on every input, which is conservative.
  """
  *_, (_, outs) = _propagate(jaxpr, in_deps)
  return outs


def first_mixing_equation(jaxpr: jcore.Jaxpr, in_deps: Sequence[Deps]) -> jcore.JaxprEqn | None:
  """The first top-level equation whose output depends on two or more labels."""
  for eqn, outs in _propagate(jaxpr, in_deps):
    if eqn is not None and any(len(d) > 1 for d in outs):
      return eqn
  return None


def prune(jaxpr: jcore.Jaxpr, used_outputs: Sequence[bool]) -> tuple[jcore.Jaxpr, list[bool]]:
  """Dead-code elimination, through higher-order primitives (cond branches, calls, loops).

  Args:
    jaxpr: an open jaxpr without constvars.
    used_outputs: which outvars to keep.

  Returns:
    The jaxpr computing only the kept outputs, whose invars are only the inputs it reads, and
    which of the original invars those are.
  """
  return pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=False)


def consts_as_inputs(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
  """The same jaxpr with its constvars moved to the front of its invars."""
  return pe.convert_constvars_jaxpr(jaxpr)


def evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args`` (one per invar)."""
  return jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, consts))(*args)
