/* kvoffload._blockplan: a device<->host job's copy plan in one C call (transfer/copy_plan.py says what a plan is).
 *
 * Why C: at 4 KiB pages a 4096-block job copies in about 2 ms, and building its plan with numpy took 0.2-0.3 ms
 * more in the cold caches a forward pass leaves behind (each of some twenty numpy calls misses them). Here one
 * pass reads the job's ints, checks them, sorts each group by source address (a radix sort on the block id or
 * the pool sub-block) and emits the copies, merging each into the one before when it continues it on both sides.
 *
 * plan(layout, ids, slots, device_sizes, host_sizes, skip, store) -> (columns, count, nbytes)
 *   layout: bytes of int64 (PlanLayout.packed): num_blocks, num_slots, slot_stride, factor, num_views,
 *           num_groups, the views' row strides, then per group: block bytes, ref count, (view, offset, nbytes)
 *           per ref.
 *   columns: bytes of 4 x capacity int64: view, view offset, pool offset, size; the first ``count`` of each
 *            column are the plan. nbytes: their total size.
 * Bad ids or slots raise ValueError with the reason (copy_plan.py adds the job id).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NO_BLOCK (-1)

typedef struct {
    int64_t key, id, slot, sub; /* sub: the position inside the slot; key: id (store) or slot * factor + sub */
} Entry;

typedef struct {
    int64_t *view, *view_offset, *pool_offset, *size;
    Py_ssize_t count;
    int64_t nbytes;
} Out;

/* Read a sequence of Python ints into ``dst``; -1 with ValueError set when one is not an int64. */
static int read_ints(PyObject *seq, int64_t *dst, Py_ssize_t n) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            PyObject *type, *value, *trace;
            PyErr_Fetch(&type, &value, &trace);
            PyObject *text = value ? PyObject_Str(value) : NULL;
            PyErr_Format(PyExc_ValueError, "block ids and slots must be int64 values: %S", text ? text : Py_None);
            Py_XDECREF(text);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(trace);
            return -1;
        }
        dst[i] = v;
    }
    return 0;
}

/* Stable LSD radix sort of ``n`` entries by key (every key in [0, bound)), a byte per pass; ``tmp`` holds n. */
static void radix_sort(Entry *a, Entry *tmp, Py_ssize_t n, int64_t bound) {
    int passes = 0;
    for (uint64_t top = (uint64_t)(bound > 0 ? bound - 1 : 0); top; top >>= 8) passes++;
    Entry *src = a, *dst = tmp;
    for (int p = 0; p < passes; p++) {
        Py_ssize_t count[257] = {0};
        int shift = 8 * p;
        for (Py_ssize_t i = 0; i < n; i++) count[(((uint64_t)src[i].key >> shift) & 0xff) + 1]++;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (Py_ssize_t i = 0; i < n; i++) dst[count[((uint64_t)src[i].key >> shift) & 0xff]++] = src[i];
        Entry *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(Entry));
}

static void sort_entries(Entry *a, Entry *tmp, Py_ssize_t n, int64_t bound) {
    for (Py_ssize_t i = 1; i < n; i++) {
        if (a[i].key < a[i - 1].key) {
            radix_sort(a, tmp, n, bound);
            return;
        }
    }
}

/* Append a copy, or grow the last one when this one continues it on both sides. The columns are read through
 * local pointers (``Out`` is copied in and out by the caller): stores through int64 pointers could alias
 * ``count``, which would make the compiler reload it after every store. */
static inline void emit(Out *o, int64_t view, int64_t view_offset, int64_t pool_offset, int64_t size) {
    Py_ssize_t m = o->count;
    o->nbytes += size;
    if (m && o->view[m - 1] == view && o->view_offset[m - 1] + o->size[m - 1] == view_offset &&
        o->pool_offset[m - 1] + o->size[m - 1] == pool_offset) {
        o->size[m - 1] += size;
        return;
    }
    o->view[m] = view;
    o->view_offset[m] = view_offset;
    o->pool_offset[m] = pool_offset;
    o->size[m] = size;
    o->count = m + 1;
}

typedef struct {
    int64_t num_blocks, num_slots, slot_stride, factor, num_views, num_groups;
    const int64_t *row_stride; /* per view */
    const int64_t *groups;     /* per group: block bytes, ref count, refs */
    int64_t max_refs;
} Layout;

static int parse_layout(const int64_t *p, Py_ssize_t len, Layout *l) {
    if (len < 6) goto bad;
    l->num_blocks = p[0], l->num_slots = p[1], l->slot_stride = p[2], l->factor = p[3];
    l->num_views = p[4], l->num_groups = p[5];
    if (l->factor < 1 || l->num_views < 1 || 6 + l->num_views > len) goto bad;
    l->row_stride = p + 6;
    l->groups = p + 6 + l->num_views;
    l->max_refs = 0;
    const int64_t *g = l->groups, *end = p + len;
    for (int64_t k = 0; k < l->num_groups; k++) {
        if (g + 2 > end || g + 2 + 3 * g[1] > end) goto bad;
        if (g[1] > l->max_refs) l->max_refs = g[1];
        g += 2 + 3 * g[1];
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "plan: malformed packed layout");
    return -1;
}

/* One group's entries, sorted by source address, as copies. */
static void emit_group(const Layout *l, const int64_t *group, const Entry *e, Py_ssize_t n, int store, Out *out) {
    int64_t block_bytes = group[0], refs = group[1], slot_stride = l->slot_stride;
    const int64_t *ref = group + 2;
    Out o = *out;
    if (store) { /* ref by ref: each view read in address order */
        for (int64_t r = 0; r < refs; r++) {
            int64_t view = ref[3 * r], offset = ref[3 * r + 1], size = ref[3 * r + 2], stride = l->row_stride[view];
            for (Py_ssize_t i = 0; i < n; i++)
                emit(&o, view, e[i].id * stride, e[i].slot * slot_stride + e[i].sub * block_bytes + offset, size);
        }
    } else { /* block by block: the pool read in address order */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t pool = e[i].slot * slot_stride + e[i].sub * block_bytes;
            for (int64_t r = 0; r < refs; r++) {
                int64_t view = ref[3 * r];
                emit(&o, view, e[i].id * l->row_stride[view], pool + ref[3 * r + 1], ref[3 * r + 2]);
            }
        }
    }
    *out = o;
}

/* Check and place group entries; -1 with ValueError set on a bad id or slot. */
static Py_ssize_t gather(const Layout *l, const int64_t *ids, Py_ssize_t dn, const int64_t *slots, Py_ssize_t hn,
                         int64_t skip, int store, Entry *out) {
    Py_ssize_t n = 0, at = 0;
    int64_t sub = skip, factor = l->factor; /* entry k sits in slot slots[at], at sub-block sub (no divisions) */
    for (Py_ssize_t k = 0; k < dn; k++) {
        int64_t id = ids[k];
        if (id != NO_BLOCK || store) {
            if (id == NO_BLOCK) {
                PyErr_SetString(PyExc_ValueError,
                                "a store has a hole (NO_BLOCK); stores copy whole offload blocks");
                return -1;
            }
            if ((uint64_t)id >= (uint64_t)l->num_blocks) {
                PyErr_Format(PyExc_ValueError, "a block id is outside [0, %lld)", (long long)l->num_blocks);
                return -1;
            }
            if (at >= hn) {
                PyErr_SetString(PyExc_ValueError, "more block ids than the slots hold");
                return -1;
            }
            Entry *e = &out[n++];
            e->id = id, e->slot = slots[at], e->sub = sub;
            e->key = store ? id : slots[at] * factor + sub;
        }
        if (++sub == factor) sub = 0, at++;
    }
    return n;
}

static PyObject *plan(PyObject *self, PyObject *args) {
    Py_buffer packed;
    PyObject *ids_arg, *slots_arg, *dsizes_arg, *hsizes_arg;
    long long skip;
    int store;
    if (!PyArg_ParseTuple(args, "y*OOOOLp", &packed, &ids_arg, &slots_arg, &dsizes_arg, &hsizes_arg, &skip, &store))
        return NULL;
    PyObject *result = NULL, *ids_seq = NULL, *slots_seq = NULL, *ds_seq = NULL, *hs_seq = NULL, *columns = NULL;
    int64_t *ids = NULL, *slots = NULL, *dsizes = NULL, *hsizes = NULL;
    Entry *entries = NULL, *tmp = NULL;
    Layout l;
    if (parse_layout((const int64_t *)packed.buf, packed.len / (Py_ssize_t)sizeof(int64_t), &l) < 0) goto done;
    if (!(ids_seq = PySequence_Fast(ids_arg, "plan: ids must be a sequence")) ||
        !(slots_seq = PySequence_Fast(slots_arg, "plan: slots must be a sequence")) ||
        !(ds_seq = PySequence_Fast(dsizes_arg, "plan: device sizes must be a sequence")) ||
        !(hs_seq = PySequence_Fast(hsizes_arg, "plan: host sizes must be a sequence")))
        goto done;
    Py_ssize_t n_ids = PySequence_Fast_GET_SIZE(ids_seq), n_slots = PySequence_Fast_GET_SIZE(slots_seq);
    Py_ssize_t groups = PySequence_Fast_GET_SIZE(ds_seq);
    if (groups != l.num_groups || PySequence_Fast_GET_SIZE(hs_seq) != groups) {
        PyErr_Format(PyExc_ValueError, "group sizes must have %lld entries", (long long)l.num_groups);
        goto done;
    }
    ids = PyMem_Malloc((size_t)(n_ids + n_slots + 2 * groups + 1) * sizeof(int64_t));
    entries = PyMem_Malloc((size_t)(2 * n_ids + 1) * sizeof(Entry));
    if (!ids || !entries) {
        PyErr_NoMemory();
        goto done;
    }
    slots = ids + n_ids, dsizes = slots + n_slots, hsizes = dsizes + groups, tmp = entries + n_ids;
    if (read_ints(ids_seq, ids, n_ids) < 0 || read_ints(slots_seq, slots, n_slots) < 0 ||
        read_ints(ds_seq, dsizes, groups) < 0 || read_ints(hs_seq, hsizes, groups) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n_slots; i++) {
        if ((uint64_t)slots[i] >= (uint64_t)l.num_slots) {
            PyErr_Format(PyExc_ValueError, "a slot is outside [0, %lld)", (long long)l.num_slots);
            goto done;
        }
    }
    Py_ssize_t capacity = n_ids * (Py_ssize_t)l.max_refs;
    if (!(columns = PyBytes_FromStringAndSize(NULL, 4 * capacity * (Py_ssize_t)sizeof(int64_t)))) goto done;
    int64_t *col = (int64_t *)PyBytes_AS_STRING(columns);
    Out out = {col, col + capacity, col + 2 * capacity, col + 3 * capacity, 0, 0};
    const int64_t *group = l.groups;
    Py_ssize_t d0 = 0, h0 = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        if (dsizes[g] < 0 || hsizes[g] < 0 || d0 + dsizes[g] > n_ids || h0 + hsizes[g] > n_slots) {
            PyErr_SetString(PyExc_ValueError, "group sizes do not add up to the ids and slots");
            goto done;
        }
        Py_ssize_t n = gather(&l, ids + d0, dsizes[g], slots + h0, hsizes[g], skip, store, entries);
        if (n < 0) goto done;
        sort_entries(entries, tmp, n, store ? l.num_blocks : l.num_slots * l.factor);
        emit_group(&l, group, entries, n, store, &out);
        d0 += dsizes[g], h0 += hsizes[g];
        group += 2 + 3 * group[1];
    }
    result = Py_BuildValue("(OnL)", columns, out.count, (long long)out.nbytes);
done:
    PyBuffer_Release(&packed);
    Py_XDECREF(ids_seq);
    Py_XDECREF(slots_seq);
    Py_XDECREF(ds_seq);
    Py_XDECREF(hs_seq);
    Py_XDECREF(columns);
    PyMem_Free(ids);
    PyMem_Free(entries);
    return result;
}

static PyMethodDef methods[] = {
    {"plan", plan, METH_VARARGS,
     "plan(layout, ids, slots, device_sizes, host_sizes, skip, store) -> (columns, count, nbytes): the coalesced "
     "copies of a device<->host job (see the module's source for the layout)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockplan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockplan(void) { return PyModule_Create(&module); }
