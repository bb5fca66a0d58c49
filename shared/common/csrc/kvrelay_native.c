/* Small native helpers for kvrelay (see shared/common/native.py): the prompt's block-hash chain and a
 * gather/scatter copy of KV blocks. Python objects are touched only with the GIL held; the copy runs
 * without it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* XXH128_hash_t of xxHash: returned in two registers by the SysV ABI, the same as this struct. */
typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_hash;
typedef xxh128_hash (*xxh3_128_fn)(const void *, size_t);

/* The xxhash package's own XXH3_128bits, handed over by shared/common/native.py: the hash is the contract's. */
static xxh3_128_fn xxh3_128 = NULL;

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

static void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static PyObject *set_xxh3_128(PyObject *self, PyObject *arg) {
    void *fn = PyLong_AsVoidPtr(arg);
    if (fn == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null function pointer");
        return NULL;
    }
    xxh3_128 = (xxh3_128_fn)fn;
    Py_RETURN_NONE;
}

/* Fill `dst` with n tokens (little-endian int32) from a list/tuple of ints; -1 with an exception on error. */
static int tokens_from_seq(PyObject **items, Py_ssize_t n, unsigned char *dst) {
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(items[i]);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < INT32_MIN || v > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "token id %ld does not fit in int32", v);
            return -1;
        }
        put_le32(dst + 4 * i, (uint32_t)(int32_t)v);
    }
    return 0;
}

/* hash_chain(tokens, block_size, parent, start_block, extra) -> list[bytes]
 * tokens: a list or tuple of ints, or bytes of little-endian int32. The hashes of the full blocks from
 * start_block on: h_i = XXH3-128(h_{i-1} || tokens of block i || extra), each as its 16 canonical bytes. */
static PyObject *hash_chain(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size, start_block;
    const char *parent, *extra;
    Py_ssize_t parent_len, extra_len;
    if (!PyArg_ParseTuple(args, "Ony#ny#", &tokens, &block_size, &parent, &parent_len, &start_block, &extra,
                          &extra_len))
        return NULL;
    if (xxh3_128 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvrelay_native: set_xxh3_128() first");
        return NULL;
    }
    if (block_size <= 0 || start_block < 0 || parent_len != 16) {
        PyErr_SetString(PyExc_ValueError, "hash_chain: block_size > 0, start_block >= 0, 16-byte parent");
        return NULL;
    }
    PyObject *seq = NULL;
    Py_ssize_t num_tokens;
    const unsigned char *raw = NULL;
    if (PyBytes_Check(tokens)) {
        num_tokens = PyBytes_GET_SIZE(tokens) / 4;
        raw = (const unsigned char *)PyBytes_AS_STRING(tokens);
    } else {
        seq = PySequence_Fast(tokens, "hash_chain: tokens must be a sequence of ints");
        if (seq == NULL) return NULL;
        num_tokens = PySequence_Fast_GET_SIZE(seq);
    }
    Py_ssize_t num_full = num_tokens / block_size;
    Py_ssize_t count = num_full > start_block ? num_full - start_block : 0;
    PyObject *out = PyList_New(count);
    if (out == NULL || count == 0) {
        Py_XDECREF(seq);
        return out;
    }
    size_t token_bytes = (size_t)block_size * 4;
    size_t msg_len = 16 + token_bytes + (size_t)extra_len;
    unsigned char *msg = PyMem_Malloc(msg_len);
    if (msg == NULL) {
        Py_XDECREF(seq);
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    memcpy(msg, parent, 16);
    memcpy(msg + 16 + token_bytes, extra, (size_t)extra_len);
    PyObject **items = seq ? PySequence_Fast_ITEMS(seq) : NULL;
    for (Py_ssize_t b = 0; b < count; b++) {
        Py_ssize_t first = (start_block + b) * block_size;
        if (items != NULL) {
            if (tokens_from_seq(items + first, block_size, msg + 16) < 0) goto fail;
        } else {
            memcpy(msg + 16, raw + 4 * first, token_bytes);
        }
        xxh128_hash h = xxh3_128(msg, msg_len);
        put_be64(msg, h.high64); /* canonical form: big-endian high then low, as xxhash's digest() */
        put_be64(msg + 8, h.low64);
        PyObject *digest = PyBytes_FromStringAndSize((const char *)msg, 16);
        if (digest == NULL) goto fail;
        PyList_SET_ITEM(out, b, digest);
    }
    PyMem_Free(msg);
    Py_XDECREF(seq);
    return out;
fail:
    PyMem_Free(msg);
    Py_XDECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* copy_blocks(dst_addr, src_addr, dst_offsets, src_offsets, sizes): for each i, copy sizes[i] bytes from
 * src_addr + src_offsets[i] to dst_addr + dst_offsets[i]. All three are int64 buffers of equal length; the
 * caller guarantees every range lies inside its allocation (kv_transfer/_shm_io.py checks). */
static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    unsigned long long dst_addr, src_addr;
    Py_buffer dst_off, src_off, sizes;
    if (!PyArg_ParseTuple(args, "KKy*y*y*", &dst_addr, &src_addr, &dst_off, &src_off, &sizes)) return NULL;
    PyObject *result = NULL;
    if (dst_off.len != src_off.len || dst_off.len != sizes.len || dst_off.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks: offsets and sizes must be int64 buffers of equal length");
        goto done;
    }
    Py_ssize_t n = dst_off.len / 8;
    const int64_t *d = (const int64_t *)dst_off.buf, *s = (const int64_t *)src_off.buf;
    const int64_t *len = (const int64_t *)sizes.buf;
    char *dst = (char *)(uintptr_t)dst_addr;
    const char *src = (const char *)(uintptr_t)src_addr;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + 2 < n) { /* blocks are scattered: the hardware prefetcher loses the stream at each one */
            __builtin_prefetch(src + s[i + 2], 0, 0);
            __builtin_prefetch(dst + d[i + 2], 1, 0);
        }
        memcpy(dst + d[i], src + s[i], (size_t)len[i]);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst_off);
    PyBuffer_Release(&src_off);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"set_xxh3_128", set_xxh3_128, METH_O, "Address of XXH3_128bits to hash with."},
    {"hash_chain", hash_chain, METH_VARARGS, "Chained block hashes of full blocks."},
    {"copy_blocks", copy_blocks, METH_VARARGS, "Gather/scatter copy of byte ranges, without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvrelay_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvrelay_native(void) { return PyModule_Create(&module); }
