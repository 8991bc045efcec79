"""The fused step's machinery: taps on param leaves, fused scans over stacked params, in-place
row buffers, gradient accumulation and the whole-gradient update. Used by the engines; uses the
update plan, the jaxpr interpreter and the per-backend choices."""
