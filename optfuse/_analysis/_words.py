"""Where a compiled program touches low-bit code words: every op that reads a float32 word of
packed codes (``optfuse.low_bit``'s ``QuantizedSlot.codes``) with anything but a move.

The words cross the fused steps' ``custom_vjp`` boundaries as float32 cotangents
(``_low_bit._blocks``), and a word's bytes may read as a denormal or a NaN: an add (a
cotangent sum), a multiply, a float ``convert`` or a ``compare`` on one may change its bits (a
TPU flushes denormals; XLA:CPU flushes them and quiets signalling NaNs). ``word_readers``
follows, through the optimized HLO, every value that holds words (the step's word inputs,
named by their argument path, and each bitcast of integers to float32, the new words
``_blocks._pack`` makes) through tuples, loops, branches, calls and fusions, until it is
bitcast to an integer type or leaves the program, and lists every op that reads one on the way.

The walk errs towards listing: an op it does not know as a move is a read (a ``reduce``, a
``scatter``, a ``sort``, a custom call other than a placement); a computation called from
several places passes words out to every caller; a loop's result holds what its initial state
held (no iteration may run). It does not judge ``select`` predicates: a select is a move, and
the ones that may put a non-word in place of words are listed apart. A word input is found by
its argument path (the entry parameter's ``op_name``, which JAX sets), so a program lowered
from other arguments needs its own ``is_words``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from optfuse._analysis import _hlo

# Ops whose result holds an operand's bits unchanged, moved (the data operands: ``select``'s
# predicate, a slice's indices are never words). A ``select`` picks one operand's bits on every
# backend (no float arithmetic); one that may pick a non-word in place of words is a move too,
# and listed apart (``WordWalk.mixed_selects``): dropping words is a wrong value, for the run
# checks to catch, not arithmetic.
MOVES = frozenset({
    "copy", "bitcast", "reshape", "transpose", "broadcast", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "reverse", "gather", "all-gather",
    "all-to-all", "collective-permute", "optimization-barrier", "domain", "select"})
# Ops that read an operand's bits as another type: to integers, the words are codes again. (The
# GPU and TPU compilers turn a ``bitcast-convert`` of a layout they keep into a ``bitcast``.)
REINTERPRETS = frozenset({"bitcast-convert", "bitcast"})
# Custom calls that only place a value (host offload's annotations).
PLACEMENTS = frozenset({"MoveToHost", "MoveToDevice", "annotate_device_placement",
                        "AllocateBuffer", "Sharding", "SPMDFullToShardShape",
                        "SPMDShardToFullShape"})
# Ops that call computations whose parameters are their operands and whose root is their result.
CALLS = frozenset({"fusion", "call"})
# Asynchronous ops (the TPU compiler's, for host memory): ``start`` returns ``((operands...),
# result, context)``, its ``done`` the result; a ``copy-start`` returns ``(result, operand,
# context)``.
ASYNC_STARTS = frozenset({"fusion-start", "async-start", "dynamic-slice-start",
                          "dynamic-update-slice-start"})
ASYNC_DONES = frozenset({"fusion-done", "async-done", "dynamic-slice-done",
                         "dynamic-update-slice-done"})
_INTEGER = ("s", "u")


class WordRead(NamedTuple):
  """An op that reads a word otherwise than by moving it.

  Attributes:
    computation: the computation it is in.
    name: the instruction's name.
    opcode: its opcode.
    operand: which of its operands is a word.
    op_name: the JAX operation it came from (its metadata), to find it in the program.
  """

  computation: str
  name: str
  opcode: str
  operand: int
  op_name: str


class WordWalk(NamedTuple):
  """What ``word_readers`` found.

  Attributes:
    sources: the values it started from: ``computation/instruction`` of each word input and
      each bitcast of integers to float32 (``bitcast-convert``, or ``bitcast``).
    to_integer: the bitcasts that turn words into integers.
    outputs: the entry's results that hold words (tuple paths of its root).
    reads: the ops that read words otherwise than by moving them: the compiled program breaks
      the no-arithmetic rule where this is not empty.
    mixed_selects: the ``select`` instructions whose other data operand holds no words (an
      ordering device such as ``_row_buffers.value_after``'s ``where(true, words, 0)``).
  """

  sources: list[str]
  to_integer: list[str]
  outputs: list[tuple[int, ...]]
  reads: list[WordRead]
  mixed_selects: list[str]


def is_code_words(path: str) -> bool:
  """Whether an entry argument's path names a ``QuantizedSlot``'s codes."""
  return path.endswith(".codes")


def _is_integer(leaf_type) -> bool:
  return isinstance(leaf_type, str) and _hlo.dtype(leaf_type).startswith(_INTEGER)


def _is_float(leaf_type) -> bool:
  return isinstance(leaf_type, str) and _hlo.dtype(leaf_type).startswith(("f", "bf"))


class _Walk:
  """The worklist over ``(computation, instruction, tuple path)`` values that hold words."""

  def __init__(self, hlo: str):
    self.computations, self.entry = _hlo.computations(hlo)
    self.by_name = {c: {i.name: i for i in body} for c, body in self.computations.items()}
    self.users: dict[tuple[str, str], list[tuple[_hlo.Instruction, int]]] = {}
    for c, body in self.computations.items():
      for i in body:
        for k, operand in enumerate(i.operands):
          self.users.setdefault((c, operand), []).append((i, k))
    self.seen: set[tuple[str, str, tuple[int, ...]]] = set()
    self.todo: list[tuple[str, str, tuple[int, ...]]] = []
    self.to_integer: set[str] = set()
    self.outputs: set[tuple[int, ...]] = set()
    self.reads: list[WordRead] = []

  def holds(self, computation: str, name: str, path: tuple[int, ...]) -> None:
    key = (computation, name, path)
    if key not in self.seen:
      self.seen.add(key)
      self.todo.append(key)

  def parameter(self, computation: str, number: int) -> str | None:
    return next((i.name for i in self.computations[computation]
                 if i.opcode == "parameter" and i.number == number), None)

  def into(self, computation: str, number: int, path: tuple[int, ...]) -> None:
    """The value enters ``computation`` as its parameter ``number``."""
    name = self.parameter(computation, number)
    if name is not None:
      self.holds(computation, name, path)

  def run(self) -> None:
    while self.todo:
      computation, name, path = self.todo.pop()
      instruction = self.by_name[computation][name]
      if instruction.root:
        self.leave(computation, path)
      for user, k in self.users.get((computation, name), []):
        self.use(computation, user, k, path)

  def leave(self, computation: str, path: tuple[int, ...]) -> None:
    """A root holds words at ``path``: they leave its computation to whoever called it."""
    if computation == self.entry:
      self.outputs.add(path)
      return
    for c, body in self.computations.items():
      for i in body:
        callees = i.callees()
        if computation not in callees:
          continue
        if i.opcode == "while" and computation == i.callee("body"):
          self.holds(c, i.name, path)
          self.into(computation, 0, path)  # the next iteration's state
        elif i.opcode in CALLS or i.opcode == "conditional":
          self.holds(c, i.name, path)
        elif i.opcode in ASYNC_STARTS:
          self.holds(c, i.name, (1, *path))

  def use(self, computation: str, user: _hlo.Instruction, k: int,
          path: tuple[int, ...]) -> None:
    """Operand ``k`` of ``user`` holds words at ``path``."""
    op = user.opcode
    if op == "get-tuple-element":
      if path and path[0] == user.index():
        self.holds(computation, user.name, path[1:])
    elif op == "tuple":
      self.holds(computation, user.name, (k, *path))
    elif op == "while":
      for callee in user.callees():
        self.into(callee, 0, path)
      self.holds(computation, user.name, path)  # no iteration runs
    elif op == "conditional":
      if k > 0:
        self.into(user.callees()[k - 1], 0, path)
      else:
        self.read(computation, user, k)
    elif op in CALLS:
      for callee in user.callees():
        self.into(callee, k, path)
    elif op in ("fusion-start", "async-start"):
      self.holds(computation, user.name, (0, k, *path))
      for callee in user.callees():
        self.into(callee, k, path)
    elif op in ("dynamic-slice-start", "dynamic-update-slice-start"):
      self.holds(computation, user.name, (0, k, *path))
      if self.moves(user, k):
        self.holds(computation, user.name, (1, *path))
    elif op == "copy-start":
      self.holds(computation, user.name, (0, *path))
      self.holds(computation, user.name, (1, *path))
    elif op == "copy-done" or op in ASYNC_DONES:
      if path and path[0] == (0 if op == "copy-done" else 1):
        self.holds(computation, user.name, path[1:])
    elif op in REINTERPRETS and _is_integer(user.type):
      self.to_integer.add(f"{computation}/{user.name}")
    elif op == "bitcast-convert" or op in MOVES and self.moves(user, k):
      self.holds(computation, user.name, path)
    elif op == "custom-call" and _custom_call_target(user) in PLACEMENTS:
      self.holds(computation, user.name, path)
    else:
      self.read(computation, user, k)

  @staticmethod
  def moves(user: _hlo.Instruction, k: int) -> bool:
    """Whether operand ``k`` of a move is data (a slice's start index is not)."""
    if user.opcode in ("dynamic-slice", "dynamic-slice-start"):
      return k == 0
    if user.opcode in ("dynamic-update-slice", "dynamic-update-slice-start"):
      return k in (0, 1)
    if user.opcode in ("pad", "gather"):
      return k == 0
    if user.opcode == "select":
      return k > 0
    return True

  def mixed_selects(self) -> list[str]:
    holding = {(c, name) for c, name, path in self.seen if not path}
    return sorted(f"{c}/{i.name}" for c, body in self.computations.items() for i in body
                  if i.opcode == "select" and (c, i.name) in holding
                  and not all((c, x) in holding for x in i.operands[1:]))

  def read(self, computation: str, user: _hlo.Instruction, k: int) -> None:
    self.reads.append(WordRead(computation, user.name, user.opcode, k, user.op_name()))


def _custom_call_target(instruction: _hlo.Instruction) -> str:
  for attribute in instruction.attributes.split(", "):
    if attribute.strip().startswith("custom_call_target="):
      return attribute.split("=", 1)[1].strip().strip('"')
  return ""


def word_readers(hlo: str, is_words: Callable[[str], bool] = is_code_words) -> WordWalk:
  """Every op of a compiled program that reads a low-bit code word otherwise than by moving it.

  Args:
    hlo: the optimized HLO text (``jax.stages.Compiled.as_text()``).
    is_words: ``is_words(path)`` of an entry parameter's argument path (its metadata's
      ``op_name``, ``state[0].mu['w'].codes``): whether it holds words.

  Returns:
    A ``WordWalk``: where the words came from, where they became integers or left, and the ops
    that read them otherwise (``reads``: empty where no arithmetic touches a word).
  """
  walk = _Walk(hlo)
  sources = []
  for i in walk.computations[walk.entry]:
    if i.opcode == "parameter" and is_words(i.op_name() or i.name):
      sources.append(f"{walk.entry}/{i.name}")
      walk.holds(walk.entry, i.name, ())
  for c, body in walk.computations.items():
    types = {i.name: i.type for i in body}
    for i in body:
      if (i.opcode in REINTERPRETS and _is_float(i.type)
          and _is_integer(types.get(i.operands[0]))):
        sources.append(f"{c}/{i.name}")
        walk.holds(c, i.name, ())
  walk.run()
  return WordWalk(sources, sorted(walk.to_integer), sorted(walk.outputs), walk.reads,
                  walk.mixed_selects())
