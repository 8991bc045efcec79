"""The jaxpr interpreter (one evaluation loop, rules keyed by primitive; the one reader of the
forms JAX versions stage differently), the parameter rules of row evaluation, and the row
evaluator with its rule table."""
