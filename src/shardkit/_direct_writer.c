/*
 * shardkit._stream_copy.DirectWriter: a file's bytes copied into aligned
 * bounce buffers, hashed, and written with O_DIRECT by a few threads, all
 * without the GIL.
 *
 * A background save used to do this in Python: a loop over pieces, futures
 * handed between a writer, a hasher and writer threads. Each hand-off took
 * the GIL back, hundreds of times per 300 MB, and every time the training
 * thread waited for it (steps ran ~30% slower while a save was in flight).
 * Here one write() call takes a whole list of memory ranges (a file's header
 * and tensors) and returns once they are copied, the GIL released for all
 * of it; finish() writes the padded tail, waits, and returns the digests.
 *
 * What it does, per bounce buffer, in file order: copy the source bytes in,
 * hashing them in the same pass (Xxh3.copy_update: the "source" block
 * digests); hand the buffer to one of `depth` POSIX threads, which pwrite
 * it (O_DIRECT; on EINVAL it clears O_DIRECT for the fd and writes the same
 * bytes again buffered, starting writeback, as storage.fast_io.direct_io did); once
 * written, and before the buffer is reused, hash the buffer's bytes (the
 * "written" digests). The caller compares the two: memory changed between
 * the copy and the write fails the save. Digests are per block of
 * block_bytes at file offsets (block_bytes 0: no hashing).
 *
 * Paced (share below 1, for background saves): one thread writes, resting after each buffer for as
 * long as (1 - share) / share times the write took; the copying and hashing wait for free buffers, so
 * they keep the same pace; hurry() ends the rests (the one thread goes on alone). Unpaced (share 1):
 * `depth` threads, no rests.
 *
 * What it does not do: open, truncate, fsync or rename the file, or own the
 * buffers (storage.fast_io.direct_io passes its pool's; they must outlive the
 * writer). With `pwrite` given (os.pwrite replaced by a tracer or a fault
 * injector), the threads call it with the GIL for each write instead of the
 * system call, and its OSError is raised from write()/finish() as it was.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: it defines _GNU_SOURCE (sync_file_range, O_DIRECT) */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "_stream_copy.h"

#define SK_ALIGN ((size_t)4096)

int sk_blocks_push(SkBlocks *b) {
    if (b->count == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 64;
        uint64_t *grown = realloc(b->digests, cap * sizeof *grown);
        if (grown == NULL) {
            return -1;
        }
        b->digests = grown, b->cap = cap;
    }
    b->digests[b->count++] = sk_xxh3_digest_reset(b->state);
    b->filled = 0;
    return 0;
}

/* Hash n bytes at src into the stream; with dst, copy them there too, in the same pass. -1: out of memory. */
static int sk_blocks_feed(SkBlocks *b, char *dst, const char *src, size_t n) {
    if (b->state == NULL) {
        if (dst != NULL) {
            sk_copy(dst, src, n);
        }
        return 0;
    }
    while (n > 0) {
        size_t take = b->block_bytes - b->filled < n ? b->block_bytes - b->filled : n;
        if (dst != NULL) {
            sk_xxh3_copy_update(b->state, dst, src, take);
            dst += take;
        } else {
            sk_xxh3_update(b->state, src, take);
        }
        b->filled += take, src += take, n -= take;
        if (b->filled == b->block_bytes && sk_blocks_push(b) < 0) {
            return -1;
        }
    }
    return 0;
}

static void sk_fail(DirectWriter *w, int err) {
    pthread_mutex_lock(&w->lock);
    if (w->err == 0) {
        w->err = err;
    }
    pthread_mutex_unlock(&w->lock);
}

/* Writes from now on are buffered: O_DIRECT was refused (EINVAL) at a write. */
static void sk_fall_back(DirectWriter *w) {
    pthread_mutex_lock(&w->lock);
    if (!w->buffered) {
        int flags = fcntl(w->fd, F_GETFL);
#ifdef O_DIRECT
        if (flags >= 0) {
            fcntl(w->fd, F_SETFL, flags & ~O_DIRECT);
        }
#endif
        w->buffered = 1;
    }
    pthread_mutex_unlock(&w->lock);
}

/* One pwrite through the Python hook: bytes written, or -1 with errno set (EINVAL for an
 * OSError(EINVAL), EIO after storing any other exception). */
static ssize_t sk_hook_write(DirectWriter *w, char *buf, size_t n, off_t offset) {
    PyGILState_STATE gil = PyGILState_Ensure();
    ssize_t written = -1;
    int err = EIO;
    PyObject *view = PyMemoryView_FromMemory(buf, (Py_ssize_t)n, PyBUF_WRITE);
    PyObject *result = view ? PyObject_CallFunction(w->hook, "iOL", w->fd, view, (long long)offset) : NULL;
    Py_XDECREF(view);
    if (result != NULL) {
        written = PyLong_AsSsize_t(result);
        Py_DECREF(result);
    }
    if (written < 0 && PyErr_Occurred()) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *code = value && PyErr_GivenExceptionMatches(type, PyExc_OSError)
                             ? PyObject_GetAttrString(value, "errno") : NULL;
        PyErr_Clear();
        if (code != NULL && PyLong_Check(code) && PyLong_AsLong(code) == EINVAL) {
            err = EINVAL;
            Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
        } else {
            pthread_mutex_lock(&w->lock);
            if (w->err == 0 && w->exc[0] == NULL) {
                w->exc[0] = type, w->exc[1] = value, w->exc[2] = tb;
            } else {
                Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
            }
            pthread_mutex_unlock(&w->lock);
        }
        Py_XDECREF(code);
    }
    PyGILState_Release(gil);
    errno = err;
    return written;
}

/* Write one job whole; 0, or the errno it failed with. */
static int sk_write_job(DirectWriter *w, SkJob *job) {
    size_t done = 0;
    while (done < job->nbytes) {
        int buffered = __atomic_load_n(&w->buffered, __ATOMIC_ACQUIRE);
        ssize_t n = w->hook != NULL ? sk_hook_write(w, job->buf + done, job->nbytes - done, job->offset + done)
                                    : pwrite(w->fd, job->buf + done, job->nbytes - done, job->offset + done);
        if (n > 0) {
            done += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && errno == EINVAL && !buffered) {
            sk_fall_back(w); /* then the same bytes again, buffered */
        } else {
            return n == 0 ? EIO : errno;
        }
    }
#if defined(__linux__) && defined(SYNC_FILE_RANGE_WRITE)
    if (__atomic_load_n(&w->buffered, __ATOMIC_ACQUIRE)) {
        sync_file_range(w->fd, job->offset, (off_t)job->nbytes, SYNC_FILE_RANGE_WRITE);
    }
#endif
    return 0;
}

static uint64_t sk_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* A paced writer (share below 1; it has one thread) rests after each write, with w->lock held on entry
 * and exit, for (1 - share) / share times as long as the write took, so the disk, and what the machine
 * spends moving the bytes, are busy for that share of the wall time. The next buffer fills meanwhile;
 * stopping the threads, or sk_hurry, cuts the rest short. */
static void sk_rest_after(DirectWriter *w, uint64_t took_ns) {
    uint64_t rest_ns = (uint64_t)((double)took_ns * (1.0 - w->share) / w->share);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until); /* the clock pthread_cond_timedwait measures by default */
    uint64_t end_ns = (uint64_t)until.tv_nsec + rest_ns;
    until.tv_sec += (time_t)(end_ns / 1000000000u), until.tv_nsec = (long)(end_ns % 1000000000u);
    while (!w->stop && w->share < 1.0 && pthread_cond_timedwait(&w->work, &w->lock, &until) != ETIMEDOUT) {
    }
}

void *sk_writer_thread(void *arg) {
    DirectWriter *w = arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->stop && w->taken == w->submitted) {
            pthread_cond_wait(&w->work, &w->lock);
        }
        if (w->stop) {
            break;
        }
        SkJob *job = &w->jobs[w->taken++ % (unsigned long long)w->depth];
        int failed = w->err != 0 || w->exc[0] != NULL;
        pthread_mutex_unlock(&w->lock);
        uint64_t start_ns = sk_now_ns();
        int err = failed ? 0 : sk_write_job(w, job); /* after a failure, nothing more is written */
        uint64_t took_ns = sk_now_ns() - start_ns;
        pthread_mutex_lock(&w->lock);
        if (err && w->err == 0) {
            w->err = err;
        }
        job->done = 1;
        pthread_cond_broadcast(&w->finished);
        if (w->share < 1.0 && !err && !failed) {
            sk_rest_after(w, took_ns);
        }
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* Wait for the oldest job in flight, hash its bytes, free its buffer. 0, or -1 on a failure. */
static int sk_retire(DirectWriter *w) {
    SkJob *job = &w->jobs[w->retired % (unsigned long long)w->depth];
    pthread_mutex_lock(&w->lock);
    while (!job->done) {
        pthread_cond_wait(&w->finished, &w->lock);
    }
    int failed = w->err != 0 || w->exc[0] != NULL;
    pthread_mutex_unlock(&w->lock);
    w->retired++;
    if (failed) {
        return -1;
    }
    if (sk_blocks_feed(&w->written, NULL, job->buf, job->data) < 0) {
        sk_fail(w, ENOMEM);
        return -1;
    }
    return 0;
}

/* Hand the current buffer's first nbytes (data of them are the file's) to the threads. */
void sk_submit(DirectWriter *w, size_t nbytes, size_t data) {
    SkJob *job = &w->jobs[w->submitted % (unsigned long long)w->depth];
    job->nbytes = nbytes, job->data = data, job->offset = w->next_offset, job->done = 0;
    w->next_offset += (off_t)w->buffer_bytes;
    w->filled = 0;
    pthread_mutex_lock(&w->lock);
    w->submitted++;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->lock);
}

/* Copy (and hash) n bytes at src into the bounce buffers, handing each full one over. 0, or -1. */
int sk_put(DirectWriter *w, const char *src, size_t n) {
    while (n > 0) {
        if (w->filled == 0 && w->submitted - w->retired >= (unsigned long long)w->depth && sk_retire(w) < 0) {
            return -1;
        }
        char *buf = w->buffers[w->submitted % (unsigned long long)w->depth];
        w->jobs[w->submitted % (unsigned long long)w->depth].buf = buf;
        size_t take = w->buffer_bytes - w->filled < n ? w->buffer_bytes - w->filled : n;
        if (sk_blocks_feed(&w->source, buf + w->filled, src, take) < 0) {
            sk_fail(w, ENOMEM);
            return -1;
        }
        w->filled += take, src += take, n -= take;
        if (w->filled == w->buffer_bytes) {
            sk_submit(w, w->buffer_bytes, w->buffer_bytes);
        }
    }
    return 0;
}

int sk_drain(DirectWriter *w) {
    while (w->retired < w->submitted) {
        if (sk_retire(w) < 0) {
            return -1;
        }
    }
    return 0;
}

void sk_hurry(DirectWriter *w) {
    pthread_mutex_lock(&w->lock);
    w->share = 1.0;
    pthread_cond_broadcast(&w->work);
    pthread_mutex_unlock(&w->lock);
}

void sk_stop_threads(DirectWriter *w) {
    if (w->threads == NULL) {
        return;
    }
    if (w->pid != getpid()) { /* a forked child: the threads (and whoever held the lock) stayed in the parent */
        free(w->threads);
        w->threads = NULL, w->nthreads = 0;
        return;
    }
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_cond_broadcast(&w->work);
    pthread_mutex_unlock(&w->lock);
    for (int i = 0; i < w->nthreads; i++) {
        pthread_join(w->threads[i], NULL);
    }
    free(w->threads);
    w->threads = NULL, w->nthreads = 0;
}

int sk_failed(DirectWriter *w) {
    pthread_mutex_lock(&w->lock);
    int failed = w->err != 0 || w->exc[0] != NULL;
    pthread_mutex_unlock(&w->lock);
    return failed;
}

