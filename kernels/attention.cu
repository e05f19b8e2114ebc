// Causal attention over packed sequences on tensor cores (sm_80 and newer).
//
// Each sequence attends only to itself; scores are never written to memory: a block of query
// rows of one head walks the sequence's keys in tiles of BN (64, or 32 for head dim 256) with an
// online softmax, keeping the running output in registers (the flash-attention scheme). Inputs
// and output are packed along the token dimension: q and out are [tokens, heads, D], k and v are
// [tokens, kv_heads, D].
//
// A block is one (query tile, head). `tiles` lists the query tiles as (sequence start, sequence
// length, tile index) triples, ordered by the host so that the longest-running tiles start first.
//
// In the first two kernels warp w owns query rows 16w..16w+15 of the tile. Matrix products use
// mma.sync.m16n8k16 with f32 accumulation; the probabilities are rounded to the input type
// before multiplying by V, as flash-attention does.
//
// Three kernels share that scheme:
// - `packed_attention_*` (64 query rows, 4 warps): loads each K/V tile through registers, V
//   transposed by scalar stores, then computes; the first kernel, kept for comparison
//   (`LAYERTAP_ATTENTION_KERNEL=simple`).
// - `pipelined_attention_w{4,8}_*` (16 query rows per warp): K and V tiles stream into dynamic
//   shared memory with cp.async in two stages, so the next tile's loads overlap this tile's
//   products; both stay row-major [key][dim] and reach the tensor cores through ldmatrix (.trans
//   for V). A warp skips the key tiles that none of its rows can see.
// - `wide_attention_*` (128 query rows): the pipelined kernel with 32 rows per warp (two groups
//   of 16 sharing every K/V fragment) and Q staged in shared memory; the default for head dims
//   64 and 128 (the host picks).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mma.cuh"

#define PAD 8

// Loads two consecutive 16-bit values as one register, zero past `valid`.
template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* row, bool valid) {
    return valid ? *reinterpret_cast<const uint32_t*>(row) : 0u;
}

// The A fragments of a warp's 16 query rows (row0..row0+15 of its sequence), zero past the
// sequence's end: what the first two kernels keep in registers for the whole key loop.
template <typename T, int D>
__device__ __forceinline__ void load_q_frags(uint32_t (&qf)[D / 16][4], const T* q, int seq_start, int seq_len,
                                             int row0, int head, int q_stride, int lane) {
    const int g = lane / 4, t = lane % 4;
    const int row_a = row0 + g, row_b = row_a + 8;
    const T* qa = q + (size_t)(seq_start + row_a) * q_stride + head * D;
    const T* qb = q + (size_t)(seq_start + row_b) * q_stride + head * D;
    const bool va = row_a < seq_len, vb = row_b < seq_len;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk * 16 + 2 * t;
        qf[kk][0] = load_pair(qa + c, va);
        qf[kk][1] = load_pair(qb + c, vb);
        qf[kk][2] = load_pair(qa + c + 8, va);
        qf[kk][3] = load_pair(qb + c + 8, vb);
    }
}

// What one warp carries along the keys for 16 query rows: the running output, and the running
// maximum (log2 domain) and this thread's share of the row sums, for rows g and g + 8 of the 16
// (a and b).
template <typename T, int D>
struct RowState {
    static constexpr int KSTEPS = D / 16;
    static constexpr int NT = D / 8;  // output column tiles
    float o[NT][4];
    float m_a, m_b, l_a, l_b;
    int row_a, row_b;  // this thread's query rows, as positions in the sequence

    __device__ __forceinline__ void init(int row0, int lane) {
        row_a = row0 + lane / 4;
        row_b = row_a + 8;
#pragma unroll
        for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
        m_a = m_b = -INFINITY;
        l_a = l_b = 0.f;
    }

    // Scales and masks the scores `s` of keys k0..k0+BN-1, updates the online softmax (rescaling
    // the output) and leaves the probabilities, rounded to T, in `pf` as mma A fragments.
    // `full`: every key of the tile is visible to every row of the warp (no mask needed).
    template <int BN>
    __device__ __forceinline__ void softmax(float (&s)[BN / 8][4], uint32_t (&pf)[BN / 16][4], int k0, bool full,
                                            int seq_len, int window, float scale_log2, int lane) {
        const int t = lane % 4;
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
    }

    // The factor that normalises a row whose sum is `l` relative to the maximum `m` (log2
    // domain): 1 / l, or with a sink logit `sink` (log2 domain; -inf: none) in the softmax, the
    // row's probabilities over the sum of its keys' terms and the sink's, both taken relative
    // to the larger of `m` and `sink` (the sink's probability is dropped, as the reference does).
    static __device__ __forceinline__ float normaliser(float l, float m, float sink) {
        if (!(l > 0.f)) return 0.f;
        if (sink == -INFINITY) return 1.f / l;
        const float top = fmaxf(m, sink);
        const float keys = exp2f(m - top);
        return keys / (l * keys + exp2f(sink - top));
    }

    // Row sums across the four threads of each group, then normalise and store. `sink`: the
    // head's sink logit in the log2 domain, -inf where there is none.
    __device__ __forceinline__ void store(T* out, int seq_start, int seq_len, int head, int q_stride, int lane,
                                          float sink) {
        const int t = lane % 4;
        l_a += __shfl_xor_sync(0xffffffff, l_a, 1);
        l_a += __shfl_xor_sync(0xffffffff, l_a, 2);
        l_b += __shfl_xor_sync(0xffffffff, l_b, 1);
        l_b += __shfl_xor_sync(0xffffffff, l_b, 2);
        const float inv_a = normaliser(l_a, m_a, sink);
        const float inv_b = normaliser(l_b, m_b, sink);
        T* oa = out + (size_t)(seq_start + row_a) * q_stride + head * D;
        T* ob = out + (size_t)(seq_start + row_b) * q_stride + head * D;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int c = n * 8 + 2 * t;
            if (row_a < seq_len) *reinterpret_cast<uint32_t*>(oa + c) = Mma<T>::pack(o[n][0] * inv_a, o[n][1] * inv_a);
            if (row_b < seq_len) *reinterpret_cast<uint32_t*>(ob + c) = Mma<T>::pack(o[n][2] * inv_b, o[n][3] * inv_b);
        }
    }
};

// Head `head`'s sink logit in the log2 domain (the scores' domain: they are scaled by
// scale * log2 e, the sinks are in the scaled scores' units), -inf where the model has none.
__device__ __forceinline__ float sink_log2(const float* sinks, int head) {
    return sinks == nullptr ? -INFINITY : sinks[head] * 1.4426950408889634f;
}

// Whether every key of tile k0..k0+BN-1 is visible to every one of the 16 rows starting at `w0`
// (then no mask is needed).
template <int BN>
__device__ __forceinline__ bool tile_full(int k0, int w0, int seq_len, int window) {
    return (k0 + BN <= w0 + 1) && (k0 + BN <= seq_len) && (window <= 0 || w0 + 15 - k0 < window);
}

// Whether any of the 16 rows starting at `w0` sees a key of tile k0..k0+BN-1: not past its last
// row (causal), not wholly before its first row's window, and the rows not all past the
// sequence's end. Groups of rows skip the tiles they cannot see.
template <int BN>
__device__ __forceinline__ bool tile_seen(int k0, int w0, int seq_len, int window) {
    return w0 < seq_len && k0 <= w0 + 15 && (window <= 0 || k0 + BN - 1 > w0 - window);
}

// A block's work: query tile `q0 / BM` of one sequence for one head, and the key tiles it can
// see (causal up to its last query, and the window below its first): `steps` tiles of BN from
// `k_begin`.
template <int BM, int BN>
struct Work {
    int seq_start, seq_len, q0, head, kv_head, q_stride, kv_stride, k_begin, steps;

    __device__ __forceinline__ Work(const uint32_t* tiles, int heads, int kv_heads, int d, int window) {
        const int tile = blockIdx.x;
        head = blockIdx.y;
        seq_start = tiles[3 * tile];
        seq_len = tiles[3 * tile + 1];
        q0 = tiles[3 * tile + 2] * BM;
        kv_head = head / (heads / kv_heads);
        q_stride = heads * d;
        kv_stride = kv_heads * d;
        const int q_last = min(q0 + BM, seq_len);
        k_begin = window > 0 ? max(0, q0 - window + 1) / BN * BN : 0;
        steps = (q_last - k_begin + BN - 1) / BN;
    }
};

// The first kernel: 64 query rows, 4 warps, K/V tiles loaded through registers.
template <typename T, int D, int BN>
__device__ void attention_tile(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                               T* __restrict__ out, const uint32_t* __restrict__ tiles, int heads, int kv_heads,
                               float scale_log2, int window, const float* __restrict__ sinks) {
    constexpr int BM = 64, WARPS = 4;
    // K tile row-major [key][dim]; V tile transposed [dim][key], so both feed mma from 32-bit loads.
    __shared__ __align__(16) T ks[BN][D + PAD];
    __shared__ __align__(16) T vt[D][BN + PAD];

    const Work<BM, BN> w(tiles, heads, kv_heads, D, window);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    RowState<T, D> st;
    st.init(w.q0 + warp * 16, lane);
    uint32_t qf[D / 16][4];
    load_q_frags<T, D>(qf, q, w.seq_start, w.seq_len, w.q0 + warp * 16, w.head, w.q_stride, lane);
    constexpr int KSTEPS = RowState<T, D>::KSTEPS, NT = RowState<T, D>::NT;

    for (int i = 0; i < w.steps; ++i) {
        const int k0 = w.k_begin + i * BN;
        __syncthreads();  // the previous tile's readers are done
        // Cooperative load: 16-byte chunks; keys past the sequence are zero.
        constexpr int CHUNKS = D / 8;
        for (int c = threadIdx.x; c < BN * CHUNKS; c += WARPS * 32) {
            const int r = c % BN;
            const int col = (c / BN) * 8;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (k0 + r < w.seq_len) {
                const size_t at = (size_t)(w.seq_start + k0 + r) * w.kv_stride + w.kv_head * D + col;
                kv4 = *reinterpret_cast<const uint4*>(k + at);
                vv4 = *reinterpret_cast<const uint4*>(v + at);
            }
            *reinterpret_cast<uint4*>(&ks[r][col]) = kv4;
            const T* vv = reinterpret_cast<const T*>(&vv4);
#pragma unroll
            for (int e = 0; e < 8; ++e) vt[col + e][r] = vv[e];
        }
        __syncthreads();

        // S = Q K^T for the warp's 16 rows and this tile's keys.
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

        uint32_t pf[BN / 16][4];
        st.template softmax<BN>(s, pf, k0, tile_full<BN>(k0, w.q0 + warp * 16, w.seq_len, window), w.seq_len,
                                window, scale_log2, lane);

        // O += P V.
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const T* vr = &vt[n * 8 + g][kk * 16 + 2 * t];
                const uint32_t b0 = *reinterpret_cast<const uint32_t*>(vr);
                const uint32_t b1 = *reinterpret_cast<const uint32_t*>(vr + 8);
                Mma<T>::mma(st.o[n], pf[kk], b0, b1);
            }
        }
    }
    st.store(out, w.seq_start, w.seq_len, w.head, w.q_stride, lane, sink_log2(sinks, w.head));
}

// Rows `r0`..`r0 + rows - 1` of the sequence (positions), columns of head `head`, from a packed
// [tokens, stride] tensor into shared memory with row stride D + PAD, by cp.async: consecutive
// threads take consecutive 16-byte chunks of a row; rows past the sequence are zero.
template <typename T, int D, int THREADS>
__device__ __forceinline__ void stage_rows(T* dst, const T* src, int rows, int r0, int seq_start, int seq_len,
                                           int stride, int head) {
    constexpr int CHUNKS = D / 8, LD = D + PAD;
    for (int c = threadIdx.x; c < rows * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS;
        const int col = (c % CHUNKS) * 8;
        const bool ok = r0 + r < seq_len;
        const size_t at = ok ? (size_t)(seq_start + r0 + r) * stride + head * D + col : 0;
        cp_async16(dst + r * LD + col, src + at, ok);
    }
}

// Keys k0..k0+BN-1 of the block's sequence and KV head into one stage: the K tile, then the V
// tile, BN rows each.
template <typename T, int D, int BN, int THREADS, typename W>
__device__ __forceinline__ void stage_kv(T* stage, const T* k, const T* v, const W& w, int k0) {
    stage_rows<T, D, THREADS>(stage, k, BN, k0, w.seq_start, w.seq_len, w.kv_stride, w.kv_head);
    stage_rows<T, D, THREADS>(stage + BN * (D + PAD), v, BN, k0, w.seq_start, w.seq_len, w.kv_stride, w.kv_head);
}

// O += P V for MT groups of 16 rows (`st[j]`, probabilities `pf[j]`) from the V tile `vs`
// (row-major [key][dim], row stride D + PAD): one transposing ldmatrix gives the B fragments of
// two 8-column output tiles, which every group uses.
template <typename T, int D, int BN, int MT>
__device__ __forceinline__ void pv_product(RowState<T, D>* st, const uint32_t (*pf)[BN / 16][4], const T* vs,
                                           int lane) {
    constexpr int LD = D + PAD, NT = RowState<T, D>::NT;
    const int lm = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, vs + (kk * 16 + (lm & 1) * 8 + lr) * LD + (n + (lm >> 1)) * 8);
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                Mma<T>::mma(st[j].o[n], pf[j][kk], b[0], b[1]);
                Mma<T>::mma(st[j].o[n + 1], pf[j][kk], b[2], b[3]);
            }
        }
    }
}

// The pipelined kernel: 16 * WARPS query rows; dynamic shared memory of
// 2 stages x (K, V) x BN x (D + PAD) elements (see `shared_bytes` on the host).
template <typename T, int D, int BN, int WARPS>
__device__ void attention_tile_pipelined(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                         T* __restrict__ out, const uint32_t* __restrict__ tiles, int heads,
                                         int kv_heads, float scale_log2, int window, const float* __restrict__ sinks) {
    constexpr int BM = 16 * WARPS;
    constexpr int LD = D + PAD;  // row stride in elements: rows 16 bytes apart in banks, no conflicts
    constexpr int STAGE = 2 * BN * LD;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    T* smem = reinterpret_cast<T*>(attention_smem);

    const Work<BM, BN> w(tiles, heads, kv_heads, D, window);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int w0 = w.q0 + warp * 16;  // the warp's first query row

    // Keys k0..k0+BN-1 (K then V) into stage `stage`.
    auto load = [&](int stage, int k0) { stage_kv<T, D, BN, WARPS * 32>(smem + stage * STAGE, k, v, w, k0); };

    RowState<T, D> st;
    st.init(w0, lane);
    uint32_t qf[D / 16][4];
    load_q_frags<T, D>(qf, q, w.seq_start, w.seq_len, w0, w.head, w.q_stride, lane);
    constexpr int KSTEPS = RowState<T, D>::KSTEPS;
    const int lm = lane >> 3, lr = lane & 7;  // ldmatrix: this lane addresses row lr of matrix lm

    load(0, w.k_begin);
    cp_async_commit();
    for (int i = 0; i < w.steps; ++i) {
        const int k0 = w.k_begin + i * BN;
        cp_async_wait<0>();
        __syncthreads();  // tile i has landed for everyone, and tile i - 1's readers are done
        if (i + 1 < w.steps) load((i + 1) & 1, k0 + BN);
        cp_async_commit();

        if (!tile_seen<BN>(k0, w0, w.seq_len, window)) continue;
        const T* ks = smem + (i & 1) * STAGE;
        const T* vs = ks + BN * LD;

        // S = Q K^T: one ldmatrix gives the B fragments of two k-steps for 8 keys.
        float s[BN / 8][4];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2) {
                uint32_t b[4];
                ldmatrix_x4(b, ks + (n * 8 + lr) * LD + kk * 16 + lm * 8);
                Mma<T>::mma(s[n], qf[kk], b[0], b[1]);
                Mma<T>::mma(s[n], qf[kk + 1], b[2], b[3]);
            }
        }

        uint32_t pf[BN / 16][4];
        st.template softmax<BN>(s, pf, k0, tile_full<BN>(k0, w0, w.seq_len, window), w.seq_len, window, scale_log2,
                                lane);

        pv_product<T, D, BN, 1>(&st, &pf, vs, lane);
    }
    st.store(out, w.seq_start, w.seq_len, w.head, w.q_stride, lane, sink_log2(sinks, w.head));
}

// The wide kernel: 128 query rows; each warp owns MT groups of 16 consecutive rows, so every K
// and V fragment it reads from shared memory feeds MT products instead of one (shared-memory
// reads per product fall from 1/2 to 5/16 with MT = 2). The Q tile no longer fits in registers
// next to MT running outputs: it is staged in shared memory with the first K/V tile and read by
// ldmatrix at every tile. Dynamic shared memory: BM rows of Q, then 2 stages x (K, V) x BN rows,
// all of D + PAD elements. Each group of 16 rows meets the same key tiles in the same order with
// the same products as in the other kernels, so the output is bitwise theirs.
template <typename T, int D, int BN, int WARPS, int MT>
__device__ void attention_tile_wide(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                    T* __restrict__ out, const uint32_t* __restrict__ tiles, int heads, int kv_heads,
                                    float scale_log2, int window, const float* __restrict__ sinks) {
    constexpr int BM = 16 * MT * WARPS;
    constexpr int LD = D + PAD;
    constexpr int STAGE = 2 * BN * LD;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    T* qs = reinterpret_cast<T*>(attention_smem);
    T* kv = qs + BM * LD;

    const Work<BM, BN> w(tiles, heads, kv_heads, D, window);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int wr = warp * 16 * MT;  // the warp's first row within the tile
    auto load = [&](int stage, int k0) { stage_kv<T, D, BN, WARPS * 32>(kv + stage * STAGE, k, v, w, k0); };

    RowState<T, D> st[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) st[j].init(w.q0 + wr + 16 * j, lane);
    constexpr int KSTEPS = RowState<T, D>::KSTEPS;
    const int lm = lane >> 3, lr = lane & 7;  // ldmatrix: this lane addresses row lr of matrix lm

    stage_rows<T, D, WARPS * 32>(qs, q, BM, w.q0, w.seq_start, w.seq_len, w.q_stride, w.head);
    load(0, w.k_begin);
    cp_async_commit();
    for (int i = 0; i < w.steps; ++i) {
        const int k0 = w.k_begin + i * BN;
        cp_async_wait<0>();
        __syncthreads();  // tile i (and Q) has landed for everyone, and tile i - 1's readers are done
        if (i + 1 < w.steps) load((i + 1) & 1, k0 + BN);
        cp_async_commit();

        bool any = false;
#pragma unroll
        for (int j = 0; j < MT; ++j) any = any || tile_seen<BN>(k0, w.q0 + wr + 16 * j, w.seq_len, window);
        if (!any) continue;
        const T* ks = kv + (i & 1) * STAGE;
        const T* vs = ks + BN * LD;

        // S = Q K^T, two k-steps at a time: the groups' A fragments (x4: rows lane % 16, columns
        // 8 (lane / 16)), then per 8 keys one ldmatrix of B for all groups.
        float s[MT][BN / 8][4];
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) s[j][n][0] = s[j][n][1] = s[j][n][2] = s[j][n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk += 2) {
            uint32_t a[MT][2][4];
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                const T* qr = qs + (wr + 16 * j + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8;
                ldmatrix_x4(a[j][0], qr);
                ldmatrix_x4(a[j][1], qr + 16);
            }
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                uint32_t b[4];
                ldmatrix_x4(b, ks + (n * 8 + lr) * LD + kk * 16 + lm * 8);
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    Mma<T>::mma(s[j][n], a[j][0], b[0], b[1]);
                    Mma<T>::mma(s[j][n], a[j][1], b[2], b[3]);
                }
            }
        }

        // A group that cannot see this tile (the tile wholly past its rows or before their
        // window) gets only masked scores: probabilities of zero that leave its state as it was.
        uint32_t pf[MT][BN / 16][4];
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int r0 = w.q0 + wr + 16 * j;
            st[j].template softmax<BN>(s[j], pf[j], k0, tile_full<BN>(k0, r0, w.seq_len, window), w.seq_len, window,
                                       scale_log2, lane);
        }

        pv_product<T, D, BN, MT>(st, pf, vs, lane);
    }
#pragma unroll
    for (int j = 0; j < MT; ++j) st[j].store(out, w.seq_start, w.seq_len, w.head, w.q_stride, lane, sink_log2(sinks, w.head));
}

#define ATTENTION_KERNEL(NAME, T, D, BN)                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                                         \
        NAME(const T* q, const T* k, const T* v, T* out, const uint32_t* tiles, int heads, int kv_heads,      \
             float scale_log2, int window, const float* sinks) {                                               \
        attention_tile<T, D, BN>(q, k, v, out, tiles, heads, kv_heads, scale_log2, window, sinks);          \
    }

#define PIPELINED_KERNEL(NAME, T, D, BN, WARPS)                                                               \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        NAME(const T* q, const T* k, const T* v, T* out, const uint32_t* tiles, int heads, int kv_heads,      \
             float scale_log2, int window, const float* sinks) {                                               \
        attention_tile_pipelined<T, D, BN, WARPS>(q, k, v, out, tiles, heads, kv_heads, scale_log2, window,  \
                                                  sinks);                                                      \
    }

#define WIDE_KERNEL(NAME, T, D, BN, WARPS, MT)                                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        NAME(const T* q, const T* k, const T* v, T* out, const uint32_t* tiles, int heads, int kv_heads,      \
             float scale_log2, int window, const float* sinks) {                                               \
        attention_tile_wide<T, D, BN, WARPS, MT>(q, k, v, out, tiles, heads, kv_heads, scale_log2, window,   \
                                                 sinks);                                                       \
    }

// Keys per tile: 64, and 32 for head dimension 256 (Qwen3.5's full-attention layers), where a
// 64-key tile of K and V would not fit the first kernel's 48 KiB of static shared memory (the
// pipelined kernel keeps the same tiles, two stages of them).
ATTENTION_KERNEL(packed_attention_bf16_d64, __nv_bfloat16, 64, 64)
ATTENTION_KERNEL(packed_attention_bf16_d128, __nv_bfloat16, 128, 64)
ATTENTION_KERNEL(packed_attention_bf16_d256, __nv_bfloat16, 256, 32)
ATTENTION_KERNEL(packed_attention_f16_d64, __half, 64, 64)
ATTENTION_KERNEL(packed_attention_f16_d128, __half, 128, 64)
ATTENTION_KERNEL(packed_attention_f16_d256, __half, 256, 32)

PIPELINED_KERNEL(pipelined_attention_w4_bf16_d64, __nv_bfloat16, 64, 64, 4)
PIPELINED_KERNEL(pipelined_attention_w4_bf16_d128, __nv_bfloat16, 128, 64, 4)
PIPELINED_KERNEL(pipelined_attention_w4_bf16_d256, __nv_bfloat16, 256, 32, 4)
PIPELINED_KERNEL(pipelined_attention_w4_f16_d64, __half, 64, 64, 4)
PIPELINED_KERNEL(pipelined_attention_w4_f16_d128, __half, 128, 64, 4)
PIPELINED_KERNEL(pipelined_attention_w4_f16_d256, __half, 256, 32, 4)
PIPELINED_KERNEL(pipelined_attention_w8_bf16_d64, __nv_bfloat16, 64, 64, 8)
PIPELINED_KERNEL(pipelined_attention_w8_bf16_d128, __nv_bfloat16, 128, 64, 8)
PIPELINED_KERNEL(pipelined_attention_w8_bf16_d256, __nv_bfloat16, 256, 32, 8)
PIPELINED_KERNEL(pipelined_attention_w8_f16_d64, __half, 64, 64, 8)
PIPELINED_KERNEL(pipelined_attention_w8_f16_d128, __half, 128, 64, 8)
PIPELINED_KERNEL(pipelined_attention_w8_f16_d256, __half, 256, 32, 8)
// The wide kernel: 4 warps of 32 rows for head dims 64 and 128; for 256, where MT = 2 running
// outputs would not fit in registers, 8 warps of 16 rows.
WIDE_KERNEL(wide_attention_bf16_d64, __nv_bfloat16, 64, 64, 4, 2)
WIDE_KERNEL(wide_attention_bf16_d128, __nv_bfloat16, 128, 64, 4, 2)
WIDE_KERNEL(wide_attention_bf16_d256, __nv_bfloat16, 256, 32, 8, 1)
WIDE_KERNEL(wide_attention_f16_d64, __half, 64, 64, 4, 2)
WIDE_KERNEL(wide_attention_f16_d128, __half, 128, 64, 4, 2)
WIDE_KERNEL(wide_attention_f16_d256, __half, 256, 32, 8, 1)
