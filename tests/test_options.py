"""The fuse options as one value: checked once where they are given, and the step, its engine and
``describe`` all built from that value."""

import dataclasses

import jax
import optax
import pytest
from flax import nnx

import optfuse
import optfuse.linen
import optfuse.nnx
from optfuse import _fuse
from tests import models

# Lion updates stacked leaves inside the loops in every fused mode (AdamW's forward step runs in
# place whole), so each mode's placements hold both loops and taps or whole leaves; clipping
# makes it a global transform for two-pass, and for forward and off mode, which run it as is.
LION = optax.lion(1e-3)
CLIP_LION = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3))

# Every combination fuse accepts.
VALID = [
    *[optfuse.FuseOptions(mode) for mode in ("off", "backward", "forward")],
    *[optfuse.FuseOptions(mode, global_ops="two_pass") for mode in ("off", "backward", "forward")],
    *[optfuse.FuseOptions(mode, offload="state") for mode in ("off", "backward", "forward")],
    optfuse.FuseOptions("backward", guard=True),
    optfuse.FuseOptions("backward", offload="state", guard=True),
    optfuse.FuseOptions("backward", global_ops="two_pass", guard=True),
]

# Each refused option, the named error it raises and the option its message names.
INVALID = [
    ({"mode": "backwards"}, optfuse.UnknownModeError, "unknown mode 'backwards'"),
    ({"mode": None}, optfuse.UnknownModeError, "unknown mode None"),
    ({"global_ops": "three_pass"}, optfuse.UnknownModeError, "unknown global_ops 'three_pass'"),
    ({"offload": "grads"}, optfuse.OffloadError, "unknown offload 'grads'"),
    ({"offload": True}, optfuse.OffloadError, "unknown offload True"),
    ({"global_ops": "two_pass", "offload": "state"}, optfuse.OffloadError,
     "global_ops='two_pass'.*use mode=\"forward\""),
    ({"mode": "forward", "global_ops": "two_pass", "offload": "state"}, optfuse.OffloadError,
     "Drop global_ops='two_pass'"),
    ({"mode": "off", "offload": "params"}, optfuse.OffloadError,
     'mode="off" has none. Use offload="state"'),
    ({"guard": "yes"}, optfuse.GuardError, "guard must be True or False, not 'yes'"),
    ({"guard": 1}, optfuse.GuardError, "guard must be True or False, not 1"),
    ({"mode": "forward", "guard": True}, optfuse.GuardError, "guard=True .* not mode='forward'"),
    ({"mode": "off", "guard": True}, optfuse.GuardError, "guard=True .* not mode='off'"),
]


def _id(options: optfuse.FuseOptions) -> str:
  given = {k: v for k, v in dataclasses.asdict(options).items()
           if v != optfuse.FuseOptions.__dataclass_fields__[k].default}
  return "-".join(f"{k}={v}" for k, v in given.items())


def _fuse_keeping_its_engine(monkeypatch, tx, options):
  """``optfuse.fuse(tx, **options)`` and the engine it built, the one its steps run on."""
  built = []
  make_engine = _fuse.make_engine
  monkeypatch.setattr(_fuse, "make_engine", lambda *a: built.append(make_engine(*a)) or built[-1])
  fx = optfuse.fuse(tx, **dataclasses.asdict(options))
  monkeypatch.undo()
  (engine,) = built
  return fx, engine


def _slot_memory_kinds(state) -> set[str]:
  return {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim}


@pytest.mark.parametrize("options", VALID, ids=map(_id, VALID))
def test_describe_reports_the_placements_of_the_step_that_runs(monkeypatch, options):
  tx = LION if options.mode == "backward" and options.global_ops is None else CLIP_LION
  fx, engine = _fuse_keeping_its_engine(monkeypatch, tx, options)
  params, (tokens, targets) = models.stacked_params(), models.tied_lm_batches()[0]
  step = jax.jit(fx.value_and_update(models.scanned_loss), donate_argnums=(0, 1))
  _, params, state = step(models.copy(params), fx.init(models.copy(params)), tokens, targets)

  # The engine of the step that ran, on the params and the state it returned.
  ran = []
  jax.eval_shape(lambda p, s: ran.append(engine.placements(models.scanned_loss, p, s,
                                                           (tokens, targets), {})),
                 params, state)
  (where, reasons), = ran
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  described = optfuse.describe(fx, models.scanned_loss, params, tokens, targets)
  assert dict(described) == {path: where.get(i, engine.unplaced) for i, path in enumerate(paths)}
  assert described.reasons == {paths[i]: why for i, why in reasons.items()
                               if where.get(i) != "loop"}
  # The slots live where the step left them.
  kind = "pinned_host" if options.offload else "device"
  assert _slot_memory_kinds(state) == {kind}
  assert set(described.state.values()) <= {"host" if options.offload else "device"}
  assert "loop" in described.values() or options.mode == "off"


def test_describe_of_a_plain_optax_transformation_is_that_of_its_default_fused_step():
  params, (tokens, targets) = models.stacked_params(), models.tied_lm_batches()[0]
  plain = optfuse.describe(LION, models.scanned_loss, params, tokens, targets)
  fused = optfuse.describe(optfuse.fuse(LION), models.scanned_loss, params, tokens, targets)
  assert (plain, plain.reasons, plain.state) == (fused, fused.reasons, fused.state)


@pytest.mark.parametrize(("given", "error", "match"), INVALID)
def test_every_refused_option_raises_its_named_error_when_fused(given, error, match):
  with pytest.raises(error, match=match):
    optfuse.fuse(LION, **given)
  with pytest.raises(error, match=match):
    optfuse.FuseOptions(**given)


@pytest.mark.parametrize(("given", "error", "match"), INVALID)
def test_train_step_and_the_flax_adapters_refuse_the_same_options_when_built(given, error, match):
  params = models.stacked_params()
  if given != {"mode": None}:  # train_step's mode=None is the state's own mode
    with pytest.raises(error, match=match):
      optfuse.train_step(models.scanned_loss, **given)
  with pytest.raises(error, match=match):
    optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=LION, **given)
  with pytest.raises(error, match=match):
    optfuse.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), LION, **given)


def test_options_are_immutable_and_checked_again_when_replaced():
  fx = optfuse.fuse(LION, mode="forward", offload="state")
  assert fx.options == optfuse.FuseOptions(mode="forward", offload="state")
  assert (fx.mode, fx.global_ops, fx.offload, fx.guard) == ("forward", None, "state", False)
  with pytest.raises(dataclasses.FrozenInstanceError):
    fx.options.mode = "backward"
  with pytest.raises(optfuse.OffloadError, match="Drop global_ops"):
    dataclasses.replace(fx.options, global_ops="two_pass")
  assert optfuse.fuse(LION, **dataclasses.asdict(fx.options)).options == fx.options


def test_the_flax_adapters_keep_the_options_they_were_given():
  options = optfuse.FuseOptions("forward", offload="state")
  state = optfuse.linen.TrainState.create(apply_fn=None, params=models.stacked_params(), tx=LION,
                                          **dataclasses.asdict(options))
  assert state.options == state.fused.options == options
  assert (state.mode, state.offload) == ("forward", "state")
  optimizer = optfuse.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), LION,
                                    **dataclasses.asdict(options))
  assert optimizer.options == optimizer.fused.options == options
  assert (optimizer.mode, optimizer.offload) == ("forward", "state")
