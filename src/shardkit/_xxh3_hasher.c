/*
 * shardkit._stream_copy.Xxh3: an xxh3-64 hasher that can also copy what it hashes.
 *
 * A verified load copies every byte from the page cache into its tensor and
 * hashes the same bytes. Done as two passes, the hash costs xxh3's full rate
 * (31-34 ms of CPU per GiB on the 2-core benchmark VM) on top of a copy that
 * is bound by memory. copy_update() makes it one pass, with the GIL released:
 * with AVX2, xxh3's own streaming update runs with an accumulate that also
 * streams each stripe it loads to the destination (non-temporal stores), so
 * the hash's arithmetic fills the copy's memory stalls. Without AVX2 it
 * copies a stride that stays in L2, then hashes it.
 *
 * The digest is xxHash's (vendored, unmodified, in third_party/xxhash/; its
 * AVX2 or SSE2 update picked at run time on x86 for update()); the fused
 * accumulate and scramble repeat its AVX2 arithmetic, and the tests check
 * every digest against the xxhash package's xxh3_64. An object may be shared
 * between threads: a lock serialises its updates, as hashlib's objects do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
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

/* copy_update's stride where the CPU lacks AVX2 (copy a stride, then hash it):
 * a quarter of the benchmark VM's 1 MiB L2, so the hash reads bytes the copy
 * has just brought in (64 KiB and 256 KiB measured alike). */
#define SK_FUSED_STRIDE ((size_t)256 * 1024)
/* Updates at least this large release the GIL (hashlib's threshold is 2 KiB). */
#define SK_GIL_MINSIZE ((Py_ssize_t)64 * 1024)

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define SK_FUSED_AVX2 1

/* What one copy_update asks of the accumulate below: the source range, where
 * its bytes go (src + delta), and which part of it the accumulate stored. */
typedef struct {
    const xxh_u8 *begin, *end;
    uintptr_t delta; /* destination address - source address, modulo 2^64 */
    const xxh_u8 *stored_begin, *stored_end;
    int gapped;
} SkCopyPlan;

/* The calling thread's plan: XXH3_update's accumulate callback has no context
 * argument, and the object's lock keeps one update per hasher at a time. */
static __thread SkCopyPlan *sk_plan;
/* How far ahead of the stripe being hashed to prefetch (1 KiB measured best of 0.4-4 KiB). */
#define SK_PREFETCH_BYTES 1024
/* Whether copy_update runs the fused AVX2 loop (set at import, and by _stream_copy._use_avx2). */
static int sk_fused_avx2 = 0;

/* One 64-byte stripe at `in` of xxh3's AVX2 accumulate (xxhash.h's
 * XXH3_accumulate_512_avx2, into registers a0 and a1), with STORE (the
 * copy's stores, or nothing) issued right after the stripe's loads. */
#define SK_STRIPE(STORE)                                                              \
    do {                                                                              \
        __m256i d0 = _mm256_loadu_si256((const __m256i *)(in));                       \
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(in + 32));                  \
        STORE;                                                                        \
        __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)(key)));      \
        __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(key + 32))); \
        a0 = _mm256_add_epi64(_mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32)),        \
                              _mm256_add_epi64(a0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2)))); \
        a1 = _mm256_add_epi64(_mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32)),        \
                              _mm256_add_epi64(a1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2)))); \
    } while (0)

/* xxh3's accumulate (same digest) that also copies the plan's source range.
 *
 * Stripes from the hasher's own buffer are only hashed. For stripes of the
 * source, each iteration also streams 64 bytes to the destination: the
 * stripe itself when its destination is 32-byte aligned, else the aligned
 * 64-byte window of the destination that starts inside the stripe, loaded
 * again from the (L1-hot) source. File offsets and tensor addresses rarely
 * share an alignment, so that second case is the common one. The windows of
 * consecutive calls tile the source; the plan records what they stored. */
__attribute__((target("avx2")))
static void sk_copy_accumulate_avx2(xxh_u64 *XXH_RESTRICT acc, const xxh_u8 *XXH_RESTRICT input,
                                    const xxh_u8 *XXH_RESTRICT secret, size_t nbStripes) {
    SkCopyPlan *plan = sk_plan;
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const xxh_u8 *in = input;
    const xxh_u8 *key = secret;
    const xxh_u8 *in_end = input + nbStripes * XXH_STRIPE_LEN;
    if (input < plan->begin || input >= plan->end) {
        for (; in < in_end; in += XXH_STRIPE_LEN, key += XXH_SECRET_CONSUME_RATE) {
            SK_STRIPE((void)0);
        }
    } else {
        size_t skew = (32 - (((uintptr_t)input + plan->delta) & 31)) & 31; /* window start - stripe start */
        const xxh_u8 *window = input + skew;
        size_t room = plan->end > window ? (size_t)(plan->end - window) : 0;
        size_t windows = room / XXH_STRIPE_LEN < nbStripes ? room / XXH_STRIPE_LEN : nbStripes; /* never past the source */
        if (plan->stored_begin == NULL) {
            plan->stored_begin = window;
        } else if (plan->stored_end != window) {
            plan->gapped = 1;
        }
        plan->stored_end = window + windows * XXH_STRIPE_LEN;
        xxh_u8 *out = (xxh_u8 *)((uintptr_t)window + plan->delta);
        const xxh_u8 *stored_end = plan->stored_end;
        for (; window < stored_end; in += XXH_STRIPE_LEN, key += XXH_SECRET_CONSUME_RATE,
                                    window += XXH_STRIPE_LEN, out += XXH_STRIPE_LEN) {
            _mm_prefetch((const char *)(in + SK_PREFETCH_BYTES), _MM_HINT_T0);
            SK_STRIPE((_mm256_stream_si256((__m256i *)out, _mm256_loadu_si256((const __m256i *)window)),
                       _mm256_stream_si256((__m256i *)(out + 32), _mm256_loadu_si256((const __m256i *)(window + 32)))));
        }
        for (; in < in_end; in += XXH_STRIPE_LEN, key += XXH_SECRET_CONSUME_RATE) {
            SK_STRIPE((void)0);
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

/* xxh3's scramble (xxhash.h's XXH3_scrambleAcc_avx2), with unaligned access
 * to the accumulators: XXH3_update keeps them 16-byte aligned in an SSE2 build. */
__attribute__((target("avx2")))
static void sk_scramble_avx2(void *XXH_RESTRICT acc, const void *XXH_RESTRICT secret) {
    const __m256i prime32 = _mm256_set1_epi32((int)XXH_PRIME32_1);
    for (int i = 0; i < 2; i++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)acc + i);
        __m256i key = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)),
                                       _mm256_loadu_si256((const __m256i *)secret + i));
        __m256i lo = _mm256_mul_epu32(key, prime32);
        __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(key, 32), prime32);
        _mm256_storeu_si256((__m256i *)acc + i, _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)));
    }
}

/* Hash `n` bytes at `from` into `state` and copy them to `to`, reading each
 * byte once: xxh3's own streaming update, with the accumulate above. The few
 * bytes xxh3 takes through its internal buffer (at most 256 at the head, 64
 * at the tail) are copied apart. */
static void sk_fused_copy_update(XXH3_state_t *state, char *to, const char *from, size_t n) {
    SkCopyPlan plan = {(const xxh_u8 *)from, (const xxh_u8 *)from + n, (uintptr_t)to - (uintptr_t)from, NULL, NULL, 0};
    sk_plan = &plan;
    XXH3_update(state, (const xxh_u8 *)from, n, sk_copy_accumulate_avx2, sk_scramble_avx2);
    sk_plan = NULL;
    _mm_sfence();
    if (plan.stored_begin == NULL || plan.gapped) {
        sk_copy(to, from, n);
        return;
    }
    size_t head = (size_t)((const char *)plan.stored_begin - from);
    size_t tail_at = (size_t)((const char *)plan.stored_end - from);
    memcpy(to, from, head);
    memcpy(to + tail_at, from + tail_at, n - tail_at);
}
#endif

/* The plain-C face of the hasher, for the direct writer (_direct_writer.c): no Python objects, no GIL. */
void *sk_xxh3_new(void) {
    XXH3_state_t *state = XXH3_createState();
    if (state != NULL) {
        XXH3_64bits_reset(state);
    }
    return state;
}

void sk_xxh3_free(void *state) { XXH3_freeState((XXH3_state_t *)state); }

uint64_t sk_xxh3_digest_reset(void *state) {
    uint64_t digest = XXH3_64bits_digest((XXH3_state_t *)state);
    XXH3_64bits_reset((XXH3_state_t *)state);
    return digest;
}

void sk_xxh3_update(void *state, const void *data, size_t n) { SK_XXH3_UPDATE((XXH3_state_t *)state, data, n); }

void sk_xxh3_copy_update(void *state, char *to, const char *from, size_t nbytes) {
#ifdef SK_FUSED_AVX2
    if (sk_fused_avx2) {
        sk_fused_copy_update((XXH3_state_t *)state, to, from, nbytes);
        return;
    }
#endif
    for (size_t done = 0; done < nbytes; done += SK_FUSED_STRIDE) {
        size_t n = nbytes - done < SK_FUSED_STRIDE ? nbytes - done : SK_FUSED_STRIDE;
        sk_copy(to + done, from + done, n);
        SK_XXH3_UPDATE((XXH3_state_t *)state, from + done, n);
    }
}

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
    sk_xxh3_copy_update(self->state, to, from, (size_t)nbytes);
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

void sk_xxh3_use_avx2(int on) {
#ifdef SK_FUSED_AVX2
    sk_fused_avx2 = on;
#else
    (void)on;
#endif
}

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
