"""The fuse options as one value and one table of what runs (``_options.refusal``), which every
entry point consults; and ``describe`` reporting what the step it describes placed while traced,
checked against where the traced step's update equations sit."""

import dataclasses
import pathlib
import re

import jax
import optax
import pytest
from flax import nnx
from jax.extend import core as jcore

import optfuse
import optfuse.linen
import optfuse.nnx
from optfuse._analysis import _auto, _memory
from optfuse._base import _options
from optfuse._engines import _guard
from tests import models

# Lion updates stacked leaves inside the loops in every fused mode (AdamW's forward step runs in
# place whole), so each mode's placements hold both loops and taps or whole leaves; clipping
# makes it a global transform for two-pass, and for forward and off mode, which run it as is.
LION = optax.lion(1e-3)
CLIP_LION = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3))
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"

FIELDS = ("mode", "global_ops", "offload", "guard", "microbatches")
# Every combination of the values each option accepts, runnable or not, and values no option
# accepts: the table (``_options.refusal``) says which raise what.
COMBINATIONS = [dict(zip(FIELDS, c)) for c in _options.combinations()]
UNKNOWN = [
    {"mode": "backwards"}, {"global_ops": "three_pass"}, {"offload": "grads"}, {"offload": True},
    {"guard": "yes"}, {"guard": 1}, {"microbatches": 0}, {"microbatches": 1.5},
]
TABLE = COMBINATIONS + [{**dict(zip(FIELDS, ("backward", None, None, False, None))), **u}
                        for u in UNKNOWN]


def _id(combo: dict) -> str:
  return "-".join(f"{k}={v}" for k, v in combo.items())


def _refusal(combo: dict):
  return _options.refusal(*(combo[k] for k in FIELDS))


def _options_of(combo: dict) -> dict:
  return {k: combo[k] for k in FIELDS[:-1]}


def _tx(options) -> optax.GradientTransformation:
  return LION if options.mode == "backward" and options.global_ops is None else CLIP_LION


def _as_the_table_says(combo: dict, build):
  """``build()``'s result where the table accepts ``combo``; where it refuses it, checks that
  ``build`` raises the table's error with its message and returns ``None``."""
  error = _refusal(combo)
  if error is None:
    return build()
  with pytest.raises(type(error), match=re.escape(str(error))):
    build()
  return None


def _batch():
  return models.tied_lm_batches()[0]


@pytest.mark.parametrize("combo", TABLE, ids=map(_id, TABLE))
def test_fuse_and_its_steps_accept_and_refuse_what_the_table_says(combo):
  step = lambda fx: fx.value_and_update(models.scanned_loss, microbatches=combo["microbatches"])
  keywords = _options_of(combo)
  _as_the_table_says(combo, lambda: step(optfuse.fuse(LION, **keywords)))
  _as_the_table_says(combo, lambda: step(optfuse.fuse(LION, options=optfuse.FuseOptions(
      **keywords))))


@pytest.mark.parametrize("combo", TABLE, ids=map(_id, TABLE))
def test_train_step_and_the_flax_adapters_accept_and_refuse_what_the_table_says(combo,
                                                                                monkeypatch):
  # The memory guard's decision stands in for its compiles: the table, not the guard, is tested.
  monkeypatch.setattr(_guard, "decide", lambda sites, peak_of: {})
  keywords, microbatches = _options_of(combo), combo["microbatches"]
  params, batch = models.stacked_params(), _batch()
  _as_the_table_says(combo, lambda: optfuse.train_step(models.scanned_loss,
                                                       microbatches=microbatches, **keywords))

  def linen_step():
    placed = params
    if keywords["offload"] == "params":  # the loop stacks in host memory, where it keeps them
      placed = optfuse.params_to_host(optfuse.fuse(LION, **keywords), models.scanned_loss,
                                      params, *batch)
    state = optfuse.linen.TrainState.create(apply_fn=None, params=placed, tx=LION, **keywords)
    # Traced, not run: the step is built, and refused, before anything is compiled.
    return jax.eval_shape(lambda s: s.value_and_update(models.scanned_loss, *batch,
                                                       microbatches=microbatches)[0], state)

  _as_the_table_says(combo, linen_step)
  # The NNX optimizer takes the options as the table says, and no microbatches (its variables
  # travel with the arguments): a named refusal whatever the options.
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  optimizer = _as_the_table_says({**combo, "microbatches": None},
                                 lambda: optfuse.nnx.Optimizer(model, LION, **keywords))
  if optimizer is not None and microbatches is not None:
    with pytest.raises(optfuse.MicrobatchError, match="takes no microbatches"):
      optimizer.value_and_update(model, lambda m: m(jax.numpy.ones((1, 2))).sum(),
                                 microbatches=microbatches)


def _compiled_options(monkeypatch) -> dict:
  """Stands in for the compiler in ``memory_report`` and ``max_batch_size``: records the
  options and microbatches each mode's step is built with, and answers a peak that grows with
  the batch."""
  compiled: dict = {}

  def lower_step(fx, loss_fn, params, args=(), kwargs=None, has_aux=False, target=None,
                 **step_options):
    compiled[fx.mode] = (fx.options, step_options.get("microbatches"))
    return args[0].shape[0]  # the batch

  def step_memory(fx, loss_fn, params, args=(), kwargs=None, **step_options):
    return {"peak_bytes": 1000 * lower_step(fx, loss_fn, params, args, kwargs, **step_options)}

  monkeypatch.setattr(_memory, "lower_step", lower_step)
  monkeypatch.setattr(_memory, "compile_memory", lambda batch: {"peak_bytes": 1000 * batch})
  monkeypatch.setattr(_memory, "step_memory", step_memory)
  return compiled


@pytest.mark.parametrize("combo", TABLE, ids=map(_id, TABLE))
def test_describe_and_the_memory_reports_accept_and_refuse_what_the_table_says(combo,
                                                                              monkeypatch):
  # The memory guard's decision stands in for its compiles: the table, not the guard, is tested.
  monkeypatch.setattr(_guard, "decide", lambda sites, peak_of: {})
  compiled = _compiled_options(monkeypatch)
  microbatches = combo["microbatches"]
  params, batch = models.stacked_params(), _batch()
  options = _as_the_table_says({**combo, "microbatches": None},
                               lambda: optfuse.FuseOptions(**_options_of(combo)))
  if options is not None:
    _as_the_table_says(combo, lambda: optfuse.describe(
        _tx(options), models.scanned_loss, params, *batch, options=options,
        microbatches=microbatches))
  args_for = lambda b: tuple(jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype) for x in batch)
  reports = {"memory_report": lambda **o: optfuse.memory_report(
                 models.scanned_loss, LION, params, *batch, microbatches=microbatches, **o),
             "max_batch_size": lambda **o: optfuse.max_batch_size(
                 models.scanned_loss, LION, params, args_for, 10**5, microbatches=microbatches,
                 max_batch=8, progress=False, **o)}
  given = [] if options is None else [{"options": options}]
  if combo["mode"] == "backward":  # the keywords are backward mode's options
    given.append({k: combo[k] for k in ("global_ops", "offload", "guard")})
  for name, report in reports.items():
    for kwargs in given:
      compiled.clear()
      if _as_the_table_says(combo, lambda r=report, o=kwargs: r(**o)) is not None:
        # Both compile every mode with the options in that mode (``FuseOptions.for_mode``),
        # each mode the options run in (offload="params" has no mode "off"); offload="auto"
        # plans from device peaks, which XLA:CPU does not split from host memory: the report
        # says so and compiles nothing here.
        planned_here = not (name == "memory_report" and options.offload == "auto")
        assert compiled == {mode: (options.for_mode(mode), microbatches)
                            for mode in _memory.MODES
                            if _runs_in(options, mode) and planned_here}, name


def _runs_in(options: optfuse.FuseOptions, mode: str) -> bool:
  try:
    options.for_mode(mode)
  except optfuse.OffloadError:
    return False
  return True


def test_every_entry_point_refuses_options_given_twice_that_disagree(monkeypatch):
  _compiled_options(monkeypatch)
  options, params, batch = optfuse.FuseOptions("forward"), models.stacked_params(), _batch()
  conflict = pytest.raises(optfuse.OptionsError, match=r"mode='off' contradicts options=")
  with conflict:
    optfuse.fuse(LION, mode="off", options=options)
  with conflict:
    optfuse.train_step(models.scanned_loss, mode="off", options=options)
  with conflict:
    optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=LION, mode="off",
                                    options=options)
  with conflict:
    optfuse.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), LION, mode="off", options=options)
  with pytest.raises(optfuse.OptionsError, match=r"guard=True contradicts options="):
    optfuse.memory_report(models.scanned_loss, LION, params, *batch, guard=True, options=options)
  with pytest.raises(optfuse.OptionsError, match=r"offload='state' contradicts options="):
    optfuse.max_batch_size(models.scanned_loss, LION, params, lambda b: batch, 10**5,
                           offload="state", options=options)
  with pytest.raises(optfuse.OptionsError, match="describes that transformation's step"):
    optfuse.describe(optfuse.fuse(LION), models.scanned_loss, params, *batch, options=options)
  # The same value twice is one value.
  assert optfuse.fuse(LION, mode="forward", options=options).options == options


def test_train_step_compares_every_option_with_those_of_a_linen_state():
  params, batch = models.stacked_params(), _batch()
  state = optfuse.linen.TrainState.create(apply_fn=None, params=params, tx=LION)
  for given in [{"guard": True}, {"mode": "forward"}, {"offload": "state"},
                {"options": optfuse.FuseOptions(guard=True)}]:
    with pytest.raises(optfuse.OptionsError, match="the state was created with"):
      optfuse.train_step(models.scanned_loss, **given)(state, *batch)
  # Options that agree with the state's run with them.
  step = jax.jit(optfuse.train_step(models.scanned_loss, options=optfuse.FuseOptions()))
  _, state = step(state, *batch)
  assert int(state.step) == 1


def _sub_jaxprs(eqn: jcore.JaxprEqn):
  for value in eqn.params.values():
    for x in value if isinstance(value, (tuple, list)) else [value]:
      if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        yield x.jaxpr if isinstance(x, jcore.ClosedJaxpr) else x


def _computes(jaxpr: jcore.Jaxpr, primitive: str) -> bool:
  return any(e.primitive.name == primitive or any(_computes(j, primitive) for j in _sub_jaxprs(e))
             for e in jaxpr.eqns)


def _where_computed(jaxpr: jcore.Jaxpr, var):
  """Where the equation that computes ``var`` sits: ``"loop"`` (a loop that runs the layers, a
  ``dot_general``, with it), ``"rows"`` (a loop of its own), ``"whole"`` (no loop), or
  ``("input", j)`` for the ``j``-th input of ``jaxpr``, followed through calls, conditionals and
  optimization barriers."""
  if var in jaxpr.invars:
    return ("input", jaxpr.invars.index(var))
  eqn = next(e for e in jaxpr.eqns if var in e.outvars)
  k, name = eqn.outvars.index(var), eqn.primitive.name
  if name in ("scan", "while"):
    return "loop" if _computes(eqn.params["jaxpr"].jaxpr, "dot_general") else "rows"
  if name == "optimization_barrier":
    return _where_computed(jaxpr, eqn.invars[k])
  if name == "cond":  # the branch that computes it; the other passes an input through
    found = {_where_computed(b.jaxpr, b.jaxpr.outvars[k]) for b in eqn.params["branches"]}
    computed = {f for f in found if not isinstance(f, tuple)}
    if computed:
      (where,) = computed
      return where
    return _where_computed(jaxpr, eqn.invars[1 + found.pop()[1]])
  bodies = list(_sub_jaxprs(eqn))
  if len(bodies) != 1 or len(bodies[0].outvars) != len(eqn.outvars):
    return "whole"  # the update's own equations
  body = bodies[0]
  found = _where_computed(body, body.outvars[k])
  return _where_computed(jaxpr, eqn.invars[found[1]]) if isinstance(found, tuple) else found


# What describe's places say of where the update's equations sit.
SITS = {"loop": "loop", "rows": "rows", "tap": "whole", "leaf": "whole", "optax": "whole"}
RUNS = [c for c in COMBINATIONS if _refusal(c) is None]


@pytest.mark.parametrize("combo", RUNS, ids=map(_id, RUNS))
def test_describe_reports_where_the_traced_step_updates_each_leaf(combo):
  options, microbatches = optfuse.FuseOptions(**_options_of(combo)), combo["microbatches"]
  fx = optfuse.fuse(_tx(options), options=options)
  params, batch = models.stacked_params(), _batch()
  if options.offload == "params":  # the loop stacks in host memory, where the step keeps them
    params = optfuse.params_to_host(fx, models.scanned_loss, params, *batch)
  step = jax.jit(fx.value_and_update(models.scanned_loss, microbatches=microbatches),
                 donate_argnums=(0, 1))
  traced = step.trace(params, fx.init(params), *batch).jaxpr.jaxpr
  # The step's outputs are (loss, params, state): the new params follow the loss.
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  sits = {path: _where_computed(traced, var)
          for path, var in zip(paths, traced.outvars[1:1 + len(paths)])}

  described = optfuse.describe(fx, models.scanned_loss, params, *batch,
                               microbatches=microbatches)
  assert {path: SITS[where] for path, where in described.items()} == sits
  stacked = {"['layers']['b']", "['layers']['w']"}
  # Every fused mode updates the stacked layers in the loops of the loss, but with microbatches,
  # whose update runs once, outside the loop over them; each leaf not in a loop says why.
  in_loops = options.mode != "off" and microbatches is None
  assert ({sits[p] for p in stacked} == {"loop"}) == in_loops
  assert set(described.reasons) == (set() if in_loops or options.mode == "off" else stacked)
  # (Each leaf's slots, where the transformation splits per leaf: not clipped Lion's.)
  assert set(described.state.values()) <= {"host" if options.offload in ("state", "params")
                                           else "device"}  # "auto": as its plan places it
  assert described.params == {p: "host" if options.offload == "params" and p in stacked
                              else "device" for p in paths}


def test_describe_of_a_plain_optax_transformation_is_that_of_its_default_fused_step():
  params, (tokens, targets) = models.stacked_params(), _batch()
  plain = optfuse.describe(LION, models.scanned_loss, params, tokens, targets)
  fused = optfuse.describe(optfuse.fuse(LION), models.scanned_loss, params, tokens, targets)
  assert (plain, plain.reasons, plain.state) == (fused, fused.reasons, fused.state)


def test_options_are_immutable_and_checked_again_when_replaced():
  fx = optfuse.fuse(LION, mode="forward", offload="state")
  assert fx.options == optfuse.FuseOptions(mode="forward", offload="state")
  assert (fx.mode, fx.global_ops, fx.offload, fx.guard) == ("forward", None, "state", False)
  with pytest.raises(dataclasses.FrozenInstanceError):
    fx.options.mode = "backward"
  with pytest.raises(optfuse.OffloadError, match="Drop global_ops"):
    dataclasses.replace(fx.options, global_ops="two_pass")
  assert optfuse.fuse(LION, options=fx.options).options == fx.options


def test_the_flax_adapters_keep_the_options_they_were_given():
  options = optfuse.FuseOptions("forward", offload="state")
  state = optfuse.linen.TrainState.create(apply_fn=None, params=models.stacked_params(), tx=LION,
                                          options=options)
  assert state.options == state.fused.options == options
  assert (state.mode, state.offload) == ("forward", "state")
  optimizer = optfuse.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), LION, options=options)
  assert optimizer.options == optimizer.fused.options == options
  assert (optimizer.mode, optimizer.offload) == ("forward", "state")


def _docs_cell(mode: str, option: str, value) -> str:
  """What the docs' table says of ``option=value`` in ``mode``: the error it raises alone, or
  "yes" and the options it is refused with that run in ``mode`` alone."""
  plain = dict(zip(FIELDS, (mode, None, None, False, None)))
  error = _refusal({**plain, option: value})
  if error is not None:
    return f"`{type(error).__name__}`"
  refused = [o for o, v in OTHERS.items() if o != option and _refusal({**plain, o: v}) is None
             and _refusal({**plain, option: value, o: v}) is not None]
  return "yes" + "".join(f", not with `{o}`" for o in refused)


# Each option set to a value other than its default, as the docs' table names them.
OTHERS = {"global_ops": "two_pass", "offload": "state", "guard": True, "microbatches": 2}


def test_the_docs_table_of_what_runs_is_the_table():
  lines = ['| mode | `global_ops="two_pass"` | `offload="state"` | `guard=True` '
           '| `microbatches=k` |', "|---|---|---|---|---|"]
  for mode in _options.MODES:
    lines.append(f'| `"{mode}"` | ' + " | ".join(_docs_cell(mode, o, v) for o, v in OTHERS.items())
                 + " |")
  assert "\n".join(lines) in (DOCS / "modes.md").read_text()


def test_offload_auto_with_the_guard_is_refused_up_front_naming_both():
  # The planner would otherwise build FuseOptions(offload="params", guard=True) and raise an
  # error about options the user never gave.
  with pytest.raises(optfuse.GuardError, match=r'offload="auto".*Use guard=False'):
    optfuse.fuse(LION, offload="auto", guard=True)
  with pytest.raises(optfuse.GuardError, match=r'offload="auto"'):
    optfuse.FuseOptions(offload="auto", guard=True)


@pytest.mark.parametrize("combo", RUNS, ids=map(_id, RUNS))
def test_every_combination_the_table_accepts_builds_traces_and_plans_a_step(combo, monkeypatch):
  # The memory guard's decision stands in for its compiles: what is built, not the guard.
  monkeypatch.setattr(_guard, "decide", lambda sites, peak_of: {})
  options, microbatches = optfuse.FuseOptions(**_options_of(combo)), combo["microbatches"]
  fx = optfuse.fuse(_tx(options), options=options)
  params, batch = models.stacked_params(), _batch()
  if options.offload == "params":  # the loop stacks in host memory, where the step keeps them
    params = optfuse.params_to_host(fx, models.scanned_loss, params, *batch)
  step = fx.value_and_update(models.scanned_loss, microbatches=microbatches)
  loss, new_params, _ = jax.eval_shape(step, params, fx.init(params), *batch)
  assert loss.shape == () and jax.tree.structure(new_params) == jax.tree.structure(params)
  if options.offload == "auto":
    # What the planner reads first (plan_offload compiles only for an accelerator's compiler).
    leaves = _auto._leaves(fx, models.scanned_loss, params, batch, {})
    assert {leaf.path for leaf in leaves if leaf.in_loop} == {"['layers']['b']",
                                                              "['layers']['w']"}


def test_an_explicit_none_is_an_option_given_and_a_keyword_left_out_is_not():
  on_host = optfuse.FuseOptions(offload="state")
  assert optfuse.fuse(LION, options=on_host).offload == "state"  # nothing given beside it
  assert optfuse.fuse(LION, offload=None).offload is None
  assert optfuse.fuse(LION, global_ops=None).global_ops is None
  # An explicit None contradicts the options' value, like any other value given twice.
  with pytest.raises(optfuse.OptionsError, match=r"offload=None contradicts options="):
    optfuse.fuse(LION, offload=None, options=on_host)
  with pytest.raises(optfuse.OptionsError, match=r"global_ops=None contradicts options="):
    optfuse.fuse(LION, global_ops=None, options=optfuse.FuseOptions(global_ops="two_pass"))
  with pytest.raises(optfuse.OptionsError, match=r"offload=None contradicts options="):
    optfuse.memory_report(models.scanned_loss, LION, models.stacked_params(), *_batch(),
                          offload=None, options=on_host)
  state = optfuse.linen.TrainState.create(apply_fn=None, params=models.stacked_params(), tx=LION,
                                          offload="state")
  with pytest.raises(optfuse.OptionsError, match="the state was created with"):
    optfuse.train_step(models.scanned_loss, offload=None)(state, *_batch())
