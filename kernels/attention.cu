// Causal attention over packed sequences on tensor cores (sm_80 and newer).
//
// Each sequence attends only to itself; scores are never written to memory: a block of 64
// queries of one head walks the sequence's keys in tiles of BN (64, or 32 for head dim 256) with
// an online softmax, keeping the running output in registers (the flash-attention scheme). Inputs and output are packed
// along the token dimension: q and out are [tokens, heads, D], k and v are [tokens, kv_heads, D].
//
// A block is one (query tile, head). `tiles` lists the query tiles as (sequence start, sequence
// length, tile index) triples, ordered by the host so that the longest-running tiles start first.
//
// Warp w of the block owns query rows 16w..16w+15 of the tile. Matrix products use
// mma.sync.m16n8k16 with f32 accumulation; the probabilities are rounded to the input type
// before multiplying by V, as flash-attention does.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mma.cuh"

#define BM 64
#define WARPS 4
#define PAD 8

// Loads two consecutive 16-bit values as one register, zero past `valid`.
template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* row, bool valid) {
    return valid ? *reinterpret_cast<const uint32_t*>(row) : 0u;
}

template <typename T, int D, int BN>
__device__ void attention_tile(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                               T* __restrict__ out, const uint32_t* __restrict__ tiles, int heads, int kv_heads,
                               float scale_log2, int window) {
    // K tile row-major [key][dim]; V tile transposed [dim][key], so both feed mma from 32-bit loads.
    __shared__ __align__(16) T ks[BN][D + PAD];
    __shared__ __align__(16) T vt[D][BN + PAD];

    const int tile = blockIdx.x;
    const int head = blockIdx.y;
    const int seq_start = tiles[3 * tile];
    const int seq_len = tiles[3 * tile + 1];
    const int q0 = tiles[3 * tile + 2] * BM;
    const int kv_head = head / (heads / kv_heads);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;  // group: rows g and g + 8 of the warp's 16
    const int t = lane % 4;  // thread in group: columns 2t, 2t + 1 (and + 8)
    const int q_stride = heads * D;
    const int kv_stride = kv_heads * D;

    // This thread's query rows, as positions in the sequence.
    const int row_a = q0 + warp * 16 + g;
    const int row_b = row_a + 8;

    // Q fragments for the warp's 16 rows, all of D, in registers.
    constexpr int KSTEPS = D / 16;
    uint32_t qf[KSTEPS][4];
    {
        const T* qa = q + (size_t)(seq_start + row_a) * q_stride + head * D;
        const T* qb = q + (size_t)(seq_start + row_b) * q_stride + head * D;
        const bool va = row_a < seq_len, vb = row_b < seq_len;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const int c = kk * 16 + 2 * t;
            qf[kk][0] = load_pair(qa + c, va);
            qf[kk][1] = load_pair(qb + c, vb);
            qf[kk][2] = load_pair(qa + c + 8, va);
            qf[kk][3] = load_pair(qb + c + 8, vb);
        }
    }

    constexpr int NT = D / 8;  // output column tiles
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY;  // running row maxima (log2 domain)
    float l_a = 0.f, l_b = 0.f;              // this thread's share of the row sums

    // Keys this tile can see: causal up to its last query, and the window below its first.
    const int q_last = min(q0 + BM, seq_len);
    int k_begin = 0;
    if (window > 0) k_begin = max(0, q0 - window + 1) / BN * BN;

    for (int k0 = k_begin; k0 < q_last; k0 += BN) {
        __syncthreads();  // the previous tile's readers are done
        // Cooperative load: 16-byte chunks; keys past the sequence are zero.
        constexpr int CHUNKS = D / 8;
        for (int c = threadIdx.x; c < BN * CHUNKS; c += WARPS * 32) {
            const int r = c % BN;
            const int col = (c / BN) * 8;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (k0 + r < seq_len) {
                const size_t at = (size_t)(seq_start + k0 + r) * kv_stride + kv_head * D + col;
                kv4 = *reinterpret_cast<const uint4*>(k + at);
                vv4 = *reinterpret_cast<const uint4*>(v + at);
            }
            *reinterpret_cast<uint4*>(&ks[r][col]) = kv4;
            const T* vv = reinterpret_cast<const T*>(&vv4);
#pragma unroll
            for (int i = 0; i < 8; ++i) vt[col + i][r] = vv[i];
        }
        __syncthreads();

        // S = Q K^T for the warp's 16 rows and this tile's 64 keys.
        float s[BN / 8][4];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                const T* kr = &ks[n * 8 + g][kk * 16 + 2 * t];
                const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr);
                const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + 8);
                Mma<T>::mma(s[n], qf[kk], b0, b1);
            }
        }

        // Scale, mask, and the online softmax update.
        const bool full = (k0 + BN <= q0 + warp * 16 + 1) && (k0 + BN <= seq_len) &&
                          (window <= 0 || q0 + warp * 16 + 15 - k0 < window);
        float mx_a = m_a, mx_b = m_b;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int key = k0 + n * 8 + 2 * t + (j & 1);
                const int row = j < 2 ? row_a : row_b;
                float x = s[n][j] * scale_log2;
                if (!full) {
                    const bool ok = key <= row && key < seq_len && (window <= 0 || row - key < window);
                    if (!ok) x = -INFINITY;
                }
                s[n][j] = x;
            }
            mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffff, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffff, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffff, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffff, mx_b, 2));
        // Rows that have seen no key yet keep a zero reference so exp2 stays finite.
        const float ref_a = mx_a == -INFINITY ? 0.f : mx_a;
        const float ref_b = mx_b == -INFINITY ? 0.f : mx_b;
        const float alpha_a = exp2f(m_a - ref_a);
        const float alpha_b = exp2f(m_b - ref_b);
        m_a = mx_a;
        m_b = mx_b;
        l_a *= alpha_a;
        l_b *= alpha_b;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= alpha_a;
            o[n][1] *= alpha_a;
            o[n][2] *= alpha_b;
            o[n][3] *= alpha_b;
        }

        // P (rounded to T) as the A operand, straight from the score registers.
        uint32_t pf[BN / 16][4];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            const float p0 = exp2f(s[n][0] - ref_a), p1 = exp2f(s[n][1] - ref_a);
            const float p2 = exp2f(s[n][2] - ref_b), p3 = exp2f(s[n][3] - ref_b);
            l_a += p0 + p1;
            l_b += p2 + p3;
            const int kk = n / 2, hi = (n % 2) * 2;
            pf[kk][hi] = Mma<T>::pack(p0, p1);
            pf[kk][hi + 1] = Mma<T>::pack(p2, p3);
        }

        // O += P V.
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const T* vr = &vt[n * 8 + g][kk * 16 + 2 * t];
                const uint32_t b0 = *reinterpret_cast<const uint32_t*>(vr);
                const uint32_t b1 = *reinterpret_cast<const uint32_t*>(vr + 8);
                Mma<T>::mma(o[n], pf[kk], b0, b1);
            }
        }
    }

    // Row sums across the four threads of each group, then normalise and store.
    l_a += __shfl_xor_sync(0xffffffff, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffff, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffff, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffff, l_b, 2);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f;
    const float inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    T* oa = out + (size_t)(seq_start + row_a) * q_stride + head * D;
    T* ob = out + (size_t)(seq_start + row_b) * q_stride + head * D;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int c = n * 8 + 2 * t;
        if (row_a < seq_len) *reinterpret_cast<uint32_t*>(oa + c) = Mma<T>::pack(o[n][0] * inv_a, o[n][1] * inv_a);
        if (row_b < seq_len) *reinterpret_cast<uint32_t*>(ob + c) = Mma<T>::pack(o[n][2] * inv_b, o[n][3] * inv_b);
    }
}

#define ATTENTION_KERNEL(NAME, T, D, BN)                                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        NAME(const T* q, const T* k, const T* v, T* out, const uint32_t* tiles, int heads, int kv_heads,      \
             float scale_log2, int window) {                                                                   \
        attention_tile<T, D, BN>(q, k, v, out, tiles, heads, kv_heads, scale_log2, window);                 \
    }

// Keys per tile: 64, and 32 for head dimension 256 (Qwen3.5's full-attention layers), where a
// 64-key tile of K and V would not fit the 48 KiB of static shared memory.
ATTENTION_KERNEL(packed_attention_bf16_d64, __nv_bfloat16, 64, 64)
ATTENTION_KERNEL(packed_attention_bf16_d128, __nv_bfloat16, 128, 64)
ATTENTION_KERNEL(packed_attention_bf16_d256, __nv_bfloat16, 256, 32)
ATTENTION_KERNEL(packed_attention_f16_d64, __half, 64, 64)
ATTENTION_KERNEL(packed_attention_f16_d128, __half, 128, 64)
ATTENTION_KERNEL(packed_attention_f16_d256, __half, 256, 32)
