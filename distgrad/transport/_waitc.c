/* The native form of distgrad/transport/waiting.py: waits with the GIL released.
 *
 * A thread that expects bytes soon looks at its descriptor (poll or epoll_wait with
 * a zero timeout) and calls sched_yield() between looks for at most spin_ns, then
 * sleeps in the kernel for the rest of its timeout. It spins only while the host
 * has a free core (the gate): the runnable count of /proc/loadavg against the CPUs
 * of this process's affinity mask, and a host-wide count of spinning distgrad
 * threads kept in a small file under /dev/shm (one 64-byte slot per spinner holding
 * pid << 32 | a millisecond timestamp, claimed and given back by compare-and-swap;
 * a slot whose timestamp is older than STALE_MS is not counted and may be taken,
 * so a process killed while spinning never keeps the gate shut).
 *
 * The Python forms in waiting.py are the reference: same functions, same results,
 * same file format. Every function here is also documented there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NSLOTS 64
#define SLOT_STRIDE 64          /* bytes: one cache line per slot */
#define STALE_MS 20             /* a live spinner refreshes its slot every millisecond */
#define LOADAVG_EVERY_NS 1000000LL

static int g_ncpu = 0;                  /* CPUs in the affinity mask at setup */
static int g_loadavg_fd = -1;           /* kept open; read with pread */
/* The slot file, read and written with pread/pwrite under its lock (never mapped: a
 * mapping of a file another process truncates, or of a full /dev/shm, raises SIGBUS) */
static int g_slots_fd = -1;
static pthread_mutex_t g_slots_mu = PTHREAD_MUTEX_INITIALIZER;   /* our threads ... */
static int g_runnable = 0;              /* cached runnable count ... */
static long long g_runnable_at = 0;     /* ... and when it was read (ns, monotonic) */
/* what the spins did (relaxed counters, for stats()): asked for, refused by the gate,
 * ended with the descriptor ready */
static unsigned long long g_asked = 0, g_refused = 0, g_caught = 0;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int slot_live(uint64_t v, uint32_t now_ms) {
    return v != 0 && (uint32_t)(now_ms - (uint32_t)v) <= STALE_MS;
}

/* The runnable count (4th field of /proc/loadavg, "R/T"), read at most once per ms. */
static int runnable(void) {
    long long t = now_ns();
    long long at = __atomic_load_n(&g_runnable_at, __ATOMIC_RELAXED);
    int fd = g_loadavg_fd;
    if (fd < 0)
        return -1;
    if (at && t - at < LOADAVG_EVERY_NS)
        return __atomic_load_n(&g_runnable, __ATOMIC_RELAXED);
    char buf[128];
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    /* "0.52 0.58 0.59 3/467 12345": the field after the third space */
    char *p = buf;
    for (int spaces = 0; *p && spaces < 3; p++)
        if (*p == ' ')
            spaces++;
    char *end;
    long r = strtol(p, &end, 10);
    if (end == p || *end != '/')
        return -1;
    __atomic_store_n(&g_runnable, (int)r, __ATOMIC_RELAXED);
    __atomic_store_n(&g_runnable_at, t, __ATOMIC_RELAXED);
    return (int)r;
}

/* The decision (waiting.may_spin): the runnable count includes the thread asking and
 * the spinners; what is left of the CPUs after every other runnable thread must
 * exceed the spinners already counted. */
static int may_spin(int ncpu, int run, int spinners) {
    int others = run - 1 - spinners;
    if (others < 0)
        others = 0;
    return spinners < ncpu - others;
}

/* Every slot's value into out[NSLOTS] (a short file reads as free slots); -1 on error. */
static int read_slots(int fd, uint64_t *out) {
    unsigned char buf[NSLOTS * SLOT_STRIDE];
    memset(buf, 0, sizeof(buf));
    if (pread(fd, buf, sizeof(buf), 0) < 0)
        return -1;
    for (int i = 0; i < NSLOTS; i++)
        memcpy(&out[i], buf + (size_t)i * SLOT_STRIDE, sizeof(uint64_t));
    return 0;
}

static int read_slot(int fd, int i, uint64_t *v) {
    *v = 0;
    return pread(fd, v, sizeof(*v), (off_t)i * SLOT_STRIDE) < 0 ? -1 : 0;
}

static int write_slot(int fd, int i, uint64_t v) {
    return pwrite(fd, &v, sizeof(v), (off_t)i * SLOT_STRIDE) == (ssize_t)sizeof(v) ? 0 : -1;
}

/* ... and other processes (a POSIX lock of the whole file, as the Python form's lockf) */
static int lock_slots(int fd) {
    pthread_mutex_lock(&g_slots_mu);
    if (lockf(fd, F_LOCK, 0) != 0) {
        pthread_mutex_unlock(&g_slots_mu);
        return -1;
    }
    return 0;
}

static void unlock_slots(int fd) {
    lockf(fd, F_ULOCK, 0);
    pthread_mutex_unlock(&g_slots_mu);
}

static int count_live(const uint64_t *slots, uint32_t now_ms) {
    int live = 0;
    for (int i = 0; i < NSLOTS; i++)
        if (slot_live(slots[i], now_ms))
            live++;
    return live;
}

/* Claim a slot when the gate is open: its index, and its value in *mine; -1 when not
 * (any error reading or writing the slot file shuts the gate for this wait). */
static int gate_claim(uint64_t *mine) {
    int fd = g_slots_fd;
    if (fd < 0 || g_ncpu <= 0)
        return -1;
    int run = runnable();
    if (run < 0 || !may_spin(g_ncpu, run, 0))
        return -1;   /* no free core even before counting spinners: no file access */
    if (lock_slots(fd) != 0)
        return -1;
    int got = -1;
    uint64_t slots[NSLOTS];
    uint32_t now_ms = (uint32_t)(now_ns() / 1000000LL);
    if (read_slots(fd, slots) == 0 && may_spin(g_ncpu, run, count_live(slots, now_ms))) {
        uint64_t v = ((uint64_t)(uint32_t)getpid() << 32) | now_ms;
        if (v == 0)
            v = 1;
        for (int i = 0; i < NSLOTS; i++) {
            if (!slot_live(slots[i], now_ms)) {
                if (write_slot(fd, i, v) == 0) {
                    *mine = v;
                    got = i;
                }
                break;
            }
        }
    }
    unlock_slots(fd);
    return got;
}

/* Keep the slot fresh while spinning; 0 when it was taken from us (we were stale). */
static int gate_refresh(int i, uint64_t *mine) {
    uint32_t now_ms = (uint32_t)(now_ns() / 1000000LL);
    if ((uint32_t)*mine == now_ms)
        return 1;
    uint64_t v = (*mine & 0xffffffff00000000ULL) | now_ms;
    if (v == 0)
        v = 1;
    int fd = g_slots_fd, ok = 0;
    uint64_t old;
    if (fd < 0 || lock_slots(fd) != 0)
        return 0;
    if (read_slot(fd, i, &old) == 0 && old == *mine && write_slot(fd, i, v) == 0) {
        *mine = v;
        ok = 1;
    }
    unlock_slots(fd);
    return ok;
}

static void gate_release(int i, uint64_t mine) {
    int fd = g_slots_fd;
    uint64_t old;
    if (fd < 0 || lock_slots(fd) != 0)
        return;
    if (read_slot(fd, i, &old) == 0 && old == mine)
        write_slot(fd, i, 0);
    unlock_slots(fd);
}

/* One look: >0 ready (n events / revents), 0 nothing, -1 error (errno). */
typedef int (*look_fn)(int fd, int timeout_ms, void *arg);

typedef struct {
    struct epoll_event *evs;
    int maxevents;
} epoll_arg;

static int look_poll(int fd, int timeout_ms, void *arg) {
    struct pollfd p = {fd, POLLIN, 0};
    (void)arg;
    return poll(&p, 1, timeout_ms);
}

static int look_epoll(int fd, int timeout_ms, void *arg) {
    epoll_arg *a = (epoll_arg *)arg;
    return epoll_wait(fd, a->evs, a->maxevents, timeout_ms);
}

static int remaining_ms(long long deadline) {
    if (deadline < 0)
        return -1;
    long long left = deadline - now_ns();
    if (left <= 0)
        return 0;
    long long ms = (left + 999999) / 1000000;   /* rounded up, as select's timeouts */
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

/* Spin (gated) then sleep, GIL released; signals: return to Python (PEP 475 style). */
static int wait_look(int fd, long long spin_ns, int timeout_ms, look_fn look, void *arg,
                     int *spun) {
    long long start = now_ns();
    long long deadline = timeout_ms < 0 ? -1 : start + (long long)timeout_ms * 1000000LL;
    int r;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        r = 0;
        if (spin_ns > 0 && !*spun) {
            uint64_t mine = 0;
            int slot;
            *spun = 1;
            if (deadline >= 0 && deadline - start < spin_ns)
                spin_ns = deadline - start;
            slot = spin_ns > 0 ? gate_claim(&mine) : -1;
            if (spin_ns > 0) {
                __atomic_fetch_add(&g_asked, 1, __ATOMIC_RELAXED);
                if (slot < 0)
                    __atomic_fetch_add(&g_refused, 1, __ATOMIC_RELAXED);
            }
            if (slot >= 0) {
                long long stop = start + spin_ns;
                for (;;) {
                    r = look(fd, 0, arg);
                    if (r != 0 || now_ns() >= stop || !gate_refresh(slot, &mine))
                        break;
                    sched_yield();
                }
                gate_release(slot, mine);
                if (r > 0)
                    __atomic_fetch_add(&g_caught, 1, __ATOMIC_RELAXED);
            }
        }
        if (r == 0)
            r = look(fd, remaining_ms(deadline), arg);
        Py_END_ALLOW_THREADS
        if (r >= 0)
            return r;
        if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0)   /* a handler raised (KeyboardInterrupt) */
            return -1;
        timeout_ms = remaining_ms(deadline);
        if (timeout_ms == 0)
            return 0;
        start = now_ns();
        deadline = timeout_ms < 0 ? -1 : start + (long long)timeout_ms * 1000000LL;
    }
}

static PyObject *waitc_wait_fd(PyObject *self, PyObject *args) {
    PyObject *fdobj;
    long long spin_ns;
    int timeout_ms, spun = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLi:wait_fd", &fdobj, &spin_ns, &timeout_ms))
        return NULL;
    int fd = PyObject_AsFileDescriptor(fdobj);
    if (fd < 0)
        return NULL;
    int r = wait_look(fd, spin_ns, timeout_ms, look_poll, NULL, &spun);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r > 0);
}

static PyObject *waitc_epoll_wait_spin(PyObject *self, PyObject *args) {
    PyObject *fdobj;
    long long spin_ns;
    int timeout_ms, maxevents = -1, spun = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLi|i:epoll_wait_spin", &fdobj, &spin_ns, &timeout_ms,
                          &maxevents))
        return NULL;
    int epfd = PyObject_AsFileDescriptor(fdobj);
    if (epfd < 0)
        return NULL;
    if (maxevents == -1)
        maxevents = FD_SETSIZE - 1;
    else if (maxevents < 1) {
        PyErr_Format(PyExc_ValueError, "maxevents must be greater than 0, got %d", maxevents);
        return NULL;
    }
    struct epoll_event one[8];
    epoll_arg a = {one, maxevents};
    if (maxevents > 8 && (a.evs = PyMem_Malloc(sizeof(struct epoll_event) * maxevents)) == NULL)
        return PyErr_NoMemory();
    int n = wait_look(epfd, spin_ns, timeout_ms, look_epoll, &a, &spun);
    PyObject *out = NULL;
    if (n >= 0 && (out = PyList_New(n)) != NULL) {
        for (int i = 0; i < n; i++) {
            PyObject *t = Py_BuildValue("(iI)", a.evs[i].data.fd, a.evs[i].events);
            if (t == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, t);
        }
    }
    if (a.evs != one)
        PyMem_Free(a.evs);
    return out;
}

/* setup_gate(slots_path, loadavg_path) -> bool: open (and make) the slot file and the
 * loadavg file and count the CPUs; False (the gate stays shut: no spinning) when
 * either is missing or the slot file is not this user's regular file. */
static PyObject *waitc_setup_gate(PyObject *self, PyObject *args) {
    const char *slots_path, *loadavg_path;
    (void)self;
    if (!PyArg_ParseTuple(args, "ss:setup_gate", &slots_path, &loadavg_path))
        return NULL;
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS
    cpu_set_t set;
    int ncpu = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
    int lfd = open(loadavg_path, O_RDONLY | O_CLOEXEC);
    int sfd = open(slots_path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    struct stat st;
    off_t size = (off_t)NSLOTS * SLOT_STRIDE;
    /* the file's blocks are reserved (posix_fallocate): a full /dev/shm fails here, at
     * setup, with no spinning, rather than at a write */
    if (ncpu > 0 && lfd >= 0 && sfd >= 0 && fstat(sfd, &st) == 0 && S_ISREG(st.st_mode)
            && st.st_uid == getuid() && posix_fallocate(sfd, 0, size) == 0) {
        /* an earlier descriptor stays open: a spinning thread may be using it */
        g_ncpu = ncpu;
        g_loadavg_fd = lfd;
        __atomic_store_n(&g_runnable_at, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&g_slots_fd, sfd, __ATOMIC_RELEASE);
        ok = 1;
    } else {
        if (lfd >= 0)
            close(lfd);
        if (sfd >= 0)
            close(sfd);
        __atomic_store_n(&g_slots_fd, -1, __ATOMIC_RELEASE);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

/* gate_state() -> (ncpu, runnable, live spinners, open): what the gate sees now. */
static PyObject *waitc_gate_state(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    int fd = g_slots_fd;
    uint64_t slots[NSLOTS];
    if (fd < 0 || read_slots(fd, slots) != 0)
        return Py_BuildValue("(iiiO)", g_ncpu, -1, 0, Py_False);
    __atomic_store_n(&g_runnable_at, 0, __ATOMIC_RELAXED);   /* a fresh sample */
    int run = runnable();
    int live = count_live(slots, (uint32_t)(now_ns() / 1000000LL));
    return Py_BuildValue("(iiiO)", g_ncpu, run, live,
                         run >= 0 && may_spin(g_ncpu, run, live) ? Py_True : Py_False);
}

/* gate_claim() -> (slot, value) or None; gate_release(slot, value): for the tests. */
static PyObject *waitc_gate_claim(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    uint64_t mine = 0;
    __atomic_store_n(&g_runnable_at, 0, __ATOMIC_RELAXED);
    int i = gate_claim(&mine);
    if (i < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(iK)", i, (unsigned long long)mine);
}

static PyObject *waitc_gate_release(PyObject *self, PyObject *args) {
    int i;
    unsigned long long v;
    (void)self;
    if (!PyArg_ParseTuple(args, "iK:gate_release", &i, &v))
        return NULL;
    if (g_slots_fd < 0 || i < 0 || i >= NSLOTS) {
        PyErr_SetString(PyExc_ValueError, "no such slot");
        return NULL;
    }
    gate_release(i, (uint64_t)v);
    Py_RETURN_NONE;
}

/* stats() -> (asked, refused, caught): spins asked for, refused by the gate, and ended
 * with the descriptor ready (the rest slept after their budget). */
static PyObject *waitc_stats(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("(KKK)", __atomic_load_n(&g_asked, __ATOMIC_RELAXED),
                         __atomic_load_n(&g_refused, __ATOMIC_RELAXED),
                         __atomic_load_n(&g_caught, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"stats", waitc_stats, METH_NOARGS, "stats() -> (asked, refused, caught)"},
    {"wait_fd", waitc_wait_fd, METH_VARARGS,
     "wait_fd(fd, spin_ns, timeout_ms) -> bool: see distgrad.transport.waiting.wait_fd"},
    {"epoll_wait_spin", waitc_epoll_wait_spin, METH_VARARGS,
     "epoll_wait_spin(epfd, spin_ns, timeout_ms, maxevents=-1) -> [(fd, events), ...]: "
     "see distgrad.transport.waiting.epoll_wait_spin"},
    {"setup_gate", waitc_setup_gate, METH_VARARGS,
     "setup_gate(slots_path, loadavg_path) -> bool: see waiting.setup_gate"},
    {"gate_state", waitc_gate_state, METH_NOARGS,
     "gate_state() -> (ncpu, runnable, spinners, open)"},
    {"gate_claim", waitc_gate_claim, METH_NOARGS, "gate_claim() -> (slot, value) or None"},
    {"gate_release", waitc_gate_release, METH_VARARGS, "gate_release(slot, value)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_waitc",
    "Waits with the GIL released (the native form of distgrad.transport.waiting).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__waitc(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "NSLOTS", NSLOTS) < 0
                      || PyModule_AddIntConstant(m, "SLOT_STRIDE", SLOT_STRIDE) < 0
                      || PyModule_AddIntConstant(m, "STALE_MS", STALE_MS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
