/* Stands where PyTorch's libc10_cuda.so stands: a library linked against the CUDA
 * runtime (-lcudart) that calls cudaMalloc and cudaFree through the dynamic linker.
 * Build: cc -shared -fPIC -o libconsumer.so this.c -L<dir> -l:libcudart.so.13
 */
#include <stdint.h>
#include <stddef.h>

typedef int cudaError_t;
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaSetDevice(int d);

int consumer_malloc(size_t n, uint64_t *out) {
    void *p = 0;
    int rc = cudaMalloc(&p, n);
    *out = (uint64_t)(uintptr_t)p;
    return rc;
}
int consumer_free(uint64_t p) { return cudaFree((void *)(uintptr_t)p); }
int consumer_set_device(int d) { return cudaSetDevice(d); }
