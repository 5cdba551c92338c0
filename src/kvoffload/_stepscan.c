/* kvoffload._stepscan: which of a step's scheduled requests the scheduler half must look at in Python.
 *
 * Why C: every engine step, StoreScan.collect (connector/stores.py) passes over every running
 * request to find the few that got new device blocks or whose next offload block just filled. In Python those are
 * two C-level passes (compress over map) plus the column check, each finding its code and data cold after the
 * engine's own work: about 15-30 us at 256 requests, half of a decode step's connector time. Here it is one pass.
 *
 * scan(num_requests, new_block_ids, computed_tokens, partial, offset) -> (grown, filled)
 *   new_block_ids[i]: request i's new blocks (None or empty: none); computed_tokens[i] + offset: its computed
 *   tokens once the step has run; partial: an int64 buffer (array('q')), partial[i] the most computed tokens at
 *   which request i's next offload block is still partial. grown: the i with new blocks; filled: the i with
 *   computed_tokens[i] + offset > partial[i]. partial is a buffer, not a list: the scheduler keeps it from step
 *   to step, and a list's int objects lie scattered, one cache miss each once the engine's work has evicted them.
 * Columns of another length, an offset other than 0 or 1, or a count that is not an int64 raise ValueError
 * (the message is StepSchedule.check's).
 *
 * common_value(mapping, keys) -> the value every key of keys has in the dict mapping, or None (keys empty, a key
 *   missing, or two values differ: compared by identity). Why C: tenants' shares (index/tenants.py) touch a
 *   request's hit keys in their tenant's policy; the keys of one request are one tenant's, and checking that key
 *   by key in Python costs as much as the touch itself (about 20 ns a key); here it is a few ns a key.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int append_index(PyObject *list, Py_ssize_t i) {
    PyObject *index = PyLong_FromSsize_t(i);
    if (index == NULL) {
        return -1;
    }
    int failed = PyList_Append(list, index);
    Py_DECREF(index);
    return failed;
}

/* Both passes over already checked sequences; -1 with an exception set on a bad item. */
static int scan_columns(Py_ssize_t n, PyObject **blocks, PyObject **computed, const long long *partial, int offset,
                        PyObject *grown, PyObject *filled) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (blocks[i] != Py_None) {
            int any = PyObject_IsTrue(blocks[i]);
            if (any < 0 || (any && append_index(grown, i) < 0)) {
                return -1;
            }
        }
        long long done = PyLong_AsLongLong(computed[i]);
        if (done == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "StepSchedule: request %zd's computed tokens are not an int64", i);
            return -1;
        }
        if (done + offset > partial[i] && append_index(filled, i) < 0) {
            return -1;
        }
    }
    return 0;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    PyObject *blocks_in, *computed_in;
    Py_buffer partial;
    int offset;
    if (!PyArg_ParseTuple(args, "nOOy*i", &n, &blocks_in, &computed_in, &partial, &offset)) {
        return NULL;
    }
    PyObject *blocks = PySequence_Fast(blocks_in, "StepSchedule.new_block_ids must be a sequence");
    PyObject *computed = blocks ? PySequence_Fast(computed_in, "StepSchedule.computed_tokens must be a sequence")
                                : NULL;
    PyObject *grown = NULL, *filled = NULL, *result = NULL;
    if (computed == NULL) {
        goto done;
    }
    Py_ssize_t num_blocks = PySequence_Fast_GET_SIZE(blocks), num_computed = PySequence_Fast_GET_SIZE(computed);
    if (num_blocks != n || num_computed != n || (offset != 0 && offset != 1)) {
        PyErr_Format(PyExc_ValueError, "StepSchedule: columns of %zd ids, %zd block lists and %zd computed counts, "
                     "offset %d", n, num_blocks, num_computed, offset);
        goto done;
    }
    if (partial.len != n * (Py_ssize_t)sizeof(long long)) {
        PyErr_Format(PyExc_ValueError, "scan: partial holds %zd bytes, not %zd int64 thresholds", partial.len, n);
        goto done;
    }
    grown = PyList_New(0);
    filled = grown ? PyList_New(0) : NULL;
    if (filled == NULL || scan_columns(n, PySequence_Fast_ITEMS(blocks), PySequence_Fast_ITEMS(computed),
                                       (const long long *)partial.buf, offset, grown, filled) < 0) {
        goto done;
    }
    result = PyTuple_Pack(2, grown, filled);
done:
    Py_XDECREF(grown);
    Py_XDECREF(filled);
    Py_XDECREF(computed);
    Py_XDECREF(blocks);
    PyBuffer_Release(&partial);
    return result;
}

static PyObject *common_value(PyObject *self, PyObject *args) {
    PyObject *mapping, *keys;
    if (!PyArg_ParseTuple(args, "O!O:common_value", &PyDict_Type, &mapping, &keys))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "common_value: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *common = NULL; /* borrowed from mapping */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyDict_GetItemWithError(mapping, items[i]);
        if (value == NULL) {
            Py_DECREF(seq);
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE;
        }
        if (common == NULL)
            common = value;
        else if (value != common) {
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
    }
    Py_DECREF(seq);
    if (common == NULL)
        Py_RETURN_NONE;
    Py_INCREF(common);
    return common;
}

static PyMethodDef methods[] = {
    {"common_value", common_value, METH_VARARGS,
     "common_value(mapping, keys) -> the value every key has in the dict mapping (the same object), else None."},
    {"scan", scan, METH_VARARGS,
     "scan(num_requests, new_block_ids, computed_tokens, partial, offset) -> (grown, filled): the requests of a step "
     "that got new blocks, and those whose next offload block filled (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stepscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stepscan(void) { return PyModule_Create(&module); }
