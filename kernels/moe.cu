// Grouped matrix product for the experts of a mixture-of-experts layer (sm_80 and newer): the
// rows of x are sorted by expert, and each block of rows is multiplied by its own expert's
// weight, all experts in one launch:  y[r, :] = x[r, :] W_e^T  for the rows r of expert e.
//
// x: [R, K] row-major; w: [E, N, K] (each expert's weight as stored, [out, in]); y: [R, N].
// tiles: [n_tiles][3] = (expert, first row, rows <= BM), made by the host from the per-expert
// counts. Grid (n_tiles, N / BN); 4 warps, 2 x 2, each warp a 32 x 64 piece of the 64 x 128
// block tile, mma.sync.m16n8k16 with f32 accumulation, rounded once to the output type. The
// reduction over K runs in the same order for every row, so a row's result does not depend on
// which other rows share its tile.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mma.cuh"

#define BM 64
#define BN 128
#define BK 32
#define PADK 8
#define THREADS 128

template <typename T>
__device__ void grouped_mm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                           const uint32_t* __restrict__ tiles, int n, int k) {
    // Two stages: the next K slice is loaded into registers while the current one is multiplied.
    __shared__ __align__(16) T xs[BM][BK + PADK];
    __shared__ __align__(16) T ws[BN][BK + PADK];

    const int tile = blockIdx.x;
    const int e = tiles[3 * tile], r0 = tiles[3 * tile + 1], rows = tiles[3 * tile + 2];
    const int n0 = blockIdx.y * BN;
    const T* we = w + (size_t)e * n * k;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 64;  // the warp's piece of the tile
    const int g = lane / 4, t = lane % 4;

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    // Each thread loads 16-byte chunks: x tile 64 x 32 = 256 chunks (2 per thread), w tile
    // 128 x 32 = 512 chunks (4 per thread). Rows past the tile (x) or past N (w) are zero.
    uint4 xr[2], wr[4];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = threadIdx.x + i * THREADS, row = c / 4, col = (c % 4) * 8;
            xr[i] = row < rows ? *reinterpret_cast<const uint4*>(x + (size_t)(r0 + row) * k + k0 + col)
                               : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int c = threadIdx.x + i * THREADS, row = c / 4, col = (c % 4) * 8;
            wr[i] = n0 + row < n ? *reinterpret_cast<const uint4*>(we + (size_t)(n0 + row) * k + k0 + col)
                                 : make_uint4(0, 0, 0, 0);
        }
    };
    fetch(0);
    for (int k0 = 0; k0 < k; k0 += BK) {
        __syncthreads();  // the previous slice's readers are done
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = threadIdx.x + i * THREADS;
            *reinterpret_cast<uint4*>(&xs[c / 4][(c % 4) * 8]) = xr[i];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int c = threadIdx.x + i * THREADS;
            *reinterpret_cast<uint4*>(&ws[c / 4][(c % 4) * 8]) = wr[i];
        }
        __syncthreads();
        if (k0 + BK < k) fetch(k0 + BK);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const T* a = &xs[wm + i * 16 + g][kk + 2 * t];
                af[i][0] = *reinterpret_cast<const uint32_t*>(a);
                af[i][1] = *reinterpret_cast<const uint32_t*>(a + 8 * (BK + PADK));
                af[i][2] = *reinterpret_cast<const uint32_t*>(a + 8);
                af[i][3] = *reinterpret_cast<const uint32_t*>(a + 8 * (BK + PADK) + 8);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const T* b = &ws[wn + j * 8 + g][kk + 2 * t];
                const uint32_t b0 = *reinterpret_cast<const uint32_t*>(b);
                const uint32_t b1 = *reinterpret_cast<const uint32_t*>(b + 8);
#pragma unroll
                for (int i = 0; i < 2; ++i) Mma<T>::mma(acc[i][j], af[i], b0, b1);
            }
        }
    }
    // Store: c0, c1 at (g, 2t..2t+1), c2, c3 at (g + 8, 2t..2t+1) of each 16 x 8 piece.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int ra = wm + i * 16 + g, rb = ra + 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = n0 + wn + j * 8 + 2 * t;
            if (col >= n) continue;
            if (ra < rows)
                *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + ra) * n + col) = Mma<T>::pack(acc[i][j][0], acc[i][j][1]);
            if (rb < rows)
                *reinterpret_cast<uint32_t*>(y + (size_t)(r0 + rb) * n + col) = Mma<T>::pack(acc[i][j][2], acc[i][j][3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
    grouped_mm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, const uint32_t* tiles, int n,
                    int k) {
    grouped_mm<__nv_bfloat16>(x, w, y, tiles, n, k);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    grouped_mm_f16(const __half* x, const __half* w, __half* y, const uint32_t* tiles, int n, int k) {
    grouped_mm<__half>(x, w, y, tiles, n, k);
}
