"""Where each parameter leaf's update runs, and why a stacked leaf is not fused in its loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from optfuse import _fuse
from optfuse._analysis import _streams, _transfers
from optfuse._base import _checks, _leaves, _memory_spaces
from optfuse._base._errors import NonSeparableError, OptionsError
from optfuse._base._options import FuseOptions
from optfuse._engines import _engine
from optfuse._optimizers import _muon_dims, _per_layer
from optfuse._plan import _make, _row_checks
from optfuse._targets import _inputs
from optfuse._targets._compiled import format_bytes

# What a reason adds where a stacked leaf's update mixes its rows: the layers of a stacked leaf
# are its rows, and the per-layer form keeps them apart.
PER_LAYER_HINT = ("; it mixes the layers of the stacked leaf: optfuse.per_layer(tx) applies the "
                  "optimizer to each layer apart, as on the unrolled model (where a statistic "
                  "per layer is meant; its layer_axes must give this leaf the axis its scan "
                  "reads as layers)")


class Placements(dict):
  """Leaf path -> where its update runs (a ``dict``), with the reasons of stacked leaves.

  Attributes:
    reasons: leaf path -> why a leaf that a scan reads as its stacked input is not updated
      inside the loop, for every such leaf that is not.
    state: leaf path -> where the leaf's optimizer-state slots live between steps, "host" or
      "device", for every float leaf that has slots.
    warnings: leaf path -> what the optimizer does to a stacked leaf that was likely not
      meant, and what to do instead: a Muon that leaves a stacked leaf of rank 3 or more to its
      AdamW fallback, or orthogonalises one across its layers (``optfuse.stacked_muon_dims``).
    params: leaf path -> where the float param leaf lives between steps, "host" (streamed
      through its fused loop, ``offload="params"``) or "device".
    host_transfer_bytes: the bytes each step moves between host and device memory (both ways,
      ``memory_report``'s count), or ``None`` without offload (nothing moves).
    why: with ``offload="auto"`` and its plan, leaf path -> where its params and state live
      and why (``OffloadPlan.why``); else empty.
  """

  def __init__(self, where: Mapping[str, str], reasons: Mapping[str, str],
               state: Mapping[str, str] | None = None,
               warnings: Mapping[str, str] | None = None,
               params: Mapping[str, str] | None = None,
               host_transfer_bytes: int | None = None, why: Mapping[str, str] | None = None):
    super().__init__(where)
    self.reasons = dict(reasons)
    self.state = dict(state or {})
    self.warnings = dict(warnings or {})
    self.params = dict(params or {})
    self.host_transfer_bytes = host_transfer_bytes
    self.why = dict(why or {})

  def table(self) -> str:
    """One line per leaf: its path, where it runs, where its params and its state live (each
    when any lives in host memory), if a stacked leaf is not fused, why, and its warning if it
    has one."""
    width = max(map(len, self), default=0)
    on = lambda what, where, path: (f"  {what} on {where.get(path, 'device')}"
                                    if "host" in where.values() else "")
    state = lambda path: on("params", self.params, path) + on("state", self.state, path)
    note = lambda notes, path, head="": f"  ({head}{notes[path]})" if path in notes else ""
    lines = [f"{path.ljust(width)}  {where}{state(path)}{note(self.reasons, path)}"
             f"{note(self.why, path)}{note(self.warnings, path, 'warning: ')}"
             for path, where in self.items()]
    if self.host_transfer_bytes is not None:
      lines.append(f"host transfers a step: {format_bytes(self.host_transfer_bytes)}")
    return "\n".join(lines)


def describe(tx, loss_fn: Callable, params, *args, options: FuseOptions | None = None,
             microbatches: int | None = None, plan=None, **kwargs) -> Placements:
  """Says where each parameter leaf is updated, without running anything.

  The step described is traced (``jax.eval_shape``, nothing compiled or run: the memory guard
  aside) and reports what its trace placed where: the same step ``value_and_update(loss_fn,
  microbatches=microbatches)`` builds, with the same options.

  Args:
    tx: a ``FusedTransformation`` (the placements of its own step), or an optax transformation
      (those of ``optfuse.fuse(tx, options=options)``'s step).
    loss_fn: ``loss_fn(params, *args, **kwargs)``; whether it returns ``(loss, aux)`` is read
      from its abstract output.
    params: params or their ``jax.ShapeDtypeStruct`` values.
    *args: the loss's other arguments (arrays or ``jax.ShapeDtypeStruct`` values).
    options: the ``FuseOptions`` of the step (a reserved keyword, not passed to ``loss_fn``):
      for an optax ``tx``, ``None`` is ``fuse``'s default (backward mode); for a
      ``FusedTransformation``, ``None`` or its own ``options``.
    microbatches: the step's microbatches, as given to ``value_and_update`` (a reserved
      keyword too): the update then runs once, outside the loop over microbatches.
    plan: with ``offload="auto"``, the ``OffloadPlan`` the params and state are placed by
      (``optfuse.place``; a reserved keyword too): where each leaf lives is the plan's, and
      ``why`` says why. Without it, nothing is streamed (``fx.init``'s placement).
    **kwargs: its keyword arguments.

  Returns:
    A ``Placements``: a dict from leaf path (``jax.tree_util.keystr``) to where its update runs,
    whose ``reasons`` say, for every leaf a scan reads as its stacked input and that is not
    updated inside the loop, why (read twice, inside a ``while_loop``, the loop too short, given
    up by the memory guard (``fuse(..., guard=True)``, with both peaks), the
    update mixes rows (the layers of the stacked leaf: the reason then names
    ``optfuse.per_layer``, the form that applies the optimizer to each layer apart),
    microbatches...). Backward mode:
    ``"loop"`` (row by row inside the backward loop of a scan, in place) or ``"tap"`` (in the
    backward pass once its whole gradient is complete). Forward mode: ``"loop"`` (row by row
    inside the forward loop of a scan, in place, just before the layer runs), ``"rows"`` (row
    by row in place before the loss) or ``"leaf"`` (whole, before the loss). With
    ``microbatches``, backward and forward mode: ``"rows"`` (row by row in place) or ``"leaf"``
    (whole), once, after the loop over the microbatches (before it in forward mode). Mode "off":
    ``"optax"``. Every mode: ``"carried"`` (not a float leaf: carried unchanged). Its
    ``state`` says where each leaf's optimizer-state slots live: ``"host"`` with
    ``offload="state"`` (or ``"params"``, or where the ``plan`` of ``offload="auto"`` streams
    it), else ``"device"``; its ``params`` where each float param leaf lives: ``"host"`` for a
    leaf placed ``"loop"`` with ``offload="params"`` (with microbatches, for a leaf placed
    ``"rows"`` that each microbatch's loops stream; with ``offload="auto"``, streamed
    ``"params"`` by the plan), else ``"device"``. Its ``warnings`` name the stacked leaves a Muon
    (``optax.contrib.muon``) leaves to its AdamW fallback while of rank 3 or more, or
    orthogonalises across their layers, and say what to do: pass
    ``muon_weight_dimension_numbers=optfuse.stacked_muon_dims`` (in the modes that fuse loops,
    which find the stacked leaves; mode "off" finds none). Its ``host_transfer_bytes`` are
    the bytes each step moves between host and device memory with offload, counted in the
    step traced on inputs placed as it says (this machine's compiler's choices).

  Raises:
    NonSeparableError: ``tx`` cannot run in backward mode (without ``global_ops="two_pass"``).
    OptionsError: ``options`` contradicts those of a ``FusedTransformation``.
    MicrobatchError: ``microbatches`` is not a positive int or ``None``, or an argument's
      leading axis is not divisible by it.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> def loss(p, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
    ...   return jnp.sum(h @ p["head"])
    >>> params = {"layers": jnp.zeros((4, 3, 3)), "head": jnp.zeros((3,))}
    >>> optfuse.describe(optax.adam(1e-3), loss, params, jnp.ones(3))
    {"['head']": 'tap', "['layers']": 'loop'}
    >>> optfuse.describe(optax.adam(1e-3), loss, params, jnp.ones((2, 3)), microbatches=2)
    {"['head']": 'leaf', "['layers']": 'leaf'}
  """
  fx = _fused(tx, options)
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  params = jax.tree.map(spec, params)
  args, kwargs = jax.tree.map(spec, (args, kwargs))
  step = fx.value_and_update.placed(loss_fn, _checks.returns_pair(loss_fn, params, args, kwargs),
                                    microbatches)
  leaves = jax.tree.leaves(params)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  found: list = []
  streams = dict(plan.streams) if fx.offload == "auto" and plan is not None else {}
  if streams:
    # ``offload="auto"``: the step streams what the plan placed in host memory (with
    # microbatches, which stacks keep their sum there and are updated row by row): traced on
    # the params and state the plan places.
    def trace(p, state, a, kw):
      outs, placed = step(p, state, *a, **kw)
      found.append(placed)
      return outs

    jax.jit(trace).trace(*_placed_by(fx, params, streams), args, kwargs)
  else:
    # The step's own trace, its state from ``init`` in the same trace: the state keeps its
    # memory space (the host-resident slots and pending gradient of ``offload="state"``),
    # which ``eval_shape``'s outputs drop.
    jax.eval_shape(lambda p, a, kw: found.append(step(p, fx.init(p), *a, **kw)[1]),
                   params, args, kwargs)
  placed, reasons, _ = found[0]
  streamed = _engine.streamed_params(found[0]) if fx.offload == "params" else frozenset()
  unplaced = fx.value_and_update.engine.unplaced
  diff = {i for i, p in enumerate(leaves) if _leaves.is_float(p)}
  label = lambda i: placed.get(i, unplaced) if i in diff else "carried"
  offload = fx.offload is not None
  # The leaves a scan reads as its stacked input: those in a loop, and those with a reason.
  stacked = {i for i in diff if placed.get(i) == "loop" or i in reasons}
  mixing = {i for i, why in reasons.items() if why.startswith(_row_checks.MIXES_ROWS)}
  per_layer = _per_layer.applies_per_layer(jax.eval_shape(fx.tx.init, params))
  warnings = _muon_dims.muon_warnings(fx.tx, params, stacked, mixing, per_layer)
  if fx.offload == "auto":
    where_params = {paths[i]: "host" if streams.get(paths[i]) == "params" else "device"
                    for i in sorted(diff)}
    where_state = {path: "host" if streams.get(path, "none") != "none" else "device"
                   for path in _state_memory(fx.tx, params, paths, diff, False)}
  else:
    where_params = {paths[i]: "host" if i in streamed else "device" for i in sorted(diff)}
    where_state = _state_memory(fx.tx, params, paths, diff, offload)
  return Placements({path: label(i) for i, path in enumerate(paths)},
                    {paths[i]: why + (PER_LAYER_HINT if i in mixing else "")
                     for i, why in reasons.items() if i in diff and placed.get(i) != "loop"},
                    where_state,
                    {paths[i]: why for i, why in warnings.items()},
                    where_params,
                    _transfer_bytes(fx, loss_fn, params, args, kwargs, microbatches,
                                    where_params, streams) if offload else None,
                    plan.why if fx.offload == "auto" and plan is not None else None)


def _transfer_bytes(fx, loss_fn: Callable, params, args: tuple, kwargs: dict,
                    microbatches: int | None, where_params: Mapping[str, str],
                    streams: Mapping[str, str]) -> int:
  """The bytes ``fx``'s jitted step moves between host and device memory, traced on
  ``params`` placed as ``where_params`` says and the state as ``fx.init`` places it (with
  ``offload="auto"``, as ``streams`` places both)."""
  has_aux = _checks.returns_pair(loss_fn, params, args, kwargs)
  to_host = lambda x: _inputs.offloaded_on(x, None)
  if fx.offload == "auto":
    params, state = _placed_by(fx, params, streams)
  else:
    init = _fuse.fuse_with(fx.tx, dataclasses.replace(fx.options, offload=None)).init
    state = to_host(jax.eval_shape(init, params))
    on_host = lambda path, x: (to_host(x) if where_params.get(jax.tree_util.keystr(path))
                               == "host" else x)
    params = jax.tree_util.tree_map_with_path(on_host, params)
  step = jax.jit(fx.value_and_update(loss_fn, has_aux, microbatches=microbatches),
                 donate_argnums=(0, 1))
  traced = step.trace(params, state, *args, **kwargs)
  return _transfers.traced_transfer_bytes(traced.jaxpr).total


def _placed_by(fx, params, streams: Mapping[str, str]) -> tuple[Any, Any]:
  """``params`` and ``fx.init``'s state (``jax.ShapeDtypeStruct`` values) placed as
  ``streams`` (an ``offload="auto"`` plan's) says."""
  init = _fuse.fuse_with(fx.tx, dataclasses.replace(fx.options, offload=None)).init
  return _streams.place_streams(fx.tx, params, jax.eval_shape(init, params), streams,
                                lambda x: _inputs.offloaded_on(x, None))


def _fused(tx, options: FuseOptions | None) -> _fuse.FusedTransformation:
  """The fused transformation whose step is described: ``tx`` itself, or ``fuse(tx, options=
  options)`` for an optax transformation."""
  if not isinstance(tx, _fuse.FusedTransformation):
    return _fuse.fuse(tx, options=options)
  if options is not None and options != tx.options:
    raise OptionsError(
        f"describe was given options={options!r} and a fused transformation whose options are "
        f"{tx.options!r}: it describes that transformation's step. Drop options, or describe "
        "the optax transformation (fx.tx) with the options you want.")
  return tx


def _state_memory(tx, params, paths: list[str], diff: set[int], offload: bool
                  ) -> dict[str, str]:
  """Leaf path -> where its slots live, from the separable split of ``tx`` (the slots each
  leaf's update owns); empty when ``tx`` does not split per leaf."""
  state = jax.eval_shape(tx.init, params)
  try:
    plan = _make.make_plan(tx, params, state)
  except NonSeparableError:
    return {}
  flat = jax.tree.leaves(state)
  where = lambda i: ("host" if offload and any(_memory_spaces.offloaded(flat[k])
                                               for k in plan.groups[i].state_outs) else "device")
  return {paths[i]: where(i) for i in sorted(diff) if plan.groups[i].state_outs}
