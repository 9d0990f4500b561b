/* A CUDA runtime for machines without a GPU: the calls PyTorch's caching allocator makes
 * for its segments (cudaMalloc, cudaFree), and the current device, over host memory.
 * Built by the tests with the runtime's soname (libcudart.so.13), so that a library
 * linked against it (fake_consumer.c, standing where libc10_cuda.so stands) finds
 * cudaMalloc through the dynamic linker exactly as PyTorch's does: gpushare's
 * LD_PRELOAD'ed allocator comes first, and this one is what it falls back to.
 * Build: cc -shared -fPIC -Wl,-soname,libcudart.so.13 -o libcudart.so.13 this.c
 */
#include <stdlib.h>

typedef int cudaError_t;
static __thread int device;
static int mallocs, frees;

cudaError_t cudaMalloc(void **p, size_t n) {
    mallocs++;
    *p = malloc(n ? n : 1);
    return *p ? 0 : 2 /* cudaErrorMemoryAllocation */;
}
cudaError_t cudaFree(void *p) {
    frees++;
    free(p);
    return 0;
}
cudaError_t cudaGetDevice(int *d) { *d = device; return 0; }
cudaError_t cudaSetDevice(int d) { device = d; return 0; }
int fake_cudart_mallocs(void) { return mallocs; }
int fake_cudart_frees(void) { return frees; }
