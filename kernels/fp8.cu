// Block-wise FP8 (e4m3) projections, W8A8 with dynamic activation scales, as Qwen's FP8 releases
// define them: each input row is quantised per group of 128 along K with scale
// s = max(amax, 1e-10) / 448 and q = e4m3(clamp(x / s, -448, 448)) (round to nearest even),
// exactly as the CPU path (`engine::layers::fp8`) does it, so both quantise every input to the
// same bytes and scales.
//
// fp8_quantise_T: x [m, k] -> q [m_pad, k] e4m3 bytes and scales [k / 128, m_pad] f32 (one
//   column of m_pad scales per group: the layout cuBLASLt's 1 x 128 block scaling reads). Rows
//   m..m_pad are zeros with the scale of an all-zero group. One warp per (row, group).
// fp8_silu_mul_quantise_T: gu [m, 2 * inter] (the gate projection, then the up projection) ->
//   silu(gate) * up rounded to T, quantised as fp8_quantise_T would quantise it, in one pass.
// fp8_qdq_T: x [m, k] -> the same quantisation dequantised, q * s, rounded to T (for the path
//   that multiplies dequantised weights).
// fp8_dequantise_T: weight bytes [n, k] with block scales [ceil(n/128), ld] -> T [n, k], each
//   element e4m3(byte) * scale rounded once.
//
// Built with --use_fast_math: the divisions that decide a quantised value are written as
// __fdiv_rn, which is IEEE division whatever the flags, so the bytes equal the CPU path's.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "convert.cuh"

#define FP8_GROUP 128
#define FP8_MAX 448.f
#define FP8_MIN_AMAX 1e-10f

__device__ __forceinline__ uint8_t fp8_encode(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float fp8_decode(uint8_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

// The scale of a group of 128 values held four per lane of a warp (the same in every lane), and
// the bytes this lane's four quantise to.
__device__ __forceinline__ float fp8_group_of(const float v[4], uint8_t q[4]) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    const float s = __fdiv_rn(fmaxf(amax, FP8_MIN_AMAX), FP8_MAX);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        // fmaxf/fminf return the number where one operand is NaN: a NaN is encoded as NaN
        // (0x7F), so it reaches the product instead of becoming -448.
        const float x = __fdiv_rn(v[j], s);
        q[j] = isnan(x) ? (uint8_t)0x7F : fp8_encode(fminf(fmaxf(x, -FP8_MAX), FP8_MAX));
    }
    return s;
}

// The four values of this lane (elements 4 * lane .. 4 * lane + 3 of group g of row r), their
// group's scale (the same in every lane), and the bytes they quantise to.
template <typename T>
__device__ __forceinline__ float fp8_group(const T* __restrict__ x, size_t m, size_t k, size_t r, size_t g, int lane,
                                           uint8_t q[4]) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (r < m) {
        const T* p = x + r * k + g * FP8_GROUP + 4 * lane;
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = to_f32(p[j]);
    }
    return fp8_group_of(v, q);
}

// Writes a warp's group: four bytes per lane, and the scale from lane 0.
__device__ __forceinline__ void fp8_store(uint8_t* __restrict__ q, float* __restrict__ scales, size_t k, size_t m_pad,
                                          size_t r, size_t g, int lane, const uint8_t b[4], float s) {
    const uint32_t packed = (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
    *reinterpret_cast<uint32_t*>(q + r * k + g * FP8_GROUP + 4 * lane) = packed;
    if (lane == 0) scales[g * m_pad + r] = s;
}

template <typename T>
__device__ void fp8_quantise(const T* __restrict__ x, size_t m, size_t m_pad, size_t k, uint8_t* __restrict__ q,
                             float* __restrict__ scales) {
    const size_t groups = k / FP8_GROUP;
    const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= m_pad * groups) return;  // whole warps: blockDim is a multiple of 32
    const size_t r = warp / groups, g = warp % groups;
    uint8_t b[4];
    const float s = fp8_group(x, m, k, r, g, lane, b);
    fp8_store(q, scales, k, m_pad, r, g, lane, b, s);
}

// SiLU(gate) * up of a row [gate (inter) | up (inter)], rounded to T exactly as ops.cu's silu_mul
// rounds it (same expression, same flags), then quantised as fp8_quantise quantises that T
// tensor: so the bytes and scales equal those of silu_mul followed by fp8_quantise, without the
// T activation ever written.
template <typename T>
__device__ void fp8_silu_mul_quantise(const T* __restrict__ gu, size_t m, size_t m_pad, size_t inter,
                                      uint8_t* __restrict__ q, float* __restrict__ scales) {
    const size_t groups = inter / FP8_GROUP;
    const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= m_pad * groups) return;
    const size_t r = warp / groups, g = warp % groups;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (r < m) {
        const T* gp = gu + r * 2 * inter + g * FP8_GROUP + 4 * lane;
        const T* up = gp + inter;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float x = to_f32(gp[j]);
            v[j] = to_f32(from_f32<T>(x / (1.f + __expf(-x)) * to_f32(up[j])));
        }
    }
    uint8_t b[4];
    const float s = fp8_group_of(v, b);
    fp8_store(q, scales, inter, m_pad, r, g, lane, b, s);
}

template <typename T>
__device__ void fp8_qdq(const T* __restrict__ x, size_t m, size_t k, T* __restrict__ y) {
    const size_t groups = k / FP8_GROUP;
    const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= m * groups) return;
    const size_t r = warp / groups, g = warp % groups;
    uint8_t b[4];
    const float s = fp8_group(x, m, k, r, g, lane, b);
    T* p = y + r * k + g * FP8_GROUP + 4 * lane;
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = from_f32<T>(fp8_decode(b[j]) * s);
}

template <typename T>
__device__ void fp8_dequantise(const uint8_t* __restrict__ w, const float* __restrict__ scale, size_t n, size_t k,
                               size_t ld, T* __restrict__ out) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n * k; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / k, c = i % k;
        out[i] = from_f32<T>(fp8_decode(w[i]) * scale[(r / FP8_GROUP) * ld + c / FP8_GROUP]);
    }
}

#define FP8_KERNELS(SUFFIX, T)                                                                                       \
    extern "C" __global__ void fp8_quantise_##SUFFIX(const T* x, size_t m, size_t m_pad, size_t k, uint8_t* q,       \
                                                     float* scales) {                                                \
        fp8_quantise(x, m, m_pad, k, q, scales);                                                                     \
    }                                                                                                                \
    extern "C" __global__ void fp8_silu_mul_quantise_##SUFFIX(const T* gu, size_t m, size_t m_pad, size_t inter,   \
                                                              uint8_t* q, float* scales) {                           \
        fp8_silu_mul_quantise(gu, m, m_pad, inter, q, scales);                                                       \
    }                                                                                                                \
    extern "C" __global__ void fp8_qdq_##SUFFIX(const T* x, size_t m, size_t k, T* y) { fp8_qdq(x, m, k, y); }       \
    extern "C" __global__ void fp8_dequantise_##SUFFIX(const uint8_t* w, const float* scale, size_t n, size_t k,    \
                                                       size_t ld, T* out) {                                          \
        fp8_dequantise(w, scale, n, k, ld, out);                                                                     \
    }

FP8_KERNELS(bf16, __nv_bfloat16)
FP8_KERNELS(f16, __half)
FP8_KERNELS(f32, float)
