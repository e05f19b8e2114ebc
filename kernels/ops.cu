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

// Four consecutive 16-bit values as f32 (one 8-byte load), and back.
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = to_f32(h[j]);
}

__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
    const float4 raw = *reinterpret_cast<const float4*>(p);
    v[0] = raw.x;
    v[1] = raw.y;
    v[2] = raw.z;
    v[3] = raw.w;
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4]) {
    uint2 raw;
    T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = from_f32<T>(v[j]);
    *reinterpret_cast<uint2*>(p) = raw;
}

__device__ __forceinline__ bool aligned(const void* p, int bytes) { return (uintptr_t)p % bytes == 0; }

// RMSNorm of an f32 row with a 16-bit weight, written in the weight's type: out = x / rms(x) * w,
// all in f32 and rounded once; with ADD, the residual add first: x_out = x + y (y the sublayer's
// 16-bit output) is written and normalised, in one pass over x and y (x_out is read back from
// the thread's own writes, out of cache). One block per row. A row of a multiple of 4 columns
// whose pointers allow it goes 4 columns at a time (thread t takes columns 4t.., 4(t + blockDim)..),
// another one at a time (t, t + blockDim, ..); the sum of squares is taken in the same order
// with or without ADD, so the fused kernel is bitwise add_f32 then this one. W, the weight's
// type, is T or f32 (the hybrids' zero-centred norms keep 1 + w in f32).
template <typename T, typename W, bool ADD>
__device__ void norm_row(const float* __restrict__ x, const T* __restrict__ y, const W* __restrict__ w,
                         float* __restrict__ x_out, T* __restrict__ out, int cols, float eps) {
    const size_t base = (size_t)blockIdx.x * cols;
    const float* xr = x + base;
    T* orow = out + base;
    const bool vec = cols % 4 == 0 && aligned(xr, 16) && aligned(orow, 8) && aligned(w, 4 * sizeof(W)) &&
                     (!ADD || (aligned(x_out + base, 16) && aligned(y + base, 8)));
    float ss = 0.f;
    if (vec) {
#pragma unroll 4
        for (int c = 4 * threadIdx.x; c < cols; c += 4 * blockDim.x) {
            float4 v = *reinterpret_cast<const float4*>(xr + c);
            if (ADD) {
                float a[4];
                load4(y + base + c, a);
                v.x += a[0];
                v.y += a[1];
                v.z += a[2];
                v.w += a[3];
                *reinterpret_cast<float4*>(x_out + base + c) = v;
            }
            ss += v.x * v.x;
            ss += v.y * v.y;
            ss += v.z * v.z;
            ss += v.w * v.w;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = xr[c];
            if (ADD) {
                v += to_f32(y[base + c]);
                x_out[base + c] = v;
            }
            ss += v * v;
        }
    }
    const float inv = rsqrtf(block_sum(ss) / cols + eps);
    const float* src = ADD ? x_out + base : xr;
    if (vec) {
#pragma unroll 4
        for (int c = 4 * threadIdx.x; c < cols; c += 4 * blockDim.x) {
            const float4 v = *reinterpret_cast<const float4*>(src + c);
            float wv[4];
            load4(w + c, wv);
            const float o[4] = {v.x * inv * wv[0], v.y * inv * wv[1], v.z * inv * wv[2], v.w * inv * wv[3]};
            store4(orow + c, o);
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = from_f32<T>(src[c] * inv * to_f32(w[c]));
    }
}

#define NORM_KERNELS(SUFFIX, T, W)                                                                        \
    extern "C" __global__ void rms_norm_##SUFFIX(const float* x, const W* w, T* out, int cols, float eps) {      \
        norm_row<T, W, false>(x, nullptr, w, nullptr, out, cols, eps);                                         \
    }                                                                                                          \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const float* x, const T* y, const W* w, float* x_out,      \
                                                     T* normed, int cols, float eps) {                         \
        norm_row<T, W, true>(x, y, w, x_out, normed, cols, eps);                                               \
    }
// f32 stream, weight and output in a 16-bit type.
NORM_KERNELS(f32_bf16, __nv_bfloat16, __nv_bfloat16)
NORM_KERNELS(f32_f16, __half, __half)
// f32 stream, f32 weight (zero-centred norms: 1 + w), output in a 16-bit type.
NORM_KERNELS(f32w_bf16, __nv_bfloat16, float)
NORM_KERNELS(f32w_f16, __half, float)

// f32 -> fp8 (E4M3, finite only): round to nearest even, saturating at +-448 (NaN stays NaN).
// What answers in fp8 are written with, after each value is scaled by 448 / amax of its row.
#include <cuda_fp8.h>

extern "C" __global__ void f32_to_fp8_e4m3(const float* __restrict__ x, uint8_t* __restrict__ out, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
    }
}

// E consecutive 16-bit values as f32, in one load (4, 8 or 16 bytes), and back.
template <int BYTES> struct Raw;
template <> struct Raw<4> { using type = uint32_t; };
template <> struct Raw<8> { using type = uint2; };
template <> struct Raw<16> { using type = uint4; };

template <typename T, int E>
__device__ __forceinline__ void load_e(const T* p, float (&x)[E]) {
    using R = typename Raw<E * sizeof(T)>::type;
    const R raw = *reinterpret_cast<const R*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = to_f32(h[j]);
}

template <typename T, int E>
__device__ __forceinline__ void store_e(T* p, const float (&x)[E]) {
    using R = typename Raw<E * sizeof(T)>::type;
    R raw;
    T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < E; ++j) h[j] = from_f32<T>(x[j]);
    *reinterpret_cast<R*>(p) = raw;
}

// Where head row `r` of a token starts in its fused q/k/v row: the nq query heads (each followed
// by its gate when gated), then the nkv key heads, then the nkv value heads.
template <typename T, int hd>
__device__ __forceinline__ const T* head_row(const T* row_in, int r, int nq, int nkv, int gated) {
    const size_t qw = (size_t)(gated ? 2 : 1) * nq * hd;
    if (r < nq) return row_in + (size_t)r * (gated ? 2 : 1) * hd;
    if (r < nq + nkv) return row_in + qw + (size_t)(r - nq) * hd;
    return row_in + qw + (size_t)nkv * hd + (size_t)(r - nq - nkv) * hd;
}

// The fused q/k/v projection's output split into contiguous q, k and v (and the attention output
// gate, where q_proj holds per head the query then its gate), with the per-head RMSNorm of q and
// k where the model has one (f32 weights: `w` or the zero-centred `1 + w`) and the rotary
// embedding on the first `rot` dims of each q and k head (the halves rotated against each other),
// all in f32 and rounded once. `norm` 0: no norm (`qn`, `kn` are then not read).
//
// `qkv` is [T, W] (16-byte aligned); `out` holds, one after the other, q [T, nq, hd], k [T, nkv,
// hd], v [T, nkv, hd] and, if gated, the gate [T, nq, hd]. One block per token; each warp takes
// head rows in turn, six at a time. Lane l holds dims E l .. E l + E - 1 (E = hd / 32; one load and one store per
// row), so the rotary partner of its dims (i and i + rot/2) is lane l ^ (rot / 2 / E), reached
// by a shuffle: rot/2 must be a multiple of E with rot / 2 / E a power of two (or rot 0). Each
// lane makes the cos/sin of its own frequencies once, from the token's position and the f32
// inverse frequencies.
template <typename T, int E>
__device__ void qkv_rope(const T* __restrict__ qkv, const uint32_t* __restrict__ pos, const float* __restrict__ inv_freq,
                         const float* __restrict__ qn, const float* __restrict__ kn, int norm, T* __restrict__ out,
                         int tokens, int nq, int nkv, int rot, int gated, float eps) {
    constexpr int hd = 32 * E;
    const int tok = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int off = rot / 2 / E;  // lanes between rotary partners
    const bool rotates = lane * E < rot;
    const bool first = (lane & off) == 0;  // holds the first half of its pairs
    float cs[E], sn[E];
#pragma unroll
    for (int j = 0; j < E; ++j) cs[j] = sn[j] = 0.f;
    if (rotates) {
        const int f0 = (lane & ~off) * E;
#pragma unroll
        for (int j = 0; j < E; ++j) sincosf((float)pos[tok] * inv_freq[f0 + j], &sn[j], &cs[j]);
    }
    const size_t qw = (size_t)(gated ? 2 : 1) * nq * hd;
    const size_t W = qw + 2 * (size_t)nkv * hd;
    const T* row_in = qkv + (size_t)tok * W;
    T* q_out = out;
    T* k_out = q_out + (size_t)tokens * nq * hd;
    T* v_out = k_out + (size_t)tokens * nkv * hd;
    T* g_out = v_out + (size_t)tokens * nkv * hd;
    // Each warp has U head rows in flight at once (all six of a token's rows per warp for the
    // 8B shape): a row alone is too little memory traffic in flight to keep the device busy.
    constexpr int U = 6;
    const int rows = nq + 2 * nkv;
    for (int r0 = warp; r0 < rows; r0 += U * warps) {
        float x[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r = r0 + u * warps;
            if (r < rows) load_e<T, E>(head_row<T, hd>(row_in, r, nq, nkv, gated) + lane * E, x[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r = r0 + u * warps;
            if (r >= rows) continue;
            T* dst;
            const float* w = nullptr;
            bool rope = rot > 0;
            if (r < nq) {
                dst = q_out + ((size_t)tok * nq + r) * hd;
                w = norm ? qn : nullptr;
                if (gated) {
                    using R = typename Raw<E * sizeof(T)>::type;
                    const T* src = head_row<T, hd>(row_in, r, nq, nkv, gated);
                    T* g = g_out + ((size_t)tok * nq + r) * hd;
                    *reinterpret_cast<R*>(g + lane * E) = *reinterpret_cast<const R*>(src + hd + lane * E);
                }
            } else if (r < nq + nkv) {
                dst = k_out + ((size_t)tok * nkv + (r - nq)) * hd;
                w = norm ? kn : nullptr;
            } else {
                dst = v_out + ((size_t)tok * nkv + (r - nq - nkv)) * hd;
                rope = false;
            }
            if (w != nullptr) {
                float ss = 0.f;
#pragma unroll
                for (int j = 0; j < E; ++j) ss += x[u][j] * x[u][j];
                for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
                const float inv = rsqrtf(ss / hd + eps);
#pragma unroll
                for (int j = 0; j < E; ++j) x[u][j] = x[u][j] * inv * w[lane * E + j];
            }
            if (rope) {  // the same for the whole warp: every lane takes part in the shuffles
#pragma unroll
                for (int j = 0; j < E; ++j) {
                    const float p = __shfl_xor_sync(0xffffffff, x[u][j], off);
                    if (rotates) x[u][j] = first ? x[u][j] * cs[j] - p * sn[j] : x[u][j] * cs[j] + p * sn[j];
                }
            }
            store_e<T, E>(dst + lane * E, x[u]);
        }
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

// Row copies with 64-bit indices (candle's own copy and gather kernels index in 32 bits, which
// wraps past 2^32 elements): dst[r * dst_s + c] = src[s(r) * src_s + c] for r < rows, c < cols,
// with s(r) = idx[r], or r itself when idx is null. Elements of 1, 2 or 4 bytes (the values are
// moved, never converted). Blocks take rows in turn, threads the columns of a row.
template <typename E>
__device__ void copy_rows(const E* __restrict__ src, const uint32_t* __restrict__ idx, E* __restrict__ dst,
                          size_t rows, size_t cols, size_t src_s, size_t dst_s) {
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const E* s = src + (idx != nullptr ? (size_t)idx[r] : r) * src_s;
        E* d = dst + r * dst_s;
        for (size_t c = threadIdx.x; c < cols; c += blockDim.x) d[c] = s[c];
    }
}

#define COPY_ROWS(NAME, E)                                                                                     \
    extern "C" __global__ void NAME(const E* src, const uint32_t* idx, E* dst, size_t rows, size_t cols,      \
                                    size_t src_s, size_t dst_s) {                                            \
        copy_rows<E>(src, idx, dst, rows, cols, src_s, dst_s);                                               \
    }
COPY_ROWS(copy_rows_b1, uint8_t)
COPY_ROWS(copy_rows_b2, uint16_t)
COPY_ROWS(copy_rows_b4, uint32_t)

// The non-finite screen: out[r] = 1 where row r of x ([rows, cols], contiguous) holds an
// infinity or a NaN (exponent bits all ones), else 0. A warp per row, 8 rows per block; `vec`
// (cols and the rows' starts multiples of 16 bytes) reads 16 bytes per lane at a time.
template <typename T> __device__ __forceinline__ bool bad_bits(uint32_t w);
// Two 16-bit values per word.
template <> __device__ __forceinline__ bool bad_bits<__nv_bfloat16>(uint32_t w) {
    return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}
template <> __device__ __forceinline__ bool bad_bits<__half>(uint32_t w) {
    return (w & 0x7c00u) == 0x7c00u || (w & 0x7c000000u) == 0x7c000000u;
}
template <> __device__ __forceinline__ bool bad_bits<float>(uint32_t w) { return (w & 0x7f800000u) == 0x7f800000u; }

template <typename T>
__device__ void nonfinite_rows(const T* __restrict__ x, uint8_t* __restrict__ out, size_t rows, size_t cols, int vec) {
    const size_t r = blockIdx.x * (size_t)8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;  // a whole warp leaves together
    bool bad = false;
    if (vec) {
        const uint4* p = reinterpret_cast<const uint4*>(x + r * cols);
        const size_t n = cols * sizeof(T) / 16;
        for (size_t i = lane; i < n; i += 32) {
            const uint4 v = p[i];
            bad |= bad_bits<T>(v.x) || bad_bits<T>(v.y) || bad_bits<T>(v.z) || bad_bits<T>(v.w);
        }
    } else {
        const T* p = x + r * cols;
        for (size_t c = lane; c < cols; c += 32) {
            uint32_t w = 0;
            if (sizeof(T) == 2) w = *reinterpret_cast<const uint16_t*>(p + c);
            else w = *reinterpret_cast<const uint32_t*>(p + c);
            bad |= bad_bits<T>(w);
        }
    }
    bad = __any_sync(0xffffffff, bad);
    if (lane == 0) out[r] = bad ? 1 : 0;
}

#define NONFINITE_ROWS(NAME, T)                                                                               \
    extern "C" __global__ void NAME(const T* x, uint8_t* out, size_t rows, size_t cols, int vec) {             \
        nonfinite_rows<T>(x, out, rows, cols, vec);                                                          \
    }
NONFINITE_ROWS(nonfinite_rows_bf16, __nv_bfloat16)
NONFINITE_ROWS(nonfinite_rows_f16, __half)
NONFINITE_ROWS(nonfinite_rows_f32, float)

// MXFP4 (gpt-oss's experts as released) to a 16-bit type or f32: `blocks` [rows, in / 2] holds two
// e2m1 values a byte, the low nibble first; each 32 values of a row share one E8M0 scale
// 2^(s - 127) from `scales` [rows, in / 32]. An e2m1 value has at most two significant bits, so
// value * scale is exact in f32 and in bf16 (the same exponent range): the dequantised weights are
// the released ones, as on the CPU. The f32 bits are built from the nibble and the scale's
// exponent with integer operations (a float product would be flushed to zero below 2^-126, the
// kernels being built with fast math). Written transposed, [in, rows], the layout float
// projections are held in, so the product that follows is the one a bf16 release of the same
// weights runs. A scale byte of 0xFF (NaN) is refused at load, before this runs.
__device__ __forceinline__ uint32_t mxfp4_f32_bits(uint32_t nibble, uint32_t scale) {
    const uint32_t sign = (nibble & 8u) << 28, m = nibble & 7u;
    if (m == 0) return sign;
    // |value| = (1 or 1.5) * 2^x: 0.5 = 2^-1, then 1, 1.5, 2, 3, 4, 6.
    const int x = (m == 1 ? -1 : (int)(m >> 1) - 1) + (int)scale - 127;
    const uint32_t half = (m >= 2 && (m & 1u)) ? 1u : 0u;  // the 1.5s
    if (x > 127) return sign | 0x7f800000u;  // past f32's range: infinity, as the CPU's product
    if (x >= -126) return sign | ((uint32_t)(x + 127) << 23) | (half << 22);
    // A subnormal: (2 or 3) * 2^(x - 1) in units of 2^-149 (x >= -128 here, so the shift is >= 20).
    return sign | ((2u + half) << (x - 1 + 149));
}

template <typename T> __device__ __forceinline__ T from_f32_bits(uint32_t bits);
template <> __device__ __forceinline__ float from_f32_bits<float>(uint32_t bits) { return __uint_as_float(bits); }
// Exact: the value's significant bits all lie in the upper 16.
template <> __device__ __forceinline__ __nv_bfloat16 from_f32_bits<__nv_bfloat16>(uint32_t bits) {
    return __ushort_as_bfloat16((unsigned short)(bits >> 16));
}
template <> __device__ __forceinline__ __half from_f32_bits<__half>(uint32_t bits) {
    return __float2half_rn(__uint_as_float(bits));
}

template <typename T>
__device__ void mxfp4_to(const uint8_t* __restrict__ blocks, const uint8_t* __restrict__ scales, T* __restrict__ out,
                         size_t rows, size_t in) {
    const size_t n = rows * in;
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t c = j / rows, r = j - c * rows;  // out[c][r] = w[r][c]
        const uint32_t byte = blocks[r * (in / 2) + c / 2];
        const uint32_t nibble = (c & 1) ? byte >> 4 : byte & 0x0Fu;
        out[j] = from_f32_bits<T>(mxfp4_f32_bits(nibble, scales[r * (in / 32) + c / 32]));
    }
}

#define MXFP4_KERNEL(SUFFIX, T)                                                                               \
    extern "C" __global__ void mxfp4_to_##SUFFIX(const uint8_t* blocks, const uint8_t* scales, T* out,      \
                                                  size_t rows, size_t in) {                                  \
        mxfp4_to<T>(blocks, scales, out, rows, in);                                                           \
    }
MXFP4_KERNEL(bf16, __nv_bfloat16)
MXFP4_KERNEL(f16, __half)
MXFP4_KERNEL(f32, float)
