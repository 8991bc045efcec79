"""Flax NNX adapter: an ``nnx.Optimizer`` whose step fuses the optimizer update.

``optimizer.value_and_update(model, loss_fn, *args)`` replaces
``nnx.value_and_grad(loss_fn)(model, *args)`` followed by ``optimizer.update(model, grads)``.

NNX objects are mutable, the fused step is a pure function: the model and the arguments are
split once into the trained params (the ``wrt`` variables of the model), the other variables
(batch statistics, RNG counters, variables of modules or ``nnx.Rngs`` passed as arguments) and
the rest. The loss merges them back inside the fused step and returns the variables it changed,
which are written back into the caller's objects with ``nnx.update``, as are the new params and
optimizer state. With ``offload="state"`` the slots of the optimizer state live in host memory,
where the constructor puts them and every step leaves them. With ``offload="params"`` the
param stacks of the fused loops (an ``nnx.scan`` over ``nnx.vmap``-built blocks) live there too:
``optimizer.params_to_host(model, loss_fn, *args)`` moves them once, before the first step, and
every step leaves them there. With ``offload="auto"``, ``optimizer.place(model, loss_fn, *args,
budget=...)`` plans what each variable streams to fit the budget and moves the params and the
optimizer state by the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import filterlib
from flax.nnx.training import optimizer as nnx_optimizer

from optfuse._analysis import _auto, _params_memory
from optfuse._analysis._auto import OffloadPlan
from optfuse._base import _leaves, _memory_spaces
from optfuse._base._checks import check_loss
from optfuse._base._errors import MicrobatchError
from optfuse._base._options import NOT_GIVEN, FuseOptions, NotGiven
from optfuse._fuse import fuse

M = TypeVar("M", bound=nnx.Module)


class Optimizer(nnx.Optimizer[M]):
  """``nnx.Optimizer`` with a fused ``value_and_update`` step.

  ``step``, ``tx``, ``wrt`` and ``opt_state`` (the state of ``tx`` in ``nnx.Optimizer``'s
  layout, ``OptState`` variables around ``tx.init(nnx.state(model, wrt))`` in "backward" and
  "off" mode) are those of ``nnx.Optimizer``, so ``update(model, grads)`` still works.

  Attributes:
    options: the ``optfuse.FuseOptions`` of the constructor; ``mode``, ``global_ops``,
      ``guard`` and ``offload`` read them. With ``offload="state"`` the slots of ``opt_state``
      live in ``pinned_host`` memory, streamed through the fused step (see ``optfuse.fuse``);
      with ``offload="params"`` the model's param stacks of the fused loops too, once
      ``params_to_host`` has moved them.
    fused: the ``optfuse.fuse(tx, options=options)`` transformation; it
      caches the update plans.

  Examples:
    >>> import jax.numpy as jnp, optax, optfuse.nnx
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = optfuse.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    >>> @nnx.jit
    ... def train_step(model, optimizer, x, y):
    ...   loss_fn = lambda model, x, y: jnp.mean((model(x) - y) ** 2)
    ...   return optimizer.value_and_update(model, loss_fn, x, y)
    >>> first = train_step(model, optimizer, x, y)
    >>> bool(train_step(model, optimizer, x, y) < first), int(optimizer.step[...])
    (True, 2)

    With the optimizer state in host memory:

    >>> optimizer = optfuse.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param,
    ...                                   offload="state")
    >>> loss = train_step(model, optimizer, x, y)
    >>> optimizer.opt_state[0].mu["kernel"][...].sharding.memory_kind
    'pinned_host'

    With the params of an ``nnx.scan`` stack in host memory too:

    >>> class Stack(nnx.Module):
    ...   def __init__(self, rngs):
    ...     make = nnx.vmap(lambda r: nnx.Linear(2, 2, rngs=r), in_axes=0, out_axes=0)
    ...     self.layers = nnx.split_rngs(splits=4)(make)(rngs)
    ...   def __call__(self, x):
    ...     run = nnx.scan(lambda h, layer: (jnp.tanh(layer(h)), None),
    ...                    in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    ...     return run(x, self.layers)[0]
    >>> stack = Stack(nnx.Rngs(0))
    >>> stack_loss = lambda model, x: jnp.mean(model(x) ** 2)
    >>> optimizer = optfuse.nnx.Optimizer(stack, optax.adam(1e-3), wrt=nnx.Param,
    ...                                   offload="params")
    >>> optimizer.params_to_host(stack, stack_loss, x)
    >>> loss = nnx.jit(lambda m, o, x: o.value_and_update(m, stack_loss, x))(stack, optimizer, x)
    >>> stack.layers.kernel[...].sharding.memory_kind
    'pinned_host'
  """

  def __init__(self, model: M, tx: optax.GradientTransformation, *,
               wrt: filterlib.Filter = nnx.Param, options: FuseOptions | None = None,
               mode: str | None = None, global_ops: str | None | NotGiven = NOT_GIVEN,
               guard: bool | None = None, offload: str | None | NotGiven = NOT_GIVEN,
               graph: bool | None = None):
    """Builds the optimizer state of the ``wrt`` variables of ``model``.

    The options are one ``FuseOptions``, as ``optfuse.fuse`` takes them: ``options=``, or the
    keywords, a shorthand that builds it (a keyword left at ``None`` is not given).

    Args:
      model: the NNX module to train.
      tx: the optax transformation.
      wrt: filter of the variables to train (as for ``nnx.Optimizer`` and ``nnx.grad``).
      options: the ``FuseOptions`` of the optimizer's steps, in place of the keywords.
      mode: "backward" (default), "forward" or "off" (see ``optfuse.fuse``).
      global_ops: ``"two_pass"`` lets backward mode run global transforms such as
        ``clip_by_global_norm`` (see ``optfuse.fuse``).
      guard: ``True`` keeps backward mode's loops only where they lower the compiled peak (see
        ``optfuse.fuse``).
      offload: ``"state"`` builds the optimizer state with its slots in ``pinned_host``
        memory, where the fused step streams them from and leaves them (``fuse``'s ``init``
        placement); not with ``global_ops``. ``"params"``: the same, and the step streams the
        model's param stacks of its fused loops from host memory too, where
        ``params_to_host`` moves them; not in mode "off". ``None`` (default): on the device.
      graph: NNX graph mode (``True``) or tree mode (``False``); ``None``: NNX's current mode.

    Raises:
      UnknownModeError: ``mode`` or ``global_ops`` is not a fusion mode.
      OffloadError: ``offload`` is not ``None``, ``"state"`` or ``"params"``, or is given
        with ``global_ops``, or is ``"params"`` in mode "off".
      GuardError: ``guard`` is ``True`` outside backward mode or with ``offload="params"``.
      OptionsError: ``options`` is given with a keyword that contradicts it.
    """
    fused = fuse(tx, mode, global_ops, offload, guard, options=options)
    # nnx.Optimizer.__init__ would build the state with tx.init; the fused transformation's init
    # gives the layout of its mode, so the attributes are set here as nnx.Optimizer sets them.
    self.graph = graph
    self.step = nnx_optimizer.OptState(jnp.array(0, dtype=jnp.uint32))
    self.tx = tx
    opt_state = nnx_optimizer.to_opt_state(fused.init(nnx.state(model, wrt, graph=graph)))
    layout = jax.tree_util.tree_flatten_with_path(nnx.as_pure(opt_state))
    self._layout = (layout[1], tuple(_leaves.key_names(path) for path, _ in layout[0]))
    self.opt_state = nnx.data(opt_state)
    self.wrt = wrt
    self.fused = fused

  @property
  def options(self) -> FuseOptions:
    """The options of the fused step."""
    return self.fused.options

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
    ``"params"`` (the model's param stacks of the fused loops too)."""
    return self.options.offload

  def update(self, model: M, grads, /, **kwargs) -> optax.Updates:
    """``nnx.Optimizer.update``: optax's update of ``model`` and the state by ``grads``.

    With ``offload="state"`` the slots are fetched whole to the device for optax's update and
    the new ones written back to host memory (``mode="off"``'s step), since JAX computes on
    device arrays only; with ``offload="params"`` the model's params in host memory too.

    Args:
      model: the module this optimizer was built for.
      grads: the gradients of its ``wrt`` variables (from ``nnx.grad``).
      **kwargs: extra arguments of ``tx.update``.

    Returns:
      The updates applied to the model's ``wrt`` variables.
    """
    if self.offload is None:
      return super().update(model, grads, **kwargs)
    on_host = nnx.as_pure(self.opt_state)
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    self._write_opt_state(_memory_spaces.tree_to_device(on_host))
    nnx.update(model, _memory_spaces.tree_to_device(params))
    updates = super().update(model, grads, **kwargs)
    self._write_opt_state(_memory_spaces.tree_like(nnx.as_pure(self.opt_state), on_host))
    new_params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    nnx.update(model, _memory_spaces.tree_like(new_params, params))
    return updates

  def _fused_opt_state(self):
    """``opt_state`` as arrays in the layout of the fused transformation's ``init``: NNX stores
    a NamedTuple nested in the state's dicts (a low-bit slot's ``QuantizedSlot``) as a State
    of its fields, which optax's duck-typed updates read but the fused step's structure check
    refuses."""
    pure = nnx.as_pure(self.opt_state)
    treedef, paths = self._layout
    if jax.tree.structure(pure) == treedef:
      return pure
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]
    leaves = {_leaves.key_names(path): x for path, x in flat}
    return jax.tree.unflatten(treedef, [leaves[path] for path in paths])

  def _write_opt_state(self, opt_state) -> None:
    nnx.update(self.opt_state, nnx.state(opt_state, graph=self.graph))

  def value_and_update(self, model: M, loss_fn: Callable, *args, has_aux: bool = False,
                       microbatches: None = None, **kwargs) -> Any:
    """One fused training step, updating ``model`` and the optimizer in place.

    Args:
      model: the module this optimizer was built for.
      loss_fn: ``loss_fn(model, *args, **kwargs)`` returning a float scalar, or ``(loss, aux)``
        with ``has_aux``; the function ``nnx.value_and_grad`` would take. Variables it changes
        (BatchNorm statistics, RNG counters), in the model or in the arguments, are written
        back.
      *args: the other positional arguments of ``loss_fn`` (arrays, ``nnx.Rngs``, modules...).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      microbatches: ``None``; a reserved keyword, not passed to ``loss_fn``: the NNX step takes
        no microbatches (the model's variables travel with its arguments, which a microbatch
        split would cut).
      **kwargs: keyword arguments of ``loss_fn``.

    Returns:
      The loss, or ``(loss, aux)`` with ``has_aux``, at the params before the update.

    Raises:
      MicrobatchError: ``microbatches`` is given.
    """
    if microbatches is not None:
      raise MicrobatchError(
          f"optfuse.nnx.Optimizer takes no microbatches (got microbatches={microbatches!r}): the "
          "model's variables (BatchNorm statistics, RNG counters) travel with the step's "
          "arguments, which a microbatch split would cut. Use optfuse.linen.TrainState or "
          "optfuse.fuse(tx).value_and_update(loss_fn, microbatches=k) on nnx.split's params.")
    pure_loss, (params, variables, rest) = self._pure(model, loss_fn, args, kwargs, has_aux)
    step = self.fused.value_and_update(pure_loss, has_aux=True)
    (loss, (aux, new_variables)), new_params, new_opt_state = step(
        params, self._fused_opt_state(), variables, rest)
    nnx.update(model, new_params)
    nnx.update((model, args, kwargs), new_variables)
    self._write_opt_state(new_opt_state)
    self.step[...] += 1
    return (loss, aux) if has_aux else loss

  def _pure(self, model: M, loss_fn: Callable, args: tuple, kwargs: dict, has_aux: bool
            ) -> tuple[Callable, tuple]:
    """``(pure_loss, (params, variables, rest))``: ``loss_fn`` on ``model`` as a function of
    the trained params (arrays), the other variables and the rest of ``(model, args, kwargs)``,
    returning ``(loss, (aux, new variables))``, and those inputs."""
    trained = filterlib.to_predicate(self.wrt)

    def in_model_and_trained(path, value) -> bool:
      return len(path) > 0 and path[0] == 0 and trained(path[1:], value)

    graph_kw = {"graph": self.graph}
    graphdef, params, variables, rest = nnx.split(
        (model, args, kwargs), in_model_and_trained, nnx.Variable, ..., **graph_kw)

    def pure_loss(params, variables, rest):
      model_, args_, kwargs_ = nnx.merge(graphdef, nnx.State({0: params}), variables, rest)
      out = loss_fn(model_, *args_, **kwargs_)
      loss, aux = check_loss(out, has_aux)
      _, _, new_variables, _ = nnx.split(
          (model_, args_, kwargs_), in_model_and_trained, nnx.Variable, ..., **graph_kw)
      return loss, (aux, nnx.as_pure(new_variables))

    return pure_loss, (nnx.as_pure(params[0]), nnx.as_pure(variables), rest)

  def params_to_host(self, model: M, loss_fn: Callable, *args, has_aux: bool = False,
                     **kwargs) -> None:
    """Moves the model's params where the optimizer's step keeps them
    (``optfuse.params_to_host``): with ``offload="params"``, the ``wrt`` variables the step
    updates in a fused loop to host memory and the others to the device; with another
    ``offload``, every one to the device.

    Call it once, outside ``nnx.jit``, before the first step: a jitted step with donation
    cannot move a variable to another memory (XLA would alias the donated buffer to an output
    in the other one), so it raises ``OffloadError`` on params placed otherwise.

    Args:
      model: the module this optimizer was built for.
      loss_fn: the loss its steps run, as given to ``value_and_update``.
      *args: its other arguments, as given to ``value_and_update``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      **kwargs: its keyword arguments.
    """
    pure_loss, (params, variables, rest) = self._pure(model, loss_fn, args, kwargs, has_aux)
    placed = _params_memory.params_to_host(self.fused, pure_loss, params, variables, rest)
    nnx.update(model, placed)

  def place(self, model: M, loss_fn: Callable, *args, budget: Any, target: Any = None,
            has_aux: bool = False, **kwargs) -> OffloadPlan:
    """With ``offload="auto"``: plans what each ``wrt`` variable streams so that the step fits
    ``budget`` (``optfuse.plan_offload``), and moves the model's params and the optimizer's
    state where the plan puts them.

    Call it once, outside ``nnx.jit``, before the first step, as ``params_to_host``.

    Args:
      model: the module this optimizer was built for.
      loss_fn: the loss its steps run, as given to ``value_and_update``.
      *args: its other arguments, as given to ``value_and_update``.
      budget: the device memory the step must fit (a reserved keyword): a name of
        ``optfuse.targets()``, whose memory is the budget and whose compiler compiles the step,
        or bytes (compiled for ``target``).
      target: with ``budget`` in bytes, the compiler (a reserved keyword; not XLA:CPU).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      **kwargs: its keyword arguments.

    Returns:
      The ``OffloadPlan``.

    Raises:
      OffloadError: the optimizer's ``offload`` is not ``"auto"``, or as
        ``optfuse.plan_offload`` raises it.
    """
    pure_loss, (params, variables, rest) = self._pure(model, loss_fn, args, kwargs, has_aux)
    plan = _auto.plan_offload(self.fused, pure_loss, params, variables, rest, budget=budget,
                              target=target)
    params, opt_state = plan.place(params, self._fused_opt_state())
    nnx.update(model, params)
    self._write_opt_state(opt_state)
    return plan

  def flush(self, model: M) -> None:
    """Applies a pending forward-mode update to ``model`` (a no-op in the other modes).

    In "forward" mode each step applies the previous step's update before its forward pass, so
    after the last step the model is one update behind; call ``flush`` before evaluating or
    saving it.

    Args:
      model: the module this optimizer was built for.
    """
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    params, opt_state = self.fused.flush(params, self._fused_opt_state())
    nnx.update(model, params)
    self._write_opt_state(opt_state)
