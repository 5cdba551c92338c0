/* kvoffload._blockcopy: many memcpy calls in one Python call, without the GIL.
 *
 * The CPU copier (transfer/cpu_copy.py) moves a job as a list of byte ranges between the engine's KV views and
 * the host pool. Calling memmove once per range from Python costs about a microsecond of interpreter and GIL
 * traffic each: at 4 KiB pages that is most of the time, and two copy threads spend it fighting for the GIL.
 * Here the whole list runs in C with the GIL released. Addresses and sizes were validated by copy_plan.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *copy_ranges(PyObject *self, PyObject *args) {
    Py_buffer dst, src, size;
    if (!PyArg_ParseTuple(args, "y*y*y*", &dst, &src, &size)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (dst.len != src.len || dst.len != size.len || dst.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "copy_ranges: dst, src and size must be int64 arrays of one length");
        goto done;
    }
    const int64_t *d = (const int64_t *)dst.buf, *s = (const int64_t *)src.buf, *n = (const int64_t *)size.buf;
    Py_ssize_t count = dst.len / (Py_ssize_t)sizeof(int64_t);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (n[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_ranges: negative size");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        memmove((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)n[i]);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&size);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_ranges", copy_ranges, METH_VARARGS,
     "copy_ranges(dst, src, size): memmove(dst[i], src[i], size[i]) for int64 arrays of addresses and sizes, "
     "without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockcopy(void) { return PyModule_Create(&module); }
