"""``max_batch_size``: the largest batch whose compiled training step fits a memory budget."""

import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._analysis import _fit, _memory
from optfuse._targets import _compiled

# 16 stacked 256x256 layers under a rematerialised scan, on sequences of 64 vectors: each compile
# takes about a third of a second on CPU, one example adds about 1.4 MB to the peak and backward
# fusion saves about 3.6 MB (most of the 4.2 MB stacked gradient), so it fits a couple more.
LAYERS, WIDTH, SEQ = 16, 256, 64
PARAMS = {"layers": jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32),
          "head": jax.ShapeDtypeStruct((WIDTH,), jnp.float32)}
ADAMW = optax.adamw(1e-3)
CLIP_ADAM = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


def _loss(params, x):
  body = lambda h, w: (jnp.tanh(h @ w), None)
  h, _ = jax.lax.scan(jax.checkpoint(body), x, params["layers"])
  return jnp.mean((h @ params["head"]) ** 2)


def _args_for(b):
  return (jax.ShapeDtypeStruct((b, SEQ, WIDTH), jnp.float32),)


def _peak(mode, b, tx=ADAMW, **step_options):
  """The compiled peak of one step, compiled here, independently of ``max_batch_size``."""
  fx = optfuse.fuse(tx, mode=mode)
  lowered = _memory.lower_step(fx, _loss, PARAMS, _args_for(b), **step_options)
  return _compiled.compiled_memory(lowered.compile())["peak_bytes"]


@pytest.fixture(scope="module")
def adamw_fit():
  """The search for a budget of optax's peak at batch 8, with every compile it made."""
  budget = optfuse.memory_report(_loss, ADAMW, PARAMS, *_args_for(8))["off"]["peak_bytes"]
  compiled = []
  lower_step = _memory.lower_step

  def counting(fx, loss_fn, params, args, *rest, **kwargs):
    compiled.append((fx.mode, args[0].shape[0]))
    return lower_step(fx, loss_fn, params, args, *rest, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_memory, "lower_step", counting)
    fit = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, budget, progress=False)
  return budget, fit, compiled


def test_the_compiled_step_at_the_returned_batch_fits_and_one_more_example_does_not(adamw_fit):
  budget, fit, _ = adamw_fit
  assert set(fit) == {"off", "backward", "forward"} and not fit.unavailable
  for mode, b in fit.items():
    assert _peak(mode, b) <= budget < _peak(mode, b + 1), mode


def test_backward_fusion_fits_a_strictly_larger_batch_than_optax_on_a_scanned_model(adamw_fit):
  _, fit, _ = adamw_fit
  assert fit["off"] == 8  # the budget is optax's peak at batch 8: a peak equal to it fits
  assert fit["backward"] > fit["off"]


def test_no_batch_is_compiled_twice_and_every_compile_is_reported(adamw_fit):
  _, fit, compiled = adamw_fit
  assert len(compiled) == len(set(compiled))
  assert set(compiled) == {(mode, b) for mode, peaks in fit.peaks.items() for b in peaks}
  # Batches 1 and 2, then the secant of the peaks to the boundary: a few compiles per mode,
  # never more than doubling and bisection would take (2 log2(16)).
  assert all(len(peaks) <= 8 for peaks in fit.peaks.values())


def test_printing_the_report_shows_the_budget_and_one_line_per_mode(adamw_fit):
  budget, fit, _ = adamw_fit
  title, header, *lines = str(fit).splitlines()
  assert f"({budget} bytes)" in title
  assert header.split()[:3] == ["mode", "max", "batch"]
  assert [line.split()[:2] for line in lines] == [[m, str(fit[m])] for m in fit]
  assert fit == {mode: fit[mode] for mode in fit}


def test_zero_when_batch_one_does_not_fit(adamw_fit):
  _, fit, _ = adamw_fit
  # Below optax's peak at batch 1, which backward fusion's smaller peak still fits under.
  budget = fit.peaks["off"][1] - 1
  small = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, budget, progress=False)
  assert small["off"] == 0 and small["forward"] == 0
  assert small["backward"] >= 1
  assert small.peaks["off"] == {1: fit.peaks["off"][1]}


@pytest.mark.parametrize("budget, expected", [
    ("24GB", 24 * 10**9),
    ("80GiB", 80 * 2**30),
    ("512MB", 512 * 10**6),
    ("1.5 GB", 1_500_000_000),
    ("1.5GiB", 3 * 2**29),
    (" 2 kB ", 2000),
    ("4KiB", 4096),
    ("24gb", 24 * 10**9),
    ("1TB", 10**12),
    ("100", 100),
    ("100 B", 100),
    (".5MB", 500_000),
    (24e9, 24 * 10**9),
    (1000, 1000),
])
def test_a_budget_is_bytes_or_a_number_with_a_decimal_or_binary_unit(budget, expected):
  assert _fit.parse_budget(budget) == expected


def test_a_budget_string_reaches_the_search_as_bytes():
  fit = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, "1 kB", modes=["off"],
                               progress=False)
  assert fit.budget_bytes == 1000 and fit == {"off": 0}


@pytest.mark.parametrize("budget", ["", "GB", "24 parsecs", "-1GB", "1.2.3GB", "1e3GB", "0.1B",
                                    "24 G B", 0, -5, True, float("nan"), float("inf"), [24]])
def test_a_bad_budget_raises_budget_error_before_compiling(budget):
  with pytest.raises(optfuse.BudgetError) as e:
    optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, budget)
  assert isinstance(e.value, ValueError) and repr(budget)[:10] in str(e.value)


def test_without_a_budget_the_default_backend_s_memory_is_the_budget(monkeypatch):
  from optfuse._targets import _registry
  monkeypatch.setattr(_registry, "host_memory_bytes", lambda: 1000)
  fit = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, modes=["off"], progress=False)
  assert fit.budget_bytes == 1000 and fit.budget_source == "this machine's physical memory"
  assert fit == {"off": 0} and "per device on cpu" in fit.table()


def test_without_a_budget_an_unknown_memory_is_a_budget_error(monkeypatch):
  from optfuse._targets import _registry
  monkeypatch.setattr(_registry, "host_memory_bytes", lambda: None)
  with pytest.raises(optfuse.BudgetError, match="no memory budget given"):
    optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, modes=["off"])


def test_arguments_that_do_not_grow_with_the_batch_raise_budget_error():
  with pytest.raises(optfuse.BudgetError, match="no larger than args_for"):
    optfuse.max_batch_size(_loss, ADAMW, PARAMS, lambda b: _args_for(4), "1GB")


def test_one_mode_may_be_named_by_a_string():
  fit = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, "1 kB", modes="backward",
                               progress=False)
  assert fit == {"backward": 0} and not fit.unavailable


def test_an_unknown_mode_raises_unknown_mode_error():
  with pytest.raises(optfuse.UnknownModeError):
    optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, "1GB", modes=["sideways"])


def test_a_non_separable_optimizer_leaves_backward_out_with_its_reason(adamw_fit):
  _, fit, _ = adamw_fit
  budget = fit.peaks["off"][2]  # a small answer keeps the search short
  plain = optfuse.max_batch_size(_loss, CLIP_ADAM, PARAMS, _args_for, budget, progress=False)
  assert set(plain) == {"off", "forward"} and set(plain.peaks) == {"off", "forward"}
  assert plain.unavailable["backward"].startswith("NonSeparableError: ")
  assert "clip_by_global_norm" in plain.unavailable["backward"]
  assert "backward  unavailable: NonSeparableError" in str(plain)
  two_pass = optfuse.max_batch_size(_loss, CLIP_ADAM, PARAMS, _args_for, budget,
                                    modes=["backward"], global_ops="two_pass", progress=False)
  assert set(two_pass) == {"backward"} and not two_pass.unavailable
  assert two_pass["backward"] >= 1


def test_with_microbatches_only_multiples_are_searched_and_the_next_multiple_does_not_fit(
    adamw_fit):
  budget, _, _ = adamw_fit
  fit = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, budget, modes=["backward"],
                               microbatches=2, progress=False)
  b = fit["backward"]
  assert b > 0 and b % 2 == 0 and all(k % 2 == 0 for k in fit.peaks["backward"])
  assert fit.next_batch("backward") == b + 2
  assert _peak("backward", b, microbatches=2) <= budget < _peak("backward", b + 2, microbatches=2)


@pytest.mark.parametrize("tqdm_installed", [True, False])
def test_a_search_of_more_than_a_few_compiles_shows_a_bar_if_tqdm_is_installed(
    adamw_fit, tqdm_installed, capsys, monkeypatch):
  _, fit, _ = adamw_fit
  if not tqdm_installed:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # importing it raises ImportError
  # Batches 1, 2, the secant's 8 and then 9: more compiles than the quiet ones.
  small = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, fit.peaks["off"][8],
                                 modes=["off"])
  assert small == {"off": 8} and len(small.peaks["off"]) > _fit.QUIET_COMPILES
  assert ("optfuse.max_batch_size" in capsys.readouterr().err) == tqdm_installed


def test_a_cap_bounds_the_search_and_the_report_says_the_cap_was_reached(adamw_fit):
  budget, fit, _ = adamw_fit
  cap = fit["backward"] - 1  # backward fits above it, so the cap answers; optax stops below
  capped = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, budget,
                                  modes=["off", "backward"], max_batch=cap, progress=False)
  assert fit["off"] < cap and capped["off"] == fit["off"] and not capped.capped("off")
  assert capped["backward"] == cap and capped.capped("backward")
  assert capped.next_batch("backward") is None and max(capped.peaks["backward"]) == cap
  assert f"searched up to batch {cap}" in str(capped) and "not tried (the cap)" in str(capped)


@pytest.mark.parametrize("cap", [0, -3, 2.5, True, "8"])
def test_a_cap_that_is_not_a_positive_int_raises_budget_error_before_compiling(cap):
  with pytest.raises(optfuse.BudgetError, match="max_batch must be an int of at least 1"):
    optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, "1GB", max_batch=cap)


def test_a_cap_is_searched_in_multiples_of_the_microbatches():
  fit = optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, "1GB", modes="backward",
                               microbatches=2, max_batch=7, progress=False)
  assert fit["backward"] == 6 and fit.capped("backward") and fit.max_batch == 6
  with pytest.raises(optfuse.BudgetError, match="at least 2"):
    optfuse.max_batch_size(_loss, ADAMW, PARAMS, _args_for, "1GB", microbatches=2, max_batch=1)
