/* libgpushare_alloc: a session's swappable GPU memory, kept in C so that PyTorch's
 * allocator never waits for Python (no GIL taken under PyTorch's allocator lock).
 *
 * Memory comes in through gs_alloc: a reserved virtual range (cuMemAddressReserve)
 * backed by pieces of physical memory (cuMemCreate, cuMemMap). Two ways lead there:
 *
 *  - preload (gpushare run): this library is in LD_PRELOAD, so its cudaMalloc and
 *    cudaFree come before the CUDA runtime's for every library that calls them,
 *    PyTorch's caching allocator included. That allocator keeps working as it does
 *    without gpushare: torch.cuda.empty_cache() frees (cudaFree), an out-of-memory
 *    answer makes it free its cache and retry, record_stream blocks are reclaimed.
 *  - pool (gpushare.attach in a program started without it): gs_pool_alloc and
 *    gs_pool_free are given to a torch.cuda.MemPool.
 *
 * Swapping is driven from Python (vmm.py) piece by piece: gs_claim_out / gs_claim_in
 * hand it pieces marked busy, gs_settle says where each ended up. A piece marked
 * discardable (gs_mark: it lies wholly in a cache the workload can rebuild) is claimed
 * out first and dropped, not copied: settled with neither memory nor host copy, it is
 * counted apart (gs_discarded) and comes back empty at the next swap-in. The table's lock is
 * held only inside these functions, never while Python runs, and a cudaFree of a
 * segment with busy pieces is finished by the gs_settle of its last one.
 *
 * Built by gpushare with the system C compiler (cc -O2 -shared -fPIC ... -ldl
 * -lpthread); a plain shared library, independent of the Python version. The CUDA
 * types are declared here with cuda.h's layouts, so no CUDA headers are needed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUcontext;
typedef int cudaError_t;

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
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
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_RECOMMENDED 1
#define cudaErrorMemoryAllocation 2
#define cudaErrorInitializationError 3

enum { GS_OK = 0, GS_LIMIT = 1, GS_DRIVER = 2, GS_UNCONFIGURED = 3 };

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                          unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*GetErrorString)(CUresult, const char **);
} cu;

struct seg;
struct piece {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle handle; /* physical memory; 0 while swapped out */
    uint64_t host;                       /* the host copy while swapped out */
    int busy;                            /* claimed by a swap in progress */
    int discard;                         /* discardable: dropped at a swap-out, not copied */
    int dropped;                         /* out, and dropped: nothing of it to copy back */
    struct seg *seg;
};
struct seg {
    CUdeviceptr va;
    size_t size;
    int n, busy, freed;
    struct seg *prev, *next;
    struct piece p[];
};
/* What a claim hands Python: the piece (its id), where it is, and GS_DISCARD /
 * GS_DROPPED. */
typedef struct { uint64_t id, va, size, handle, host, flags; } gs_piece;
#define GS_DISCARD 1
#define GS_DROPPED 2

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int configured, device_index;
static CUcontext ctx;
static CUmemAllocationProp prop;
/* Read-write for this device and every device that can reach it as a peer (as PyTorch's
 * expandable segments grant): a kernel of another GPU of the process may touch it. */
#define MAX_ACCESS 64
static CUmemAccessDesc access_desc[MAX_ACCESS];
static int naccess;
static CUdevice ctx_dev;
static size_t gran, piece_bytes, limit, resident, swapped, discarded;
static struct seg *head, *tail;
static uint64_t *returned;
static int nreturned, capreturned, npieces;
static volatile int routing, paused, notify_fd = -1;
/* Called before an allocation with its bytes (outside every lock of this library):
 * blocks while the session, past its grant's bound, yields and asks the node again for
 * room (a safe point: the session's GPU work is waited for before the lease goes). */
typedef void (*grow_fn)(unsigned long long);
static grow_fn volatile grow_cb;
static unsigned long long mallocs_seen, frees_seen;
static __thread char err[512];
static time_t last_limit_note;

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* Driver calls that give memory back and failed: kept and tried again (at each
 * allocation, free and swap: gs_retry), so that a failed unmap, release or address free
 * leaks nothing for good. An unmap done is followed by its release. Under `dmu`. */
enum { D_UNMAP, D_RELEASE, D_ADDRESS };
struct deferred { int kind; CUdeviceptr va; size_t size; CUmemGenericAllocationHandle h; };
static struct deferred *deferred;
static int ndeferred, capdeferred;
static size_t deferred_bytes; /* physical memory still held by them */
static pthread_mutex_t dmu = PTHREAD_MUTEX_INITIALIZER;

static void defer(int kind, CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&dmu);
    if (ndeferred == capdeferred) {
        int cap = capdeferred ? 2 * capdeferred : 16;
        struct deferred *d = realloc(deferred, (size_t)cap * sizeof *d);
        if (!d) { /* lost, and said */
            pthread_mutex_unlock(&dmu);
            fprintf(stderr, "gpushare: out of host memory: %zu bytes of GPU memory leak\n", size);
            return;
        }
        deferred = d, capdeferred = cap;
    }
    deferred[ndeferred++] = (struct deferred){kind, va, size, h};
    if (kind != D_ADDRESS) deferred_bytes += size;
    pthread_mutex_unlock(&dmu);
}

static void fail(const char *call, CUresult rc) {
    const char *s = NULL;
    if (cu.GetErrorString) cu.GetErrorString(rc, &s);
    snprintf(err, sizeof err, "%s failed: %s (CUDA error %d)", call, s ? s : "unknown error", rc);
}

const char *gs_error(void) { return err; }

int gs_abi(void) { return 2; }

/* The session's context current on this thread, pushed if another was (and popped
 * after), so a workload's own current context is never switched under it. */
static int enter(void) {
    CUcontext cur = NULL;
    cu.CtxGetCurrent(&cur);
    if (cur == ctx) return 0;
    return cu.CtxPushCurrent(ctx) == 0;
}
static void leave(int pushed) {
    CUcontext c;
    if (pushed) cu.CtxPopCurrent(&c);
}

/* A piece's physical memory given back (unmapped first if `mapped`), the context
 * current; a call that fails is deferred (gs_retry), so nothing leaks for good. */
static void give_back(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h, int mapped) {
    if (mapped && cu.MemUnmap(va, size)) {
        defer(D_UNMAP, va, size, h);
        return;
    }
    if (cu.MemRelease(h)) defer(D_RELEASE, va, size, h);
}
static void free_address(CUdeviceptr va, size_t size) {
    if (cu.MemAddressFree(va, size)) defer(D_ADDRESS, va, size, 0);
}
/* A handle whose release failed in Python's swap-out (unmapped already): kept here. */
void gs_defer_release(unsigned long long h, unsigned long long size) {
    defer(D_RELEASE, 0, size, h);
}
/* Try the deferred calls again, in order (a range's unmaps before its address free);
 * how many are still pending. */
int gs_retry(void) {
    pthread_mutex_lock(&dmu);
    if (!ndeferred) {
        pthread_mutex_unlock(&dmu);
        return 0;
    }
    int pushed = enter(), j = 0;
    for (int i = 0; i < ndeferred; i++) {
        struct deferred d = deferred[i];
        if (d.kind == D_UNMAP) {
            if (cu.MemUnmap(d.va, d.size)) {
                deferred[j++] = d;
                continue;
            }
            d.kind = D_RELEASE;
        }
        if (d.kind == D_RELEASE) {
            if (cu.MemRelease(d.h)) deferred[j++] = d;
            else deferred_bytes -= d.size;
        } else if (cu.MemAddressFree(d.va, d.size)) {
            deferred[j++] = d;
        }
    }
    ndeferred = j;
    leave(pushed);
    pthread_mutex_unlock(&dmu);
    return j;
}
/* Physical memory held by deferred calls: still the GPU's, so counted resident. */
static size_t pending(void) {
    pthread_mutex_lock(&dmu);
    size_t n = deferred_bytes;
    pthread_mutex_unlock(&dmu);
    return n;
}

static void notify(void) {
    int fd = notify_fd;
    if (fd >= 0) {
        ssize_t r = write(fd, "m", 1); /* non-blocking: a full pipe already says it */
        (void)r;
    }
}

#define SYM(field, name)                                                                \
    do {                                                                                \
        *(void **)&cu.field = dlsym(h, name);                                           \
        if (!cu.field) {                                                                \
            snprintf(err, sizeof err, "%s has no %s: the NVIDIA driver is too old", lib, \
                     name);                                                             \
            return -1;                                                                  \
        }                                                                               \
    } while (0)

static int load(const char *lib) {
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, sizeof err, "cannot load the CUDA driver (%s)", dlerror());
        return -1;
    }
    SYM(Init, "cuInit");
    SYM(DeviceGet, "cuDeviceGet");
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    SYM(DeviceGetCount, "cuDeviceGetCount");
    SYM(DeviceCanAccessPeer, "cuDeviceCanAccessPeer");
    SYM(CtxGetCurrent, "cuCtxGetCurrent");
    SYM(CtxPushCurrent, "cuCtxPushCurrent_v2");
    SYM(CtxPopCurrent, "cuCtxPopCurrent_v2");
    SYM(CtxSynchronize, "cuCtxSynchronize");
    SYM(MemGetAllocationGranularity, "cuMemGetAllocationGranularity");
    SYM(MemAddressReserve, "cuMemAddressReserve");
    SYM(MemAddressFree, "cuMemAddressFree");
    SYM(MemCreate, "cuMemCreate");
    SYM(MemRelease, "cuMemRelease");
    SYM(MemMap, "cuMemMap");
    SYM(MemUnmap, "cuMemUnmap");
    SYM(MemSetAccess, "cuMemSetAccess");
    SYM(GetErrorString, "cuGetErrorString");
    return 0;
}

#define CHECK(call, expr)         \
    do {                          \
        CUresult rc_ = (expr);    \
        if (rc_) {                \
            fail(call, rc_);      \
            return rc_;           \
        }                         \
    } while (0)

/* The device's properties, the devices granted access (it and its peers), the
 * granularity; 0 or the CUDA error (gs_error says which). */
static CUresult set_up(int device, CUdevice dev) {
    int count = 0;
    CHECK("cuDeviceGetCount", cu.DeviceGetCount(&count));
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    naccess = 0;
    access_desc[naccess].location = prop.location;
    access_desc[naccess++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int i = 0; i < count && naccess < MAX_ACCESS; i++) {
        CUdevice other;
        int can = 0;
        if (i == device) continue;
        CHECK("cuDeviceGet", cu.DeviceGet(&other, i));
        CHECK("cuDeviceCanAccessPeer", cu.DeviceCanAccessPeer(&can, other, dev));
        if (!can) continue;
        access_desc[naccess].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access_desc[naccess].location.id = i;
        access_desc[naccess++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    int pushed = enter();
    CUresult rc = cu.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    leave(pushed);
    if (rc) fail("cuMemGetAllocationGranularity", rc);
    return rc;
}

/* Set up for one device; the limit and piece size in bytes. 0, or -1 / a CUDA error
 * (gs_error says which), holding no context then. Again only while no memory is held. */
int gs_configure(const char *lib, int device, unsigned long long lim, unsigned long long piece) {
    pthread_mutex_lock(&mu);
    int busy = head != NULL;
    pthread_mutex_unlock(&mu);
    if (busy) {
        snprintf(err, sizeof err, "gpushare's allocator already holds memory in this process");
        return -1;
    }
    if (load(lib)) return -1;
    CUdevice dev;
    CHECK("cuInit", cu.Init(0));
    CHECK("cuDeviceGet", cu.DeviceGet(&dev, device));
    pthread_mutex_lock(&mu);
    configured = 0; /* until it is again: no context held meanwhile */
    pthread_mutex_unlock(&mu);
    if (ctx) { /* configured before: one hold on the primary context, not one a call */
        cu.DevicePrimaryCtxRelease(ctx_dev);
        ctx = NULL;
    }
    CHECK("cuDevicePrimaryCtxRetain", cu.DevicePrimaryCtxRetain(&ctx, dev));
    ctx_dev = dev;
    CUresult rc = set_up(device, dev);
    if (rc) { /* the hold just taken given back */
        cu.DevicePrimaryCtxRelease(dev);
        ctx = NULL;
        return rc;
    }
    pthread_mutex_lock(&mu);
    device_index = device;
    limit = lim;
    piece_bytes = round_up(piece ? piece : gran, gran);
    configured = 1;
    pthread_mutex_unlock(&mu);
    return 0;
}

unsigned long long gs_granularity(void) { return gran; }
int gs_access_devices(void) { return naccess; }
unsigned long long gs_piece_bytes(void) { return piece_bytes; }
void gs_set_limit(unsigned long long lim) { limit = lim; }
void gs_route(int on) { routing = on; }
void gs_pause(int on) { __atomic_add_fetch(&paused, on ? 1 : -1, __ATOMIC_SEQ_CST); }
void gs_notify(int fd) { notify_fd = fd; }
void gs_on_grow(grow_fn f) { grow_cb = f; }
unsigned long long gs_resident(void) { return resident + pending(); }
unsigned long long gs_pending(void) { return pending(); }
unsigned long long gs_swapped(void) { return swapped; }
unsigned long long gs_discarded(void) { return discarded; }
int gs_npieces(void) { return npieces; }
unsigned long long gs_mallocs_seen(void) { return mallocs_seen; }
unsigned long long gs_frees_seen(void) { return frees_seen; }

/* Whether the cudaMalloc every library finds is this one (LD_PRELOAD worked): looked up
 * in the global scope (RTLD_DEFAULT from here would search this library's own too). */
int gs_interposing(void) {
    Dl_info mine, found;
    void *global = dlopen(NULL, RTLD_LAZY);
    void *f = global ? dlsym(global, "cudaMalloc") : NULL;
    if (!f || !dladdr((void *)gs_interposing, &mine) || !dladdr(f, &found)) return 0;
    return mine.dli_fbase == found.dli_fbase;
}

static void release_pieces(struct piece *p, int n) {
    for (int i = 0; i < n; i++) give_back(p[i].va, p[i].size, p[i].handle, 1);
}

/* A new range of at least size bytes at *out; GS_LIMIT past the session's limit,
 * GS_DRIVER when the driver refused (the GPU full, say). */
int gs_alloc(unsigned long long size, unsigned long long *out) {
    if (!configured) {
        snprintf(err, sizeof err, "gpushare's allocator is not configured");
        return GS_UNCONFIGURED;
    }
    size_t rounded = round_up(size ? size : 1, gran);
    gs_retry();
    grow_fn grow = grow_cb;
    if (grow) {
        pthread_mutex_lock(&mu);
        int within = resident + pending() + swapped + discarded + rounded <= limit;
        pthread_mutex_unlock(&mu);
        if (within) grow(rounded); /* past the limit: refused below, without a wait */
    }
    pthread_mutex_lock(&mu);
    /* dropped pieces count: they come back (empty) at the next swap-in */
    size_t held = resident + pending() + swapped + discarded;
    if (held + rounded > limit) {
        snprintf(err, sizeof err,
                 "allocating %zu bytes would take this session past its memory limit of %zu"
                 " bytes (%zu in use): free memory or ask for a larger limit (--memory,"
                 " GPUSHARE_MEMORY)",
                 rounded, limit, held);
        pthread_mutex_unlock(&mu);
        return GS_LIMIT;
    }
    resident += rounded; /* counted now, so that two threads cannot both pass the limit */
    pthread_mutex_unlock(&mu);
    int n = (int)((rounded + piece_bytes - 1) / piece_bytes), made = 0;
    struct seg *s = calloc(1, sizeof *s + (size_t)n * sizeof(struct piece));
    if (!s) {
        snprintf(err, sizeof err, "out of host memory for gpushare's table");
        goto undo;
    }
    int pushed = enter();
    CUresult rc = cu.MemAddressReserve(&s->va, rounded, gran, 0, 0);
    if (rc) {
        fail("cuMemAddressReserve", rc);
        leave(pushed);
        goto undo;
    }
    for (; made < n; made++) {
        struct piece *p = &s->p[made];
        p->va = s->va + (size_t)made * piece_bytes;
        p->size = rounded - (size_t)made * piece_bytes;
        if (p->size > piece_bytes) p->size = piece_bytes;
        p->seg = s;
        if ((rc = cu.MemCreate(&p->handle, p->size, &prop, 0))) {
            fail("cuMemCreate", rc);
            break;
        }
        if ((rc = cu.MemMap(p->va, p->size, 0, p->handle, 0))) {
            fail("cuMemMap", rc);
            give_back(p->va, p->size, p->handle, 0);
            break;
        }
        if ((rc = cu.MemSetAccess(p->va, p->size, access_desc, (size_t)naccess))) {
            fail("cuMemSetAccess", rc);
            made++; /* mapped: undone below with the others */
            break;
        }
    }
    if (rc) {
        release_pieces(s->p, made);
        free_address(s->va, rounded);
        leave(pushed);
        goto undo;
    }
    leave(pushed);
    s->size = rounded;
    s->n = n;
    pthread_mutex_lock(&mu);
    s->prev = tail;
    if (tail) tail->next = s; else head = s;
    tail = s;
    npieces += n;
    pthread_mutex_unlock(&mu);
    *out = s->va;
    notify();
    return GS_OK;
undo:
    free(s);
    pthread_mutex_lock(&mu);
    resident -= rounded;
    pthread_mutex_unlock(&mu);
    return GS_DRIVER;
}

static struct seg *find(CUdeviceptr va) { /* under mu; the newest are freed most */
    for (struct seg *s = tail; s; s = s->prev)
        if (s->va == va) return s;
    return NULL;
}

int gs_owns(unsigned long long va) {
    pthread_mutex_lock(&mu);
    int yes = find(va) != NULL;
    pthread_mutex_unlock(&mu);
    return yes;
}

static void give_back_host(uint64_t host) { /* under mu */
    if (nreturned == capreturned) {
        int cap = capreturned ? 2 * capreturned : 64;
        uint64_t *r = realloc(returned, (size_t)cap * sizeof *r);
        if (!r) return; /* lost to Python's pool, not to correctness */
        returned = r;
        capreturned = cap;
    }
    returned[nreturned++] = host;
}

static void drop_segment(struct seg *s) { /* under mu, no piece busy */
    free_address(s->va, s->size);
    free(s);
}

/* Free a range from gs_alloc: waits for the device's queued work first, as cudaFree
 * does (unmapping does not wait). 0, or 1 when the range is not ours. */
int gs_free(unsigned long long va) {
    if (!configured || !gs_owns(va)) return 1;
    gs_retry();
    int pushed = enter();
    cu.CtxSynchronize();
    pthread_mutex_lock(&mu);
    struct seg *s = find(va);
    if (!s) {
        pthread_mutex_unlock(&mu);
        leave(pushed);
        return 1;
    }
    if (s->prev) s->prev->next = s->next; else head = s->next;
    if (s->next) s->next->prev = s->prev; else tail = s->prev;
    s->freed = 1;
    npieces -= s->n;
    for (int i = 0; i < s->n; i++) {
        struct piece *p = &s->p[i];
        if (p->busy) continue; /* its swap's gs_settle finishes it */
        if (p->handle) {
            give_back(p->va, p->size, p->handle, 1);
            resident -= p->size;
        } else if (p->dropped) {
            discarded -= p->size;
        } else {
            swapped -= p->size;
            if (p->host) give_back_host(p->host);
        }
    }
    if (!s->busy) drop_segment(s);
    pthread_mutex_unlock(&mu);
    leave(pushed);
    notify();
    return 0;
}

static void claim(struct piece *p, gs_piece *out) {
    p->busy = 1;
    p->seg->busy++;
    out->id = (uint64_t)(uintptr_t)p;
    out->va = p->va;
    out->size = p->size;
    out->handle = p->handle;
    out->host = p->host;
    out->flags = (p->discard ? GS_DISCARD : 0) | (p->dropped ? GS_DROPPED : 0);
}

/* Resident pieces until nbytes (at most max): the discardable first (dropping them
 * costs no copy), then the others; the most recently allocated first within each. */
int gs_claim_out(unsigned long long nbytes, gs_piece *out, int max) {
    int n = 0;
    size_t want = 0;
    pthread_mutex_lock(&mu);
    for (int pass = 1; pass >= 0; pass--)
        for (struct seg *s = tail; s && want < nbytes && n < max; s = s->prev)
            for (int i = s->n - 1; i >= 0 && want < nbytes && n < max; i--) {
                struct piece *p = &s->p[i];
                if (!p->busy && p->handle && (p->discard != 0) == pass) {
                    claim(p, &out[n++]);
                    want += p->size;
                }
            }
    pthread_mutex_unlock(&mu);
    return n;
}

/* Mark (on) or unmark the pieces lying wholly within [va, va + size) discardable: the
 * bytes marked. A piece the range only touches is not: other memory shares it. */
unsigned long long gs_mark(unsigned long long va, unsigned long long size, int on) {
    size_t n = 0;
    pthread_mutex_lock(&mu);
    for (struct seg *s = head; s; s = s->next) {
        if (s->va + s->size <= va || s->va >= va + size) continue;
        for (int i = 0; i < s->n; i++) {
            struct piece *p = &s->p[i];
            if (p->va >= va && p->va + p->size <= va + size) {
                p->discard = on;
                n += p->size;
            }
        }
    }
    pthread_mutex_unlock(&mu);
    return n;
}

/* Swapped-out pieces in allocation order (at most max). */
int gs_claim_in(gs_piece *out, int max) {
    int n = 0;
    pthread_mutex_lock(&mu);
    for (struct seg *s = head; s && n < max; s = s->next)
        for (int i = 0; i < s->n && n < max; i++)
            if (!s->p[i].busy && !s->p[i].handle) claim(&s->p[i], &out[n++]);
    pthread_mutex_unlock(&mu);
    return n;
}

/* A claimed piece's swap step is over: its physical memory (0: none) and host copy. */
void gs_settle(uint64_t id, unsigned long long handle, uint64_t host) {
    struct piece *p = (struct piece *)(uintptr_t)id;
    pthread_mutex_lock(&mu);
    struct seg *s = p->seg;
    int was = p->handle != 0;
    if (!s->freed) {
        if (was && !handle) {
            resident -= p->size;
            /* out with no host copy: dropped (the swap decided so from the mark it
             * claimed the piece with, which may have changed since) */
            p->dropped = !host;
            if (p->dropped) discarded += p->size;
            else swapped += p->size;
        }
        if (!was && handle) {
            if (p->dropped) discarded -= p->size; else swapped -= p->size;
            resident += p->size;
            p->dropped = 0;
        }
        p->handle = handle;
        p->host = host;
    } else { /* freed while it moved: nothing of it stays */
        if (was) resident -= p->size;
        else if (p->dropped) discarded -= p->size;
        else swapped -= p->size;
        if (handle) {
            int pushed = enter();
            give_back(p->va, p->size, handle, 1);
            leave(pushed);
        }
        if (host) give_back_host(host);
    }
    p->busy = 0;
    if (--s->busy == 0 && s->freed) {
        int pushed = enter();
        drop_segment(s);
        leave(pushed);
    }
    pthread_mutex_unlock(&mu);
}

/* Host copies of pieces freed while swapped out, for Python's pool (at most max). */
int gs_returned(uint64_t *out, int max) {
    pthread_mutex_lock(&mu);
    int n = nreturned < max ? nreturned : max;
    memcpy(out, returned + (nreturned - n), (size_t)n * sizeof *out);
    nreturned -= n;
    pthread_mutex_unlock(&mu);
    return n;
}

static void limit_note(void) {
    time_t now = time(NULL);
    if (now != last_limit_note) { /* at most one a second: PyTorch retries at once */
        last_limit_note = now;
        fprintf(stderr, "gpushare: %s\n", err);
    }
}

/* --- the pool route: a torch.cuda.MemPool's allocator ------------------------------ */

void *gs_pool_alloc(ssize_t size, int device, void *stream) {
    (void)device, (void)stream;
    unsigned long long va = 0;
    int rc = gs_alloc((unsigned long long)size, &va);
    if (rc == GS_LIMIT) limit_note();
    else if (rc) fprintf(stderr, "gpushare: %s\n", err);
    return rc ? NULL : (void *)(uintptr_t)va; /* NULL: PyTorch raises out of memory */
}

void gs_pool_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size, (void)device, (void)stream;
    if (ptr && gs_free((unsigned long long)(uintptr_t)ptr))
        fprintf(stderr, "gpushare: freeing %p: not gpushare's memory\n", ptr);
}

/* --- the preload route: the CUDA runtime's cudaMalloc and cudaFree ------------------ */

typedef cudaError_t (*malloc_fn)(void **, size_t);
typedef cudaError_t (*free_fn)(void *);
typedef cudaError_t (*getdev_fn)(int *);

static void *next_sym(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    static const char *libs[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
    for (unsigned i = 0; !f && i < sizeof libs / sizeof *libs; i++) {
        void *h = dlopen(libs[i], RTLD_LAZY | RTLD_NOLOAD); /* loaded by then, locally */
        if (h) f = dlsym(h, name);
    }
    return f;
}

static int on_our_device(void) {
    static getdev_fn getdev;
    if (!getdev) *(void **)&getdev = next_sym("cudaGetDevice");
    int d;
    if (getdev && getdev(&d) == 0) return d == device_index;
    CUcontext cur = NULL;
    return cu.CtxGetCurrent(&cur) == 0 && cur == ctx;
}

cudaError_t cudaMalloc(void **ptr, size_t size) {
    __atomic_add_fetch(&mallocs_seen, 1, __ATOMIC_RELAXED);
    if (configured && routing && !paused && size && on_our_device()) {
        unsigned long long va = 0;
        int rc = gs_alloc(size, &va);
        if (rc == GS_OK) {
            *ptr = (void *)(uintptr_t)va;
            return 0;
        }
        if (rc == GS_LIMIT) limit_note();
        else fprintf(stderr, "gpushare: %s\n", err);
        return cudaErrorMemoryAllocation; /* PyTorch frees its cache and retries, then raises */
    }
    static malloc_fn real;
    if (!real) *(void **)&real = next_sym("cudaMalloc");
    return real ? real(ptr, size) : cudaErrorInitializationError;
}

cudaError_t cudaFree(void *ptr) {
    __atomic_add_fetch(&frees_seen, 1, __ATOMIC_RELAXED);
    if (ptr && configured && gs_free((unsigned long long)(uintptr_t)ptr) == 0) return 0;
    static free_fn real;
    if (!real) *(void **)&real = next_sym("cudaFree");
    return real ? real(ptr) : cudaErrorInitializationError;
}
