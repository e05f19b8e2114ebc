// Next-token log-probabilities: the f32 log-softmax of each row of logits [rows, vocab] and its
// top k entries (k <= 64), in one block per row.
//
// 1. Each thread runs an online max / sum-of-exponentials over its strided share of the row; the
//    block combines them into the row's log-sum-exp (lse).
// 2. Each thread keeps its own k best (value, id) pairs, sorted, in registers or local memory
//    (a value enters only when it beats the thread's current k-th, so most are one compare).
// 3. k rounds of a block-wide argmax over the threads' heads: the winner is written out and its
//    thread moves on to its next candidate.
// Order: a larger value first; equal values by ascending id (a thread sees its ids in ascending
// order and keeps the earlier one first, and the argmax prefers the smaller id). NaN logits never
// enter a list. The outputs: ids (u32) and log-probabilities (value - lse) [rows, k], and for
// each row the log-probability of targets[row] (NaN where targets[row] < 0).
//
// Built with --use_fast_math: expf and logf are the hardware approximations (relative error near
// 1e-7 on the log-sum-exp, far below what the f32 reference differs by).

#include <float.h>
#include <math.h>
#include <stdint.h>

#define LP_MAX_K 64
#define LP_THREADS 256

// (value, id) ranks before (v2, i2).
__device__ __forceinline__ bool lp_before(float v, uint32_t i, float v2, uint32_t i2) {
    return v > v2 || (v == v2 && i < i2);
}

extern "C" __global__ void __launch_bounds__(LP_THREADS)
topk_logprobs_f32(const float* __restrict__ logits, size_t vocab, int k, const int32_t* __restrict__ targets,
                  uint32_t* __restrict__ out_ids, float* __restrict__ out_lp, float* __restrict__ out_target) {
    const size_t row = blockIdx.x;
    const float* x = logits + row * vocab;
    const int tid = threadIdx.x;

    // 1. log-sum-exp.
    float m = -INFINITY, s = 0.f;
    for (size_t i = tid; i < vocab; i += LP_THREADS) {
        const float v = x[i];
        if (v == -INFINITY) continue;
        if (v > m) {
            s = s * expf(m - v) + 1.f;
            m = v;
        } else {
            s += expf(v - m);
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

    // 2. This thread's k best, sorted.
    float bv[LP_MAX_K];
    uint32_t bi[LP_MAX_K];
    int n = 0;
    for (size_t i = tid; i < vocab; i += LP_THREADS) {
        const float v = x[i];
        if (!(v == v)) continue;  // NaN
        if (n == k && !lp_before(v, (uint32_t)i, bv[k - 1], bi[k - 1])) continue;
        int j = (n < k) ? n++ : k - 1;
        while (j > 0 && lp_before(v, (uint32_t)i, bv[j - 1], bi[j - 1])) {
            bv[j] = bv[j - 1];
            bi[j] = bi[j - 1];
            --j;
        }
        bv[j] = v;
        bi[j] = (uint32_t)i;
    }

    // 3. k rounds of block argmax over the threads' heads.
    __shared__ float wv[LP_THREADS / 32];
    __shared__ uint32_t wi[LP_THREADS / 32];
    __shared__ uint32_t win;
    int head = 0;
    for (int r = 0; r < k; ++r) {
        float v = head < n ? bv[head] : -INFINITY;
        uint32_t i = head < n ? bi[head] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffff, v, o);
            const uint32_t i2 = __shfl_xor_sync(0xffffffff, i, o);
            if (lp_before(v2, i2, v, i)) {
                v = v2;
                i = i2;
            }
        }
        if (tid % 32 == 0) {
            wv[tid / 32] = v;
            wi[tid / 32] = i;
        }
        __syncthreads();
        if (tid == 0) {
            float bestv = wv[0];
            uint32_t besti = wi[0];
            for (int w = 1; w < LP_THREADS / 32; ++w) {
                if (lp_before(wv[w], wi[w], bestv, besti)) {
                    bestv = wv[w];
                    besti = wi[w];
                }
            }
            win = besti;
            out_ids[row * k + r] = besti == 0xffffffffu ? 0 : besti;
            out_lp[row * k + r] = besti == 0xffffffffu ? NAN : bestv - lse;
        }
        __syncthreads();
        // The thread whose head won moves on (ids are distinct, so exactly one does).
        if (head < n && bi[head] == win) ++head;
        __syncthreads();
    }
}
