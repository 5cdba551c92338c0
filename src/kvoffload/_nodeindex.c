/* The node tier's shared index: key -> slot, slot states, pins and a CLOCK hand, in one shared-memory segment
 * that every engine on a machine maps (kvoffload/tiers/node/segment.py creates, checks and maps it).
 *
 * Concurrency without a server:
 * - Writers (reserve, complete, pin, unpin, release, reset) hold the index's lock, an OFD lock on a byte of the
 *   namespace's engines file (tiers/node/liveness.py), whose descriptor each takes as ``lock_fd``; they wait for
 *   it at most ``wait_ms``, once per outage (``Busy`` after: an engine frozen holding it costs the others hits,
 *   never steps; ``outage``). Each
 *   bumps a sequence counter to odd before changing the table and back to even after, so lookups (the hot path:
 *   a whole prompt's keys every scheduler step) read without the lock and retry when a writer overlapped them;
 *   they only wait on a writer after a few retries. One engine's lookup thus never waits on another's eviction.
 * - Pins are a bit per attached engine in each slot, so a dead engine's pins are cleared without knowing counts;
 *   an engine counts its own repeated pins itself.
 * - Crash safety: a slot changes state by one store, its other fields written while it is FREE or IN_FLIGHT under
 *   its owner; the hash table is derived from the slots. An engine killed holding the lock leaves ``holder`` set
 *   for the next holder (the kernel releases the lock), which rebuilds the table from the slots; the dead engine's
 *   pins and in-flight slots go when an engine finds its attachment's lock gone (tiers/node/liveness.py). No
 *   process-shared pthread mutex: its robust-list pointers live in the segment, and a stray write there crashed
 *   its holder.
 * - Every reuse of a slot gives it a higher epoch (never 0, starting from the pool's random generation), so a
 *   reader whose slot was rewritten under it sees a different epoch after its copy and fails the load (verify),
 *   and an engine whose halves hold two generations of the pool never takes one's slot for the other's.
 *
 * Nothing read back from the segment is trusted (a bug, a version mix or a stray write must not take every engine
 * on the machine down): the geometry is checked on every call (``Damaged`` when wrong), each
 * slot carries a check word over its key, epoch, state and owner, every slot number and hash entry is bounds
 * checked and every probe bounded. A violation seen under the lock is repaired before it is released: the table
 * is rebuilt from the slots, and a slot that fails its check is quarantined (LOST) for QUARANTINE_S, so a store
 * still being copied into it lands in no other block's slot.
 *
 * Tenants' shares (docs/node.md, "Tenants"): with a tenant table in the header (``set_tenants``), each slot records
 * its tenant (one byte, the table's position), each tenant its resident slots, and ``reserve`` evicts by the rule
 * of kvoffload/index/tenants.py over the whole pool (``sweep_tenants``). Without a table (``tenants_on`` 0) the
 * sweep is the plain CLOCK one, unchanged. The table and the counts are fairness, never safety: a tenant byte or
 * count is trusted for nothing but the choice of victims, damage there is repaired from the slots (counts
 * recounted, bad bytes to "other") and a damaged table is reset (engines write theirs again within a second).
 *
 * Retention hints (docs/node.md, "Retention hints"): a slot may carry a deadline (CLOCK_MONOTONIC milliseconds, the
 * same in every process of the machine), given with its store (``reserve``) or raised later by any engine
 * (``retain``). While the pool holds any (``retained`` in the header), both sweeps pass a slot whose deadline has
 * not passed and take it only when no other victim is left, oldest deadline first; a passed deadline makes the slot
 * ordinary. Retained slots are capped (each call gives its engine's cap): past it, the oldest deadlines are dropped.
 * Deadlines are fairness, never safety, like the tenant bytes: outside the check word, one past now + MAX_RETAIN_MS
 * clamped to it, counts recounted from the slots by the repair. With no deadline ever given the sweeps are the
 * ones of version 4, victim for victim.
 *
 * Functions take the mapped segment (a writable buffer; verify and stats also accept a read-only one) and
 * keys as one bytes object of 16-byte keys.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAGIC 0x313065646f6e766bULL /* "kvnode01" little endian */
#define VERSION 5 /* 3: checked slots, files bound to the index (generation, inodes), the lock in the engines file;
                   * 4: tenants' shares (the tenant table after the pool inodes, a tenant byte in each slot);
                   * 5: retention deadlines (one in each slot, 64 bytes now; the retained count and figures after
                   *    the tenant table) */
#define LOCK_BYTE MAX_ATTACH /* the byte of the engines file whose lock is the index's: after the attachments' */
#define KEY 16
#define MAX_ATTACH 64
#define MAX_RANKS 1024
#define EMPTY (-1)
#define LOCKFREE_TRIES 8
#define QUARANTINE_S 30
#define MAX_TABLE (1ULL << 40)
#define MAX_RETAIN_MS 86400000ULL /* a deadline further than this from now (max_retain_s's bound) is damage: clamped */
#define DEMOTE_SLACK 16 /* past the cap, demote 1/16 of it more than needed: the scan for the oldest is not per store */

enum { FREE = 0, IN_FLIGHT = 1, READY = 2, LOST = 3 };

#define MAX_TENANTS 17          /* 16 named tenants (positions 0 to 15) and "other" */
#define OTHER (MAX_TENANTS - 1) /* every tenant not named, and whatever tenant byte is not a table entry */
#define TENANT_NAME 64          /* a name's bytes (UTF-8, NUL padded); a longer one: its first 48 and a hash */
#define SHARE_ONE 1000000LL     /* shares are in millionths of the pool */
#define SHARE_SLACK MAX_TENANTS /* each share rounded to a millionth: the sum may be a hair over one */
enum { NAMED = 1, HASHED = 2 }; /* a tenant entry's flags: in use; its name is a prefix and a hash */
/* What sweep_tenants obeys: the rule, or (tests only, ``set_rule``) one of its mutants, which the tests of the
 * rule run to show that they fail on a wrong rule. */
enum { RULE = 0, RULE_ANY = 1, RULE_NO_TAKE_BACK = 2, RULE_NO_OWN = 3, RULE_HARD_QUOTA = 4 };
static int rule_kind = RULE;

static PyObject *Busy, *Damaged;
#define WAIT_MS 20
static long wait_ms = WAIT_MS;
/* The engines files (by descriptor) whose lock this process gave up on: while one is not had again, its lock is
 * tried once and not waited for, so an engine frozen holding it costs each other engine one wait per outage, not
 * one per operation (every step has several). A descriptor past OUTAGE_FDS always waits. */
#define OUTAGE_FDS 4096
static unsigned char outage[OUTAGE_FDS];

typedef struct {
    uint64_t pid;
    uint64_t start; /* process start time (clock ticks since boot): a reused pid is another process */
    uint64_t pidns; /* for logs: liveness is the engine's lock (tiers/node/liveness.py) */
} Attachment;

typedef struct {
    uint8_t name[TENANT_NAME]; /* NUL padded (names hold no NUL); HASHED: the name's first 48 bytes, then 16 of hash */
    uint32_t share;            /* millionths of the pool */
    uint32_t flags;            /* NAMED, HASHED */
    uint64_t check;            /* over name, share, flags and position: a stray write is seen, the table reset */
    uint64_t resident;         /* slots ready or in flight of this tenant: derived from the slots' tenant bytes */
    uint64_t stores, evictions;
} Tenant;

typedef struct {
    uint64_t magic; /* written last at init, so a half-made segment never has it */
    uint32_t version;
    uint32_t header_bytes;
    uint8_t fingerprint[KEY];
    uint64_t num_slots;
    uint64_t slot_bytes;
    uint64_t table_size;
    uint64_t total_bytes;
    uint64_t generation;    /* random per set of files (index, engines, pool.<rank>) */
    uint64_t engines_inode; /* the "engines" file that goes with this index */
    uint64_t seq;
    uint64_t hand;
    uint64_t next_epoch;
    uint64_t used;
    int64_t holder; /* attachment holding the lock (MAX_ATTACH: one with none), -1 none */
    uint64_t stores, evictions, cross_hits, repairs, reclaimed, busy;
    Attachment att[MAX_ATTACH];
    uint64_t served[MAX_ATTACH];  /* per attachment: pins other engines took on blocks it stored */
    uint64_t pool_inode[MAX_RANKS]; /* each rank's pool file, 0 before it is made */
    uint64_t tenants_on;            /* 1: the table below is the pool's (set_tenants), 0: no tenants */
    uint64_t tenants_gen;           /* bumped by every change of the table: engines re-read it when it moves */
    Tenant tenant[MAX_TENANTS];     /* by position: named tenants first, OTHER last */
    uint64_t retained; /* resident slots with a deadline (some may have passed); 0: the sweeps ignore deadlines */
    uint64_t retain_hits, retain_demoted, retain_evicted; /* pins of retained slots; dropped past the cap; evicted */
} Header;

typedef struct {
    uint8_t key[KEY];
    uint64_t epoch;
    uint64_t check; /* over key, epoch, state and owner: a stray write to any of them is seen */
    uint64_t pins;
    uint64_t lost_until; /* LOST: the monotonic second from which it may be reused */
    uint8_t state;
    uint8_t owner; /* the engine that reserved it (and wrote it) */
    uint8_t ref;   /* CLOCK reference bit */
    uint8_t tenant; /* the table position of the tenant it was stored for: a hint for eviction, never checked */
    uint8_t pad[4];
    uint64_t deadline; /* retention: CLOCK_MONOTONIC ms before which eviction passes it by; 0 none; a hint */
} Slot;

typedef struct {
    Header *h;
    Slot *slots;
    int32_t *table;
    uint64_t n, mask; /* read once per call: every index below is bounded by these, not by shared memory */
    int bad;          /* a violation was seen: repair before the lock is released */
    int fd;           /* the engines file, whose LOCK_BYTE this process locks to write */
} Seg;

static size_t header_size(void) { return (sizeof(Header) + 63) & ~(size_t)63; }

static size_t segment_size(uint64_t num_slots, uint64_t table_size) {
    return header_size() + num_slots * sizeof(Slot) + table_size * sizeof(int32_t);
}

static uint64_t now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts); /* one clock for every process on the machine */
    return (uint64_t)ts.tv_sec;
}

static int64_t clock_shift_ms; /* tests only (``shift_clock``): deadlines pass without the test sleeping */

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* Python's time.monotonic: the clock the engines' books keep */
    return (uint64_t)((int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + clock_shift_ms);
}

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static uint64_t check_of(const Slot *sl, uint8_t state) {
    uint64_t k0, k1;
    memcpy(&k0, sl->key, 8);
    memcpy(&k1, sl->key + 8, 8);
    return mix(k0 ^ mix(k1 ^ mix(sl->epoch ^ mix(((uint64_t)state << 8 | sl->owner) + 0x9e3779b97f4a7c15ULL))));
}

static int slot_ok(const Slot *sl) {
    uint8_t state = __atomic_load_n(&sl->state, __ATOMIC_ACQUIRE);
    return state <= LOST && sl->owner < MAX_ATTACH && sl->check == check_of(sl, state);
}

static void set_state(Slot *sl, uint8_t state) {
    sl->check = check_of(sl, state);
    __atomic_store_n(&sl->state, state, __ATOMIC_RELEASE);
}

/* ---- the tenant table ---------------------------------------------------------------------------------------- */

static uint64_t tenant_check(const Tenant *t, int position) {
    uint64_t x = mix(((uint64_t)t->share << 32 | t->flags) ^ (uint64_t)position * 0x9e3779b97f4a7c15ULL);
    for (int i = 0; i < TENANT_NAME; i += 8) {
        uint64_t w;
        memcpy(&w, t->name + i, 8);
        x = mix(x ^ w);
    }
    return x;
}

/* Whether one entry reads as this module writes it: checked, a share in range, and a name that is one (NUL
 * padded, not empty) when named, none when not. */
static int tenant_ok(const Tenant *t, int position) {
    if (t->check != tenant_check(t, position) || t->share > SHARE_ONE || (t->flags & ~(uint32_t)(NAMED | HASHED)))
        return 0;
    if (!(t->flags & NAMED)) return t->share == 0 && t->flags == 0 && t->name[0] == 0;
    if (t->name[0] == 0) return 0;
    if (t->flags & HASHED) return 1; /* the hash may hold any byte */
    int ended = 0;
    for (int i = 0; i < TENANT_NAME; i++) {
        if (t->name[i] == 0) ended = 1;
        else if (ended) return 0;
    }
    return 1;
}

/* Whether the table is one this module wrote: none (off), or every entry sound, "other" named, shares at most one. */
static int table_ok(const Header *h) {
    uint64_t on = __atomic_load_n(&h->tenants_on, __ATOMIC_ACQUIRE);
    if (on == 0) return 1;
    if (on != 1) return 0;
    int64_t total = 0;
    for (int i = 0; i < MAX_TENANTS; i++) {
        if (!tenant_ok(&h->tenant[i], i)) return 0;
        total += h->tenant[i].share;
    }
    return (h->tenant[OTHER].flags & NAMED) && total <= SHARE_ONE + SHARE_SLACK;
}

static int tenants_on(const Header *h) { return __atomic_load_n(&h->tenants_on, __ATOMIC_ACQUIRE) == 1; }

/* A slot's tenant as eviction counts it: a byte naming no entry of the table counts for "other". */
static int tenant_of(const Header *h, const Slot *sl) {
    int t = sl->tenant;
    if (t >= MAX_TENANTS) return OTHER;
    if (tenants_on(h) && !(h->tenant[t].flags & NAMED)) return OTHER;
    return t;
}

/* No table (a damaged one costs fairness until an engine writes its table again, never a wrong block). */
static void reset_table(Header *h) {
    for (int i = 0; i < MAX_TENANTS; i++) {
        Tenant *t = &h->tenant[i];
        memset(t->name, 0, TENANT_NAME);
        t->share = 0;
        t->flags = 0;
        t->stores = 0;
        t->evictions = 0;
        t->check = tenant_check(t, i);
    }
    __atomic_store_n(&h->tenants_on, 0, __ATOMIC_RELEASE);
    h->tenants_gen++;
}

/* Each tenant's resident slots, counted from the slots; a tenant byte naming no entry becomes "other". */
static void recount_tenants(Header *h, Slot *slots, uint64_t n) {
    uint64_t resident[MAX_TENANTS] = {0};
    for (uint64_t i = 0; i < n; i++) {
        Slot *sl = &slots[i];
        if (sl->state != READY && sl->state != IN_FLIGHT) continue;
        int t = tenant_of(h, sl);
        sl->tenant = (uint8_t)t; /* outside the check word: rewriting it never fails the slot */
        resident[t]++;
    }
    for (int t = 0; t < MAX_TENANTS; t++) h->tenant[t].resident = resident[t];
}

/* ---- retention deadlines ------------------------------------------------------------------------------------ */

static int holds_key(const Slot *sl) { return sl->state == READY || sl->state == IN_FLIGHT; }

/* The slot is ordinary again: its deadline goes, and the count with it. */
static void drop_deadline(Header *h, Slot *sl) {
    if (!sl->deadline) return;
    sl->deadline = 0;
    if (h->retained) h->retained--; /* a wrong count is found by the check and recounted */
}

/* Whether a resident slot is retained at ``now``: a passed deadline is dropped (the slot is ordinary from here), one
 * further than MAX_RETAIN_MS is clamped (written by no engine: damage, which may cost fairness for that long). */
static int retained_at(Header *h, Slot *sl, uint64_t now) {
    uint64_t d = sl->deadline;
    if (!d) return 0;
    if (d <= now) {
        drop_deadline(h, sl);
        return 0;
    }
    if (d > now + MAX_RETAIN_MS) sl->deadline = now + MAX_RETAIN_MS;
    return 1;
}

/* Raise a resident slot's deadline to ``d`` (never lower it); a deadline past is no hint. */
static void hold(Header *h, Slot *sl, uint64_t d, uint64_t now) {
    if (d <= now) return;
    if (d > now + MAX_RETAIN_MS) d = now + MAX_RETAIN_MS;
    if (!sl->deadline) h->retained++;
    if (d > sl->deadline) sl->deadline = d;
}

typedef struct {
    uint64_t deadline;
    int64_t slot;
} Held;

static int by_deadline(const void *a, const void *b) {
    const Held *x = a, *y = b;
    if (x->deadline != y->deadline) return x->deadline < y->deadline ? -1 : 1;
    return x->slot < y->slot ? -1 : x->slot > y->slot;
}

/* The retained slots eviction may take (ready, unpinned, not marked, of ``tenant`` unless it is -1) into ``out``
 * (room for s->n), passed deadlines dropped on the way; how many. */
static Py_ssize_t takeable_retained(Seg *s, uint8_t *marks, int tenant, uint64_t now, Held *out) {
    Py_ssize_t count = 0;
    for (uint64_t i = 0; i < s->n; i++) {
        Slot *sl = &s->slots[i];
        if (!sl->deadline || sl->state != READY || sl->pins || ((marks[i >> 3] >> (i & 7)) & 1) || !slot_ok(sl))
            continue;
        if (tenant >= 0 && tenant_of(s->h, sl) != tenant) continue;
        if (retained_at(s->h, sl, now)) out[count++] = (Held){sl->deadline, (int64_t)i};
    }
    return count;
}

/* Up to ``need`` retained slots of ``tenant`` (-1: any), oldest deadline first, marked and put into ``found``:
 * what eviction takes once no other victim is left. How many (fewer: no room). */
static Py_ssize_t take_retained(Seg *s, uint8_t *marks, int64_t *found, Py_ssize_t need, int tenant, uint64_t now) {
    Held *held = PyMem_Malloc(sizeof(Held) * s->n);
    if (!held) return 0; /* no room found: the store is refused, nothing changed */
    Py_ssize_t count = takeable_retained(s, marks, tenant, now, held), got = 0;
    qsort(held, (size_t)count, sizeof(Held), by_deadline);
    for (; got < need && got < count; got++) {
        uint64_t i = (uint64_t)held[got].slot;
        found[got] = (int64_t)i;
        marks[i >> 3] |= (uint8_t)(1 << (i & 7));
    }
    PyMem_Free(held);
    return got;
}

/* Past ``cap`` retained slots, the oldest deadlines are dropped (the slots ordinary) down to the cap less a 16th of
 * it, so that a pool at its cap scans its slots once per cap/16 new deadlines, not once per store. The scan also
 * drops passed deadlines and recounts. */
static void cap_retained(Seg *s, uint64_t cap, uint64_t now) {
    Header *h = s->h;
    if (h->retained <= cap) return;
    Held *held = PyMem_Malloc(sizeof(Held) * s->n);
    if (!held) return; /* over the cap until the next call: fairness, never safety */
    uint64_t count = 0;
    for (uint64_t i = 0; i < s->n; i++) {
        Slot *sl = &s->slots[i];
        if (sl->deadline && holds_key(sl) && retained_at(h, sl, now)) held[count++] = (Held){sl->deadline, (int64_t)i};
    }
    h->retained = count; /* the scan's count: a drifted one is right again */
    if (count > cap) {
        uint64_t keep = cap - cap / DEMOTE_SLACK;
        qsort(held, (size_t)count, sizeof(Held), by_deadline);
        for (uint64_t j = 0; j < count - keep; j++) drop_deadline(h, &s->slots[held[j].slot]);
        h->retain_demoted += count - keep;
    }
    PyMem_Free(held);
}

/* Retained slots, read without the lock: the header's count of resident slots with a deadline (one that passed
 * counts until a sweep or a store meets it), bounded by the pool. O(1): the scheduler reads it with its step's
 * figures, and a scan of every slot there would cost a large pool milliseconds a step. */
static uint64_t count_retained(Seg *s) {
    uint64_t count = __atomic_load_n(&s->h->retained, __ATOMIC_RELAXED);
    return count < s->n ? count : s->n; /* a damaged count is a wrong figure, never a wrong bound */
}

/* Map a buffer; 0 with an exception set (Damaged) when it is not, or no longer, a segment this module made. */
static int open_seg(PyObject *obj, Py_buffer *view, Seg *s, int writable) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return 0;
    Header *h = (Header *)view->buf;
    const char *problem = NULL;
    uint64_t n = 0, table = 0;
    if ((size_t)view->len < sizeof(Header)) {
        problem = "it is shorter than its header";
    } else {
        n = h->num_slots;
        table = h->table_size;
        if (h->magic != MAGIC || h->version != VERSION) problem = "its magic word or version changed";
        else if (h->header_bytes != header_size() || n == 0 || n > INT32_MAX || table < 2 * n || table > MAX_TABLE ||
                 (table & (table - 1)) || h->total_bytes != (uint64_t)view->len ||
                 segment_size(n, table) != (size_t)view->len)
            problem = "its geometry changed";
    }
    if (problem) {
        PyBuffer_Release(view);
        PyErr_Format(Damaged, "node index: %s", problem);
        return 0;
    }
    s->h = h;
    s->n = n;
    s->mask = table - 1;
    s->slots = (Slot *)((char *)view->buf + header_size());
    s->table = (int32_t *)((char *)s->slots + n * sizeof(Slot));
    s->bad = 0;
    return 1;
}

static uint64_t home(const uint8_t *key) {
    uint64_t v;
    memcpy(&v, key, sizeof v);
    return v;
}

/* The table entry at ``i`` as a slot number, -1 for an empty entry, -2 (and ``bad``) for one naming no slot. */
static int64_t entry(Seg *s, uint64_t i) {
    int32_t slot = __atomic_load_n(&s->table[i], __ATOMIC_RELAXED);
    if (slot == EMPTY) return -1;
    if (slot < 0 || (uint64_t)slot >= s->n) {
        s->bad = 1;
        return -2;
    }
    return slot;
}

/* The slot holding ``key`` (ready or in flight, its check word right), -1 when none. */
static int64_t find(Seg *s, const uint8_t *key) {
    uint64_t i = home(key) & s->mask;
    for (uint64_t probes = 0; probes <= s->mask; probes++, i = (i + 1) & s->mask) {
        int64_t slot = entry(s, i);
        if (slot == -1) return -1;
        if (slot < 0 || memcmp(s->slots[slot].key, key, KEY) != 0) continue;
        Slot *sl = &s->slots[slot];
        uint8_t state = __atomic_load_n(&sl->state, __ATOMIC_ACQUIRE);
        if ((state == READY || state == IN_FLIGHT) && slot_ok(sl)) return slot;
        s->bad = 1; /* a table entry on a slot that holds no key, or fails its check */
    }
    return -1;
}

static void insert(Seg *s, const uint8_t *key, int32_t slot) {
    uint64_t i = home(key) & s->mask;
    for (uint64_t probes = 0; probes <= s->mask; probes++, i = (i + 1) & s->mask) {
        if (s->table[i] == EMPTY) {
            s->table[i] = slot;
            return;
        }
    }
    s->bad = 1; /* a full table: the slots count no longer matches it */
}

/* Linear probing, backward-shift deletion: no tombstones, so probes stay short however long the pool runs. */
static void erase(Seg *s, const uint8_t *key) {
    uint64_t i = home(key) & s->mask, probes = 0;
    for (;; i = (i + 1) & s->mask) {
        int64_t slot = entry(s, i);
        if (slot == -1 || ++probes > s->mask + 1) return;
        if (slot >= 0 && memcmp(s->slots[slot].key, key, KEY) == 0) break;
    }
    uint64_t j = (i + 1) & s->mask;
    for (probes = 0; probes <= s->mask; probes++, j = (j + 1) & s->mask) {
        int64_t slot = entry(s, j);
        if (slot == -1) break;
        if (slot < 0) return; /* repaired before the lock is released */
        uint64_t k = home(s->slots[slot].key) & s->mask;
        int movable = (j > i) ? (k <= i || k > j) : (k <= i && k > j);
        if (movable) {
            s->table[i] = (int32_t)slot;
            i = j;
        }
    }
    s->table[i] = EMPTY;
}

static void free_slot(Seg *s, int64_t i) {
    Tenant *t = &s->h->tenant[tenant_of(s->h, &s->slots[i])];
    if (t->resident) t->resident--; /* a wrong count is found by the check and recounted */
    drop_deadline(s->h, &s->slots[i]);
    erase(s, s->slots[i].key);
    s->slots[i].pins = 0;
    set_state(&s->slots[i], FREE);
    if (s->h->used) s->h->used--;
}

/* A slot whose entry cannot be trusted: no one reads it, no one reuses it before a store still copying into it
 * (its engine's, if it was in flight) has surely landed. */
static void quarantine(Slot *sl) {
    sl->pins = 0;
    sl->owner = 0;
    sl->lost_until = now_s() + QUARANTINE_S;
    set_state(sl, LOST);
}

static void write_begin(Seg *s) {
    __atomic_add_fetch(&s->h->seq, 1, __ATOMIC_ACQ_REL);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static void write_end(Seg *s) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_add_fetch(&s->h->seq, 1, __ATOMIC_ACQ_REL);
}

static uint64_t live_mask(Seg *s) {
    uint64_t live = 0;
    for (int i = 0; i < MAX_ATTACH; i++) live |= (uint64_t)(s->h->att[i].pid != 0) << i;
    return live;
}

/* Release everything attachment ``a`` holds: its pins, its in-flight slots and its entry. */
static void release(Seg *s, int a) {
    uint64_t bit = 1ULL << a;
    for (uint64_t i = 0; i < s->n; i++) {
        Slot *slot = &s->slots[i];
        slot->pins &= ~bit;
        if (slot->state == IN_FLIGHT && slot->owner == a && slot_ok(slot)) free_slot(s, (int64_t)i);
    }
    memset(&s->h->att[a], 0, sizeof(Attachment));
    s->h->served[a] = 0;
}

/* The slots are the truth: rebuild the table, the counts, the hand and the epoch from them, quarantining every slot
 * whose entry fails its check (and a second slot of one key). A holder killed mid-change keeps its attachment
 * here: what it holds goes when the engines' locks say it died (tiers/node/liveness.py), never on the word of
 * the holder field, which a process that lost its attachment may still have written. */
static void repair(Seg *s) {
    Header *h = s->h;
    uint64_t live = live_mask(s), top = h->next_epoch, used = 0, retained = 0;
    for (uint64_t i = 0; i <= s->mask; i++) s->table[i] = EMPTY;
    s->bad = 0;
    for (uint64_t i = 0; i < s->n; i++) {
        Slot *sl = &s->slots[i];
        if (!slot_ok(sl)) {
            quarantine(sl);
            continue;
        }
        if (sl->state == FREE || sl->state == LOST) {
            sl->pins = 0;
            continue;
        }
        if (sl->state == IN_FLIGHT && !((live >> sl->owner) & 1)) { /* its engine detached */
            sl->pins = 0;
            set_state(sl, FREE);
            continue;
        }
        if (find(s, sl->key) >= 0) { /* a key in two slots: keep the first */
            quarantine(sl);
            continue;
        }
        sl->pins &= live;
        if (sl->epoch >= top) top = sl->epoch + 1; /* checked: an epoch this module wrote */
        insert(s, sl->key, (int32_t)i);
        used++;
        retained += sl->deadline != 0;
    }
    for (uint64_t i = 0; i < s->n; i++)
        if (!holds_key(&s->slots[i])) s->slots[i].deadline = 0; /* outside the check word: a free slot holds none */
    h->used = used;
    h->retained = retained;
    if (!table_ok(h)) reset_table(h);
    recount_tenants(h, s->slots, s->n);
    h->hand %= s->n;
    h->next_epoch = top ? top : 1;
    h->holder = -1;
    h->repairs++;
    s->bad = 0;
}

/* repair, with the sequence counter odd meanwhile (it may already be: a writer died mid-change). */
static void repair_now(Seg *s) {
    if (!(s->h->seq & 1)) write_begin(s);
    repair(s);
    write_end(s);
}

/* One attempt at the index's lock: an OFD write lock on LOCK_BYTE of the engines file. The kernel holds it, not
 * the segment, so nothing written into the segment can make it unlockable or crash its holder, and it goes with a
 * holder that dies. 1 had, 0 held by another, -1 errno set. */
static int try_lock(int fd, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = LOCK_BYTE;
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return 1;
    return (errno == EAGAIN || errno == EACCES) ? 0 : -1;
}

/* Lock the segment for attachment ``a``, waiting at most wait_ms (polled: an OFD lock has no timed wait; not at
 * all during an outage, see ``outage``); 0 with Busy (not had in time) or OSError set. A holder that died
 * mid-change left ``holder`` set (or the sequence counter odd): the new holder repairs first. */
static int lock(Seg *s, int a) {
    int got, rc = 0;
    int in_outage = s->fd >= 0 && s->fd < OUTAGE_FDS && outage[s->fd];
    long limit = in_outage ? 0 : wait_ms;
    Py_BEGIN_ALLOW_THREADS
    struct timespec start, now, pause = {0, 20000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        got = try_lock(s->fd, F_WRLCK);
        if (got != 0) break;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000L + (now.tv_nsec - start.tv_nsec) / 1000000L >= limit) break;
        nanosleep(&pause, NULL);
        if (pause.tv_nsec < 1000000) pause.tv_nsec *= 2;
    }
    rc = errno;
    Py_END_ALLOW_THREADS
    if (got < 0) {
        PyErr_Format(PyExc_OSError, "node index: cannot lock the engines file: %s", strerror(rc));
        return 0;
    }
    if (got == 0) {
        __atomic_add_fetch(&s->h->busy, 1, __ATOMIC_RELAXED);
        if (s->fd >= 0 && s->fd < OUTAGE_FDS) outage[s->fd] = 1;
        PyErr_Format(Busy, "node index: another engine held its lock for over %ld ms", wait_ms);
        return 0;
    }
    if (in_outage) outage[s->fd] = 0;
    if (s->h->holder != -1 || (s->h->seq & 1)) repair_now(s);
    s->h->holder = a < 0 ? MAX_ATTACH : a;
    return 1;
}

static void unlock(Seg *s) {
    if (s->bad) repair_now(s);
    s->h->holder = -1;
    try_lock(s->fd, F_UNLCK);
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

/* init(buffer, num_slots, slot_bytes, table_size, fingerprint, generation, engines_inode): format a new segment
 * (the caller holds it alone). */
static PyObject *py_init(PyObject *self, PyObject *args) {
    Py_buffer view, fp;
    unsigned long long num_slots, slot_bytes, table_size, generation, engines_inode;
    if (!PyArg_ParseTuple(args, "w*KKKy*KK", &view, &num_slots, &slot_bytes, &table_size, &fp, &generation,
                          &engines_inode))
        return NULL;
    PyObject *result = NULL;
    if (fp.len != KEY || num_slots == 0 || num_slots > INT32_MAX || table_size < 2 * num_slots ||
        table_size > MAX_TABLE || (table_size & (table_size - 1)) ||
        segment_size(num_slots, table_size) != (size_t)view.len) {
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
    h->generation = generation;
    h->engines_inode = engines_inode;
    h->next_epoch = 1 + (generation >> 2); /* epochs of two generations never meet in practice */
    h->holder = -1;
    reset_table(h); /* no tenants until an engine with a tenant table attaches (set_tenants) */
    Slot *slots = (Slot *)((char *)view.buf + header_size());
    for (uint64_t i = 0; i < num_slots; i++) set_state(&slots[i], FREE);
    int32_t *table = (int32_t *)((char *)slots + num_slots * sizeof(Slot));
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

/* set_wait_ms(ms): how long this process waits for the index's lock before an operation gives up (Busy); it ends
 * an outage, so the next operation waits again. */
static PyObject *py_set_wait_ms(PyObject *self, PyObject *args) {
    long ms;
    if (!PyArg_ParseTuple(args, "l", &ms)) return NULL;
    if (ms < 0 || ms > 3600000) {
        PyErr_SetString(PyExc_ValueError, "set_wait_ms: 0 to 3600000 ms");
        return NULL;
    }
    wait_ms = ms;
    memset(outage, 0, sizeof outage);
    Py_RETURN_NONE;
}

/* files(buffer) -> (generation, engines inode, {rank: pool file inode}) as the index records them. */
static PyObject *py_files(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    PyObject *pools = PyDict_New();
    for (int r = 0; pools && r < MAX_RANKS; r++) {
        uint64_t inode = __atomic_load_n(&s.h->pool_inode[r], __ATOMIC_RELAXED);
        if (!inode) continue;
        PyObject *k = PyLong_FromLong(r), *v = PyLong_FromUnsignedLongLong(inode);
        if (!k || !v || PyDict_SetItem(pools, k, v) < 0) Py_CLEAR(pools);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    PyObject *out = pools ? Py_BuildValue("(KKN)", (unsigned long long)s.h->generation,
                                          (unsigned long long)s.h->engines_inode, pools) : NULL;
    PyBuffer_Release(&view);
    return out;
}

/* bind_pool(buffer, rank, inode): record rank's pool file (the caller holds the namespace's directory lock). */
static PyObject *py_bind_pool(PyObject *self, PyObject *args) {
    PyObject *obj;
    int rank;
    unsigned long long inode;
    if (!PyArg_ParseTuple(args, "OiK", &obj, &rank, &inode)) return NULL;
    if (rank < 0 || rank >= MAX_RANKS) {
        PyErr_Format(PyExc_ValueError, "rank %d is outside [0, %d)", rank, MAX_RANKS);
        return NULL;
    }
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    __atomic_store_n(&s.h->pool_inode[rank], inode, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* attach(buffer, pid, start, pidns) -> attachment id, or -1 when every entry is taken. */
static PyObject *py_attach(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long pid, start, pidns;
    int fd;
    if (!PyArg_ParseTuple(args, "OiKKK", &obj, &fd, &pid, &start, &pidns)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    s.fd = fd;
    long found = -1;
    if (lock(&s, -1)) {
        for (int a = 0; a < MAX_ATTACH && found < 0; a++) {
            if (s.h->att[a].pid == 0) {
                /* pid last: an engine killed in between leaves a free entry, never one that looks attached */
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
    int fd, a, dead;
    unsigned long long pid, start;
    if (!PyArg_ParseTuple(args, "OiiKKp", &obj, &fd, &a, &pid, &start, &dead) || !check_attachment(a)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    s.fd = fd;
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

/* lookup(buffer, attachment, keys) -> (hits, pending). Reads without the lock (see the top of this file); a
 * violation seen in a read no writer overlapped is repaired under it. */
static PyObject *py_lookup(PyObject *self, PyObject *args) {
    PyObject *obj;
    int fd, a;
    Py_buffer keys;
    if (!PyArg_ParseTuple(args, "Oiiy*", &obj, &fd, &a, &keys)) return NULL;
    Py_buffer view;
    Seg s;
    Py_ssize_t hits = 0;
    int pending = 0, done = 0, bad = 0;
    if (!check_keys(&keys) || !open_seg(obj, &view, &s, 1)) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    s.fd = fd;
    Py_ssize_t n = keys.len / KEY;
    for (int t = 0; t < LOCKFREE_TRIES && !done; t++) {
        uint64_t before = __atomic_load_n(&s.h->seq, __ATOMIC_ACQUIRE);
        if (before & 1) continue;
        s.bad = 0;
        scan(&s, keys.buf, n, a, &hits, &pending);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        done = __atomic_load_n(&s.h->seq, __ATOMIC_ACQUIRE) == before;
        bad = done && s.bad;
    }
    if (!done || bad) { /* writers kept overlapping (or one died), or the read saw damage: ask under the lock */
        done = 0;          /* a damaged read is no answer: Busy (a miss) when the lock is not had in time */
        if (lock(&s, a)) {
            s.bad = 0;
            scan(&s, keys.buf, n, a, &hits, &pending);
            if (s.bad) { /* repaired by unlock: answer from the repaired table */
                repair_now(&s);
                scan(&s, keys.buf, n, a, &hits, &pending);
            }
            unlock(&s);
            done = 1;
        }
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
    int fd, a;
    Py_buffer keys;
    if (!PyArg_ParseTuple(args, "Oiiy*", &obj, &fd, &a, &keys)) return NULL;
    Py_buffer view;
    Seg s;
    PyObject *out = NULL;
    if (!check_attachment(a) || !check_keys(&keys) || !open_seg(obj, &view, &s, 1)) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    s.fd = fd;
    Py_ssize_t n = keys.len / KEY;
    if (lock(&s, a)) {
        uint64_t ms = s.h->retained ? now_ms() : 0;
        out = PyList_New(n);
        for (Py_ssize_t i = 0; out && i < n; i++) {
            int64_t slot = find(&s, (const uint8_t *)keys.buf + i * KEY);
            uint64_t epoch = 0;
            if (slot >= 0 && s.slots[slot].state == READY) {
                Slot *sl = &s.slots[slot];
                sl->pins |= 1ULL << a;
                epoch = sl->epoch;
                s.h->retain_hits += ms && sl->deadline > ms;
                if (sl->owner != a) {
                    s.h->cross_hits++;
                    s.h->served[sl->owner]++; /* owner < MAX_ATTACH: find checked the slot */
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
    int fd, a, flag;
    Py_ssize_t n;
    PyObject *slots, *epochs;
} SlotArgs;

static int slot_args(PyObject *args, SlotArgs *x) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "OiiOOp", &obj, &x->fd, &x->a, &x->slots, &x->epochs, &x->flag)) return 0;
    if (!check_attachment(x->a)) return 0;
    if (!PyList_Check(x->slots) || !PyList_Check(x->epochs) || PyList_GET_SIZE(x->slots) != PyList_GET_SIZE(x->epochs)) {
        PyErr_SetString(PyExc_TypeError, "slots and epochs must be lists of one length");
        return 0;
    }
    x->n = PyList_GET_SIZE(x->slots);
    if (!open_seg(obj, &x->view, &x->s, 1)) return 0;
    x->s.fd = x->fd;
    return 1;
}

/* The slot at ``i`` of the lists when it still holds that epoch (and passes its check), else -1 (an exception set
 * on a bad item). */
static int64_t slot_at(SlotArgs *x, Py_ssize_t i) {
    long long slot = PyLong_AsLongLong(PyList_GET_ITEM(x->slots, i));
    unsigned long long epoch = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(x->epochs, i));
    if (PyErr_Occurred()) return -1;
    if (slot < 0 || (uint64_t)slot >= x->s.n || x->s.slots[slot].epoch != epoch) return -1;
    if (!slot_ok(&x->s.slots[slot])) {
        x->s.bad = 1;
        return -1;
    }
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
                x.s.h->tenant[tenant_of(x.s.h, &x.s.slots[slot])].stores++;
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

/* CLOCK: up to ``need`` slots that are free, ready (unpinned, unreferenced) or lost past their quarantine, and not
 * marked (held by this call), the hand moving on and clearing reference bits as it passes, and passing retained
 * slots by. Two turns at most; then retained slots, oldest deadline first. Fewer found means no room (nothing
 * evicted yet). */
static Py_ssize_t sweep(Seg *s, uint8_t *marks, int64_t *found, Py_ssize_t need) {
    Py_ssize_t got = 0;
    uint64_t n = s->n, now = 0;
    int hints = s->h->retained != 0; /* none: version 4's sweep, victim for victim */
    uint64_t ms = hints ? now_ms() : 0;
    for (uint64_t step = 0; step < 2 * n && got < need; step++) {
        uint64_t i = s->h->hand % n;
        s->h->hand = (i + 1) % n;
        Slot *slot = &s->slots[i];
        if ((marks[i >> 3] >> (i & 7)) & 1) continue;
        if (!slot_ok(slot)) {
            s->bad = 1;
            continue;
        }
        int take = slot->state == FREE;
        if (slot->state == LOST) {
            now = now ? now : now_s();
            take = now >= slot->lost_until || slot->lost_until > now + QUARANTINE_S;
        } else if (slot->state == READY && slot->pins == 0) {
            if (hints && retained_at(s->h, slot, ms)) continue; /* passed untouched: its reference bit stays */
            take = !slot->ref;
            slot->ref = 0;
        }
        if (take) {
            found[got++] = (int64_t)i;
            marks[i >> 3] |= (uint8_t)(1 << (i & 7));
        }
    }
    if (got < need && hints) got += take_retained(s, marks, found + got, need - got, -1, ms);
    return got;
}

/* ---- eviction by tenants' shares ------------------------------------------------------------------------------ */

/* The rule's state during one reserve: each tenant's usage against its quota, in millionths of a slot. */
typedef struct {
    int64_t excess[MAX_TENANTS]; /* usage * SHARE_ONE - share * n: above 0, over its quota */
    uint32_t storing;            /* a bit per tenant with keys in this store */
    uint32_t exhausted;          /* a bit per tenant the hand found nothing more to take from in two turns */
    int tier;                    /* of the last choice: 1 storing and over, 2 over, 3 storing; 0 anyone (RULE_ANY) */
    int64_t best;                /* the chosen tenant's excess */
} Rule;

static int in_tier(const Rule *r, int t, int tier) {
    if ((r->exhausted >> t) & 1) return 0;
    int over = r->excess[t] > 0, storing = (r->storing >> t) & 1;
    return tier == 1 ? storing && over : tier == 2 ? over : storing;
}

/* The tenant the next victim comes from (kvoffload/index/tenants.py's rule): 1. storing and over its quota, 2. any
 * over its quota, 3. storing; the most over (least under) first, ties to the first position. -1: none may give
 * (the store is refused). */
static int choose(Rule *r) {
    if (rule_kind == RULE_ANY) {
        r->tier = 0;
        return r->exhausted & 1 ? -1 : 0;
    }
    for (int tier = 1; tier <= 3; tier++) {
        if ((tier == 2 && rule_kind == RULE_NO_TAKE_BACK) || (tier == 3 && rule_kind == RULE_NO_OWN)) continue;
        int best = -1;
        for (int t = 0; t < MAX_TENANTS; t++)
            if (in_tier(r, t, tier) && (best < 0 || r->excess[t] > r->excess[best])) best = t;
        if (best >= 0) {
            r->tier = tier;
            r->best = r->excess[best];
            return best;
        }
    }
    return -1;
}

/* Whether tenant ``t`` may give the next victim when the rule chose ``chosen``: the chosen one, or another of its
 * tier within a slot of it ("most over first" to a slot: the hand takes the first of two tenants about as far
 * over, instead of going round the pool for each victim in turn). */
static int may_give(const Rule *r, int t, int chosen) {
    if (r->tier == 0) return 1;
    return t == chosen || (in_tier(r, t, r->tier) && r->excess[t] >= r->best - SHARE_ONE);
}

/* A slot the hand may take without evicting: free, or lost past its quarantine. */
static int reusable(const Slot *slot, uint64_t *now) {
    if (slot->state == FREE) return 1;
    if (slot->state != LOST) return 0;
    *now = *now ? *now : now_s();
    return *now >= slot->lost_until || slot->lost_until > *now + QUARANTINE_S;
}

static void take(uint8_t *marks, int64_t *found, Py_ssize_t *got, uint64_t i) {
    found[(*got)++] = (int64_t)i;
    marks[i >> 3] |= (uint8_t)(1 << (i & 7));
}

/* sweep with a tenant table: free slots first (nothing is evicted while the pool has room: a tenant alone fills
 * it, its share lent), then victims by the rule, each tenant's in CLOCK order: the hand clears and takes only
 * slots of tenants that may give, and passes the others' untouched (and retained slots: once the hand found none
 * other of the chosen tenant in two turns, its retained slots go, oldest deadline first). A tenant the hand went two turns past without
 * finding one to take has none; at most two turns per tenant in all. Fewer found means no room (nothing evicted
 * yet). ``fresh_tenants``: the tenant of each key to store. */
static Py_ssize_t sweep_tenants(Seg *s, uint8_t *marks, int64_t *found, Py_ssize_t need,
                                const uint8_t *fresh_tenants) {
    Header *h = s->h;
    uint64_t n = s->n, now = 0, used = h->used < n ? h->used : n;
    Py_ssize_t got = 0;
    Rule r = {.storing = 0, .exhausted = 0};
    int hints = h->retained != 0; /* none: version 4's sweep, victim for victim */
    uint64_t ms = hints ? now_ms() : 0;
    uint32_t drained = 0; /* a bit per tenant (bit 0: anyone, RULE_ANY) the hand found no unretained slot of */
    for (int t = 0; t < MAX_TENANTS; t++) {
        uint64_t resident = h->tenant[t].resident < n ? h->tenant[t].resident : n; /* a damaged count: bounded */
        r.excess[t] = (int64_t)resident * SHARE_ONE - (int64_t)h->tenant[t].share * (int64_t)n;
    }
    for (Py_ssize_t i = 0; i < need; i++) {
        r.excess[fresh_tenants[i]] += SHARE_ONE;
        r.storing |= 1u << fresh_tenants[i];
    }
    if (rule_kind == RULE_HARD_QUOTA)
        for (int t = 0; t < MAX_TENANTS; t++)
            if (((r.storing >> t) & 1) && r.excess[t] > 0) return 0;
    uint64_t hand = h->hand % n;
    for (uint64_t step = 0, free = n - used; step < n && got < need && free; step++) { /* free slots */
        uint64_t i = (hand + step) % n;
        Slot *slot = &s->slots[i];
        if ((marks[i >> 3] >> (i & 7)) & 1) continue;
        if (!slot_ok(slot)) {
            s->bad = 1;
            continue;
        }
        if (reusable(slot, &now)) {
            take(marks, found, &got, i);
            free--;
        }
    }
    int chosen = got < need ? choose(&r) : -1;
    uint64_t since = 0; /* steps since the last victim or choice */
    for (uint64_t step = 0; got < need && chosen >= 0 && step < 2 * n * (MAX_TENANTS + 1); step++) {
        uint32_t bit = r.tier == 0 ? 1u : 1u << chosen;
        if (drained & bit) { /* the chosen tenant gives its retained slots now, oldest deadline first */
            if (take_retained(s, marks, found + got, 1, r.tier == 0 ? -1 : chosen, ms) == 1)
                r.excess[tenant_of(h, &s->slots[found[got++]])] -= SHARE_ONE;
            else
                r.exhausted |= bit;
            chosen = choose(&r);
            since = 0;
            continue;
        }
        uint64_t i = h->hand % n;
        h->hand = (i + 1) % n;
        Slot *slot = &s->slots[i];
        if (++since > 2 * n) { /* two turns without one: nothing more to take there, but retained slots */
            if (hints) {
                drained |= bit;
            } else {
                r.exhausted |= bit;
                chosen = choose(&r);
            }
            since = 0;
        }
        if ((marks[i >> 3] >> (i & 7)) & 1) continue;
        if (!slot_ok(slot)) {
            s->bad = 1;
            continue;
        }
        if (reusable(slot, &now)) {
            take(marks, found, &got, i);
            continue;
        }
        if (slot->state != READY || slot->pins) continue;
        if (slot->tenant >= MAX_TENANTS) s->bad = 1; /* recounted before the lock goes */
        int t = tenant_of(h, slot);
        if (!may_give(&r, t, chosen)) continue; /* protected: its reference bit is its own CLOCK's */
        if (hints && retained_at(h, slot, ms)) continue; /* its tenant's other slots go first */
        if (slot->ref) {
            slot->ref = 0;
            continue;
        }
        take(marks, found, &got, i);
        r.excess[t] -= SHARE_ONE;
        chosen = choose(&r);
        since = 0;
    }
    return got;
}

/* Each key's deadline in ``deadlines`` (8 bytes a key, native order, ms; 0 none; none given: all 0). */
static uint64_t deadline_at(const Py_buffer *deadlines, Py_ssize_t i) {
    uint64_t d = 0;
    if (deadlines->obj && deadlines->len) memcpy(&d, (const char *)deadlines->buf + i * 8, 8);
    return d;
}

static int check_deadlines(const Py_buffer *deadlines, const Py_buffer *keys) {
    if (deadlines->obj && deadlines->len && (deadlines->len % 8 || deadlines->len / 8 * KEY != keys->len)) {
        PyErr_Format(PyExc_ValueError, "%zd deadline bytes for %zd keys", deadlines->len, keys->len / KEY);
        return 0;
    }
    return 1;
}

/* reserve(buffer, attachment, keys, tenants=b"", deadlines=b"", cap=0) -> None (no room: nothing changed) or
 * ([positions of the keys to store], [slots], [epochs], evicted keys as bytes). Keys already held (ready or in
 * flight, by any engine) are left out and protected from this call's evictions. ``tenants``: each key's tenant
 * (a table position; one byte a key, or none: every key "other's"), which evicts by the rule when the pool has a
 * tenant table (sweep_tenants) and is recorded in the slots either way. ``deadlines``: each key's retention
 * deadline (8 bytes a key, ms of CLOCK_MONOTONIC, 0 none), given to its slot (raised, for a key already held) when
 * ``cap``, this engine's bound on the pool's retained slots, is not 0. */
static PyObject *py_reserve(PyObject *self, PyObject *args) {
    PyObject *obj;
    int fd, a;
    unsigned long long cap = 0;
    Py_buffer keys, tenants = {0}, deadlines = {0};
    if (!PyArg_ParseTuple(args, "Oiiy*|y*y*K", &obj, &fd, &a, &keys, &tenants, &deadlines, &cap)) return NULL;
    Py_buffer view;
    Seg s;
    PyObject *out = NULL;
    if ((tenants.obj && tenants.len && tenants.len * KEY != keys.len) || !check_deadlines(&deadlines, &keys)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "reserve: %zd tenant bytes for %zd keys", tenants.len, keys.len / KEY);
        PyBuffer_Release(&keys);
        if (tenants.obj) PyBuffer_Release(&tenants);
        if (deadlines.obj) PyBuffer_Release(&deadlines);
        return NULL;
    }
    if (!check_attachment(a) || !check_keys(&keys) || !open_seg(obj, &view, &s, 1)) {
        PyBuffer_Release(&keys);
        if (tenants.obj) PyBuffer_Release(&tenants);
        if (deadlines.obj) PyBuffer_Release(&deadlines);
        return NULL;
    }
    int hinted = cap && deadlines.obj && deadlines.len; /* else no deadline is written, none dropped */
    uint64_t ms = hinted ? now_ms() : 0;
    s.fd = fd;
    const uint8_t *k = keys.buf;
    Py_ssize_t n = keys.len / KEY;
    Py_ssize_t *fresh = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    int64_t *victims = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    uint8_t *marks = PyMem_Calloc((size_t)(s.n + 7) / 8, 1);
    uint8_t *fresh_tenants = PyMem_Malloc(n ? (size_t)n : 1);
    if (!fresh || !victims || !marks || !fresh_tenants) {
        PyErr_NoMemory();
        goto done;
    }
    if (!lock(&s, a)) goto done;
    write_begin(&s);
    Py_ssize_t need = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = find(&s, k + i * KEY);
        if (slot >= 0) {
            marks[slot >> 3] |= (uint8_t)(1 << (slot & 7));
            if (hinted) hold(s.h, &s.slots[slot], deadline_at(&deadlines, i), ms);
            continue;
        }
        uint8_t t = tenants.obj && tenants.len ? ((const uint8_t *)tenants.buf)[i] : OTHER;
        fresh_tenants[need] = t < MAX_TENANTS && (!tenants_on(s.h) || (s.h->tenant[t].flags & NAMED)) ? t : OTHER;
        fresh[need++] = i;
    }
    int with_tenants = tenants_on(s.h) && table_ok(s.h);
    if (tenants_on(s.h) && !with_tenants) s.bad = 1; /* a damaged table: reset before the lock goes */
    Py_ssize_t got = with_tenants ? sweep_tenants(&s, marks, victims, need, fresh_tenants)
                                  : sweep(&s, marks, victims, need);
    if (got < need) {
        if (hinted) cap_retained(&s, cap, ms);
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
                if (slot->deadline && slot->deadline > (ms = ms ? ms : now_ms())) s.h->retain_evicted++;
                memcpy(ev + nevicted++ * KEY, slot->key, KEY);
                s.h->tenant[tenant_of(s.h, slot)].evictions++;
                free_slot(&s, victims[i]);
                s.h->evictions++;
            }
            /* FREE (or LOST) now: its fields are ours to write; IN_FLIGHT under this owner makes them visible.
             * Its epoch only grows, whatever next_epoch says: a reader's (slot, epoch) never comes back. */
            uint64_t floor = slot->epoch < (UINT64_MAX >> 1) ? slot->epoch + 1 : 1; /* a damaged one: no wrap */
            uint64_t epoch = s.h->next_epoch > floor ? s.h->next_epoch : floor;
            s.h->next_epoch = epoch + 1;
            slot->owner = (uint8_t)a;
            slot->pins = 0;
            slot->ref = 0;
            slot->epoch = epoch;
            slot->tenant = fresh_tenants[i];
            s.h->tenant[fresh_tenants[i]].resident++;
            slot->deadline = 0; /* free, so none counted (damage here is the repair's) */
            memcpy(slot->key, k + fresh[i] * KEY, KEY);
            set_state(slot, IN_FLIGHT);
            insert(&s, slot->key, (int32_t)victims[i]);
            s.h->used++;
            if (hinted) hold(s.h, slot, deadline_at(&deadlines, fresh[i]), ms);
            PyList_SET_ITEM(positions, i, PyLong_FromSsize_t(fresh[i]));
            PyList_SET_ITEM(slots, i, PyLong_FromLongLong(victims[i]));
            PyList_SET_ITEM(epochs, i, PyLong_FromUnsignedLongLong(epoch));
        }
    }
    if (hinted) cap_retained(&s, cap, ms);
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
    PyMem_Free(victims);
    PyMem_Free(marks);
    PyMem_Free(fresh_tenants);
    PyBuffer_Release(&view);
    PyBuffer_Release(&keys);
    if (tenants.obj) PyBuffer_Release(&tenants);
    if (deadlines.obj) PyBuffer_Release(&deadlines);
    return out;
}

/* retain(buffer, attachment, keys, deadlines, cap) -> how many keys the pool holds (ready or in flight): their
 * slots' deadlines are raised to ``deadlines`` (8 bytes a key, ms of CLOCK_MONOTONIC), never lowered; past
 * ``cap`` retained slots, the oldest deadlines are dropped. The sequence counter is not bumped: lookups read no
 * deadline. */
static PyObject *py_retain(PyObject *self, PyObject *args) {
    PyObject *obj;
    int fd, a;
    unsigned long long cap;
    Py_buffer keys, deadlines;
    if (!PyArg_ParseTuple(args, "Oiiy*y*K", &obj, &fd, &a, &keys, &deadlines, &cap)) return NULL;
    Py_buffer view;
    Seg s;
    long held = 0;
    int ok = check_attachment(a) && check_keys(&keys) && check_deadlines(&deadlines, &keys) &&
             deadlines.len / 8 * KEY == keys.len && open_seg(obj, &view, &s, 1);
    if (ok) {
        s.fd = fd;
        if (cap && lock(&s, a)) {
            uint64_t ms = now_ms();
            for (Py_ssize_t i = 0; i < keys.len / KEY; i++) {
                int64_t slot = find(&s, (const uint8_t *)keys.buf + i * KEY);
                if (slot < 0) continue;
                hold(s.h, &s.slots[slot], deadline_at(&deadlines, i), ms);
                held++;
            }
            cap_retained(&s, cap, ms);
            unlock(&s);
        }
        PyBuffer_Release(&view);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&deadlines);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(held);
}

/* retention(buffer) -> (retained slots now, hits, demoted, evicted): the pool's figures, read without the lock (a
 * gauge may be a step behind). */
static PyObject *py_retention(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    PyObject *out = Py_BuildValue("(KKKK)", (unsigned long long)count_retained(&s),
                                  (unsigned long long)s.h->retain_hits, (unsigned long long)s.h->retain_demoted,
                                  (unsigned long long)s.h->retain_evicted);
    PyBuffer_Release(&view);
    return out;
}

/* reset(buffer, attachment) -> count: drop the ready, unpinned blocks this engine wrote. */
static PyObject *py_reset(PyObject *self, PyObject *args) {
    PyObject *obj;
    int fd, a;
    if (!PyArg_ParseTuple(args, "Oii", &obj, &fd, &a) || !check_attachment(a)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    s.fd = fd;
    long dropped = 0;
    if (lock(&s, a)) {
        write_begin(&s);
        for (uint64_t i = 0; i < s.n; i++) {
            Slot *slot = &s.slots[i];
            if (slot->state == READY && slot->owner == a && slot->pins == 0 && slot_ok(slot)) {
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

/* verify(buffer, slots, epochs, state) -> True when every slot is in ``state`` (READY for a job reading slots,
 * IN_FLIGHT for one writing them) at its epoch and passes its check (a worker's check). */
static PyObject *py_verify(PyObject *self, PyObject *args) {
    PyObject *obj, *slots, *epochs;
    int want = READY;
    if (!PyArg_ParseTuple(args, "OO!O!|i", &obj, &PyTuple_Type, &slots, &PyTuple_Type, &epochs, &want)) return NULL;
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
        ok = slot >= 0 && (uint64_t)slot < s.n && epoch != 0 &&
             __atomic_load_n(&s.slots[slot].epoch, __ATOMIC_ACQUIRE) == epoch &&
             __atomic_load_n(&s.slots[slot].state, __ATOMIC_ACQUIRE) == want && slot_ok(&s.slots[slot]);
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(ok);
}

/* stats(buffer) -> dict of the pool's counters (read without the lock: a gauge may be a step behind). */
static PyObject *py_stats(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    Header *h = s.h;
    int attached = 0;
    for (int a = 0; a < MAX_ATTACH; a++) attached += h->att[a].pid != 0;
    uint64_t used = h->used < s.n ? h->used : s.n;
    PyObject *out = Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsisKsK}", "capacity", (unsigned long long)s.n, "used", (unsigned long long)used,
        "slot_bytes", (unsigned long long)h->slot_bytes, "stores", (unsigned long long)h->stores,
        "evictions", (unsigned long long)h->evictions, "cross_hits", (unsigned long long)h->cross_hits,
        "repairs", (unsigned long long)h->repairs, "reclaimed", (unsigned long long)h->reclaimed, "attached", attached,
        "busy", (unsigned long long)h->busy, "generation", (unsigned long long)h->generation);
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

#define PROBLEM(...) snprintf(problem, size, __VA_ARGS__)

/* The first broken law of a locked segment into ``problem`` ("" when none). */
static void find_problem(Seg *s, char *problem, size_t size) {
    Header *h = s->h;
    uint64_t used = 0, entries = 0, live = live_mask(s), resident[MAX_TENANTS] = {0}, retained = 0;
    *problem = 0;
    if (!table_ok(h)) PROBLEM("the tenant table is damaged");
    for (uint64_t i = 0; i < s->n && !*problem; i++) {
        Slot *slot = &s->slots[i];
        unsigned long long u = (unsigned long long)i;
        if (!slot_ok(slot)) PROBLEM("slot %llu fails its check (state %u)", u, slot->state);
        else if ((slot->state == FREE || slot->state == LOST) && slot->pins) PROBLEM("free slot %llu is pinned", u);
        else if (slot->pins & ~live) PROBLEM("slot %llu is pinned by a detached engine", u);
        else if (slot->state == IN_FLIGHT && !((live >> slot->owner) & 1))
            PROBLEM("slot %llu is in flight for a detached engine", u);
        else if ((slot->state == READY || slot->state == IN_FLIGHT) && slot->epoch >= h->next_epoch)
            PROBLEM("slot %llu's epoch is not below the next one", u);
        else if ((slot->state == READY || slot->state == IN_FLIGHT) && find(s, slot->key) != (int64_t)i)
            PROBLEM("slot %llu's key is not indexed to it", u);
        else if ((slot->state == READY || slot->state == IN_FLIGHT) && tenant_of(h, slot) != slot->tenant)
            PROBLEM("slot %llu's tenant %u is not in the tenant table", u, slot->tenant);
        else if (!holds_key(slot) && slot->deadline)
            PROBLEM("free slot %llu has a deadline", u);
        retained += holds_key(slot) && slot->deadline;
        used += slot->state == READY || slot->state == IN_FLIGHT;
        if (slot->state == READY || slot->state == IN_FLIGHT) resident[tenant_of(h, slot)]++;
    }
    for (int t = 0; t < MAX_TENANTS && !*problem; t++)
        if (resident[t] != h->tenant[t].resident)
            PROBLEM("tenant %d holds %llu slots, its count says %llu", t, (unsigned long long)resident[t],
                    (unsigned long long)h->tenant[t].resident);
    if (!*problem && retained != h->retained)
        PROBLEM("%llu slots have deadlines, the count says %llu", (unsigned long long)retained,
                (unsigned long long)h->retained);
    for (uint64_t i = 0; i <= s->mask && !*problem; i++) {
        int64_t slot = entry(s, i);
        if (slot == -1) continue;
        entries++;
        if (slot < 0 || (s->slots[slot].state != READY && s->slots[slot].state != IN_FLIGHT))
            PROBLEM("table entry %llu names slot %lld, which holds no key", (unsigned long long)i, (long long)slot);
    }
    if (!*problem && (used != h->used || entries != used))
        PROBLEM("%llu slots hold keys, the count says %llu, the table has %llu entries", (unsigned long long)used,
                (unsigned long long)h->used, (unsigned long long)entries);
    if (!*problem && h->hand >= s->n) PROBLEM("the CLOCK hand is past the slots");
    if (!*problem && (h->seq & 1)) PROBLEM("the sequence counter is odd outside a write");
    if (!*problem && s->bad) PROBLEM("a table entry names no slot");
}

/* check(buffer, attachment, repair=False) -> None, or the first broken law as a string; ``repair``: and rebuild
 * the index from its slots (what every engine does once a RECLAIM_S, so damage no operation ran into is found). */
static PyObject *py_check(PyObject *self, PyObject *args) {
    PyObject *obj;
    int fd, a, fix = 0;
    if (!PyArg_ParseTuple(args, "Oii|p", &obj, &fd, &a, &fix)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    s.fd = fd;
    char problem[200] = "";
    if (lock(&s, a)) {
        find_problem(&s, problem, sizeof problem);
        s.bad = fix && *problem; /* unlock repairs */
        unlock(&s);
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return NULL;
    if (!*problem) Py_RETURN_NONE;
    return PyUnicode_FromString(problem);
}

/* The table read without the lock, retried while a writer overlaps; 0 when it never read whole (a writer died
 * mid-change: the next holder repairs). */
static int read_table(Seg *s, uint64_t *gen, int *on, Tenant *copy) {
    for (int t = 0; t < LOCKFREE_TRIES * 4; t++) {
        uint64_t before = __atomic_load_n(&s->h->seq, __ATOMIC_ACQUIRE);
        if (before & 1) continue;
        *gen = s->h->tenants_gen;
        *on = table_ok(s->h) && tenants_on(s->h);
        memcpy(copy, s->h->tenant, sizeof(Tenant) * MAX_TENANTS);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&s->h->seq, __ATOMIC_ACQUIRE) == before) return 1;
    }
    return 0;
}

/* tenants(buffer) -> (generation, on, [(position, name, hashed, share, resident, stores, evictions)]): the tenant
 * table, read without the lock (a gauge may be a step behind); a damaged table reads as none (off). */
static PyObject *py_tenants(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 0)) return NULL;
    Tenant table[MAX_TENANTS];
    uint64_t gen = 0;
    int on = 0;
    if (!read_table(&s, &gen, &on, table)) on = 0;
    PyObject *entries = PyList_New(0);
    for (int t = 0; on && entries && t < MAX_TENANTS; t++) {
        Tenant *e = &table[t];
        if (!(e->flags & NAMED)) continue;
        size_t len = strnlen((const char *)e->name, TENANT_NAME);
        if (e->flags & HASHED) len = TENANT_NAME;
        PyObject *item = Py_BuildValue("(iy#OIKKK)", t, (const char *)e->name, (Py_ssize_t)len,
                                       (e->flags & HASHED) ? Py_True : Py_False, e->share,
                                       (unsigned long long)(e->resident < s.n ? e->resident : s.n),
                                       (unsigned long long)e->stores, (unsigned long long)e->evictions);
        if (!item || PyList_Append(entries, item) < 0) Py_CLEAR(entries);
        Py_XDECREF(item);
    }
    PyBuffer_Release(&view);
    if (!entries) return NULL;
    return Py_BuildValue("(KON)", (unsigned long long)gen, on ? Py_True : Py_False, entries);
}

/* One named entry of set_tenants' arguments: (name bytes, hashed, share), checked. */
static int parse_tenant(PyObject *item, Tenant *t) {
    const char *name;
    Py_ssize_t len;
    int hashed;
    unsigned int share;
    if (!PyArg_ParseTuple(item, "y#pI", &name, &len, &hashed, &share)) return 0;
    if (len < 1 || len > TENANT_NAME || (!hashed && memchr(name, 0, (size_t)len)) || share > SHARE_ONE) {
        PyErr_SetString(PyExc_ValueError, "set_tenants: a name of 1 to 64 bytes (no NUL unless hashed), a share "
                                          "of at most one million");
        return 0;
    }
    memset(t, 0, sizeof *t);
    memcpy(t->name, name, (size_t)len);
    t->share = share;
    t->flags = NAMED | (hashed ? HASHED : 0);
    return 1;
}

static int same_name(const Tenant *a, const Tenant *b) {
    return (a->flags & (NAMED | HASHED)) == (b->flags & (NAMED | HASHED)) && !memcmp(a->name, b->name, TENANT_NAME);
}

/* Write ``named`` and "other" into the table. A tenant already in the table keeps its position (its slots keep
 * counting for it); a new one takes a free position; a position whose tenant went is cleared, and the slots that
 * counted for it count for "other" (recounted). */
static void write_table(Seg *s, const Tenant *named, int count, uint32_t other_share) {
    Header *h = s->h;
    int was_on = tenants_on(h) && table_ok(h), position[MAX_TENANTS - 1], taken[MAX_TENANTS - 1] = {0};
    for (int j = 0; j < count; j++) {
        position[j] = -1;
        for (int p = 0; was_on && p < OTHER; p++)
            if (!taken[p] && (h->tenant[p].flags & NAMED) && same_name(&h->tenant[p], &named[j])) {
                position[j] = p;
                taken[p] = 1;
                break;
            }
    }
    for (int j = 0, p = 0; j < count; j++) {
        if (position[j] >= 0) continue;
        while (taken[p]) p++;
        position[j] = p;
        taken[p] = 1;
    }
    Tenant fresh[MAX_TENANTS];
    memset(fresh, 0, sizeof fresh);
    for (int j = 0; j < count; j++) fresh[position[j]] = named[j];
    memcpy(fresh[OTHER].name, "other", 5);
    fresh[OTHER].flags = NAMED;
    fresh[OTHER].share = other_share;
    int kept[MAX_TENANTS];
    for (int p = 0; p < MAX_TENANTS; p++)
        kept[p] = p == OTHER || (was_on && (h->tenant[p].flags & NAMED) && same_name(&h->tenant[p], &fresh[p]));
    for (uint64_t i = 0; i < s->n; i++) /* a tenant gone (or another in its place): its slots go to "other" */
        if (s->slots[i].tenant < MAX_TENANTS && !kept[s->slots[i].tenant]) s->slots[i].tenant = OTHER;
    for (int p = 0; p < MAX_TENANTS; p++) {
        Tenant *t = &h->tenant[p];
        memcpy(t->name, fresh[p].name, TENANT_NAME);
        t->share = fresh[p].share;
        t->flags = fresh[p].flags;
        if (!kept[p]) t->stores = t->evictions = 0;
        t->check = tenant_check(t, p);
    }
    __atomic_store_n(&h->tenants_on, 1, __ATOMIC_RELEASE);
    h->tenants_gen++;
    recount_tenants(h, s->slots, s->n);
}

/* set_tenants(buffer, attachment, [(name, hashed, share)], other_share, replace) -> whether written: the pool's
 * tenant table (shares in millionths); ``replace`` False writes it only when the pool has none. */
static PyObject *py_set_tenants(PyObject *self, PyObject *args) {
    PyObject *obj, *list;
    int fd, a, replace;
    unsigned int other_share;
    if (!PyArg_ParseTuple(args, "OiiO!Ip", &obj, &fd, &a, &PyList_Type, &list, &other_share, &replace) ||
        !check_attachment(a))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(list);
    Tenant named[MAX_TENANTS - 1];
    long long total = other_share;
    if (count > OTHER || other_share > SHARE_ONE) {
        PyErr_Format(PyExc_ValueError, "set_tenants: at most %d named tenants, shares of at most one million", OTHER);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < count; j++) {
        if (!parse_tenant(PyList_GET_ITEM(list, j), &named[j])) return NULL;
        total += named[j].share;
        for (Py_ssize_t i = 0; i < j; i++)
            if (same_name(&named[i], &named[j])) {
                PyErr_SetString(PyExc_ValueError, "set_tenants: a tenant named twice");
                return NULL;
            }
    }
    if (total > SHARE_ONE + SHARE_SLACK) {
        PyErr_SetString(PyExc_ValueError, "set_tenants: shares add up to more than the pool");
        return NULL;
    }
    Py_buffer view;
    Seg s;
    if (!open_seg(obj, &view, &s, 1)) return NULL;
    s.fd = fd;
    int written = 0;
    if (lock(&s, a)) {
        if (replace || !tenants_on(s.h) || !table_ok(s.h)) {
            write_begin(&s);
            write_table(&s, named, (int)count, other_share);
            write_end(&s);
            written = 1;
        }
        unlock(&s);
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(written);
}

/* set_rule(kind): which rule reserve evicts by with a tenant table; tests only (a mutant shows a test can fail). */
static PyObject *py_set_rule(PyObject *self, PyObject *args) {
    int kind;
    if (!PyArg_ParseTuple(args, "i", &kind)) return NULL;
    if (kind < RULE || kind > RULE_HARD_QUOTA) {
        PyErr_SetString(PyExc_ValueError, "set_rule: an unknown rule");
        return NULL;
    }
    rule_kind = kind;
    Py_RETURN_NONE;
}

/* shift_clock(ms): tests only: the clock deadlines are read against runs ``ms`` ahead of CLOCK_MONOTONIC. */
static PyObject *py_shift_clock(PyObject *self, PyObject *args) {
    long long ms;
    if (!PyArg_ParseTuple(args, "L", &ms)) return NULL;
    if (ms < 0 || ms > (long long)(100 * MAX_RETAIN_MS)) {
        PyErr_SetString(PyExc_ValueError, "shift_clock: 0 to 100 days");
        return NULL;
    }
    clock_shift_ms = ms;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"init", py_init, METH_VARARGS, "Format a new segment."},
    {"size", py_size, METH_VARARGS, "Bytes of a segment of num_slots slots and table_size table entries."},
    {"set_wait_ms", py_set_wait_ms, METH_VARARGS, "How long this process waits for the lock (then Busy)."},
    {"files", py_files, METH_VARARGS, "(generation, engines inode, {rank: pool inode}) as recorded."},
    {"bind_pool", py_bind_pool, METH_VARARGS, "Record a rank's pool file inode."},
    {"attach", py_attach, METH_VARARGS, "Register an engine; its attachment id, or -1 when full."},
    {"attachments", py_attachments, METH_VARARGS, "The attached engines: (id, pid, start, pidns)."},
    {"release", py_release, METH_VARARGS, "Release an engine's pins, in-flight slots and entry (dead: count it reclaimed)."},
    {"lookup", py_lookup, METH_VARARGS, "(leading ready keys, first other one in flight for this engine)."},
    {"touch", py_touch, METH_VARARGS, "Set the CLOCK bits of keys."},
    {"pin", py_pin, METH_VARARGS, "Pin ready keys: [(slot, epoch)], (-1, 0) when not ready."},
    {"unpin", py_unpin, METH_VARARGS, "Unpin slots (of these epochs); drop: free them when no one pins them."},
    {"complete", py_complete, METH_VARARGS, "Complete this engine's stores (success) or forget them."},
    {"reserve", py_reserve, METH_VARARGS, "Reserve slots for the keys not held; None when there is no room."},
    {"retain", py_retain, METH_VARARGS, "Raise held keys' deadlines (ms); past the cap the oldest are dropped."},
    {"retention", py_retention, METH_VARARGS, "(retained slots now, hits, demoted, evicted)."},
    {"reset", py_reset, METH_VARARGS, "Drop the ready, unpinned blocks this engine wrote."},
    {"verify", py_verify, METH_VARARGS, "Whether slots are in a state (READY by default) at these epochs."},
    {"stats", py_stats, METH_VARARGS, "The pool's counters."},
    {"check", py_check, METH_VARARGS, "None, or the first broken law of the segment (repair: and rebuild it)."},
    {"served", py_served, METH_VARARGS, "Pins other engines took on blocks this attachment stored."},
    {"tenants", py_tenants, METH_VARARGS, "(generation, on, [(position, name, hashed, share, resident, stores, evictions)])."},
    {"set_tenants", py_set_tenants, METH_VARARGS, "Write the tenant table (replace: even over another one)."},
    {"set_rule", py_set_rule, METH_VARARGS, "Tests only: evict by the rule (0) or one of its mutants."},
    {"shift_clock", py_shift_clock, METH_VARARGS, "Tests only: read deadlines against a clock ms ahead."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nodeindex", "The node tier's shared index.", -1, methods};

PyMODINIT_FUNC PyInit__nodeindex(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Busy = PyErr_NewExceptionWithDoc("kvoffload._nodeindex.Busy",
                                     "Another engine held the index's lock past the wait: the operation did nothing.",
                                     NULL, NULL);
    Damaged = PyErr_NewExceptionWithDoc("kvoffload._nodeindex.Damaged",
                                        "The segment's header is not what this module made: do not use it.",
                                        NULL, NULL);
    if (!Busy || !Damaged || PyModule_AddObjectRef(m, "Busy", Busy) < 0 ||
        PyModule_AddObjectRef(m, "Damaged", Damaged) < 0 ||
        PyModule_AddIntConstant(m, "MAX_ATTACH", MAX_ATTACH) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_MS", WAIT_MS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_RETAIN_MS", (long)MAX_RETAIN_MS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_RANKS", MAX_RANKS) < 0 ||
        PyModule_AddIntConstant(m, "VERSION", VERSION) < 0 ||
        PyModule_AddIntConstant(m, "READY", READY) < 0 || PyModule_AddIntConstant(m, "IN_FLIGHT", IN_FLIGHT) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TENANTS", MAX_TENANTS) < 0 || PyModule_AddIntConstant(m, "OTHER", OTHER) < 0 ||
        PyModule_AddIntConstant(m, "TENANT_NAME", TENANT_NAME) < 0 ||
        PyModule_AddIntConstant(m, "SHARE_ONE", (long)SHARE_ONE) < 0 ||
        PyModule_AddIntConstant(m, "TENANT_BYTES", (long)sizeof(Tenant)) < 0 ||
        PyModule_AddIntConstant(m, "RULE", RULE) < 0 || PyModule_AddIntConstant(m, "RULE_ANY", RULE_ANY) < 0 ||
        PyModule_AddIntConstant(m, "RULE_NO_TAKE_BACK", RULE_NO_TAKE_BACK) < 0 ||
        PyModule_AddIntConstant(m, "RULE_NO_OWN", RULE_NO_OWN) < 0 ||
        PyModule_AddIntConstant(m, "RULE_HARD_QUOTA", RULE_HARD_QUOTA) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_BYTES", (long)sizeof(Slot)) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_BYTES", (long)header_size()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* Where fields lie, for tests that damage them on purpose (and tools that read them). */
    PyObject *layout = Py_BuildValue(
        "{snsnsnsnsnsnsnsnsnsnsnsnsnsnsnsnsn}", "seq", (Py_ssize_t)offsetof(Header, seq),
        "hand", (Py_ssize_t)offsetof(Header, hand), "next_epoch", (Py_ssize_t)offsetof(Header, next_epoch),
        "att", (Py_ssize_t)offsetof(Header, att), "slot_epoch", (Py_ssize_t)offsetof(Slot, epoch),
        "slot_pins", (Py_ssize_t)offsetof(Slot, pins), "slot_state", (Py_ssize_t)offsetof(Slot, state),
        "slot_tenant", (Py_ssize_t)offsetof(Slot, tenant), "tenants_on", (Py_ssize_t)offsetof(Header, tenants_on),
        "tenant", (Py_ssize_t)offsetof(Header, tenant), "tenant_name", (Py_ssize_t)offsetof(Tenant, name),
        "tenant_share", (Py_ssize_t)offsetof(Tenant, share), "tenant_flags", (Py_ssize_t)offsetof(Tenant, flags),
        "tenant_resident", (Py_ssize_t)offsetof(Tenant, resident),
        "tenant_stores", (Py_ssize_t)offsetof(Tenant, stores), "slot_deadline", (Py_ssize_t)offsetof(Slot, deadline),
        "retained", (Py_ssize_t)offsetof(Header, retained));
    if (!layout || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
