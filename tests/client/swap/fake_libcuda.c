/* A libcuda for machines without a GPU: the driver calls gpushare makes (the ctypes
 * layer src/gpushare/client/swap/cuda.py and the allocator gpushare_alloc.c), with the
 * signatures and structures of cuda.h, over host memory. Virtual memory management is
 * modelled with the kernel's own: a reservation is an inaccessible mapping, a physical
 * allocation a memfd, cuMemMap maps it at the reserved address and cuMemSetAccess makes
 * it readable and writable, so an unmapped range really faults. Every argument gpushare
 * passes is checked as the driver would; a wrong structure layout or flag returns
 * CUDA_ERROR_INVALID_VALUE, and a call that needs a current context returns
 * CUDA_ERROR_INVALID_CONTEXT without one (contexts are a per-thread stack, as in CUDA).
 *
 * Environment: FAKE_CUDA_CAPACITY (bytes) bounds the physical memory (cuMemCreate past
 * it returns CUDA_ERROR_OUT_OF_MEMORY); FAKE_CUDA_GRANULARITY (bytes, default 2 MiB, an
 * H200's); FAKE_CUDA_CORRUPT=1 flips the first byte of every device-to-host copy;
 * FAKE_CUDA_DEVICES (default 1) devices, peers of each other unless FAKE_CUDA_NO_PEERS=1
 * (memory lives on device 0 alone; the others can be granted access to it).
 * For tests: fake_cuda_fail(name, code, skip) makes the call after `skip` more calls of
 * `name` fail once; fake_cuda_calls(name) counts calls; fake_cuda_log() lists them;
 * fake_cuda_alive("streams"|"events"|"contexts") counts what was made and not given
 * back; fake_cuda_access(ids, max) the devices the last cuMemSetAccess granted.
 * Built by the tests with: cc -shared -fPIC -o X.so this.c
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_CONTEXT = 201 };
static int initialized;
static size_t created, pinned; /* physical bytes, pinned host bytes */
static int streams_alive, events_alive, ctx_refs; /* made and not yet destroyed/released */
static int access_n, access_ids[16];               /* the last cuMemSetAccess's devices */
static char ctx_token, foreign_token, stream_token;
static __thread CUcontext stack[16];
static __thread int depth;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static struct { char name[48]; int n; } counts[64];
static char fail_name[48];
static int fail_code, fail_skip;
static char calls_log[1 << 16];

/* Count the call, log it, and fail it if asked to. */
static CUresult called(const char *name) {
    CUresult rc = OK;
    pthread_mutex_lock(&mu);
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
/* "streams", "events" or "contexts" (primary-context retains) not yet given back. */
int fake_cuda_alive(const char *what) {
    if (!strcmp(what, "streams")) return streams_alive;
    if (!strcmp(what, "events")) return events_alive;
    if (!strcmp(what, "contexts")) return ctx_refs;
    return -1;
}
/* The devices the last cuMemSetAccess granted access to; their count. */
int fake_cuda_access(int *ids, int max) {
    for (int i = 0; i < access_n && i < max; i++) ids[i] = access_ids[i];
    return access_n;
}
/* Another context (a workload's own) current on this thread: gpushare must push and
 * pop its own around its calls and leave this one current. */
void fake_cuda_push_foreign(void) { stack[depth++] = &foreign_token; }
int fake_cuda_foreign_current(void) { return depth && stack[depth - 1] == &foreign_token; }

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

CUresult cuInit(unsigned flags) { initialized = 1; return flags ? INVALID_VALUE : OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= devices()) return INVALID_VALUE;
    *d = ordinal;
    return OK;
}
CUresult cuDeviceGetCount(int *n) {
    if (!initialized) return NOT_INITIALIZED;
    *n = devices();
    return OK;
}
CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
    CALLED("cuDeviceCanAccessPeer");
    if (d < 0 || d >= devices() || peer < 0 || peer >= devices()) return INVALID_VALUE;
    const char *s = getenv("FAKE_CUDA_NO_PEERS");
    *can = d != peer && !(s && *s == '1');
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
    if (d != 0) return INVALID_VALUE;
    *c = &ctx_token;
    __atomic_add_fetch(&ctx_refs, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuCtxGetCurrent(CUcontext *c) { *c = depth ? stack[depth - 1] : NULL; return OK; }
CUresult cuCtxSetCurrent(CUcontext c) {
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
CUresult cuCtxSynchronize(void) {
    CALLED("cuCtxSynchronize");
    NEEDS_CONTEXT();
    return OK;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
    if (!good_prop(p) || option != 1 /* RECOMMENDED */) return INVALID_VALUE;
    *g = granularity();
    return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    CALLED("cuMemAddressReserve");
    NEEDS_CONTEXT();
    if (size % granularity() || align != granularity() || addr || flags) return INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)p;
    return OK;
}
/* The ranges mapped now: as CUDA, mapping over a mapped range fails, and an unmap must
   cover whole mappings and nothing unmapped. */
static struct span { CUdeviceptr p; size_t n; } *spans;
static size_t nspans, capspans;

static int overlaps(CUdeviceptr p, size_t n, const struct span *s) {
    return p < s->p + s->n && s->p < p + n;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    CALLED("cuMemAddressFree");
    pthread_mutex_lock(&mu); /* what is still mapped there goes with the range */
    size_t j = 0;
    for (size_t i = 0; i < nspans; i++)
        if (!overlaps(ptr, size, &spans[i])) spans[j++] = spans[i];
    nspans = j;
    pthread_mutex_unlock(&mu);
    return munmap((void *)ptr, size) ? INVALID_VALUE : OK;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p,
                     unsigned long long flags) {
    CALLED("cuMemCreate");
    NEEDS_CONTEXT();
    if (!good_prop(p) || flags || size % granularity()) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (created + size > capacity()) {
        pthread_mutex_unlock(&mu);
        return OUT_OF_MEMORY;
    }
    created += size;
    pthread_mutex_unlock(&mu);
    int fd = memfd_create("fake-cuda", 0);
    if (fd < 0 || ftruncate(fd, (off_t)size)) return OUT_OF_MEMORY;
    const char *dirty = getenv("FAKE_CUDA_DIRTY"); /* as a GPU's: what was there before */
    if (dirty && *dirty == '1') {
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) return OUT_OF_MEMORY;
        memset(m, 0xA5, size);
        munmap(m, size);
    }
    *h = ((unsigned long long)size << 20) | (unsigned)fd; /* fd and size, as a handle */
    return OK;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    CALLED("cuMemRelease");
    pthread_mutex_lock(&mu);
    created -= (size_t)(h >> 20);
    pthread_mutex_unlock(&mu);
    return close((int)(h & 0xFFFFF)) ? INVALID_VALUE : OK;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags) {
    CALLED("cuMemMap");
    if (offset || flags || size != (size_t)(h >> 20)) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < nspans; i++)
        if (overlaps(ptr, size, &spans[i])) {
            pthread_mutex_unlock(&mu);
            return INVALID_VALUE;
        }
    if (nspans == capspans) {
        size_t cap = capspans ? 2 * capspans : 256;
        struct span *more = realloc(spans, cap * sizeof *spans);
        if (!more) {
            pthread_mutex_unlock(&mu);
            return OUT_OF_MEMORY;
        }
        spans = more, capspans = cap;
    }
    void *p = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)(h & 0xFFFFF), 0);
    if (p != MAP_FAILED) spans[nspans++] = (struct span){ptr, size};
    pthread_mutex_unlock(&mu);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}
static int unmap_spans(CUdeviceptr ptr, size_t size) {
    size_t covered = 0;
    for (size_t i = 0; i < nspans; i++) {
        if (!overlaps(ptr, size, &spans[i])) continue;
        if (spans[i].p < ptr || spans[i].p + spans[i].n > ptr + size) return 0; /* a part */
        covered += spans[i].n;
    }
    if (covered != size) return 0; /* some of it is not mapped */
    size_t j = 0;
    for (size_t i = 0; i < nspans; i++)
        if (!overlaps(ptr, size, &spans[i])) spans[j++] = spans[i];
    nspans = j;
    return 1;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *d, size_t count) {
    CALLED("cuMemSetAccess");
    /* The owning device among them, each device once, every one read-write. */
    int own = 0;
    if (count < 1 || count > 16) return INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (d[i].location.type != 1 || d[i].flags != 3) return INVALID_VALUE;
        if (d[i].location.id < 0 || d[i].location.id >= devices()) return INVALID_VALUE;
        for (size_t j = 0; j < i; j++)
            if (d[j].location.id == d[i].location.id) return INVALID_VALUE;
        own |= d[i].location.id == 0;
    }
    if (!own) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    access_n = (int)count;
    for (size_t i = 0; i < count; i++) access_ids[i] = d[i].location.id;
    pthread_mutex_unlock(&mu);
    return mprotect((void *)ptr, size, PROT_READ | PROT_WRITE) ? INVALID_VALUE : OK;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CALLED("cuMemUnmap");
    pthread_mutex_lock(&mu);
    int whole = unmap_spans(ptr, size);
    pthread_mutex_unlock(&mu);
    if (!whole) return INVALID_VALUE;
    /* Back to a reservation: the range stays ours and faults again. */
    void *p = mmap((void *)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}
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
    pthread_mutex_unlock(&mu);
    return OK;
}
CUresult cuMemFreeHost(void *p) {
    CALLED("cuMemFreeHost");
    NEEDS_CONTEXT();
    char *base = (char *)p - sizeof(size_t);
    pthread_mutex_lock(&mu);
    pinned -= *(size_t *)base;
    pthread_mutex_unlock(&mu);
    free(base);
    return OK;
}
CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    NEEDS_CONTEXT();
    if (flags != 1 /* NON_BLOCKING */) return INVALID_VALUE;
    *s = &stream_token;
    __atomic_add_fetch(&streams_alive, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuStreamDestroy_v2(CUstream s) {
    CALLED("cuStreamDestroy_v2");
    if (s != &stream_token || streams_alive <= 0) return INVALID_VALUE;
    __atomic_sub_fetch(&streams_alive, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    CALLED("cuMemcpyDtoHAsync_v2");
    NEEDS_CONTEXT();
    if (s != &stream_token) return INVALID_VALUE;
    memcpy(dst, (void *)src, n);
    const char *bad = getenv("FAKE_CUDA_CORRUPT");
    if (bad && *bad == '1' && n) ((unsigned char *)dst)[0] ^= 0xFF;
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    CALLED("cuMemcpyHtoDAsync_v2");
    NEEDS_CONTEXT();
    if (s != &stream_token) return INVALID_VALUE;
    memcpy((void *)dst, src, n);
    return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    CALLED("cuMemsetD8Async");
    NEEDS_CONTEXT();
    if (s != &stream_token) return INVALID_VALUE;
    memset((void *)dst, v, n);
    return OK;
}
CUresult cuEventCreate(CUevent *e, unsigned flags) {
    CALLED("cuEventCreate");
    NEEDS_CONTEXT();
    if (flags != 2 /* DISABLE_TIMING */) return INVALID_VALUE;
    *e = malloc(8);
    if (*e) __atomic_add_fetch(&events_alive, 1, __ATOMIC_SEQ_CST);
    return *e ? OK : OUT_OF_MEMORY;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    CALLED("cuEventRecord");
    return e && s == &stream_token ? OK : INVALID_VALUE;
}
CUresult cuEventSynchronize(CUevent e) {
    CALLED("cuEventSynchronize");
    return e ? OK : INVALID_VALUE;
}
CUresult cuEventDestroy_v2(CUevent e) {
    CALLED("cuEventDestroy_v2");
    if (!e) return INVALID_VALUE;
    __atomic_sub_fetch(&events_alive, 1, __ATOMIC_SEQ_CST);
    free(e);
    return OK;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
    static const char *names[] = {"no error", "invalid argument", "out of memory",
                                  "initialization error"};
    *s = r >= 0 && r < 4 ? names[r] : r == INVALID_CONTEXT ? "invalid device context"
                                                            : "unknown error";
    return OK;
}
