"""GPU compile targets: one ``GpuTargetConfig`` text proto per GPU (see ``optfuse._targets``)."""
