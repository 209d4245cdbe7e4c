/*
 * The Python type of shardkit._stream_copy.DirectWriter (the engine, and
 * what it does: _direct_writer.c). Each call parses its arguments with the
 * GIL, then releases it for all of the copying, hashing and waiting.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "_stream_copy.h"

#define SK_ALIGN ((size_t)4096)

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
    static char *names[] = {"fd", "buffers", "buffer_bytes", "block_bytes", "pwrite", "share", NULL};
    int fd;
    PyObject *buffers, *hook = Py_None;
    Py_ssize_t buffer_bytes, block_bytes;
    double share = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOnn|Od:DirectWriter", names, &fd, &buffers, &buffer_bytes,
                                     &block_bytes, &hook, &share)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(buffers, "buffers must be a sequence of addresses");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t depth = PySequence_Fast_GET_SIZE(seq);
    if (depth < 1 || buffer_bytes <= 0 || (size_t)buffer_bytes % SK_ALIGN || block_bytes < 0 || !(share > 0.0)
        || share > 1.0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "DirectWriter needs >= 1 buffer, buffer_bytes a positive multiple of "
                                          "4096, block_bytes >= 0 and 0 < share <= 1");
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
    w->fd = fd, w->depth = (int)depth, w->buffer_bytes = (size_t)buffer_bytes, w->pid = getpid(), w->share = share;
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
    for (int i = 0; i < (share < 1.0 ? 1 : w->depth); i++) { /* paced: one write at a time */
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
    if (w->pid == getpid()) { /* in a forked child the parent's threads may still count as waiters: keep them */
        pthread_mutex_destroy(&w->lock);
        pthread_cond_destroy(&w->work);
        pthread_cond_destroy(&w->finished);
    }
    Py_TYPE(w)->tp_free((PyObject *)w);
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

static PyObject *dw_hurry(DirectWriter *w, PyObject *unused) {
    (void)unused;
    Py_BEGIN_ALLOW_THREADS /* the lock may be held by a thread waiting for the GIL in the pwrite hook */
    sk_hurry(w);
    Py_END_ALLOW_THREADS
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
    {"hurry", (PyCFunction)dw_hurry, METH_NOARGS,
     "hurry(): a paced writer (share below 1) rests no more; from any thread, while another writes."},
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
