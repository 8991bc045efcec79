"""Choices that depend on the compiler: one table per choice, keyed by platform.

Each entry says what was measured on that platform's compiler to choose it. A step picks its
entry with ``per_platform``, which stages every alternative out and lets JAX keep the one of the
platform it lowers for (``lax.platform_dependent``): a step compiled for a TPU or a GPU target
from this CPU gets the TPU's or the GPU's choice, not this machine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax

# Whether a row loop whose optimizer-state slots live in host memory (``offload="state"``)
# prefetches the next iteration's slot rows (the transfer overlaps the next layer's pullback,
# one row per slot more in flight) rather than reading them once the gradient row exists.
# Measured, backward fusion with offload of the 1.3B scanned decoder (24 layers, d=2048, T=2048),
# AdamW, compile-only peaks:
# - TPU v5e compiler, batch 7: prefetched 16.01 GB, read after the gradient row 17.33 GB;
# - H100 compiler, batch 34: prefetched 71.04 GB, read after the gradient row 60.69 GB (without
#   offload: 61.29 GB); batch 1: 7.79 GB and 7.39 GB;
# - XLA:CPU counts host memory as device memory: prefetched, as on several devices.
STREAMED_PREFETCH = {"tpu": True, "cuda": False, "rocm": False, "cpu": True}

# Whether forward fusion updates every stacked leaf row by row (in the forward loop, or in a row
# loop before the loss), or the ones whose whole update runs in place (AdamW...) whole, in the
# pending update's conditional. Measured, forward fusion of the 1.3B scanned decoder, compile-
# only peaks (rows against whole):
# - H100 compiler, 24 layers: AdamW 22.99 GB against 35.78 GB, clip_by_global_norm + AdamW
#   21.97 GB against 40.61 GB (optax: 21.97 GB): the GPU compiler copies the whole params and
#   state around the conditional;
# - TPU v5e compiler, 12 layers: 13.31 GB against 13.48 GB;
# - XLA:CPU, 24 layers: 22.38 GB either way, and whole is faster there (the 184M GPT: 0.79x
#   optax's step time whole, 0.82x row by row).
FORWARD_STACKED_ROWS = {"tpu": True, "cuda": True, "rocm": True, "cpu": False}


def per_platform(table: dict[str, Any], choose: Callable[[Any], Callable[..., Any]],
                 *args: Any) -> Any:
  """``choose(table[platform])(*args)`` for the platform the step is lowered for.

  Args:
    table: platform name -> the value of the choice there ("cpu", "tpu", "cuda", "rocm").
    choose: from a value of ``table`` to the function that runs with it.
    *args: the functions' array arguments (pytrees), if any; anything else is closed over.

  Returns:
    What the chosen function returns (every function must return the same types).
  """
  values = dict.fromkeys(table.values())
  if len(values) == 1:
    return choose(next(iter(values)))(*args)
  return lax.platform_dependent(*args, **{p: choose(v) for p, v in table.items()},
                                default=choose(table["cpu"]))
