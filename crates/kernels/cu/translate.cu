// translate.cu: virtual token ids -> kernel ids (the CUDA twin of CpuDevice::translate).
//
// For i < n: out[i] = v2p[id / page_size] * stride + id % page_size with id = ids[i],
// or 0 (the sink) when id <= 0, id / page_size >= v2p_len, or v2p[page] <= 0.
// For n <= i < out_width: out[i] = 0 (zero-filled tail for graph capture).
// The product wraps like Rust's i32::wrapping_mul/wrapping_add: it is computed in
// unsigned arithmetic, where overflow is defined, and cast back.
//
// The host checks page_size > 0, n <= out_width, ids has >= n entries, out has
// >= out_width entries and out is neither v2p nor ids, so threads only read v2p and ids
// and each writes its own out[i].
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

extern "C" __global__ void unikv_translate(
    const int* v2p,
    unsigned long long v2p_len,
    const int* ids,
    unsigned long long n,
    int page_size,
    int stride,
    int* out,
    unsigned long long out_width)
{
    unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < out_width; i += step) {
        int kernel_id = 0;
        if (i < n) {
            int id = ids[i];
            if (id > 0) {
                unsigned long long page = (unsigned long long)(id / page_size);
                if (page < v2p_len) {
                    int phys = v2p[page];
                    if (phys > 0) {
                        unsigned int k = (unsigned int)phys * (unsigned int)stride
                                       + (unsigned int)(id % page_size);
                        kernel_id = (int)k;
                    }
                }
            }
        }
        out[i] = kernel_id;
    }
}
