"""``optfuse.train_step``: a loss function becomes a fused training step on a train state.

The decorated function is the user's loss, unchanged; the result takes a train state in place of
the params. It works with any state that follows the ``flax.training.train_state.TrainState``
protocol (fields ``step``, ``params``, ``tx``, ``opt_state`` and a ``replace`` method), so a
plain Flax ``TrainState`` needs no other change, and it defers to ``state.value_and_update``
for an ``optfuse.linen.TrainState``. This module does not import Flax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from optfuse._base import _memory_spaces
from optfuse._base._errors import OffloadError
from optfuse._base._options import FuseOptions
from optfuse._fuse import fuse_with


def train_step(loss_fn: Callable | None = None, *, has_aux: bool = False,
               mode: str | None = None, global_ops: str | None = None,
               microbatches: int | None = None, guard: bool = False,
               offload: str | None = None) -> Callable:
  """Turns ``loss_fn(params, *args)`` into ``step(state, *args) -> (value, state)``.

  ``step(state, *args)`` does what ``jax.value_and_grad(loss_fn)(state.params, *args)`` followed
  by ``state.apply_gradients(grads=grads)`` does, with the optimizer update fused into the
  backward pass. Use it as a decorator (``@optfuse.train_step`` or
  ``@optfuse.train_step(has_aux=True)``) or call it inline:
  ``loss, state = optfuse.train_step(loss_fn)(state)``.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a float scalar, or ``(loss, aux)``
      with ``has_aux``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    mode: the fusion mode ("backward", "forward" or "off"). By default the state's own ``mode``
      for an ``optfuse.linen.TrainState``, else "backward". The state's ``opt_state`` must have
      the layout ``optfuse.fuse(state.tx, mode).init`` gives: ``tx.init(params)`` in "backward"
      and "off" mode.
    global_ops: ``"two_pass"`` lets backward mode run global transforms such as
      ``clip_by_global_norm`` (see ``optfuse.fuse``). By default the state's own ``global_ops``
      for an ``optfuse.linen.TrainState``, else ``None``.
    microbatches: split every array argument along its leading axis into this many microbatches
      whose mean gradient makes one update; the value is their mean loss.
    guard: ``True`` keeps backward mode's loops only where they lower the compiled peak (see
      ``optfuse.fuse``); an ``optfuse.linen.TrainState`` uses its own ``guard``.
    offload: ``"state"``: the slots of ``state.opt_state`` live in ``pinned_host`` memory and
      are streamed through the step (see ``optfuse.fuse``). By default the state's own
      ``offload`` for an ``optfuse.linen.TrainState`` (create it with ``offload="state"``),
      else ``None``. A plain Flax ``TrainState`` needs its ``opt_state`` moved there once, out
      of ``jit``: ``state.replace(opt_state=optfuse.from_optax_state(optfuse.fuse(state.tx,
      offload="state"), state.params, state.opt_state))``.

  Returns:
    ``step(state, *args, **kwargs) -> (value, state)``: the loss (or ``(loss, aux)``) at the old
    params, and the state with new ``params`` and ``opt_state`` and ``step + 1``. Without
    ``loss_fn``, a decorator that builds it.

  Raises:
    UnknownModeError: ``mode`` or ``global_ops`` is not one ``optfuse.fuse`` accepts (when
      ``train_step`` is called).
    GuardError: ``guard`` is not a bool, or is ``True`` outside backward mode (when
      ``train_step`` is called).
    ValueError: ``mode`` or ``global_ops`` contradicts that of an ``optfuse.linen.TrainState``.
    OffloadError: ``offload`` is not ``None`` or ``"state"``, or is given with ``global_ops``
      (when ``train_step`` is called); or it contradicts the ``offload`` of an
      ``optfuse.linen.TrainState``, or the state's slots are in device memory (at the step).

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
  if loss_fn is None:
    return functools.partial(train_step, has_aux=has_aux, mode=mode, global_ops=global_ops,
                             microbatches=microbatches, guard=guard, offload=offload)
  # Checked here, once: a step on an optfuse.linen.TrainState runs with the state's own options,
  # which must agree with those given.
  options = FuseOptions(mode or "backward", global_ops, offload, guard)
  fused_by_tx: dict = {}

  @functools.wraps(loss_fn)
  def step(state, *args, **kwargs) -> tuple[Any, Any]:
    if hasattr(state, "value_and_update") and isinstance(getattr(state, "options", None),
                                                         FuseOptions):
      _check_agrees_with_state(state.options, mode=mode, global_ops=global_ops, offload=offload)
      return state.value_and_update(loss_fn, *args, has_aux=has_aux,
                                    microbatches=microbatches, **kwargs)
    if state.tx not in fused_by_tx:
      fused_by_tx[state.tx] = fuse_with(state.tx, options)
    if offload is not None:
      _check_slots_on_host(state.opt_state)
    update = fused_by_tx[state.tx].value_and_update(loss_fn, has_aux=has_aux,
                                                    microbatches=microbatches)
    value, params, opt_state = update(state.params, state.opt_state, *args, **kwargs)
    return value, state.replace(step=state.step + 1, params=params, opt_state=opt_state)

  return step


def _check_agrees_with_state(options: FuseOptions, **given) -> None:
  """Raises unless each argument of ``train_step`` given is the one in ``options``, those the
  state was created with: its ``opt_state`` has that mode's layout and that offload's
  placement."""
  for name, value in given.items():
    own = getattr(options, name)
    if value is not None and value != own:
      error = OffloadError if name == "offload" else ValueError
      raise error(
          f"train_step was given {name}={value!r} but the state was created with "
          f"{name}={own!r}, and its opt_state was built for it. Drop the {name} argument or "
          f"create the state with the {name} you want.")


def _check_slots_on_host(opt_state) -> None:
  try:
    _memory_spaces.check_on_host(opt_state)
  except OffloadError as e:
    raise OffloadError(
        f"{e} With optfuse.train_step(offload='state') on a flax TrainState, move its opt_state "
        "to the host once, outside jit: state.replace(opt_state=optfuse.from_optax_state("
        "optfuse.fuse(state.tx, offload='state'), state.params, state.opt_state)), or create "
        "the state with optfuse.linen.TrainState.create(..., offload='state').") from None
