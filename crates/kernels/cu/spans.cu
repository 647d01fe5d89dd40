// spans.cu: the byte-span kernels of one buffer: page-envelope copies (the CUDA twin of
// CpuDevice::move_spans) and fills (of CpuDevice::fill_spans: zeroing page envelopes on
// hand-out, poisoning freed ones), each one launch for all its spans.
//
// `moves` holds 3 u64 per move (src, dst, len), `spans` 2 per span (offset, len). The
// host checks every range against the buffer, and for moves that no destination
// overlaps another destination or any source (the Device::move_spans contract): so no
// thread reads a byte any thread writes, no two threads write one byte, and the copies
// need no staging buffer and no order. Fill spans may overlap; every writer of a byte
// writes the same value.
//
// The grid is 2-D: blockIdx.y strides over the spans, blockIdx.x over chunks of
// UNIKV_CHUNK bytes of a span, so a multi-MiB envelope is shared by many blocks. A span's
// 16-byte-aligned body is moved a 16-byte word per thread (a move's only when its source
// and destination share their alignment modulo 16), the bytes before and after it one
// at a time.
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// Bytes per chunk: one 16-byte word per thread of a 256-thread block.
#define UNIKV_CHUNK 4096ULL

struct alignas(16) unikv_word {
    unsigned long long lo, hi;
};

// The 16-byte words of a span [0, len) from `offset` in the buffer: `head` single bytes
// up to a 16-byte boundary, `words` words, then single bytes to `len`. No words when
// `aligned` is false (the span is then all head).
struct unikv_split {
    unsigned long long head, words;
};

static __device__ unikv_split unikv_split_span(unsigned long long offset, unsigned long long len, bool aligned) {
    unikv_split s;
    s.head = (16 - (offset & 15)) & 15;
    if (!aligned || s.head > len) {
        s.head = len;
        s.words = 0;
    } else {
        s.words = (len - s.head) / 16;
    }
    return s;
}

// Whether byte `b` of a span is one of the single bytes of `s` (not inside a word).
static __device__ bool unikv_single_byte(unikv_split s, unsigned long long b) {
    return b < s.head || b >= s.head + 16 * s.words;
}

// Calls `f(i)` for every item `i < n` this thread owns: blockIdx.x strides over chunks
// of `per_chunk` items, the block's threads over a chunk's items.
template <class F>
static __device__ void unikv_each_in_chunks(unsigned long long n, unsigned long long per_chunk, F f) {
    for (unsigned long long c = blockIdx.x; c * per_chunk < n; c += gridDim.x) {
        unsigned long long end = (c + 1) * per_chunk;
        if (end > n) {
            end = n;
        }
        for (unsigned long long i = c * per_chunk + threadIdx.x; i < end; i += blockDim.x) {
            f(i);
        }
    }
}

extern "C" __global__ void unikv_move_spans(
    unsigned char* buf,
    const unsigned long long* moves,
    unsigned long long n_moves)
{
    for (unsigned long long m = blockIdx.y; m < n_moves; m += gridDim.y) {
        unsigned long long src = moves[3 * m];
        unsigned long long dst = moves[3 * m + 1];
        unsigned long long len = moves[3 * m + 2];
        unikv_split s = unikv_split_span(dst, len, ((src ^ dst) & 15) == 0);
        const unikv_word* from = (const unikv_word*)(buf + src + s.head);
        unikv_word* to = (unikv_word*)(buf + dst + s.head);
        unikv_each_in_chunks(s.words, UNIKV_CHUNK / 16, [&](unsigned long long w) { to[w] = from[w]; });
        // The single bytes: the head and the tail (a whole unaligned span), chunk by chunk.
        unikv_each_in_chunks(len, UNIKV_CHUNK, [&](unsigned long long b) {
            if (unikv_single_byte(s, b)) {
                buf[dst + b] = buf[src + b];
            }
        });
    }
}

extern "C" __global__ void unikv_fill_spans(
    unsigned char* buf,
    const unsigned long long* spans,
    unsigned long long n_spans,
    unsigned char value)
{
    unikv_word word;
    word.lo = (unsigned long long)value * 0x0101010101010101ULL;
    word.hi = word.lo;
    for (unsigned long long s_ix = blockIdx.y; s_ix < n_spans; s_ix += gridDim.y) {
        unsigned long long offset = spans[2 * s_ix];
        unsigned long long len = spans[2 * s_ix + 1];
        unikv_split s = unikv_split_span(offset, len, true);
        unikv_word* to = (unikv_word*)(buf + offset + s.head);
        unikv_each_in_chunks(s.words, UNIKV_CHUNK / 16, [&](unsigned long long w) { to[w] = word; });
        unikv_each_in_chunks(len, UNIKV_CHUNK, [&](unsigned long long b) {
            if (unikv_single_byte(s, b)) {
                buf[offset + b] = value;
            }
        });
    }
}
