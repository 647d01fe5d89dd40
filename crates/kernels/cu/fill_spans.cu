// fill_spans.cu: set every byte of each span to one value (the CUDA twin of
// CpuDevice::fill_spans: zeroing page envelopes on hand-out, poisoning freed ones).
//
// `spans` holds 2 u64 per span: offset, len. The host checks every span against the
// buffer. Spans may overlap; every writer of a byte writes the same value.
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// Block b handles spans b, b + gridDim.x, ...; its threads stride over the bytes.
extern "C" __global__ void unikv_fill_spans(
    unsigned char* buf,
    const unsigned long long* spans,
    unsigned long long n_spans,
    unsigned char value)
{
    for (unsigned long long s = blockIdx.x; s < n_spans; s += gridDim.x) {
        unsigned long long offset = spans[2 * s];
        unsigned long long len = spans[2 * s + 1];
        for (unsigned long long b = threadIdx.x; b < len; b += blockDim.x) {
            buf[offset + b] = value;
        }
    }
}
