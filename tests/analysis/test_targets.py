"""Compile targets: memory reports and fits for the TPU and GPU compilers, without their hardware.

The tests marked ``targets`` compile for TPU v5e (libtpu) and for NVIDIA GPUs (the CUDA plugin)
from ``jax.ShapeDtypeStruct``s; each skips, saying which extra to install, when its compiler is
absent. The rest check the registry, the parsing of compiler refusals and the search on their own.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optfuse
from optfuse._analysis import _fit, _memory
from optfuse._targets import _compiled, _registry

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')
needs_cuda = pytest.mark.skipif(not _registry.compiler_installed("cuda"),
                                reason='the GPU compiler is not installed: '
                                'pip install -e ".[cuda]"')

# 16 layers: the stacked gradient is 16 layer rows, against the few rows a fused loop holds.
LAYERS, DIM, BATCH = 16, 128, 8


def _scanned_params(dim=DIM, layers=LAYERS):
  return {"embed": jax.ShapeDtypeStruct((64, dim), jnp.float32),
          "layers": {"w": jax.ShapeDtypeStruct((layers, dim, dim), jnp.float32),
                     "b": jax.ShapeDtypeStruct((layers, dim), jnp.float32)}}


def _scanned_loss(params, x):
  def body(h, layer):
    return jnp.tanh(h @ layer["w"] + layer["b"]), None

  h, _ = jax.lax.scan(body, x @ params["embed"], params["layers"])
  return jnp.mean(h**2)


def _batch(b, dim=DIM):
  return jax.ShapeDtypeStruct((b, 64), jnp.float32)


# --- the registry and the refusals, no compiler needed ---------------------------------------

def test_targets_name_the_accelerators_colab_and_clouds_rent():
  names = set(optfuse.targets())
  assert {"tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4", "t4", "l4", "a100-40gb", "a100-80gb",
          "h100"} <= names


def test_an_unknown_target_is_a_target_error_that_lists_the_known_ones():
  with pytest.raises(optfuse.TargetError, match="unknown compile target 'tpu-v9'.*tpu-v5e"):
    optfuse.memory_report(_scanned_loss, optax.sgd(0.1), _scanned_params(), _batch(2),
                          target="tpu-v9")


def test_an_unreadable_topology_is_a_target_error():
  with pytest.raises(optfuse.TargetError, match="cannot read the topology"):
    _registry.resolve("tpu-v5e:two-by-two")


@pytest.mark.parametrize("name, extra", [("tpu-v5e", "tpu"), ("h100", "cuda")])
def test_a_target_whose_compiler_is_missing_names_the_extra_to_install(monkeypatch, name, extra):
  _registry._named.cache_clear()
  monkeypatch.setattr(_registry, "compiler_installed", lambda platform: False)
  with pytest.raises(optfuse.TargetError, match=rf'pip install -e "\.\[{extra}\]"'):
    optfuse.max_batch_size(_scanned_loss, optax.sgd(0.1), _scanned_params(), _batch,
                           target=name)
  _registry._named.cache_clear()


def test_the_gpu_compiler_is_missing_where_no_jax_plugin_is_installed_at_all(monkeypatch):
  # A plain `pip install optfuse` has no jax_plugins package; find_spec then raises for a
  # submodule of it, as Python's does for a submodule whose parent is missing.
  find_spec = importlib.util.find_spec

  def without_jax_plugins(name, package=None):
    if name == "jax_plugins":
      return None
    if name.startswith("jax_plugins."):
      raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
    return find_spec(name, package)

  monkeypatch.setattr(importlib.util, "find_spec", without_jax_plugins)
  assert not _registry.compiler_installed("cuda")


def test_something_that_is_no_target_is_a_target_error():
  with pytest.raises(optfuse.TargetError, match="a target is None, a name"):
    _registry.resolve(42)


@pytest.mark.parametrize("message, needed, available", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
     "temporaries (18.64G) exceeds available HBM (15.75G).", 18.64, 15.75),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
     "hbm. Used 16.65G of 15.75G hbm. Exceeded hbm capacity by 922.70M.", 16.65, 15.75),
])
def test_a_compiler_out_of_memory_reads_as_does_not_fit_with_the_bytes_it_needed(
    message, needed, available):
  refusal = _compiled.does_not_fit(jax.errors.JaxRuntimeError(message))
  # The TPU compiler's "G" are GiB; two decimals of them are ~10 MB, hence the rounding.
  assert refusal.needed_bytes == int(needed * 2**30)
  assert refusal.available_bytes == int(available * 2**30)
  assert str(refusal).startswith("does not fit: the compiler needs")


def test_other_compile_errors_are_not_read_as_out_of_memory():
  assert _compiled.does_not_fit(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: bad")) is None
  assert _compiled.does_not_fit(ValueError("RESOURCE_EXHAUSTED")) is None


def test_a_gpu_budget_is_the_share_jax_preallocates(monkeypatch):
  size = int(__import__("re").search(r"device_memory_size:\s*(\d+)",
                                     _registry.gpu_config("h100.txtpb")).group(1))
  assert _registry._gpu_memory("h100.txtpb")[0] == int(0.75 * size)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  assert _registry._gpu_memory("h100.txtpb")[0] == int(0.9 * size)


@settings(max_examples=300, deadline=None)
@given(base=st.integers(0, 1000), slope=st.integers(0, 60), budget=st.integers(0, 6000),
       wobble=st.lists(st.integers(0, 40), min_size=400, max_size=400),
       refused_from=st.one_of(st.none(), st.integers(1, 300)),
       guess=st.integers(1, 300), hint=st.one_of(st.none(), st.floats(0.5, 100)),
       cap=st.one_of(st.none(), st.integers(0, 399)))
def test_the_affine_search_is_exact_for_any_monotone_peak_and_asks_each_point_once(
    base, slope, budget, wobble, refused_from, guess, hint, cap):
  peaks = np.cumsum(wobble) + base + slope * np.arange(400)
  asked = []

  def peak(k):
    asked.append(k)
    if k >= 400 or (refused_from and k >= refused_from):
      return None
    return int(peaks[k])

  fits = lambda k: 1 <= k < 400 and not (refused_from and k >= refused_from) and (
      peaks[k] <= budget)
  got = _fit.largest_affine(peak, budget, 1, (guess, guess + 1), hint, upper=cap)
  if cap is not None:  # nothing above the cap is asked; the cap answers when it fits
    assert max(asked, default=0) <= cap and got <= cap
    fits = lambda k, below=fits: k <= cap and below(k)
  assert (got == 0 and not fits(1)) or (fits(got) and not fits(got + 1))
  assert len(asked) == len(set(asked))


def test_an_unbracketed_search_grows_at_most_sixteenfold_a_probe():
  # Equal peaks at 1 and 2 (a compiler that pads the batch) would aim the secant at a batch no
  # compiler can build: the GPU compiler fails on such a program instead of refusing it.
  asked = []
  peak = lambda k: asked.append(k) or 1000 + (0 if k < 3 else k)
  assert _fit.largest_affine(peak, 1500, 1, (1, 2)) == 500
  grown = [b / a for a, b in zip(asked, asked[1:]) if b > a and a < 500]
  assert max(grown) <= _fit.GROWTH and len(asked) <= 7


def test_a_cap_that_fits_is_found_in_three_compiles():
  asked = []
  got = _fit.largest_affine(lambda k: asked.append(k) or 1000 + 37 * k, 5000, 1, (1, 2), upper=50)
  assert got == 50 and asked == [1, 2, 50]


def test_an_affine_peak_is_found_in_four_compiles():
  asked = []
  got = _fit.largest_affine(lambda k: asked.append(k) or 1000 + 37 * k, 5000, 1, (4, 8))
  assert got == 108 and asked == [4, 8, 108, 109]


def test_a_slope_hint_aims_past_refusals_that_carry_no_peak():
  # Above the boundary the compiler refuses: only the peaks below it are known.
  asked = []
  peak = lambda k: asked.append(k) or (1000 + 37 * k if k <= 108 else None)
  assert _fit.largest_affine(peak, 5000, 1, (120, 121), slope=37.0) == 108
  assert len(asked) <= 5


# --- the TPU compiler (libtpu), deviceless ---------------------------------------------------

@needs_tpu
@pytest.mark.targets
@pytest.mark.parametrize("name", ["tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"])
def test_each_tpu_budget_is_the_hbm_limit_its_compiler_states(name):
  target = _registry.resolve(name)
  big = jax.ShapeDtypeStruct((120_000, 120_000), jnp.float32,
                             sharding=jax.sharding.SingleDeviceSharding(target.devices[0]))
  refusal = _memory.compile_memory(jax.jit(lambda x: x @ x + 1).lower(big))
  assert isinstance(refusal, _memory.DoesNotFit)
  # The compiler prints two decimals of GiB.
  assert abs(refusal.available_bytes - target.memory_bytes) < 0.01 * 2**30


@pytest.fixture(scope="module")
def v5e_report():
  # d=2048: the TPU compiler keeps small temporaries out of HBM (at d=1024 neither step
  # reports any temp), so a smaller stack shows nothing to save.
  return optfuse.memory_report(_scanned_loss, optax.adamw(1e-3), _scanned_params(2048),
                               _batch(BATCH), target="tpu-v5e")


@needs_tpu
@pytest.mark.targets
def test_memory_report_compiles_every_mode_for_tpu_v5e_within_its_hbm(v5e_report):
  assert set(v5e_report) == {"off", "backward", "forward"}
  assert v5e_report.target == "tpu-v5e"
  assert v5e_report.budget_bytes == int(15.75 * 2**30)
  assert all(v5e_report.fits(mode) for mode in v5e_report)
  assert "compiled for tpu-v5e" in v5e_report.table()


@needs_tpu
@pytest.mark.targets
def test_backward_fusion_saves_the_stacked_gradient_on_the_tpu_compiler(v5e_report):
  stacked = LAYERS * (2048 * 2048 + 2048) * 4
  saved = v5e_report["off"]["peak_bytes"] - v5e_report["backward"]["peak_bytes"]
  # The loop writes each layer's rows in place: all of the stacked gradient but a layer's rows.
  assert saved >= 0.8 * stacked


@needs_tpu
@pytest.mark.targets
def test_a_model_too_big_for_the_tpu_is_answered_does_not_fit_per_mode():
  params = _scanned_params(8192, layers=16)  # 4.3 GB of params, 13 GB with AdamW's moments
  report = optfuse.memory_report(_scanned_loss, optax.adamw(1e-3), params,
                                 jax.ShapeDtypeStruct((8, 64), jnp.float32), target="tpu-v5e")
  assert "off" in report.does_not_fit and not report.fits("off")
  refusal = report.does_not_fit["off"]
  assert refusal.needed_bytes > refusal.available_bytes == report.budget_bytes
  assert "does not fit: the compiler needs" in report.table()


@pytest.mark.slow
@needs_tpu
@pytest.mark.targets
def test_max_batch_size_on_tpu_needs_no_budget_and_reads_refusals_as_not_fitting():
  params = _scanned_params(256)
  args_for = lambda b: (jax.ShapeDtypeStruct((b, 256, 64), jnp.float32),)

  def loss(p, x):
    return _scanned_loss(p, x.reshape(-1, 64))

  fit = optfuse.max_batch_size(loss, optax.adamw(1e-3), params, args_for, target="tpu-v5e",
                               modes=["backward"], progress=False)
  assert fit.budget_bytes == int(15.75 * 2**30) and "HBM" in fit.budget_source
  b = fit["backward"]
  assert b > 1000 and fit.peaks["backward"][b] <= fit.budget_bytes
  nxt = fit.next_batch("backward")
  assert nxt in fit.does_not_fit.get("backward", {}) or fit.peaks["backward"][nxt] > (
      fit.budget_bytes)


@needs_tpu
@pytest.mark.targets
def test_a_topology_of_four_chips_reports_per_device_and_splits_the_batch():
  one = optfuse.memory_report(_scanned_loss, optax.sgd(0.1), _scanned_params(), _batch(4),
                              target="tpu-v5e")
  four = optfuse.memory_report(_scanned_loss, optax.sgd(0.1), _scanned_params(), _batch(16),
                               target="tpu-v5e:2x2")
  assert len(_registry.resolve("tpu-v5e:2x2").devices) == 4
  # Each device holds the whole (replicated) params and a quarter of the batch of 16.
  assert four["off"]["argument_bytes"] == one["off"]["argument_bytes"]


@needs_tpu
@pytest.mark.targets
def test_a_mesh_or_topology_the_user_holds_is_a_target():
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1",
                                          chips_per_host_bounds=(1, 1, 1))
  mesh = jax.sharding.Mesh(np.array(topology.devices), ("data",))
  by_name = optfuse.memory_report(_scanned_loss, optax.sgd(0.1), _scanned_params(), _batch(4),
                                  target="tpu-v5e")
  for target in (topology, mesh, topology.devices):
    report = optfuse.memory_report(_scanned_loss, optax.sgd(0.1), _scanned_params(), _batch(4),
                                   target=target)
    assert report["backward"] == by_name["backward"]
    assert report.budget_bytes == by_name.budget_bytes


# --- the GPU compiler (the CUDA plugin), deviceless -------------------------------------------

@needs_cuda
@pytest.mark.targets
@pytest.mark.parametrize("name", ["t4", "h100", *(pytest.param(n, marks=pytest.mark.slow)
                                                 for n in ("l4", "a100-40gb", "a100-80gb",
                                                           "h200"))])
def test_each_gpu_description_compiles_and_backward_fusion_saves_the_stacked_gradient(name):
  report = optfuse.memory_report(_scanned_loss, optax.adamw(1e-3), _scanned_params(1024),
                                 _batch(BATCH), target=name)
  stacked = LAYERS * (1024 * 1024 + 1024) * 4
  assert report["off"]["peak_bytes"] - report["backward"]["peak_bytes"] >= 0.8 * stacked
  assert report.fits("off") and "XLA_PYTHON_CLIENT_MEM_FRACTION" in report.budget_source


@needs_cuda
@pytest.mark.targets
@pytest.mark.parametrize("clip", [False, True], ids=["adamw", "clip+adamw"])
def test_forward_fusion_never_peaks_above_optax_on_the_gpu_compiler(clip):
  # Updated whole in the pending update's conditional, the stacked leaves made the H100
  # compiler copy params and state (here 472.59 MB with AdamW, 539.24 MB with clipping, against
  # optax's 279.75 MB); row by row (``_backends.FORWARD_STACKED_ROWS``) forward fusion holds
  # what optax holds, plus at most the layer row in flight (measured: 33 kB and 4.19 MB more).
  tx = optax.adamw(1e-3)
  tx = optax.chain(optax.clip_by_global_norm(1.0), tx) if clip else tx
  report = optfuse.memory_report(_scanned_loss, tx, _scanned_params(1024), _batch(BATCH),
                                 target="h100")
  row = (1024 * 1024 + 1024) * 4
  assert report["forward"]["peak_bytes"] <= report["off"]["peak_bytes"] + row


# The bench's scanned-model forms at the size of the README's forms table (16 layers of d=512).
# The three forms that compute in bfloat16 peaked above optax on the TPU v5e compiler until the
# forward loop carried its param stacks there (``_backends.CARRIED_STACKS``); where a loop costs
# more than it saves, the memory guard gives it up (``guard=True``).
@needs_tpu
@pytest.mark.slow
@pytest.mark.targets
@pytest.mark.parametrize("guard", [False, True], ids=["fused", "guarded"])
@pytest.mark.parametrize("form", ["linen_axis1", "bf16_policy", "moveaxis", "outer_remat",
                                  "no_remat"])
def test_backward_fusion_never_peaks_above_optax_on_the_tpu_compiler_for_every_form(form, guard):
  from optfuse.bench import _forms, _models, _suite
  model = (_models.decoder(_suite.FORM_SIZE, scanned=True, remat=False) if form == "no_remat"
           else _forms.FORMS[form](_suite.FORM_SIZE))
  report = optfuse.memory_report(model.loss, optax.adamw(1e-3), _models.abstract(model.params),
                                 *_models.abstract(model.batch), target="tpu-v5e", guard=guard)
  assert report["backward"]["peak_bytes"] <= report["off"]["peak_bytes"]


# The replicas of the forms that store the layer axis second (16 layers of d=512, vocab
# 4096, T=256, B=2). The TPU compiler relaid their loop-carried stacks out layer axis first, a
# transposed copy of each whole stack (42 % saved); pinned to the stored layout
# (``_backends.STORED_LAYOUTS``) backward fusion saves more than the stacked gradient.
@needs_tpu
@pytest.mark.slow
@pytest.mark.targets
@pytest.mark.parametrize("form", ["linen_axis1", "moveaxis"])
def test_layer_axis_second_forms_save_their_stacked_gradient_on_the_tpu_compiler(form):
  from optfuse.bench import _forms, _models, _suite
  model = _forms.FORMS[form](_suite.FORM_SIZE._replace(vocab=4096, seq=256, batch=2))
  params = _models.abstract(model.params)
  report = optfuse.memory_report(model.loss, optax.adamw(1e-3), params,
                                 *_models.abstract(model.batch), target="tpu-v5e")
  saved = report["off"]["peak_bytes"] - report["backward"]["peak_bytes"]
  assert saved >= 0.8 * _models.grad_bytes(params["layers"])


# Two-pass backward with whole-leaf statistics on an 8-layer d=1024 decoder (ff 4096, vocab
# 4096, T=512, batch 1; a 403 MB stacked gradient). Its forward loop carried the param stacks
# there, as one-pass backward's does (``_backends.CARRIED_STACKS``), and the TPU compiler copied
# them for the two backward loops: Adafactor's defaults peaked at 1.33 GB against optax's
# 1.03 GB, LAMB at 2.14 against 2.14. Read as loop invariants (``TWO_PASS_CARRIED_STACKS``):
# 0.65 and 1.47 GB, 0.94 and 1.65 stacked gradients below optax.
@needs_tpu
@pytest.mark.targets
@pytest.mark.parametrize("name", ["adafactor", "lamb"])
def test_two_pass_with_whole_leaf_statistics_saves_the_stacked_gradient_on_the_tpu_compiler(
    name):
  from optfuse.bench import _models
  config = _models.DecoderConfig(layers=8, dim=1024, heads=8, ff=4096, vocab=4096, seq=512,
                                 batch=1)
  model = _models.decoder(config, scanned=True, remat=True)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  tx = getattr(optax, name)(1e-3)
  target = _registry.resolve("tpu-v5e")
  peaks = {mode: _memory.step_memory(optfuse.fuse(tx, mode=mode, global_ops=global_ops),
                                     model.loss, params, batch, target=target)["peak_bytes"]
           for mode, global_ops in [("off", None), ("backward", "two_pass")]}
  saved = peaks["off"] - peaks["backward"]
  assert saved >= 0.8 * _models.grad_bytes(params["layers"]), peaks


def _embedded_loss(params, x):
  return _scanned_loss({**params, "embed": params["vocab"] @ params["embed"]}, x)


@needs_cuda
@pytest.mark.targets
def test_forward_fusion_updates_a_leaf_outside_the_loop_in_place_on_the_gpu_compiler():
  # The H100 compiler copies each leaf a conditional updates whole: the pending update of an
  # 8192x1024 leaf outside the loop (and of its two moments) cost copies of them (measured:
  # 107.0 MB of temporaries against backward fusion's 35.9 MB). Chosen by a select there
  # (``_backends.PENDING_SELECT``), it is updated in place (5.9 MB).
  params = {**_scanned_params(1024), "vocab": jax.ShapeDtypeStruct((64, 8192), jnp.float32),
            "embed": jax.ShapeDtypeStruct((8192, 1024), jnp.float32)}
  report = optfuse.memory_report(_embedded_loss, optax.adamw(1e-3), params, _batch(BATCH),
                                 target="h100")
  leaf = 8192 * 1024 * 4
  assert report["forward"]["temp_bytes"] < report["backward"]["temp_bytes"] + leaf
