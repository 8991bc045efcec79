"""Optimized HLO text (``jax.stages.Compiled.as_text()``) read as computations of instructions.

An instruction line ``[ROOT] %name = type opcode(operands), attributes`` becomes an
``Instruction`` with its operands' names, the computations it calls and its result's types (a
tuple type nested as tuples of leaf types), so that a walk can follow a value through tuples,
loops, branches and fusions. The text's other sections (``FileNames``, ``StackFrames``...) are
skipped.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_NAME = re.compile(r"%?([\w.\-]+)")
_CALLEE = re.compile(r"\b(?:calls|body|condition|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_INDEX = re.compile(r"\bindex=(\d+)")
_OP_NAME = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')
_COMMENT = re.compile(r"/\*.*?\*/")
_DTYPE = re.compile(r"^([a-z]+\d*(?:[a-z]\d*[a-z]*)*)\[")


class Instruction(NamedTuple):
  """One HLO instruction.

  Attributes:
    name: its name, without ``%``.
    type: its result type: a leaf type string (``f32[4,128]{1,0}``) or a tuple of them.
    opcode: ``add``, ``fusion``, ``get-tuple-element``...
    operands: the names of its operands, in order.
    attributes: the text after its operand list.
    root: whether it is its computation's ``ROOT``.
    literal: a ``parameter``'s number or a ``constant``'s value, as written (else empty).
  """

  name: str
  type: str | tuple
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  root: bool
  literal: str = ""

  @property
  def number(self) -> int | None:
    """A ``parameter``'s number."""
    return int(self.literal) if self.opcode == "parameter" else None

  def callees(self) -> tuple[str, ...]:
    """The computations it calls (a fusion's, a loop's body and condition, the branches...)."""
    found = _CALLEE.findall(self.attributes)
    for branches in _BRANCHES.findall(self.attributes):
      found += [_NAME.match(b.strip()).group(1) for b in branches.split(",") if b.strip()]
    return tuple(found)

  def callee(self, role: str) -> str | None:
    """The computation it calls as ``role``: ``body``, ``condition``, ``calls``..."""
    found = re.search(rf"\b{role}=%?([\w.\-]+)", self.attributes)
    return found.group(1) if found else None

  def index(self) -> int | None:
    """A ``get-tuple-element``'s index."""
    found = _INDEX.search(self.attributes)
    return int(found.group(1)) if found else None

  def op_name(self) -> str:
    """Its metadata's ``op_name``: for an entry parameter, the argument's path."""
    found = _OP_NAME.search(self.attributes)
    return found.group(1).replace("\\'", "'") if found else ""


def dtype(leaf_type: str) -> str:
  """The element type of a leaf type string: ``f32``, ``u32``, ``pred``..."""
  found = _DTYPE.match(leaf_type)
  return found.group(1) if found else leaf_type


def leaf_types(type_: str | tuple) -> list[str]:
  """The leaf type strings of a result type, in order (a tuple's nested ones flattened)."""
  if isinstance(type_, str):
    return [type_]
  return [leaf for t in type_ for leaf in leaf_types(t)]


def _split_top(text: str, sep: str = ",") -> list[str]:
  """``text`` split at the ``sep`` characters outside brackets, parentheses and braces."""
  parts, depth, start = [], 0, 0
  for k, c in enumerate(text):
    depth += (c in "([{") - (c in ")]}")
    if c == sep and depth == 0:
      parts.append(text[start:k])
      start = k + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _closing(text: str, start: int) -> int:
  """The index of the bracket closing the one at ``start``."""
  depth = 0
  for k in range(start, len(text)):
    depth += (text[k] in "([{") - (text[k] in ")]}")
    if depth == 0:
      return k
  raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def parse_type(text: str) -> str | tuple:
  """A result type: a leaf type string, or a (nested) tuple of them."""
  text = text.strip()
  if text.startswith("("):
    return tuple(parse_type(part) for part in _split_top(text[1:-1]))
  return text


def parse_instruction(line: str) -> Instruction | None:
  """One instruction line, or ``None`` for a line that is not one."""
  line = line.strip()
  root = line.startswith("ROOT ")
  line = line[5:] if root else line
  name, eq, rest = line.partition(" = ")
  if not eq or " " in name:
    return None
  if rest.startswith("("):
    end = _closing(rest, 0)
    type_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    type_text, _, rest = rest.partition(" ")
  opcode, paren, rest = rest.partition("(")
  if not paren:
    return None
  end = _closing("(" + rest, 0) - 1
  operands_text, attributes = rest[:end], rest[end + 1:]
  literal = operands_text if opcode in ("parameter", "constant") else ""
  if opcode in ("parameter", "constant"):
    operands: tuple[str, ...] = ()
  else:
    # An operand may be printed with its type before it (``f32[4] %x``): its name is the last
    # word.
    operands = tuple(_NAME.fullmatch(part.split()[-1]).group(1)
                     for part in _split_top(_COMMENT.sub("", operands_text)))
  return Instruction(name.lstrip("%"), parse_type(type_text), opcode, operands,
                     attributes, root, literal)


def computations(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
  """Computation name -> its instructions, and the entry computation's name."""
  found: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in hlo.splitlines():
    if not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
      head = line.split()
      is_entry = head[0] == "ENTRY"
      current = (head[1] if is_entry else head[0]).lstrip("%")
      found[current] = []
      entry = current if is_entry else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      instruction = parse_instruction(line)
      if instruction is not None:
        found[current].append(instruction)
  return found, entry
