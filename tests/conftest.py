"""Test-wide settings.

The suite runs on the CPU. With the TPU compiler (libtpu) or the CUDA plugin installed for the
compile-target tests, JAX would otherwise probe for a TPU or a GPU when it starts and log its
failure; ``JAX_PLATFORMS=cpu`` (unless set already) keeps the default backend on the CPU, and the
targets' compile-only devices still come from their plugins (``optfuse._targets``).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu lets one process at a time hold it unless told that compile-only sharing is fine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
