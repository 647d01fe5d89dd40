// move_spans.cu: page-envelope copies inside one byte buffer (the CUDA twin of
// CpuDevice::move_spans), in one launch, copied in place.
//
// `moves` holds 3 u64 per move: src, dst, len. The host checks every src and dst range
// against the buffer and that no destination overlaps another destination or any
// source (the Device::move_spans contract). So no thread reads a byte any thread
// writes, and no two threads write the same byte: the copies need no staging buffer
// and no ordering between them.
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// Block b handles moves b, b + gridDim.x, ...; its threads stride over the bytes.
extern "C" __global__ void unikv_move_spans(
    unsigned char* buf,
    const unsigned long long* moves,
    unsigned long long n_moves)
{
    for (unsigned long long m = blockIdx.x; m < n_moves; m += gridDim.x) {
        unsigned long long src = moves[3 * m];
        unsigned long long dst = moves[3 * m + 1];
        unsigned long long len = moves[3 * m + 2];
        for (unsigned long long b = threadIdx.x; b < len; b += blockDim.x) {
            buf[dst + b] = buf[src + b];
        }
    }
}
