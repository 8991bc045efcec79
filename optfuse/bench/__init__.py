"""``python -m optfuse.bench``: step time, compile time and compiled memory, fused vs optax.

Run ``python -m optfuse.bench --quick`` (about 90 CPU-seconds, most of it XLA compiling), or
without ``--quick`` for the full suite (larger models, every optimizer on every model, the
184M-parameter scanned GPT; meant for a GPU or TPU). ``--out DIR`` writes ``results.json``,
``results.md`` and ``results.png``. The same command runs on CPU, GPU and TPU: JAX picks the
backend. ``--fit BUDGET`` (e.g. ``--fit 24GB``) prints the largest batch per mode whose compiled
step fits the budget, for the big scanned decoders (compile-only, seconds per compile on CPU).

Modules: ``_models`` (the models in plain JAX), ``_timing`` (compiling and interleaved timing),
``_forms`` (scanned decoders as codebases write them), ``_suite`` (the suites, the measuring loop,
the compile-only memory section and the memory floor), ``_fit_table`` (the ``--fit`` search),
``_what_fits`` (the largest decoder per target, and with offload beside each machine's host
memory), ``_hosts`` (the machines the targets come in: host memory, host link, peak FLOP/s, with
sources), ``_offload_cost`` (the bytes a streamed step moves and the time they take: a model),
``_offload_time`` (the streamed step's time on this machine), ``_fsdp`` (per-device memory under
FSDP), ``_cache`` (compile-only peaks on disk), ``_report`` (tables, files, plot), ``__main__``
(the command line).
"""

from optfuse.bench._suite import SUITES as SUITES
from optfuse.bench._suite import run_suite as run_suite
