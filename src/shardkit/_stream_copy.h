/*
 * What the C files of shardkit._stream_copy share: the streaming copy
 * (_stream_copy.c), the Xxh3 hasher (_xxh3_hasher.c), which copies with it,
 * and the direct writer (_direct_writer.c), which copies and hashes with both.
 */
#ifndef SHARDKIT_STREAM_COPY_H
#define SHARDKIT_STREAM_COPY_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

/* Copy n bytes between non-overlapping regions with non-temporal stores where the CPU has them. */
void sk_copy(char *dst, const char *src, size_t n);

/* Let Xxh3.copy_update use its AVX2 loop (1) or not (0): _stream_copy._use_avx2() sets both modules' choice. */
void sk_xxh3_use_avx2(int on);

/* Add the Xxh3 type to the module; 0 on success, -1 with an exception set. */
int sk_add_xxh3_type(PyObject *module);

/* An xxh3-64 state (seed 0) for C callers, no GIL needed: new (NULL when out of memory), free,
 * update, copy_update (copy n bytes and hash them, one pass, as Xxh3.copy_update), and the
 * digest of what was fed so far, the state reset for the next block. */
void *sk_xxh3_new(void);
void sk_xxh3_free(void *state);
void sk_xxh3_update(void *state, const void *data, size_t n);
void sk_xxh3_copy_update(void *state, char *to, const char *from, size_t n);
uint64_t sk_xxh3_digest_reset(void *state);

/* Add the DirectWriter type (_direct_writer.c) to the module; 0 on success, -1 with an exception set. */
int sk_add_direct_writer_type(PyObject *module);

#endif
