"""optfuse's tests, one folder per layer of the package, as a reader would look for them:

- ``jaxpr``: the interpreter, the row rules and their parameter rewrites, JAX versions' forms;
- ``plan``: which leaves' updates split per row, separability, per-matrix optimizers;
- ``fusion``: the fused loops on the forms real codebases write, accumulation, two-pass;
- ``engines``: each mode's step against optax, offload, the guard, Muon, sharded meshes;
- ``low_bit``: the low-bit state's quantisation and its fused steps;
- ``adapters``: the Linen and NNX adapters against Flax's own steps;
- ``analysis``: ``describe``, ``memory_report``, ``max_batch_size``, targets, slices;
- ``end_to_end``: the public API on real pytrees and losses, checkpoints, robustness, options,
  the fault-injection proofs of the equivalence criteria;
- ``project``: the package's structure, docs, docstrings, examples, notebook and benchmark.

Beside them: ``conftest.py``, the shared models (``models.py``), the equivalence criteria
(``criteria.py``), the injected faults (``faults.py``), the margin reports (``margins.py``,
``low_bit_margins.py``), the scripts the multi-device tests start (``_*_worker.py``) and their
environment (``_subprocess.py``).
"""
