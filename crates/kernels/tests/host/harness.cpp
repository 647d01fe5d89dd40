// harness.cpp: runs the CUDA kernels of ../../cu/*.cu as host C++ (tests/host_kernels.rs).
//
// The shim below stands in for CUDA: `__global__` is empty and the launch loops over
// every block and, inside it, every thread of a grid in turn, setting blockIdx/threadIdx
// as a GPU would. The kernels' contracts make their threads independent (no thread
// reads a byte another writes, no two write one), so running them one after another
// computes what a GPU launch computes, and an indexing bug shows as a wrong output.
//
// Protocol (stdin -> stdout, little-endian): a message is a list of arrays, each a u64
// byte length and the bytes. The first is the kernel's name, the second three u32 (the
// grid's x and y and the block size), then the kernel's arguments in the order of `main` below. The output
// is the one array the kernel writes, after the launch.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

struct dim3 {
    unsigned int x, y, z;
};
static dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__

#define __device__
#include "spans.cu"
#include "tables.cu"
#include "translate.cu"

template <class Kernel>
static void launch(unsigned int grid_x, unsigned int grid_y, unsigned int block, Kernel kernel) {
    gridDim = {grid_x, grid_y, 1};
    blockDim = {block, 1, 1};
    for (unsigned int y = 0; y < grid_y; ++y) {
        for (unsigned int x = 0; x < grid_x; ++x) {
            for (unsigned int t = 0; t < block; ++t) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                kernel();
            }
        }
    }
}

static std::vector<unsigned char> read_array() {
    uint64_t len = 0;
    if (fread(&len, 8, 1, stdin) != 1) {
        fprintf(stderr, "harness: truncated input\n");
        exit(2);
    }
    std::vector<unsigned char> bytes(len);
    if (len > 0 && fread(bytes.data(), 1, len, stdin) != len) {
        fprintf(stderr, "harness: truncated array\n");
        exit(2);
    }
    return bytes;
}

template <class T>
static T* as(std::vector<unsigned char>& a) {
    return reinterpret_cast<T*>(a.data());
}

static void write_array(const std::vector<unsigned char>& a) {
    uint64_t len = a.size();
    fwrite(&len, 8, 1, stdout);
    fwrite(a.data(), 1, a.size(), stdout);
}

int main() {
    std::vector<unsigned char> name_bytes = read_array();
    std::string name(name_bytes.begin(), name_bytes.end());
    std::vector<unsigned char> shape = read_array();
    unsigned int grid_x = as<unsigned int>(shape)[0];
    unsigned int grid_y = as<unsigned int>(shape)[1];
    unsigned int block = as<unsigned int>(shape)[2];
    if (name == "fill_spans") {
        auto buf = read_array();
        auto spans = read_array();
        auto value = read_array();
        unsigned long long n = spans.size() / 16;
        launch(grid_x, grid_y, block, [&] {
            unikv_fill_spans(buf.data(), as<unsigned long long>(spans), n, value[0]);
        });
        write_array(buf);
    } else if (name == "move_spans") {
        auto buf = read_array();
        auto moves = read_array();
        unsigned long long n = moves.size() / 24;
        launch(grid_x, grid_y, block,
               [&] { unikv_move_spans(buf.data(), as<unsigned long long>(moves), n); });
        write_array(buf);
    } else if (name == "scatter_tables") {
        // k, the k tables, then the (slot, index, value) triples; the tables' addresses
        // go in front of the triples, as the backend stages them.
        auto k_bytes = read_array();
        unsigned long long k = as<unsigned long long>(k_bytes)[0];
        std::vector<std::vector<unsigned char>> tables;
        for (unsigned long long t = 0; t < k; ++t) {
            tables.push_back(read_array());
        }
        auto triples = read_array();
        std::vector<unsigned long long> list(k + (triples.size() + 7) / 8);
        for (unsigned long long t = 0; t < k; ++t) {
            list[t] = (unsigned long long)(uintptr_t)tables[t].data();
        }
        memcpy(&list[k], triples.data(), triples.size());
        unsigned long long n = triples.size() / 12;
        launch(grid_x, grid_y, block, [&] { unikv_scatter_tables(list.data(), k, n); });
        std::vector<unsigned char> all;
        for (auto& t : tables) {
            all.insert(all.end(), t.begin(), t.end());
        }
        write_array(all);
    } else if (name == "gather") {
        auto src = read_array();
        auto indices = read_array();
        auto out = read_array();
        unsigned long long n = indices.size() / 4;
        launch(grid_x, grid_y, block, [&] {
            unikv_gather(as<int>(src), src.size() / 4, as<int>(indices), n, as<int>(out));
        });
        write_array(out);
    } else if (name == "translate") {
        auto v2p = read_array();
        auto ids = read_array();
        auto args = read_array();  // n, page size, stride, out width: 4 x i64
        auto out = read_array();
        long long* a = as<long long>(args);
        launch(grid_x, grid_y, block, [&] {
            unikv_translate(as<int>(v2p), v2p.size() / 4, as<int>(ids),
                            (unsigned long long)a[0], (int)a[1], (int)a[2], as<int>(out),
                            (unsigned long long)a[3]);
        });
        write_array(out);
    } else if (name == "translate_many") {
        // count, then per translation: v2p, ids, (n, page size, stride, out width) as
        // 4 x i64, out. Output: the outs, concatenated.
        auto count_bytes = read_array();
        unsigned long long count = as<unsigned long long>(count_bytes)[0];
        std::vector<std::vector<unsigned char>> v2ps, idss, outs;
        std::vector<unsigned long long> list;
        for (unsigned long long t = 0; t < count; ++t) {
            v2ps.push_back(read_array());
            idss.push_back(read_array());
            auto args = read_array();
            outs.push_back(read_array());
            long long* a = as<long long>(args);
            unsigned long long words[8] = {0, v2ps.back().size() / 4, 0, (unsigned long long)a[0],
                                           (unsigned long long)a[1], (unsigned long long)a[2], 0,
                                           (unsigned long long)a[3]};
            list.insert(list.end(), words, words + 8);
        }
        for (unsigned long long t = 0; t < count; ++t) {  // the vectors no longer move
            list[8 * t] = (unsigned long long)(uintptr_t)v2ps[t].data();
            list[8 * t + 2] = (unsigned long long)(uintptr_t)idss[t].data();
            list[8 * t + 6] = (unsigned long long)(uintptr_t)outs[t].data();
        }
        launch(grid_x, grid_y, block, [&] { unikv_translate_many(list.data(), count); });
        std::vector<unsigned char> all;
        for (auto& o : outs) {
            all.insert(all.end(), o.begin(), o.end());
        }
        write_array(all);
    } else if (name == "translate_windows") {
        // count, then per window: v2p, ids, starts, lens (empty: none), (rows, bias,
        // batch, width, page size, stride) as 6 x i64, out. Output: the outs, concatenated.
        auto count_bytes = read_array();
        unsigned long long count = as<unsigned long long>(count_bytes)[0];
        std::vector<std::vector<unsigned char>> v2ps, idss, startss, lenss, outs;
        std::vector<unsigned long long> list;
        for (unsigned long long t = 0; t < count; ++t) {
            v2ps.push_back(read_array());
            idss.push_back(read_array());
            startss.push_back(read_array());
            lenss.push_back(read_array());
            auto args = read_array();
            outs.push_back(read_array());
            long long* a = as<long long>(args);
            unsigned long long words[12] = {0, v2ps.back().size() / 4, 0,
                                            (unsigned long long)a[0], 0,
                                            (unsigned long long)a[1], (unsigned long long)a[2],
                                            (unsigned long long)a[3], (unsigned long long)a[4],
                                            (unsigned long long)a[5], 0, 0};
            list.insert(list.end(), words, words + 12);
        }
        for (unsigned long long t = 0; t < count; ++t) {  // the vectors no longer move
            list[12 * t] = (unsigned long long)(uintptr_t)v2ps[t].data();
            list[12 * t + 2] = (unsigned long long)(uintptr_t)idss[t].data();
            list[12 * t + 4] = (unsigned long long)(uintptr_t)startss[t].data();
            list[12 * t + 10] = (unsigned long long)(uintptr_t)outs[t].data();
            if (!lenss[t].empty()) {
                list[12 * t + 11] = (unsigned long long)(uintptr_t)lenss[t].data();
            }
        }
        launch(grid_x, grid_y, block, [&] { unikv_translate_windows(list.data(), count); });
        std::vector<unsigned char> all;
        for (auto& o : outs) {
            all.insert(all.end(), o.begin(), o.end());
        }
        write_array(all);
    } else if (name == "translate_lanes") {
        // count, then per translation: v2p, rows, lanes, firsts (empty: none), starts,
        // (lane_len, batch, stride, out_at, out_len) as 5 x u64, out (the whole table:
        // entries outside out_at..out_at + out_len must stay). Output: the outs,
        // concatenated. The list is packed as the backend packs it (cuda.rs).
        auto count_bytes = read_array();
        unsigned long long count = as<unsigned long long>(count_bytes)[0];
        std::vector<std::vector<unsigned char>> v2ps, rowss, laness, firstss, startss, outs;
        std::vector<unsigned long long> list, out_at;
        unsigned long long total = 0;
        for (unsigned long long t = 0; t < count; ++t) {
            v2ps.push_back(read_array());
            rowss.push_back(read_array());
            laness.push_back(read_array());
            firstss.push_back(read_array());
            startss.push_back(read_array());
            auto args = read_array();
            outs.push_back(read_array());
            unsigned long long* a = as<unsigned long long>(args);
            unsigned long long words[12] = {0, v2ps.back().size() / 4, 0, rowss.back().size() / 4,
                                            a[0], 0, 0, 0, a[1], a[2], 0, a[4]};
            list.insert(list.end(), words, words + 12);
            out_at.push_back(a[3]);
            total += a[1];
        }
        for (unsigned long long t = 0; t < count; ++t) {  // the vectors no longer move
            list[12 * t] = (unsigned long long)(uintptr_t)v2ps[t].data();
            list[12 * t + 2] = (unsigned long long)(uintptr_t)rowss[t].data();
            list[12 * t + 5] = (unsigned long long)(uintptr_t)laness[t].data();
            if (!firstss[t].empty()) {
                list[12 * t + 6] = (unsigned long long)(uintptr_t)firstss[t].data();
            }
            list[12 * t + 7] = (unsigned long long)(uintptr_t)startss[t].data();
            list[12 * t + 10] = (unsigned long long)(uintptr_t)(outs[t].data() + 4 * out_at[t]);
        }
        launch(grid_x, grid_y, block,
               [&] { unikv_translate_lanes(list.data(), count, total); });
        std::vector<unsigned char> all;
        for (auto& o : outs) {
            all.insert(all.end(), o.begin(), o.end());
        }
        write_array(all);
    } else if (name == "gather_rows") {
        // buf, ids, path, then (batch, width, page size, rows per token, row bytes) as
        // 5 x u64. Output: the buffer.
        auto buf = read_array();
        auto ids = read_array();
        auto path = read_array();
        auto args = read_array();
        unsigned long long* a = as<unsigned long long>(args);
        launch(grid_x, grid_y, block, [&] {
            unikv_gather_rows(buf.data(), buf.size(), as<int>(ids), as<int>(path), a[0], a[1],
                              a[2], a[3], a[4]);
        });
        write_array(buf);
    } else {
        fprintf(stderr, "harness: unknown kernel %s\n", name.c_str());
        return 2;
    }
    return 0;
}
