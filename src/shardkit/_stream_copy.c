/*
 * shardkit._stream_copy: a memory-to-memory copy with non-temporal stores.
 *
 * Staging a checkpoint copies gigabytes that will not be read again soon.
 * glibc's memmove switches to non-temporal (cache-bypassing) stores only for
 * single calls larger than about 3/4 of the last-level cache (~100 MiB on a
 * typical server), so copying tensor by tensor in chunks of a few MiB pays
 * for a read-for-ownership of every destination line: about 1.5x the memory
 * traffic. This copies with streaming stores at any size (AVX2 when the CPU
 * has it, SSE2 otherwise) and releases the GIL while it runs. Other CPUs get
 * plain memcpy. Regions must not overlap (the Python wrapper checks).
 *
 * The module also holds Xxh3 (_xxh3_hasher.c): an xxh3-64 hasher that can
 * copy a slice and hash it in the same pass; and DirectWriter
 * (_direct_writer.c): a file's bytes copied, hashed and written with O_DIRECT
 * by its own threads, the GIL released throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_stream_copy.h"
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define SK_STREAMING 1
#endif

#ifdef SK_STREAMING
static int sk_have_avx2 = 0;

/* Copy the few bytes that bring dst to an `align` boundary; return how many. */
static size_t sk_head(char *dst, const char *src, size_t n, size_t align) {
    size_t head = (align - ((uintptr_t)dst & (align - 1))) & (align - 1);
    if (head > n) head = n;
    memcpy(dst, src, head);
    return head;
}

__attribute__((target("avx2")))
static void sk_stream_avx2(char *dst, const char *src, size_t n) {
    size_t head = sk_head(dst, src, n, 32);
    dst += head; src += head; n -= head;
    size_t blocks = n / 128;
    for (size_t i = 0; i < blocks; i++, src += 128, dst += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + 0));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)(dst + 0), a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    _mm_sfence();
    memcpy(dst, src, n - blocks * 128);
}

static void sk_stream_sse2(char *dst, const char *src, size_t n) {
    size_t head = sk_head(dst, src, n, 16);
    dst += head; src += head; n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence();
    memcpy(dst, src, n - blocks * 64);
}
#endif

void sk_copy(char *dst, const char *src, size_t n) {
#ifdef SK_STREAMING
    if (sk_have_avx2) {
        sk_stream_avx2(dst, src, n);
    } else {
        sk_stream_sse2(dst, src, n);
    }
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *sk_py_copy(PyObject *self, PyObject *args) {
    unsigned long long dst, src, nbytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKK:copy", &dst, &src, &nbytes)) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    sk_copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *sk_py_kind(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
#ifdef SK_STREAMING
    return PyUnicode_FromString(sk_have_avx2 ? "avx2 streaming stores" : "sse2 streaming stores");
#else
    return PyUnicode_FromString("memcpy");
#endif
}

static PyObject *sk_py_use_avx2(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
#ifdef SK_STREAMING
    sk_have_avx2 = on && __builtin_cpu_supports("avx2");
    sk_xxh3_use_avx2(sk_have_avx2);
    return PyBool_FromLong(sk_have_avx2);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef sk_methods[] = {
    {"copy", sk_py_copy, METH_VARARGS,
     "copy(dst_addr, src_addr, nbytes): copy nbytes between non-overlapping addresses, GIL released."},
    {"kind", sk_py_kind, METH_NOARGS, "kind() -> str: which copy loop this CPU uses."},
    {"_use_avx2", sk_py_use_avx2, METH_O,
     "_use_avx2(on) -> bool: for tests, whether the AVX2 loops may run (only where the CPU has AVX2); "
     "returns whether they run now. Otherwise the SSE2 ones do."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sk_module = {
    PyModuleDef_HEAD_INIT, "_stream_copy", "Non-temporal memory copies for checkpoint staging.", -1, sk_methods,
};

PyMODINIT_FUNC PyInit__stream_copy(void) {
#ifdef SK_STREAMING
    __builtin_cpu_init();
    sk_have_avx2 = __builtin_cpu_supports("avx2");
    sk_xxh3_use_avx2(sk_have_avx2);
#endif
    PyObject *module = PyModule_Create(&sk_module);
    if (module != NULL && (sk_add_xxh3_type(module) < 0 || sk_add_direct_writer_type(module) < 0)) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
