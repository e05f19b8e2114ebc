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

#include "convert.cuh"
#include "mma.cuh"
#include "reduce.cuh"

#define CHUNK 64
#define BV 32
#define SCAN_THREADS 256
#define LOCAL_THREADS 256



// ---------------------------------------------------------------------------------------------
// 1. conv + SiLU + l2norm + gates. Grid (ceil(T / CONV_TOKENS), 2 * nk + nv); block of `hd`
// threads (>= dk, dv, a multiple of 32): thread `lane` owns one channel of the block's head over
// CONV_TOKENS consecutive tokens, the conv's window sliding along in registers, so each input is
// read once; the l2norm's per-token sums go through one shared-memory exchange per block.
// x: [T, ldx] (q | k | v channels first), w: [conv_dim, K] f32 (w[c][K - 1] multiplies the token
// itself; K <= CONV_MAX), pos: [T] position in its sequence, b/a: [T, ldb] / [T, lda] (value
// heads first). out: [T, conv_dim] f32, beta/g: [T, nv] f32. Each token's values depend on its
// own window alone, whatever tokens share its block.
#define CONV_TOKENS 16
#define CONV_MAX 8
template <typename T>
__device__ void conv_norm_gates(const T* __restrict__ x, int ldx, const float* __restrict__ w, int kernel,
                                const uint32_t* __restrict__ pos, const T* __restrict__ b, int ldb,
                                const T* __restrict__ a, int lda, const float* __restrict__ neg_a,
                                const float* __restrict__ dt_bias, float* __restrict__ out, float* __restrict__ beta,
                                float* __restrict__ g, int tokens, int nk, int nv, int dk, int dv, float q_scale) {
    __shared__ float red[32][CONV_TOKENS];
    const int t0 = blockIdx.x * CONV_TOKENS;
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
    const bool mine = lane < width;
    const int c = c0 + (mine ? lane : 0);
    // wr[s] multiplies the token s positions back; win[s] holds that token's input.
    float wr[CONV_MAX], win[CONV_MAX];
#pragma unroll
    for (int s = 0; s < CONV_MAX; ++s) {
        wr[s] = s < kernel ? w[(size_t)c * kernel + kernel - 1 - s] : 0.f;
        // The window shifts by one before each token: it starts one token back.
        const int ts = t0 - 1 - s;
        win[s] = (s + 1 < kernel && ts >= 0 && mine) ? to_f32(x[(size_t)ts * ldx + c]) : 0.f;
    }
    // Every load first (clamped to the last token, so none waits on a branch), then the math.
    float xs[CONV_TOKENS];
    int ps[CONV_TOKENS];
#pragma unroll
    for (int i = 0; i < CONV_TOKENS; ++i) {
        const int t = min(t0 + i, tokens - 1);
        xs[i] = to_f32(x[(size_t)t * ldx + c]);
        ps[i] = (int)pos[t];
    }
    float y[CONV_TOKENS];
#pragma unroll
    for (int i = 0; i < CONV_TOKENS; ++i) {
#pragma unroll
        for (int s = CONV_MAX - 1; s > 0; --s) win[s] = win[s - 1];
        win[0] = xs[i];
        // Same order as the portable path: the token itself, then 1, 2, ... positions back.
        float v = win[0] * wr[0];
#pragma unroll
        for (int s = 1; s < CONV_MAX; ++s)
            if (s < kernel && s <= ps[i]) v += win[s] * wr[s];
        y[i] = mine && t0 + i < tokens ? v / (1.f + expf(-v)) : 0.f;
    }
    if (norm) {
#pragma unroll
        for (int i = 0; i < CONV_TOKENS; ++i) {
            float v = y[i] * y[i];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane % 32 == 0) red[lane / 32][i] = v;
        }
        __syncthreads();
        const int warps = blockDim.x / 32;
#pragma unroll
        for (int i = 0; i < CONV_TOKENS; ++i) {
            float total = 0.f;
            for (int j = 0; j < warps; ++j) total += red[j][i];
            y[i] = y[i] / sqrtf(total + 1e-6f);
            if (slot < nk) y[i] *= q_scale;
        }
    }
    if (mine) {
#pragma unroll
        for (int i = 0; i < CONV_TOKENS; ++i)
            if (t0 + i < tokens) out[(size_t)(t0 + i) * conv_dim + c0 + lane] = y[i];
    }
    if (!norm && lane < CONV_TOKENS && t0 + lane < tokens) {
        const int t = t0 + lane;
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
                                    const float* dt_bias, float* out, float* beta, float* g, int tokens,      \
                                    int nk, int nv, int dk, int dv, float q_scale) {                          \
        conv_norm_gates<T>(x, ldx, w, kernel, pos, b, ldb, a, lda, neg_a, dt_bias, out, beta, g, tokens, nk,  \
                           nv, dk, dv, q_scale);                                                              \
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
// The recurrent state, the decays and the triangular inverse stay f32. Same inputs and outputs
// as 2 and 3; dk a multiple of 16, dv a multiple of 8. Tiles come in with cp.async (every copy
// of a chunk in flight at once), rows past a sequence's end zero-filled.

// Rows [0, 64) x columns [0, cols) of a row-major f32 matrix (row stride ld floats, cols a
// multiple of 4) into shared memory (row stride sst); rows >= valid become zeros.
__device__ __forceinline__ void tile_async(float* dst, int sst, const float* src, size_t ld, int cols, int valid) {
    const int c4 = cols / 4;
    for (int e = threadIdx.x; e < CHUNK * c4; e += blockDim.x) {
        const int row = e / c4, col = 4 * (e % c4);
        const bool ok = row < valid;
        cp_async16(dst + row * sst + col, src + (ok ? row : 0) * ld + col, ok);
    }
}

// 2b. Per (chunk, value head), 8 warps: A and P from K K^T and Q K^T on tensor cores; the
// inverse T = (I + A)^-1 by forward substitution in f32 (4 lanes per column, the column in
// registers), its columns scaled by beta; then [W | U] = T diag(beta) [exp(G) k | v] on tensor
// cores. Dynamic shared memory: (64 (max(dk, dv) + 4) + 64 (dk + 4) + 2 * 64 * 68 + 192) floats.
#define TS 68
extern "C" __global__ void __launch_bounds__(LOCAL_THREADS)
    gdn_chunk_local_tc(const float* __restrict__ qkv, const float* __restrict__ beta, const float* __restrict__ g,
                       const uint32_t* __restrict__ chunks, float* __restrict__ gcum, float* __restrict__ wk,
                       float* __restrict__ u, float* __restrict__ p, int nk, int nv, int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    const int qst = max(dk, dv) + 4, kst = dk + 4;
    float* qs = sm;                  // [64][qst]: q, then v
    float* ks = qs + CHUNK * qst;    // [64][kst]: k
    float* as = ks + CHUNK * kst;    // [64][TS]: A
    float* ts = as + CHUNK * TS;     // [64][TS]: T diag(beta)
    float* gs = ts + CHUNK * TS;     // [64]: G
    float* es = gs + CHUNK;          // [64]: exp(G)
    float* bs = es + CHUNK;          // [64]: beta
    const int c = blockIdx.x, h = blockIdx.y;
    const int t0 = (int)chunks[2 * c], len = (int)chunks[2 * c + 1];
    const int r = nv / nk, kh = h / r;
    const int conv_dim = 2 * nk * dk + nv * dv;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gi = lane >> 2, ti = lane & 3;
    const size_t ch = (size_t)c * nv + h;
    const float* rows0 = qkv + (size_t)t0 * conv_dim;

    tile_async(qs, qst, rows0 + kh * dk, conv_dim, dk, len);
    tile_async(ks, kst, rows0 + nk * dk + kh * dk, conv_dim, dk, len);
    if (warp == 0) {
        // The running sum of g over the chunk, two tokens per lane.
        const int i0 = 2 * lane, i1 = i0 + 1;
        const float g0 = i0 < len ? g[(size_t)(t0 + i0) * nv + h] : 0.f;
        const float g1 = i1 < len ? g[(size_t)(t0 + i1) * nv + h] : 0.f;
        float sum = g0 + g1;
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(0xffffffff, sum, o);
            if (lane >= o) sum += n;
        }
        float before = __shfl_up_sync(0xffffffff, sum, 1);
        if (lane == 0) before = 0.f;
        const float G0 = before + g0, G1 = G0 + g1;
        gs[i0] = G0;
        gs[i1] = G1;
        es[i0] = expf(G0);
        es[i1] = expf(G1);
        bs[i0] = i0 < len ? beta[(size_t)(t0 + i0) * nv + h] : 0.f;
        bs[i1] = i1 < len ? beta[(size_t)(t0 + i1) * nv + h] : 0.f;
        gcum[ch * CHUNK + i0] = G0;
        gcum[ch * CHUNK + i1] = G1;
    }
    cp_async_wait_all();
    __syncthreads();

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
            for (int q = 0; q < 4; q += 2) {
                const int i = m0 + gi + 4 * q, j = n0 + 8 * n + 2 * ti;
                float2 pv, av;
                const float d0 = j <= i ? expf(gs[i] - gs[j]) : 0.f, d1 = j + 1 <= i ? expf(gs[i] - gs[j + 1]) : 0.f;
                av.x = j < i ? bs[i] * (akk[n][q] * d0) : 0.f;
                av.y = j + 1 < i ? bs[i] * (akk[n][q + 1] * d1) : 0.f;
                pv.x = j <= i ? pqk[n][q] * d0 : 0.f;
                pv.y = j + 1 <= i ? pqk[n][q + 1] * d1 : 0.f;
                *reinterpret_cast<float2*>(as + i * TS + j) = av;
                *reinterpret_cast<float2*>(pc + i * CHUNK + j) = pv;
            }
    }
    __syncthreads();
    // v into q's place, in flight while the inverse is computed.
    tile_async(qs, qst, rows0 + 2 * nk * dk + h * dv, conv_dim, dv, len);
    // T = (I + A)^-1, column by column: T[i][col] = [i == col] - sum_{col <= j < i} A[i][j] T[j][col].
    // Lane `part` of a column's four holds T[4 k + part][col] in tc[k].
    {
        const int col = tid >> 2, part = tid & 3;
        float tc[CHUNK / 4];
#pragma unroll
        for (int k = 0; k < CHUNK / 4; ++k) tc[k] = 4 * k + part == col ? 1.f : 0.f;
#pragma unroll
        for (int i = 1; i < CHUNK; ++i) {
            const float* ai = as + i * TS + part;
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int k = 0; 4 * k < i; k += 2) {
                if (4 * k + part < i) s0 += ai[4 * k] * tc[k];
                if (4 * (k + 1) + part < i) s1 += ai[4 * (k + 1)] * tc[k + 1];
            }
            float s = s0 + s1;
            s += __shfl_xor_sync(0xffffffff, s, 1);
            s += __shfl_xor_sync(0xffffffff, s, 2);
            if (part == (i & 3) && i > col) tc[i >> 2] = -s;
        }
        const float bc = bs[col];
#pragma unroll
        for (int k = 0; k < CHUNK / 4; ++k) ts[(4 * k + part) * TS + col] = tc[k] * bc;
    }
    cp_async_wait_all();
    __syncthreads();
    // [W | U] = T diag(beta) [exp(G) k | v]; T is lower triangular, so rows 16 m.. need only the
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
                    const int j = 8 * s + ti;
                    const float* xb = x + j * ld + gi;
                    const float e0 = is_k ? es[j] : 1.f, e1 = is_k ? es[j + 4] : 1.f;
                    mma_tf32(acc, a[s], tf32(xb[0] * e0), tf32(xb[4 * ld] * e1));
                }
#pragma unroll
            for (int q = 0; q < 4; q += 2) {
                const int i = m0 + gi + 4 * q, col = c0 + 2 * ti;
                float* dst = is_k ? wk + (ch * CHUNK + i) * dk + col : u + (ch * CHUNK + i) * dv + col - dk;
                *reinterpret_cast<float2*>(dst) = make_float2(acc[q], acc[q + 1]);
            }
        }
    }
}

// 3b. Per (slice of BVT value columns, value head, sequence), 8 warps, the chunks in order; the
// state slice S [dk][BVT] stays f32 in shared memory and enters the products as TF32; exp(G)
// and exp(G_last - G) scale q and k as they enter the products. Warp w takes rows 16 (w / 2)..
// and value columns 32 (w % 2).. of V' and O, and every eighth 16 x 8 tile of S. The next chunk's
// tiles come in while this one computes (two cp.async groups, one per half of the products), its
// U into registers. Dynamic shared memory: (2 * 64 (dk + 4) + 64 (dk + 8) + 64 * 68 +
// (64 + dk) (BVT + 8) + 128) floats.
#define BVT 64
#define VST (BVT + 8)
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    gdn_chunk_scan_tc(const float* __restrict__ qkv, const uint32_t* __restrict__ seqs,
                      const float* __restrict__ gcum, const float* __restrict__ wk, const float* __restrict__ u,
                      const float* __restrict__ p, float* __restrict__ out, int nk, int nv, int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    const int st = dk + 4, kst = dk + 8;
    float* ws = sm;                  // W [64][st]
    float* qs = ws + CHUNK * st;     // q [64][st]
    float* ks = qs + CHUNK * st;     // k [64][kst]
    float* ps = ks + CHUNK * kst;    // P [64][TS]
    float* vs = ps + CHUNK * TS;     // V' [64][VST]
    float* ss = vs + CHUNK * VST;    // S [dk][VST]
    float* fq = ss + dk * VST;       // exp(G) [64]
    float* fk = fq + CHUNK;          // exp(G_last - G) [64]
    const int v0 = blockIdx.x * BVT, h = blockIdx.y, sq = blockIdx.z;
    const int t0 = (int)seqs[3 * sq], len = (int)seqs[3 * sq + 1], c0 = (int)seqs[3 * sq + 2];
    const int nchunks = (len + CHUNK - 1) / CHUNK;
    const int r = nv / nk, kh = h / r;
    const int conv_dim = 2 * nk * dk + nv * dv;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gi = lane >> 2, ti = lane & 3;
    const int m0 = 16 * (warp >> 1), n0 = 32 * (warp & 1);
    const int s_tiles = (dk / 16) * (BVT / 8);

    for (int e = tid; e < dk * VST; e += SCAN_THREADS) ss[e] = 0.f;

    // Two groups of copies per chunk, each issued as soon as its buffers are free, so they land
    // while the previous chunk computes: W and q (read by V' = U - W S and O = q S) once those
    // products are done, k and P (read by the rest) once the state update is done.
    const float* qkv_q = qkv + kh * dk;
    const float* qkv_k = qkv + nk * dk + kh * dk;
    auto load_wq = [&](int cc) {
        const size_t ch = (size_t)(c0 + cc) * nv + h;
        const int tc = t0 + cc * CHUNK, rows = min(CHUNK, len - cc * CHUNK);
        tile_async(ws, st, wk + ch * CHUNK * dk, dk, dk, CHUNK);
        tile_async(qs, st, qkv_q + (size_t)tc * conv_dim, conv_dim, dk, rows);
        if (tid < CHUNK) fq[tid] = expf(gcum[ch * CHUNK + tid]);
    };
    auto load_kp = [&](int cc) {
        const size_t ch = (size_t)(c0 + cc) * nv + h;
        const int tc = t0 + cc * CHUNK, rows = min(CHUNK, len - cc * CHUNK);
        tile_async(ks, kst, qkv_k + (size_t)tc * conv_dim, conv_dim, dk, rows);
        tile_async(ps, TS, p + ch * CHUNK * CHUNK, CHUNK, CHUNK, CHUNK);
        if (tid < CHUNK) fk[tid] = expf(gcum[ch * CHUNK + CHUNK - 1] - gcum[ch * CHUNK + tid]);
    };
    // U of a chunk, in the accumulators' layout (loaded a chunk ahead, into registers).
    float un[4][4];
    auto load_u = [&](int cc) {
        const size_t ch = (size_t)(c0 + cc) * nv + h;
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int q = 0; q < 4; q += 2) {
                const int i = m0 + gi + 4 * q, col = v0 + n0 + 8 * n + 2 * ti;
                const float2 uv = col < dv ? *reinterpret_cast<const float2*>(u + (ch * CHUNK + i) * dv + col)
                                           : make_float2(0.f, 0.f);
                un[n][q] = uv.x;
                un[n][q + 1] = uv.y;
            }
    };
    if (nchunks > 0) {
        load_wq(0);
        cp_async_commit();
        load_kp(0);
        cp_async_commit();
        load_u(0);
    }

    for (int cc = 0; cc < nchunks; ++cc) {
        const size_t ch = (size_t)(c0 + cc) * nv + h;
        const int tc = t0 + cc * CHUNK;
        const int rows = min(CHUNK, len - cc * CHUNK);
        const float* gc = gcum + ch * CHUNK;
        // V' starts as U, O as zero.
        float vacc[4][4], oacc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                vacc[n][q] = un[n][q];
                oacc[n][q] = 0.f;
            }
        const float decay = expf(gc[CHUNK - 1]);
        cp_async_wait<1>();  // this chunk's W and q (its k and P may still be on the way)
        __syncthreads();     // ... for every thread, with exp(G); the previous state update done
        // V' = U - W S and O = (q exp(G)) S.
        const float fq0 = fq[m0 + gi], fq1 = fq[m0 + gi + 8];
        for (int k0 = 0; k0 < dk; k0 += 8) {
            uint32_t aw[4], aq[4];
            const float* wa = ws + (m0 + gi) * st + k0 + ti;
            aw[0] = tf32(-wa[0]);
            aw[1] = tf32(-wa[8 * st]);
            aw[2] = tf32(-wa[4]);
            aw[3] = tf32(-wa[8 * st + 4]);
            const float* qa = qs + (m0 + gi) * st + k0 + ti;
            aq[0] = tf32(qa[0] * fq0);
            aq[1] = tf32(qa[8 * st] * fq1);
            aq[2] = tf32(qa[4] * fq0);
            aq[3] = tf32(qa[8 * st + 4] * fq1);
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const float* sb = ss + (k0 + ti) * VST + n0 + 8 * n + gi;
                const uint32_t b0 = tf32(sb[0]), b1 = tf32(sb[4 * VST]);
                mma_tf32(vacc[n], aw, b0, b1);
                mma_tf32(oacc[n], aq, b0, b1);
            }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int q = 0; q < 4; q += 2)
                *reinterpret_cast<float2*>(vs + (m0 + gi + 4 * q) * VST + n0 + 8 * n + 2 * ti) =
                    make_float2(vacc[n][q], vacc[n][q + 1]);
        __syncthreads();  // W, q and exp(G) read: the next chunk's come in
        if (cc + 1 < nchunks) {
            load_wq(cc + 1);
            load_u(cc + 1);
        }
        cp_async_commit();   // (an empty group past the last chunk keeps the count)
        cp_async_wait<1>();  // this chunk's k and P
        __syncthreads();
        // O += P V' (P is zero right of the diagonal: rows 16 m.. need 16 (m + 1) columns); store.
        for (int k0 = 0; k0 < m0 + 16; k0 += 8) {
            uint32_t a[4];
            frag_a_tf32(a, ps, TS, m0, k0, lane);
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const float* vb = vs + (k0 + ti) * VST + n0 + 8 * n + gi;
                mma_tf32(oacc[n], a, tf32(vb[0]), tf32(vb[4 * VST]));
            }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int q = 0; q < 4; q += 2) {
                const int i = m0 + gi + 4 * q, col = v0 + n0 + 8 * n + 2 * ti;
                if (i < rows && col < dv)
                    *reinterpret_cast<float2*>(out + ((size_t)(tc + i) * nv + h) * dv + col) =
                        make_float2(oacc[n][q], oacc[n][q + 1]);
            }
        // S = exp(G_last) S + K'^T V', K' = k exp(G_last - G).
        for (int e = warp; e < s_tiles; e += SCAN_THREADS / 32) {
            const int d0 = 16 * (e / (BVT / 8)), j0 = 8 * (e % (BVT / 8));
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int k0 = 0; k0 < CHUNK; k0 += 8) {
                const float* ka = ks + (k0 + ti) * kst + d0 + gi;  // A[d][i] = K'[i][d]
                const float f0 = fk[k0 + ti], f1 = fk[k0 + ti + 4];
                const uint32_t a[4] = {tf32(ka[0] * f0), tf32(ka[8] * f0), tf32(ka[4 * kst] * f1),
                                       tf32(ka[4 * kst + 8] * f1)};
                const float* vb = vs + (k0 + ti) * VST + j0 + gi;
                mma_tf32(acc, a, tf32(vb[0]), tf32(vb[4 * VST]));
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float* sp = ss + (d0 + gi + 8 * (q >> 1)) * VST + j0 + 2 * ti + (q & 1);
                *sp = *sp * decay + acc[q];
            }
        }
        __syncthreads();  // k, P, V' and exp(G_last - G) read: the next chunk's k and P come in
        if (cc + 1 < nchunks) load_kp(cc + 1);
        cp_async_commit();
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

// 4b. The same, one warp per (token, head) row and 8 rows per block (grid ceil(T * nv / 8)), for
// dv a multiple of 4 and at most 128 J: lane l owns the 4-column groups l, l + 32, ... (J of them
// at most). Every load is issued before any math (groups past the row re-read its last one), so
// a warp waits once per row. x, w and out start on 16-byte boundaries, z's rows on 4 elements.
template <typename T> struct Quad;
template <> struct Quad<float> { using type = float4; };
template <> struct Quad<__nv_bfloat16> { using type = uint2; };
template <> struct Quad<__half> { using type = uint2; };

template <typename T, int J>
__device__ void gated_norm4(const float* __restrict__ x, const T* __restrict__ z, int ldz, const float* __restrict__ w,
                            T* __restrict__ out, int rows, int nv, int dv, float eps) {
    using Q = typename Quad<T>::type;
    const int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;  // a whole warp leaves together
    const int t = row / nv, h = row % nv, groups = dv / 4;
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)row * dv);
    const Q* zr = reinterpret_cast<const Q*>(z + (size_t)t * ldz + (size_t)h * dv);
    float4 xv[J], wv[J];
    Q zv[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int e = min(lane + 32 * j, groups - 1);
        xv[j] = xr[e];
        zv[j] = zr[e];
        wv[j] = reinterpret_cast<const float4*>(w)[e];
    }
    float total = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j)
        if (lane + 32 * j < groups)
            total += xv[j].x * xv[j].x + xv[j].y * xv[j].y + xv[j].z * xv[j].z + xv[j].w * xv[j].w;
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffff, total, o);
    const float scale = 1.f / sqrtf(total / dv + eps);
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int e = lane + 32 * j;
        if (e < groups) {
            const T* zq = reinterpret_cast<const T*>(&zv[j]);
            const float xs[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w}, ws[4] = {wv[j].x, wv[j].y, wv[j].z, wv[j].w};
            Q o;
            T* oq = reinterpret_cast<T*>(&o);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float zf = to_f32(zq[q]);
                store(oq + q, xs[q] * scale * ws[q] * (zf / (1.f + expf(-zf))));
            }
            reinterpret_cast<Q*>(out + (size_t)row * dv)[e] = o;
        }
    }
}

#define GATED_NORM4_KERNEL(NAME, T, J)                                                                       \
    extern "C" __global__ void NAME(const float* x, const T* z, int ldz, const float* w, T* out, int rows,      \
                                    int nv, int dv, float eps) {                                             \
        gated_norm4<T, J>(x, z, ldz, w, out, rows, nv, dv, eps);                                             \
    }
#define GATED_NORM4_KERNELS(J)                                                                               \
    GATED_NORM4_KERNEL(gdn_gated_norm4_##J##_f32, float, J)                                                  \
    GATED_NORM4_KERNEL(gdn_gated_norm4_##J##_bf16, __nv_bfloat16, J)                                         \
    GATED_NORM4_KERNEL(gdn_gated_norm4_##J##_f16, __half, J)
GATED_NORM4_KERNELS(1)
GATED_NORM4_KERNELS(2)
GATED_NORM4_KERNELS(4)
GATED_NORM4_KERNELS(8)
