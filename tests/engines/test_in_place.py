"""Every donated stacked param and state buffer is updated in place, on every compiler.

The memory floor of a fused step rests on the compiler writing each layer's new rows into the
donated stack it read them from. XLA may give that up: copy insertion adds a whole-buffer copy
where a while loop reads a value it also writes (openxla/xla#45912 dropped in-place updates of
donated buffers in such loops, from jaxlib 0.7.2), and a donated input left unaliased gets a new
output buffer. Neither changes a result, so no equivalence test sees it; both add a stacked
buffer to the peak.

For each step (backward, forward, streamed state and params, low-bit state, microbatches,
two-pass),
compiled for XLA:CPU, the TPU v5e compiler and the H100 compiler (compile-only), the optimized
module must:

- alias every stacked param and state parameter of its entry computation to an output
  (``input_output_alias`` in the module's header), and
- hold no ``copy`` or ``copy-start`` whose destination is a whole stacked buffer in the
  device's or the host's memory. A TPU's copies into and out of its on-chip memory (memory
  space 1, the ``S(1)`` of a layout) are the compiler's prefetches and evictions of a buffer it
  chose to keep there, not a second buffer in memory, and are not counted.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._analysis import _memory
from optfuse._targets import _registry
from tests import models

LAYERS, DIM, VOCAB = 6, 1024, 64  # no batch axis is 6 long: a 6-long leading axis is a stack
PARAMS = models.abstract_stacked_params(LAYERS, DIM, VOCAB)
SEQ = 8


def _batch(microbatches: int):
  tokens = jax.ShapeDtypeStruct((2 * microbatches, SEQ), jnp.int32)
  return tokens, tokens


CASES = {
    "backward": dict(mode="backward"),
    "forward": dict(mode="forward"),
    "backward, state streamed": dict(mode="backward", offload="state"),
    "backward, params streamed": dict(mode="backward", offload="params"),
    "forward, state streamed": dict(mode="forward", offload="state"),
    "backward, 8-bit state": dict(mode="backward", bits=8),
    "forward, 4-bit state": dict(mode="forward", bits=4),
    "backward, 2 microbatches": dict(mode="backward", microbatches=2),
    "forward, 2 microbatches": dict(mode="forward", microbatches=2),
    # Two passes whose second reads the first's statistics (LAMB's trust ratios), and whose
    # second reads none of them (SM3: its statistics are only its new state).
    "two-pass, LAMB": dict(mode="backward", global_ops="two_pass", tx=optax.lamb),
    "two-pass, SM3": dict(mode="backward", global_ops="two_pass", tx=optax.sm3, slots=1),
}

TARGETS = {
    "cpu": None,
    "tpu-v5e": pytest.param("tpu-v5e", marks=[pytest.mark.targets, pytest.mark.skipif(
        not _registry.compiler_installed("tpu"), reason="the TPU compiler is not installed")]),
    "h100": pytest.param("h100", marks=[pytest.mark.targets, pytest.mark.skipif(
        not _registry.compiler_installed("cuda"), reason="the GPU compiler is not installed")]),
}

_PARAMETER = re.compile(r"%(\S+) = (\w+)\[([\d,]*)\]\{[^}]*\} parameter\((\d+)\)")
_ALIAS = re.compile(r"\{[\d,\s]*\}: \((\d+), \{[\d,\s]*\}, (?:may|must)-alias\)")
# ``%x = f32[4,1024,1024]{2,1,0:T(8,128)S(5)} copy(...)``, or a ``copy-start`` whose tuple
# result opens with its destination.
_COPY = re.compile(r"= \(?(\w+)\[([\d,]*)\]\{([^}]*)\}[^=]*? copy(?:-start)?\(")


def _compiled_text(case: dict, target: str | None) -> str:
  case = dict(case)
  bits, microbatches = case.pop("bits", None), case.pop("microbatches", None)
  tx = case.pop("tx", optax.adam)(1e-3)
  case.pop("slots", None)
  if bits is not None:
    tx = optfuse.low_bit(tx, bits)
  fx = optfuse.fuse(tx, **case)
  resolved = None if target is None else _registry.resolve(target)
  step_options = {} if microbatches is None else {"microbatches": microbatches}
  traced = _memory.trace_step(fx, models.scanned_loss, PARAMS, _batch(microbatches or 1),
                              target=resolved, **step_options)
  with _memory.on_target(resolved):
    return traced.lower().compile().as_text()


def _entry(text: str) -> str:
  start = text.index("\nENTRY ")
  return text[start:text.index("\n}", start)]


def stacked_parameters(text: str) -> dict[int, str]:
  """The entry computation's stacked inputs (a param or state leaf whose leading axis is the
  layer axis: every such input is donated), by parameter number."""
  found = {}
  for name, _, dims, number in _PARAMETER.findall(_entry(text)):
    shape = tuple(int(d) for d in dims.split(",") if d)
    if len(shape) >= 2 and shape[0] == LAYERS:
      found[int(number)] = name
  return found


def aliased_parameters(text: str) -> set[int]:
  """The parameter numbers the module's ``input_output_alias`` writes an output into."""
  header = text.splitlines()[0]
  match = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*entry_computation_layout", header)
  return set() if match is None else {int(n) for n in _ALIAS.findall(match.group(1))}


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) (\S+)\((.*)$")


def whole_stack_copies(text: str, stacked_shapes: set[tuple[int, ...]]) -> list[str]:
  """The copies in the module whose destination is a whole stacked buffer, neither end of them
  in a TPU's on-chip memory (memory space 1)."""
  results = {m.group(1): m.group(2) for m in map(_INSTRUCTION.match, text.splitlines()) if m}
  found = []
  for line in text.splitlines():
    match = _COPY.search(line)
    if match is None:
      continue
    shape = tuple(int(d) for d in match.group(2).split(",") if d)
    operand = re.search(r" copy(?:-start)?\(%([^),\s]+)", line).group(1)
    ends = line.split(" copy")[0] + results.get(operand, "")
    if shape in stacked_shapes and "S(1)" not in ends:
      found.append(line.strip())
  return found


# Where a compiler copies stacks today: each entry fails the check (``strict``), so a change
# that removes the copy shows here.
KNOWN_COPIES = {
    ("forward", "h100"): "the GPU compiler copies the stacks a forward step updates whole before "
                         "its loop (the biases and their two slots, (L, d) each), out of the "
                         "select of the pending update (_backends.PENDING_SELECT)",
    ("forward, state streamed", "cpu"): "XLA:CPU fuses the new bias row into the layer's "
                                        "fusion, which reads the old stack after the row's "
                                        "write, and copies the (L, d) stack every iteration",
    ("forward, 4-bit state", "cpu"): "as with the state streamed: the (L, d) bias stack is "
                                     "copied every iteration of the forward loop",
}


def _combinations():
  for case_id, case in CASES.items():
    for target_id, target in TARGETS.items():
      reason = KNOWN_COPIES.get((case_id, target_id))
      marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
      if not isinstance(target, str) and target is not None:  # a ``pytest.param``
        marks, target = [*marks, *target.marks], target.values[0]
      yield pytest.param(case, target, marks=marks, id=f"{case_id}-{target_id}")


@pytest.mark.parametrize("case,target", list(_combinations()))
def test_every_donated_stacked_buffer_is_updated_in_place(case, target):
  text = _compiled_text(case, target)
  stacked = stacked_parameters(text)
  # w and b, and at least their slots shaped like them (two each, SM3's one)
  assert len(stacked) >= 2 * (1 + case.get("slots", 2))
  not_aliased = sorted(name for number, name in stacked.items()
                       if number not in aliased_parameters(text))
  assert not not_aliased, f"donated stacked buffers given a new output buffer: {not_aliased}"
  shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(PARAMS["layers"])}
  assert not whole_stack_copies(text, shapes)


def test_the_reader_finds_an_unaliased_stack_and_a_whole_stack_copy():
  # Without donation the compiler aliases nothing, and a copy of a donated stack (an update
  # that reads the old stack after writing the new one) holds a whole one: the checks above
  # must see both.
  w = jax.ShapeDtypeStruct((LAYERS, DIM, DIM), jnp.float32)

  def step(params, state):
    new = params.at[0].set(state[0])
    return new, new + params  # the old stack is read after the new one is written

  text = jax.jit(step, donate_argnums=(0,)).lower(w, w).compile().as_text()
  assert 0 not in aliased_parameters(jax.jit(step).lower(w, w).compile().as_text())
  assert whole_stack_copies(text, {tuple(w.shape)})
