"""One engine per mode of ``optfuse.fuse``: ``off`` (the plain optax step), ``backward``,
two-pass backward, ``forward``, and the wrappers that change where state lives
(``offload="state"``) or which loops are kept (the memory guard). Engines are siblings: what two
of them share lives in the fusion layer below."""
