"""Low-bit optimizer state: quantization maps, block quantization, the ``low_bit`` transform."""
