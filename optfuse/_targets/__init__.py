"""Compile targets and what depends on them: the registry of TPU and GPU targets, their GPU
device descriptions (``gpu/*.txtpb``), abstract step inputs placed on a target, compiled memory
read from XLA's buffer assignment, the per-backend table of compiler-dependent choices, and the
machines the targets come in (``_hosts``: host memory, host link, peak FLOP/s, with sources)."""
