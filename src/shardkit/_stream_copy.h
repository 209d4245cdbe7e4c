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

/* --- the direct writer: _direct_writer.c (the engine) and _direct_writer_type.c (its Python type) --- */

#include <pthread.h>
#include <sys/types.h>

/* Digests of consecutive blocks of a byte stream. */
typedef struct {
    void *state;
    size_t block_bytes, filled;
    uint64_t *digests;
    size_t count, cap;
} SkBlocks;

typedef struct {
    char *buf;
    size_t nbytes, data; /* bytes to write (padded), of which data */
    off_t offset;
    int done;
} SkJob;

typedef struct {
    PyObject_HEAD
    int fd, depth, nthreads, stop, buffered, busy, reported;
    pid_t pid;         /* the process that started the threads (a forked child has none of them) */
    size_t buffer_bytes, filled;
    off_t next_offset;
    unsigned long long submitted, taken, retired; /* job k uses buffer k % depth */
    char **buffers;
    SkJob *jobs;
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t work, finished;
    int err;           /* first errno of a failed write (0: none) */
    PyObject *exc[3];  /* or the exception the pwrite hook raised */
    PyObject *hook;
    SkBlocks source, written;
    double share;      /* the share of the wall time it keeps the disk busy (1: unpaced; below 1: one thread) */
} DirectWriter;

/* Append the digest of the block being hashed, reset for the next one; -1: out of memory. */
int sk_blocks_push(SkBlocks *b);
/* A writer thread's loop: write the jobs handed over, in turn, until w->stop. */
void *sk_writer_thread(void *arg);
/* Hand the current buffer's first nbytes (data of them the file's) to the threads. */
void sk_submit(DirectWriter *w, size_t nbytes, size_t data);
/* Copy (and hash) n bytes at src into the buffers, handing each full one over; 0, or -1 on a failure. */
int sk_put(DirectWriter *w, const char *src, size_t n);
/* Wait for every job handed over and hash its bytes, in order; 0, or -1 on a failure. */
int sk_drain(DirectWriter *w);
/* Stop and join the threads (after the writes in progress); idempotent. */
void sk_stop_threads(DirectWriter *w);
/* No more rests: a paced writer goes on at full speed (its one thread). Any thread, any time. */
void sk_hurry(DirectWriter *w);
/* Whether a write failed (an errno, or an exception from the pwrite hook). */
int sk_failed(DirectWriter *w);

#endif
