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
 * bytes again buffered, starting writeback, as storage.direct_io did); once
 * written, and before the buffer is reused, hash the buffer's bytes (the
 * "written" digests). The caller compares the two: memory changed between
 * the copy and the write fails the save. Digests are per block of
 * block_bytes at file offsets (block_bytes 0: no hashing).
 *
 * What it does not do: open, truncate, fsync or rename the file, or own the
 * buffers (storage.direct_io passes its pool's; they must outlive the
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
#include <unistd.h>
#include "_stream_copy.h"

#define SK_ALIGN ((size_t)4096)

/* Digests of consecutive blocks of a byte stream. */
typedef struct {
    void *state;
    size_t block_bytes, filled;
    uint64_t *digests;
    size_t count, cap;
} SkBlocks;

static int sk_blocks_push(SkBlocks *b) {
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

static PyObject *sk_blocks_list(SkBlocks *b) {
    if (b->state != NULL && b->filled > 0 && sk_blocks_push(b) < 0) {
        return PyErr_NoMemory();
    }
    PyObject *out = PyList_New((Py_ssize_t)b->count);
    for (size_t i = 0; out != NULL && i < b->count; i++) {
        char text[17];
        snprintf(text, sizeof text, "%016llx", (unsigned long long)b->digests[i]);
        PyObject *s = PyUnicode_FromString(text);
        if (s == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, s);
    }
    return out;
}

typedef struct {
    char *buf;
    size_t nbytes, data; /* bytes to write (padded), of which data */
    off_t offset;
    int done;
} SkJob;

typedef struct {
    PyObject_HEAD
    int fd, depth, nthreads, stop, buffered, busy, reported;
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
} DirectWriter;

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

static void *sk_writer_thread(void *arg) {
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
        int err = failed ? 0 : sk_write_job(w, job); /* after a failure, nothing more is written */
        pthread_mutex_lock(&w->lock);
        if (err && w->err == 0) {
            w->err = err;
        }
        job->done = 1;
        pthread_cond_broadcast(&w->finished);
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
static void sk_submit(DirectWriter *w, size_t nbytes, size_t data) {
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
static int sk_put(DirectWriter *w, const char *src, size_t n) {
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

static int sk_drain(DirectWriter *w) {
    while (w->retired < w->submitted) {
        if (sk_retire(w) < 0) {
            return -1;
        }
    }
    return 0;
}

static void sk_stop_threads(DirectWriter *w) {
    if (w->threads == NULL) {
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

/* --- the Python type ------------------------------------------------------ */

static PyObject *sk_raise(DirectWriter *w) {
    pthread_mutex_lock(&w->lock);
    PyObject *type = w->exc[0], *value = w->exc[1], *tb = w->exc[2];
    w->exc[0] = w->exc[1] = w->exc[2] = NULL;
    int err = w->err ? w->err : EIO;
    w->err = err, w->reported = 1; /* stays failed */
    pthread_mutex_unlock(&w->lock);
    if (type != NULL) {
        PyErr_Restore(type, value, tb);
    } else {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return NULL;
}

static int sk_enter(DirectWriter *w) {
    if (w->busy) {
        PyErr_SetString(PyExc_RuntimeError, "DirectWriter: one call at a time");
        return -1;
    }
    w->busy = 1;
    return 0;
}

static PyObject *dw_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fd", "buffers", "buffer_bytes", "block_bytes", "pwrite", NULL};
    int fd;
    PyObject *buffers, *hook = Py_None;
    Py_ssize_t buffer_bytes, block_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOnn|O:DirectWriter", names, &fd, &buffers, &buffer_bytes,
                                     &block_bytes, &hook)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(buffers, "buffers must be a sequence of addresses");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t depth = PySequence_Fast_GET_SIZE(seq);
    if (depth < 1 || buffer_bytes <= 0 || (size_t)buffer_bytes % SK_ALIGN || block_bytes < 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "DirectWriter needs >= 1 buffer, buffer_bytes a positive multiple of "
                                          "4096 and block_bytes >= 0");
        return NULL;
    }
    DirectWriter *w = (DirectWriter *)type->tp_alloc(type, 0);
    if (w == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->work, NULL);
    pthread_cond_init(&w->finished, NULL);
    w->fd = fd, w->depth = (int)depth, w->buffer_bytes = (size_t)buffer_bytes;
    w->hook = hook == Py_None ? NULL : (Py_INCREF(hook), hook);
    w->source.block_bytes = w->written.block_bytes = (size_t)block_bytes;
    w->buffers = calloc((size_t)depth, sizeof *w->buffers);
    w->jobs = calloc((size_t)depth, sizeof *w->jobs);
    w->threads = calloc((size_t)depth, sizeof *w->threads);
    if (block_bytes > 0) {
        w->source.state = sk_xxh3_new();
        w->written.state = sk_xxh3_new();
    }
    if (!w->buffers || !w->jobs || !w->threads || (block_bytes > 0 && (!w->source.state || !w->written.state))) {
        Py_DECREF(seq), Py_DECREF(w);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < depth; i++) {
        w->buffers[i] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        Py_DECREF(w);
        return NULL;
    }
    for (int i = 0; i < w->depth; i++) {
        int err = pthread_create(&w->threads[i], NULL, sk_writer_thread, w);
        if (err) {
            Py_DECREF(w); /* joins the threads started so far */
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        w->nthreads++;
    }
    return (PyObject *)w;
}

static void dw_dealloc(DirectWriter *w) {
    Py_BEGIN_ALLOW_THREADS /* a thread may wait for the GIL in the pwrite hook */
    sk_stop_threads(w);
    Py_END_ALLOW_THREADS
    free(w->threads), free(w->buffers), free(w->jobs);
    free(w->source.digests), free(w->written.digests);
    if (w->source.state) sk_xxh3_free(w->source.state);
    if (w->written.state) sk_xxh3_free(w->written.state);
    Py_XDECREF(w->exc[0]), Py_XDECREF(w->exc[1]), Py_XDECREF(w->exc[2]), Py_XDECREF(w->hook);
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->finished);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static int sk_failed(DirectWriter *w) {
    pthread_mutex_lock(&w->lock);
    int failed = w->err != 0 || w->exc[0] != NULL;
    pthread_mutex_unlock(&w->lock);
    return failed;
}

static PyObject *dw_write(DirectWriter *w, PyObject *segments) {
    PyObject *seq = PySequence_Fast(segments, "write() takes a sequence of (address, nbytes) pairs");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    unsigned long long *pairs = PyMem_Malloc(2 * (size_t)(count ? count : 1) * sizeof *pairs);
    for (Py_ssize_t i = 0; pairs != NULL && i < count; i++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KK", &pairs[2 * i], &pairs[2 * i + 1])) {
            PyMem_Free(pairs), Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    if (pairs == NULL) {
        return PyErr_NoMemory();
    }
    if (sk_enter(w) < 0) {
        PyMem_Free(pairs);
        return NULL;
    }
    int rc = sk_failed(w) ? -1 : 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; rc == 0 && i < count; i++) {
        rc = sk_put(w, (const char *)(uintptr_t)pairs[2 * i], (size_t)pairs[2 * i + 1]);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(pairs);
    w->busy = 0;
    return rc < 0 ? sk_raise(w) : (Py_INCREF(Py_None), Py_None);
}

static PyObject *dw_drain(DirectWriter *w, PyObject *unused) {
    (void)unused;
    if (sk_enter(w) < 0) {
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sk_drain(w);
    Py_END_ALLOW_THREADS
    w->busy = 0;
    return rc < 0 ? sk_raise(w) : (Py_INCREF(Py_None), Py_None);
}

static PyObject *dw_finish(DirectWriter *w, PyObject *unused) {
    (void)unused;
    if (sk_enter(w) < 0) {
        return NULL;
    }
    int rc = sk_failed(w) ? -1 : 0;
    size_t size = (size_t)w->next_offset + w->filled;
    Py_BEGIN_ALLOW_THREADS
    if (rc == 0 && w->filled > 0) {
        size_t padded = (w->filled + SK_ALIGN - 1) / SK_ALIGN * SK_ALIGN;
        memset(w->buffers[w->submitted % (unsigned long long)w->depth] + w->filled, 0, padded - w->filled);
        sk_submit(w, padded, w->filled);
    }
    if (rc == 0) {
        rc = sk_drain(w);
    }
    sk_stop_threads(w);
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (rc < 0) {
        return w->reported ? (Py_INCREF(Py_None), Py_None) : sk_raise(w);
    }
    PyObject *source = sk_blocks_list(&w->source);
    PyObject *written = source ? sk_blocks_list(&w->written) : NULL;
    PyObject *out = written ? Py_BuildValue("(nOO)", (Py_ssize_t)size, source, written) : NULL;
    Py_XDECREF(source), Py_XDECREF(written);
    return out;
}

static PyObject *dw_abort(DirectWriter *w, PyObject *unused) {
    (void)unused;
    if (sk_enter(w) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    sk_stop_threads(w);
    Py_END_ALLOW_THREADS
    w->busy = 0;
    Py_RETURN_NONE;
}

static PyMethodDef dw_methods[] = {
    {"write", (PyCFunction)dw_write, METH_O,
     "write(segments): copy (and hash) each (address, nbytes) in order into the buffers, handing full ones "
     "to the writer threads; returns once the bytes are copied. GIL released throughout."},
    {"drain", (PyCFunction)dw_drain, METH_NOARGS, "drain(): wait until every full buffer handed over is written."},
    {"finish", (PyCFunction)dw_finish, METH_NOARGS,
     "finish() -> (nbytes, source_digests, written_digests): write the tail padded to 4096 bytes, wait, stop "
     "the threads. None when a failure was already raised. The caller truncates the file to nbytes."},
    {"abort", (PyCFunction)dw_abort, METH_NOARGS, "abort(): stop the threads after the writes in progress."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DirectWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shardkit._stream_copy.DirectWriter",
    .tp_doc = "DirectWriter(fd, buffers, buffer_bytes, block_bytes, pwrite=None): O_DIRECT writes of copied, "
              "hashed bytes from len(buffers) threads, without the GIL.",
    .tp_basicsize = sizeof(DirectWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = dw_new,
    .tp_dealloc = (destructor)dw_dealloc,
    .tp_methods = dw_methods,
};

int sk_add_direct_writer_type(PyObject *module) {
    if (PyType_Ready(&DirectWriterType) < 0) {
        return -1;
    }
    Py_INCREF(&DirectWriterType);
    if (PyModule_AddObject(module, "DirectWriter", (PyObject *)&DirectWriterType) < 0) {
        Py_DECREF(&DirectWriterType);
        return -1;
    }
    return 0;
}
