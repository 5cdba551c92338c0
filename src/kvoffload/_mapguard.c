/* Guarded mappings: a shared-memory file truncated under us costs the copy in flight, not the process.
 *
 * The node pool maps files on a tmpfs (MAP_SHARED) and copies KV blocks in and out of them: torch copies (maybe
 * in OpenMP threads) and our own C code reading the index. If another process truncates such a file, any access
 * beyond its new end raises SIGBUS, which kills the engine. We cannot longjmp out of torch code, so instead:
 * - A process-wide SIGBUS handler (SA_SIGINFO | SA_ONSTACK) looks up si_addr in a fixed table of registered
 *   ranges. On a hit it replaces the WHOLE range with anonymous zero pages (mmap MAP_FIXED | MAP_PRIVATE |
 *   MAP_ANONYMOUS: async-signal-safe in practice), marks the range lost and returns; the faulting instruction
 *   re-runs on the zero pages and the copy finishes with garbage, which the caller discards because lost() says
 *   so. One thread remaps a range at a time: another that faults in it meanwhile returns and faults again until
 *   the remap is done.
 * - A fault outside every range goes to the handler installed before ours (Python's faulthandler keeps working):
 *   a function is called; for SIG_DFL or SIG_IGN the default is restored and the fault re-runs and kills as before
 *   (a SIGBUS sent by kill() is raised again, or ignored under SIG_IGN). A handler installed after ours (say
 *   faulthandler.enable() after the first guard) runs first and sees every fault: enable it before.
 * - The handler takes no lock and allocates nothing: it reads the table with atomic loads. Registration (guard,
 *   unguard) runs under the GIL, so it needs no lock either; an entry is published by its in-use flag, written
 *   last.
 *
 * guard(buffer) holds the buffer (an export of the mmap, so it cannot be closed or resized) until unguard(id): a
 * range must not be unmapped while guarded, or a later mapping at its address would have its faults swallowed.
 * The buffer must start on a page (an mmap does); its length is rounded up to whole pages for the remap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RANGES 256

enum { INTACT = 0, REMAPPING = 1, LOST = 2 };

typedef struct {
    uintptr_t base;
    uintptr_t len;   /* rounded up to whole pages */
    int in_use;      /* written last by guard, first by unguard: the handler ignores an entry without it */
    int state;       /* INTACT, REMAPPING (a handler is replacing it), LOST */
} Range;

static Range ranges[MAX_RANGES];       /* read by the handler: atomic loads only */
static Py_buffer views[MAX_RANGES];    /* the buffers held, touched only under the GIL */
static struct sigaction previous;      /* written once, before our handler is installed */
static int installed;
static uintptr_t page_size;
static uint64_t fault_count;

static void pass_on(int sig, siginfo_t *info, void *context) {
    /* A fault outside our ranges (or one we could not repair): what would have happened without us. */
    int sent = info->si_code <= 0; /* kill(), raise(), sigqueue(): no instruction re-runs */
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, context);
    } else if (previous.sa_handler == SIG_IGN) {
        if (!sent) {
            struct sigaction dfl;
            memset(&dfl, 0, sizeof dfl);
            dfl.sa_handler = SIG_DFL;
            sigaction(SIGBUS, &dfl, NULL);
        }
    } else if (previous.sa_handler == SIG_DFL) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGBUS, &dfl, NULL);
        if (sent) raise(SIGBUS); /* blocked until we return, then it kills */
    } else {
        previous.sa_handler(sig);
    }
}

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    int saved_errno = errno;
    uintptr_t addr = (uintptr_t)info->si_addr;
    if (info->si_code > 0) { /* raised by the kernel for an access: si_addr is meaningful */
        for (int i = 0; i < MAX_RANGES; i++) {
            Range *r = &ranges[i];
            if (!__atomic_load_n(&r->in_use, __ATOMIC_ACQUIRE)) continue;
            uintptr_t base = __atomic_load_n(&r->base, __ATOMIC_RELAXED);
            uintptr_t len = __atomic_load_n(&r->len, __ATOMIC_RELAXED);
            if (addr < base || addr - base >= len) continue;
            __atomic_add_fetch(&fault_count, 1, __ATOMIC_RELAXED);
            int state = __atomic_load_n(&r->state, __ATOMIC_ACQUIRE);
            do {
                if (state == REMAPPING) { /* another thread is at it: re-run, and fault again until it is done */
                    errno = saved_errno;
                    return;
                }
                /* INTACT, or LOST and faulting again (it should not): remap (again) rather than loop forever */
            } while (!__atomic_compare_exchange_n(&r->state, &state, REMAPPING, 0, __ATOMIC_ACQ_REL,
                                                  __ATOMIC_ACQUIRE));
            void *p = mmap((void *)base, len, PROT_READ | PROT_WRITE,
                           MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) {
                __atomic_store_n(&r->state, INTACT, __ATOMIC_RELEASE);
                break; /* cannot repair: die as we would have */
            }
            __atomic_store_n(&r->state, LOST, __ATOMIC_RELEASE);
            errno = saved_errno;
            return;
        }
    }
    pass_on(sig, info, context);
    errno = saved_errno;
}

static int install(void) {
    if (installed) return 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    /* The previous handler is read first: the kernel writes the old action back only after the new one is live,
     * so a fault in another thread in between would find `previous` half written. */
    if (sigaction(SIGBUS, NULL, &previous) != 0 || sigaction(SIGBUS, &action, NULL) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    installed = 1;
    return 0;
}

static int check_id(long id) {
    if (id < 0 || id >= MAX_RANGES || !__atomic_load_n(&ranges[id].in_use, __ATOMIC_ACQUIRE)) {
        PyErr_Format(PyExc_ValueError, "no guarded range %ld", id);
        return -1;
    }
    return 0;
}

static PyObject *py_guard(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O:guard", &obj)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0) return NULL;
    uintptr_t base = (uintptr_t)view.buf;
    if (view.len <= 0 || base % page_size) {
        PyErr_Format(PyExc_ValueError, "guard needs a non-empty buffer that starts on a page (an mmap), not %zd "
                     "bytes at offset %zu in a page", view.len, (size_t)(base % page_size));
        PyBuffer_Release(&view);
        return NULL;
    }
    if (install() < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    for (long i = 0; i < MAX_RANGES; i++) {
        Range *r = &ranges[i];
        if (__atomic_load_n(&r->in_use, __ATOMIC_ACQUIRE)) continue;
        views[i] = view;
        __atomic_store_n(&r->base, base, __ATOMIC_RELAXED);
        __atomic_store_n(&r->len, ((uintptr_t)view.len + page_size - 1) / page_size * page_size, __ATOMIC_RELAXED);
        __atomic_store_n(&r->state, INTACT, __ATOMIC_RELAXED);
        __atomic_store_n(&r->in_use, 1, __ATOMIC_RELEASE);
        return PyLong_FromLong(i);
    }
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_RuntimeError, "all %d guarded ranges are in use", MAX_RANGES);
    return NULL;
}

static PyObject *py_lost(PyObject *self, PyObject *args) {
    long id;
    if (!PyArg_ParseTuple(args, "l:lost", &id) || check_id(id) < 0) return NULL;
    return PyBool_FromLong(__atomic_load_n(&ranges[id].state, __ATOMIC_ACQUIRE) != INTACT);
}

static PyObject *py_unguard(PyObject *self, PyObject *args) {
    long id;
    if (!PyArg_ParseTuple(args, "l:unguard", &id) || check_id(id) < 0) return NULL;
    __atomic_store_n(&ranges[id].in_use, 0, __ATOMIC_RELEASE);
    PyBuffer_Release(&views[id]);
    memset(&views[id], 0, sizeof views[id]);
    Py_RETURN_NONE;
}

static PyObject *py_faults(PyObject *self, PyObject *args) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&fault_count, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"guard", py_guard, METH_VARARGS, "Guard a writable, page-aligned buffer (an mmap): its id."},
    {"lost", py_lost, METH_VARARGS, "Whether a SIGBUS replaced the range with zero pages."},
    {"unguard", py_unguard, METH_VARARGS, "Forget a range and release its buffer (before the mmap is closed)."},
    {"faults", py_faults, METH_NOARGS, "SIGBUS faults handled in guarded ranges, in all."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mapguard", "Guarded mappings: SIGBUS on a truncated "
                                    "shared-memory file replaces the range with zero pages.", -1, methods};

PyMODINIT_FUNC PyInit__mapguard(void) {
    long page = sysconf(_SC_PAGESIZE);
    page_size = page > 0 ? (uintptr_t)page : 4096;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_RANGES", MAX_RANGES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
