"""Small deterministic test models shared by the test suite.

``tied_lm`` is the reference model of the equivalence tests: a two-layer residual MLP language
model whose embedding table is both the input lookup and the output projection (a tied weight, so
its gradient is the sum of two uses) and which holds a parameter the loss never reads (``unused``:
optax still decays and moves it, with a zero gradient).

The runners train for a number of steps and return ``(losses, params, state)``; ``run_optax`` is
the reference written as plain optax code (``value_and_grad``, ``tx.update``, ``apply_updates``),
never through optfuse.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optfuse
from tests.criteria import LOW_BIT_TOL, REJECTED_BY, SPREAD_CAP, SpreadTooWide

# JAX 0.10's jax_custom_vjp3 cannot transpose, inside jax.checkpoint, a custom_vjp function that
# takes a None argument (jax/_src/hijax.py:639 in 0.10.2 zips the inputs with their nonzero flags,
# which count the None; fixed by 0.11.0): optfuse's fused scan is such a function when the scan
# sits inside jax.checkpoint.
CUSTOM_VJP3_REMAT_BUG = pytest.mark.xfail(
    jax.config.jax_custom_vjp3 and jax.__version_info__ < (0, 11), raises=ValueError,
    strict=True, reason="jax_custom_vjp3 of JAX 0.10 fails to transpose a custom_vjp with a None "
    "argument inside jax.checkpoint (jax/_src/hijax.py:639)")


VOCAB = 32
DIM = 16
HIDDEN = 24
BATCH = 4
SEQ = 6


def tied_lm_params(seed: int = 0, dtype=jnp.float32) -> dict:
  """Params of ``tied_lm_loss``: tied embedding, two dense layers, norm scale, unused leaf."""
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  params = {
      "embed": jax.random.normal(k[0], (VOCAB, DIM)) / jnp.sqrt(DIM),
      "layers": [
          {"w": jax.random.normal(k[1], (DIM, HIDDEN)) / jnp.sqrt(DIM),
           "b": jnp.zeros((HIDDEN,))},
          {"w": jax.random.normal(k[2], (HIDDEN, DIM)) / jnp.sqrt(HIDDEN),
           "b": jnp.full((DIM,), 0.1)},
      ],
      "norm": {"scale": jnp.ones((DIM,))},
      "unused": jax.random.normal(k[3], (3, DIM)),
  }
  return jax.tree.map(lambda x: x.astype(dtype), params)


def tied_lm_loss(params: dict, tokens: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy; reads ``params["embed"]`` twice, ``params["unused"]`` never."""
  embed = params["embed"]
  h = embed[tokens]
  first, second = params["layers"]
  z = jnp.tanh(h @ first["w"] + first["b"])
  h = h + z @ second["w"] + second["b"]
  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * params["norm"]["scale"]
  logits = h @ embed.T
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # bf16 params: f32 loss
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def tied_lm_batches(num: int = 5, seed: int = 1) -> list[tuple[jax.Array, jax.Array]]:
  """``num`` fixed ``(tokens, targets)`` batches; step ``t`` uses batch ``t % num``."""
  keys = jax.random.split(jax.random.PRNGKey(seed), num)
  batches = []
  for key in keys:
    seq = jax.random.randint(key, (BATCH, SEQ + 1), 0, VOCAB)
    batches.append((seq[:, :-1], seq[:, 1:]))
  return batches


def copy(tree):
  """A fresh copy of ``tree``: steps jitted with ``donate_argnums`` consume their inputs."""
  return jax.tree.map(jnp.copy, tree)


def run_fused(tx: optax.GradientTransformation, mode: str, params, batches: Sequence[tuple],
              steps: int, loss_fn: Callable = tied_lm_loss, jit: bool = True,
              ) -> tuple[jax.Array, Any, Any]:
  """Trains ``steps`` steps with ``optfuse.fuse(tx, mode)``.

  Args:
    tx: the optax transformation.
    mode: the optfuse mode.
    params: initial params (copied, never donated).
    batches: positional arguments of ``loss_fn`` after params; step ``t`` uses
      ``batches[t % len(batches)]``.
    steps: number of steps.
    loss_fn: the loss.
    jit: run the step under ``jax.jit(step, donate_argnums=(0, 1))``, else eagerly.

  Returns:
    ``(losses, params, state)`` with the losses of every step stacked.
  """
  fx = optfuse.fuse(tx, mode=mode)
  params = copy(params)
  return run_steps(fx.value_and_update(loss_fn), params, fx.init(params), batches, steps, jit)


def run_optax(tx: optax.GradientTransformation, params, batches: Sequence[tuple], steps: int,
              loss_fn: Callable = tied_lm_loss, jit: bool = True, loss_args: bool = False,
              ) -> tuple[jax.Array, Any, Any]:
  """The reference: ``steps`` plain optax steps.

  Same arguments as ``run_fused``, and ``loss_args``: pass ``value``, ``grad`` and ``value_fn``
  to ``tx.update``, as line searches, Polyak step sizes and ``reduce_on_plateau`` require.
  """

  params = copy(params)
  return run_steps(optax_step(tx, loss_fn, loss_args), params, tx.init(params), batches, steps,
                   jit)


def optax_step(tx: optax.GradientTransformation, loss_fn: Callable, loss_args: bool = False
               ) -> Callable:
  """The plain optax step ``run_optax`` runs, ``(params, state, *batch) -> (loss, params,
  state)``: jit it once (with donation) and pass it to ``run_steps(..., jit=False)`` to run
  several references (``nudge``) on one compile."""

  def step(params, state, *args):
    loss, grads = jax.value_and_grad(loss_fn)(params, *args)
    extra = {}
    if loss_args:
      extra = dict(value=loss, grad=grads, value_fn=lambda p: loss_fn(p, *args))
    updates, state = tx.update(grads, state, params, **extra)
    return loss, optax.apply_updates(params, updates), state

  return step


def run_steps(step: Callable, params, state, batches: Sequence[tuple], steps: int,
              jit: bool = True) -> tuple[jax.Array, Any, Any]:
  """``steps`` calls of ``step(params, state, *batch)``, jitted with donation unless ``jit=False``.

  Returns:
    ``(losses, params, state)`` with the losses of every step stacked.
  """
  params, state = copy(params), copy(state)  # some inits share buffers between leaves (cocob, sam)
  if jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  losses = []
  for t in range(steps):
    # One step in flight at a time: on a mesh of simulated CPU devices with several steps
    # queued, the client's threads can all wait in one step's collective while the devices it
    # needs are queued behind them (a 40 s rendezvous timeout on a loaded two-core machine).
    loss, params, state = jax.block_until_ready(step(params, state, *batches[t % len(batches)]))
    losses.append(loss)
  return jnp.stack(losses), params, state


def reference_steps(step: Callable, params, state, batches: Sequence[tuple], steps: int
                    ) -> tuple[list, tuple]:
  """The run of ``step`` taken apart into its steps, for ``criteria.assert_each_step_matches``.

  Returns:
    ``(starts, run)``: ``starts[t]`` the ``(params, state)`` before step ``t``; ``run`` the
    ``(losses, params, state)`` after each step, the losses stacked, params and state as lists.
  """
  step = jax.jit(step)
  starts, losses, out_params, out_state = [(params, state)], [], [], []
  for t in range(steps):
    loss, params, state = jax.block_until_ready(step(params, state, *batches[t % len(batches)]))
    starts.append((params, state))
    losses.append(loss)
    out_params.append(params)
    out_state.append(state)
  return starts[:-1], (jnp.stack(losses), out_params, out_state)


def steps_from(step: Callable, starts: list, batches: Sequence[tuple]) -> tuple:
  """``step`` from each of ``starts`` (``reference_steps``), one step each, with step ``t``'s
  batch: ``(losses, params, state)`` after each, in ``reference_steps``' form."""
  step = jax.jit(step)
  outs = [jax.block_until_ready(step(p, s, *batches[t % len(batches)]))
          for t, (p, s) in enumerate(starts)]
  return jnp.stack([o[0] for o in outs]), [o[1] for o in outs], [o[2] for o in outs]


def mlp_params_and_batches(seed: int = 0) -> tuple[dict, list[tuple[jax.Array, jax.Array]]]:
  """A two-layer tanh MLP's params and one batch, for quick (e.g. eager) comparisons."""
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  params = {"w1": jax.random.normal(k[0], (4, 8)), "w2": jax.random.normal(k[1], (8, 2))}
  return params, [(jax.random.normal(k[2], (3, 4)), jax.random.normal(k[3], (3, 2)))]


def mlp_loss(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def stacked_params(layers: int = 4, dim: int = DIM) -> dict:
  """Params of ``scanned_loss``: an embedding, ``layers`` stacked residual layers, a head."""
  k = jax.random.split(jax.random.PRNGKey(3), 3)
  return {
      "embed": jax.random.normal(k[0], (VOCAB, dim)) / np.sqrt(dim),
      "layers": {"w": jax.random.normal(k[1], (layers, dim, dim)) / np.sqrt(dim),
                 "b": jnp.zeros((layers, dim))},
      "head": jax.random.normal(k[2], (dim, VOCAB)) / np.sqrt(dim),
  }


def scanned_loss(params, tokens, targets):
  """A residual MLP whose layers are stacked params consumed by ``lax.scan``."""
  body = lambda h, layer: (h + jnp.tanh(h @ layer["w"] + layer["b"]), None)
  h, _ = jax.lax.scan(body, params["embed"][tokens], params["layers"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], targets).mean()


def abstract_stacked_params(layers: int, dim: int, vocab: int = VOCAB) -> dict:
  """``stacked_params``' shapes as ``jax.ShapeDtypeStruct``s, for compile-only memory checks
  (with ``vocab`` tokens: ``scanned_loss`` reads as many as its inputs say)."""
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return {"embed": spec(vocab, dim),
          "layers": {"w": spec(layers, dim, dim), "b": spec(layers, dim)},
          "head": spec(dim, vocab)}


def compiled_memory(fx, loss_fn: Callable, params, *args, **step_kwargs):
  """``memory_analysis()`` of ``fx``'s step, jitted with donation, compiled for abstract inputs
  (``jax.ShapeDtypeStruct``s): nothing is allocated."""
  step = jax.jit(fx.value_and_update(loss_fn, **step_kwargs), donate_argnums=(0, 1))
  return step.lower(params, jax.eval_shape(fx.init, params), *args).compile().memory_analysis()


def compiled_peak(fx, loss_fn: Callable, params, *args, **step_kwargs) -> int:
  """Compiled peak bytes of ``fx``'s step (``compiled_memory``): arguments + temporaries +
  outputs - aliased outputs."""
  stats = compiled_memory(fx, loss_fn, params, *args, **step_kwargs)
  return (stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes)


RESIDUAL_LAYERS, RESIDUAL_DIM = 16, 256


def residual_stack_specs(layers: int = RESIDUAL_LAYERS, dim: int = RESIDUAL_DIM,
                         batch: int = 64) -> tuple[dict, tuple]:
  """Compile-only ``(params, (x, y))`` specs of ``residual_stack_loss``: ``layers`` stacked
  ``dim``x``dim`` residual layers with biases, and a linear head."""
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"w": spec(layers, dim, dim), "b": spec(layers, dim), "out": spec(dim, 1)}
  return params, (spec(batch, dim), spec(batch, 1))


def residual_stack_loss(p, x, y):
  body = lambda h, layer: (h + jnp.tanh(h @ layer[0] + layer[1]), None)
  h, _ = jax.lax.scan(body, x, (p["w"], p["b"]))
  return jnp.mean((h @ p["out"] - y) ** 2)


def ema_of_params(lr: float = 1e-2) -> optax.GradientTransformation:
  """A rowwise transform whose state reads the params (``mu``, an average of the params that
  the update pulls towards): a row loop cannot leave its slots to a pass after the loop."""

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, mu, params):
    mu = jax.tree.map(lambda m, p: 0.9 * m + 0.1 * p, mu, params)
    return jax.tree.map(lambda g, m, p: -lr * (g + 0.01 * (p - m)), grads, mu, params), mu

  return optax.GradientTransformation(init, update)


def orbax_round_trip(path, tree, template):
  """``tree`` saved with Orbax under ``path`` and restored onto ``template``'s shardings (memory
  kinds included), as a resumed job restores it."""
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            template)
    return checkpointer.restore(path, abstract)


@functools.cache
def float16_compiles() -> bool:
  """Whether XLA on the default backend compiles a float16 conversion. XLA:CPU needs the F16C
  instructions for it (AVX and up); at ``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2`` it fails with
  "Symbols not found: __truncsfhf2" in plain optax too, so a float16 test has nothing to
  compare there."""
  try:
    convert = jax.jit(lambda x: (x.astype(jnp.float16) * 3).astype(jnp.float32))
    convert(jnp.ones(4)).block_until_ready()
  except jax.errors.JaxRuntimeError:
    return False
  return True


def load_example(name: str):
  """The module of ``examples/<name>.py`` (the examples are files, not a package)."""
  path = pathlib.Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"examples.{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def nudge(tree, ulps: int):
  """``tree`` with every float leaf moved ``ulps`` representable values up (down if negative)."""
  def move(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    for _ in range(abs(ulps)):
      x = jnp.nextafter(x, jnp.full_like(x, jnp.inf if ulps > 0 else -jnp.inf))
    return x
  return jax.tree.map(move, tree)


# A low-bit trajectory is chaotic: an ulp that moves a moment across a code boundary flips that
# code, the weight then moves by a fraction of a learning-rate step, and every later gradient
# differs. Fusion reorders no arithmetic of the update, but XLA contracts the fused program
# differently, and the modes with a global norm or microbatches sum the gradient in another
# order, so a fused run is one more trajectory of that family; which codes flip depends on the
# code XLA:CPU emits for the processor. The test measures the family's width itself: the
# reference run from starting points one and two ulps away (NUDGES), against each other. A fused
# run passes when each leaf and the losses are within LOW_BIT_TOL of the reference (no code
# flipped), or within SPREAD_MARGIN times the widest distance between those reference runs: the
# largest of six distances drawn from the family can still be below a seventh, and at
# XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 a fused run's distance reached 1.0 times it.
#
# That width is measured, so a chaotic enough reference would widen it without limit: it is
# capped at SPREAD_CAP times how far the reference moved the leaf, ||p_T - p_0|| (for the losses,
# how far the loss moved from the first step's); tests/criteria.py says why the cap is what it
# is, beside the one-step check's. The widths measured, python -m tests.low_bit_margins: at most
# 4.1e-3 in the low-bit AdamW tests (10 steps; 20 steps with gradient clipping reached 9.9e-3),
# but 1e-2 to 4.3e-2 for low-bit Muon's matrices (20 steps, 8 bits: the orthogonalisation
# spreads a flipped code over the whole matrix). A reference whose width exceeds the cap on a
# leaf the tolerance (LOW_BIT_TOL) does not settle cannot tell the fused run from such an error,
# and the check says so and fails.
NUDGES = (1, -1, 2)
SPREAD_MARGIN = 2.0


def _distances(a, b) -> list[float]:
  """The largest loss difference of two ``(losses, params)`` runs, then each leaf's Euclidean
  distance."""
  loss = float(np.max(np.abs(np.asarray(a[0], np.float64) - np.asarray(b[0], np.float64))))
  return [loss, *(float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                  for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]), strict=True))]


class Spread(NamedTuple):
  """What a chaotic reference accepts, for the losses then each params leaf (``names``).

  ``want`` is the reference's ``(losses, params)`` from the start itself; ``widths`` are
  SPREAD_MARGIN times the widest distance between the runs from nudged starts; ``caps`` are
  SPREAD_CAP times how far ``want`` moved (``_movement``)."""

  want: tuple
  names: list[str]
  widths: list[float]
  caps: list[float]


class Judged(NamedTuple):
  """One leaf (or the losses) of a run judged against a ``Spread``."""

  name: str
  distance: float  # from the reference's run
  width: float  # the width accepted
  cap: float  # the widest width that can be accepted
  within_tol: bool  # within the tolerance of the reference's run, element by element

  @property
  def margin(self) -> float:
    """The distance in units of the width accepted: the check passes a leaf below 1."""
    return self.distance / self.width if self.width else float("inf")


def _movement(start, want) -> list[float]:
  """How far the run ``want = (losses, params)`` went: the largest change of its loss from the
  first step's, then each leaf's Euclidean distance from ``start``."""
  losses = np.asarray(want[0], np.float64)
  return [float(np.max(np.abs(losses - losses[0]))),
          *_distances((losses, start), (losses, want[1]))[1:]]


def reference_spread(reference: Callable[[int], tuple], start, nudges: Sequence[int] = NUDGES
                     ) -> Spread:
  """The ``Spread`` of the runs ``reference(ulps)`` for ``ulps`` in ``(0, *nudges)``, each
  ``(losses, params)`` trained from ``start`` moved by ``ulps`` (``nudge``)."""
  runs = [reference(ulps) for ulps in (0, *nudges)]
  pairs = [_distances(a, b) for i, a in enumerate(runs) for b in runs[i + 1:]]
  names = ["losses", *(jax.tree_util.keystr(k) for k, _ in
                       jax.tree_util.tree_flatten_with_path(runs[0][1])[0])]
  return Spread(runs[0], names, [SPREAD_MARGIN * max(column) for column in zip(*pairs)],
                [SPREAD_CAP * moved for moved in _movement(start, runs[0])])


def judge(got, spread: Spread, tol: dict = LOW_BIT_TOL) -> list[Judged]:
  """Each of the losses and the params leaves of ``got = (losses, params)`` against ``spread``."""
  want = spread.want
  values = [(got[0], want[0]), *zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]),
                                     strict=True)]
  within = [np.allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
            for g, w in values]
  return [Judged(*row) for row in zip(spread.names, _distances(got, want), spread.widths,
                                      spread.caps, within, strict=True)]


def assert_within_spread(got, spread: Spread, tol: dict = LOW_BIT_TOL):
  """Asserts that ``got = (losses, params)`` follows the reference ``spread`` was measured on:
  each of the losses and the params leaves is within ``tol`` (``np.allclose``) of the
  reference's run, or within the width its nudged runs accept (see LOW_BIT_TOL's comment).

  Raises:
    AssertionError: a leaf is beyond both ("beyond").
    SpreadTooWide: the reference's own width exceeds the cap on a leaf the tolerance does not
      settle ("cannot judge").
  """
  for j in judge(got, spread, tol):
    if j.within_tol:
      continue
    if j.width > j.cap:
      raise _too_wide(j)
    assert j.distance <= j.width, (
        f"{j.name}: distance {j.distance:.3g} from the reference, beyond {SPREAD_MARGIN} x the "
        f"spread of reference runs started an ulp or two apart ({j.width:.3g})")


def _too_wide(j: Judged) -> SpreadTooWide:
  return SpreadTooWide(
      f"{j.name}: the reference runs started an ulp or two apart are {j.width:.3g} wide "
      f"({SPREAD_MARGIN} x their spread), more than {SPREAD_CAP} of how far the reference "
      f"moved ({j.cap:.3g}): the spread check cannot judge this run (a learning rate 1 % off "
      "could pass). Shorten the run or lower the learning rate until the reference is less "
      "chaotic.")


def spread_distance(got, spread: Spread, tol: dict = LOW_BIT_TOL) -> tuple[float, str]:
  """The spread check's distance of ``got = (losses, params)``, for ``criteria.Criterion``: the
  largest over the leaves beyond ``tol`` whose width the check accepts (at most the cap) of
  their distance in units of that width, and its leaf; 0 where every leaf is within ``tol``.

  Raises:
    SpreadTooWide: no leaf is beyond its width, and a leaf beyond ``tol`` has a width over the
      cap: the check cannot judge the run.
  """
  beyond = [j for j in judge(got, spread, tol) if not j.within_tol]
  judgeable = [j for j in beyond if j.width <= j.cap]
  worst = max(((j.margin, j.name) for j in judgeable), default=(0.0, ""))
  if worst[0] <= 1 and len(judgeable) < len(beyond):
    raise _too_wide(next(j for j in beyond if j.width > j.cap))
  return worst


def assert_within_reference_spread(got, reference: Callable[[int], tuple], tol: dict, *, start,
                                   nudges: Sequence[int] = NUDGES):
  """``assert_within_spread`` of a chaotic run ``got = (losses, params)`` against
  ``reference``, which runs the reference from ``start`` moved by ``ulps`` (``nudge``) and
  returns its ``(losses, params)``, from as many starts as ``nudges`` says."""
  assert_within_spread(got, reference_spread(reference, start, nudges), tol)


def assert_same_low_bit_trajectory(got, reference: Callable[[int], tuple], *, start,
                                   nudges: Sequence[int] = NUDGES):
  """``assert_within_reference_spread`` at LOW_BIT_TOL: a low-bit run, whose flipped codes
  make the trajectory chaotic."""
  assert_within_reference_spread(got, reference, LOW_BIT_TOL, start=start, nudges=nudges)


def assert_rejected(got, spread: Spread, error: str, tol: dict = LOW_BIT_TOL):
  """Asserts that ``assert_within_spread`` fails ``got``, a run with ``error`` injected, because
  a leaf is beyond the width accepted (not because the reference cannot judge it), by at least
  ``criteria.REJECTED_BY`` times that width."""
  try:
    assert_within_spread(got, spread, tol)
  except AssertionError as e:
    assert "beyond" in str(e), f"{error}: {e}"
  else:
    pytest.fail(f"the spread check passes a run with {error} injected")
  worst = max((j for j in judge(got, spread, tol) if not j.within_tol), key=lambda j: j.margin)
  assert worst.margin >= REJECTED_BY, (
      f"{error}: {worst.name} only {worst.margin:.3g} times the width accepted")
