"""The update plan: ``tx.update`` traced once for a params/state signature and cut into one
group per parameter leaf (a separable transform), or into a global stage plus groups (clipping,
``apply_if_finite``). The layer below the fusion machinery, above the jaxpr interpreter."""
