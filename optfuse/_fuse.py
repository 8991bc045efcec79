"""The public entry point: ``optfuse.fuse(tx, mode)``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from optfuse._base import _checks, _options
from optfuse._base._options import NOT_GIVEN, FuseOptions, NotGiven
from optfuse._engines._backward import BackwardEngine
from optfuse._engines._engine import Engine, PlacedStep, Step, without_placements
from optfuse._engines._forward import ForwardEngine
from optfuse._engines._guard import GuardedEngine
from optfuse._engines._offload import OffloadEngine, with_params_placed
from optfuse._engines._two_pass import TwoPassEngine
from optfuse._engines._unfused import OffEngine
from optfuse._jaxpr import _interpreter
from optfuse._plan import _make
from optfuse._targets import _backends


class FusedTransformation(NamedTuple):
  """An optax transformation with its update fused into the training step.

  Attributes:
    init: ``init(params) -> state``. In "backward" and "off" mode exactly ``tx.init(params)``.
    value_and_update: ``value_and_update(loss_fn, has_aux=False, *, microbatches=None) -> step``
      where ``step(params, state, *args, **kwargs) -> (value, params, state)``. With
      ``microbatches=k`` every array argument is split along its leading axis into ``k``
      microbatches whose mean gradient makes one update (the mean loss is returned); it raises
      ``MicrobatchError`` for a ``k`` that is not a positive int, and ``GuardError`` for
      ``k > 1`` with ``guard=True`` (``FuseOptions.check_microbatches``).
    flush: ``flush(params, state) -> (params, state)``; applies a pending forward-mode update,
      identity in the other modes.
    tx: the wrapped optax transformation.
    options: the ``FuseOptions`` it runs with, as given to ``optfuse.fuse``; ``mode``,
      ``global_ops``, ``offload`` and ``guard`` read them.
  """

  init: Callable[[Any], Any]
  value_and_update: Callable[..., Callable[..., tuple[Any, Any, Any]]]
  flush: Callable[[Any, Any], tuple[Any, Any]]
  tx: optax.GradientTransformation
  options: FuseOptions

  @property
  def mode(self) -> str:
    """The mode: "backward", "forward" or "off"."""
    return self.options.mode

  @property
  def global_ops(self) -> str | None:
    """``None`` or ``"two_pass"``."""
    return self.options.global_ops

  @property
  def offload(self) -> str | None:
    """``None``, ``"state"``, ``"params"`` or ``"auto"``."""
    return self.options.offload

  @property
  def guard(self) -> bool:
    """Whether the memory guard keeps only loops that lower the compiled peak."""
    return self.options.guard


# The engine of each mode (``_engine.Engine``), built from the transformation and the options;
# ``ENGINE_OF`` names the engine of a ``(mode, global_ops)`` pair where it is not the mode's own.
ENGINES: dict[str, Callable[[optax.GradientTransformation, FuseOptions], Engine]] = {
    "off": OffEngine,
    "backward": BackwardEngine,
    "two_pass": TwoPassEngine,
    "forward": ForwardEngine,
}
ENGINE_OF = {("backward", "two_pass"): "two_pass"}


def make_engine(tx: optax.GradientTransformation, options: FuseOptions) -> Engine:
  """The engine that runs ``tx`` with ``options``: the mode's, behind the memory guard with
  ``guard``, in host memory with ``offload``."""
  engine = ENGINES[ENGINE_OF.get((options.mode, options.global_ops), options.mode)](tx, options)
  if options.guard:
    engine = GuardedEngine(engine)
  return engine if options.offload is None else OffloadEngine(engine)


def fuse(tx: optax.GradientTransformation, mode: str | None = None,
         global_ops: str | None | NotGiven = NOT_GIVEN, offload: str | None | NotGiven = NOT_GIVEN,
         guard: bool | None = None, *, options: FuseOptions | None = None
         ) -> FusedTransformation:
  """Fuses the optax transformation ``tx`` into the training step.

  The options are one ``FuseOptions``: ``options=``, or the keywords, a shorthand that builds
  it (a keyword left at its default takes that of ``options``, or "backward" mode without the
  others; an explicit ``offload=None`` or ``global_ops=None`` is given, and must agree with
  ``options``).

  Args:
    tx: any optax ``GradientTransformation`` (a chain, ``inject_hyperparams``, masks...).
    mode: "backward" (default) updates each leaf inside the backward pass as soon as its
      gradient is complete (separable transforms only); "forward" keeps the gradient and
      applies the update just before each leaf's first use in the next step (every transform);
      "off" is the plain optax step behind the same API.
    global_ops: ``"two_pass"`` lets backward mode run transforms that reduce over all the
      gradients (``clip_by_global_norm``, ``apply_if_finite``...) exactly: a first backward pass
      computes the global statistics, a second one (over the same forward pass) fuses the
      updates. ``None`` (default): backward mode refuses them with ``NonSeparableError``.
      Forward and off modes run them exactly either way.
    offload: ``"state"`` keeps the optimizer state's slots (every float state leaf with at least
      one axis: Adam's ``mu`` and ``nu``) in ``pinned_host`` memory between steps. Backward mode
      streams them through the device: one row per fused loop iteration, prefetched an
      iteration ahead, and each tapped leaf's slots whole at its tap. Forward mode keeps the
      pending gradient there too and streams both into its forward loop (global clipping
      included). Mode "off" fetches the whole state for optax's update. ``"params"``: the
      state as with ``"state"``, and the param stacks the fused loops update too (backward and
      forward modes): each layer's rows are fetched for its forward and its backward iteration
      and the new rows written back to the host there; place the params with
      ``optfuse.params_to_host``. ``"auto"`` (backward mode): each leaf streams what
      ``optfuse.place`` plans for a memory budget (nothing, its slots, or its params and
      slots), with the fewest bytes moved; ``init`` leaves the state on the device and
      ``optfuse.place`` places params and state. ``None`` (default): the state lives on the
      device.
    guard: backward mode only. ``True``: the first trace of the step for given input shapes
      compiles it twice more (every loop fused; every fused leaf tapped; with several fused
      scans, once more per scan) for the platform it is traced for, and keeps the placement
      with the lowest compiled peak, so that fusion never peaks above taps (which peak at
      optax's); ``describe(fx, ...).reasons`` says which loops it gave up and both peaks. Not
      with ``offload="params"`` or ``"auto"``, whose stacks are read a row at a time only in
      their loops.
      ``False`` (default): every loop that can fuse is fused.
    options: the options as one ``FuseOptions``, in place of the keywords.

  Returns:
    A ``FusedTransformation``; its ``options`` are the ``FuseOptions`` it runs with.

  Raises:
    UnknownModeError: ``mode`` is not one of "backward", "forward", "off", or ``global_ops`` is
      not ``None`` or "two_pass".
    OffloadError: ``offload`` is not ``None``, "state", "params" or "auto", or is given with
      ``global_ops``, or is "params" in mode "off", or "auto" outside backward mode.
    GuardError: ``guard`` is not a bool, or is ``True`` outside backward mode or with
      ``offload="params"`` or ``"auto"``.
    OptionsError: ``options`` is given with a keyword that contradicts it.

  Examples:
    >>> import jax.numpy as jnp, optax, optfuse
    >>> fx = optfuse.fuse(optax.adam(1e-2))
    >>> params = {"w": jnp.ones(3)}
    >>> state = fx.init(params)
    >>> step = fx.value_and_update(lambda p, x: jnp.sum((p["w"] * x) ** 2))
    >>> loss, params, state = step(params, state, jnp.arange(3.0))
    >>> float(loss)
    5.0
  """
  return fuse_with(tx, _options.resolve(options, mode=mode, global_ops=global_ops,
                                        offload=offload, guard=guard))


class _ValueAndUpdate:
  """A fused transformation's ``value_and_update``: the steps of its engine.

  ``placed`` builds the same step returning what its trace placed where too (``describe``
  traces it); calling builds the step the user runs, which drops them.
  """

  def __init__(self, engine: Engine):
    self.engine = engine

  def placed(self, loss_fn: Callable, has_aux: bool = False,
             microbatches: int | None = None) -> PlacedStep:
    """The step of ``loss_fn``, returning ``((value, params, state), Placed)``.

    Raises:
      MicrobatchError: ``microbatches`` is not a positive int or ``None``.
    """
    step = self.engine.step(loss_fn, has_aux,
                            self.engine.options.check_microbatches(microbatches))
    return _on_inputs_placement(_interpreter.with_shared_scalars(step))

  def __call__(self, loss_fn: Callable, has_aux: bool = False, *,
               microbatches: int | None = None) -> Step:
    step = self.placed(loss_fn, has_aux, microbatches)
    if self.engine.options.offload in ("params", "auto"):
      step = with_params_placed(step, mixed=self.engine.options.offload == "auto")
    return without_placements(step)


def fuse_with(tx: optax.GradientTransformation, options: FuseOptions) -> FusedTransformation:
  """``fuse(tx, ...)`` with its options as one checked value (``train_step``, the Flax
  adapters)."""
  engine = make_engine(tx, options)
  return FusedTransformation(engine.init, _ValueAndUpdate(engine),
                             _on_inputs_placement(_interpreter.with_shared_scalars(engine.flush)),
                             tx, options)


def _on_inputs_placement(step: Callable) -> Callable:
  """``step``, traced with the compiler choices of the platform and the mesh its params are
  placed on."""

  @functools.wraps(step)
  def traced(params, *args, **kwargs):
    with _backends.traced_on(params):
      return step(params, *args, **kwargs)

  return traced


def check_separable(tx: optax.GradientTransformation, params) -> None:
  """Raises ``NonSeparableError`` if ``tx`` cannot run in backward mode for ``params``.

  Args:
    tx: an optax transformation.
    params: params or their ``jax.ShapeDtypeStruct`` values.

  Returns:
    None.

  Raises:
    NonSeparableError: naming the part of the chain whose update of one leaf reads the
      gradients of other leaves.
  """
  abstract = _checks.abstract(params)
  _make.make_plan(tx, abstract, jax.eval_shape(tx.init, abstract))
