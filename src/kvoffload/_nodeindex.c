/* The node tier's shared index: key -> slot, slot states, pins and a CLOCK hand, in one shared-memory segment
 * that every engine on a machine maps (kvoffload/tiers/node/segment.py creates, checks and maps it).
 *
 * Concurrency without a server:
 * - Writers (reserve, complete, pin, unpin, release, reset) hold one process-shared robust mutex. Each bumps a
 *   sequence counter to odd before changing the table and back to even after, so lookups (the hot path: a whole
 *   prompt's keys every scheduler step) read without the mutex and retry when a writer overlapped them; they only
 *   wait on a writer after a few retries. One engine's lookup thus never waits on another's eviction.
 * - Pins are a bit per attached engine in each slot, so a dead engine's pins are cleared without knowing counts;
 *   an engine counts its own repeated pins itself.
 * - Crash safety: a slot changes state by one store, its other fields written while it is FREE or IN_FLIGHT under
 *   its owner; the hash table is derived from the slots. An engine killed holding the mutex leaves EOWNERDEAD to
 *   the next holder, which rebuilds the table from the slots and releases the dead engine's pins and in-flight
 *   slots (the holder is recorded on every lock).
 * - Every reuse of a slot gives it a new epoch (never 0), so a reader whose slot was rewritten under it sees a
 *   different epoch after its copy and fails the load (verify).
 *
 * Functions take the mapped segment (a writable buffer; verify and stats also accept a read-only one) and
 * keys as one bytes object of 16-byte keys.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAGIC 0x313065646f6e766bULL /* "kvnode01" little endian */
#define VERSION 2 /* 2: an engine is alive while it holds its byte of the "engines" file (tiers/node/liveness.py) */
#define KEY 16
#define MAX_ATTACH 64
#define EMPTY (-1)
#define LOCKFREE_TRIES 8

enum { FREE = 0, IN_FLIGHT = 1, READY = 2 };

typedef struct {
    uint64_t pid;
    uint64_t start; /* process start time (clock ticks since boot): a reused pid is another process */
    uint64_t pidns; /* inode of its pid namespace: only an engine of the same namespace can tell it is dead */
} Attachment;

typedef struct {
    uint64_t magic; /* written last at init, so a half-made segment never has it */
    uint32_t version;
    uint32_t header_bytes;
    uint8_t fingerprint[KEY];
    uint64_t num_slots;
    uint64_t slot_bytes;
    uint64_t table_size;
    uint64_t total_bytes;
    union {
        pthread_mutex_t lock;
        uint8_t lock_room[64];
    };
    uint64_t seq;
    uint64_t hand;
    uint64_t next_epoch;
    uint64_t used;
    int64_t holder; /* attachment holding the mutex, -1 none */
    uint64_t stores, evictions, cross_hits, repairs, reclaimed;
    Attachment att[MAX_ATTACH];
    uint64_t served[MAX_ATTACH]; /* per attachment: pins other engines took on blocks it stored */
} Header;

typedef struct {
    uint8_t key[KEY];
    uint64_t epoch;
    uint64_t pins;
    uint8_t state;
    uint8_t owner; /* the engine that reserved it (and wrote it) */
    uint8_t ref;   /* CLOCK reference bit */
    uint8_t mark;  /* reserve: protected from eviction in this call */
    uint8_t pad[4];
} Slot;

typedef struct {
    Header *h;
    Slot *slots;
    int32_t *table;
    uint64_t mask;
} Seg;

static size_t header_size(void) { return (sizeof(Header) + 63) & ~(size_t)63; }

static size_t segment_size(uint64_t num_slots, uint64_t table_size) {
    return header_size() + num_slots * sizeof(Slot) + table_size * sizeof(int32_t);
}

static void bind(Seg *s, void *base) {
    s->h = (Header *)base;
    s->slots = (Slot *)((char *)base + header_size());
    s->table = (int32_t *)((char *)s->slots + s->h->num_slots * sizeof(Slot));
    s->mask = s->h->table_size - 1;
}

/* Map a buffer; 0 with an exception set when it is not a segment this module made. */
static int open_seg(PyObject *obj, Py_buffer *view, Seg *s, int writable) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return 0;
    Header *h = (Header *)view->buf;
    if ((size_t)view->len < sizeof(Header) || h->magic != MAGIC || h->version != VERSION ||
        h->total_bytes != (uint64_t)view->len ||
        segment_size(h->num_slots, h->table_size) != (size_t)view->len) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "not a node index segment of this version");
        return 0;
    }
    bind(s, view->buf);
    return 1;
}

static uint64_t home(const uint8_t *key) {
    uint64_t v;
    memcpy(&v, key, sizeof v);
    return v;
}

static int64_t find(Seg *s, const uint8_t *key) {
    uint64_t i = home(key) & s->mask;
    for (uint64_t n = 0; n <= s->mask; n++, i = (i + 1) & s->mask) {
        int32_t slot = __atomic_load_n(&s->table[i], __ATOMIC_RELAXED);
        if (slot == EMPTY) return -1;
        if ((uint64_t)slot < s->h->num_slots && memcmp(s->slots[slot].key, key, KEY) == 0) return slot;
    }
    return -1;
}

static void insert(Seg *s, const uint8_t *key, int32_t slot) {
    uint64_t i = home(key) & s->mask;
    while (s->table[i] != EMPTY) i = (i + 1) & s->mask;
    s->table[i] = slot;
}

/* Linear probing, backward-shift deletion: no tombstones, so probes stay short however long the pool runs. */
static void erase(Seg *s, const uint8_t *key) {
    uint64_t i = home(key) & s->mask;
    for (;; i = (i + 1) & s->mask) {
        int32_t slot = s->table[i];
        if (slot == EMPTY) return;
        if (memcmp(s->slots[slot].key, key, KEY) == 0) break;
    }
    for (uint64_t j = (i + 1) & s->mask;; j = (j + 1) & s->mask) {
        int32_t slot = s->table[j];
        if (slot == EMPTY) break;
        uint64_t k = home(s->slots[slot].key) & s->mask;
        int movable = (j > i) ? (k <= i || k > j) : (k <= i && k > j);
        if (movable) {
            s->table[i] = slot;
            i = j;
        }
    }
    s->table[i] = EMPTY;
}

static void set_state(Slot *slot, uint8_t state) { __atomic_store_n(&slot->state, state, __ATOMIC_RELEASE); }

static void free_slot(Seg *s, int64_t i) {
    erase(s, s->slots[i].key);
    set_state(&s->slots[i], FREE);
    s->slots[i].pins = 0;
    s->h->used--;
}

static void write_begin(Seg *s) {
    __atomic_add_fetch(&s->h->seq, 1, __ATOMIC_ACQ_REL);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static void write_end(Seg *s) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_add_fetch(&s->h->seq, 1, __ATOMIC_ACQ_REL);
}

/* Release everything attachment ``a`` holds: its pins, its in-flight slots and its entry. */
static void release(Seg *s, int a) {
    uint64_t bit = 1ULL << a;
    for (uint64_t i = 0; i < s->h->num_slots; i++) {
        Slot *slot = &s->slots[i];
        slot->pins &= ~bit;
        if (slot->state == IN_FLIGHT && slot->owner == a) free_slot(s, (int64_t)i);
    }
    memset(&s->h->att[a], 0, sizeof(Attachment));
}

/* After a writer died mid-change: the slots are the truth; rebuild the table and the counts from them. */
static void repair(Seg *s) {
    Header *h = s->h;
    for (uint64_t i = 0; i <= s->mask; i++) s->table[i] = EMPTY;
    h->used = 0;
    for (uint64_t i = 0; i < h->num_slots; i++) {
        Slot *slot = &s->slots[i];
        slot->mark = 0;
        if (slot->state != IN_FLIGHT && slot->state != READY) slot->state = FREE;
        if (slot->state == FREE) {
            slot->pins = 0;
            continue;
        }
        if (find(s, slot->key) >= 0) { /* a key in two slots: keep the first */
            slot->state = FREE;
            slot->pins = 0;
            continue;
        }
        insert(s, slot->key, (int32_t)i);
        h->used++;
    }
    if (h->holder >= 0 && h->holder < MAX_ATTACH) release(s, (int)h->holder);
    h->holder = -1;
    if (h->seq & 1) h->seq++;
    h->repairs++;
}

/* Lock the segment for attachment ``a``; 0 with an exception set when the mutex cannot be had. */
static int lock(Seg *s, int a) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_mutex_lock(&s->h->lock);
    Py_END_ALLOW_THREADS
    if (rc == EOWNERDEAD) {
        repair(s);
        pthread_mutex_consistent(&s->h->lock);
    } else if (rc != 0) {
        PyErr_Format(PyExc_OSError, "node index: cannot lock the segment: %s", strerror(rc));
        return 0;
    }
    s->h->holder = a;
    return 1;
}

static void unlock(Seg *s) {
    s->h->holder = -1;
    pthread_mutex_unlock(&s->h->lock);
}

static int check_attachment(int a) {
    if (a < 0 || a >= MAX_ATTACH) {
        PyErr_Format(PyExc_ValueError, "attachment %d is outside [0, %d)", a, MAX_ATTACH);
        return 0;
    }
    return 1;
}

static int check_keys(Py_buffer *keys) {
    if (keys->len % KEY) {
        PyErr_Format(PyExc_ValueError, "keys must be 16-byte keys, got %zd bytes", keys->len);
        return 0;
    }
    return 1;
}

/* init(buffer, num_slots, slot_bytes, table_size, fingerprint): format a new segment (the caller holds it alone). */
static PyObject *py_init(PyObject *self, PyObject *args) {
    Py_buffer view, fp;
    unsigned long long num_slots, slot_bytes, table_size;
    if (!PyArg_ParseTuple(args, "w*KKKy*", &view, &num_slots, &slot_bytes, &table_size, &fp)) return NULL;
    PyObject *result = NULL;
    if (fp.len != KEY || num_slots == 0 || num_slots > INT32_MAX || table_size < 2 * num_slots ||
        (table_size & (table_size - 1)) || segment_size(num_slots, table_size) != (size_t)view.len) {
        PyErr_SetString(PyExc_ValueError, "init: bad fingerprint, sizes or buffer length");
        goto done;
    }
    memset(view.buf, 0, (size_t)view.len);
    Header *h = (Header *)view.buf;
    h->version = VERSION;
    h->header_bytes = (uint32_t)header_size();
    memcpy(h->fingerprint, fp.buf, KEY);
    h->num_slots = num_slots;
    h->slot_bytes = slot_bytes;
    h->table_size = table_size;
    h->total_bytes = (uint64_t)view.len;
    h->next_epoch = 1;
    h->holder = -1;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(&h->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc) {
        PyErr_Format(PyExc_OSError, "init: pthread_mutex_init: %s", strerror(rc));
        goto done;
    }
    int32_t *table = (int32_t *)((char *)view.buf + header_size() + num_slots * sizeof(Slot));
    for (uint64_t i = 0; i < table_size; i++) table[i] = EMPTY;
    __atomic_store_n(&h->magic, MAGIC, __ATOMIC_RELEASE);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&fp);
    PyBuffer_Release(&view);
    return result;
}

/* size(num_slots, table_size) -> bytes of a segment. */
static PyObject *py_size(PyObject *self, PyObject *args) {
    unsigned long long num_slots, table_size;
    if (!PyArg_ParseTuple(args, "KK", &num_slots, &table_size)) return NULL;
    return PyLong_FromSize_t(segment_size(num_slots, table_size));
}

/* attach(buffer, pid, start, pidns) -> attachment id, or -1 when every entry is taken. */
static PyObject *py_attach(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long pid, start, pidns;
    if (!PyArg_ParseTuple(args, "OKKK", &obj, &pid, &start, &pidns)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    long found = -1;
    if (lock(&s, -1)) {
        for (int a = 0; a < MAX_ATTACH && found < 0; a++) {
            if (s.h->att[a].pid == 0) {
                /* pid last: an engine killed in between leaves a free entry, never one that looks alive */
                s.h->served[a] = 0;
                s.h->att[a].start = start;
                s.h->att[a].pidns = pidns;
                __atomic_store_n(&s.h->att[a].pid, pid, __ATOMIC_RELEASE);
                found = a;
            }
        }
        unlock(&s);
    }
    PyBuffer_Release(&view);
    return PyErr_Occurred() ? NULL : PyLong_FromLong(found);
}

/* attachments(buffer) -> [(id, pid, start, pidns)] of the attached engines. */
static PyObject *py_attachments(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    PyObject *out = PyList_New(0);
    for (int a = 0; out && a < MAX_ATTACH; a++) {
        Attachment at = s.h->att[a];
        if (at.pid == 0) continue;
        PyObject *item = Py_BuildValue("(iKKK)", a, (unsigned long long)at.pid, (unsigned long long)at.start,
                                       (unsigned long long)at.pidns);
        if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    PyBuffer_Release(&view);
    return out;
}

/* release(buffer, attachment, pid, start, dead) -> whether released: a dead (or detaching) engine's pins, in-flight
 * slots and entry go, if the entry is still that process's (another engine may have released it and a new one
 * taken the entry since the caller looked). */
static PyObject *py_release(PyObject *self, PyObject *args) {
    PyObject *obj;
    int a, dead;
    unsigned long long pid, start;
    if (!PyArg_ParseTuple(args, "OiKKp", &obj, &a, &pid, &start, &dead) || !check_attachment(a)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    int released = 0;
    if (lock(&s, -1)) {
        write_begin(&s);
        if (s.h->att[a].pid == pid && s.h->att[a].start == start && pid != 0) {
            release(&s, a);
            s.h->reclaimed += dead;
            released = 1;
        }
        write_end(&s);
        unlock(&s);
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(released);
}

/* The leading ready keys, and whether the first other one is in flight for ``a`` itself. */
static void scan(Seg *s, const uint8_t *keys, Py_ssize_t n, int a, Py_ssize_t *hits, int *pending) {
    *hits = 0;
    *pending = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = find(s, keys + i * KEY);
        uint8_t state = slot < 0 ? FREE : __atomic_load_n(&s->slots[slot].state, __ATOMIC_ACQUIRE);
        if (state != READY) {
            *pending = state == IN_FLIGHT && s->slots[slot].owner == a;
            return;
        }
        (*hits)++;
    }
}

/* lookup(buffer, attachment, keys) -> (hits, pending). Reads without the mutex (see the top of this file). */
static PyObject *py_lookup(PyObject *self, PyObject *args) {
    PyObject *obj;
    int a;
    Py_buffer keys;
    if (!PyArg_ParseTuple(args, "Oiy*", &obj, &a, &keys)) return NULL;
    Py_buffer view;
    Seg s;
    Py_ssize_t hits = 0;
    int pending = 0, done = 0;
    if (!check_keys(&keys) || !open_seg(obj, &view, &s, 1)) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t n = keys.len / KEY;
    for (int t = 0; t < LOCKFREE_TRIES && !done; t++) {
        uint64_t before = __atomic_load_n(&s.h->seq, __ATOMIC_ACQUIRE);
        if (before & 1) continue;
        scan(&s, keys.buf, n, a, &hits, &pending);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        done = __atomic_load_n(&s.h->seq, __ATOMIC_ACQUIRE) == before;
    }
    if (!done && lock(&s, a)) { /* writers kept overlapping (or one died): ask under the mutex */
        scan(&s, keys.buf, n, a, &hits, &pending);
        unlock(&s);
        done = 1;
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&keys);
    if (!done) return NULL;
    return Py_BuildValue("(nO)", hits, pending ? Py_True : Py_False);
}

/* touch(buffer, keys): set the CLOCK bit of the keys found. A hint: a race sets a bit on a wrong slot at worst. */
static PyObject *py_touch(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_buffer keys;
    if (!PyArg_ParseTuple(args, "Oy*", &obj, &keys)) return NULL;
    Py_buffer view;
    Seg s;
    if (!check_keys(&keys) || !open_seg(obj, &view, &s, 1)) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < keys.len / KEY; i++) {
        int64_t slot = find(&s, (const uint8_t *)keys.buf + i * KEY);
        if (slot >= 0) __atomic_store_n(&s.slots[slot].ref, 1, __ATOMIC_RELAXED);
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&keys);
    Py_RETURN_NONE;
}

/* pin(buffer, attachment, keys) -> [(slot, epoch)], (-1, 0) for a key that is not ready. */
static PyObject *py_pin(PyObject *self, PyObject *args) {
    PyObject *obj;
    int a;
    Py_buffer keys;
    if (!PyArg_ParseTuple(args, "Oiy*", &obj, &a, &keys)) return NULL;
    Py_buffer view;
    Seg s;
    PyObject *out = NULL;
    if (!check_attachment(a) || !check_keys(&keys) || !open_seg(obj, &view, &s, 1)) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t n = keys.len / KEY;
    if (lock(&s, a)) {
        out = PyList_New(n);
        for (Py_ssize_t i = 0; out && i < n; i++) {
            int64_t slot = find(&s, (const uint8_t *)keys.buf + i * KEY);
            uint64_t epoch = 0;
            if (slot >= 0 && s.slots[slot].state == READY) {
                s.slots[slot].pins |= 1ULL << a;
                epoch = s.slots[slot].epoch;
                if (s.slots[slot].owner != a) {
                    s.h->cross_hits++;
                    s.h->served[s.slots[slot].owner]++;
                }
            } else {
                slot = -1;
            }
            PyObject *item = Py_BuildValue("(LK)", (long long)slot, (unsigned long long)epoch);
            if (!item) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, item);
        }
        unlock(&s);
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&keys);
    return out;
}

/* Parse (buffer, attachment, [slots], [epochs], flag) for unpin and complete. */
typedef struct {
    Py_buffer view;
    Seg s;
    int a, flag;
    Py_ssize_t n;
    PyObject *slots, *epochs;
} SlotArgs;

static int slot_args(PyObject *args, SlotArgs *x) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "OiOOp", &obj, &x->a, &x->slots, &x->epochs, &x->flag)) return 0;
    if (!check_attachment(x->a)) return 0;
    if (!PyList_Check(x->slots) || !PyList_Check(x->epochs) || PyList_GET_SIZE(x->slots) != PyList_GET_SIZE(x->epochs)) {
        PyErr_SetString(PyExc_TypeError, "slots and epochs must be lists of one length");
        return 0;
    }
    x->n = PyList_GET_SIZE(x->slots);
    return open_seg(obj, &x->view, &x->s, 1);
}

/* The slot at ``i`` of the lists when it still holds that epoch, else -1 (an exception set on a bad item). */
static int64_t slot_at(SlotArgs *x, Py_ssize_t i) {
    long long slot = PyLong_AsLongLong(PyList_GET_ITEM(x->slots, i));
    unsigned long long epoch = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(x->epochs, i));
    if (PyErr_Occurred()) return -1;
    if (slot < 0 || (uint64_t)slot >= x->s.h->num_slots || x->s.slots[slot].epoch != epoch) return -1;
    return slot;
}

/* unpin(buffer, attachment, slots, epochs, drop): this engine's pins go; ``drop`` (a failed load) also frees the
 * slots no one else pins. */
static PyObject *py_unpin(PyObject *self, PyObject *args) {
    SlotArgs x;
    if (!slot_args(args, &x)) return NULL;
    if (lock(&x.s, x.a)) {
        write_begin(&x.s);
        for (Py_ssize_t i = 0; i < x.n && !PyErr_Occurred(); i++) {
            int64_t slot = slot_at(&x, i);
            if (slot < 0) continue;
            Slot *sl = &x.s.slots[slot];
            sl->pins &= ~(1ULL << x.a);
            if (x.flag && sl->pins == 0 && sl->state == READY) free_slot(&x.s, slot);
        }
        write_end(&x.s);
        unlock(&x.s);
    }
    PyBuffer_Release(&x.view);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* complete(buffer, attachment, slots, epochs, success): this engine's stores become ready, or are forgotten. */
static PyObject *py_complete(PyObject *self, PyObject *args) {
    SlotArgs x;
    if (!slot_args(args, &x)) return NULL;
    if (lock(&x.s, x.a)) {
        write_begin(&x.s);
        for (Py_ssize_t i = 0; i < x.n && !PyErr_Occurred(); i++) {
            int64_t slot = slot_at(&x, i);
            if (slot < 0 || x.s.slots[slot].state != IN_FLIGHT || x.s.slots[slot].owner != x.a) continue;
            if (x.flag) {
                x.s.slots[slot].ref = 1;
                set_state(&x.s.slots[slot], READY);
                x.s.h->stores++;
            } else {
                free_slot(&x.s, slot);
            }
        }
        write_end(&x.s);
        unlock(&x.s);
    }
    PyBuffer_Release(&x.view);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* CLOCK: up to ``need`` slots that are free or ready, unpinned, unmarked and unreferenced, the hand moving on and
 * clearing reference bits as it passes. Two turns at most; fewer found means no room (nothing evicted yet). */
static Py_ssize_t sweep(Seg *s, int64_t *found, Py_ssize_t need) {
    Py_ssize_t got = 0;
    uint64_t n = s->h->num_slots;
    for (uint64_t step = 0; step < 2 * n && got < need; step++) {
        uint64_t i = s->h->hand;
        s->h->hand = (i + 1) % n;
        Slot *slot = &s->slots[i];
        if (slot->state == FREE && !slot->mark) {
            found[got++] = (int64_t)i;
            slot->mark = 1;
        } else if (slot->state == READY && slot->pins == 0 && !slot->mark) {
            if (slot->ref) {
                slot->ref = 0;
            } else {
                found[got++] = (int64_t)i;
                slot->mark = 1;
            }
        }
    }
    return got;
}

/* reserve(buffer, attachment, keys) -> None (no room: nothing changed) or
 * ([positions of the keys to store], [slots], [epochs], evicted keys as bytes). Keys already held (ready or in
 * flight, by any engine) are left out and protected from this call's evictions. */
static PyObject *py_reserve(PyObject *self, PyObject *args) {
    PyObject *obj;
    int a;
    Py_buffer keys;
    if (!PyArg_ParseTuple(args, "Oiy*", &obj, &a, &keys)) return NULL;
    Py_buffer view;
    Seg s;
    PyObject *out = NULL;
    if (!check_attachment(a) || !check_keys(&keys) || !open_seg(obj, &view, &s, 1)) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    const uint8_t *k = keys.buf;
    Py_ssize_t n = keys.len / KEY;
    Py_ssize_t *fresh = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    int64_t *held = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    int64_t *victims = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    if (!fresh || !held || !victims) {
        PyErr_NoMemory();
        goto done;
    }
    if (!lock(&s, a)) goto done;
    write_begin(&s);
    Py_ssize_t need = 0, nheld = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = find(&s, k + i * KEY);
        if (slot >= 0) {
            held[nheld++] = slot;
            s.slots[slot].mark = 1;
        } else {
            fresh[need++] = i;
        }
    }
    Py_ssize_t got = sweep(&s, victims, need);
    for (Py_ssize_t i = 0; i < nheld; i++) s.slots[held[i]].mark = 0;
    for (Py_ssize_t i = 0; i < got; i++) s.slots[victims[i]].mark = 0;
    if (got < need) {
        write_end(&s);
        unlock(&s);
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    PyObject *positions = PyList_New(need), *slots = PyList_New(need), *epochs = PyList_New(need);
    PyObject *evicted = PyBytes_FromStringAndSize(NULL, need * KEY);
    Py_ssize_t nevicted = 0;
    if (positions && slots && epochs && evicted) {
        char *ev = PyBytes_AS_STRING(evicted);
        for (Py_ssize_t i = 0; i < need; i++) {
            Slot *slot = &s.slots[victims[i]];
            if (slot->state == READY) {
                memcpy(ev + nevicted++ * KEY, slot->key, KEY);
                free_slot(&s, victims[i]);
                s.h->evictions++;
            }
            /* FREE now: its fields are ours to write; IN_FLIGHT under this owner makes them visible. */
            slot->owner = (uint8_t)a;
            slot->pins = 0;
            slot->ref = 0;
            slot->epoch = s.h->next_epoch++;
            memcpy(slot->key, k + fresh[i] * KEY, KEY);
            set_state(slot, IN_FLIGHT);
            insert(&s, slot->key, (int32_t)victims[i]);
            s.h->used++;
            PyList_SET_ITEM(positions, i, PyLong_FromSsize_t(fresh[i]));
            PyList_SET_ITEM(slots, i, PyLong_FromLongLong(victims[i]));
            PyList_SET_ITEM(epochs, i, PyLong_FromUnsignedLongLong(slot->epoch));
        }
    }
    write_end(&s);
    unlock(&s);
    if (positions && slots && epochs && evicted && !PyErr_Occurred() &&
        _PyBytes_Resize(&evicted, nevicted * KEY) == 0) {
        out = Py_BuildValue("(NNNN)", positions, slots, epochs, evicted);
    } else {
        Py_XDECREF(positions);
        Py_XDECREF(slots);
        Py_XDECREF(epochs);
        Py_XDECREF(evicted);
    }
done:
    PyMem_Free(fresh);
    PyMem_Free(held);
    PyMem_Free(victims);
    PyBuffer_Release(&view);
    PyBuffer_Release(&keys);
    return out;
}

/* reset(buffer, attachment) -> count: drop the ready, unpinned blocks this engine wrote. */
static PyObject *py_reset(PyObject *self, PyObject *args) {
    PyObject *obj;
    int a;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &a) || !check_attachment(a)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    long dropped = 0;
    if (lock(&s, a)) {
        write_begin(&s);
        for (uint64_t i = 0; i < s.h->num_slots; i++) {
            Slot *slot = &s.slots[i];
            if (slot->state == READY && slot->owner == a && slot->pins == 0) {
                free_slot(&s, (int64_t)i);
                dropped++;
            }
        }
        write_end(&s);
        unlock(&s);
    }
    PyBuffer_Release(&view);
    return PyErr_Occurred() ? NULL : PyLong_FromLong(dropped);
}

/* verify(buffer, slots, epochs) -> True when every slot is ready and still holds its epoch (a worker's check). */
static PyObject *py_verify(PyObject *self, PyObject *args) {
    PyObject *obj, *slots, *epochs;
    if (!PyArg_ParseTuple(args, "OO!O!", &obj, &PyTuple_Type, &slots, &PyTuple_Type, &epochs)) return NULL;
    if (PyTuple_GET_SIZE(slots) != PyTuple_GET_SIZE(epochs)) {
        PyErr_SetString(PyExc_ValueError, "verify: slots and epochs differ in length");
        return NULL;
    }
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    int ok = 1;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(slots); i++) {
        long long slot = PyLong_AsLongLong(PyTuple_GET_ITEM(slots, i));
        unsigned long long epoch = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(epochs, i));
        if (PyErr_Occurred()) break;
        ok = slot >= 0 && (uint64_t)slot < s.h->num_slots && epoch != 0 &&
             __atomic_load_n(&s.slots[slot].epoch, __ATOMIC_ACQUIRE) == epoch &&
             __atomic_load_n(&s.slots[slot].state, __ATOMIC_ACQUIRE) == READY;
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(ok);
}

/* stats(buffer) -> dict of the pool's counters. */
static PyObject *py_stats(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    Header *h = s.h;
    int attached = 0;
    for (int a = 0; a < MAX_ATTACH; a++) attached += h->att[a].pid != 0;
    PyObject *out = Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsi}", "capacity", (unsigned long long)h->num_slots, "used", (unsigned long long)h->used,
        "slot_bytes", (unsigned long long)h->slot_bytes, "stores", (unsigned long long)h->stores,
        "evictions", (unsigned long long)h->evictions, "cross_hits", (unsigned long long)h->cross_hits,
        "repairs", (unsigned long long)h->repairs, "reclaimed", (unsigned long long)h->reclaimed, "attached", attached);
    if (out) {
        PyObject *fp = PyBytes_FromStringAndSize((const char *)h->fingerprint, KEY);
        if (!fp || PyDict_SetItemString(out, "fingerprint", fp) < 0) Py_CLEAR(out);
        Py_XDECREF(fp);
    }
    PyBuffer_Release(&view);
    return out;
}

/* served(buffer, attachment) -> pins other engines took on blocks this attachment stored, since it attached. */
static PyObject *py_served(PyObject *self, PyObject *args) {
    PyObject *obj;
    int a;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &a) || !check_attachment(a)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    unsigned long long served = __atomic_load_n(&s.h->served[a], __ATOMIC_RELAXED);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(served);
}

/* check(buffer, attachment) -> None, or the first broken law as a string. */
static PyObject *py_check(PyObject *self, PyObject *args) {
    PyObject *obj;
    int a;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &a)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    char problem[200] = "";
    if (lock(&s, a)) {
        Header *h = s.h;
        uint64_t used = 0, entries = 0, live = 0;
        for (int i = 0; i < MAX_ATTACH; i++) live |= (uint64_t)(h->att[i].pid != 0) << i;
        for (uint64_t i = 0; i < h->num_slots && !*problem; i++) {
            Slot *slot = &s.slots[i];
            if (slot->state > READY) snprintf(problem, sizeof problem, "slot %llu has state %u", (unsigned long long)i, slot->state);
            else if (slot->state == FREE && slot->pins) snprintf(problem, sizeof problem, "free slot %llu is pinned", (unsigned long long)i);
            else if (slot->pins & ~live) snprintf(problem, sizeof problem, "slot %llu is pinned by a detached engine", (unsigned long long)i);
            else if (slot->state == IN_FLIGHT && !((live >> slot->owner) & 1)) snprintf(problem, sizeof problem, "slot %llu is in flight for a detached engine", (unsigned long long)i);
            else if (slot->mark) snprintf(problem, sizeof problem, "slot %llu is left marked", (unsigned long long)i);
            else if (slot->state != FREE && find(&s, slot->key) != (int64_t)i) snprintf(problem, sizeof problem, "slot %llu's key is not indexed to it", (unsigned long long)i);
            used += slot->state != FREE;
        }
        for (uint64_t i = 0; i <= s.mask && !*problem; i++) {
            int32_t slot = s.table[i];
            if (slot == EMPTY) continue;
            entries++;
            if ((uint64_t)slot >= h->num_slots || s.slots[slot].state == FREE)
                snprintf(problem, sizeof problem, "table entry %llu names slot %d, which holds no key", (unsigned long long)i, slot);
        }
        if (!*problem && (used != h->used || entries != used))
            snprintf(problem, sizeof problem, "%llu slots hold keys, the count says %llu, the table has %llu entries",
                     (unsigned long long)used, (unsigned long long)h->used, (unsigned long long)entries);
        if (!*problem && (h->seq & 1)) snprintf(problem, sizeof problem, "the sequence counter is odd outside a write");
        unlock(&s);
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return NULL;
    if (!*problem) Py_RETURN_NONE;
    return PyUnicode_FromString(problem);
}

static PyMethodDef methods[] = {
    {"init", py_init, METH_VARARGS, "Format a new segment."},
    {"size", py_size, METH_VARARGS, "Bytes of a segment of num_slots slots and table_size table entries."},
    {"attach", py_attach, METH_VARARGS, "Register an engine; its attachment id, or -1 when full."},
    {"attachments", py_attachments, METH_VARARGS, "The attached engines: (id, pid, start, pidns)."},
    {"release", py_release, METH_VARARGS, "Release an engine's pins, in-flight slots and entry (dead: count it reclaimed)."},
    {"lookup", py_lookup, METH_VARARGS, "(leading ready keys, first other one in flight for this engine)."},
    {"touch", py_touch, METH_VARARGS, "Set the CLOCK bits of keys."},
    {"pin", py_pin, METH_VARARGS, "Pin ready keys: [(slot, epoch)], (-1, 0) when not ready."},
    {"unpin", py_unpin, METH_VARARGS, "Unpin slots (of these epochs); drop: free them when no one pins them."},
    {"complete", py_complete, METH_VARARGS, "Complete this engine's stores (success) or forget them."},
    {"reserve", py_reserve, METH_VARARGS, "Reserve slots for the keys not held; None when there is no room."},
    {"reset", py_reset, METH_VARARGS, "Drop the ready, unpinned blocks this engine wrote."},
    {"verify", py_verify, METH_VARARGS, "Whether slots are ready and hold these epochs."},
    {"stats", py_stats, METH_VARARGS, "The pool's counters."},
    {"check", py_check, METH_VARARGS, "None, or the first broken law of the segment."},
    {"served", py_served, METH_VARARGS, "Pins other engines took on blocks this attachment stored."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nodeindex", "The node tier's shared index.", -1, methods};

PyMODINIT_FUNC PyInit__nodeindex(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "MAX_ATTACH", MAX_ATTACH) < 0 ||
              PyModule_AddIntConstant(m, "VERSION", VERSION) < 0 ||
              PyModule_AddIntConstant(m, "HEADER_BYTES", (long)header_size()) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
