"""``offload="auto"``: what each leaf streams, chosen so that the step fits a memory budget with
the fewest bytes moved between host and device memory per step.

Each leaf streams nothing, its optimizer state's slots (``"state"``) or, for a param stack its
fused loop updates, its params too (``"params"``). Streaming a leaf's slots frees their bytes on
the device and moves them twice a step (read, written back); streaming its params frees theirs
and moves them about three times (read by the forward loop, again by the backward loop, written
back). The planner ranks what it may stream by bytes moved per byte freed (slots first, then
params), adds the cheapest until the bytes freed cover what the compiled step needs beyond the
budget, compiles the step so placed, and adds more while the compiler says it does not fit;
then it drops, one at a time, what an earlier round added if the step fits without it. A round
whose compiled peak is not below the peak before it is undone and not tried again: a compiler
may keep in device memory what a stream moves to the host, or more (buffers held around the
streamed rows), and the plan then says so for those leaves instead of streaming them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from optfuse import _fuse
from optfuse._analysis import _memory, _streams
from optfuse._analysis._describe import describe
from optfuse._base import _memory_spaces, _options
from optfuse._base._errors import OffloadError
from optfuse._targets import _registry
from optfuse._targets._compiled import DoesNotFit, format_bytes

# Bytes moved a step per byte freed on the device: the ranking (the exact bytes are counted).
MOVED_PER_BYTE = {"state": 2, "params": 3}


class OffloadPlan:
  """What each leaf of ``offload="auto"`` streams, and what the step so placed needs.

  Attributes:
    streams: param leaf path -> "none", "state" (its optimizer-state slots in host memory) or
      "params" (its param stack and its slots in host memory, streamed through its fused loop).
    why: param leaf path -> where its params and state live, and why.
    device_peak_bytes: the compiled step's device peak so placed.
    host_bytes: the host memory it uses (0 on XLA:CPU, whose host memory is device memory).
    host_transfer_bytes: the bytes it moves between host and device memory a step.
    budget_bytes: the device memory it was planned to fit.
    budget_source: where ``budget_bytes`` comes from.
    target: the compile target's name ("cpu" for this machine's backend).
    memory: the compiled step's memory so placed (``memory_report``'s fields).
  """

  def __init__(self, tx, streams: Mapping[str, str], why: Mapping[str, str],
               memory: Mapping[str, int], budget_bytes: int, budget_source: str, target: str):
    self.tx, self.memory = tx, dict(memory)
    self.streams, self.why = dict(streams), dict(why)
    self.device_peak_bytes = memory["peak_bytes"]
    self.host_bytes = memory.get("host_bytes", 0)
    self.host_transfer_bytes = memory.get("host_transfer_bytes", 0)
    self.budget_bytes, self.budget_source, self.target = budget_bytes, budget_source, target

  def place(self, params, state):
    """``params`` and ``state`` (``fx.init(params)``, or a later state of the same step) with
    what the plan streams in host memory and the rest in device memory.

    Returns:
      ``(params, state)`` placed for the step of ``optfuse.fuse(tx, offload="auto")``.
    """
    return _streams.place_streams(self.tx, _memory_spaces.tree_to_device(params),
                                        _memory_spaces.tree_to_device(state), self.streams,
                                        _memory_spaces.to_host)

  def table(self) -> str:
    """One line per leaf (where it lives, and why), then the step's memory and transfers."""
    width = max(map(len, self.why), default=0)
    lines = [f"{path.ljust(width)}  {why}" for path, why in self.why.items()]
    lines.append(f"device peak {format_bytes(self.device_peak_bytes)} of "
                 f"{format_bytes(self.budget_bytes)} ({self.budget_source}, {self.target}); "
                 f"host {format_bytes(self.host_bytes)}; host transfers a step "
                 f"{format_bytes(self.host_transfer_bytes)}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()

  def __repr__(self) -> str:
    return f"OffloadPlan(\n{self.table()}\n)"


class Placed(NamedTuple):
  """What ``optfuse.place`` returns.

  Attributes:
    params: the params, placed.
    state: the optimizer state (``fx.init``'s), placed.
    plan: the ``OffloadPlan`` they are placed by.
  """

  params: Any
  state: Any
  plan: OffloadPlan


class _Leaf(NamedTuple):
  path: str
  param_bytes: int
  state_bytes: int
  in_loop: bool


def _bytes(x) -> int:
  return int(np.prod(np.shape(x))) * np.dtype(jax.numpy.result_type(x)).itemsize


def _leaves(fx, loss_fn: Callable, params, args: tuple, kwargs: dict) -> list[_Leaf]:
  """The leaves the plan may stream: those with slots, and the param stacks of fused loops."""
  flat = dict((jax.tree_util.keystr(p), x)
              for p, x in jax.tree_util.tree_flatten_with_path(params)[0])
  state = jax.tree.leaves(jax.eval_shape(fx.tx.init, params))
  slots = _streams.slots_of(fx.tx, params)
  where = describe(fx.tx, loss_fn, params, *args,
                   options=_options.FuseOptions(offload="params"), **kwargs)
  paths = dict.fromkeys([*slots, *(p for p, w in where.params.items() if w == "host")])
  return [_Leaf(p, _bytes(flat[p]), sum(_bytes(state[k]) for k in slots.get(p, ())),
                where.params.get(p) == "host") for p in paths]


def _candidates(leaves: list[_Leaf], streams: dict[str, str],
                refused: Mapping[tuple[str, str], Any]) -> list[tuple[float, int, str, str]]:
  """What may stream next, as ``(moved per byte freed, bytes freed, path, what)``, but the
  ``(path, what)`` streams of ``refused`` (that did not lower the compiled peak)."""
  return [o for o in _all_candidates(leaves, streams) if (o[2], o[3]) not in refused]


def _all_candidates(leaves: list[_Leaf], streams: dict[str, str]
                    ) -> list[tuple[float, int, str, str]]:
  out = []
  for leaf in leaves:
    now = streams.get(leaf.path, "none")
    if now == "none" and leaf.state_bytes:
      out.append((MOVED_PER_BYTE["state"], leaf.state_bytes, leaf.path, "state"))
    if now != "params" and leaf.in_loop:
      freed = leaf.param_bytes + (leaf.state_bytes if now == "none" else 0)
      moved = (MOVED_PER_BYTE["params"] * leaf.param_bytes
               + (MOVED_PER_BYTE["state"] * leaf.state_bytes if now == "none" else 0))
      out.append((moved / freed, freed, leaf.path, "params"))
  return out


def _choose(leaves: list[_Leaf], streams: dict[str, str], needed: int,
            refused: Mapping[tuple[str, str], Any]) -> dict[str, str]:
  """The cheapest additions to ``streams`` that free at least ``needed`` bytes by their
  sizes: in the cheapest tier, the smallest leaf that covers what is left, else the largest
  and on; then the next tier. Empty when nothing is left to stream but what ``refused``
  holds."""
  chosen: dict[str, str] = {}
  left = needed
  while left > 0:
    options = _candidates(leaves, {**streams, **chosen}, refused)
    if not options:
      break
    tier = min(o[0] for o in options)
    # A leaf's params in the same step as its slots: one choice, the larger.
    tier_options = [o for o in options if o[0] == tier]
    covering = [o for o in tier_options if o[1] >= left]
    _, freed, path, what = (min(covering, key=lambda o: o[1]) if covering
                            else max(tier_options, key=lambda o: o[1]))
    chosen[path] = what
    left -= freed
  return chosen


def _peak(memory) -> int | None:
  if isinstance(memory, DoesNotFit):
    return memory.needed_bytes
  return memory["peak_bytes"]


def _fits(memory, budget: int) -> bool:
  return not isinstance(memory, DoesNotFit) and memory["peak_bytes"] <= budget


def _budget(budget, target) -> tuple[int, str, _registry.Target | None]:
  """``(budget bytes, where they come from, the resolved compile target)``."""
  if isinstance(budget, (int, np.integer)) and not isinstance(budget, bool):
    if budget <= 0:
      raise OffloadError(f"budget must be a positive number of bytes, not {budget}.")
    return int(budget), "given", _registry.resolve(target)
  if target is not None:
    raise OffloadError(
        f"budget={budget!r} names a target, whose memory is the budget, and target={target!r} "
        "names another: give budget in bytes with target, or the target alone as budget.")
  resolved = _registry.resolve(budget)
  bytes_, source = (resolved.memory_bytes, resolved.memory_source) if resolved is not None \
      else (None, "unknown")
  if bytes_ is None:
    raise OffloadError(
        f"the memory of target {budget!r} is not known ({source}): give budget in bytes.")
  return int(bytes_), source, resolved


def plan_offload(fx: _fuse.FusedTransformation, loss_fn: Callable, params, *args,
                 budget: Any, target: Any = None, microbatches: int | None = None,
                 **kwargs) -> OffloadPlan:
  """What each leaf of ``fx``'s step streams so that the step fits ``budget``, with the fewest
  bytes moved between host and device memory a step. Nothing runs: each candidate placement is
  compiled.

  Args:
    fx: ``optfuse.fuse(tx, offload="auto")``.
    loss_fn: ``loss_fn(params, *args, **kwargs)``, as its step runs it.
    params: the params or their ``jax.ShapeDtypeStruct`` values.
    *args: the loss's other arguments (arrays or ``jax.ShapeDtypeStruct`` values).
    budget: the device memory the step must fit (a reserved keyword, not passed to
      ``loss_fn``): a name of ``optfuse.targets()`` ("tpu-v5e", "h100"...), whose memory is the
      budget and whose compiler compiles the step, or bytes (compiled for ``target``).
    target: with ``budget`` in bytes, the compiler (a reserved keyword too; ``None``: this
      machine's).
    microbatches: the step's (``fx.value_and_update(loss_fn, microbatches=k)``; a reserved
      keyword too), whose compiled peaks the plan is made from: a stack it streams keeps the
      sum of its gradients in host memory too. ``args`` are then the whole batch.
    **kwargs: the loss's keyword arguments.

  Returns:
    An ``OffloadPlan``.

  Raises:
    OffloadError: ``fx`` is not ``offload="auto"``; ``budget`` is neither bytes nor a target
      with a known memory; the compiler is XLA:CPU (which counts host memory as device
      memory); or the step does not fit even with every leaf it can stream
      streamed (the message says by how much, and what to do).
    TargetError: an unknown target, or its compiler is not installed.
  """
  if fx.offload != "auto":
    raise OffloadError(f"plan_offload plans offload='auto', and fx has offload={fx.offload!r}: "
                       "use optfuse.fuse(tx, offload='auto').")
  fx.options.check_microbatches(microbatches)
  budget_bytes, source, resolved = _budget(budget, target)
  name = _memory.target_budget(resolved)[0]
  if (jax.default_backend() if resolved is None else resolved.platform) == "cpu":
    raise OffloadError(
        "offload='auto' plans from compiled device peaks, and XLA:CPU counts host memory as "
        "device memory (streaming frees nothing there). Plan for the accelerator's compiler: "
        "budget='tpu-v5e' (a name of optfuse.targets()), or budget in bytes with target=...; "
        "the plan then places the params and state on this machine as it would there.")
  has_aux = _memory.loss_has_aux(loss_fn, params, *args, **kwargs)
  measure = lambda streams: _memory.step_memory(fx, loss_fn, params, args, kwargs, has_aux,
                                                resolved, streams=streams,
                                                microbatches=microbatches)
  leaves = _leaves(fx, loss_fn, params, args, kwargs)
  streams: dict[str, str] = {}
  memory = measure(streams)
  added: dict[str, int | None] = {}  # path -> the peak before it streamed
  # (path, what) -> (the peak without, with): streams whose round did not lower the peak.
  refused: dict[tuple[str, str], tuple[int | None, int | None]] = {}
  rounds: list[dict[str, str]] = []
  while not _fits(memory, budget_bytes):
    peak = _peak(memory)
    needed = (peak - budget_bytes) if peak else 1
    chosen = _choose(leaves, streams, needed, refused)
    if not chosen:
      raise OffloadError(
          f"the step does not fit {format_bytes(budget_bytes)} ({source}) even with every "
          f"leaf it can stream in host memory{_refused_note(refused, name)}: it needs "
          f"{format_bytes(peak) if peak else 'more'}"
          ". Use a smaller batch or sequence, optfuse.low_bit(tx, bits=8) state, "
          "jax.checkpoint (remat) on the scanned layers, or a device with more memory.")
    tried = measure({**streams, **chosen})
    if not _lowers(tried, memory):
      refused.update(dict.fromkeys(chosen.items(), (peak, _peak(tried))))
      continue
    for path in chosen:
      added.setdefault(path, peak)
    streams.update(chosen)
    rounds.append(chosen)
    memory = tried
  # What an earlier round streamed may not be needed once a later one does: a small leaf frees
  # less than its bytes (its rows in flight), the next round more. Each is dropped if the step
  # still fits without it, the most bytes moved first.
  earlier = [(path, what) for chosen in rounds[:-1] for path, what in chosen.items()]
  moved = {leaf.path: leaf for leaf in leaves}
  cost = lambda pw: (MOVED_PER_BYTE["params"] * moved[pw[0]].param_bytes if pw[1] == "params"
                     else 0) + MOVED_PER_BYTE["state"] * moved[pw[0]].state_bytes
  for path, _ in sorted(earlier, key=cost, reverse=True):
    trial = {p: w for p, w in streams.items() if p != path}
    tried = measure(trial)
    if _fits(tried, budget_bytes):
      streams, memory = trial, tried
      added.pop(path)
  why = {leaf.path: _why(streams.get(leaf.path, "none"), added.get(leaf.path), budget_bytes,
                        _refused_of(refused, leaf.path, streams), name)
         for leaf in leaves}
  return OffloadPlan(fx.tx, {p: streams.get(p, "none") for p in why}, why, memory,
                     budget_bytes, source, name)


def _lowers(tried, before) -> bool:
  """Whether the step compiled as ``tried`` needs less device memory than ``before``; a
  refusal without a figure counts as lower (the next round says more)."""
  now, then = _peak(tried), _peak(before)
  return now is None or then is None or now < then


def _refused_of(refused, path: str, streams: Mapping[str, str]):
  """``(what, without, with)`` of ``path``'s refused stream, when it streams nothing."""
  if streams.get(path, "none") != "none":
    return None
  found = [(what, *peaks) for (p, what), peaks in refused.items() if p == path]
  return found[0] if found else None


def _refused_note(refused, target: str) -> str:
  if not refused:
    return ""
  paths = ", ".join(dict.fromkeys(p for p, _ in refused))
  return f" but {paths}, whose streaming did not lower the compiled peak on {target}"


def _why(what: str, peak_before: int | None, budget: int, refused=None, target: str = "") -> str:
  fits = format_bytes(budget)
  needs = f": {format_bytes(peak_before)} without it" if peak_before else ""
  if what == "params":
    return f"params and state: host (needed to fit {fits}{needs})"
  if what == "state":
    return f"params: device, state: host (needed to fit {fits}{needs})"
  if refused is not None:
    streamed, without, with_ = refused
    fmt = lambda b: format_bytes(b) if b else "more"
    return (f"params and state: device (streaming its {streamed} did not lower the compiled "
            f"peak on {target}: {fmt(with_)} with it, {fmt(without)} without)")
  return f"params and state: device (not needed to fit {fits})"


def place(fx: _fuse.FusedTransformation, loss_fn: Callable, params, *args, budget: Any,
          target: Any = None, microbatches: int | None = None, **kwargs) -> Placed:
  """Plans ``offload="auto"`` for ``budget`` (``plan_offload``) and places ``params`` and
  ``fx.init(params)`` by the plan.

  Args:
    fx: ``optfuse.fuse(tx, offload="auto")``.
    loss_fn: ``loss_fn(params, *args, **kwargs)``, as its step runs it.
    params: the params (arrays).
    *args: the loss's other arguments (arrays or ``jax.ShapeDtypeStruct`` values).
    budget: the device memory the step must fit (a reserved keyword): a target name of
      ``optfuse.targets()``, whose memory is the budget, or bytes.
    target: with ``budget`` in bytes, the compiler it is planned with (``None``: this
      machine's; not XLA:CPU, where streaming frees nothing).
    microbatches: the step's, as ``plan_offload`` takes it (a reserved keyword).
    **kwargs: the loss's keyword arguments.

  Returns:
    ``Placed(params, state, plan)``: the params and ``fx.init``'s state with what the plan
    streams in host memory, and the ``OffloadPlan``. ``fx``'s step takes them as they are.

  Raises:
    OffloadError: as ``plan_offload`` raises it.
    TargetError: an unknown target, or its compiler is not installed.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> def loss(p, x):
    ...   h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x @ p["embed"], p["layers"])
    ...   return jnp.sum(h)
    >>> params = {"embed": jnp.ones((2, 256)), "layers": jnp.zeros((8, 256, 256))}
    >>> fx = optfuse.fuse(optax.adam(1e-3), offload="auto")
    >>> need = optfuse.memory_report(loss, optax.adam(1e-3), params, jnp.ones(2),
    ...                              target="tpu-v5e")["backward"]["peak_bytes"]
    >>> params, state, plan = optfuse.place(fx, loss, params, jnp.ones(2), budget=need - 1,
    ...                                     target="tpu-v5e")  # a byte less than it needs
    >>> plan.streams
    {"['embed']": 'none', "['layers']": 'state'}
    >>> state[0].mu["layers"].sharding.memory_kind
    'pinned_host'
    >>> float(fx.value_and_update(loss)(params, state, jnp.ones(2))[0])
    0.0
  """
  plan = plan_offload(fx, loss_fn, params, *args, budget=budget, target=target,
                      microbatches=microbatches, **kwargs)
  return Placed(*plan.place(params, fx.init(params)), plan)
