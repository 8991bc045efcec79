"""JAX 0.11's forms of the control-flow equations, staged on the installed JAX (0.10).

JAX 0.11 changed what a traced jaxpr holds (jax-ml/jax, ``jax/_src/lax/control_flow/loops.py``
and ``jax/_src/core.py`` at 0.11.0):

* a ``scan`` no longer has the params ``num_consts`` and ``num_carry``: ``ft_in``, a
  ``FlatTree`` of its operands grouped as ``(consts, carry, xs)`` (each group's ``len`` counts
  its leaves; the consts may be a tuple of groups), and ``ft_out``, its outputs as
  ``(carry, ys)``, say where each group begins;
* ``ClosedJaxpr`` was merged into ``Jaxpr``: a body is a ``Jaxpr`` carrying its ``consts`` (the
  first of its inputs are their constvars), whose ``.jaxpr`` is itself; ``ClosedJaxpr`` is an
  alias. So is every body: a scan's ``jaxpr``, a ``while``'s ``cond_jaxpr``/``body_jaxpr``, a
  ``cond``'s ``branches``, a ``jit``'s ``jaxpr``.

``stage_as_jax011`` rewrites what ``jax.make_jaxpr`` returns into those forms, and teaches the
installed JAX to take them back where JAX itself reads them: each rewritten primitive's
``get_bind_params`` (which ``jax.core.eval_jaxpr`` and optfuse's ``_interpreter.bind`` call
before binding, as 0.11's own primitives accept their params) and ``partial_eval.dce_jaxpr`` on
a jaxpr holding them (0.11's DCE rules read 0.11's forms). Everything else optfuse does with the
equations it reads as it would on 0.11.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore
from jax.extend.core import primitives as P


@dataclasses.dataclass(frozen=True)
class Leaves:
  """A group of ``n`` leaves of a ``FlatTree``."""

  n: int

  def __len__(self) -> int:
    return self.n


@dataclasses.dataclass(frozen=True)
class Groups:
  """A ``FlatTree`` tuple: its ``len`` counts the leaves of its parts, ``unpack`` gives them."""

  parts: tuple

  def __len__(self) -> int:
    return sum(len(p) for p in self.parts)

  def unpack(self) -> tuple:
    return self.parts


class MergedJaxpr(jcore.Jaxpr):
  """JAX 0.11's ``Jaxpr``: it carries the values of its constvars (``consts``); ``.jaxpr`` is
  itself. Not a ``ClosedJaxpr`` of JAX 0.10."""

  def __init__(self, closed: Any):
    inner = closed.jaxpr
    super().__init__(inner.constvars, inner.invars, inner.outvars,
                     [_eqn_to_011(e) for e in inner.eqns], inner.effects, inner.debug_info)
    self.consts = list(closed.consts)

  @property
  def jaxpr(self) -> MergedJaxpr:
    return self


def _closed_010(body: Any) -> jcore.ClosedJaxpr:
  """A body in JAX 0.10's form: a ``ClosedJaxpr`` of equations in 0.10's forms."""
  inner = body.jaxpr
  jaxpr = jcore.Jaxpr(inner.constvars, inner.invars, inner.outvars,
                      [_eqn_to_010(e) for e in inner.eqns], inner.effects, inner.debug_info)
  return jcore.ClosedJaxpr(jaxpr, list(body.consts))


# The primitives whose bodies 0.11 stages as merged jaxprs, with the params holding them.
_MERGED = {P.scan_p: ("jaxpr",), P.while_p: ("cond_jaxpr", "body_jaxpr"), P.cond_p: ("branches",),
           P.jit_p: ("jaxpr",)}
# Primitives whose bodies keep their form; the equations inside are rewritten.
_OTHER_CALLS = (P.remat_p, P.custom_jvp_call_p, P.custom_vjp_call_p, P.closed_call_p)


def _map_bodies(primitive, params: dict, merged, other) -> dict:
  """``params`` with each body in ``_MERGED``'s params through ``merged``, any other jaxpr
  through ``other``."""
  out = {}
  for name, v in params.items():
    form = merged if name in _MERGED.get(primitive, ()) else other
    if isinstance(v, tuple) and v and isinstance(v[0], (jcore.Jaxpr, jcore.ClosedJaxpr)):
      out[name] = tuple(form(b) for b in v)
    elif isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)):
      out[name] = form(v)
    else:
      out[name] = v
  return out


def _params_to_011(primitive, params: dict, n_in: int, n_out: int) -> dict:
  out = _map_bodies(primitive, params, MergedJaxpr, _jaxpr_to_011)
  if primitive is P.scan_p and "num_consts" in out:
    nc, nk = out.pop("num_consts"), out.pop("num_carry")
    # The consts as JAX 0.11's partial evaluation groups them: residuals, then the others.
    out["ft_in"] = Groups((Groups((Leaves(0), Leaves(nc))), Leaves(nk), Leaves(n_in - nc - nk)))
    out["ft_out"] = Groups((Leaves(nk), Leaves(n_out - nk)))
  return out


def _params_to_010(primitive, params: dict) -> dict:
  out = _map_bodies(primitive, params, _jaxpr_to_010, _jaxpr_to_010)
  if primitive is P.scan_p and "ft_in" in out:
    consts, carry, _ = out.pop("ft_in").unpack()
    out.pop("ft_out")
    out.update(num_consts=len(consts), num_carry=len(carry))
  return out


def _eqn_to_011(eqn: jcore.JaxprEqn) -> jcore.JaxprEqn:
  return eqn.replace(params=_params_to_011(eqn.primitive, eqn.params, len(eqn.invars),
                                           len(eqn.outvars)))


def _eqn_to_010(eqn: jcore.JaxprEqn) -> jcore.JaxprEqn:
  return eqn.replace(params=_params_to_010(eqn.primitive, eqn.params))


def _jaxpr_to_011(j):
  if isinstance(j, MergedJaxpr):
    return j
  if isinstance(j, jcore.ClosedJaxpr):
    return jcore.ClosedJaxpr(_jaxpr_to_011(j.jaxpr), j.consts)
  return j.replace(eqns=[_eqn_to_011(e) for e in j.eqns])


def _jaxpr_to_010(j):
  if isinstance(j, MergedJaxpr):
    return _closed_010(j)
  if isinstance(j, jcore.ClosedJaxpr):
    return jcore.ClosedJaxpr(_jaxpr_to_010(j.jaxpr), j.consts)
  return j.replace(eqns=[_eqn_to_010(e) for e in j.eqns])


def holds_011(jaxpr: jcore.Jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr in it) holds an equation in JAX 0.11's forms."""
  for eqn in jaxpr.eqns:
    if "ft_in" in eqn.params or any(isinstance(v, MergedJaxpr) or (
        isinstance(v, tuple) and any(isinstance(b, MergedJaxpr) for b in v))
        for v in eqn.params.values()):
      return True
    if any(holds_011(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
      return True
  return False


def count_011(jaxpr: jcore.Jaxpr) -> dict[str, int]:
  """How many scans with ``ft_in`` and bodies in the merged form ``jaxpr`` holds, at any
  depth."""
  counts = {"ft_in": 0, "merged": 0}
  for eqn in jaxpr.eqns:
    counts["ft_in"] += "ft_in" in eqn.params
    for v in eqn.params.values():
      for b in v if isinstance(v, tuple) else (v,):
        counts["merged"] += isinstance(b, MergedJaxpr)
    for sub in jcore.jaxprs_in_params(eqn.params):
      for k, n in count_011(sub).items():
        counts[k] += n
  return counts


def stage_as_jax011(monkeypatch, seen: list | None = None) -> None:
  """From now until the test ends, ``jax.make_jaxpr`` stages JAX 0.11's forms (the module
  docstring); each jaxpr it returns is appended to ``seen``."""
  make_jaxpr, dce = jax.make_jaxpr, pe.dce_jaxpr

  def make_jaxpr_011(fun, *args, **kwargs):
    traced = make_jaxpr(fun, *args, **kwargs)

    def staged(*a, **k):
      out = traced(*a, **k)
      closed, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
      closed = jcore.ClosedJaxpr(_jaxpr_to_011(closed.jaxpr), closed.consts)
      if seen is not None:
        seen.append(closed)
      return (closed, *rest) if rest else closed

    return staged

  def dce_011(jaxpr, used_outputs, instantiate=False):
    if not holds_011(jaxpr):
      return dce(jaxpr, used_outputs, instantiate)
    pe.dce_jaxpr = dce  # JAX 0.10's rules, inner calls included, on 0.10's forms
    try:
      pruned, used_inputs = dce(_jaxpr_to_010(jaxpr), used_outputs, instantiate)
    finally:
      pe.dce_jaxpr = dce_011
    return _jaxpr_to_011(pruned), used_inputs

  monkeypatch.setattr(jax, "make_jaxpr", make_jaxpr_011)
  monkeypatch.setattr(pe, "dce_jaxpr", dce_011)
  for primitive in (*_MERGED, *_OTHER_CALLS):
    bind_params = primitive.get_bind_params
    monkeypatch.setattr(primitive, "get_bind_params",
                        lambda params, p=primitive, b=bind_params: b(_params_to_010(p, params)))
