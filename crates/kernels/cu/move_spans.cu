// move_spans.cu: page-envelope copies inside one byte buffer (the CUDA twin of
// CpuDevice::move_spans), in two launches on one stream so that every source is read
// before any destination is written:
//   1. unikv_stage_spans copies each move's source into a staging buffer;
//   2. unikv_unstage_spans copies each staged range to the move's destination.
//
// `moves` holds 4 u64 per move: src, dst, len, staging offset (the prefix sum of the
// lengths). The host checks every src and dst range against the buffer, that no two
// destinations overlap, and sizes `staging` to the sum of the lengths; `staging` is a
// separate allocation. So in each launch the reads and writes go to different
// allocations, and in launch 2 no two threads write the same byte.
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// Block b handles moves b, b + gridDim.x, ...; its threads stride over the bytes.
extern "C" __global__ void unikv_stage_spans(
    const unsigned char* buf,
    const unsigned long long* moves,
    unsigned long long n_moves,
    unsigned char* staging)
{
    for (unsigned long long m = blockIdx.x; m < n_moves; m += gridDim.x) {
        unsigned long long src = moves[4 * m];
        unsigned long long len = moves[4 * m + 2];
        unsigned long long at = moves[4 * m + 3];
        for (unsigned long long b = threadIdx.x; b < len; b += blockDim.x) {
            staging[at + b] = buf[src + b];
        }
    }
}

extern "C" __global__ void unikv_unstage_spans(
    unsigned char* buf,
    const unsigned long long* moves,
    unsigned long long n_moves,
    const unsigned char* staging)
{
    for (unsigned long long m = blockIdx.x; m < n_moves; m += gridDim.x) {
        unsigned long long dst = moves[4 * m + 1];
        unsigned long long len = moves[4 * m + 2];
        unsigned long long at = moves[4 * m + 3];
        for (unsigned long long b = threadIdx.x; b < len; b += blockDim.x) {
            buf[dst + b] = staging[at + b];
        }
    }
}
