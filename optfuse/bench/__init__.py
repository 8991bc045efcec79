"""``python -m optfuse.bench``: step time, compile time and compiled memory, fused vs optax.

Run ``python -m optfuse.bench --quick`` (about 90 CPU-seconds, most of it XLA compiling), or
without ``--quick`` for the full suite (larger models, every optimizer on every model, the
184M-parameter scanned GPT; meant for a GPU or TPU). ``--out DIR`` writes ``results.json``,
``results.md`` and ``results.png``. The same command runs on CPU, GPU and TPU: JAX picks the
backend. ``--fit BUDGET`` (e.g. ``--fit 24GB``) prints the largest batch per mode whose compiled
step fits the budget, for the big scanned decoders (compile-only, seconds per compile on CPU).

The command runs, times and prints; the models it reports live in the library's layers, where
users and tests reach them too: the host machines in ``optfuse._targets._hosts``, the transfer
model in ``optfuse._analysis._offload_cost``, the what-fits searches in
``optfuse._analysis._what_fits``, FSDP's per-device bytes in ``optfuse._analysis._fsdp``, the
collectives of compiled HLO in ``optfuse._analysis._collectives``, the memory floor in
``optfuse._analysis._floor``.

Modules: ``_models`` (the benchmark's models in plain JAX), ``_forms`` (scanned decoders as
codebases write them), ``_timing`` (compiling and interleaved timing), ``_suite`` (the suites,
the measuring loop, the compile-only memory section), ``_fit_table`` (the ``--fit`` rows),
``_what_fits`` (the largest decoder per target), ``_host_fits`` (the same with offload, beside
each machine's host memory), ``_slices`` (the ``--slices`` rows), ``_offload_cost`` (the
transfer model's rows), ``_offload_time`` (the streamed step's time on this machine), ``_fsdp``
(per-device memory under FSDP), ``_cache`` (compile-only peaks on disk), ``_report`` (tables,
files, plot), ``__main__`` (the command line).
"""

from optfuse.bench._suite import SUITES as SUITES
from optfuse.bench._suite import run_suite as run_suite
