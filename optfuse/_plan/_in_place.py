"""Which whole updates XLA runs in place: the buffer analysis of one leaf's update jaxpr.

A leaf's update (its ``Plan`` group: ``(update, *new_slots)`` from the flat inputs ``(consts,
grads, state, params, *cuts)``) overwrites the param and its state slots. Run whole, XLA writes
them in place in a few elementwise passes when no output needs an old value another output
overwrites. When one does (Lion's step reads the old momentum beside the new), or when two
outputs read a full-size intermediate (the clipped gradient, read by both of Adam's moments),
XLA holds a full-size temporary, which a row loop holds one row of. Both questions are answered
on the jaxpr, from data dependencies alone (``_interpreter.direct_dependencies``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from jax.extend import core as jcore

from optfuse._jaxpr import _interpreter

Deps = _interpreter.Deps


@functools.lru_cache(maxsize=1024)  # once per leaf group: plans are cached per signature
def in_place(jaxpr: jcore.Jaxpr, reads: Sequence[bool], leaf: int, state_outs: Sequence[int],
             consts: int, n: int, m: int) -> bool:
  """Whether the update of param ``leaf`` runs whole in place.

  Args:
    jaxpr: the update, from the flat inputs ``reads`` selects to ``(update, *new_slots)``.
    reads: which of the flat inputs ``(consts, grads, state, params, *cuts)`` it reads (a
      tuple, like ``state_outs``: the answers are cached).
    leaf: the param leaf it updates.
    state_outs: the state leaves its new slots replace.
    consts: how many constants lead the flat inputs; ``n`` params, ``m`` state leaves.

  Returns:
    True when it reads no cut and no array of another leaf or state leaf (the clipping factor
    makes a full-size clipped gradient; another leaf's buffers are overwritten by their own
    update while this one reads them; scalars such as Adam's count cost nothing to keep), and
    each output reads, of the buffers the update overwrites (the param and its slots), only its
    own old value and the others' new values.
  """
  flat = [k for k, r in enumerate(reads) if r]
  param = consts + n + m + leaf
  label = {param: -1, **{consts + n + k: k for k in state_outs}}
  own = {consts + leaf, *label}
  if any(k >= consts + 2 * n + m or (k >= consts and k not in own and v.aval.size > 1)
         for k, v in zip(flat, jaxpr.invars)):
    return False
  in_deps = [Deps([label[k]]) if k in label else Deps() for k in flat]
  direct = _interpreter.direct_dependencies(jaxpr, in_deps, jaxpr.outvars[1:])
  return all(d <= {own_buffer} for d, own_buffer in zip(direct, [-1, *state_outs]))


@functools.lru_cache(maxsize=1024)
def cut_gradient_split(jaxpr: jcore.Jaxpr, reads: Sequence[bool], leaf: int, consts: int, n: int,
                       m: int) -> tuple[tuple[jcore.Jaxpr, tuple[bool, ...]],
                                        tuple[jcore.Jaxpr, tuple[bool, ...]]] | None:
  """The update (as ``in_place`` takes it) split at the value it computes from its gradient and
  the cuts alone, when the rest reads the gradient and the cuts only through that value.

  Returns:
    ``((head, head_reads), (tail, tail_reads))``: the head from the flat inputs to that value
    (the clipped gradient, shaped like the gradient), the tail from the flat inputs with that
    value in the gradient's place to the update's outputs, reading no cut; or ``None`` (no cut,
    or a cut read elsewhere, such as ``apply_if_finite``'s flag gating the state). The value is
    the last such one in the jaxpr: as much of the gradient's own computation as possible.
  """
  flat = [k for k, r in enumerate(reads) if r]
  grad, cuts = consts + leaf, [k for k in flat if k >= consts + 2 * n + m]
  if grad not in flat or not cuts:
    return None
  grad_var = jaxpr.invars[flat.index(grad)]
  in_deps = [Deps([0]) if k == grad else Deps([1]) if k in cuts
             else Deps([2]) if k >= consts else Deps() for k in flat]
  labels = _interpreter.variable_dependencies(jaxpr, in_deps)
  shape, dtype = grad_var.aval.shape, grad_var.aval.dtype
  candidates = [v for e in jaxpr.eqns for v in e.outvars
                if 0 in labels.get(v, ()) and labels[v] <= {0, 1}
                and v.aval.shape == shape and v.aval.dtype == dtype]
  for value in reversed(candidates):
    if any(d & {0, 1} for d in _interpreter.direct_dependencies(jaxpr, in_deps, [value])):
      continue
    (head, head_used), (tail, tail_used) = _interpreter.split_at(jaxpr, value, grad_var)
    mask = lambda used: tuple(dict(zip(flat, used)).get(k, False) for k in range(len(reads)))
    return (head, mask(head_used)), (tail, mask(tail_used))
  return None
