"""The memory guard: a fused loop is kept only where the compiled step peaks no higher with it.

Fusing a scan's stacked leaves into its backward loop removes their stacked gradient, but the
loop's own buffers (its rows in flight, the residuals it stacks) are placed by the compiler, and
on some compilers and bodies they cost more than the gradient saved (the TPU v5e compiler's
bfloat16 scan forms). With ``optfuse.fuse(tx, guard=True)`` the first trace of a step for given
input shapes compiles it, on the platform it is traced for, once with every loop fused and once
with every fused leaf tapped (and with several fused scans, once per scan with that scan's
leaves tapped), and keeps the placement whose peak is lowest, the fused one on a tie. A loop
given up says so in ``optfuse.describe(...).reasons``, with both peaks.

The decision is cached per step and inputs (their shapes, shardings and memory kinds) and the
platform, device count and target traced for: a step traced again (another ``jax.jit`` of
it, ``describe``) compiles nothing more.

The guard wraps the backward engine (``GuardedEngine``, built by ``_fuse.make_engine``): it asks
the engine for the loss's fused scans and for its step with chosen leaves kept out of the loops,
and the engine knows nothing of the guard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optfuse._base._checks import abstract, checked_step
from optfuse._base._errors import GuardError
from optfuse._engines._backward import BackwardEngine, Refused
from optfuse._engines._engine import PlacedStep, without_placements
from optfuse._fusion._loops import is_dynamic
from optfuse._targets import _backends, _inputs
from optfuse._targets._compiled import DoesNotFit, compile_memory, format_bytes


def _hashable(x) -> bool:
  try:
    hash(x)
  except TypeError:
    return False
  return True


def _placed(x) -> tuple:
  """An array leaf's sharding and memory kind, hashable: a traced leaf's from its aval (what
  a jitted step sees of its input), a concrete array's or a ``ShapeDtypeStruct``'s from its own
  sharding; ``None`` where it has none (a NumPy array, a struct given no sharding)."""
  if isinstance(x, jax.core.Tracer):
    aval = jax.typeof(x)
    sharding, memory = getattr(aval, "sharding", None), getattr(aval, "memory_space", None)
  else:
    sharding = getattr(x, "sharding", None)
    memory = getattr(sharding, "memory_kind", None)
  return (sharding if _hashable(sharding) else repr(sharding)), str(memory)


def shapes_key(params, state, args: tuple, kwargs: dict) -> Any:
  """What the decision depends on: the inputs' tree structures, shapes, dtypes, shardings and
  memory kinds, the static arguments, and the platform, device count and target the step is
  traced for (the loop policy, ``_backends.loop_policy``, changes with the device count, and
  the peaks with where each input lives). The target is keyed by value: an ``id`` may be
  reused by another target once the first is gone."""
  leaves, treedef = jax.tree.flatten((params, state, args, kwargs))
  described = tuple((jnp.shape(x), str(jnp.result_type(x)), *_placed(x)) if is_dynamic(x)
                    else ("static", x if _hashable(x) else id(x)) for x in leaves)
  target = _backends.target()
  return (treedef, described, _backends.platform(), _backends.device_count(),
          target and target.described())


def peak(step: Callable, params, state, args: tuple, kwargs: dict, init: Callable) -> int:
  """The compiled peak of ``jax.jit(step, donate_argnums=(0, 1))`` for the shapes of the
  inputs (the bytes the compiler says it needed, for a program that does not fit), on the
  target steps are lowered for (``_backends.target``) or this machine's default device."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [is_dynamic(x) for x in leaves]

  def probe(params, state, dyn):
    it = iter(dyn)
    a, kw = jax.tree.unflatten(treedef, [next(it) if d else x for x, d in zip(leaves, dynamic)])
    return step(params, state, *a, **kw)

  params, state = abstract(params), abstract(state)
  dyn = abstract([x for x, d in zip(leaves, dynamic) if d])
  target = _backends.target()
  if target is None and _backends.platform() != _backends.default_platform():
    raise GuardError(
        f"guard=True compiles the step to compare peaks, on the devices it is lowered for, and "
        f"this step is lowered for {_backends.platform()} devices from a "
        f"{_backends.default_platform()} machine. Lower it inside "
        f"optfuse.compiling_for(target) (the target its inputs are placed on).")
  if target is not None:
    params = _inputs.params_on(params, target)
    dyn = _inputs.batch_on(dyn, target)
    state = _inputs.state_on(init, params, target)
  memory = compile_memory(jax.jit(probe, donate_argnums=(0, 1)).lower(params, state, dyn))
  if isinstance(memory, DoesNotFit):
    return memory.needed_bytes or 0
  return memory["peak_bytes"]


def decide(sites: Sequence[tuple[int, ...]], peak_of: Callable[[frozenset], int]
           ) -> dict[int, str]:
  """The fused leaves to tap instead, with why.

  Args:
    sites: the leaves of each fused scan.
    peak_of: the compiled peak of the step with the given leaves tapped.

  Returns:
    leaf -> why it is tapped, for the leaves of the placement with the lowest peak (every loop
    fused on a tie).
  """
  fused = frozenset(leaf for site in sites for leaf in site)
  if not fused:
    return {}
  candidates = [frozenset(), fused]
  if len(sites) > 1:
    candidates += [frozenset(site) for site in sites]
  peaks = {c: peak_of(c) for c in candidates}
  best = min(candidates, key=lambda c: (peaks[c], len(c)))
  platform = _backends.platform()
  why = (f"guard=True: compiled for {platform}, the step peaks at "
         f"{format_bytes(peaks[frozenset()])} with its loop fused and "
         f"{format_bytes(peaks[best])} with its leaves tapped, so they are tapped")
  return dict.fromkeys(sorted(best), why)


class GuardedEngine:
  """``guard=True``: the backward engine ``engine`` (one pass or two-pass) with the fused leaves
  the memory guard taps kept out of its loops (``decide``), decided once per step (its loss,
  ``has_aux`` and microbatches) and input shapes, for every step the engine builds: a step traced
  again (``describe``'s trace) compiles nothing more."""

  def __init__(self, engine: BackwardEngine):
    self.engine = engine
    self.tx, self.options, self.unplaced = engine.tx, engine.options, engine.unplaced
    # loss -> (has_aux, microbatches, input shapes) -> the fused leaves the guard taps, with why;
    # kept while the loss lives (an NNX step's loss is new per trace).
    self.decisions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def init(self, params):
    return self.engine.init(params)

  def flush(self, params, state):
    return self.engine.flush(params, state)

  def step(self, loss_fn: Callable, has_aux: bool, microbatches: int) -> PlacedStep:
    own: dict = {}  # for a loss that takes no weak reference: this step's decisions alone

    def refusing(refused: Refused) -> PlacedStep:
      return self.engine.unchecked(loss_fn, has_aux, microbatches, refused)

    def step(params, state, *args, **kwargs):
      try:
        decisions = self.decisions.setdefault(loss_fn, {})
      except TypeError:
        decisions = own
      shapes = (has_aux, microbatches, shapes_key(params, state, args, kwargs))
      if shapes not in decisions:
        decisions[shapes] = self.decide(loss_fn, refusing, params, state, args, kwargs)
      return refusing(tuple(sorted(decisions[shapes].items())))(params, state, *args, **kwargs)

    return checked_step(self.tx, step)

  def decide(self, loss_fn: Callable, refusing: Callable[[Refused], PlacedStep], params, state,
             args: tuple, kwargs: dict) -> dict[int, str]:
    """The fused leaves of ``loss_fn``'s scans the guard taps: ``decide`` on the peaks of
    ``refusing(refused)``, the step with the leaves of ``refused`` tapped."""
    loop_plan = self.engine.analyze(loss_fn, params, state, args, kwargs)
    sites = [site.leaves for site in loop_plan.sites.values()]

    def peak_of(tapped: frozenset) -> int:
      refused = tuple((i, "tapped by the memory guard's probe") for i in sorted(tapped))
      return peak(without_placements(refusing(refused)), params, state, args, kwargs,
                  self.tx.init)

    return decide(sites, peak_of)
