"""Which leaves of a plan run row by row, whole in place, or from their cut gradient: predicates
from shapes alone.

One test (``row_refusal``) decides for every mode whether a stacked leaf is updated row by row
(backward loops, two-pass loops, forward loops, row updates before the loss); the others say
whether a whole update runs in place, so that no row loop is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from optfuse._jaxpr import _draws, _interpreter, _row_params, _rows
from optfuse._plan import _in_place
from optfuse._plan._fields import LeafGroup, slots_only

# How a reason begins when the update reads other rows than its own (``describe`` reads it).
MIXES_ROWS = "its update mixes rows"
# The reason when a state slot has no row per layer along the param's stacked axis.
NOT_STACKED = "its optimizer state is not stacked along the layer axis"


def _unpacks_bits(jaxpr: jcore.Jaxpr) -> bool:
  """Whether ``jaxpr`` (or a sub-jaxpr) bitcasts between dtypes: it reads packed state
  (``optfuse.low_bit``'s codes), so updating it whole holds float copies of the stack."""
  return any(_interpreter.primitive_of(eqn) is P.bitcast_convert_type_p or
             any(_unpacks_bits(sub) for sub in _interpreter.inner_jaxprs(eqn))
             for eqn in jaxpr.eqns)


def _row_spec(x, axis: int) -> jax.ShapeDtypeStruct:
  shape = jnp.shape(x)
  return jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], jnp.result_type(x))


class RowChecks:
  """The row and in-place predicates of ``Plan`` (mixed into it: they read ``PlanFields`` and
  run its runners abstractly)."""

  __slots__ = ()

  def slots_whole(self, i: int) -> bool:
    """Whether a row loop that updates leaf ``i``'s param may leave its state slots to one
    whole pass after the loop (``run_group_slots``).

    They may when they read neither the param, which the loop overwrites in place, nor the
    global stage's cuts: XLA then holds the gradient scaled by the cut (the clipped gradient,
    read by both of Adam's moments) as a full-size buffer (measured, the quick suite's scanned
    MLP in forward mode with clipping: 12.05 MB instead of 10.40 MB).
    """
    group, n, m, c = self.groups[i], self.num_params, self.num_state, len(self.consts)
    reads = slots_only(self.groups[i])[1]
    return bool(group.state_outs) and not reads[c + n + m + i] and not any(
        reads[c + 2 * n + m:])

  def in_place_whole(self, i: int) -> bool:
    """Whether leaf ``i``'s whole update runs in place (``_in_place.in_place``): otherwise XLA
    holds a full-size temporary (measured, the quick suite's scanned MLP in forward mode: Lion
    9.55 MB whole, 8.02 MB row by row), which a row loop holds one row of."""
    g = self.groups[i]
    return _in_place.in_place(g.jaxpr, g.reads, i, g.state_outs, len(self.consts),
                              self.num_params, self.num_state)

  def cut_gradient_split(self, i: int) -> tuple[tuple[jcore.Jaxpr, tuple[bool, ...]],
                                                LeafGroup] | None:
    """Leaf ``i``'s update split at its clipped gradient (``_in_place.cut_gradient_split``):
    ``((head, reads), tail)``, the tail a ``LeafGroup`` reading it in the gradient's place."""
    g = self.groups[i]
    split = _in_place.cut_gradient_split(g.jaxpr, g.reads, i, len(self.consts),
                                         self.num_params, self.num_state)
    return None if split is None else (split[0], LeafGroup(i, g.state_outs, *split[1], True))

  def in_place_from_cut_gradient(self, i: int) -> bool:
    """Whether leaf ``i``'s update, once its cut (clipped) gradient is written over the
    gradient's buffer, runs whole in place (measured, that MLP with clipping: 10.27 MB so, 11.64 MB
    whole, 10.40 MB row by row)."""
    split = self.cut_gradient_split(i)
    return split is not None and _in_place.in_place(
        split[1].jaxpr, split[1].reads, i, split[1].state_outs, len(self.consts),
        self.num_params, self.num_state)

  def min_rows(self, i: int) -> int:
    """The shortest stack that leaf ``i`` pays to update row by row.

    A row loop removes the stacked gradient (``length`` rows) but keeps rows in flight: the
    row's gradient and the param and state rows read out of their buffers. Below ``2 + slots``
    rows that costs more than it saves (measured: a 3-layer scan with AdamW used one row more
    temp memory fused), and the leaf is updated whole. A leaf whose state is packed in low bits
    (``optfuse.low_bit``) pays from 2 rows: its whole update dequantizes every slot of the stack
    to float32 (measured, a 4-layer d=512 decoder, 8-bit AdamW: 284 MB whole, 170 MB row by
    row on the TPU v5e compiler; the docs' low-bit page).
    """
    g = self.groups[i]
    return 2 if _unpacks_bits(g.jaxpr) else 2 + len(g.state_outs)

  def row_refusal(self, i: int, state, params, axis: int = 0, stats: bool = False
                  ) -> str | None:
    """Why leaf ``i`` is not updated row by row along ``axis``, or ``None`` when it is.

    It is when the leaf has at least ``min_rows`` rows, each of its state slots has as many
    rows along ``axis``, whatever its other axes (Adam's moments have the param's shape;
    Adafactor's factored moments of an (L, d, f) param are (L, d) and (L, f), a Kronecker
    factor (L, d, d)), and its update computes row ``l`` from row ``l`` of its gradient, param
    and slots only
    (with ``stats``: and its statistics are reductions whose rows combine, ``run_stats_row``).
    This is the one test of every mode: backward loops, two-pass loops, forward loops and row
    updates before the loss.
    """
    if (refused := dict(self.refused).get(i)) is not None:
      return refused
    group, p = self.groups[i], params[i]
    shape = jnp.shape(p)
    length = shape[axis] if len(shape) > axis else 0
    if length < self.min_rows(i):
      return (f"its loop has {length} iterations, fewer than the {self.min_rows(i)} from which "
              "updating row by row pays (the rows in flight cost more than the stack)")
    # A slot's other axes need no relation to the param's: the row evaluation below decides
    # whether row ``l`` of every output reads only row ``l`` of each input.
    if any(jnp.ndim(state[k]) <= axis or jnp.shape(state[k])[axis] != length
           for k in group.state_outs):
      return NOT_STACKED
    row = _row_spec(p, axis)
    rows = (row, row, [_row_spec(state[k], axis) for k in group.state_outs])
    spec = lambda x: None if x is None else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
    state, params = [spec(s) for s in state], [spec(q) for q in params]
    try:
      jax.eval_shape(lambda rows, cuts: self.run_group_row(i, state, params, cuts, rows, 0,
                                                           length, axis), rows, list(self.cuts))
      if stats and self.stats is not None:
        jax.eval_shape(lambda g: [v for v, _ in self.run_stats_row(i, g, state, params, 0,
                                                                   length, axis)], row)
    except _row_params.RowRuleError as e:
      return f"{e} (an error in optfuse: please report it; the leaf is updated after the loop)"
    except _rows.NoRowRule as e:
      return (f"its update runs {e.primitive} on its rows, which has no row rule yet (whether it "
              "mixes rows is not known)")
    except _draws.NonPartitionableDraw as e:
      return str(e)
    except _rows.NotRowwise as e:
      return f"{MIXES_ROWS} ({e})"
    return None

  def rowwise(self, i: int, state, params, axis: int = 0, stats: bool = False) -> bool:
    """Whether leaf ``i`` is updated row by row along ``axis`` (``row_refusal``)."""
    return self.row_refusal(i, state, params, axis, stats) is None

