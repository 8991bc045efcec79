"""Answers about a training step before it runs: where each update runs (``describe``), the
compiled memory of each mode (``memory_report``) and the largest batch that fits
(``max_batch_size``), and the models the benchmark reports: what offload moves and costs
(``_offload_cost``), what fits beside a machine's host memory (``_what_fits``), FSDP's
per-device bytes (``_fsdp``), the collectives of a compiled step (``_collectives``) and the
memory floor (``_floor``). The layer above the engines: it builds fused steps and compiles
them."""
