"""GPU compile targets: one ``GpuTargetConfig`` text proto per GPU (``_registry``)."""
