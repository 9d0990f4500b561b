/* A libcuda for machines without a GPU: the driver calls gpushare makes (the ctypes
 * layer src/gpushare/client/swap/cuda.py and the allocator gpushare_alloc.c) and those
 * vLLM's cumem allocator makes, with the signatures and structures of cuda.h, over host
 * memory. It refuses what CUDA's documentation says CUDA refuses, so that a test passing
 * here does not pass by a leniency a GPU lacks:
 *
 *  - Virtual memory is modelled with the kernel's own: a reservation is an inaccessible
 *    mapping, a physical allocation a memfd, cuMemMap maps it at the reserved address
 *    (which must lie within one reservation, aligned to the granularity, over nothing
 *    mapped) and cuMemSetAccess (on a range wholly mapped) makes it readable and
 *    writable, so an unmapped range really faults. cuMemRelease of a handle still
 *    mapped frees its memory only when its last mapping goes, as CUDA does; a released
 *    handle cannot be mapped again. cuMemAddressFree takes a whole reservation with
 *    nothing mapped in it (CUDA leaves the latter undocumented: refused, so that a
 *    mapping left behind shows).
 *  - Fresh physical memory holds garbage, not zeros (as a GPU's holds what was there).
 *  - Copies and memsets on a stream (*Async) are done by a worker thread per stream, in
 *    stream order, each no sooner than FAKE_CUDA_LATENCY_US (default 1000) after it was
 *    queued: the caller's bytes are not there until cuStreamSynchronize,
 *    cuEventSynchronize after an event recorded behind them, or cuCtxSynchronize says
 *    so, and a missing synchronize corrupts bytes as on a GPU. A queued copy touching
 *    device memory not mapped and accessible when it runs is an illegal address: sticky
 *    (CUDA_ERROR_ILLEGAL_ADDRESS from every synchronize and every later queued call), as
 *    a GPU's context is lost. The NULL stream is a stream of its own; cuMemcpyDtoH_v2
 *    and cuMemcpyHtoD_v2 wait for it and copy at once.
 *  - Capacity: FAKE_CUDA_CAPACITY bytes (cuMemCreate past it: CUDA_ERROR_OUT_OF_MEMORY),
 *    shared by every process that loads the fake with the same FAKE_CUDA_SHARED (a file
 *    path: a table of each live process's bytes, under flock), so a second tenant's
 *    memory makes out-of-memory real; a process that died counts no more (the driver
 *    frees a dead process's memory). cuMemGetInfo_v2 reports it.
 *  - A wrong structure layout or flag returns CUDA_ERROR_INVALID_VALUE, a call that needs
 *    a current context returns CUDA_ERROR_INVALID_CONTEXT without one (contexts are a
 *    per-thread stack, as in CUDA), a stream or event not made (or destroyed) returns
 *    CUDA_ERROR_INVALID_HANDLE.
 *
 * Environment: FAKE_CUDA_GRANULARITY (bytes, default 2 MiB, an H200's; minimum and
 * recommended alike); FAKE_CUDA_DIRTY=0 makes fresh memory zeros; FAKE_CUDA_CORRUPT=1
 * flips the first byte of every device-to-host copy; FAKE_CUDA_DEVICES (default 1)
 * devices, peers of each other unless FAKE_CUDA_NO_PEERS=1 (memory lives on device 0
 * alone; the others can be granted access to it); FAKE_CUDA_FAIL=call:nth[:code] makes
 * the nth call of `call` fail (code default 999), for a process a test starts.
 * For tests (every cu* call but cuGetErrorString is counted, logged and can be made to
 * fail): fake_cuda_fail(name, code, skip) makes the call after `skip` more calls of
 * `name` fail once; fake_cuda_calls(name) counts calls; fake_cuda_log() lists them;
 * fake_cuda_alive(what) counts what was made and not given back ("streams", "events",
 * "contexts", "handles": physical allocations not yet freed, "mappings",
 * "reservations", "host": pinned host allocations) and "faults" (illegal addresses);
 * fake_cuda_mapped() the bytes mapped now;
 * fake_cuda_access(ids, max) the devices the last cuMemSetAccess granted;
 * fake_cuda_hold(on) stops every stream's worker until released.
 * Built by the tests with: cc -shared -fPIC -o X.so this.c -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUcontext, *CUstream, *CUevent;

typedef struct CUmemLocation_st { int type; int id; } CUmemLocation;
typedef struct CUmemAllocationProp_st {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct CUmemAccessDesc_st { CUmemLocation location; int flags; } CUmemAccessDesc;

enum {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
};
static int initialized;
static size_t created, pinned; /* this process's physical bytes, pinned host bytes */
static int ctx_refs, access_n, access_ids[16], host_allocs, faults;
static char ctx_token, foreign_token;
static __thread CUcontext stack[16];
static __thread int depth;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* before any stream's lock */
static volatile int held;                               /* fake_cuda_hold */
static volatile CUresult sticky;                        /* an illegal address seen */

static struct { char name[48]; int n; } counts[64];
static char fail_name[48];
static int fail_code, fail_skip;
static char calls_log[1 << 16];

static void env_fail(void) { /* FAKE_CUDA_FAIL=call:nth[:code], read at the first call */
    static int done;
    if (done) return;
    done = 1;
    const char *s = getenv("FAKE_CUDA_FAIL");
    if (!s || !*s) return;
    const char *c = strchr(s, ':');
    if (!c || (size_t)(c - s) >= sizeof fail_name) return;
    memcpy(fail_name, s, (size_t)(c - s));
    fail_name[c - s] = 0;
    char *end;
    fail_skip = (int)strtol(c + 1, &end, 10) - 1;
    fail_code = *end == ':' ? atoi(end + 1) : 999;
}

/* Count the call, log it, and fail it if asked to. */
static CUresult called(const char *name) {
    CUresult rc = OK;
    pthread_mutex_lock(&mu);
    env_fail();
    for (int i = 0; i < 64; i++) {
        if (!counts[i].name[0]) strncpy(counts[i].name, name, sizeof counts[i].name - 1);
        if (!strcmp(counts[i].name, name)) {
            counts[i].n++;
            break;
        }
    }
    size_t len = strlen(calls_log);
    if (len + strlen(name) + 2 < sizeof calls_log) {
        strcat(calls_log, name);
        strcat(calls_log, ";");
    }
    if (fail_name[0] && !strcmp(fail_name, name) && fail_skip-- == 0) {
        fail_name[0] = 0;
        rc = fail_code;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}
#define CALLED(name)                  \
    do {                              \
        CUresult rc_ = called(name);  \
        if (rc_) return rc_;          \
    } while (0)
#define NEEDS_CONTEXT() \
    do { if (!depth || stack[depth - 1] != &ctx_token) return INVALID_CONTEXT; } while (0)

void fake_cuda_fail(const char *name, int code, int skip) {
    pthread_mutex_lock(&mu);
    env_fail();
    strncpy(fail_name, name, sizeof fail_name - 1);
    fail_code = code;
    fail_skip = skip;
    pthread_mutex_unlock(&mu);
}
int fake_cuda_calls(const char *name) {
    for (int i = 0; i < 64; i++)
        if (!strcmp(counts[i].name, name)) return counts[i].n;
    return 0;
}
const char *fake_cuda_log(void) { return calls_log; }
void fake_cuda_log_clear(void) { calls_log[0] = 0; }
size_t fake_cuda_created(void) { return created; }
size_t fake_cuda_pinned(void) { return pinned; }
void fake_cuda_hold(int on) { held = on; }
/* The devices the last cuMemSetAccess granted access to; their count. */
int fake_cuda_access(int *ids, int max) {
    for (int i = 0; i < access_n && i < max; i++) ids[i] = access_ids[i];
    return access_n;
}
/* Another context (a workload's own) current on this thread: gpushare must push and
 * pop its own around its calls and leave this one current. */
void fake_cuda_push_foreign(void) { stack[depth++] = &foreign_token; }
int fake_cuda_foreign_current(void) { return depth && stack[depth - 1] == &foreign_token; }

static int env_is(const char *name, char c) {
    const char *s = getenv(name);
    return s && *s == c;
}
/* FAKE_CUDA_DEVICES devices (default 1), every one a peer of every other unless
 * FAKE_CUDA_NO_PEERS=1; only device 0 holds memory. */
static int devices(void) {
    const char *s = getenv("FAKE_CUDA_DEVICES");
    return s ? atoi(s) : 1;
}
static size_t granularity(void) {
    const char *s = getenv("FAKE_CUDA_GRANULARITY");
    return s ? strtoull(s, NULL, 10) : (size_t)2 << 20;
}
static size_t capacity(void) {
    const char *s = getenv("FAKE_CUDA_CAPACITY");
    return s ? strtoull(s, NULL, 10) : (size_t)1 << 40;
}
static int good_prop(const CUmemAllocationProp *p) {
    return p && p->type == 1 /* PINNED */ && p->requestedHandleTypes == 0 &&
           p->location.type == 1 /* DEVICE */ && p->location.id == 0 &&
           p->win32HandleMetaData == NULL && p->allocFlags.compressionType == 0;
}

/* --- capacity, shared between processes ------------------------------------------- */

#define TENANTS 256
struct tenant { int32_t pid; uint32_t tag; uint64_t bytes; };
static struct tenant *table; /* FAKE_CUDA_SHARED's, mapped; NULL: this process alone */
static int table_fd = -1;
static uint32_t my_tag; /* this copy of the fake, within its process */

static void open_table(void) { /* under mu */
    static int tried;
    if (tried) return;
    tried = 1;
    const char *path = getenv("FAKE_CUDA_SHARED");
    if (!path || !*path) return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    size_t n = TENANTS * sizeof(struct tenant);
    flock(fd, LOCK_EX);
    off_t end = lseek(fd, 0, SEEK_END);
    if (end < (off_t)n && ftruncate(fd, (off_t)n)) {
        flock(fd, LOCK_UN);
        close(fd);
        return;
    }
    flock(fd, LOCK_UN);
    void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return;
    }
    table = m, table_fd = fd;
    my_tag = (uint32_t)(uintptr_t)&my_tag ^ (uint32_t)time(NULL);
}
static int alive_pid(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

/* Bytes every tenant holds (this process's included); the table locked by the caller. */
static size_t used_locked(void) {
    if (!table) return created;
    size_t sum = 0;
    for (int i = 0; i < TENANTS; i++) {
        if (!table[i].pid) continue;
        if (!alive_pid(table[i].pid)) { /* its memory went with it */
            memset(&table[i], 0, sizeof table[i]);
            continue;
        }
        sum += table[i].bytes;
    }
    return sum;
}
static void set_mine_locked(void) {
    if (!table) return;
    int32_t me = (int32_t)getpid();
    int free_slot = -1;
    for (int i = 0; i < TENANTS; i++) {
        if (table[i].pid == me && table[i].tag == my_tag) {
            table[i].bytes = created;
            return;
        }
        if (!table[i].pid && free_slot < 0) free_slot = i;
    }
    if (free_slot >= 0) table[free_slot] = (struct tenant){me, my_tag, created};
}
/* Take (n > 0) or give back bytes of physical memory; 0 when past the capacity. */
static int account(long long n) { /* under mu */
    open_table();
    if (table) flock(table_fd, LOCK_EX);
    int ok = 1;
    if (n > 0 && used_locked() + (size_t)n > capacity()) ok = 0;
    else created += (size_t)n;
    if (ok) set_mine_locked();
    if (table) flock(table_fd, LOCK_UN);
    return ok;
}

/* --- devices and contexts ------------------------------------------------------------- */

CUresult cuInit(unsigned flags) {
    CALLED("cuInit");
    initialized = 1;
    return flags ? INVALID_VALUE : OK;
}
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    CALLED("cuDeviceGet");
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= devices()) return INVALID_VALUE;
    *d = ordinal;
    return OK;
}
CUresult cuDeviceGetCount(int *n) {
    CALLED("cuDeviceGetCount");
    if (!initialized) return NOT_INITIALIZED;
    *n = devices();
    return OK;
}
CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
    CALLED("cuDeviceCanAccessPeer");
    if (d < 0 || d >= devices() || peer < 0 || peer >= devices()) return INVALID_VALUE;
    *can = d != peer && !env_is("FAKE_CUDA_NO_PEERS", '1');
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    CALLED("cuDevicePrimaryCtxRelease_v2");
    pthread_mutex_lock(&mu);
    int ok = d == 0 && ctx_refs > 0;
    if (ok) ctx_refs--;
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    CALLED("cuDevicePrimaryCtxRetain");
    if (d != 0) return INVALID_VALUE;
    *c = &ctx_token;
    __atomic_add_fetch(&ctx_refs, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuCtxGetCurrent(CUcontext *c) {
    CALLED("cuCtxGetCurrent");
    *c = depth ? stack[depth - 1] : NULL;
    return OK;
}
CUresult cuCtxSetCurrent(CUcontext c) {
    CALLED("cuCtxSetCurrent");
    if (c != &ctx_token) return INVALID_VALUE;
    if (!depth) depth = 1;
    stack[depth - 1] = c;
    return OK;
}
CUresult cuCtxPushCurrent_v2(CUcontext c) {
    CALLED("cuCtxPushCurrent_v2");
    if (c != &ctx_token || depth == 16) return INVALID_VALUE;
    stack[depth++] = c;
    return OK;
}
CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    CALLED("cuCtxPopCurrent_v2");
    if (!depth) return INVALID_CONTEXT;
    *c = stack[--depth];
    return OK;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
    CALLED("cuMemGetAllocationGranularity");
    if (!good_prop(p) || (option != 0 /* MINIMUM */ && option != 1 /* RECOMMENDED */))
        return INVALID_VALUE;
    *g = granularity();
    return OK;
}
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
    CALLED("cuMemGetInfo_v2");
    NEEDS_CONTEXT();
    pthread_mutex_lock(&mu);
    open_table();
    if (table) flock(table_fd, LOCK_EX);
    size_t used = used_locked(), cap = capacity();
    if (table) flock(table_fd, LOCK_UN);
    pthread_mutex_unlock(&mu);
    *total = cap;
    *free_ = used < cap ? cap - used : 0;
    return OK;
}

/* --- virtual memory ------------------------------------------------------------------- */

/* Physical allocations: freed when no reference (cuMemCreate's, each
   cuMemRetainAllocationHandle's) and no mapping is left. */
struct handle { int fd; size_t size; int refs, maps; struct handle *next; };
static struct handle *handles;
static int handles_alive;
/* Reservations, and the ranges mapped now (with whether access was granted). */
struct range { CUdeviceptr p; size_t n; };
static struct range *reservations;
static size_t nres, capres;
struct span { CUdeviceptr p; size_t n; struct handle *h; int access; };
static struct span *spans;
static size_t nspans, capspans;

static int grow(void **arr, size_t *cap, size_t n, size_t elem) {
    if (n < *cap) return 1;
    size_t c = *cap ? 2 * *cap : 256;
    void *more = realloc(*arr, c * elem);
    if (!more) return 0;
    *arr = more, *cap = c;
    return 1;
}
static struct handle *find_handle(CUmemGenericAllocationHandle v) { /* under mu */
    for (struct handle *h = handles; h; h = h->next)
        if ((CUmemGenericAllocationHandle)(uintptr_t)h == v) return h;
    return NULL;
}
static void maybe_free(struct handle *h) { /* under mu: the last reference gone */
    if (h->refs || h->maps) return;
    for (struct handle **pp = &handles; *pp; pp = &(*pp)->next)
        if (*pp == h) {
            *pp = h->next;
            break;
        }
    close(h->fd);
    account(-(long long)h->size);
    handles_alive--;
    free(h);
}
static int overlaps(CUdeviceptr p, size_t n, CUdeviceptr q, size_t m) {
    return p < q + m && q < p + n;
}
static struct range *reservation_of(CUdeviceptr p, size_t n) { /* under mu */
    for (size_t i = 0; i < nres; i++)
        if (p >= reservations[i].p && p + n <= reservations[i].p + reservations[i].n)
            return &reservations[i];
    return NULL;
}
/* Whether [p, p + n) is wholly mapped (and, if `access`, accessible). Under mu. */
static int covered(CUdeviceptr p, size_t n, int access) {
    size_t got = 0;
    for (size_t i = 0; i < nspans; i++) {
        struct span *s = &spans[i];
        if (!overlaps(p, n, s->p, s->n)) continue;
        if (access && !s->access) return 0;
        CUdeviceptr lo = s->p > p ? s->p : p, hi = s->p + s->n < p + n ? s->p + s->n : p + n;
        got += hi - lo;
    }
    return got == n; /* spans never overlap */
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    CALLED("cuMemAddressReserve");
    NEEDS_CONTEXT();
    size_t page = (size_t)sysconf(_SC_PAGESIZE), g = granularity();
    /* as documented: size (and a hint) a multiple of the page size, the alignment a
       power of two or 0 (the default), flags 0; the start is at least granularity-aligned */
    if (!ptr || !size || size % page || addr % page || flags || (align & (align - 1)))
        return INVALID_VALUE;
    if (align < g) align = g;
    size_t span = size + align;
    char *m = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    uintptr_t start = ((uintptr_t)m + align - 1) / align * align;
    if (start > (uintptr_t)m) munmap(m, start - (uintptr_t)m);
    munmap((char *)start + size, (uintptr_t)m + span - start - size);
    pthread_mutex_lock(&mu);
    int ok = grow((void **)&reservations, &capres, nres, sizeof *reservations);
    if (ok) reservations[nres++] = (struct range){start, size};
    pthread_mutex_unlock(&mu);
    if (!ok) {
        munmap((void *)start, size);
        return OUT_OF_MEMORY;
    }
    *ptr = start;
    return OK;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    CALLED("cuMemAddressFree");
    pthread_mutex_lock(&mu);
    size_t i = 0;
    while (i < nres && !(reservations[i].p == ptr && reservations[i].n == size)) i++;
    int mapped = 0;
    for (size_t j = 0; j < nspans; j++) mapped |= overlaps(ptr, size, spans[j].p, spans[j].n);
    int ok = i < nres && !mapped;
    if (ok) reservations[i] = reservations[--nres];
    pthread_mutex_unlock(&mu);
    if (!ok) return INVALID_VALUE;
    return munmap((void *)ptr, size) ? INVALID_VALUE : OK;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size,
                     const CUmemAllocationProp *p, unsigned long long flags) {
    CALLED("cuMemCreate");
    NEEDS_CONTEXT();
    if (!out || !good_prop(p) || flags || !size || size % granularity()) return INVALID_VALUE;
    struct handle *h = calloc(1, sizeof *h);
    if (!h) return OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    int ok = account((long long)size);
    pthread_mutex_unlock(&mu);
    if (!ok) {
        free(h);
        return OUT_OF_MEMORY;
    }
    int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
    void *m = MAP_FAILED;
    if (fd >= 0 && !ftruncate(fd, (off_t)size))
        m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        if (fd >= 0) close(fd);
        pthread_mutex_lock(&mu);
        account(-(long long)size);
        pthread_mutex_unlock(&mu);
        free(h);
        return OUT_OF_MEMORY;
    }
    if (!env_is("FAKE_CUDA_DIRTY", '0')) { /* as a GPU's: whatever was there before */
        static unsigned char seed = 0x5A;
        unsigned char b = __atomic_add_fetch(&seed, 0x3B, __ATOMIC_RELAXED) | 1;
        memset(m, b, size);
    }
    munmap(m, size);
    h->fd = fd, h->size = size, h->refs = 1;
    pthread_mutex_lock(&mu);
    h->next = handles, handles = h;
    handles_alive++;
    pthread_mutex_unlock(&mu);
    *out = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return OK;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle v) {
    CALLED("cuMemRelease");
    pthread_mutex_lock(&mu);
    struct handle *h = find_handle(v);
    int ok = h && h->refs > 0;
    if (ok) {
        h->refs--;
        maybe_free(h); /* mapped: freed at its last unmap */
    }
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle v,
                  unsigned long long flags) {
    CALLED("cuMemMap");
    size_t g = granularity();
    if (flags || !size || ptr % g || size % g || offset % g) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct handle *h = find_handle(v);
    CUresult rc = OK;
    if (!h || !h->refs || offset + size > h->size || !reservation_of(ptr, size))
        rc = INVALID_VALUE;
    for (size_t i = 0; !rc && i < nspans; i++)
        if (overlaps(ptr, size, spans[i].p, spans[i].n)) rc = INVALID_VALUE;
    if (!rc && !grow((void **)&spans, &capspans, nspans, sizeof *spans)) rc = OUT_OF_MEMORY;
    if (!rc) {
        void *p = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd,
                       (off_t)offset);
        if (p == MAP_FAILED) rc = INVALID_VALUE;
        else {
            spans[nspans++] = (struct span){ptr, size, h, 0};
            h->maps++;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}
/* The handle mapped at addr (anywhere in its mapping), one more reference to it; fails
   where nothing is mapped. */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *out, void *addr) {
    CALLED("cuMemRetainAllocationHandle");
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)addr;
    pthread_mutex_lock(&mu);
    struct handle *h = NULL;
    for (size_t i = 0; i < nspans && !h; i++)
        if (p >= spans[i].p && p < spans[i].p + spans[i].n) h = spans[i].h;
    if (h) h->refs++;
    pthread_mutex_unlock(&mu);
    if (!h || !out) return INVALID_VALUE;
    *out = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return OK;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CALLED("cuMemUnmap");
    pthread_mutex_lock(&mu);
    /* whole mappings, and nothing unmapped within the range */
    int whole = size && covered(ptr, size, 0);
    for (size_t i = 0; whole && i < nspans; i++)
        if (overlaps(ptr, size, spans[i].p, spans[i].n) &&
            (spans[i].p < ptr || spans[i].p + spans[i].n > ptr + size))
            whole = 0;
    if (!whole) {
        pthread_mutex_unlock(&mu);
        return INVALID_VALUE;
    }
    /* Back to a reservation first: the range stays ours and faults again. */
    void *p = mmap((void *)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    size_t j = 0;
    for (size_t i = 0; i < nspans; i++) {
        if (!overlaps(ptr, size, spans[i].p, spans[i].n)) {
            spans[j++] = spans[i];
            continue;
        }
        spans[i].h->maps--;
        maybe_free(spans[i].h);
    }
    nspans = j;
    pthread_mutex_unlock(&mu);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *d, size_t count) {
    CALLED("cuMemSetAccess");
    /* The owning device among them, each device once, every one read-write. */
    int own = 0;
    if (count < 1 || count > 16 || !d) return INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (d[i].location.type != 1 || d[i].flags != 3) return INVALID_VALUE;
        if (d[i].location.id < 0 || d[i].location.id >= devices()) return INVALID_VALUE;
        for (size_t j = 0; j < i; j++)
            if (d[j].location.id == d[i].location.id) return INVALID_VALUE;
        own |= d[i].location.id == 0;
    }
    if (!own) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    /* as documented: a range wholly mapped */
    if (!size || !covered(ptr, size, 0) ||
        mprotect((void *)ptr, size, PROT_READ | PROT_WRITE)) {
        pthread_mutex_unlock(&mu);
        return INVALID_VALUE;
    }
    for (size_t i = 0; i < nspans; i++)
        if (overlaps(ptr, size, spans[i].p, spans[i].n)) spans[i].access = 1;
    access_n = (int)count;
    for (size_t i = 0; i < count; i++) access_ids[i] = d[i].location.id;
    pthread_mutex_unlock(&mu);
    return OK;
}

/* --- pinned host memory ----------------------------------------------------------------- */

CUresult cuMemHostAlloc(void **pp, size_t size, unsigned flags) {
    CALLED("cuMemHostAlloc");
    NEEDS_CONTEXT();
    if (flags) return INVALID_VALUE;
    *pp = malloc(size + sizeof(size_t));
    if (!*pp) return OUT_OF_MEMORY;
    *(size_t *)*pp = size;
    *pp = (char *)*pp + sizeof(size_t);
    pthread_mutex_lock(&mu);
    pinned += size;
    host_allocs++;
    pthread_mutex_unlock(&mu);
    return OK;
}
CUresult cuMemFreeHost(void *p) {
    CALLED("cuMemFreeHost");
    NEEDS_CONTEXT();
    char *base = (char *)p - sizeof(size_t);
    pthread_mutex_lock(&mu);
    pinned -= *(size_t *)base;
    host_allocs--;
    pthread_mutex_unlock(&mu);
    free(base);
    return OK;
}

/* --- streams and events: a worker thread per stream ------------------------------------ */

enum { OP_DTOH, OP_HTOD, OP_SET };
struct op {
    int kind;
    char *dst;
    const char *src;
    size_t n;
    unsigned char v;
    struct timespec due;
    struct op *next;
};
struct stream {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct op *head, *tail;
    uint64_t queued, done; /* ops queued and done, in order */
    int stop;
    pthread_t thread;
    struct stream *next;
};
struct event { struct stream *s; uint64_t seq; struct event *next; };
static struct stream *streams, *null_stream;
static struct event *events;
static int streams_alive, events_alive;

static long latency_ns(void) {
    const char *s = getenv("FAKE_CUDA_LATENCY_US");
    return (s ? atol(s) : 1000) * 1000L;
}
/* One queued op, its device side checked mapped and accessible as it runs (under mu, so
   that nothing is unmapped under the copy): else an illegal address, for good. */
static void run_op(struct op *o) {
    CUdeviceptr dev = (CUdeviceptr)(uintptr_t)(o->kind == OP_DTOH ? o->src : o->dst);
    pthread_mutex_lock(&mu);
    if (!sticky && o->n && !covered(dev, o->n, 1)) {
        sticky = ILLEGAL_ADDRESS;
        faults++;
        fprintf(stderr, "fake libcuda: illegal address: a queued %s %#llx (%zu bytes)\n",
                o->kind == OP_DTOH ? "copy from" : "write to", dev, o->n);
    }
    if (!sticky) {
        if (o->kind == OP_SET) memset(o->dst, o->v, o->n);
        else memcpy(o->dst, o->src, o->n);
        if (o->kind == OP_DTOH && o->n && env_is("FAKE_CUDA_CORRUPT", '1'))
            ((unsigned char *)o->dst)[0] ^= 0xFF;
    }
    pthread_mutex_unlock(&mu);
}
static void *worker(void *arg) {
    struct stream *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cond, &s->lock);
        if (!s->head) break;
        struct op *o = s->head;
        pthread_mutex_unlock(&s->lock);
        while (held) usleep(200);
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &o->due, NULL);
        run_op(o);
        pthread_mutex_lock(&s->lock);
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->done++;
        free(o);
        pthread_cond_broadcast(&s->cond);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}
static struct stream *new_stream(void) {
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    if (pthread_create(&s->thread, NULL, worker, s)) {
        free(s);
        return NULL;
    }
    return s;
}
/* The stream behind a handle (NULL: the NULL stream, made at its first use); 0 if none. */
static struct stream *find_stream(CUstream v) {
    pthread_mutex_lock(&mu);
    struct stream *s = NULL;
    if (!v) {
        if (!null_stream) null_stream = new_stream();
        s = null_stream;
    } else
        for (struct stream *t = streams; t; t = t->next)
            if (t == (struct stream *)v) s = t;
    pthread_mutex_unlock(&mu);
    return s;
}
static void drain(struct stream *s, uint64_t upto) {
    pthread_mutex_lock(&s->lock);
    while (s->done < upto) pthread_cond_wait(&s->cond, &s->lock);
    pthread_mutex_unlock(&s->lock);
}
static uint64_t queued(struct stream *s) {
    pthread_mutex_lock(&s->lock);
    uint64_t q = s->queued;
    pthread_mutex_unlock(&s->lock);
    return q;
}
static CUresult enqueue(CUstream v, int kind, void *dst, const void *src, size_t n,
                        unsigned char val) {
    struct stream *s = find_stream(v);
    if (!s) return INVALID_HANDLE;
    if (sticky) return sticky;
    struct op *o = calloc(1, sizeof *o);
    if (!o) return OUT_OF_MEMORY;
    *o = (struct op){kind, dst, src, n, val, {0, 0}, NULL};
    clock_gettime(CLOCK_MONOTONIC, &o->due);
    long ns = o->due.tv_nsec + latency_ns();
    o->due.tv_sec += ns / 1000000000L;
    o->due.tv_nsec = ns % 1000000000L;
    pthread_mutex_lock(&s->lock);
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    s->queued++;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    return OK;
}

CUresult cuStreamCreate(CUstream *out, unsigned flags) {
    CALLED("cuStreamCreate");
    NEEDS_CONTEXT();
    if (!out || (flags != 0 && flags != 1 /* NON_BLOCKING */)) return INVALID_VALUE;
    struct stream *s = new_stream();
    if (!s) return OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    s->next = streams, streams = s;
    streams_alive++;
    pthread_mutex_unlock(&mu);
    *out = s;
    return OK;
}
CUresult cuStreamDestroy_v2(CUstream v) {
    CALLED("cuStreamDestroy_v2");
    pthread_mutex_lock(&mu);
    struct stream *s = NULL;
    for (struct stream **pp = &streams; *pp; pp = &(*pp)->next)
        if (*pp == (struct stream *)v) {
            s = *pp;
            *pp = s->next;
            streams_alive--;
            break;
        }
    for (struct event *e = events; s && e; e = e->next)
        if (e->s == s) e->s = NULL; /* its work is done below: complete */
    pthread_mutex_unlock(&mu);
    if (!s) return INVALID_HANDLE;
    /* CUDA returns at once and finishes the work queued; the same, seen from outside */
    pthread_mutex_lock(&s->lock);
    s->stop = 1;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    /* not freed: an event or a synchronize may still hold it (done == queued now) */
    return OK;
}
CUresult cuStreamSynchronize(CUstream v) {
    CALLED("cuStreamSynchronize");
    struct stream *s = find_stream(v);
    if (!s) return INVALID_HANDLE;
    drain(s, queued(s));
    return sticky;
}
CUresult cuCtxSynchronize(void) {
    CALLED("cuCtxSynchronize");
    NEEDS_CONTEXT();
    pthread_mutex_lock(&mu); /* every stream, to what it had queued now */
    int n = 0;
    for (struct stream *t = streams; t; t = t->next) n++;
    struct stream **all = calloc((size_t)n + 1, sizeof *all);
    uint64_t *upto = calloc((size_t)n + 1, sizeof *upto);
    int k = 0;
    if (all && upto) {
        for (struct stream *t = streams; t; t = t->next) all[k++] = t;
        if (null_stream) all[k++] = null_stream;
        for (int i = 0; i < k; i++) upto[i] = queued(all[i]);
    }
    pthread_mutex_unlock(&mu); /* waited for outside it (streams are never freed) */
    CUresult rc = all && upto ? OK : OUT_OF_MEMORY;
    for (int i = 0; i < k; i++) drain(all[i], upto[i]);
    free(all);
    free(upto);
    return rc ? rc : sticky;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    CALLED("cuMemcpyDtoHAsync_v2");
    NEEDS_CONTEXT();
    return enqueue(s, OP_DTOH, dst, (const void *)(uintptr_t)src, n, 0);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    CALLED("cuMemcpyHtoDAsync_v2");
    NEEDS_CONTEXT();
    return enqueue(s, OP_HTOD, (void *)(uintptr_t)dst, src, n, 0);
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    CALLED("cuMemsetD8Async");
    NEEDS_CONTEXT();
    return enqueue(s, OP_SET, (void *)(uintptr_t)dst, NULL, n, v);
}
/* Synchronous copies (the NULL stream's work before them done first; vLLM's sleep copies
   with cudaMemcpy). */
static CUresult copy_now(int kind, void *dst, const void *src, size_t n) {
    CUresult rc = enqueue(NULL, kind, dst, src, n, 0);
    if (rc) return rc;
    struct stream *s = find_stream(NULL);
    drain(s, queued(s));
    return sticky;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    CALLED("cuMemcpyDtoH_v2");
    NEEDS_CONTEXT();
    return copy_now(OP_DTOH, dst, (const void *)(uintptr_t)src, n);
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    CALLED("cuMemcpyHtoD_v2");
    NEEDS_CONTEXT();
    return copy_now(OP_HTOD, (void *)(uintptr_t)dst, src, n);
}
static struct event *find_event(CUevent v) { /* under mu */
    for (struct event *e = events; e; e = e->next)
        if (e == (struct event *)v) return e;
    return NULL;
}
CUresult cuEventCreate(CUevent *out, unsigned flags) {
    CALLED("cuEventCreate");
    NEEDS_CONTEXT();
    if (!out || flags != 2 /* DISABLE_TIMING */) return INVALID_VALUE;
    struct event *e = calloc(1, sizeof *e);
    if (!e) return OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    e->next = events, events = e;
    events_alive++;
    pthread_mutex_unlock(&mu);
    *out = e;
    return OK;
}
CUresult cuEventRecord(CUevent v, CUstream sv) {
    CALLED("cuEventRecord");
    struct stream *s = find_stream(sv);
    pthread_mutex_lock(&mu);
    struct event *e = find_event(v);
    if (e && s) {
        e->s = s; /* complete once the work queued on s before now is done */
        e->seq = queued(s);
    }
    pthread_mutex_unlock(&mu);
    if (!e || !s) return INVALID_HANDLE;
    return sticky;
}
/* The stream and mark an event waits for (none: complete), or INVALID_HANDLE. */
static CUresult event_mark(CUevent v, struct stream **s, uint64_t *seq) {
    pthread_mutex_lock(&mu);
    struct event *e = find_event(v);
    if (e) *s = e->s, *seq = e->seq;
    pthread_mutex_unlock(&mu);
    return e ? OK : INVALID_HANDLE;
}
CUresult cuEventSynchronize(CUevent v) {
    CALLED("cuEventSynchronize");
    struct stream *s = NULL;
    uint64_t seq = 0;
    CUresult rc = event_mark(v, &s, &seq);
    if (rc) return rc;
    if (s) drain(s, seq); /* a stream is freed only after its destroyer cleared e->s */
    return sticky;
}
CUresult cuEventQuery(CUevent v) {
    CALLED("cuEventQuery");
    struct stream *s = NULL;
    uint64_t seq = 0;
    CUresult rc = event_mark(v, &s, &seq);
    if (rc) return rc;
    if (!s) return sticky;
    pthread_mutex_lock(&s->lock);
    int done = s->done >= seq;
    pthread_mutex_unlock(&s->lock);
    return sticky ? sticky : done ? OK : NOT_READY;
}
CUresult cuEventDestroy_v2(CUevent v) {
    CALLED("cuEventDestroy_v2");
    pthread_mutex_lock(&mu);
    struct event *e = NULL;
    for (struct event **pp = &events; *pp; pp = &(*pp)->next)
        if (*pp == (struct event *)v) {
            e = *pp;
            *pp = e->next;
            events_alive--;
            break;
        }
    pthread_mutex_unlock(&mu);
    free(e);
    return e ? OK : INVALID_HANDLE;
}

/* Bytes mapped now. */
size_t fake_cuda_mapped(void) {
    size_t n = 0;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < nspans; i++) n += spans[i].n;
    pthread_mutex_unlock(&mu);
    return n;
}
/* What was made and not given back. */
int fake_cuda_alive(const char *what) {
    int n = -1;
    pthread_mutex_lock(&mu);
    if (!strcmp(what, "streams")) n = streams_alive;
    else if (!strcmp(what, "events")) n = events_alive;
    else if (!strcmp(what, "contexts")) n = ctx_refs;
    else if (!strcmp(what, "handles")) n = handles_alive;
    else if (!strcmp(what, "mappings")) n = (int)nspans;
    else if (!strcmp(what, "reservations")) n = (int)nres;
    else if (!strcmp(what, "host")) n = host_allocs;
    else if (!strcmp(what, "faults")) n = faults;
    pthread_mutex_unlock(&mu);
    return n;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
    static const char *names[] = {"no error", "invalid argument", "out of memory",
                                  "initialization error"};
    *s = r >= 0 && r < 4              ? names[r]
         : r == INVALID_CONTEXT       ? "invalid device context"
         : r == INVALID_HANDLE        ? "invalid resource handle"
         : r == NOT_READY             ? "device not ready"
         : r == ILLEGAL_ADDRESS       ? "an illegal memory access was encountered"
                                      : "unknown error";
    return OK;
}
