// tables.cu: scatter and gather of i32 table entries (the CUDA twins of
// CpuDevice::scatter_tables and CpuDevice::gather_table).
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// One launch for the scatters into several tables (a step's mirror upload of every
// side). `list` holds `k` table addresses (u64), then `n` triples of u32: the table's
// slot in the list, the index, the value's bit pattern. The host checks every index
// against its table and keeps only the last triple for each (table, index), so no two
// threads write the same entry; `list` is separate from every table.
extern "C" __global__ void unikv_scatter_tables(
    const unsigned long long* list,
    unsigned long long k,
    unsigned long long n)
{
    const unsigned int* triples = (const unsigned int*)(list + k);
    unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += step) {
        int* table = (int*)list[triples[3 * i]];
        table[triples[3 * i + 1]] = (int)triples[3 * i + 2];
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
