"""The memory floor of a training step: the least peak a fused step could reach.

The floor is an estimate from optax's compiled memory: its peak, minus the whole gradient, plus
the gradient bytes that must be live at once even when every update is fused at the earliest
point (one layer's slice of the stacked leaves plus the leaves outside the loop for a scanned
model, the largest leaf for an unrolled one, the whole accumulator for gradient accumulation),
and never less than the step's inputs plus outputs. It assumes optax holds the whole gradient
at its peak: true when the backward pass is a scan (the stacked gradient is the scan's output),
optimistic for unrolled models, where XLA already frees gradient buffers early and optax's peak
can be below optax-minus-gradient plus the live part, and on compilers that write the stacked
gradient into buffers dead by optax's peak (the TPU compiler's, for the bfloat16 forms: the
docs' benchmarks page).
"""

from __future__ import annotations

from collections.abc import Mapping


def floor_bytes(off_memory: Mapping[str, int], grad_bytes: int, live_grad_bytes: int) -> int:
  """The estimated memory floor (see the module docstring).

  Args:
    off_memory: optax's compiled memory (``peak_bytes``, ``argument_bytes``, ``output_bytes``,
      ``alias_bytes``, as ``_targets._compiled.compiled_memory`` reads them).
    grad_bytes: the bytes of the whole gradient.
    live_grad_bytes: the gradient bytes a fused step must still hold at once.

  Returns:
    The floor in bytes.

  Examples:
    >>> off = {"peak_bytes": 10_000, "argument_bytes": 100, "output_bytes": 100,
    ...        "alias_bytes": 100}
    >>> floor_bytes(off, grad_bytes=4_000, live_grad_bytes=1_000)
    7000
  """
  persistent = (off_memory["argument_bytes"] + off_memory["output_bytes"]
                - off_memory["alias_bytes"])
  return max(persistent, off_memory["peak_bytes"] - grad_bytes + live_grad_bytes)
