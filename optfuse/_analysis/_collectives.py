"""What a compiled step communicates: the collectives in its HLO text.

A sharded step's gathers and reductions are the compiler's, so they are read where it writes
them, in the compiled module's text. An instruction inside a loop body appears there once,
however many times the loop runs it: these count instructions, not executions.
"""

from __future__ import annotations

import collections
import re

_ALL_GATHER = re.compile(r"=\s*(.+?)\s+all-gather(?:-start)?\(")
_COLLECTIVE = re.compile(
    r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def all_gathers(hlo: str) -> list[str]:
  """The result types of the all-gathers in compiled HLO text, layouts dropped, sorted.

  A gather inside a loop body is one entry, however many times the loop runs it.

  Examples:
    >>> all_gathers("%g = f32[8,4]{1,0} all-gather(f32[1,4]{1,0} %p), dimensions={0}")
    ['f32[8,4]']
  """
  return sorted(re.sub(r"\{[^}]*\}", "", m.group(1)) for m in _ALL_GATHER.finditer(hlo))


def collective_counts(hlo: str) -> dict[str, int]:
  """How many of each collective compiled HLO text holds (one in a loop body counts once).

  Examples:
    >>> collective_counts("%a = f32[4] all-reduce(f32[4] %x)\\n"
    ...                   "%b = f32[4] all-reduce-start(f32[4] %y)")
    {'all-reduce': 2}
  """
  return dict(sorted(collections.Counter(_COLLECTIVE.findall(hlo)).items()))
