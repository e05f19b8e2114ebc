// The Gated DeltaNet on packed sequences, in f32 (the triangular solve and the recurrent state
// always; the chunk products too, or on tensor cores in TF32 for bf16/f16 models: 2b and 3b),
// in three launches per layer, and its gated RMSNorm in a fourth:
//
// 1. gdn_conv_*: per token and head, the causal depthwise conv1d (zeros before the sequence's
//    first token) + SiLU over the q, k, v channels, the l2norm of q and k (q also scaled by
//    dk^-1/2), and the gates of each value head: beta = sigmoid(b) (rounded to the input type,
//    as the reference computes it there), g = -exp(A_log) * softplus(a + dt_bias).
// 2. gdn_chunk_local: per chunk of 64 tokens (chunks never straddle a sequence) and value head,
//    everything that does not need the recurrent state: the running sum G of g, the UT system
//    (I + A) with A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i, solved by forward
//    substitution for W = (I + A)^-1 (beta k exp(G)) and U = (I + A)^-1 (beta v), and the
//    causal intra-chunk scores P_ij = (q_i . k_j) exp(G_i - G_j), j <= i.
// 3. gdn_chunk_scan: per sequence, value head and slice of BV value columns, the chunks in
//    order with the state slice S [dk, BV] in shared memory:
//    V' = U - W S;  O = (q exp(G)) S + P V';  S = exp(G_last) S + (k exp(G_last - G))^T V'.
//
// Every sequence is computed the same whatever else is in the batch, so packed equals alone.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mma.cuh"

#define CHUNK 64
#define BV 32
#define SCAN_THREADS 256
#define LOCAL_THREADS 256

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float round_to(float x, const float*) { return x; }
__device__ __forceinline__ float round_to(float x, const __nv_bfloat16*) {
    return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float round_to(float x, const __half*) { return __half2float(__float2half_rn(x)); }

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), for every thread.
__device__ float block_sum(float v) {
    __shared__ float red[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (threadIdx.x == 0) red[0] = s;
    }
    __syncthreads();
    return red[0];
}

// ---------------------------------------------------------------------------------------------
// 1. conv + SiLU + l2norm + gates. Grid (tokens, 2 * nk + nv); block of `hd` threads (>= dk, dv).
// x: [T, ldx] (q | k | v channels first), w: [conv_dim, K] f32 (w[c][K - 1] multiplies the token
// itself), pos: [T] position in its sequence, b/a: [T, ldb] / [T, lda] (value heads first).
// out: [T, conv_dim] f32, beta/g: [T, nv] f32.
template <typename T>
__device__ void conv_norm_gates(const T* __restrict__ x, int ldx, const float* __restrict__ w, int kernel,
                                const uint32_t* __restrict__ pos, const T* __restrict__ b, int ldb,
                                const T* __restrict__ a, int lda, const float* __restrict__ neg_a,
                                const float* __restrict__ dt_bias, float* __restrict__ out, float* __restrict__ beta,
                                float* __restrict__ g, int nk, int nv, int dk, int dv, float q_scale) {
    const int t = blockIdx.x;
    const int slot = blockIdx.y;
    const int conv_dim = 2 * nk * dk + nv * dv;
    int c0, width;
    bool norm = true;
    if (slot < 2 * nk) {
        c0 = slot * dk;
        width = dk;
    } else {
        c0 = 2 * nk * dk + (slot - 2 * nk) * dv;
        width = dv;
        norm = false;
    }
    const int lane = threadIdx.x;
    const int p = (int)pos[t];
    float y = 0.f;
    if (lane < width) {
        const int c = c0 + lane;
        const float* wc = w + (size_t)c * kernel;
        // Same order as the portable path: the token itself, then 1, 2, ... positions back.
        y = to_f32(x[(size_t)t * ldx + c]) * wc[kernel - 1];
        for (int s = 1; s < kernel && s <= p; ++s) y += to_f32(x[(size_t)(t - s) * ldx + c]) * wc[kernel - 1 - s];
        y = y / (1.f + expf(-y));
    }
    if (norm) {
        y = y / sqrtf(block_sum(lane < width ? y * y : 0.f) + 1e-6f);
        if (slot < nk) y *= q_scale;
    }
    if (lane < width) out[(size_t)t * conv_dim + c0 + lane] = y;
    if (!norm && lane == 0) {
        const int h = slot - 2 * nk;
        const float bv = to_f32(b[(size_t)t * ldb + h]);
        beta[(size_t)t * nv + h] = round_to(1.f / (1.f + expf(-bv)), b);
        const float z = to_f32(a[(size_t)t * lda + h]) + dt_bias[h];
        const float sp = z > 20.f ? z : log1pf(expf(z));
        g[(size_t)t * nv + h] = sp * neg_a[h];
    }
}

#define CONV_KERNEL(NAME, T)                                                                                 \
    extern "C" __global__ void NAME(const T* x, int ldx, const float* w, int kernel, const uint32_t* pos,     \
                                    const T* b, int ldb, const T* a, int lda, const float* neg_a,             \
                                    const float* dt_bias, float* out, float* beta, float* g, int nk, int nv,  \
                                    int dk, int dv, float q_scale) {                                          \
        conv_norm_gates<T>(x, ldx, w, kernel, pos, b, ldb, a, lda, neg_a, dt_bias, out, beta, g, nk, nv, dk,  \
                           dv, q_scale);                                                                      \
    }

CONV_KERNEL(gdn_conv_f32, float)
CONV_KERNEL(gdn_conv_bf16, __nv_bfloat16)
CONV_KERNEL(gdn_conv_f16, __half)

// ---------------------------------------------------------------------------------------------
// 2. The chunk-local part. Grid (chunks, nv); LOCAL_THREADS threads; dynamic shared memory
// (64 * (max(2 dk, dk + dv) + 4) + 64 * 65 + 128) floats; dk a multiple of 4.
// qkv: [T, conv_dim] f32 from kernel 1; chunks: [chunks][2] (first token, tokens <= 64).
// Outputs per (chunk, head) = c * nv + h: gcum [.., 64], wk [.., 64, dk], u [.., 64, dv],
// p [.., 64, 64] (zeros above the diagonal); rows past the chunk's tokens are those of zero
// inputs.
extern "C" __global__ void __launch_bounds__(LOCAL_THREADS)
    gdn_chunk_local(const float* __restrict__ qkv, const float* __restrict__ beta, const float* __restrict__ g,
                    const uint32_t* __restrict__ chunks, float* __restrict__ gcum, float* __restrict__ wk,
                    float* __restrict__ u, float* __restrict__ p, int nk, int nv, int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    const int xst = max(2 * dk, dk + dv) + 4;
    float* xs = sm;                   // [64][xst]: q | k first, then the right-hand sides
    float* as = xs + CHUNK * xst;     // [64][65]
    float* gs = as + CHUNK * 65;      // [64]
    float* bs = gs + CHUNK;           // [64]
    const int c = blockIdx.x, h = blockIdx.y;
    const int t0 = (int)chunks[2 * c], len = (int)chunks[2 * c + 1];
    const int r = nv / nk, kh = h / r;
    const int conv_dim = 2 * nk * dk + nv * dv;
    const int tid = threadIdx.x;
    const size_t ch = (size_t)c * nv + h;

    for (int e = tid; e < CHUNK * 2 * dk; e += LOCAL_THREADS) {
        const int row = e / (2 * dk), col = e % (2 * dk);
        float v = 0.f;
        if (row < len) {
            const float* src = qkv + (size_t)(t0 + row) * conv_dim;
            v = col < dk ? src[kh * dk + col] : src[nk * dk + kh * dk + col - dk];
        }
        xs[row * xst + col] = v;
    }
    if (tid < CHUNK) {
        gs[tid] = tid < len ? g[(size_t)(t0 + tid) * nv + h] : 0.f;
        bs[tid] = tid < len ? beta[(size_t)(t0 + tid) * nv + h] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {
        float s = 0.f;
        for (int i = 0; i < CHUNK; ++i) {
            s += gs[i];
            gs[i] = s;
        }
    }
    __syncthreads();
    if (tid < CHUNK) gcum[ch * CHUNK + tid] = gs[tid];

    // A (strictly lower) and P (lower, diagonal included), four dimensions per shared load.
    float* pc = p + ch * CHUNK * CHUNK;
    for (int e = tid; e < CHUNK * CHUNK; e += LOCAL_THREADS) {
        const int i = e / CHUNK, j = e % CHUNK;
        float akk = 0.f, pqk = 0.f;
        if (j <= i) {
            const float4* qi = reinterpret_cast<const float4*>(xs + i * xst);
            const float4* ki = reinterpret_cast<const float4*>(xs + i * xst + dk);
            const float4* kj = reinterpret_cast<const float4*>(xs + j * xst + dk);
#pragma unroll 4
            for (int d = 0; d < dk / 4; ++d) {
                const float4 a = ki[d], b = kj[d], q = qi[d];
                akk += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                pqk += q.x * b.x + q.y * b.y + q.z * b.z + q.w * b.w;
            }
            const float decay = expf(gs[i] - gs[j]);
            pqk *= decay;
            akk = j < i ? bs[i] * akk * decay : 0.f;
        }
        as[i * 65 + j] = akk;
        pc[e] = pqk;
    }
    __syncthreads();
    // Right-hand sides, from global memory: [beta v | beta exp(G) k].
    for (int e = tid; e < CHUNK * (dk + dv); e += LOCAL_THREADS) {
        const int row = e / (dk + dv), col = e % (dk + dv);
        float val = 0.f;
        if (row < len) {
            const float* src = qkv + (size_t)(t0 + row) * conv_dim;
            val = col < dv ? src[2 * nk * dk + h * dv + col] * bs[row]
                           : src[nk * dk + kh * dk + col - dv] * bs[row] * expf(gs[row]);
        }
        xs[row * xst + col] = val;
    }
    __syncthreads();
    // Forward substitution, row by row: X_i -= sum_{j < i} A_ij X_j.
    for (int i = 1; i < CHUNK; ++i) {
        const float* ai = as + i * 65;
        for (int col = tid; col < dk + dv; col += LOCAL_THREADS) {
            float acc0 = 0.f, acc1 = 0.f;
            int j = 0;
            for (; j + 1 < i; j += 2) {
                acc0 += ai[j] * xs[j * xst + col];
                acc1 += ai[j + 1] * xs[(j + 1) * xst + col];
            }
            if (j < i) acc0 += ai[j] * xs[j * xst + col];
            xs[i * xst + col] -= acc0 + acc1;
        }
        __syncthreads();
    }
    for (int e = tid; e < CHUNK * (dk + dv); e += LOCAL_THREADS) {
        const int row = e / (dk + dv), col = e % (dk + dv);
        const float val = xs[row * xst + col];
        if (col < dv) {
            u[(ch * CHUNK + row) * dv + col] = val;
        } else {
            wk[(ch * CHUNK + row) * dk + col - dv] = val;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. The scan. Grid (ceil(dv / BV), nv, sequences): the slices of one (sequence, head) side by
// side, so they share the chunk data in L2. SCAN_THREADS threads; dynamic shared memory
// (max(64 (dk + 4), dk * 68) + 64 (dk + 4) + 64 * 68 + 64 BV + dk BV + 64) floats; dk a
// multiple of 4. seqs: [sequences][3] (first token, tokens, first chunk); out: [T, nv, dv] f32.
// Thread (grp, col) owns value column col of the slice: rows grp, grp + 8, ... of V' and O, and
// rows grp, grp + 8, ... of the state.
#define GROUPS (SCAN_THREADS / BV)
#define ROWS (CHUNK / GROUPS)
#define SROWS 16
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    gdn_chunk_scan(const float* __restrict__ qkv, const uint32_t* __restrict__ seqs, const float* __restrict__ gcum,
                   const float* __restrict__ wk, const float* __restrict__ u, const float* __restrict__ p,
                   float* __restrict__ out, int nk, int nv, int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    const int st = dk + 4, kt = CHUNK + 4;
    float* ws = sm;                                    // W [64][dk + 4], then K'^T [dk][68]
    float* qs = ws + max(CHUNK * st, dk * kt);         // q exp(G) [64][dk + 4]
    float* ps = qs + CHUNK * st;                       // P [64][68]
    float* vs = ps + CHUNK * kt;                       // U, then V' [64][BV]
    float* ss = vs + CHUNK * BV;                       // the state slice [dk][BV]
    float* gs = ss + dk * BV;                          // G [64]
    const int v0 = blockIdx.x * BV, h = blockIdx.y, sq = blockIdx.z;
    const int t0 = (int)seqs[3 * sq], len = (int)seqs[3 * sq + 1], c0 = (int)seqs[3 * sq + 2];
    const int nchunks = (len + CHUNK - 1) / CHUNK;
    const int r = nv / nk, kh = h / r;
    const int conv_dim = 2 * nk * dk + nv * dv;
    const int tid = threadIdx.x;
    const int col = tid % BV;
    const int grp = tid / BV;
    const bool col_ok = v0 + col < dv;

    for (int e = tid; e < dk * BV; e += SCAN_THREADS) ss[e] = 0.f;

    for (int cc = 0; cc < nchunks; ++cc) {
        const size_t ch = (size_t)(c0 + cc) * nv + h;
        const int tc = t0 + cc * CHUNK;
        const int rows = min(CHUNK, len - cc * CHUNK);
        const float* gc = gcum + ch * CHUNK;
        __syncthreads();  // the previous chunk's readers are done
        if (tid < CHUNK) gs[tid] = gc[tid];
        for (int e = tid; e < CHUNK * dk; e += SCAN_THREADS) {
            const int i = e / dk, d = e % dk;
            ws[i * st + d] = wk[(ch * CHUNK + i) * dk + d];
            const float q = i < rows ? qkv[(size_t)(tc + i) * conv_dim + kh * dk + d] : 0.f;
            qs[i * st + d] = q * expf(gc[i]);
        }
        for (int e = tid; e < CHUNK * CHUNK; e += SCAN_THREADS) ps[(e / CHUNK) * kt + e % CHUNK] = p[ch * CHUNK * CHUNK + e];
        for (int e = tid; e < CHUNK * BV; e += SCAN_THREADS) {
            const int i = e / BV, j = e % BV;
            vs[e] = v0 + j < dv ? u[(ch * CHUNK + i) * dv + v0 + j] : 0.f;
        }
        __syncthreads();
        // V' = U - W S and O = (q exp(G)) S.
        float vn[ROWS], o[ROWS];
#pragma unroll
        for (int k = 0; k < ROWS; ++k) vn[k] = o[k] = 0.f;
        for (int d = 0; d < dk; d += 4) {
            const float s0 = ss[d * BV + col], s1 = ss[(d + 1) * BV + col];
            const float s2 = ss[(d + 2) * BV + col], s3 = ss[(d + 3) * BV + col];
#pragma unroll
            for (int k = 0; k < ROWS; ++k) {
                const int i = grp + k * GROUPS;
                const float4 w4 = *reinterpret_cast<const float4*>(ws + i * st + d);
                const float4 q4 = *reinterpret_cast<const float4*>(qs + i * st + d);
                vn[k] += w4.x * s0 + w4.y * s1 + w4.z * s2 + w4.w * s3;
                o[k] += q4.x * s0 + q4.y * s1 + q4.z * s2 + q4.w * s3;
            }
        }
        __syncthreads();  // W, U and the state have been read
#pragma unroll
        for (int k = 0; k < ROWS; ++k) vs[(grp + k * GROUPS) * BV + col] -= vn[k];
        // k exp(G_last - G), transposed, into W's place.
        const float glast = gs[CHUNK - 1];
        for (int e = tid; e < CHUNK * dk; e += SCAN_THREADS) {
            const int i = e / dk, d = e % dk;
            const float k = i < rows ? qkv[(size_t)(tc + i) * conv_dim + nk * dk + kh * dk + d] : 0.f;
            ws[d * kt + i] = k * expf(glast - gs[i]);
        }
        __syncthreads();
        // O += P V' (P is zero above the diagonal); store.
#pragma unroll
        for (int k = 0; k < ROWS; ++k) {
            const int i = grp + k * GROUPS;
            float acc = o[k];
            for (int j = 0; j <= i; j += 4) {
                const float4 p4 = *reinterpret_cast<const float4*>(ps + i * kt + j);
                acc += p4.x * vs[j * BV + col] + p4.y * vs[(j + 1) * BV + col] + p4.z * vs[(j + 2) * BV + col] +
                       p4.w * vs[(j + 3) * BV + col];
            }
            if (i < rows && col_ok) out[((size_t)(tc + i) * nv + h) * dv + v0 + col] = acc;
        }
        // S = exp(G_last) S + K'^T V'.
        const float decay = expf(glast);
        for (int d0 = 0; d0 < dk; d0 += GROUPS * SROWS) {
            float acc[SROWS];
#pragma unroll
            for (int k = 0; k < SROWS; ++k) acc[k] = 0.f;
            for (int i = 0; i < CHUNK; i += 4) {
                const float x0 = vs[i * BV + col], x1 = vs[(i + 1) * BV + col];
                const float x2 = vs[(i + 2) * BV + col], x3 = vs[(i + 3) * BV + col];
#pragma unroll
                for (int k = 0; k < SROWS; ++k) {
                    const int d = d0 + grp + k * GROUPS;
                    if (d < dk) {
                        const float4 k4 = *reinterpret_cast<const float4*>(ws + d * kt + i);
                        acc[k] += k4.x * x0 + k4.y * x1 + k4.z * x2 + k4.w * x3;
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < SROWS; ++k) {
                const int d = d0 + grp + k * GROUPS;
                if (d < dk) ss[d * BV + col] = ss[d * BV + col] * decay + acc[k];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2b and 3b. The same two steps with the chunk products on tensor cores (TF32 operands, f32
// accumulation), for models computed in bf16 or f16, whose q, k and v carry 8 or 11 mantissa
// bits already: rounding them to TF32's 11 bits adds less error than the layer's output rounding.
// The recurrent state, the decays and the triangular inverse stay f32. Same inputs, outputs and
// grids as 2 and 3; dk a multiple of 16, dv a multiple of 8.

// 2b. Per (chunk, value head), 8 warps: A and P from K K^T and Q K^T on tensor cores, the
// inverse T = (I + A)^-1 by forward substitution (4 lanes per column, f32), then
// [W | U] = T [beta exp(G) k | beta v] on tensor cores.
// Dynamic shared memory: (64 (max(dk, dv) + 4) + 64 (dk + 4) + 2 * 64 * 68 + 128) floats.
#define TS 68
extern "C" __global__ void __launch_bounds__(LOCAL_THREADS)
    gdn_chunk_local_tc(const float* __restrict__ qkv, const float* __restrict__ beta, const float* __restrict__ g,
                       const uint32_t* __restrict__ chunks, float* __restrict__ gcum, float* __restrict__ wk,
                       float* __restrict__ u, float* __restrict__ p, int nk, int nv, int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    const int qst = max(dk, dv) + 4, kst = dk + 4;
    float* qs = sm;                  // [64][qst]: q, then beta v
    float* ks = qs + CHUNK * qst;    // [64][kst]: k, then beta exp(G) k
    float* as = ks + CHUNK * kst;    // [64][TS]: A
    float* ts = as + CHUNK * TS;     // [64][TS]: T = (I + A)^-1
    float* gs = ts + CHUNK * TS;     // [64]
    float* bs = gs + CHUNK;          // [64]
    const int c = blockIdx.x, h = blockIdx.y;
    const int t0 = (int)chunks[2 * c], len = (int)chunks[2 * c + 1];
    const int r = nv / nk, kh = h / r;
    const int conv_dim = 2 * nk * dk + nv * dv;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gi = lane >> 2, ti = lane & 3;
    const size_t ch = (size_t)c * nv + h;

    const int dk4 = dk / 4;
    for (int e = tid; e < CHUNK * dk4; e += LOCAL_THREADS) {
        const int row = e / dk4, col = 4 * (e % dk4);
        float4 q = make_float4(0.f, 0.f, 0.f, 0.f), k = q;
        if (row < len) {
            const float* src = qkv + (size_t)(t0 + row) * conv_dim + kh * dk + col;
            q = *reinterpret_cast<const float4*>(src);
            k = *reinterpret_cast<const float4*>(src + nk * dk);
        }
        *reinterpret_cast<float4*>(qs + row * qst + col) = q;
        *reinterpret_cast<float4*>(ks + row * kst + col) = k;
    }
    if (tid < CHUNK) {
        gs[tid] = tid < len ? g[(size_t)(t0 + tid) * nv + h] : 0.f;
        bs[tid] = tid < len ? beta[(size_t)(t0 + tid) * nv + h] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {
        float s = 0.f;
        for (int i = 0; i < CHUNK; ++i) {
            s += gs[i];
            gs[i] = s;
        }
    }
    __syncthreads();
    if (tid < CHUNK) gcum[ch * CHUNK + tid] = gs[tid];

    // K K^T and Q K^T: warp w takes rows 16 (w / 2).., columns 32 (w % 2)...
    {
        const int m0 = 16 * (warp >> 1), n0 = 32 * (warp & 1);
        float akk[4][4], pqk[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) akk[n][q] = pqk[n][q] = 0.f;
        if (n0 <= m0 + 15) {
            for (int k0 = 0; k0 < dk; k0 += 8) {
                uint32_t ak[4], aq[4];
                frag_a_tf32(ak, ks, kst, m0, k0, lane);
                frag_a_tf32(aq, qs, qst, m0, k0, lane);
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const float* kb = ks + (n0 + 8 * n + gi) * kst + k0 + ti;
                    const uint32_t b0 = tf32(kb[0]), b1 = tf32(kb[4]);
                    mma_tf32(akk[n], ak, b0, b1);
                    mma_tf32(pqk[n], aq, b0, b1);
                }
            }
        }
        float* pc = p + ch * CHUNK * CHUNK;
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = m0 + gi + 8 * (q >> 1), j = n0 + 8 * n + 2 * ti + (q & 1);
                const float decay = j <= i ? expf(gs[i] - gs[j]) : 0.f;
                as[i * TS + j] = j < i ? bs[i] * (akk[n][q] * decay) : 0.f;
                pc[i * CHUNK + j] = j <= i ? pqk[n][q] * decay : 0.f;
            }
    }
    __syncthreads();
    // The right-hand sides in place of q and k: beta v and beta exp(G) k (zeros past the end).
    for (int e = tid; e < CHUNK * dk; e += LOCAL_THREADS) {
        const int row = e / dk, col = e % dk;
        ks[row * kst + col] *= bs[row] * expf(gs[row]);
    }
    for (int e = tid; e < CHUNK * dv; e += LOCAL_THREADS) {
        const int row = e / dv, col = e % dv;
        qs[row * qst + col] = row < len ? qkv[(size_t)(t0 + row) * conv_dim + 2 * nk * dk + h * dv + col] * bs[row] : 0.f;
    }
    // T = (I + A)^-1, column by column: T[i][col] = [i == col] - sum_{col <= j < i} A[i][j] T[j][col].
    {
        const int col = tid >> 2, part = tid & 3;
        for (int i = part; i < CHUNK; i += 4) ts[i * TS + col] = i == col ? 1.f : 0.f;
        __syncwarp();
        for (int i = 1; i < CHUNK; ++i) {
            float s = 0.f;
            if (i > col)
                for (int j = col + part; j < i; j += 4) s += as[i * TS + j] * ts[j * TS + col];
            s += __shfl_xor_sync(0xffffffff, s, 1);
            s += __shfl_xor_sync(0xffffffff, s, 2);
            if (i > col && part == 0) ts[i * TS + col] = -s;
            __syncwarp();
        }
    }
    __syncthreads();
    // [W | U] = T [beta exp(G) k | beta v]; T is lower triangular, so rows 16 m.. need only the
    // first 16 (m + 1) columns of T. Warp w: rows 16 (w % 4).., every other 8-column tile.
    {
        const int mt = warp & 3, m0 = 16 * mt, steps = 2 * mt + 2;
        uint32_t a[8][4];
#pragma unroll
        for (int s = 0; s < 8; ++s)
            if (s < steps) frag_a_tf32(a[s], ts, TS, m0, 8 * s, lane);
        const int tiles = (dk + dv) / 8;
        for (int nt = warp >> 2; nt < tiles; nt += 2) {
            const int c0 = 8 * nt;
            const bool is_k = c0 < dk;
            const float* x = is_k ? ks + c0 : qs + (c0 - dk);
            const int ld = is_k ? kst : qst;
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < 8; ++s)
                if (s < steps) {
                    const float* xb = x + (8 * s + ti) * ld + gi;
                    mma_tf32(acc, a[s], tf32(xb[0]), tf32(xb[4 * ld]));
                }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = m0 + gi + 8 * (q >> 1), col = c0 + 2 * ti + (q & 1);
                if (is_k) {
                    wk[(ch * CHUNK + i) * dk + col] = acc[q];
                } else {
                    u[(ch * CHUNK + i) * dv + col - dk] = acc[q];
                }
            }
        }
    }
}

// 3b. Per (slice of BV value columns, value head, sequence), 8 warps, the chunks in order; the
// state slice S [dk][BV] stays f32 in shared memory and enters the products as TF32. Warp w
// takes rows 16 (w / 2).. and value columns 16 (w % 2).. of V' and O, and every eighth of the
// 16 x 8 tiles of S. Dynamic shared memory:
// (2 * 64 (dk + 4) + 64 (dk + 8) + 64 * 68 + 64 (BV + 8) + dk (BV + 8)) floats.
#define VST (BV + 8)
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    gdn_chunk_scan_tc(const float* __restrict__ qkv, const uint32_t* __restrict__ seqs,
                      const float* __restrict__ gcum, const float* __restrict__ wk, const float* __restrict__ u,
                      const float* __restrict__ p, float* __restrict__ out, int nk, int nv, int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    const int st = dk + 4, kst = dk + 8;
    float* ws = sm;                  // W [64][st]
    float* qs = ws + CHUNK * st;     // q exp(G) [64][st]
    float* ks = qs + CHUNK * st;     // k exp(G_last - G) [64][kst]
    float* ps = ks + CHUNK * kst;    // P [64][TS]
    float* vs = ps + CHUNK * TS;     // V' [64][VST]
    float* ss = vs + CHUNK * VST;    // S [dk][VST]
    const int v0 = blockIdx.x * BV, h = blockIdx.y, sq = blockIdx.z;
    const int t0 = (int)seqs[3 * sq], len = (int)seqs[3 * sq + 1], c0 = (int)seqs[3 * sq + 2];
    const int nchunks = (len + CHUNK - 1) / CHUNK;
    const int r = nv / nk, kh = h / r;
    const int conv_dim = 2 * nk * dk + nv * dv;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gi = lane >> 2, ti = lane & 3;
    const int m0 = 16 * (warp >> 1), n0 = 16 * (warp & 1);
    const int dk4 = dk / 4;
    const int s_tiles = (dk / 16) * (BV / 8);

    for (int e = tid; e < dk * VST; e += SCAN_THREADS) ss[e] = 0.f;

    for (int cc = 0; cc < nchunks; ++cc) {
        const size_t ch = (size_t)(c0 + cc) * nv + h;
        const int tc = t0 + cc * CHUNK;
        const int rows = min(CHUNK, len - cc * CHUNK);
        const float* gc = gcum + ch * CHUNK;
        const float glast = gc[CHUNK - 1];
        __syncthreads();  // the previous chunk's readers are done
        for (int e = tid; e < CHUNK * dk4; e += SCAN_THREADS) {
            const int i = e / dk4, d = 4 * (e % dk4);
            *reinterpret_cast<float4*>(ws + i * st + d) =
                *reinterpret_cast<const float4*>(wk + (ch * CHUNK + i) * dk + d);
            float4 q = make_float4(0.f, 0.f, 0.f, 0.f), k = q;
            if (i < rows) {
                const float* src = qkv + (size_t)(tc + i) * conv_dim + kh * dk + d;
                q = *reinterpret_cast<const float4*>(src);
                k = *reinterpret_cast<const float4*>(src + nk * dk);
                const float eq = expf(gc[i]), ek = expf(glast - gc[i]);
                q = make_float4(q.x * eq, q.y * eq, q.z * eq, q.w * eq);
                k = make_float4(k.x * ek, k.y * ek, k.z * ek, k.w * ek);
            }
            *reinterpret_cast<float4*>(qs + i * st + d) = q;
            *reinterpret_cast<float4*>(ks + i * kst + d) = k;
        }
        for (int e = tid; e < CHUNK * CHUNK / 4; e += SCAN_THREADS) {
            const int i = e / (CHUNK / 4), j = 4 * (e % (CHUNK / 4));
            *reinterpret_cast<float4*>(ps + i * TS + j) =
                *reinterpret_cast<const float4*>(p + ch * CHUNK * CHUNK + i * CHUNK + j);
        }
        // V' starts as U (in the accumulators' layout), O as zero.
        float vacc[2][4], oacc[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = m0 + gi + 8 * (q >> 1), col = v0 + n0 + 8 * n + 2 * ti + (q & 1);
                vacc[n][q] = col < dv ? u[(ch * CHUNK + i) * dv + col] : 0.f;
                oacc[n][q] = 0.f;
            }
        __syncthreads();
        // V' = U - W S and O = (q exp(G)) S.
        for (int k0 = 0; k0 < dk; k0 += 8) {
            uint32_t aw[4], aq[4];
            frag_a_tf32(aw, ws, st, m0, k0, lane);
            frag_a_tf32(aq, qs, st, m0, k0, lane);
#pragma unroll
            for (int q = 0; q < 4; ++q) aw[q] ^= 0x80000000u;  // -W
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const float* sb = ss + (k0 + ti) * VST + n0 + 8 * n + gi;
                const uint32_t b0 = tf32(sb[0]), b1 = tf32(sb[4 * VST]);
                mma_tf32(vacc[n], aw, b0, b1);
                mma_tf32(oacc[n], aq, b0, b1);
            }
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q)
                vs[(m0 + gi + 8 * (q >> 1)) * VST + n0 + 8 * n + 2 * ti + (q & 1)] = vacc[n][q];
        __syncthreads();
        // O += P V' (P is zero right of the diagonal: rows 16 m.. need 16 (m + 1) columns); store.
        for (int k0 = 0; k0 < m0 + 16; k0 += 8) {
            uint32_t a[4];
            frag_a_tf32(a, ps, TS, m0, k0, lane);
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const float* vb = vs + (k0 + ti) * VST + n0 + 8 * n + gi;
                mma_tf32(oacc[n], a, tf32(vb[0]), tf32(vb[4 * VST]));
            }
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = m0 + gi + 8 * (q >> 1), col = v0 + n0 + 8 * n + 2 * ti + (q & 1);
                if (i < rows && col < dv) out[((size_t)(tc + i) * nv + h) * dv + col] = oacc[n][q];
            }
        // S = exp(G_last) S + K'^T V'.
        const float decay = expf(glast);
        for (int e = warp; e < s_tiles; e += SCAN_THREADS / 32) {
            const int d0 = 16 * (e / (BV / 8)), j0 = 8 * (e % (BV / 8));
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int k0 = 0; k0 < CHUNK; k0 += 8) {
                const float* ka = ks + (k0 + ti) * kst + d0 + gi;  // A[d][i] = K'[i][d]
                const uint32_t a[4] = {tf32(ka[0]), tf32(ka[8]), tf32(ka[4 * kst]), tf32(ka[4 * kst + 8])};
                const float* vb = vs + (k0 + ti) * VST + j0 + gi;
                mma_tf32(acc, a, tf32(vb[0]), tf32(vb[4 * VST]));
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float* sp = ss + (d0 + gi + 8 * (q >> 1)) * VST + j0 + 2 * ti + (q & 1);
                *sp = *sp * decay + acc[q];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. The gated RMSNorm of the delta rule's output, in f32, rounded once:
// y = x * rsqrt(mean(x^2) + eps) * w * silu(z). Grid (tokens * nv); block dv rounded up to 32.
// x: [T * nv, dv] f32; z: token t, head h at z[t * ldz + h * dv ..]; w: [dv] f32; out [T * nv, dv].
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

template <typename T>
__device__ void gated_norm(const float* __restrict__ x, const T* __restrict__ z, int ldz, const float* __restrict__ w,
                           T* __restrict__ out, int nv, int dv, float eps) {
    const int row = blockIdx.x, t = row / nv, h = row % nv, d = threadIdx.x;
    const float v = d < dv ? x[(size_t)row * dv + d] : 0.f;
    const float total = block_sum(v * v);
    if (d < dv) {
        const float scale = 1.f / sqrtf(total / dv + eps);
        const float zf = to_f32(z[(size_t)t * ldz + h * dv + d]);
        store(out + (size_t)row * dv + d, v * scale * w[d] * (zf / (1.f + expf(-zf))));
    }
}

#define GATED_NORM_KERNEL(NAME, T)                                                                           \
    extern "C" __global__ void NAME(const float* x, const T* z, int ldz, const float* w, T* out, int nv, int dv, \
                                    float eps) {                                                             \
        gated_norm<T>(x, z, ldz, w, out, nv, dv, eps);                                                       \
    }

GATED_NORM_KERNEL(gdn_gated_norm_f32, float)
GATED_NORM_KERNEL(gdn_gated_norm_bf16, __nv_bfloat16)
GATED_NORM_KERNEL(gdn_gated_norm_f16, __half)
