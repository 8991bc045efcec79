"""Flax Linen adapter: a ``TrainState`` whose step fuses the optimizer update.

``optfuse.linen.TrainState`` is ``flax.training.train_state.TrainState`` with two more static
fields (the fusion ``options`` and the cached fused transformation) and one more method:

* ``state.value_and_update(loss_fn, *args)`` replaces
  ``jax.value_and_grad(loss_fn)(state.params, *args)`` followed by
  ``state.apply_gradients(grads=grads)``: the params and ``opt_state`` are updated inside the
  backward pass and ``step`` is incremented.

Everything else is Flax's: ``opt_state`` keeps optax's layout (in "backward" and "off" mode),
``apply_gradients`` and ``replace`` work, and the class can be subclassed to carry more fields
(``batch_stats``...) exactly like Flax's. With ``offload="state"`` the slots of ``opt_state``
live in host memory, where ``create`` puts them and every step leaves them. With
``offload="params"`` the param stacks of the fused loops live there too: ``create`` cannot know
which (they are the loss's), so ``state.params_to_host(loss_fn, *args)`` places them once,
before the first step, and every step leaves them there. With ``offload="auto"``,
``state.place(loss_fn, *args, budget=...)`` plans what each leaf streams to fit the budget and
places the params and ``opt_state`` by the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optax
from flax import struct
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from optfuse._analysis import _auto, _params_memory
from optfuse._analysis._auto import OffloadPlan
from optfuse._base import _memory_spaces
from optfuse._base._errors import ParamsStructureError
from optfuse._base._options import NOT_GIVEN, FuseOptions, NotGiven
from optfuse._fuse import FusedTransformation, fuse, fuse_with


class TrainState(train_state.TrainState):
  """Flax's ``TrainState`` with a fused ``value_and_update`` step.

  Attributes:
    step: number of updates applied so far.
    apply_fn: usually ``model.apply``.
    params: the params updated by ``tx``.
    tx: the optax transformation.
    opt_state: the state of ``tx``; exactly ``tx.init(params)`` at creation in "backward" and
      "off" mode, so checkpoints and ``apply_gradients`` interoperate with plain Flax.
    options: the ``optfuse.FuseOptions`` of ``create`` (static: part of the jit cache key);
      ``mode``, ``global_ops``, ``guard`` and ``offload`` read them. With ``offload="state"``
      the slots of ``opt_state`` (Adam's ``mu`` and ``nu``) live in ``pinned_host`` memory,
      streamed through the fused step (see ``optfuse.fuse``); with ``offload="params"`` the
      param stacks of its fused loops too, once ``params_to_host`` has placed them.
    fused: the ``optfuse.fuse(tx, options=options)`` transformation, built
      once by ``create`` and carried along by ``replace`` so that its update plans are cached
      across steps.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optfuse.linen
    >>> import flax.linen as nn
    >>> model = nn.Dense(2)
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
    >>> params = model.init(jax.random.key(0), x)["params"]
    >>> state = optfuse.linen.TrainState.create(
    ...     apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
    >>> loss, state = jax.jit(lambda s, x, y: s.value_and_update(loss_fn, x, y))(state, x, y)
    >>> int(state.step)
    1

    With the optimizer state in host memory:

    >>> state = optfuse.linen.TrainState.create(
    ...     apply_fn=model.apply, params=params, tx=optax.adam(1e-3), offload="state")
    >>> state.opt_state[0].mu["kernel"].sharding.memory_kind
    'pinned_host'
    >>> step = jax.jit(lambda s, x, y: s.value_and_update(loss_fn, x, y), donate_argnums=0)
    >>> loss, state = step(state, x, y)
    >>> state.opt_state[0].mu["kernel"].sharding.memory_kind
    'pinned_host'

    With the params of a scanned stack in host memory too:

    >>> class Layer(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, h, _):
    ...     return jnp.tanh(nn.Dense(3)(h)), None
    >>> stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
    ...                 length=4)()
    >>> params = stack.init(jax.random.key(0), x, None)["params"]
    >>> def stack_loss(params, x):
    ...   return jnp.mean(stack.apply({"params": params}, x, None)[0] ** 2)
    >>> state = optfuse.linen.TrainState.create(
    ...     apply_fn=stack.apply, params=params, tx=optax.adam(1e-3), offload="params")
    >>> state = state.params_to_host(stack_loss, x)
    >>> loss, state = jax.jit(lambda s, x: s.value_and_update(stack_loss, x),
    ...                       donate_argnums=0)(state, x)
    >>> state.params["Dense_0"]["kernel"].sharding.memory_kind
    'pinned_host'
  """

  options: FuseOptions = struct.field(pytree_node=False, default=FuseOptions(), kw_only=True)
  fused: FusedTransformation | None = struct.field(
      pytree_node=False, default=None, kw_only=True, repr=False)

  @property
  def mode(self) -> str:
    """The fusion mode, "backward", "forward" or "off"."""
    return self.options.mode

  @property
  def global_ops(self) -> str | None:
    """``None`` or ``"two_pass"``."""
    return self.options.global_ops

  @property
  def guard(self) -> bool:
    """Whether backward mode keeps only the loops that lower the compiled peak."""
    return self.options.guard

  @property
  def offload(self) -> str | None:
    """``None``, ``"state"`` (the slots of ``opt_state`` in ``pinned_host`` memory) or
    ``"params"`` (the param stacks of the fused loops too)."""
    return self.options.offload

  @classmethod
  def create(cls, *, apply_fn: Callable, params, tx: optax.GradientTransformation,
             options: FuseOptions | None = None, mode: str | None = None,
             global_ops: str | None | NotGiven = NOT_GIVEN, guard: bool | None = None,
             offload: str | None | NotGiven = NOT_GIVEN, **kwargs) -> TrainState:
    """A new state with ``step=0`` and ``opt_state = optfuse.fuse(tx, options=options).init(
    params)``.

    The options are one ``FuseOptions``, as ``optfuse.fuse`` takes them: ``options=``, or the
    keywords, a shorthand that builds it (a keyword left at ``None`` is not given).

    Args:
      apply_fn: usually ``model.apply``.
      params: the params to train.
      tx: the optax transformation.
      options: the ``FuseOptions`` of the state's steps, in place of the keywords.
      mode: "backward" (default), "forward" or "off" (see ``optfuse.fuse``).
      global_ops: ``"two_pass"`` lets backward mode run global transforms such as
        ``clip_by_global_norm`` (see ``optfuse.fuse``).
      guard: ``True`` keeps backward mode's loops only where they lower the compiled peak (see
        ``optfuse.fuse``).
      offload: ``"state"`` creates ``opt_state`` with its slots in ``pinned_host`` memory,
        where the fused step streams them from and leaves them (``fuse``'s ``init`` placement);
        not with ``global_ops``. ``"params"``: the same, and the step streams the param stacks
        of its fused loops from host memory too, where ``params_to_host`` places them
        (``params`` as given until then); not in mode "off". ``None`` (default): on the
        device.
      **kwargs: the other fields of a subclass (``batch_stats=...``).

    Returns:
      The new state.

    Raises:
      UnknownModeError: ``mode`` or ``global_ops`` is not a fusion mode.
      OffloadError: ``offload`` is not ``None``, ``"state"`` or ``"params"``, or is given
        with ``global_ops``, or is ``"params"`` in mode "off".
      GuardError: ``guard`` is ``True`` outside backward mode or with ``offload="params"``.
      OptionsError: ``options`` is given with a keyword that contradicts it.
      ParamsStructureError: ``params`` holds fp8 overwrite-with-gradient params, which are not
        trained by ``tx`` and cannot be fused.
    """
    if isinstance(params, Mapping) and OVERWRITE_WITH_GRADIENT in params:
      raise ParamsStructureError(
          f"params hold a {OVERWRITE_WITH_GRADIENT!r} collection (fp8 training); its values are "
          "overwritten by their gradients, not trained by tx, so optfuse cannot fuse them. Use "
          "flax.training.train_state.TrainState for fp8 training.")
    fused = fuse(tx, mode, global_ops, offload, guard, options=options)
    return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=fused.init(params),
               options=fused.options, fused=fused, **kwargs)

  def params_to_host(self, loss_fn: Callable, *args, **kwargs) -> TrainState:
    """The state with its params where its step keeps them (``optfuse.params_to_host``): with
    ``offload="params"``, the leaves the step updates in a fused loop in host memory and the
    others on the device; with another ``offload``, every leaf on the device.

    Call it once, outside ``jax.jit``, before the first step: a jitted step with donation
    cannot move a leaf to another memory (XLA would alias the donated buffer to an output in
    the other one), so it raises ``OffloadError`` on params placed otherwise.

    Args:
      loss_fn: the loss the state's steps run, as given to ``value_and_update``.
      *args: its other arguments (arrays or ``jax.ShapeDtypeStruct`` values), as given to
        ``value_and_update``.
      **kwargs: its keyword arguments; ``microbatches=`` (a reserved keyword) when the steps
        take microbatches.

    Returns:
      The state with its params placed.
    """
    fused = self._fused()
    return self.replace(params=_params_memory.params_to_host(fused, loss_fn, self.params, *args,
                                                             **kwargs), fused=fused)

  def place(self, loss_fn: Callable, *args, budget: Any, target: Any = None,
            microbatches: int | None = None, **kwargs) -> tuple[TrainState, OffloadPlan]:
    """With ``offload="auto"``: the state with its params and ``opt_state`` placed by the plan
    of what each leaf streams so that the step fits ``budget`` (``optfuse.place``).

    Call it once, outside ``jax.jit``, before the first step, as ``params_to_host``.

    Args:
      loss_fn: the loss the state's steps run, as given to ``value_and_update``.
      *args: its other arguments (arrays or ``jax.ShapeDtypeStruct`` values), as given to
        ``value_and_update`` (the whole batch with ``microbatches``).
      budget: the device memory the step must fit (a reserved keyword): a name of
        ``optfuse.targets()``, whose memory is the budget and whose compiler compiles the step,
        or bytes (compiled for ``target``).
      target: with ``budget`` in bytes, the compiler (a reserved keyword; not XLA:CPU).
      microbatches: the steps' (a reserved keyword), as ``value_and_update`` takes it.
      **kwargs: the loss's keyword arguments.

    Returns:
      ``(state, plan)``: the state placed, and the ``OffloadPlan``.

    Raises:
      OffloadError: the state's ``offload`` is not ``"auto"``, or as ``optfuse.plan_offload``
        raises it.
    """
    fused = self._fused()
    plan = _auto.plan_offload(fused, loss_fn, self.params, *args, budget=budget, target=target,
                              microbatches=microbatches, **kwargs)
    params, opt_state = plan.place(self.params, self.opt_state)
    return self.replace(params=params, opt_state=opt_state, fused=fused), plan

  def _fused(self) -> FusedTransformation:
    if (self.fused is not None and self.fused.tx is self.tx
        and self.fused.options == self.options):
      return self.fused
    return fuse_with(self.tx, self.options)

  def apply_gradients(self, *, grads, **kwargs) -> TrainState:
    """Flax's ``apply_gradients``: optax's update of ``params`` and ``opt_state`` by ``grads``.

    With ``offload="state"`` the slots are fetched whole to the device for optax's update and
    the new ones written back to host memory (``mode="off"``'s step), since JAX computes on
    device arrays only; with ``offload="params"`` the params in host memory too.

    Args:
      grads: gradients with the structure of ``params``.
      **kwargs: other fields to ``replace``.

    Returns:
      The state with ``step + 1`` and the updated ``params`` and ``opt_state``.
    """
    if self.offload is None:
      return super().apply_gradients(grads=grads, **kwargs)
    on_device = self.replace(opt_state=_memory_spaces.tree_to_device(self.opt_state),
                             params=_memory_spaces.tree_to_device(self.params))
    new = super(TrainState, on_device).apply_gradients(grads=grads, **kwargs)
    return new.replace(opt_state=_memory_spaces.tree_like(new.opt_state, self.opt_state),
                       params=_memory_spaces.tree_like(new.params, self.params))

  def value_and_update(self, loss_fn: Callable, *args, has_aux: bool = False,
                       microbatches: int | None = None, **kwargs) -> tuple[Any, TrainState]:
    """One fused training step.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a float scalar, or
        ``(loss, aux)`` with ``has_aux``; the same function ``jax.value_and_grad`` would take.
      *args: the other positional arguments of ``loss_fn`` (the batch, dropout keys...).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; put updated mutable collections
        (``batch_stats``) in ``aux`` and ``replace`` them into the state afterwards.
      microbatches: split every array argument along its leading axis into this many
        microbatches whose mean gradient makes one update (see ``optfuse.fuse``); the value is
        the mean loss (with ``has_aux``, the aux of each microbatch stacked).
      **kwargs: keyword arguments of ``loss_fn``.

    Returns:
      ``(value, state)``: the loss (or ``(loss, aux)``) at the old params, and the state with
      new ``params`` and ``opt_state`` and ``step + 1``.
    """
    fused = self._fused()
    step = fused.value_and_update(loss_fn, has_aux=has_aux, microbatches=microbatches)
    value, params, opt_state = step(self.params, self.opt_state, *args, **kwargs)
    return value, self.replace(step=self.step + 1, params=params, opt_state=opt_state,
                               fused=fused)

  def flush(self) -> TrainState:
    """Applies a pending forward-mode update (identity in "backward" and "off" mode).

    Returns:
      The state whose ``params`` are the trained params, e.g. for evaluation or checkpoints.
    """
    fused = self._fused()
    params, opt_state = fused.flush(self.params, self.opt_state)
    return self.replace(params=params, opt_state=opt_state, fused=fused)
