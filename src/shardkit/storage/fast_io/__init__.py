"""Memory and I/O mechanics under the readers and writers: host copies that bypass the cache (``memcopy``),
prefaulting fresh memory (``prefault``), ``O_DIRECT`` writes (``direct_io``) and the local sinks that use them
(``sinks``), bringing mapped pages in ahead of use (``map_prefetch``), the shared I/O thread pool (``parallel``),
and which destination tensors share memory (``destinations``). No file formats here."""
