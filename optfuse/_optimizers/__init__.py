"""Optax optimizers set up for stacked (scanned) layers: Muon's dimension numbers that keep the
layer axis a batch axis (``stacked_muon_dims``), the check ``describe`` runs on a Muon whose
dimension numbers do not, and any optimizer applied to each layer apart (``per_layer``)."""
