// The experts of a mixture-of-experts layer on the GPU (sm_80 and newer), with no round trip to
// the host: every size the launches need is an upper bound the host knows from the batch, and
// the exact counts stay on the device.
//
//   moe_route      per token: softmax of the router's logits in f32, the top k experts (best
//                  first, ties to the lower index), their weights renormalised when asked.
//   moe_count      how many (token, slot) pairs each expert has.
//   moe_offsets    each expert's first row, and the tile list: one (expert, first row, rows <= BM)
//                  triple per block of rows, with the number of tiles.
//   moe_place      every pair's row in expert order: tokens[row] = token, row_of[slot * T + token]
//                  = row (slot-major). The order of rows within an expert is whatever the atomics
//                  give; no result depends on it (below).
//   grouped_mm     y[r, :] = x[src(r), :] W_e^T for the rows r of expert e, all experts in one
//                  launch; src(r) = tokens[r] when the rows are gathered from the tokens. The
//                  SwiGLU form multiplies by the expert's gate rows and up rows in one block and
//                  writes silu(gate) * up, each rounded to the output type first (the bits of
//                  grouped_mm followed by silu_mul).
//   moe_combine    out[t] = the sum over slots, best first, of weight * y[row] in f32, plus the
//                  shared expert's output times sigmoid(x . gate) when there is one, rounded once.
//
// grouped_mm: x [R, K] row-major (or the tokens' rows, gathered); w [E, N, K] (each expert's
// weight as stored, [out, in]; [E, 2N, K] with the gate rows first for SwiGLU); y [R, N]. Grid
// (tiles bound, column blocks); blocks past the device's tile count return at once. 4 warps, 2 x 2,
// each a 32 x 64 piece of the 64 x 128 block tile; three 32-wide slices of K in flight (cp.async),
// fragments by ldmatrix, mma.sync.m16n8k16 with f32 accumulation. The
// reduction over K runs in the same order for every row, so a row's result does not depend on
// which rows share its tile or where in its expert's block it lands. On Hopper (sm_90a) the
// grouped_wg_* kernels below compute the same products with warpgroup MMA instead.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "convert.cuh"
#include "mma.cuh"
#include "reduce.cuh"
#include "wgmma.cuh"

#define BM 64
#define BN 128
#define BK 32
#define PADK 8
#define STAGES 3
#define THREADS 128
#define MAX_EXPERTS 1024
#define ROUTE_WARPS 8
#define PLACE_THREADS 256
#define PLACE_PER_THREAD 8
#define COMBINE_THREADS 256

// ---------------------------------------------------------------------------------------------
// Routing: one warp per token.

template <typename T>
__device__ void moe_route(const T* __restrict__ logits, uint32_t* __restrict__ idx, float* __restrict__ weight,
                          int tokens, int e, int k, int norm) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tok = blockIdx.x * ROUTE_WARPS + warp;
    if (tok >= tokens) return;
    const T* row = logits + (size_t)tok * e;
    float v[MAX_EXPERTS / 32];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS / 32; ++i) {
        const int c = lane + 32 * i;
        float l = c < e ? to_f32(row[c]) : -INFINITY;
        if (!(l >= -INFINITY)) l = -INFINITY;  // NaN
        v[i] = l;
        m = fmaxf(m, l);
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS / 32; ++i)
        if (lane + 32 * i < e) s += __expf(v[i] - m);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);

    uint32_t taken = 0;  // bit i: expert lane + 32 i is chosen
    float mine = 0.f;    // lane j keeps slot j's probability and expert
    int mine_idx = 0;
    for (int j = 0; j < k; ++j) {
        float bv = -INFINITY;
        int bi = -1;
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS / 32; ++i) {
            const int c = lane + 32 * i;
            if (c < e && !((taken >> i) & 1) && (bi < 0 || v[i] > bv)) {
                bv = v[i];
                bi = c;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffff, bv, o);
            const int oi = __shfl_xor_sync(0xffffffff, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi % 32 == lane) taken |= 1u << (bi / 32);
        if (lane == j) {
            mine = __expf(bv - m) / s;
            mine_idx = bi;
        }
    }
    float total = lane < k ? mine : 0.f;
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffff, total, o);
    if (lane < k) {
        idx[(size_t)tok * k + lane] = mine_idx;
        weight[(size_t)tok * k + lane] = norm ? mine / total : mine;
    }
}

extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
    moe_route_bf16(const __nv_bfloat16* logits, uint32_t* idx, float* weight, int tokens, int e, int k, int norm) {
    moe_route(logits, idx, weight, tokens, e, k, norm);
}
extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
    moe_route_f16(const __half* logits, uint32_t* idx, float* weight, int tokens, int e, int k, int norm) {
    moe_route(logits, idx, weight, tokens, e, k, norm);
}

// ---------------------------------------------------------------------------------------------
// The pairs in expert order. `counts` and `cursor` start at zero.

extern "C" __global__ void moe_count(const uint32_t* __restrict__ idx, uint32_t* __restrict__ counts, int pairs,
                                     int e) {
    __shared__ uint32_t hist[MAX_EXPERTS];
    for (int x = threadIdx.x; x < e; x += blockDim.x) hist[x] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x)
        atomicAdd(&hist[idx[i]], 1u);
    __syncthreads();
    for (int x = threadIdx.x; x < e; x += blockDim.x)
        if (hist[x]) atomicAdd(&counts[x], hist[x]);
}

// One block. `bm`: the rows of a tile (64 or 128: the grouped kernel's TM).
extern "C" __global__ void moe_offsets(const uint32_t* __restrict__ counts, uint32_t* __restrict__ starts,
                                       uint32_t* __restrict__ tiles, uint32_t* __restrict__ n_tiles, int e, int bm) {
    __shared__ uint32_t count[MAX_EXPERTS], first_row[MAX_EXPERTS], first_tile[MAX_EXPERTS];
    const uint32_t m = (uint32_t)bm;
    for (int x = threadIdx.x; x < e; x += blockDim.x) count[x] = counts[x];
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t r = 0, t = 0;
        for (int x = 0; x < e; ++x) {
            first_row[x] = r;
            first_tile[x] = t;
            r += count[x];
            t += (count[x] + m - 1) / m;
        }
        *n_tiles = t;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < e; x += blockDim.x) {
        const uint32_t c = count[x], r = first_row[x];
        starts[x] = r;
        for (uint32_t i = 0; i * m < c; ++i) {
            uint32_t* tl = tiles + 3 * (size_t)(first_tile[x] + i);
            tl[0] = x;
            tl[1] = r + i * m;
            tl[2] = min(m, c - i * m);
        }
    }
}

// Each block places PLACE_THREADS * PLACE_PER_THREAD consecutive pairs: ranks within the block
// from shared atomics, then one global atomic per expert reserves the block's rows.
extern "C" __global__ void __launch_bounds__(PLACE_THREADS)
    moe_place(const uint32_t* __restrict__ idx, const uint32_t* __restrict__ starts, uint32_t* __restrict__ cursor,
              uint32_t* __restrict__ tokens, uint32_t* __restrict__ row_of, int t, int k, int e) {
    __shared__ uint32_t hist[MAX_EXPERTS], base[MAX_EXPERTS];
    for (int x = threadIdx.x; x < e; x += blockDim.x) hist[x] = 0;
    __syncthreads();
    const int pairs = t * k;
    const int first = blockIdx.x * PLACE_THREADS * PLACE_PER_THREAD;
    uint32_t rank[PLACE_PER_THREAD];
#pragma unroll
    for (int q = 0; q < PLACE_PER_THREAD; ++q) {
        const int i = first + q * PLACE_THREADS + threadIdx.x;
        if (i < pairs) rank[q] = atomicAdd(&hist[idx[i]], 1u);
    }
    __syncthreads();
    for (int x = threadIdx.x; x < e; x += blockDim.x)
        if (hist[x]) base[x] = starts[x] + atomicAdd(&cursor[x], hist[x]);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < PLACE_PER_THREAD; ++q) {
        const int i = first + q * PLACE_THREADS + threadIdx.x;
        if (i < pairs) {
            const uint32_t r = base[idx[i]] + rank[q];
            const int tok = i / k, j = i % k;
            tokens[r] = tok;
            row_of[(size_t)j * t + tok] = r;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The grouped product.

template <int TM> struct Tile {
    static constexpr int STAGES_ = TM == 128 ? 4 : STAGES;  // slices of K in flight
    static constexpr int XCHUNKS = TM * BK / 8 / THREADS;   // 16-byte copies of x per thread
    static constexpr int MI = TM / 32;                      // 16-row fragments per warp
    template <typename T> static constexpr size_t shared_bytes() {
        return (size_t)STAGES_ * (TM + BN) * (BK + PADK) * sizeof(T);
    }
};

template <typename T, bool SWIGLU, int TM>
__device__ void grouped_mm(const T* __restrict__ x, const uint32_t* __restrict__ gather, const T* __restrict__ w,
                           T* __restrict__ y, const uint32_t* __restrict__ tiles,
                           const uint32_t* __restrict__ n_tiles, int n, int k) {
    using C = Tile<TM>;
    constexpr int STG = C::STAGES_, MI = C::MI, XC = C::XCHUNKS;
    // STG slices of K in flight: cp.async fills one while the tensor cores read another.
    extern __shared__ __align__(16) unsigned char smem[];
    auto xs = reinterpret_cast<T(*)[TM][BK + PADK]>(smem);
    auto ws = reinterpret_cast<T(*)[BN][BK + PADK]>(smem + (size_t)STG * TM * (BK + PADK) * sizeof(T));

    // The blocks of one tile (its column blocks) are consecutive, so they run together and its
    // rows of x are read from memory once, then from L2.
    const int nb = SWIGLU ? BN / 2 : BN;
    const int col_blocks = (n + nb - 1) / nb;
    const int tile = blockIdx.x / col_blocks;
    if (n_tiles != nullptr && tile >= (int)*n_tiles) return;
    const int e = tiles[3 * tile], r0 = tiles[3 * tile + 1], rows = tiles[3 * tile + 2];
    // SwiGLU: 64 output columns, whose gate rows fill ws[0..64) and up rows ws[64..128).
    const int n0 = (blockIdx.x % col_blocks) * nb;
    const T* we = w + (size_t)e * (SWIGLU ? 2 : 1) * n * k;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp / 2) * (TM / 2);
    const int g = lane / 4, t = lane % 4;

    float acc[MI][8][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    // Each thread copies 16-byte chunks: x tile TM x 32 (XC per thread), w tile 128 x 32 = 512
    // chunks (4 per thread), all at the same column of the slice. Rows past the tile (x) or past
    // N (w), and columns past K, are zero.
    const int ccol = (threadIdx.x % 4) * 8;
    const T* xrow[XC];
    const T* wrow[4];
#pragma unroll
    for (int i = 0; i < XC; ++i) {
        const int row = (threadIdx.x + i * THREADS) / 4;
        xrow[i] = row < rows ? x + (size_t)(gather ? gather[r0 + row] : r0 + row) * k : nullptr;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = (threadIdx.x + i * THREADS) / 4;
        const int out = n0 + (SWIGLU ? row % (BN / 2) : row);
        wrow[i] = out < n ? we + (size_t)((SWIGLU && row >= BN / 2 ? n : 0) + out) * k : nullptr;
    }
    auto load = [&](int stage, int k0) {
        const int col = k0 + ccol;
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            const bool ok = xrow[i] != nullptr && col < k;
            cp_async16(&xs[stage][(threadIdx.x + i * THREADS) / 4][ccol], ok ? xrow[i] + col : x, ok);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool ok = wrow[i] != nullptr && col < k;
            cp_async16(&ws[stage][(threadIdx.x + i * THREADS) / 4][ccol], ok ? wrow[i] + col : w, ok);
        }
    };
    // The first ws row of the warp's fragment j (8 rows: output columns, or gate / up rows).
    auto bbase = [&](int j) {
        return SWIGLU ? (j / 4) * (BN / 2) + (warp % 2) * 32 + (j % 4) * 8 : (warp % 2) * 64 + j * 8;
    };
    // ldmatrix addresses: lane l gives row l % 8 of matrix l / 8.
    const int lm = lane / 8, lr = lane % 8;

    const int steps = (k + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STG - 1; ++s) {
        if (s < steps) load(s, s * BK);
        cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<STG - 2>();  // this step's slice has landed (for this thread's copies)
        __syncthreads();           // ... for every thread's, and the slice of step - 1 is read
        const int next = step + STG - 1;
        if (next < steps) load(next % STG, next * BK);
        cp_async_commit();
        const int st = step % STG;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            // A (rows of x): matrices (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8).
            uint32_t af[MI][4];
#pragma unroll
            for (int i = 0; i < MI; ++i)
                ldmatrix_x4(af[i], &xs[st][wm + i * 16 + lr + (lm % 2) * 8][kk + (lm / 2) * 8]);
            // B (rows of w, [n][k]): fragments j and j + 1, each its k 0..7 and 8..15.
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                uint32_t bf[4];
                ldmatrix_x4(bf, &ws[st][bbase(j + lm / 2) + lr][kk + (lm % 2) * 8]);
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    Mma<T>::mma(acc[i][j], af[i], bf[0], bf[1]);
                    Mma<T>::mma(acc[i][j + 1], af[i], bf[2], bf[3]);
                }
            }
        }
    }
    // Store: c0, c1 at (g, 2t..2t+1), c2, c3 at (g + 8, 2t..2t+1) of each 16 x 8 piece.
    const T* as_t = nullptr;  // selects round_to's type
#pragma unroll
    for (int i = 0; i < MI; ++i) {
        const int ra = wm + i * 16 + g, rb = ra + 8;
#pragma unroll
        for (int j = 0; j < (SWIGLU ? 4 : 8); ++j) {
            const int col = n0 + (SWIGLU ? (warp % 2) * 32 : (warp % 2) * 64) + j * 8 + 2 * t;
            if (col >= n) continue;
            float o[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (SWIGLU) {
                    const float gate = round_to(acc[i][j][q], as_t), up = round_to(acc[i][j + 4][q], as_t);
                    o[q] = gate / (1.f + __expf(-gate)) * up;
                } else {
                    o[q] = acc[i][j][q];
                }
            }
            if (ra < rows) *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + ra) * n + col) = Mma<T>::pack(o[0], o[1]);
            if (rb < rows) *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + rb) * n + col) = Mma<T>::pack(o[2], o[3]);
        }
    }
}

// A grouped kernel's entry point: BODY<T, SWIGLU, TM> (grouped_mm or grouped_wg) on BOUND threads.
#define GROUPED(NAME, BODY, BOUND, T, SWIGLU, TM)                                                               \
    extern "C" __global__ void __launch_bounds__(BOUND)                                                         \
        NAME(const T* x, const uint32_t* gather, const T* w, T* y, const uint32_t* tiles, const uint32_t* n_tiles, \
             int n, int k) {                                                                                    \
        BODY<T, SWIGLU, TM>(x, gather, w, y, tiles, n_tiles, n, k);                                             \
    }

// Tiles of 64 rows (3 slices in flight, 46 KiB of shared memory) for batches with few rows per
// expert, of 128 (4 slices, 80 KiB; two blocks per SM) for the rest; dynamic shared memory of
// Tile<TM>::shared_bytes<T>().
GROUPED(grouped_mm_bf16, grouped_mm, THREADS, __nv_bfloat16, false, 64)
GROUPED(grouped_mm_f16, grouped_mm, THREADS, __half, false, 64)
GROUPED(grouped_swiglu_bf16, grouped_mm, THREADS, __nv_bfloat16, true, 64)
GROUPED(grouped_swiglu_f16, grouped_mm, THREADS, __half, true, 64)
GROUPED(grouped_mm128_bf16, grouped_mm, THREADS, __nv_bfloat16, false, 128)
GROUPED(grouped_mm128_f16, grouped_mm, THREADS, __half, false, 128)
GROUPED(grouped_swiglu128_bf16, grouped_mm, THREADS, __nv_bfloat16, true, 128)
GROUPED(grouped_swiglu128_f16, grouped_mm, THREADS, __half, true, 128)

// The same products on Hopper's warpgroup MMA (sm_90a; other GPUs run the kernels above). One
// warpgroup (128 threads) per 64 rows of the tile (TM = 64 or 128), each multiplying its rows by
// the block's 256 rows of w (256 output columns; for SwiGLU 128, whose gate rows fill w's tile rows
// 0..128 and up rows 128..256) with wgmma.m64n256k16: slices of 64 along K, in 128-byte swizzled
// tiles (wgmma.cuh), WG_STAGES of them in shared memory: copies (cp.async, every thread) run two
// slices ahead of the tensor cores, and one slice's products are in flight while the next is
// issued. Every row's reduction over K runs in the same order, 16 at a time, whatever its tile,
// so a row's result does not depend on its batch mates; tiles of 64 and 128 rows give the same
// bits.
#define WG_BN 256
#define WG_BK 64
#define WG_STAGES 4

template <int TM> struct WgTile {
    static constexpr int THREADS_ = 2 * TM;                               // one warpgroup per 64 rows
    static constexpr uint32_t STAGE = (uint32_t)(TM + WG_BN) * WG_BK * 2;  // bytes: x's rows, then w's
    static constexpr size_t SHARED = (size_t)WG_STAGES * STAGE + 1024;    // + room to align to 1024
};

template <typename T, bool SWIGLU, int TM>
__device__ void grouped_wg(const T* __restrict__ x, const uint32_t* __restrict__ gather, const T* __restrict__ w,
                           T* __restrict__ y, const uint32_t* __restrict__ tiles, const uint32_t* __restrict__ n_tiles,
                           int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = WgTile<TM>;
    constexpr int NT = C::THREADS_;
    constexpr int RS = NT / 8;           // rows one pass of copies covers (8 chunks of 16 bytes a row)
    constexpr int AR = TM / RS;          // passes over x's rows: 4
    constexpr int BR = WG_BN / RS;       // passes over w's rows: 8 or 16
    constexpr int NB = SWIGLU ? WG_BN / 2 : WG_BN;
    extern __shared__ unsigned char wg_smem[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(wg_smem);
    const uint32_t base = (raw + 1023u) & ~1023u;

    const int col_blocks = (n + NB - 1) / NB;
    const int tile = blockIdx.x / col_blocks;
    if (n_tiles != nullptr && tile >= (int)*n_tiles) return;
    const int e = tiles[3 * tile], r0 = tiles[3 * tile + 1], rows = tiles[3 * tile + 2];
    const int n0 = (blockIdx.x % col_blocks) * NB;
    const T* we = w + (size_t)e * (SWIGLU ? 2 : 1) * n * k;
    const int tid = threadIdx.x;
    // This thread copies chunk c (8 elements) of rows r, r + RS, ...; all in the same swizzle row
    // class (RS is a multiple of 8), so at the same swizzled offset within their rows.
    const int c = tid % 8, r = tid / 8;
    const uint32_t sw = wg_swizzle(r, c);
    const T* xrow[AR];
#pragma unroll
    for (int i = 0; i < AR; ++i) {
        const int row = r + i * RS;
        xrow[i] = row < rows ? x + (size_t)(gather ? gather[r0 + row] : r0 + row) * k : nullptr;
    }
    // w's tile row r + i RS: output column n0 + (r + i RS) % NB; for SwiGLU, rows NB.. are the up
    // rows, n further on in the expert's weight.
    const T* wfirst = we + (size_t)(n0 + r) * k;
    auto wvalid = [&](int i) { return n0 + r + (i % (NB / RS)) * RS < n; };
    auto woff = [&](int i) { return (size_t)(i * RS + (SWIGLU && i >= BR / 2 ? n - NB : 0)) * k; };

    auto load = [&](int stage, int k0) {
        const int col = k0 + c * 8;
        const bool in_k = col < k;
        const uint32_t sa = base + stage * C::STAGE, sb = sa + TM * WG_BK * 2;
#pragma unroll
        for (int i = 0; i < AR; ++i) {
            const bool ok = xrow[i] != nullptr && in_k;
            cp_async16_to(sa + (uint32_t)(i * RS * 128) + sw, ok ? xrow[i] + col : x, ok);
        }
#pragma unroll
        for (int i = 0; i < BR; ++i) {
            const bool ok = in_k && wvalid(i);
            cp_async16_to(sb + (uint32_t)(i * RS * 128) + sw, ok ? wfirst + woff(i) + col : w, ok);
        }
    };

    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    const int wg = tid / 128;
    const int steps = (k + WG_BK - 1) / WG_BK;
#pragma unroll
    for (int s = 0; s < WG_STAGES - 2; ++s) {
        if (s < steps) load(s, s * WG_BK);
        cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<WG_STAGES - 3>();  // this step's slice has landed (this thread's copies)
        wg_fence_shared();
        // Every thread's copies have landed, and every warpgroup has finished the products of
        // step - 2 (the wait below), whose slice the copies below overwrite.
        __syncthreads();
        const int next = step + WG_STAGES - 2;
        if (next < steps) load(next % WG_STAGES, next * WG_BK);
        cp_async_commit();
        const uint32_t sa = base + (step % WG_STAGES) * C::STAGE;
        const uint32_t a = sa + wg * 64 * 128, b = sa + TM * WG_BK * 2;
        wg_fence_acc(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; ++kk) Wgmma<T>::mma(acc, wg_desc(a + kk * 32), wg_desc(b + kk * 32));
        wg_commit();
        wg_wait<1>();
        wg_fence_acc(acc);
    }
    wg_wait<0>();
    wg_fence_acc(acc);

    const int lane = tid % 32, g = lane / 4, t = lane % 4;
    const int ra = wg * 64 + (tid % 128) / 32 * 16 + g, rb = ra + 8;
    const T* as_t = nullptr;  // selects round_to's type
#pragma unroll
    for (int j = 0; j < NB / 8; ++j) {
        const int col = n0 + j * 8 + 2 * t;
        if (col >= n) continue;
        float o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (SWIGLU) {
                const float gate = round_to(acc[4 * j + q], as_t), up = round_to(acc[4 * (j + NB / 8) + q], as_t);
                o[q] = gate / (1.f + __expf(-gate)) * up;
            } else {
                o[q] = acc[4 * j + q];
            }
        }
        if (ra < rows) *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + ra) * n + col) = Mma<T>::pack(o[0], o[1]);
        if (rb < rows) *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + rb) * n + col) = Mma<T>::pack(o[2], o[3]);
    }
#else
    __trap();  // launched only on sm_90 from the sm_90a build (engine/cuda/moe.rs)
#endif
}

// Dynamic shared memory of WgTile<TM>::SHARED; 2 TM threads.
GROUPED(grouped_wg_mm64_bf16, grouped_wg, 128, __nv_bfloat16, false, 64)
GROUPED(grouped_wg_mm64_f16, grouped_wg, 128, __half, false, 64)
GROUPED(grouped_wg_swiglu64_bf16, grouped_wg, 128, __nv_bfloat16, true, 64)
GROUPED(grouped_wg_swiglu64_f16, grouped_wg, 128, __half, true, 64)
GROUPED(grouped_wg_mm128_bf16, grouped_wg, 256, __nv_bfloat16, false, 128)
GROUPED(grouped_wg_mm128_f16, grouped_wg, 256, __half, false, 128)
GROUPED(grouped_wg_swiglu128_bf16, grouped_wg, 256, __nv_bfloat16, true, 128)
GROUPED(grouped_wg_swiglu128_f16, grouped_wg, 256, __half, true, 128)

// ---------------------------------------------------------------------------------------------
// The grouped product of FP8 experts (e4m3, W8A8 with block scales, as Qwen's FP8 releases
// define it): x [R, K] e4m3 bytes, each row quantised per group of 128 along K with its scale in
// xs[g * xs_ld + row] (the layout fp8_quantise writes); w [E, N', K] e4m3 (N' = 2N for SwiGLU,
// gate rows first) with block scales ws[(e * N'/128 + row/128) * ws_ld + g]. For the rows r of
// expert e:
//     y[r, c] = sum over groups g in order of (sum_{k in g} x[src(r), k] w_e[c, k]) * xs[g, src(r)] * ws[e, c/128, g]
// each group's products summed in f32 by mma.sync.m16n8k32 (e4m3), then scaled and added in f32.
// The tiles, copies and fragments are grouped_mm's with two e4m3 bytes carried as one 16-bit
// element (a 16 x 32-byte A fragment and a 32-byte x 8 B fragment are laid out in registers as
// m16n8k16's 16-bit ones). K and N must be multiples of 128, so each block's output rows lie in
// one scale block (SwiGLU: its 64 gate rows in one, its 64 up rows in one). sm_89 and newer.

__device__ __forceinline__ void mma_e4m3(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

template <typename T, bool SWIGLU>
__device__ void grouped_fp8(const uint8_t* __restrict__ x, const float* __restrict__ xs, int xs_ld,
                            const uint32_t* __restrict__ gather, const uint8_t* __restrict__ w,
                            const float* __restrict__ ws, int ws_ld, T* __restrict__ y,
                            const uint32_t* __restrict__ tiles, const uint32_t* __restrict__ n_tiles, int n, int k) {
    __shared__ __align__(16) uint16_t xsm[STAGES][BM][BK + PADK];
    __shared__ __align__(16) uint16_t wsm[STAGES][BN][BK + PADK];

    // The blocks of one tile are consecutive (as in grouped_mm).
    const int nb = SWIGLU ? BN / 2 : BN;
    const int col_blocks = (n + nb - 1) / nb;
    const int tile = blockIdx.x / col_blocks;
    if (n_tiles != nullptr && tile >= (int)*n_tiles) return;
    const int e = tiles[3 * tile], r0 = tiles[3 * tile + 1], rows = tiles[3 * tile + 2];
    const int n0 = (blockIdx.x % col_blocks) * nb;
    const int wn = SWIGLU ? 2 * n : n;
    const int kh = k / 2;  // K in byte pairs
    const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
    const uint16_t* we = reinterpret_cast<const uint16_t*>(w + (size_t)e * wn * k);
    const float* wse = ws + (size_t)e * (wn / 128) * ws_ld;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp / 2) * 32;
    const int g = lane / 4, t = lane % 4;

    float acc[2][8][4], part[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = part[i][j][q] = 0.f;

    const int ccol = (threadIdx.x % 4) * 8;
    const uint16_t* xrow[2];
    const uint16_t* wrow[4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = (threadIdx.x + i * THREADS) / 4;
        xrow[i] = row < rows ? x16 + (size_t)(gather ? gather[r0 + row] : r0 + row) * kh : nullptr;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = (threadIdx.x + i * THREADS) / 4;
        const int out = n0 + (SWIGLU ? row % (BN / 2) : row);
        wrow[i] = out < n ? we + (size_t)((SWIGLU && row >= BN / 2 ? n : 0) + out) * kh : nullptr;
    }
    // The activation-scale rows of this thread's accumulators (rows wm + 16 i + g and + 8), -1 past the tile.
    int src[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = wm + i * 16 + g + 8 * h;
            src[i][h] = row < rows ? (int)(gather ? gather[r0 + row] : r0 + row) : -1;
        }
    // The weight-scale rows of this block's output rows: the gate's (or the only) block, the up's.
    const int sb0 = n0 / 128, sb1 = SWIGLU ? (n + n0) / 128 : sb0;
    auto load = [&](int stage, int k0) {
        const int col = k0 + ccol;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const bool ok = xrow[i] != nullptr && col < kh;
            cp_async16(&xsm[stage][(threadIdx.x + i * THREADS) / 4][ccol], ok ? xrow[i] + col : x16, ok);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool ok = wrow[i] != nullptr && col < kh;
            cp_async16(&wsm[stage][(threadIdx.x + i * THREADS) / 4][ccol], ok ? wrow[i] + col : we, ok);
        }
    };
    auto bbase = [&](int j) {
        return SWIGLU ? (j / 4) * (BN / 2) + (warp % 2) * 32 + (j % 4) * 8 : (warp % 2) * 64 + j * 8;
    };
    const int lm = lane / 8, lr = lane % 8;

    const int steps = kh / BK;          // 64 bytes of K per step
    const int per_group = 128 / (2 * BK);  // steps per group of 128
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s * BK);
        cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int next = step + STAGES - 1;
        if (next < steps) load(next % STAGES, next * BK);
        cp_async_commit();
        const int st = step % STAGES;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                ldmatrix_x4(af[i], &xsm[st][wm + i * 16 + lr + (lm % 2) * 8][kk + (lm / 2) * 8]);
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                uint32_t bf[4];
                ldmatrix_x4(bf, &wsm[st][bbase(j + lm / 2) + lr][kk + (lm % 2) * 8]);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mma_e4m3(part[i][j], af[i], bf[0], bf[1]);
                    mma_e4m3(part[i][j + 1], af[i], bf[2], bf[3]);
                }
            }
        }
        if (step % per_group == per_group - 1) {
            // The group is complete: its sums scaled by both scales, added in f32.
            const int grp = step / per_group;
            const float w0 = wse[sb0 * ws_ld + grp], w1 = wse[sb1 * ws_ld + grp];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float a0 = src[i][0] >= 0 ? xs[(size_t)grp * xs_ld + src[i][0]] : 0.f;
                const float a1 = src[i][1] >= 0 ? xs[(size_t)grp * xs_ld + src[i][1]] : 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float sw = (SWIGLU && j >= 4) ? w1 : w0;
                    acc[i][j][0] += part[i][j][0] * (a0 * sw);
                    acc[i][j][1] += part[i][j][1] * (a0 * sw);
                    acc[i][j][2] += part[i][j][2] * (a1 * sw);
                    acc[i][j][3] += part[i][j][3] * (a1 * sw);
                    part[i][j][0] = part[i][j][1] = part[i][j][2] = part[i][j][3] = 0.f;
                }
            }
        }
    }
    const T* as_t = nullptr;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int ra = wm + i * 16 + g, rb = ra + 8;
#pragma unroll
        for (int j = 0; j < (SWIGLU ? 4 : 8); ++j) {
            const int col = n0 + (SWIGLU ? (warp % 2) * 32 : (warp % 2) * 64) + j * 8 + 2 * t;
            if (col >= n) continue;
            float o[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (SWIGLU) {
                    const float gate = round_to(acc[i][j][q], as_t), up = round_to(acc[i][j + 4][q], as_t);
                    o[q] = gate / (1.f + __expf(-gate)) * up;
                } else {
                    o[q] = acc[i][j][q];
                }
            }
            if (ra < rows) *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + ra) * n + col) = Mma<T>::pack(o[0], o[1]);
            if (rb < rows) *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + rb) * n + col) = Mma<T>::pack(o[2], o[3]);
        }
    }
}

#define GROUPED_FP8(NAME, T, SWIGLU)                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                       \
        NAME(const uint8_t* x, const float* xs, int xs_ld, const uint32_t* gather, const uint8_t* w,             \
             const float* ws, int ws_ld, T* y, const uint32_t* tiles, const uint32_t* n_tiles, int n, int k) {   \
        grouped_fp8<T, SWIGLU>(x, xs, xs_ld, gather, w, ws, ws_ld, y, tiles, n_tiles, n, k);                    \
    }
GROUPED_FP8(grouped_fp8_mm_bf16, __nv_bfloat16, false)
GROUPED_FP8(grouped_fp8_mm_f16, __half, false)
GROUPED_FP8(grouped_fp8_swiglu_bf16, __nv_bfloat16, true)
GROUPED_FP8(grouped_fp8_swiglu_f16, __half, true)

// ---------------------------------------------------------------------------------------------
// The weighted sum over the slots (and the shared expert): one block per token, 16-byte vectors.

template <typename T>
__device__ void moe_combine(const T* __restrict__ ys, const uint32_t* __restrict__ row_of,
                            const float* __restrict__ weight, const T* __restrict__ shared, const T* __restrict__ x,
                            const T* __restrict__ gate, T* __restrict__ out, int t, int h, int k) {
    constexpr int V = 16 / sizeof(T);
    const int tok = blockIdx.x;
    float sig = 0.f;
    if (shared != nullptr) {
        float d = 0.f;
        for (int c = threadIdx.x; c < h; c += blockDim.x) d += to_f32(x[(size_t)tok * h + c]) * to_f32(gate[c]);
        d = block_sum(d);
        sig = 1.f / (1.f + __expf(-d));
    }
    for (int c = threadIdx.x * V; c < h; c += blockDim.x * V) {
        float acc[V];
#pragma unroll
        for (int q = 0; q < V; ++q) acc[q] = 0.f;
        for (int j = 0; j < k; ++j) {
            const float wj = weight[(size_t)tok * k + j];
            const uint4 raw = *reinterpret_cast<const uint4*>(ys + (size_t)row_of[(size_t)j * t + tok] * h + c);
            const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int q = 0; q < V; ++q) acc[q] += wj * to_f32(v[q]);
        }
        if (shared != nullptr) {
            const uint4 raw = *reinterpret_cast<const uint4*>(shared + (size_t)tok * h + c);
            const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int q = 0; q < V; ++q) acc[q] += to_f32(v[q]) * sig;
        }
        uint4 o;
        T* ov = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int q = 0; q < V; ++q) ov[q] = from_f32<T>(acc[q]);
        *reinterpret_cast<uint4*>(out + (size_t)tok * h + c) = o;
    }
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
    moe_combine_bf16(const __nv_bfloat16* ys, const uint32_t* row_of, const float* weight, const __nv_bfloat16* shared,
                     const __nv_bfloat16* x, const __nv_bfloat16* gate, __nv_bfloat16* out, int t, int h, int k) {
    moe_combine(ys, row_of, weight, shared, x, gate, out, t, h, k);
}
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
    moe_combine_f16(const __half* ys, const uint32_t* row_of, const float* weight, const __half* shared,
                    const __half* x, const __half* gate, __half* out, int t, int h, int k) {
    moe_combine(ys, row_of, weight, shared, x, gate, out, t, h, k);
}
