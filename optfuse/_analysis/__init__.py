"""Answers about a training step before it runs: where each update runs (``describe``), the
compiled memory of each mode (``memory_report``) and the largest batch that fits
(``max_batch_size``). The layer above the engines: it builds fused steps and compiles them."""
