//! The fused CPU attention for AVX-512, running `HB` query heads that share a key/value head
//! together: each key and value loaded serves all of them, and the `4 * HB` vector sums stay in
//! registers (AVX-512 has 32). The operations are those of the portable `Ctx::block`, in the
//! same order (multiplies and adds, never fused; the same `exp16`, the same softmax sums), so the
//! results are the same bits (tested).

use std::arch::x86_64::*;

use super::{exp16, Ctx, LANES};

impl Ctx<'_> {
    /// Query heads per pass: the largest of 4, 3, 2 that divides the heads sharing a key/value
    /// head, where the head size is a multiple of the lanes; else 1 (the portable block).
    pub(super) fn heads_per_pass(&self) -> usize {
        let group = self.heads / self.kv_heads;
        match self.d % LANES {
            0 => [4, 3, 2].into_iter().find(|hb| group.is_multiple_of(*hb)).unwrap_or(1),
            _ => 1,
        }
    }

    /// Queries `i0..i0 + n` of the sequence starting at `start`, every head, into `dst`, `HB`
    /// heads of a group at a time. Needs `d % LANES == 0` and `HB` dividing the group.
    #[target_feature(enable = "avx512f")]
    pub(super) fn block_grouped<const HB: usize>(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        let (heads, d) = (self.heads, self.d);
        let group = heads / self.kv_heads;
        assert!(d % LANES == 0 && group.is_multiple_of(HB), "grouped attention: d {d}, group {group}, HB {HB}");
        let mut scores: [Vec<f32>; HB] = std::array::from_fn(|_| Vec::new());
        for i in i0..i0 + n {
            let p = i - start;
            let lo = start + self.window.map_or(0, |w| (p + 1).saturating_sub(w));
            let row = &mut dst[(i - i0) * heads * d..][..heads * d];
            for h0 in (0..heads).step_by(HB) {
                let kh = h0 / group;
                let sums = self.grouped_scores::<HB>(&mut scores, i, lo, h0, kh);
                self.grouped_values::<HB>(&mut row[h0 * d..][..HB * d], &scores, &sums, i, lo, kh);
            }
        }
    }

    /// Query `i`'s softmax weights over keys `lo..=i` for heads `h0..h0 + HB` into `scores`,
    /// unnormalised; returns each head's sum of them.
    #[target_feature(enable = "avx512f")]
    fn grouped_scores<const HB: usize>(
        &self,
        scores: &mut [Vec<f32>; HB],
        i: usize,
        lo: usize,
        h0: usize,
        kh: usize,
    ) -> [f32; HB] {
        let (d, tp) = (self.d, self.tp);
        let nk = i + 1 - lo;
        let chunks = nk.div_ceil(LANES);
        let qs: [&[f32]; HB] = std::array::from_fn(|u| &self.qs[(i * self.heads + h0 + u) * d..][..d]);
        let kt = &self.kt[kh * d * tp..][..d * tp];
        for s in scores.iter_mut() {
            s.clear();
            s.resize(chunks * LANES, 0.0);
        }
        let mut maxes = [_mm512_set1_ps(f32::NEG_INFINITY); HB];
        let (scale, neg_inf) = (_mm512_set1_ps(self.scale), _mm512_set1_ps(f32::NEG_INFINITY));
        let mut c = 0;
        while c < chunks {
            let m = if chunks - c >= 4 { 4 } else { 1 };
            let j0 = lo + c * LANES;
            let s = match m {
                4 => chunk_sums::<HB, 4>(&qs, &kt[j0..], tp, d),
                _ => widen(chunk_sums::<HB, 1>(&qs, &kt[j0..], tp, d)),
            };
            for u in 0..HB {
                for (w, &su) in s[u].iter().enumerate().take(m) {
                    let at = (c + w) * LANES;
                    let valid = (nk - at).min(LANES);
                    let keep: __mmask16 = if valid == LANES { 0xffff } else { (1u16 << valid) - 1 };
                    let v = _mm512_mask_blend_ps(keep, neg_inf, _mm512_mul_ps(su, scale));
                    let dst: &mut [f32; LANES] = (&mut scores[u][at..at + LANES]).try_into().expect("16 scores");
                    // SAFETY: `dst` holds 16 values.
                    unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) };
                    maxes[u] = _mm512_max_ps(maxes[u], v);
                }
            }
            c += m;
        }
        std::array::from_fn(|u| {
            let mut lane_max = [0f32; LANES];
            // SAFETY: `lane_max` holds 16 values.
            unsafe { _mm512_storeu_ps(lane_max.as_mut_ptr(), maxes[u]) };
            let max = self.with_sink(h0 + u, lane_max.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)));
            let mut sums = [0f32; LANES];
            for out in scores[u].chunks_exact_mut(LANES) {
                let w: &mut [f32; LANES] = out.try_into().expect("LANES scores");
                for v in w.iter_mut() {
                    *v -= max;
                }
                exp16(w);
                for l in 0..LANES {
                    sums[l] += w[l];
                }
            }
            self.denominator(h0 + u, max, &sums)
        })
    }

    /// `out` (`HB` heads' rows of `d`) = the values of keys `lo..=i` of key/value head `kh`
    /// weighted by each head's `scores`, divided by its `sums`; each element's sum runs over the
    /// keys in order, up to four 16-column pieces at a time.
    #[target_feature(enable = "avx512f")]
    fn grouped_values<const HB: usize>(
        &self,
        out: &mut [f32],
        scores: &[Vec<f32>; HB],
        sums: &[f32; HB],
        i: usize,
        lo: usize,
        kh: usize,
    ) {
        let (kv_heads, d) = (self.kv_heads, self.d);
        let mut g0 = 0;
        while g0 < d {
            let m = if d - g0 >= 4 * LANES { 4 } else { 1 };
            let a = match m {
                4 => piece_sums::<HB, 4>(scores, &self.vs[kh * d + g0..], kv_heads * d, lo, i),
                _ => widen(piece_sums::<HB, 1>(scores, &self.vs[kh * d + g0..], kv_heads * d, lo, i)),
            };
            for u in 0..HB {
                let sum = _mm512_set1_ps(sums[u]);
                for (k, &ak) in a[u].iter().enumerate().take(m) {
                    let o = &mut out[u * d + g0 + k * LANES..][..LANES];
                    // SAFETY: `o` holds 16 values.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), _mm512_div_ps(ak, sum)) };
                }
            }
            g0 += m * LANES;
        }
    }
}

/// The scores of `HB` queries (`qs`, each `d` long) against `M` chunks of 16 keys (`kt`: row
/// `dd` at `dd * tp`, the chunks side by side), unscaled: each lane a sum over `dd` in order.
#[target_feature(enable = "avx512f")]
#[inline]
fn chunk_sums<const HB: usize, const M: usize>(
    qs: &[&[f32]; HB],
    kt: &[f32],
    tp: usize,
    d: usize,
) -> [[__m512; M]; HB] {
    let mut s = [[_mm512_setzero_ps(); M]; HB];
    for dd in 0..d {
        let at = &kt[dd * tp..][..M * LANES];
        // SAFETY: `at` holds `M` chunks of 16 values.
        let r: [__m512; M] = std::array::from_fn(|w| unsafe { _mm512_loadu_ps(at.as_ptr().add(w * LANES)) });
        for u in 0..HB {
            let qv = _mm512_set1_ps(qs[u][dd]);
            for w in 0..M {
                s[u][w] = _mm512_add_ps(s[u][w], _mm512_mul_ps(qv, r[w]));
            }
        }
    }
    s
}

/// `M` 16-column pieces of the weighted values of `HB` heads: row `j` of `vs` at
/// `j * stride`, weighted by `scores[u][j - lo]`, summed over keys `lo..=i` in order.
#[target_feature(enable = "avx512f")]
#[inline]
fn piece_sums<const HB: usize, const M: usize>(
    scores: &[Vec<f32>; HB],
    vs: &[f32],
    stride: usize,
    lo: usize,
    i: usize,
) -> [[__m512; M]; HB] {
    let mut a = [[_mm512_setzero_ps(); M]; HB];
    for (jj, j) in (lo..=i).enumerate() {
        let at = &vs[j * stride..][..M * LANES];
        // SAFETY: `at` holds `M` pieces of 16 values.
        let v: [__m512; M] = std::array::from_fn(|k| unsafe { _mm512_loadu_ps(at.as_ptr().add(k * LANES)) });
        for u in 0..HB {
            let w = _mm512_set1_ps(scores[u][jj]);
            for k in 0..M {
                a[u][k] = _mm512_add_ps(a[u][k], _mm512_mul_ps(w, v[k]));
            }
        }
    }
    a
}

/// One vector per head as the first of four (the rest zero, never read).
#[target_feature(enable = "avx512f")]
#[inline]
fn widen<const HB: usize>(x: [[__m512; 1]; HB]) -> [[__m512; 4]; HB] {
    x.map(|[v]| [v, _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()])
}
