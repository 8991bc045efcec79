"""Step timing: compile each mode once, warm up, then run the modes interleaved and keep medians.

Interleaving (A, B, A, B, ... with the order reversed every round) spreads slow drifts of the
machine (other processes, frequency scaling, caches) over every mode alike, and the ratio of each
round's back-to-back runs compares the steps rather than the moments they ran at.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optfuse import _fuse
from optfuse._analysis import _memory


def compile_step(fx: _fuse.FusedTransformation, loss_fn: Callable, params, batch: tuple,
                 **step_options: Any) -> tuple[jax.stages.Compiled, float]:
  """Traces, lowers and compiles ``jax.jit(step, donate_argnums=(0, 1))``.

  Args:
    fx: the fused transformation.
    loss_fn: ``loss_fn(params, *batch)``, returning a scalar.
    params: the params (or their ``jax.ShapeDtypeStruct``s).
    batch: the loss's arguments after params.
    **step_options: keyword arguments of ``fx.value_and_update``.

  Returns:
    ``(compiled, seconds)``: the executable and the wall time of tracing, lowering and
    compiling it.
  """
  start = time.perf_counter()
  compiled = _memory.lower_step(fx, loss_fn, params, batch, **step_options).compile()
  return compiled, time.perf_counter() - start


class Trainer:
  """Trains with one compiled step; it owns ``params`` and ``state`` (the step donates them)."""

  def __init__(self, compiled: jax.stages.Compiled, params, state, batch: tuple):
    self.compiled = compiled
    self.params = params
    self.state = state
    self.batch = batch
    self.loss: Any = None
    self.steps = 0

  def run(self, steps: int) -> float:
    """Runs ``steps`` steps and returns the wall time per step in seconds."""
    start = time.perf_counter()
    for _ in range(steps):
      self.loss, self.params, self.state = self.compiled(self.params, self.state, *self.batch)
    jax.block_until_ready((self.loss, self.params, self.state))
    self.steps += steps
    return (time.perf_counter() - start) / steps


class Timing(NamedTuple):
  """Interleaved timings of several trainers.

  Attributes:
    step_s: name -> median seconds per step.
    ratio: name -> median over rounds of (seconds per step / the reference's in the same round).
    steps_per_run: steps in each timed run.
    runs: name -> seconds per step of each timed run, in round order.
    ratios: name -> each round's ratio to the reference, in round order.
  """

  step_s: dict[str, float]
  ratio: dict[str, float]
  steps_per_run: int
  runs: dict[str, list[float]]
  ratios: dict[str, list[float]]


def interleaved(trainers: Mapping[str, Trainer], reference: str, rounds: int, warmup: int,
                min_run_s: float) -> Timing:
  """Times every trainer in ``rounds`` interleaved rounds.

  Args:
    trainers: name -> trainer; every trainer runs the same number of steps.
    reference: the trainer the ratios divide by.
    rounds: timed runs per trainer.
    warmup: untimed steps per trainer before the first timed run.
    min_run_s: a timed run lasts at least about this long: the number of steps per run is set
      from one step of the slowest trainer.

  Returns:
    The medians, and the per-round ratios' medians: a round runs each trainer once, back to back,
    so its ratios compare runs made under the same conditions.
  """
  for trainer in trainers.values():
    if warmup:
      trainer.run(warmup)
  slowest = max(trainer.run(1) for trainer in trainers.values())
  steps = max(1, math.ceil(min_run_s / max(slowest, 1e-9)))
  names = list(trainers)
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names if r % 2 == 0 else reversed(names):
      times[name].append(trainers[name].run(steps))
  ref = times[reference]
  ratios = {name: [a / b for a, b in zip(t, ref, strict=True)] for name, t in times.items()}
  return Timing({name: statistics.median(t) for name, t in times.items()},
                {name: statistics.median(r) for name, r in ratios.items()}, steps, times, ratios)


def interleaved_compiles(compile_fns: Mapping[str, Callable[[], float]],
                         first: Mapping[str, float], reference: str, rounds: int
                         ) -> tuple[dict[str, float], dict[str, float]]:
  """Compile times of several steps, compiled in interleaved rounds.

  Args:
    compile_fns: name -> a function that compiles the step afresh and returns its seconds.
    first: name -> the seconds of a compile already made (the first round).
    reference: the step the ratios divide by.
    rounds: rounds in all, the first included; later rounds alternate the order.

  Returns:
    ``(seconds, ratio)``: name -> the median compile time, and name -> the median over rounds of
    its ratio to the reference's compile in the same round. The first compile in a process
    also pays one-off costs (JAX's and XLA's caches); the median drops it.
  """
  times = {name: [first[name]] for name in compile_fns}
  names = list(compile_fns)
  for r in range(1, rounds):
    for name in reversed(names) if r % 2 else names:
      times[name].append(compile_fns[name]())
  ref = times[reference]
  return ({name: statistics.median(t) for name, t in times.items()},
          {name: statistics.median(a / b for a, b in zip(t, ref, strict=True))
           for name, t in times.items()})


def update_time(tx, params, rounds: int, min_run_s: float) -> float:
  """Median seconds of optax's update alone, ``tx.update`` and ``optax.apply_updates`` of a
  gradient, jitted with params and state donated: the part of a step fusion can act on.

  Args:
    tx: the optax transformation.
    params: the params (arrays).
    rounds: timed runs.
    min_run_s: a timed run lasts at least about this long.

  Returns:
    Seconds per update.
  """
  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  run = jax.jit(update, donate_argnums=(1, 2))
  params = jax.tree.map(jnp.copy, params)
  state = jax.jit(tx.init)(params)

  def timed(steps: int) -> float:
    nonlocal params, state
    start = time.perf_counter()
    for _ in range(steps):
      params, state = run(grads, state, params)
    jax.block_until_ready((params, state))
    return (time.perf_counter() - start) / steps

  steps = max(1, math.ceil(min_run_s / max(timed(1), 1e-9)))
  return statistics.median(timed(steps) for _ in range(rounds))
