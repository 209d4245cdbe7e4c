/*
 * shardkit._stream_copy.Xxh3: an xxh3-64 hasher that can also copy what it hashes.
 *
 * A verified load copies every byte from the page cache into its tensor and
 * hashes the same bytes. Done as two Python calls per slice, the hash reads
 * its slice back after the copy has pushed it out of the core's cache, and
 * on the 2-core benchmark VM it cost ~60 ms of CPU per GiB inside a load,
 * twice xxh3's rate on hot bytes. copy_update() copies and hashes in strides
 * that stay in the L2 cache, in one call with the GIL released: the hash
 * then reads what the copy just loaded.
 *
 * The hashing is xxHash's own (vendored, unmodified, in third_party/xxhash/;
 * AVX2 or SSE2 picked at run time on x86), so digests equal the xxhash
 * package's xxh3_64. An object may be shared between threads: a lock
 * serialises its updates, as hashlib's objects do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <stdint.h>
#include <stdio.h>
#include "_stream_copy.h"

#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include "xxhash.h"

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
/* Defined, with external linkage, in xxh_x86dispatch.c (its header would
 * declare it static here, under XXH_INLINE_ALL): AVX2 where the CPU has it. */
XXH_errorcode XXH3_64bits_update_dispatch(XXH3_state_t *state, const void *input, size_t len);
#define SK_XXH3_UPDATE XXH3_64bits_update_dispatch
#else
#define SK_XXH3_UPDATE XXH3_64bits_update
#endif

/* copy_update's stride: a quarter of the benchmark VM's 1 MiB L2, so the hash
 * reads bytes the copy has just brought in (64 KiB and 256 KiB measured alike). */
#define SK_FUSED_STRIDE ((size_t)256 * 1024)
/* Updates at least this large release the GIL (hashlib's threshold is 2 KiB). */
#define SK_GIL_MINSIZE ((Py_ssize_t)64 * 1024)

typedef struct {
    PyObject_HEAD
    XXH3_state_t *state; /* heap: it must be 64-byte aligned */
    PyThread_type_lock lock;
} Xxh3Object;

static void sk_lock(Xxh3Object *self) {
    if (!PyThread_acquire_lock(self->lock, 0)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, 1);
        Py_END_ALLOW_THREADS
    }
}

static PyObject *xxh3_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Xxh3() takes no arguments");
        return NULL;
    }
    Xxh3Object *self = (Xxh3Object *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->state = XXH3_createState();
    self->lock = PyThread_allocate_lock();
    if (self->state == NULL || self->lock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    XXH3_64bits_reset(self->state);
    return (PyObject *)self;
}

static void xxh3_dealloc(Xxh3Object *self) {
    if (self->state != NULL) {
        XXH3_freeState(self->state);
    }
    if (self->lock != NULL) {
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *xxh3_update(Xxh3Object *self, PyObject *data) {
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (view.len >= SK_GIL_MINSIZE) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, 1);
        SK_XXH3_UPDATE(self->state, view.buf, (size_t)view.len);
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
    } else {
        sk_lock(self);
        SK_XXH3_UPDATE(self->state, view.buf, (size_t)view.len);
        PyThread_release_lock(self->lock);
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *xxh3_copy_update(Xxh3Object *self, PyObject *args) {
    unsigned long long dst, src, nbytes;
    if (!PyArg_ParseTuple(args, "KKK:copy_update", &dst, &src, &nbytes)) {
        return NULL;
    }
    char *to = (char *)(uintptr_t)dst;
    const char *from = (const char *)(uintptr_t)src;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, 1);
    for (size_t done = 0; done < (size_t)nbytes; done += SK_FUSED_STRIDE) {
        size_t n = (size_t)nbytes - done < SK_FUSED_STRIDE ? (size_t)nbytes - done : SK_FUSED_STRIDE;
        sk_copy(to + done, from + done, n);
        SK_XXH3_UPDATE(self->state, from + done, n);
    }
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static XXH64_hash_t xxh3_digest(Xxh3Object *self) {
    sk_lock(self);
    XXH64_hash_t digest = XXH3_64bits_digest(self->state);
    PyThread_release_lock(self->lock);
    return digest;
}

static PyObject *xxh3_hexdigest(Xxh3Object *self, PyObject *unused) {
    (void)unused;
    char text[17];
    snprintf(text, sizeof text, "%016llx", (unsigned long long)xxh3_digest(self));
    return PyUnicode_FromString(text);
}

static PyObject *xxh3_intdigest(Xxh3Object *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromUnsignedLongLong((unsigned long long)xxh3_digest(self));
}

static PyMethodDef xxh3_methods[] = {
    {"update", (PyCFunction)xxh3_update, METH_O, "update(data): hash the bytes of a contiguous buffer."},
    {"copy_update", (PyCFunction)xxh3_copy_update, METH_VARARGS,
     "copy_update(dst_addr, src_addr, nbytes): copy nbytes (non-overlapping) and hash them, one pass, GIL released."},
    {"hexdigest", (PyCFunction)xxh3_hexdigest, METH_NOARGS, "hexdigest() -> str: 16 hex digits, as xxhash's."},
    {"intdigest", (PyCFunction)xxh3_intdigest, METH_NOARGS, "intdigest() -> int: the 64-bit digest."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Xxh3Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shardkit._stream_copy.Xxh3",
    .tp_doc = "Xxh3(): an xxh3-64 hasher (seed 0) whose copy_update() copies and hashes in one pass.",
    .tp_basicsize = sizeof(Xxh3Object),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = xxh3_new,
    .tp_dealloc = (destructor)xxh3_dealloc,
    .tp_methods = xxh3_methods,
};

int sk_add_xxh3_type(PyObject *module) {
    if (PyType_Ready(&Xxh3Type) < 0) {
        return -1;
    }
    Py_INCREF(&Xxh3Type);
    if (PyModule_AddObject(module, "Xxh3", (PyObject *)&Xxh3Type) < 0) {
        Py_DECREF(&Xxh3Type);
        return -1;
    }
    return 0;
}
