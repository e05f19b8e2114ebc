// Next-token log-probabilities: the f32 log-softmax of each row of logits [rows, vocab] and its
// top k entries (k <= 64), in one block per row.
//
// 1. Each thread runs an online max / sum-of-exponentials over its strided share of the row (its
//    loads batched LP_LSE_LOADS at a time, the values folded in one by one in id order); the
//    block combines them into the row's log-sum-exp (lse).
// 2. Radix select of the k'-th best value. Each value gets an order-preserving u32 key: the float's
//    bits with the sign bit set for x >= 0 and all bits flipped for x < 0, so keys compare as the
//    values do. +0, -0 and the subnormals all take the key of +0: the kernel is built with
//    --use_fast_math, whose float compares flush subnormals to zero, so these values are equal
//    and go by id (their log-probability, x - lse, is -lse for all of them alike). NaN gets key 0,
//    below every value's (-inf's key is 0x007fffff), and is never counted nor selected.
//    Up to three passes over the row, on bits 31..21, 20..10 and 9..0 of the key: a histogram in
//    shared memory of the keys that share the digits chosen so far (the lanes of a warp that hit
//    the same bin add once, so a row of equal values costs no more than any other), then a block
//    scan of the bins from the top finds the bin holding the k'-th best, k' = min(k, the number
//    of values that are not NaN), and rem, how many of that bin are needed (the k' - rem keys
//    above the bin are all taken). The passes stop once the whole bin is needed (rem equals its
//    count); otherwise after the third the bin is a single key and rem picks among equal values.
// 3. One more pass over the row in tiles, in ascending id: the ids before the first 16-byte
//    aligned one, then tiles of 4 * 256 read as float4 (thread t holds ids 4t..4t+3 of the
//    tile), then the ids after the last whole float4. Every key above the bin is taken, and of the
//    keys in the bin the first rem by id: a block-wide exclusive scan of the per-thread counts
//    ranks them across threads and tiles. The pass stops once all k' are found. The k'
//    candidates, in shared memory, are ranked by counting (key descending, id ascending) and
//    written out.
//    The row is read 3 to 5 times (once for the lse, 1 to 3 histograms, the candidates), each time
//    streaming, with two float4 loads per thread in flight.
// Order: a larger value first; equal values by ascending id. NaN logits are never selected; where
// a row has fewer than k non-NaN values, the slots past them get id 0 and a NaN log-probability.
// -inf values are values like the others (ranked last). The outputs: ids (u32) and
// log-probabilities (value - lse) [rows, k], and for each row the log-probability of
// targets[row] (NaN where targets[row] < 0).
//
// Built with --use_fast_math: expf and logf are the hardware approximations (relative error near
// 1e-7 on the log-sum-exp, far below what the f32 reference differs by). The selection works on
// integer keys only.

#include <float.h>
#include <math.h>
#include <stdint.h>

#define LP_MAX_K 64
#define LP_THREADS 256
#define LP_WARPS (LP_THREADS / 32)
// Loads in flight per thread in the log-sum-exp pass.
#define LP_LSE_LOADS 8
// Histogram bins: 11 bits of the key per pass (the last pass 10).
#define LP_BINS 2048

static_assert(LP_BINS % LP_THREADS == 0 && 1024 % LP_THREADS == 0, "each thread scans whole bins");
static_assert(LP_MAX_K <= LP_THREADS, "one thread per output slot");

// The order-preserving key of a logit (see the header); 0 for NaN.
__device__ __forceinline__ uint32_t lp_key(float v) {
    uint32_t b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN
    if ((b & 0x7f800000u) == 0u) b = 0u;             // +-0 and subnormals: +0
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Adds this thread's N keys that are not NaN and match `prefix` under `mask` to their bin
// (key >> shift) & dmask. Every lane of the warp calls it; lanes with the same bin add once.
template <int N>
__device__ __forceinline__ void lp_count(uint32_t* hist, const uint32_t (&key)[N], uint32_t prefix, uint32_t mask,
                                         int shift, uint32_t dmask, int lane) {
    bool any = false;
    for (int j = 0; j < N; ++j) any |= key[j] != 0u && (key[j] & mask) == prefix;
    if (!__any_sync(0xffffffffu, any)) return;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const bool on = key[j] != 0u && (key[j] & mask) == prefix;
        const uint32_t d = on ? (key[j] >> shift) & dmask : 0xffffffffu;
        const unsigned peers = __match_any_sync(0xffffffffu, d);
        if (on && lane == __ffs(peers) - 1) atomicAdd(&hist[d], (uint32_t)__popc(peers));
    }
}

// The sum of v over the threads before this one in the block; *total gets the sum over all.
// ws (LP_WARPS words) must not be written again by any thread before all have returned: callers
// alternate two buffers between consecutive calls with no __syncthreads() between them.
__device__ __forceinline__ uint32_t lp_block_scan(uint32_t v, uint32_t* ws, uint32_t* total, int lane) {
    uint32_t inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) ws[threadIdx.x / 32] = inc;
    __syncthreads();
    uint32_t before = 0, sum = 0;
#pragma unroll
    for (int w = 0; w < LP_WARPS; ++w) {
        const uint32_t t = ws[w];
        if (w < (int)(threadIdx.x / 32)) before += t;
        sum += t;
    }
    *total = sum;
    return before + inc - v;
}

extern "C" __global__ void __launch_bounds__(LP_THREADS)
topk_logprobs_f32(const float* __restrict__ logits, size_t vocab, int k, const int32_t* __restrict__ targets,
                  uint32_t* __restrict__ out_ids, float* __restrict__ out_lp, float* __restrict__ out_target) {
    const size_t row = blockIdx.x;
    const float* x = logits + row * vocab;
    const int tid = threadIdx.x;

    // 1. log-sum-exp.
    float m = -INFINITY, s = 0.f;
    // LP_LSE_LOADS loads in flight per thread; the values are folded in one at a time, in the
    // order of a plain strided loop and with the same operations (an id past the row reads as
    // -inf, which is skipped), so the sums are those of one load at a time.
    for (size_t i0 = tid; i0 < vocab; i0 += LP_LSE_LOADS * LP_THREADS) {
        float vs[LP_LSE_LOADS];
#pragma unroll
        for (int q = 0; q < LP_LSE_LOADS; ++q) {
            const size_t i = i0 + (size_t)q * LP_THREADS;
            vs[q] = i < vocab ? x[i] : -INFINITY;
        }
#pragma unroll
        for (int q = 0; q < LP_LSE_LOADS; ++q) {
            const float v = vs[q];
            if (v == -INFINITY) continue;
            if (v > m) {
                s = s * expf(m - v) + 1.f;
                m = v;
            } else {
                s += expf(v - m);
            }
        }
    }
    __shared__ float sm[LP_THREADS / 32], ss[LP_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffff, m, o);
        const float s2 = __shfl_xor_sync(0xffffffff, s, o);
        const float mm = fmaxf(m, m2);
        s = (mm == -INFINITY) ? 0.f : s * expf(m - mm) + s2 * expf(m2 - mm);
        m = mm;
    }
    if (tid % 32 == 0) {
        sm[tid / 32] = m;
        ss[tid / 32] = s;
    }
    __syncthreads();
    __shared__ float lse_s;
    if (tid == 0) {
        float mm = -INFINITY;
        for (int w = 0; w < LP_THREADS / 32; ++w) mm = fmaxf(mm, sm[w]);
        float tot = 0.f;
        for (int w = 0; w < LP_THREADS / 32; ++w) tot += (sm[w] == -INFINITY) ? 0.f : ss[w] * expf(sm[w] - mm);
        lse_s = mm + logf(tot);
    }
    __syncthreads();
    const float lse = lse_s;
    if (tid == 0) {
        const int32_t t = targets[row];
        out_target[row] = (t >= 0 && (size_t)t < vocab) ? x[t] - lse : NAN;
    }

    // 2. Radix select of the k'-th best key.
    const int lane = tid % 32;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
    // Ids [0, h) and [h + 4 * nvec, vocab) one at a time, [h, h + 4 * nvec) as aligned float4.
    const size_t h0 = ((16 - (addr & 15)) & 15) / 4;
    const size_t h = h0 < vocab ? h0 : vocab;
    const size_t nvec = (vocab - h) / 4;
    const size_t tail = vocab - h - 4 * nvec;
    const float4* __restrict__ xv = reinterpret_cast<const float4*>(x + h);
    // This thread's element of the head-and-tail step (at most 6 ids: thread t < h takes id t,
    // thread h + j takes id h + 4 * nvec + j).
    const size_t edge_id = (size_t)tid < h ? (size_t)tid : h + 4 * nvec + (size_t)(tid - h);
    const bool edge_in = (size_t)tid < h || ((size_t)tid >= h && (size_t)(tid - h) < tail);

    __shared__ uint32_t hist[LP_BINS];
    __shared__ uint32_t ws[2][LP_WARPS];
    __shared__ uint32_t sel[3];
    uint32_t prefix = 0, mask = 0;  // the key bits chosen so far
    uint32_t kk = 0, rem = 0;       // k' and how many of the chosen bin are needed
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        const uint32_t nb = pass == 2 ? 1024u : 2048u;
        for (int b = tid; b < LP_BINS; b += LP_THREADS) hist[b] = 0;
        __syncthreads();
        {
            uint32_t ek[1] = {edge_in ? lp_key(x[edge_id]) : 0u};
            lp_count(hist, ek, prefix, mask, shift, nb - 1, lane);
        }
        for (size_t base = 0; base < nvec; base += 2 * LP_THREADS) {
            const size_t j0 = base + tid, j1 = base + LP_THREADS + tid;
            const float4 a = j0 < nvec ? xv[j0] : make_float4(0.f, 0.f, 0.f, 0.f);
            const float4 b = j1 < nvec ? xv[j1] : make_float4(0.f, 0.f, 0.f, 0.f);
            uint32_t key[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
            if (j0 < nvec) {
                key[0] = lp_key(a.x);
                key[1] = lp_key(a.y);
                key[2] = lp_key(a.z);
                key[3] = lp_key(a.w);
            }
            if (j1 < nvec) {
                key[4] = lp_key(b.x);
                key[5] = lp_key(b.y);
                key[6] = lp_key(b.z);
                key[7] = lp_key(b.w);
            }
            lp_count(hist, key, prefix, mask, shift, nb - 1, lane);
        }
        __syncthreads();
        // The bins from the top: thread t sums bins [nb - per * (t + 1), nb - per * t).
        const uint32_t per = nb / LP_THREADS;
        const uint32_t top = nb - per * (uint32_t)tid;
        uint32_t c = 0;
        for (uint32_t i = 1; i <= per; ++i) c += hist[top - i];
        uint32_t total;
        const uint32_t above = lp_block_scan(c, ws[0], &total, lane);
        if (pass == 0) {
            kk = total < (uint32_t)k ? total : (uint32_t)k;  // the non-NaN values, at most k
            rem = kk;
        }
        if (rem == 0) break;  // no non-NaN value (the same for every thread)
        if (above < rem && rem <= above + c) {
            uint32_t run = above;
            for (uint32_t i = 1; i <= per; ++i) {
                const uint32_t n = hist[top - i];
                if (run + n >= rem) {
                    sel[0] = top - i;
                    sel[1] = rem - run;
                    sel[2] = n;
                    break;
                }
                run += n;
            }
        }
        __syncthreads();
        prefix |= sel[0] << shift;
        mask |= (nb - 1) << shift;
        rem = sel[1];
        if (sel[2] == rem) break;  // the whole bin is taken
    }

    // 3. The candidates: the keys above the bin, then the first rem of the bin by id.
    __shared__ uint32_t ck[LP_MAX_K], ci[LP_MAX_K];
    __shared__ float cv[LP_MAX_K];
    const uint32_t hi = prefix | ~mask;  // keys above the bin are above hi
    const uint32_t gt = kk - rem;        // how many
    uint32_t got_gt = 0, got_eq = 0;     // found so far, in the tiles before (the same for every thread)
    int parity = 0;
    // One tile: this thread's n ids in ascending order; every thread of the block calls it.
    auto tile = [&](const uint32_t* key, const float* val, size_t id0, int n) {
        uint32_t cg = 0, ce = 0;
        for (int j = 0; j < n; ++j) {
            cg += key[j] > hi;
            ce += key[j] != 0u && (key[j] & mask) == prefix;
        }
        uint32_t total;
        // Both counts in one scan: at most 4 * LP_THREADS of each per tile, so 16 bits apiece.
        const uint32_t before = lp_block_scan((cg << 16) | ce, ws[parity], &total, lane);
        parity ^= 1;
        uint32_t pg = got_gt + (before >> 16), pe = got_eq + (before & 0xffffu);
        for (int j = 0; j < n; ++j) {
            int slot = -1;
            if (key[j] > hi) {
                slot = (int)pg++;
            } else if (key[j] != 0u && (key[j] & mask) == prefix) {
                if (pe < rem) slot = (int)(gt + pe);
                ++pe;
            }
            if (slot >= 0 && slot < LP_MAX_K) {
                ck[slot] = key[j];
                ci[slot] = (uint32_t)(id0 + j);
                cv[slot] = val[j];
            }
        }
        got_gt += total >> 16;
        got_eq += total & 0xffffu;
    };
    bool done = got_gt >= gt && got_eq >= rem;  // kk == 0: nothing to find
    if (!done) {
        float v = edge_in && (size_t)tid < h ? x[tid] : 0.f;
        uint32_t key = edge_in && (size_t)tid < h ? lp_key(v) : 0u;
        tile(&key, &v, tid, 1);
        done = got_gt >= gt && got_eq >= rem;
    }
    {
        // Two tiles' loads are in flight while one is counted.
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        float4 cur = !done && (size_t)tid < nvec ? xv[tid] : zero;
        float4 nxt = !done && (size_t)tid + LP_THREADS < nvec ? xv[tid + LP_THREADS] : zero;
        for (size_t base = 0; base < nvec && !done; base += LP_THREADS) {
            const size_t j = base + tid, j2 = j + 2 * LP_THREADS;
            const float4 after = j2 < nvec ? xv[j2] : zero;
            float val[4] = {cur.x, cur.y, cur.z, cur.w};
            uint32_t key[4] = {0u, 0u, 0u, 0u};
            if (j < nvec) {
                for (int q = 0; q < 4; ++q) key[q] = lp_key(val[q]);
            }
            tile(key, val, h + 4 * j, 4);
            done = got_gt >= gt && got_eq >= rem;
            cur = nxt;
            nxt = after;
        }
    }
    if (!done) {
        const bool in = edge_in && (size_t)tid >= h;
        float v = in ? x[edge_id] : 0.f;
        uint32_t key = in ? lp_key(v) : 0u;
        tile(&key, &v, edge_id, 1);
    }
    __syncthreads();

    // Rank the k' candidates (key descending, id ascending) and write them; the slots past k' get
    // id 0 and NaN.
    if ((uint32_t)tid < kk) {
        const uint32_t mk = ck[tid], mi = ci[tid];
        int r = 0;
        for (uint32_t j = 0; j < kk; ++j) r += ck[j] > mk || (ck[j] == mk && ci[j] < mi);
        out_ids[row * k + r] = mi;
        out_lp[row * k + r] = cv[tid] - lse;
    } else if (tid < k) {
        out_ids[row * k + tid] = 0;
        out_lp[row * k + tid] = NAN;
    }
}
