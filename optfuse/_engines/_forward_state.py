"""Forward mode's optimizer state: the optax state plus the pending gradient, and the
conversions to and from a plain optax state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optfuse._base._checks import check_state
from optfuse._base._errors import StateMismatchError
from optfuse._base._memory_spaces import state_to_host, tree_to_device


class ForwardState(NamedTuple):
  """The optimizer state of ``optfuse.fuse(tx, mode="forward")``.

  ``(params, ForwardState(opt_state, pending_grads, True))`` stands for the params and optax state
  that ``tx.update(pending_grads, opt_state, params)`` followed by ``optax.apply_updates`` gives:
  the next step, or ``fx.flush``, applies that update first.

  Attributes:
    opt_state: the optax state of ``tx`` for the params held, as ``tx.init(params)`` builds it.
    pending_grads: a tree like the params: the gradient whose update is not applied yet (zeros,
      and ignored, when ``has_pending`` is false).
    has_pending: a scalar bool array: whether ``pending_grads`` is still to be applied.
  """

  opt_state: Any
  pending_grads: Any
  has_pending: jax.Array


def no_pending(params, opt_state) -> ForwardState:
  return ForwardState(opt_state, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.bool_))


def check_forward_state(tx: optax.GradientTransformation, params, state) -> None:
  if not isinstance(state, ForwardState):
    raise StateMismatchError(
        f'mode="forward" needs a ForwardState, got {type(state).__name__}. Build it with '
        "fx.init(params), or convert an optax state with optfuse.from_optax_state(fx, params, "
        "opt_state).")
  check_state(tx, params, state.opt_state)
  if jax.tree.structure(state.pending_grads) != jax.tree.structure(params) or any(
      jnp.shape(g) != jnp.shape(p)
      for g, p in zip(jax.tree.leaves(state.pending_grads), jax.tree.leaves(params))):
    raise StateMismatchError(
        "the pending gradients of the ForwardState do not match the params (tree structure or "
        "shapes); the state was built for other params. Rebuild it with fx.init(params).")


def to_optax_state(fx, params, state) -> tuple[Any, Any]:
  """Flushes a fused state and returns ``(params, optax_state)``.

  Args:
    fx: the ``FusedTransformation`` ``state`` belongs to.
    params: the params.
    state: ``fx``'s state.

  Returns:
    ``(params, opt_state)`` where ``opt_state`` has the structure of ``fx.tx.init(params)``: in
    forward mode after applying the pending update, otherwise ``state`` itself; with
    ``offload="state"`` moved to device memory, where optax's own code (``optax.tree``
    utilities, a plain optax step) can read it; with ``offload="params"`` the params too.

  Examples:
    >>> import jax.numpy as jnp, optax, optfuse
    >>> fx = optfuse.fuse(optax.sgd(0.5), mode="forward")
    >>> params = {"w": jnp.ones(2)}
    >>> step = fx.value_and_update(lambda p: jnp.sum(p["w"] ** 2))
    >>> _, params, state = step(params, fx.init(params))
    >>> params, opt_state = optfuse.to_optax_state(fx, params, state)
    >>> params["w"].tolist()
    [0.0, 0.0]
  """
  if fx.mode == "forward":
    params, state = fx.flush(params, state)
    state = state.opt_state
  if getattr(fx, "offload", None) is not None:  # "params": the loops' param stacks too
    params, state = tree_to_device(params), tree_to_device(state)
  return params, state


def from_optax_state(fx, params, opt_state):
  """The state of ``fx`` for ``params`` and a plain optax state of ``fx.tx``.

  Args:
    fx: a ``FusedTransformation``.
    params: the params ``opt_state`` belongs to.
    opt_state: a state of ``fx.tx`` (``tx.init(params)`` or a later one).

  Returns:
    A ``ForwardState`` with nothing pending in forward mode, otherwise ``opt_state`` itself;
    with ``offload="state"``, its slots moved to host memory (``fx.init``'s placement).
  """
  state = no_pending(params, opt_state) if fx.mode == "forward" else opt_state
  # offload="auto": on the device, where fx.init leaves it (optfuse.place moves it).
  return state if getattr(fx, "offload", None) in (None, "auto") else state_to_host(state)
