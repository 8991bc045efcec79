"""Low-bit code words meet no arithmetic: they cross the fused steps as float32 cotangents
(``optfuse/_low_bit/_blocks.py``), and a word whose bytes read as a denormal or a NaN is an
ordinary 8- or 4-bit state.

Two checks. At run time, state whose words are denormal, signalling-NaN, quiet-NaN and infinite
float32 patterns (every pattern is a valid word: each byte, or nibble, is a code) trains in
every mode like the unfused transformation, the state bit for bit. XLA:CPU flushes denormals and
quiets signalling NaNs in arithmetic, so an add or a multiply on a word changes it here (the
first test) and the run check fails on one (the fault test). In the compiled programs of
XLA:CPU and the TPU v5e and H100 compilers, every op that reads a word only moves it until it
is bitcast to an integer (``optfuse._analysis._words``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optfuse
from optfuse._analysis import _memory, _words
from optfuse._fusion import _fused_step
from optfuse._low_bit import _maps
from optfuse._targets import _registry
from tests import criteria
from tests.low_bit.test_low_bit_fusion import low_bit_tx

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')
needs_gpu = pytest.mark.skipif(not _registry.compiler_installed("cuda"),
                               reason="the GPU compiler is not installed")

LAYERS, ROWS, N = 3, 4, 512
STEPS = 2

# Words as uint32: denormals (exponent 0), signalling NaNs (exponent 255, quiet bit 0, payload
# not 0), quiet NaNs, infinities, -0 and two normal numbers. The first word of every block is
# MAX_CODES instead, whose codes hold its map's largest entry (1 in every map: code 255 in 8
# bits, nibble 15 in 4): a block whose gradient is zero then keeps its codes through the step
# (its moments all scale alike), so the new state holds the same patterns and the output path
# carries them too. 0xFF is itself a denormal word.
MAX_CODES = 0x000000FF
PATTERNS = np.array([0x00000001, 0x007FFFFF, 0x80123456, 0x7F800001, 0xFFBFFFFF, 0x7FA5A5A5,
                     0x7FC00000, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x80000000, 0x3F800000,
                     0x12345678], np.uint32)
# The scales of the crafted slots: second moments of 1 keep the updates small.
SCALES = {"mu": 1e-2, "nu": 1.0, "trace": 1e-2}


def linear_loss(params, x):
  """A loss linear in the params, with a scanned stack: every gradient is exactly ``x[0]``
  (broadcast), in any mode and summed over microbatches of equal rows, so the fused run and the
  reference update the same moments from the same gradients."""
  c = x[0]
  h, _ = lax.scan(lambda h, w: (h + jnp.sum(w * c), None), jnp.zeros((), jnp.float32),
                  params["layers"])
  return h + jnp.sum(params["dense"] * c)


def _params():
  return {"layers": jnp.full((LAYERS, ROWS, N), 0.5, jnp.float32),
          "dense": jnp.full((ROWS, N), 0.25, jnp.float32)}


def _batch():
  """Rows all equal; the first half of each row's values 0, so their blocks get no
  gradient."""
  c = np.zeros(N, np.float32)
  c[N // 2:] = np.linspace(-1, 1, N // 2, dtype=np.float32)
  return (jnp.asarray(np.broadcast_to(c, (4, N))),)


def crafted_words(shape: tuple[int, ...], bits: int) -> np.ndarray:
  """Float32 words of ``shape`` cycling through ``PATTERNS``, ``MAX_CODES`` first in every
  block."""
  per_block = _maps.DEFAULT_BLOCK_SIZE[bits] * bits // 32
  j = np.arange(shape[-1])
  row = np.where(j % per_block == 0, np.uint32(MAX_CODES), PATTERNS[j % len(PATTERNS)])
  return np.broadcast_to(row.astype(np.uint32), shape).view(np.float32)


def _is_slot(x) -> bool:
  return isinstance(x, optfuse.QuantizedSlot)


def crafted(state, bits: int):
  """``state`` (optax's or a fused one) with the words of every quantized slot crafted, each
  array in the memory it was in."""
  def craft(path, slot):
    if not _is_slot(slot):
      return slot
    name = next(n for n in SCALES if f".{n}[" in jax.tree_util.keystr(path))
    scales = np.full(slot.scales.shape, SCALES[name], np.float32)
    return optfuse.QuantizedSlot(
        jax.device_put(crafted_words(slot.codes.shape, bits), slot.codes.sharding),
        jax.device_put(scales, slot.scales.sharding))

  return jax.tree_util.tree_map_with_path(craft, state, is_leaf=_is_slot)


def _bits(optimizer: str) -> int:
  return 4 if "4bit" in optimizer else 8


def reference(optimizer: str):
  """The unfused low-bit transformation from the crafted state: ``(params, state)``."""
  tx = low_bit_tx(optimizer)
  params, batch = _params(), _batch()

  @jax.jit
  def step(p, s):
    updates, s = tx.update(jax.grad(linear_loss)(p, *batch), s, p)
    return optax.apply_updates(p, updates), s

  p, s = params, crafted(tx.init(params), _bits(optimizer))
  for _ in range(STEPS):
    p, s = step(p, s)
  return p, s


def _fuse(optimizer: str, mode: str, offload: str | None) -> optfuse.FusedTransformation:
  if mode == "two_pass":
    return optfuse.fuse(low_bit_tx(optimizer), mode="backward", global_ops="two_pass")
  return optfuse.fuse(low_bit_tx(optimizer), mode=mode, offload=offload)


def fused(optimizer: str, mode: str, offload: str | None = None,
          microbatches: int | None = None):
  """The fused run from the crafted state, as optax's ``(params, state)``."""
  fx = _fuse(optimizer, mode, offload)
  params, batch = _params(), _batch()
  p = optfuse.params_to_host(fx, linear_loss, params, *batch) if offload == "params" else params
  s = crafted(fx.init(_params()), _bits(optimizer))
  step = jax.jit(fx.value_and_update(linear_loss, microbatches=microbatches))
  for _ in range(STEPS):
    _, p, s = step(p, s, *batch)
  if mode == "forward":
    p, s = fx.flush(p, s)
  return optfuse.to_optax_state(fx, p, s)


def _uint32(tree):
  return jax.tree.map(lambda x: np.asarray(x).view(np.uint32), tree)


def assert_same_state_bit_for_bit_and_params(got, want) -> None:
  """The states equal bit for bit (codes as uint32 words); the params within the float32
  criterion, whose update the fused step orders differently."""
  want_state, got_state = _uint32(want[1]), _uint32(got[1])
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want_state)[0],
                          jax.tree.leaves(got_state), strict=True):
    differ = np.flatnonzero(w.ravel() != g.ravel())
    assert not differ.size, (
        f"{jax.tree_util.keystr(path)}: {differ.size} words differ, first "
        f"{g.ravel()[differ[0]]:#010x} where the reference has {w.ravel()[differ[0]]:#010x}")
  criteria.assert_matches_optax(got[0], want[0])


def _special_words(state) -> set[str]:
  words = np.concatenate([np.asarray(q.codes).view(np.uint32).ravel() for q in
                          jax.tree.leaves(state, is_leaf=_is_slot) if _is_slot(q)])
  exponent, mantissa = (words >> 23) & 0xFF, words & 0x7FFFFF
  kinds = {"denormal": (exponent == 0) & (mantissa != 0),
           "signalling NaN": (exponent == 0xFF) & (mantissa != 0) & (mantissa < 0x400000),
           "quiet NaN": (exponent == 0xFF) & (mantissa >= 0x400000)}
  return {kind for kind, found in kinds.items() if found.any()}


def test_xla_cpu_arithmetic_changes_denormal_and_signalling_nan_words():
  """The premise of the run check on this backend: an add of zero or a multiply by one changes
  such a word's bits under ``jit`` (XLA:CPU runs with denormals flushed and quiets signalling
  NaNs), so a step that did either would not keep its state bit for bit."""
  words = np.array([0x00000001, 0x007FFFFF, 0x7F800001, 0xFFBFFFFF], np.uint32)
  zero = jnp.zeros(4, jnp.float32)
  for op in (lambda w, z: w + z, lambda w, z: w * (1 + z)):
    out = np.asarray(jax.jit(op)(words.view(np.float32), zero)).view(np.uint32)
    assert (out != words).all(), [f"{w:#010x}" for w in out]


def test_the_reference_keeps_the_crafted_words_where_no_gradient_reaches_them():
  """The new state of the reference holds denormal and NaN words, so the runs below check the
  words leaving a step as well as those entering it."""
  for optimizer in ("adamw_8bit", "adamw_4bit"):
    assert _special_words(reference(optimizer)[1]) == {"denormal", "signalling NaN",
                                                        "quiet NaN"}, optimizer


# (optimizer, mode, offload, microbatches); one fast case a bit width, the others under -m slow.
RUNS = [("adamw_8bit", "backward", None, None), ("adamw_4bit", "forward", "state", None)]
SLOW_RUNS = [
    ("adamw_8bit", "forward", None, None), ("adamw_4bit", "backward", None, None),
    ("adamw_8bit", "two_pass", None, None), ("adamw_8bit", "backward", "state", None),
    ("adamw_8bit", "backward", "params", None), ("adamw_8bit", "forward", "params", None),
    ("adamw_8bit", "backward", None, 2), ("adamw_8bit", "forward", None, 2),
    ("adamw_8bit", "off", None, None), ("lion_8bit", "backward", None, None),
    ("sgd_momentum_4bit", "backward", None, None)]


@pytest.mark.parametrize("optimizer,mode,offload,microbatches", [
    *RUNS, *(pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_RUNS)])
def test_denormal_and_nan_code_words_train_bit_for_bit_like_the_unfused_transformation(
    optimizer, mode, offload, microbatches):
  got = fused(optimizer, mode, offload, microbatches)
  assert_same_state_bit_for_bit_and_params(got, reference(optimizer))


def add_zero_to_state(monkeypatch, which: str) -> None:
  """Injects an add of a zero computed at run time on every ``which`` ("old": read, "new":
  written) state slot of the fused backward step, at its taps and in its loops: what a
  cotangent sum, or a select folded into arithmetic, would do to the words."""
  apply, row_update = _fused_step.LeafUpdater.apply, _fused_step.LeafUpdater.row_update

  def plus_zero(slots, grad, when):
    if when != which:
      return slots
    zero = jnp.zeros((), jnp.float32) * jnp.ravel(grad)[0]
    return tuple(s + zero.astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s
                 for s in slots)

  def faulty_apply(self, i, grad, param, slots, readonly):
    new_param, new_slots = apply(self, i, grad, param, plus_zero(slots, grad, "old"), readonly)
    return new_param, plus_zero(new_slots, grad, "new")

  def faulty_row_update(self, i, grad_row, param_row, slot_rows, *args, **kwargs):
    update, new_slots = row_update(self, i, grad_row, param_row,
                                   plus_zero(slot_rows, grad_row, "old"), *args, **kwargs)
    return update, plus_zero(new_slots, grad_row, "new")

  monkeypatch.setattr(_fused_step.LeafUpdater, "apply", faulty_apply)
  monkeypatch.setattr(_fused_step.LeafUpdater, "row_update", faulty_row_update)


@pytest.mark.parametrize("which", ["new", "old"])
def test_the_run_check_and_the_program_check_reject_an_add_on_the_words(monkeypatch, which):
  add_zero_to_state(monkeypatch, which)
  with pytest.raises(AssertionError, match="words differ"):
    assert_same_state_bit_for_bit_and_params(fused("adamw_8bit", "backward"),
                                             reference("adamw_8bit"))
  walk = _words.word_readers(_compiled_text("adamw_8bit", "backward"))
  assert "add" in {r.opcode for r in walk.reads}, walk.reads


def _compiled_text(optimizer: str, mode: str, offload: str | None = None,
                   microbatches: int | None = None, target: str | None = None) -> str:
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params())
  batch = tuple(jax.ShapeDtypeStruct((x.shape[0] * (microbatches or 1), *x.shape[1:]), x.dtype)
                for x in _batch())
  resolved = _registry.resolve(target)
  traced = _memory.trace_step(_fuse(optimizer, mode, offload), linear_loss, params, batch,
                              target=resolved, microbatches=microbatches)
  with _memory.on_target(resolved):
    return traced.lower().compile().as_text()


def assert_words_only_move(hlo: str) -> None:
  """Every word of the compiled step is moved only, from the step's inputs to an integer
  bitcast, and from ``_pack``'s float32 bitcast to the step's outputs."""
  walk = _words.word_readers(hlo)
  assert not walk.reads, "ops that read code words:\n" + "\n".join(map(str, walk.reads))
  # Four word inputs (mu and nu of two leaves), each read as integers; four word outputs.
  assert sum(s.count("codes") for s in walk.sources) == 4, walk.sources
  assert walk.to_integer and len(walk.outputs) == 4, walk


# (mode, offload, microbatches): the steps whose programs are walked, each for 8-bit AdamW and,
# under -m slow, 4-bit AdamW.
STEPS_WALKED = [("backward", None, None), ("forward", None, None), ("backward", "state", None),
                ("forward", "state", None), ("two_pass", None, None), ("backward", "params", None),
                ("backward", None, 2), ("forward", None, 2)]


def _walked(fast: int) -> list:
  """The walked steps, the first ``fast`` of 8-bit AdamW's unmarked, the others slow."""
  cases = [(optimizer, *step) for optimizer in ("adamw_8bit", "adamw_4bit")
           for step in STEPS_WALKED]
  return [pytest.param(*case, marks=() if k < fast else pytest.mark.slow)
          for k, case in enumerate(cases)]


@pytest.mark.parametrize("optimizer,mode,offload,microbatches", _walked(3))
def test_xla_cpus_compiled_step_only_moves_the_code_words(optimizer, mode, offload,
                                                          microbatches):
  assert_words_only_move(_compiled_text(optimizer, mode, offload, microbatches))


@pytest.mark.targets
@needs_tpu
@pytest.mark.parametrize("optimizer,mode,offload,microbatches", _walked(len(STEPS_WALKED)))
def test_the_tpu_compilers_step_only_moves_the_code_words(optimizer, mode, offload,
                                                          microbatches):
  assert_words_only_move(_compiled_text(optimizer, mode, offload, microbatches, "tpu-v5e"))


@pytest.mark.targets
@needs_gpu
@pytest.mark.parametrize("optimizer,mode,offload,microbatches", _walked(len(STEPS_WALKED)))
def test_the_gpu_compilers_step_only_moves_the_code_words(optimizer, mode, offload,
                                                          microbatches):
  assert_words_only_move(_compiled_text(optimizer, mode, offload, microbatches, "h100"))


@pytest.mark.targets
@pytest.mark.parametrize("target", [pytest.param("tpu-v5e", marks=needs_tpu),
                                    pytest.param("h100", marks=needs_gpu)])
def test_the_program_check_finds_an_add_on_the_words_in_the_target_compilers_step(
    monkeypatch, target):
  add_zero_to_state(monkeypatch, "new")
  walk = _words.word_readers(_compiled_text("adamw_8bit", "backward", target=target))
  assert "add" in {r.opcode for r in walk.reads}, walk.reads
