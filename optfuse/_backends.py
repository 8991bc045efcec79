"""Choices that depend on the compiler: one table per choice, keyed by platform.

Each entry says what was measured on that platform's compiler to choose it. A step picks its
entry with ``for_platform`` while it is traced, for the platform it will be lowered for: this
machine's backend, or the target's inside ``lowering_for`` (``optfuse.memory_report`` and
``max_batch_size`` compile for a TPU or GPU target from this CPU in it). The step is traced
once: ``lax.platform_dependent`` would stage every platform's alternative and trace the step
once per alternative (measured, forward fusion of a small scanned decoder: 1.2-1.3x optax's
compile time against 1.0x). A program lowered for another platform by other means than
``lowering_for`` gets this machine's choices: the same math, the other compiler's memory.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

# The target a step is being traced for, when it is not this machine's backend. Set only by
# ``lowering_for``; read at trace time by ``for_platform`` and the memory guard.
_TARGET: contextvars.ContextVar[Any] = contextvars.ContextVar("optfuse_target", default=None)

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

# Whether forward fusion chooses between the pending update and the unchanged params and state
# with a select per leaf (``jnp.where(has_pending, new, old)``: the update always computed, its
# result kept only when a gradient is pending) rather than one ``lax.cond``. The GPU compiler
# copies every leaf a conditional updates whole (the embedding and its moments: three 62.5 MiB
# copies for the bench's forms) and updates them in place under a select; XLA:CPU does the
# opposite. Measured, forward peaks, cond -> select (optax in brackets):
# - H100 compiler: the 1.3B decoder (24 layers) 22.99 -> 21.97 GB (21.97), forms of 16 layers of
#   d=512 linen_axis1 1.87 -> 1.67 GB (1.61), no_remat 5.16 -> 4.96 GB (4.73); with
#   clip_by_global_norm + AdamW the 1.3B decoder 21.97 GB either way;
# - XLA:CPU: linen_axis1 1.68 -> 1.89 GB, no_remat 4.98 -> 5.19 GB;
# - TPU v5e compiler: the same peaks either way (within 0.2 MB: linen_axis1 1474 MB, bf16_policy
#   1572 MB, no_remat 4485 MB, the 1.3B decoder at 12 layers 13.31 GB, with clipping too).
# With the state in host memory (``offload="state"``) the conditional stays on every platform:
# there the select raised the H100 peaks of forward fusion (1.3B 7.45 -> 7.53 GB, 6.6B 31.05 ->
# 31.91 GB).
PENDING_SELECT = {"tpu": False, "cuda": True, "rocm": True, "cpu": False}

# Whether a fused scan's forward loop carries the param stacks it reads (each row written back
# behind an ``optimization_barrier``) instead of reading them as loop invariants. The TPU
# compiler hoists a loop-invariant cast out of the loop: ``convert`` of the whole float32 stack
# to bfloat16 (and, after ``moveaxis``, a transposed copy) before the forward loop, where a
# carried stack is cast row by row. Measured, TPU v5e, backward peaks of the bench's forms (16
# layers of d=512; optax 1371 / 1363 / 1413 / 4542 MB): linen_axis1 1625 -> 1290 MB, moveaxis
# 1591 -> 1289 MB, bf16_policy 1451 -> 1350 MB, no_remat 4144 -> 4095 MB; the 1.3B decoder at 12
# layers 9.99 -> 9.83 GB; but jax.checkpoint around the whole stack 4077 -> 4156 MB, so a scan
# inside a checkpoint keeps its invariant reads. XLA:CPU and H100: the same peaks either way
# (linen_axis1 1478 / 1404 MB, no_remat 4773 / 4712 MB).
CARRIED_STACKS = {"tpu": True, "cuda": False, "rocm": False, "cpu": False}

# Whether the row loops pin each param stack they write to the row-major layout the step's
# arguments have (``jax.experimental.layout.with_layout_constraint``). The TPU compiler tiles
# the two minor dimensions, so it lays out a loop-carried stack whose rows it slices with the
# layer axis major (``{2,0,1}`` for ``f32[512,16,2048]``, the layer axis second): a transposed
# copy of the whole stack before the loops and back after them, 64 MiB for one such weight of
# the bench's forms (``XLA_FLAGS=--xla_dump_to=DIR``, ``*buffer-assignment.txt``). Pinned, the
# rows are read and written in the stored layout. Measured, TPU v5e, peaks of the bench's forms
# (16 layers of d=512, AdamW), unpinned -> pinned: backward linen_axis1 1290 -> 1271 MB,
# moveaxis 1289 -> 1271 MB, bf16_policy 1350 -> 1301 MB (optax 1371 / 1363 / 1413 MB); forward
# linen_axis1 1742 -> 1474 MB; outer_remat, no_remat and the 1.3B decoder (12 layers) unchanged;
# the replicas (vocab 4096, T=256, B=2) linen_axis1 801 -> 642 MB, moveaxis 816 -> 642 MB
# (optax 886 / 903 MB). A toy size whose temporaries all fit in the TPU's vector memory (8 layers
# of d=256) loses 3.6 MB (89 -> 93 MB, optax 89 MB). H100: the same peaks either way. Pinning
# the slot stacks too made the compiler copy a whole slot stack, in its layer-major layout, for
# each row it reads (the same peak, a stack copy per iteration): only param stacks are pinned.
STORED_LAYOUTS = {"tpu": True, "cuda": False, "rocm": False, "cpu": False}


@contextlib.contextmanager
def lowering_for(target: Any) -> Iterator[None]:
  """Steps traced inside are traced for the resolved ``target`` (``_targets.Target``; ``None``:
  this machine's backend): its platform's choices, and what a step compiles on its own (the
  memory guard) it compiles for that target."""
  token = _TARGET.set(target)
  try:
    yield
  finally:
    _TARGET.reset(token)


def target() -> Any:
  """The resolved target steps are traced for now, or ``None`` (this machine's default
  device)."""
  return _TARGET.get()


def platform() -> str:
  """The platform steps are traced for now ("cpu", "tpu", "cuda"; JAX's "gpu" is "cuda")."""
  current = _TARGET.get()
  name = current.platform if current is not None else jax.default_backend()
  return "cuda" if name == "gpu" else name


def for_platform(table: dict[str, Any]) -> Any:
  """``table``'s entry for ``platform()``, the CPU's for a platform not in it.

  Args:
    table: platform name -> the value of the choice there ("cpu", "tpu", "cuda", "rocm").

  Returns:
    The value of the choice for the platform steps are traced for now.
  """
  return table.get(platform(), table["cpu"])
