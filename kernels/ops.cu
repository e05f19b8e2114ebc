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

// The fused q/k/v projection's output split into contiguous q, k and v (and the attention output
// gate, where q_proj holds per head the query then its gate), with the per-head RMSNorm of q and
// k where the model has one (f32 weights: `w` or the zero-centred `1 + w`) and the rotary
// embedding on the first `rot` dims of each q and k head (the halves rotated against each other),
// all in f32 and rounded once. `norm` 0: no norm (`qn`, `kn` are then not read).
//
// `qkv` is [T, W]; `out` holds, one after the other, q [T, nq, hd], k [T, nkv, hd], v [T, nkv, hd]
// and, if gated, the gate [T, nq, hd]. One block per token: its threads first compute the
// token's cos/sin for the rot/2 frequencies into shared memory (from its position and the f32
// inverse frequencies), then each warp takes head rows in turn. Lane l holds dims l, l + 32, ..
// (E = hd / 32 of them), so a rotary pair (i, i + rot/2) stays in one lane: rot/2 must be a
// multiple of 32 (or rot 0), rot/2 at most 128.
template <typename T, int E>
__device__ void qkv_rope(const T* __restrict__ qkv, const uint32_t* __restrict__ pos, const float* __restrict__ inv_freq,
                         const float* __restrict__ qn, const float* __restrict__ kn, int norm, T* __restrict__ out,
                         int tokens, int nq, int nkv, int rot, int gated, float eps) {
    constexpr int hd = 32 * E;
    __shared__ float cs[128], sn[128];
    const int tok = blockIdx.x;
    const int half = rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) sincosf((float)pos[tok] * inv_freq[i], &sn[i], &cs[i]);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const size_t qw = (size_t)(gated ? 2 : 1) * nq * hd;
    const size_t W = qw + 2 * (size_t)nkv * hd;
    const T* row_in = qkv + (size_t)tok * W;
    T* q_out = out;
    T* k_out = q_out + (size_t)tokens * nq * hd;
    T* v_out = k_out + (size_t)tokens * nkv * hd;
    T* g_out = v_out + (size_t)tokens * nkv * hd;
    for (int r = warp; r < nq + 2 * nkv; r += warps) {
        const T* src;
        T* dst;
        const float* w = nullptr;
        bool rope = true;
        if (r < nq) {
            src = row_in + (size_t)r * (gated ? 2 : 1) * hd;
            dst = q_out + ((size_t)tok * nq + r) * hd;
            w = norm ? qn : nullptr;
            if (gated) {
                T* g = g_out + ((size_t)tok * nq + r) * hd;
#pragma unroll
                for (int j = 0; j < E; ++j) g[lane + 32 * j] = src[hd + lane + 32 * j];
            }
        } else if (r < nq + nkv) {
            src = row_in + qw + (size_t)(r - nq) * hd;
            dst = k_out + ((size_t)tok * nkv + (r - nq)) * hd;
            w = norm ? kn : nullptr;
        } else {
            src = row_in + qw + (size_t)nkv * hd + (size_t)(r - nq - nkv) * hd;
            dst = v_out + ((size_t)tok * nkv + (r - nq - nkv)) * hd;
            rope = false;
        }
        float x[E];
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = to_f32(src[lane + 32 * j]);
        if (w != nullptr) {
            float ss = 0.f;
#pragma unroll
            for (int j = 0; j < E; ++j) ss += x[j] * x[j];
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
            const float inv = rsqrtf(ss / hd + eps);
#pragma unroll
            for (int j = 0; j < E; ++j) x[j] = x[j] * inv * w[lane + 32 * j];
        }
        if (rope) {
            const int hj = half / 32;  // the partner of element j is element j + hj
#pragma unroll
            for (int j = 0; j < E; ++j) {
                if (j < hj) {
                    const float c = cs[lane + 32 * j], s = sn[lane + 32 * j];
                    const float a = x[j], b = x[j + hj];
                    x[j] = a * c - b * s;
                    x[j + hj] = b * c + a * s;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < E; ++j) dst[lane + 32 * j] = from_f32<T>(x[j]);
    }
}

#define QKV_ROPE(NAME, T, E)                                                                                       \
    extern "C" __global__ void NAME(const T* qkv, const uint32_t* pos, const float* inv_freq, const float* qn,     \
                                    const float* kn, int norm, T* out, int tokens, int nq, int nkv, int rot,      \
                                    int gated, float eps) {                                                        \
        qkv_rope<T, E>(qkv, pos, inv_freq, qn, kn, norm, out, tokens, nq, nkv, rot, gated, eps);                 \
    }
QKV_ROPE(qkv_rope_bf16_d64, __nv_bfloat16, 2)
QKV_ROPE(qkv_rope_bf16_d128, __nv_bfloat16, 4)
QKV_ROPE(qkv_rope_bf16_d256, __nv_bfloat16, 8)
QKV_ROPE(qkv_rope_f16_d64, __half, 2)
QKV_ROPE(qkv_rope_f16_d128, __half, 4)
QKV_ROPE(qkv_rope_f16_d256, __half, 8)
