"""``optfuse.train_step``: a loss function becomes a fused training step on a train state.

The decorated function is the user's loss, unchanged; the result takes a train state in place of
the params. It works with any state that follows the ``flax.training.train_state.TrainState``
protocol (fields ``step``, ``params``, ``tx``, ``opt_state`` and a ``replace`` method), so a
plain Flax ``TrainState`` needs no other change, and it defers to ``state.value_and_update``
for an ``optfuse.linen.TrainState``. This module does not import Flax.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from optfuse._base import _memory_spaces, _options
from optfuse._base._errors import OffloadError, OptionsError
from optfuse._base._options import NOT_GIVEN, FuseOptions, NotGiven
from optfuse._fuse import fuse_with


def train_step(loss_fn: Callable | None = None, *, has_aux: bool = False,
               options: FuseOptions | None = None, mode: str | None = None,
               global_ops: str | None | NotGiven = NOT_GIVEN, microbatches: int | None = None,
               guard: bool | None = None,
               offload: str | None | NotGiven = NOT_GIVEN) -> Callable:
  """Turns ``loss_fn(params, *args)`` into ``step(state, *args) -> (value, state)``.

  ``step(state, *args)`` does what ``jax.value_and_grad(loss_fn)(state.params, *args)`` followed
  by ``state.apply_gradients(grads=grads)`` does, with the optimizer update fused into the
  backward pass. Use it as a decorator (``@optfuse.train_step`` or
  ``@optfuse.train_step(has_aux=True)``) or call it inline:
  ``loss, state = optfuse.train_step(loss_fn)(state)``.

  The fusion options are one ``FuseOptions``: ``options=``, or the keywords ``mode``,
  ``global_ops``, ``guard`` and ``offload``, a shorthand that builds it (a keyword left at its
  default is not given; an explicit ``offload=None`` or ``global_ops=None`` is given). An
  ``optfuse.linen.TrainState`` carries its own options, which its ``opt_state`` was built for:
  the step runs with them, and options given here must agree.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a float scalar, or ``(loss, aux)``
      with ``has_aux``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    options: the ``FuseOptions`` of the step, in place of the keywords. By default the state's
      own for an ``optfuse.linen.TrainState``, else ``FuseOptions()`` (backward mode). A plain
      Flax state's ``opt_state`` must have the layout ``optfuse.fuse(state.tx, options=
      options).init`` gives: ``tx.init(params)`` in "backward" and "off" mode.
    mode: the fusion mode ("backward", "forward" or "off"; see ``optfuse.fuse``).
    global_ops: ``"two_pass"`` lets backward mode run global transforms such as
      ``clip_by_global_norm`` (see ``optfuse.fuse``).
    microbatches: split every array argument along its leading axis into this many microbatches
      whose mean gradient makes one update; the value is their mean loss.
    guard: ``True`` keeps backward mode's loops only where they lower the compiled peak (see
      ``optfuse.fuse``).
    offload: ``"state"``: the slots of ``state.opt_state`` live in ``pinned_host`` memory and
      are streamed through the step (see ``optfuse.fuse``). An ``optfuse.linen.TrainState``
      is created with it (``offload="state"``); a plain Flax ``TrainState`` needs its
      ``opt_state`` moved there once, out of ``jit``: ``state.replace(opt_state=
      optfuse.from_optax_state(optfuse.fuse(state.tx, offload="state"), state.params,
      state.opt_state))``. ``"params"``: the param stacks of the fused loops too; an
      ``optfuse.linen.TrainState`` places them with ``state.params_to_host(loss_fn, *args)``,
      a plain Flax state with ``state.replace(params=optfuse.params_to_host(fx, loss_fn,
      state.params, *args))`` for ``fx = optfuse.fuse(state.tx, offload="params")``, and its
      ``opt_state`` as for ``"state"``; once, out of ``jit``.

  Returns:
    ``step(state, *args, **kwargs) -> (value, state)``: the loss (or ``(loss, aux)``) at the old
    params, and the state with new ``params`` and ``opt_state`` and ``step + 1``. Without
    ``loss_fn``, a decorator that builds it.

  Raises:
    UnknownModeError, OffloadError, GuardError: the options make a combination that does not
      run, as ``optfuse.fuse`` raises them (when ``train_step`` is called).
    MicrobatchError: ``microbatches`` is not a positive int or ``None`` (when ``train_step`` is
      called).
    OptionsError: ``options`` and a keyword contradict each other (when ``train_step`` is
      called), or the options given contradict those of an ``optfuse.linen.TrainState`` (at the
      step).
    OffloadError: ``offload`` is given and a plain Flax state's slots are in device memory, or
      with ``offload="params"`` a param leaf is not where the step keeps it (at the step).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse
    >>> from flax.training import train_state
    >>> state = train_state.TrainState.create(
    ...     apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
    >>> @optfuse.train_step
    ... def loss_fn(params, x):
    ...   return jnp.sum(params["w"] * x)
    >>> loss, state = jax.jit(loss_fn)(state, jnp.arange(3.0))
    >>> print(state.params["w"], state.step)
    [1.  0.9 0.8] 1
  """
  given = dict(mode=mode, global_ops=global_ops, guard=guard, offload=offload)
  if loss_fn is None:
    return functools.partial(train_step, has_aux=has_aux, options=options,
                             microbatches=microbatches, **given)
  # Checked here, once: a step on an optfuse.linen.TrainState runs with the state's own options,
  # which must agree with those given.
  resolved = _options.resolve(options, **given)
  resolved.check_microbatches(microbatches)
  # What was given, for the comparison with a state's own options: all of ``options``, else the
  # keywords given.
  named = (dataclasses.asdict(options) if options is not None
           else _options.given_options(**given))
  fused_by_tx: dict = {}

  @functools.wraps(loss_fn)
  def step(state, *args, **kwargs) -> tuple[Any, Any]:
    if hasattr(state, "value_and_update") and isinstance(getattr(state, "options", None),
                                                         FuseOptions):
      _check_agrees_with_state(state.options, named)
      return state.value_and_update(loss_fn, *args, has_aux=has_aux,
                                    microbatches=microbatches, **kwargs)
    if state.tx not in fused_by_tx:
      fused_by_tx[state.tx] = fuse_with(state.tx, resolved)
    if resolved.offload is not None:
      _check_slots_on_host(state.opt_state, resolved.offload)
    update = fused_by_tx[state.tx].value_and_update(loss_fn, has_aux=has_aux,
                                                    microbatches=microbatches)
    value, params, opt_state = update(state.params, state.opt_state, *args, **kwargs)
    return value, state.replace(step=state.step + 1, params=params, opt_state=opt_state)

  return step


def _check_agrees_with_state(options: FuseOptions, given: dict) -> None:
  """Raises unless each option given to ``train_step`` is the one in ``options``, those the
  state was created with: its ``opt_state`` has that mode's layout and that offload's
  placement."""
  conflicts = {name: value for name, value in given.items() if getattr(options, name) != value}
  if conflicts:
    named = ", ".join(f"{name}={value!r}" for name, value in conflicts.items())
    raise OptionsError(
        f"train_step was given {named} but the state was created with {options!r}, and its "
        f"opt_state was built for those options. Drop them from train_step, or create the "
        f"state with the options you want.")


def _check_slots_on_host(opt_state, offload: str) -> None:
  try:
    _memory_spaces.check_on_host(opt_state)
  except OffloadError as e:
    raise OffloadError(
        f"{e} With optfuse.train_step(offload={offload!r}) on a flax TrainState, move its "
        "opt_state to the host once, outside jit: state.replace(opt_state=optfuse."
        f"from_optax_state(optfuse.fuse(state.tx, offload={offload!r}), state.params, "
        "state.opt_state)), or create the state with optfuse.linen.TrainState.create(..., "
        f"offload={offload!r}).") from None
