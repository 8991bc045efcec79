"""optfuse: fuse the optax update into the backward (and forward) pass of a JAX training step.

The core (``fuse``, ``describe``, ``memory_report``, ``max_batch_size``...) depends on jax and
optax only. The Flax adapters ``optfuse.linen`` and ``optfuse.nnx`` are imported on first use.
"""

import importlib

from optfuse._analysis._auto import OffloadPlan as OffloadPlan
from optfuse._analysis._auto import place as place
from optfuse._analysis._auto import plan_offload as plan_offload
from optfuse._analysis._describe import describe as describe
from optfuse._analysis._fit import FitReport as FitReport
from optfuse._analysis._fit import max_batch_size as max_batch_size
from optfuse._analysis._fsdp import fsdp_axis as fsdp_axis
from optfuse._analysis._params_memory import params_to_device as params_to_device
from optfuse._analysis._params_memory import params_to_host as params_to_host
from optfuse._analysis._params_memory import streamed as streamed
from optfuse._analysis._report import MemoryReport as MemoryReport
from optfuse._analysis._report import memory_report as memory_report
from optfuse._analysis._slices import SliceFit as SliceFit
from optfuse._analysis._slices import SliceReport as SliceReport
from optfuse._analysis._slices import smallest_slices as smallest_slices
from optfuse._base._errors import BudgetError as BudgetError
from optfuse._base._errors import GuardError as GuardError
from optfuse._base._errors import LayerAxesError as LayerAxesError
from optfuse._base._errors import LossOutputError as LossOutputError
from optfuse._base._errors import LowBitError as LowBitError
from optfuse._base._errors import MicrobatchError as MicrobatchError
from optfuse._base._errors import MuonDimsError as MuonDimsError
from optfuse._base._errors import NonSeparableError as NonSeparableError
from optfuse._base._errors import OffloadError as OffloadError
from optfuse._base._errors import OptfuseError as OptfuseError
from optfuse._base._errors import OptionsError as OptionsError
from optfuse._base._errors import ParamsStructureError as ParamsStructureError
from optfuse._base._errors import StateMismatchError as StateMismatchError
from optfuse._base._errors import TargetError as TargetError
from optfuse._base._errors import TracingError as TracingError
from optfuse._base._errors import UnknownModeError as UnknownModeError
from optfuse._base._options import FuseOptions as FuseOptions
from optfuse._engines._forward_state import ForwardState as ForwardState
from optfuse._engines._forward_state import from_optax_state as from_optax_state
from optfuse._engines._forward_state import to_optax_state as to_optax_state
from optfuse._fuse import FusedTransformation as FusedTransformation
from optfuse._fuse import check_separable as check_separable
from optfuse._fuse import fuse as fuse
from optfuse._low_bit._transform import QuantizedSlot as QuantizedSlot
from optfuse._low_bit._transform import low_bit as low_bit
from optfuse._optimizers._muon_dims import stacked_muon_dims as stacked_muon_dims
from optfuse._optimizers._per_layer import PerLayerState as PerLayerState
from optfuse._optimizers._per_layer import per_layer as per_layer
from optfuse._targets._backends import compiling_for as compiling_for
from optfuse._targets._compiled import DoesNotFit as DoesNotFit
from optfuse._targets._registry import target_mesh as target_mesh
from optfuse._targets._registry import targets as targets
from optfuse._train_step import train_step as train_step

# The names ``from optfuse import *`` binds: every name re-exported above (docs/api.md
# documents each; tests/project/test_api.py checks both). The Flax adapters are left out:
# they import Flax, which the core does not need, on first use.
__all__ = [
    "OffloadPlan", "place", "plan_offload", "describe", "FitReport", "max_batch_size",
    "params_to_device", "params_to_host", "streamed", "MemoryReport", "memory_report", "SliceFit",
    "SliceReport", "fsdp_axis", "smallest_slices", "BudgetError", "GuardError", "LossOutputError",
    "LayerAxesError", "LowBitError", "MicrobatchError", "MuonDimsError", "NonSeparableError",
    "OffloadError", "OptfuseError", "OptionsError", "ParamsStructureError", "StateMismatchError",
    "TargetError", "TracingError", "UnknownModeError", "FuseOptions", "ForwardState",
    "from_optax_state", "to_optax_state", "FusedTransformation", "check_separable", "fuse",
    "QuantizedSlot", "low_bit", "PerLayerState", "per_layer", "stacked_muon_dims", "compiling_for",
    "DoesNotFit", "target_mesh", "targets", "train_step",
]

__version__ = "0.1.0"

_ADAPTERS = ("linen", "nnx")


def __getattr__(name: str):
  if name in _ADAPTERS:
    return importlib.import_module(f"optfuse.{name}")
  raise AttributeError(f"module 'optfuse' has no attribute {name!r}")
