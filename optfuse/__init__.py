"""optfuse: fuse the optax update into the backward (and forward) pass of a JAX training step."""

from optfuse._errors import LossOutputError as LossOutputError
from optfuse._errors import MicrobatchError as MicrobatchError
from optfuse._errors import NonSeparableError as NonSeparableError
from optfuse._errors import OptfuseError as OptfuseError
from optfuse._errors import ParamsStructureError as ParamsStructureError
from optfuse._errors import StateMismatchError as StateMismatchError
from optfuse._errors import UnknownModeError as UnknownModeError
from optfuse._describe import describe as describe
from optfuse._fuse import FusedTransformation as FusedTransformation
from optfuse._fuse import check_separable as check_separable
from optfuse._fuse import fuse as fuse

__version__ = "0.1.0"
