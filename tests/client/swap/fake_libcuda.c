/* A libcuda for machines without a GPU: the driver calls gpushare's ctypes layer makes
 * (src/gpushare/swap/cuda.py), with the signatures and structures of cuda.h, over host
 * memory. Virtual memory management is modelled with the kernel's own: a reservation is
 * an inaccessible mapping, a physical allocation a memfd, cuMemMap maps it at the
 * reserved address and cuMemSetAccess makes it readable and writable, so an unmapped
 * range really faults. Every argument gpushare passes is checked as the driver would;
 * a wrong structure layout or flag returns CUDA_ERROR_INVALID_VALUE.
 *
 * FAKE_CUDA_CAPACITY (bytes) bounds the physical memory: cuMemCreate past it returns
 * CUDA_ERROR_OUT_OF_MEMORY. Built by the tests with: cc -shared -fPIC -o X.so this.c
 */
#define _GNU_SOURCE
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

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3 };
static const size_t GRANULARITY = 2 << 20; /* what an H200 reports */
static int initialized, current;
static size_t created; /* physical bytes */
static char ctx_token, stream_token, event_token;

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
    if (ordinal != 0) return INVALID_VALUE;
    *d = 0;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (d != 0) return INVALID_VALUE;
    *c = &ctx_token;
    return OK;
}
CUresult cuCtxSetCurrent(CUcontext c) {
    if (c != &ctx_token) return INVALID_VALUE;
    current = 1;
    return OK;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
    if (!good_prop(p) || option != 1 /* RECOMMENDED */) return INVALID_VALUE;
    *g = GRANULARITY;
    return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    if (!current || size % GRANULARITY || align != GRANULARITY || addr || flags)
        return INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)p;
    return OK;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    return munmap((void *)ptr, size) ? INVALID_VALUE : OK;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p,
                     unsigned long long flags) {
    if (!current || !good_prop(p) || flags || size % GRANULARITY) return INVALID_VALUE;
    if (created + size > capacity()) return OUT_OF_MEMORY;
    int fd = memfd_create("fake-cuda", 0);
    if (fd < 0 || ftruncate(fd, (off_t)size)) return OUT_OF_MEMORY;
    created += size;
    *h = ((unsigned long long)size << 20) | (unsigned)fd; /* fd and size, as a handle */
    return OK;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    created -= (size_t)(h >> 20);
    return close((int)(h & 0xFFFFF)) ? INVALID_VALUE : OK;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags) {
    if (offset || flags || size != (size_t)(h >> 20)) return INVALID_VALUE;
    void *p = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)(h & 0xFFFFF), 0);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *d, size_t count) {
    if (count != 1 || d->location.type != 1 || d->location.id != 0 || d->flags != 3)
        return INVALID_VALUE;
    return mprotect((void *)ptr, size, PROT_READ | PROT_WRITE) ? INVALID_VALUE : OK;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    /* Back to a reservation: the range stays ours and faults again. */
    void *p = mmap((void *)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}
CUresult cuMemHostAlloc(void **pp, size_t size, unsigned flags) {
    if (flags) return INVALID_VALUE;
    *pp = malloc(size);
    return *pp ? OK : OUT_OF_MEMORY;
}
CUresult cuMemFreeHost(void *p) { free(p); return OK; }
CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    if (flags != 1 /* NON_BLOCKING */) return INVALID_VALUE;
    *s = &stream_token;
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    if (s != &stream_token) return INVALID_VALUE;
    memcpy(dst, (void *)src, n);
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    if (s != &stream_token) return INVALID_VALUE;
    memcpy((void *)dst, src, n);
    return OK;
}
CUresult cuEventCreate(CUevent *e, unsigned flags) {
    if (flags != 2 /* DISABLE_TIMING */) return INVALID_VALUE;
    *e = &event_token;
    return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    return e == &event_token && s == &stream_token ? OK : INVALID_VALUE;
}
CUresult cuEventSynchronize(CUevent e) { return e == &event_token ? OK : INVALID_VALUE; }
CUresult cuEventDestroy_v2(CUevent e) { return e == &event_token ? OK : INVALID_VALUE; }
CUresult cuGetErrorString(CUresult r, const char **s) {
    static const char *names[] = {"no error", "invalid argument", "out of memory",
                                  "initialization error"};
    *s = r >= 0 && r < 4 ? names[r] : "unknown error";
    return OK;
}
size_t fake_cuda_created(void) { return created; }
