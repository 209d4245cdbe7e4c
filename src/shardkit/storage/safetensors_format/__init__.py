"""The safetensors file format: its header (build, parse and check an untrusted one: ``header``), the fast
atomic writer with block checksums (``writer``), and verified ranged reads of tensor bytes (``tensor_io``)."""
