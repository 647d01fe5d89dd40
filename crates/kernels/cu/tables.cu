// tables.cu: scatter and gather of i32 table entries (the CUDA twins of
// CpuDevice::scatter_table and CpuDevice::gather_table).
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// table[pairs[2k]] = (int)pairs[2k + 1] for k < n. The host checks every index against
// the table and keeps only the last pair for each index, so no two threads write the
// same entry; `pairs` is a separate allocation.
extern "C" __global__ void unikv_scatter(
    int* table,
    const unsigned int* pairs,
    unsigned long long n)
{
    unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k < n; k += step) {
        table[pairs[2 * k]] = (int)pairs[2 * k + 1];
    }
}

// out[i] = src[indices[i]] for i < n, or 0 when indices[i] is outside src. The host
// checks that indices and out hold n entries and that out is neither src nor indices.
extern "C" __global__ void unikv_gather(
    const int* src,
    unsigned long long src_len,
    const int* indices,
    unsigned long long n,
    int* out)
{
    unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += step) {
        int index = indices[i];
        out[i] = (index >= 0 && (unsigned long long)index < src_len) ? src[index] : 0;
    }
}
