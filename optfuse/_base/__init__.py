"""What every layer shares: the named errors, the checks of a step's inputs, the float-leaf
predicates and the memory spaces (device or host) where state lives."""
