/*
 * What the two C files of shardkit._stream_copy share: the streaming copy
 * (_stream_copy.c) and the registration of the Xxh3 hasher type
 * (_xxh3_hasher.c), which copies with it.
 */
#ifndef SHARDKIT_STREAM_COPY_H
#define SHARDKIT_STREAM_COPY_H

#include <Python.h>
#include <stddef.h>

/* Copy n bytes between non-overlapping regions with non-temporal stores where the CPU has them. */
void sk_copy(char *dst, const char *src, size_t n);

/* Let Xxh3.copy_update use its AVX2 loop (1) or not (0): _stream_copy._use_avx2() sets both modules' choice. */
void sk_xxh3_use_avx2(int on);

/* Add the Xxh3 type to the module; 0 on success, -1 with an exception set. */
int sk_add_xxh3_type(PyObject *module);

#endif
