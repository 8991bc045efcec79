"""A scan's body as the fused loops call it: its VJP on one iteration's rows, and where each
residual of that VJP comes from.

The forward loop of a fused scan (``_fused_scan``) stacks only the residuals that are neither
inputs of the iteration (param rows, constants: read again in the backward) nor computed from
the loop's constants alone (a causal mask, rotary tables: computed once before the loop, as
JAX's scan partial evaluation hoists them); ``probe_residuals`` sorts them at trace time by
following data dependencies through the traced body VJP.

A fully unrolled scan (penzai's ``LayerStack``) is compiled by XLA as straight-line code, where
the values JAX's VJP names as residuals are forwarded to their backward readers and cheap ones
are recomputed inside fusions: optax's step holds far fewer bytes than the residuals listed. A
rolled fused loop must stack every residual it names, so for such a scan the body's VJP is
taken under ``jax.checkpoint`` with ``narrow_matmuls_saveable``: the loop stacks the weight
matmul outputs no wider than the layer's hidden state and recomputes the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from optfuse._fusion._sites import Site
from optfuse._jaxpr import _interpreter, _rows


def split(values, mask):
  return [v for v, m in zip(values, mask) if m], [v for v, m in zip(values, mask) if not m]


def merge(selected, others, mask):
  it_s, it_o = iter(selected), iter(others)
  return [next(it_s) if m else next(it_o) for m in mask]


class Residuals(NamedTuple):
  """Where each residual of the body's VJP comes from in iteration ``l`` of the backward.

  A static pytree (no leaves; the value is its tree structure): the fused scan's forward rule
  returns it among its residuals, and JAX rebuilds it, with the residuals' tree, for the
  backward rule it pairs with that forward pass.

  Attributes:
    treedef: treedef of the VJP function (its leaves are the residuals).
    sources: per residual, ``("input", k)`` for the ``k``-th flat input of the body's float
      VJP (constants, carry, param rows after their path, other scanned rows), ``("saved",
      j)`` for the ``j``-th residual the forward loop stacks, or ``("invariant", j)`` for the
      ``j``-th residual computed from the constants alone (computed once, before the loop).
    needs_carry: whether some residual is a carry input (then the forward stacks the carries).
  """

  treedef: Any
  sources: tuple[tuple[str, int], ...]
  needs_carry: bool


jax.tree_util.register_static(Residuals)


class Body(NamedTuple):
  """The scan's body as the fused loops call it: its VJP on one iteration's rows."""

  eqn: jcore.JaxprEqn
  site: Site
  is_param_x: list
  fc: list
  fk: list
  fxo: list
  fout: list

  @property
  def parts(self) -> _interpreter.ScanParts:
    """The scan's counts, body and loop params."""
    return _interpreter.scan_parts(self.eqn)

  @property
  def length(self) -> int:
    return self.parts.length

  def body_rows(self, p_rows, index):
    """The body's inputs for the stored param rows: each row through its path."""
    return [_rows.apply_path(path, r, axis, index, self.length)
            for r, path, axis in zip(p_rows, self.site.paths, self.site.axes)]

  def vjp(self, consts, carry, q_rows, xo_rows):
    """The body's VJP with respect to its float inputs (``q_rows``: the param rows after their
    paths); non-float outputs come as aux. Returns ``(outs, pullback, flat_inputs)``."""
    body = self.parts.body
    fc, fk, fxo, fout = self.fc, self.fk, self.fxo, self.fout
    static_consts, static_carry = split(consts, fc)[1], split(carry, fk)[1]
    static_xo = split(xo_rows, fxo)[1]

    def float_body(f_consts, f_carry, f_params, f_xo):
      xs = merge(f_params, merge(f_xo, static_xo, fxo), self.is_param_x)
      out = _interpreter.evaluate(body.jaxpr, body.consts, [
          *merge(f_consts, static_consts, fc), *merge(f_carry, static_carry, fk), *xs])
      return split(out, fout)

    inputs = (split(consts, fc)[0], split(carry, fk)[0], list(q_rows), split(xo_rows, fxo)[0])
    if self.site.rolled:
      width = max([int(np.prod(np.shape(c))) for c in inputs[1]], default=0)
      float_body = jax.checkpoint(float_body, policy=narrow_matmuls_saveable(width))
    out_float, pullback, out_static = jax.vjp(float_body, *inputs, has_aux=True)
    return merge(out_float, out_static, fout), pullback, [x for part in inputs for x in part]


def narrow_matmuls_saveable(width: int):
  """A ``jax.checkpoint`` policy: save the outputs of matmuls without batch dimensions (a layer's
  weight projections) that have at most ``width`` elements (the layer's hidden state).

  Measured on penzai's Llama-like ``LayerStack`` (12 layers of d=512, tokens (2, 256), AdamW,
  before the TPU forward loop carried its stacks; compile-only peaks of backward fusion against
  optax's 1361 / 1197 / 963 MB on XLA:CPU / TPU v5e / H100): stacking every residual peaks at
  1311 / 1200 / 1302 MB; saving every matmul
  (``dots_saveable``) at 931 / 869 / 919 MB; every matmul without batch dimensions at 868 /
  825 / 846 MB; this policy at 767 / 724 / 754 MB (the q/k/v/out and down projections are
  saved; the norms, attention and the MLP's wider up projections are recomputed); saving
  nothing at 730 / 686 / 718 MB, for a second forward pass of every layer.
  """

  def policy(prim, *avals, **params) -> bool:
    if prim is not lax.dot_general_p:
      return False
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
    if lhs_batch or rhs_batch:
      return False
    lhs, rhs = avals
    free = lambda a, contract: int(np.prod([d for i, d in enumerate(a.shape) if i not in contract]))
    return free(lhs, lhs_contract) * free(rhs, rhs_contract) <= width

  return policy


def probe_residuals(body: Body, consts, carry, q_rows, xo_rows) -> tuple[Residuals, list]:
  """Where each residual of the body's VJP comes from, decided once at trace time, and the
  values of the loop-invariant ones.

  A residual that is an input of the iteration is read again in the backward; one that
  depends on the constants alone (found by following data dependencies through the traced
  VJP) is computed once before the loop; the others are stacked by the forward loop. The
  invariant ones are evaluated from the probe's own jaxpr, pruned to them (a causal mask, a
  rotary table), rather than from a second trace of the body's VJP.
  """
  found: list = []

  def residuals(consts, carry, q_rows, xo_rows):
    _, pullback, flat_inputs = body.vjp(consts, carry, q_rows, xo_rows)
    leaves = jax.tree.leaves(pullback)
    found.append((jax.tree.structure(pullback),
                  [next((k for k, x in enumerate(flat_inputs) if x is r), None) for r in leaves]))
    return leaves

  closed = jax.make_jaxpr(residuals)(consts, carry, q_rows, xo_rows)
  varying = frozenset([0])
  labels = ([frozenset()] * len(jax.tree.leaves(consts))
            + [varying] * len(jax.tree.leaves((carry, q_rows, xo_rows))))
  deps = _interpreter.output_dependencies(closed.jaxpr, labels)
  treedef, input_of = found[-1]
  sources, n_saved, n_invariant = [], 0, 0
  for k, d in zip(input_of, deps):
    if k is not None:
      sources.append(("input", k))
    elif not d:
      sources.append(("invariant", n_invariant))
      n_invariant += 1
    else:
      sources.append(("saved", n_saved))
      n_saved += 1
  nf = sum(body.fc), sum(body.fc) + sum(body.fk)
  needs_carry = any(kind == "input" and nf[0] <= k < nf[1] for kind, k in sources)
  residuals = Residuals(treedef, tuple(sources), needs_carry)
  keep = [kind == "invariant" for kind, _ in sources]
  if not any(keep):
    return residuals, []
  pruned, reads = _interpreter.prune(_interpreter.consts_as_inputs(closed.jaxpr), keep)
  flat = [*closed.consts, *jax.tree.leaves((consts, carry, q_rows, xo_rows))]
  return residuals, _interpreter.evaluate(pruned, (), [x for x, r in zip(flat, reads) if r])


def residuals_of(residuals: Residuals, pullback, kind: str) -> list:
  return [r for r, (s, _) in zip(jax.tree.leaves(pullback), residuals.sources) if s == kind]
