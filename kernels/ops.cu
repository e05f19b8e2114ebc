// Fused element-wise kernel for the CUDA path.
//
// silu_mul: `gu` is [rows, 2 * inter] holding the gate projection in its first `inter` columns
// and the up projection in the rest (one matmul makes both); out[r, c] = silu(g) * u, computed in
// f32 and rounded once. Eight elements per thread (16-byte loads); `inter` must be a multiple of 8.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "convert.cuh"
#include "reduce.cuh"

template <typename T>
__device__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, size_t rows, size_t inter) {
    constexpr int V = 16 / sizeof(T);  // elements per 16-byte vector
    const size_t vecs = rows * inter / V;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vecs; i += (size_t)gridDim.x * blockDim.x) {
        const size_t e = i * V;
        const size_t r = e / inter, c = e % inter;
        const uint4 gv = *reinterpret_cast<const uint4*>(gu + r * 2 * inter + c);
        const uint4 uv = *reinterpret_cast<const uint4*>(gu + r * 2 * inter + inter + c);
        const T* g = reinterpret_cast<const T*>(&gv);
        const T* u = reinterpret_cast<const T*>(&uv);
        uint4 ov;
        T* o = reinterpret_cast<T*>(&ov);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float x = to_f32(g[j]);
            o[j] = from_f32<T>(x / (1.f + __expf(-x)) * to_f32(u[j]));
        }
        *reinterpret_cast<uint4*>(out + e) = ov;
    }
}

extern "C" __global__ void silu_mul_bf16(const __nv_bfloat16* gu, __nv_bfloat16* out, size_t rows, size_t inter) {
    silu_mul(gu, out, rows, inter);
}
extern "C" __global__ void silu_mul_f16(const __half* gu, __half* out, size_t rows, size_t inter) {
    silu_mul(gu, out, rows, inter);
}
extern "C" __global__ void silu_mul_f32(const float* gu, float* out, size_t rows, size_t inter) {
    silu_mul(gu, out, rows, inter);
}

// The residual stream in f32 (16-bit models on CUDA): out = x + y with x f32 and y the
// sublayer's 16-bit output; four elements per thread when n allows.
template <typename T>
__device__ void add_f32(const float* __restrict__ x, const T* __restrict__ y, float* __restrict__ out, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = x[i] + to_f32(y[i]);
    }
}

extern "C" __global__ void add_f32_bf16(const float* x, const __nv_bfloat16* y, float* out, size_t n) {
    add_f32(x, y, out, n);
}
extern "C" __global__ void add_f32_f16(const float* x, const __half* y, float* out, size_t n) { add_f32(x, y, out, n); }

// RMSNorm of an f32 row with a 16-bit weight, written in the weight's type: out = x / rms(x) * w,
// all in f32 and rounded once. One block per row.
template <typename T>
__device__ void rms_norm_f32(const float* __restrict__ x, const T* __restrict__ w, T* __restrict__ out, int cols,
                             float eps) {
    const float* xr = x + (size_t)blockIdx.x * cols;
    T* orow = out + (size_t)blockIdx.x * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    const float inv = rsqrtf(block_sum(ss) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = from_f32<T>(xr[c] * inv * to_f32(w[c]));
}

extern "C" __global__ void rms_norm_f32_bf16(const float* x, const __nv_bfloat16* w, __nv_bfloat16* out, int cols,
                                             float eps) {
    rms_norm_f32(x, w, out, cols, eps);
}
extern "C" __global__ void rms_norm_f32_f16(const float* x, const __half* w, __half* out, int cols, float eps) {
    rms_norm_f32(x, w, out, cols, eps);
}

// f32 -> fp8 (E4M3, finite only): round to nearest even, saturating at +-448 (NaN stays NaN).
// What answers in fp8 are written with, after each value is scaled by 448 / amax of its row.
#include <cuda_fp8.h>

extern "C" __global__ void f32_to_fp8_e4m3(const float* __restrict__ x, uint8_t* __restrict__ out, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
    }
}
