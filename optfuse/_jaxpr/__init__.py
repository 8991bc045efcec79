"""The jaxpr interpreter (one evaluation loop, rules keyed by primitive), row evaluation of a
computation on one slice of a stacked value, and the row rules table."""
