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
// 16-byte-aligned body is moved in 16-byte words (a move's only when its source and
// destination share their alignment modulo 16), each thread loading UNIKV_UNROLL words
// before storing them so that several loads are in flight; the bytes before and after
// the body one at a time (a whole unaligned span is all such bytes, spread over the
// chunks as the words are).
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// Bytes per chunk: 16 words for each thread of a 256-thread block. A block moves 64 KiB
// of a span, not a word per thread: per-block work that small left a page-size-1 copy
// at 4 % of an H200's bandwidth.
#define UNIKV_CHUNK 65536ULL

// Words a thread loads before it stores them.
#define UNIKV_UNROLL 4

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

// Stores `load(w)` at word `w` for every word `w < n` this thread owns (the chunks of
// unikv_each_in_chunks), UNIKV_UNROLL loads at a time before their stores.
template <class Load, class Store>
static __device__ void unikv_words_in_chunks(unsigned long long n, Load load, Store store) {
    const unsigned long long per_chunk = UNIKV_CHUNK / 16;
    for (unsigned long long c = blockIdx.x; c * per_chunk < n; c += gridDim.x) {
        unsigned long long end = (c + 1) * per_chunk;
        if (end > n) {
            end = n;
        }
        const unsigned long long step = UNIKV_UNROLL * (unsigned long long)blockDim.x;
        for (unsigned long long i = c * per_chunk + threadIdx.x; i < end; i += step) {
            unikv_word w[UNIKV_UNROLL];
            for (int u = 0; u < UNIKV_UNROLL; u++) {
                unsigned long long j = i + u * (unsigned long long)blockDim.x;
                if (j < end) {
                    w[u] = load(j);
                }
            }
            for (int u = 0; u < UNIKV_UNROLL; u++) {
                unsigned long long j = i + u * (unsigned long long)blockDim.x;
                if (j < end) {
                    store(j, w[u]);
                }
            }
        }
    }
}

// Calls `f(b)` for every single byte `b` of span `s` of `len` bytes this thread owns:
// with a body, the head and the tail (fewer than 16 bytes each), in the first chunk's
// block; without one (the whole span), chunk by chunk.
template <class F>
static __device__ void unikv_each_single_byte(unikv_split s, unsigned long long len, F f) {
    if (s.words == 0) {
        unikv_each_in_chunks(len, UNIKV_CHUNK, f);
        return;
    }
    if (blockIdx.x != 0) {
        return;
    }
    for (unsigned long long b = threadIdx.x; b < s.head; b += blockDim.x) {
        f(b);
    }
    for (unsigned long long b = s.head + 16 * s.words + threadIdx.x; b < len; b += blockDim.x) {
        f(b);
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
        unikv_words_in_chunks(
            s.words,
            [&](unsigned long long w) { return from[w]; },
            [&](unsigned long long w, unikv_word v) { to[w] = v; });
        unikv_each_single_byte(s, len, [&](unsigned long long b) { buf[dst + b] = buf[src + b]; });
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
        unikv_words_in_chunks(
            s.words,
            [&](unsigned long long) { return word; },
            [&](unsigned long long w, unikv_word v) { to[w] = v; });
        unikv_each_single_byte(s, len, [&](unsigned long long b) { buf[offset + b] = value; });
    }
}

// A tree verify's accepted rows moved to consecutive positions (the CUDA twin of
// CpuDevice::gather_rows). Request r has `width` kernel ids ids[r * width ..] and path
// entries path[r * width ..]; for i = 0, 1, ... while node = path[i] is in 0..width,
// the token rows of position `node` are copied to those of position i (row l of kernel
// id k: row_bytes bytes at (k + l * page_size) * row_bytes), skipping equal or
// non-positive ids and rows past the buffer.
//
// blockIdx.y strides over the requests, x over the byte offsets of a token's rows: a
// thread owns one offset and walks the path in order. Rows of distinct tokens are
// disjoint and a byte is at the same offset in every row it is copied between, so each
// byte has one thread, which keeps the path's order (a node's index is at least its
// position, so its rows are read before a later step overwrites them) without a
// barrier. The host checks the tables' ranges and that no offset wraps.
extern "C" __global__ void unikv_gather_rows(
    unsigned char* buf,
    unsigned long long buf_len,
    const int* ids,
    const int* path,
    unsigned long long batch,
    unsigned long long width,
    unsigned long long page_size,
    unsigned long long rows_per_token,
    unsigned long long row_bytes)
{
    unsigned long long token_bytes = rows_per_token * row_bytes;
    unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long r = blockIdx.y; r < batch; r += gridDim.y) {
        const int* id = ids + r * width;
        const int* nodes = path + r * width;
        for (unsigned long long o = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
             o < token_bytes; o += step) {
            unsigned long long row = (o / row_bytes) * page_size;
            unsigned long long b = o % row_bytes;
            for (unsigned long long i = 0; i < width; ++i) {
                int node = nodes[i];
                if (node < 0 || (unsigned long long)node >= width) {
                    break;
                }
                int src = id[node];
                int dst = id[i];
                if (src == dst || src <= 0 || dst <= 0) {
                    continue;
                }
                unsigned long long s = ((unsigned long long)src + row) * row_bytes;
                unsigned long long d = ((unsigned long long)dst + row) * row_bytes;
                if (s + row_bytes > buf_len || d + row_bytes > buf_len) {
                    continue;
                }
                buf[d + b] = buf[s + b];
            }
        }
    }
}
