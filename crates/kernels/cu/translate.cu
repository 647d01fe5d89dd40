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

// The kernel id of one slot `i` of a translation's output.
static __device__ int unikv_kernel_id(
    const int* v2p,
    unsigned long long v2p_len,
    const int* ids,
    unsigned long long n,
    int page_size,
    int stride,
    unsigned long long i)
{
    if (i >= n) {
        return 0;
    }
    int id = ids[i];
    if (id <= 0) {
        return 0;
    }
    unsigned long long page = (unsigned long long)(id / page_size);
    if (page >= v2p_len) {
        return 0;
    }
    int phys = v2p[page];
    if (phys <= 0) {
        return 0;
    }
    unsigned int k = (unsigned int)phys * (unsigned int)stride + (unsigned int)(id % page_size);
    return (int)k;
}

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
        out[i] = unikv_kernel_id(v2p, v2p_len, ids, n, page_size, stride, i);
    }
}

// Several translations in one launch (a step's translation of every side): `list` holds
// 8 u64 per translation (v2p, v2p_len, ids, n, page_size, stride, out, out_width, the
// pointers as addresses). blockIdx.y strides over the translations, x over each one's
// output. The host checks each as for unikv_translate, and that no output is another
// translation's table.
extern "C" __global__ void unikv_translate_many(
    const unsigned long long* list,
    unsigned long long count)
{
    for (unsigned long long t = blockIdx.y; t < count; t += gridDim.y) {
        const unsigned long long* a = list + 8 * t;
        int* out = (int*)a[6];
        unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
             i < a[7]; i += step) {
            out[i] = unikv_kernel_id((const int*)a[0], a[1], (const int*)a[2], a[3], (int)a[4],
                                     (int)a[5], i);
        }
    }
}

// Windows of virtual ids that start at device-side offsets (a verify step's write ids and
// state slots: the start is the accepted count of the request's earlier verify, which
// only the device knows). `list` holds 12 u64 per window: v2p, v2p_len, ids (request 0's
// row), rows, starts (request 0's start), bias (an i64), batch, width, page_size, stride,
// out (request 0's window), lens (request 0's live length, or 0: none), the pointers as
// addresses. For r < batch, j < width: s = starts[r] + bias + j and out[r * width + j]
// translates ids[r * rows + s], or is 0 when s is outside 0..rows or j >= lens[r].
// blockIdx.y strides over the windows, x over each one's batch * width slots. The host
// checks every range, and that no output is an input of the call or overlaps another
// output.
extern "C" __global__ void unikv_translate_windows(
    const unsigned long long* list,
    unsigned long long count)
{
    for (unsigned long long w = blockIdx.y; w < count; w += gridDim.y) {
        const unsigned long long* a = list + 12 * w;
        const int* ids = (const int*)a[2];
        unsigned long long rows = a[3];
        const int* starts = (const int*)a[4];
        long long bias = (long long)a[5];
        unsigned long long width = a[7];
        int* out = (int*)a[10];
        const int* lens = (const int*)a[11];
        unsigned long long items = a[6] * width;
        unsigned long long step = (unsigned long long)blockDim.x * gridDim.x;
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
             i < items; i += step) {
            unsigned long long r = i / width;
            long long j = (long long)(i % width);
            long long s = (long long)starts[r] + bias + j;
            out[i] = s < 0 || (lens != 0 && j >= (long long)lens[r]) ? 0
                           : unikv_kernel_id((const int*)a[0], a[1], ids + r * rows, rows,
                                             (int)a[8], (int)a[9], (unsigned long long)s);
        }
    }
}

// Runs of persistent lanes of virtual pages at device-side offsets (a step's FULL page
// table and SWA window: the CUDA twin of CpuDevice::translate_lanes). `list` holds 12 u64
// per translation: v2p, v2p_len, rows, rows_len, lane_len, lanes (request 0's lane),
// firsts (request 0's first entry, or 0: none), starts (request 0's output start; batch + 1
// prefix sums), batch, stride, out (output 0), out_len, the pointers as addresses.
// `total` is the sum of the batches. For request r of a translation: lane l = lanes[r],
// first f = firsts[r] (0 without), o = starts[r], c = starts[r + 1] - o; for each j < c
// with o + j inside 0..out_len (the only j visited), out[o + j] = v2p[p] * stride for
// p = rows[l * lane_len + f + j], or 0 (the sink) when l is outside the lanes, f + j
// outside 0..lane_len, p <= 0, p >= v2p_len or v2p[p] <= 0. blockIdx.y strides over every
// translation's requests, x over each request's run. The host checks every range, that v2p
// and rows are no output, and that no output range overlaps an input range or another
// output, so only device data (overlapping runs of two requests) can give a slot two
// writers (which one lands is then unspecified).
extern "C" __global__ void unikv_translate_lanes(
    const unsigned long long* list,
    unsigned long long count,
    unsigned long long total)
{
    for (unsigned long long q = blockIdx.y; q < total; q += gridDim.y) {
        unsigned long long t = 0;
        unsigned long long r = q;
        while (t < count && r >= list[12 * t + 8]) {
            r -= list[12 * t + 8];
            t += 1;
        }
        if (t >= count) {
            return;
        }
        const unsigned long long* a = list + 12 * t;
        const int* v2p = (const int*)a[0];
        unsigned long long v2p_len = a[1];
        const int* rows = (const int*)a[2];
        unsigned long long lane_len = a[4];
        long long lanes_count = (long long)(a[3] / lane_len);
        long long lane = (long long)((const int*)a[5])[r];
        long long first = a[6] == 0 ? 0 : (long long)((const int*)a[6])[r];
        const int* starts = (const int*)a[7];
        long long start = (long long)starts[r];
        long long runs = (long long)starts[r + 1] - start;
        unsigned int stride = (unsigned int)a[9];
        int* out = (int*)a[10];
        long long out_len = (long long)a[11];
        // Only the j with start + j inside 0..out_len: at most out_len steps, whatever the
        // device values (a run of INT_MIN..INT_MAX is not 2^32 of them).
        long long from = start < 0 ? -start : 0;
        long long to = runs < out_len - start ? runs : out_len - start;
        long long step = (long long)blockDim.x * gridDim.x;
        for (long long j = from + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < to;
             j += step) {
            long long o = start + j;
            long long e = first + j;
            int id = 0;
            if (lane >= 0 && lane < lanes_count && e >= 0 && e < (long long)lane_len) {
                int p = rows[(unsigned long long)lane * lane_len + (unsigned long long)e];
                if (p > 0 && (unsigned long long)p < v2p_len) {
                    int phys = v2p[p];
                    if (phys > 0) {
                        id = (int)((unsigned int)phys * stride);
                    }
                }
            }
            out[o] = id;
        }
    }
}
