//! Causal attention over the packed batch on the CPU, in f32, fused: for each query, the scores
//! against the keys it may see (its own sequence, up to itself, within the sliding window), the
//! softmax and the weighted sum of the values, in one pass that never builds a score matrix or a
//! mask and skips the causal upper triangle. Blocks of queries run in parallel; each query's
//! result is computed the same way whatever else is in the batch.
//!
//! The scores and the exponentials run 16 keys at a time across vector lanes: the keys are
//! transposed once per call (`[kv_heads, d, T]`), so a query's 16 scores are 16 independent
//! sums over the head dimension in a fixed order, and `exp16` is a polynomial over 16 lanes.

use candle_core::{DType, Tensor};

use super::cpu_ops::f32s;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
#[path = "cpu_attention_avx512.rs"]
mod avx512;

/// Queries per work item.
const BLOCK: usize = 16;
/// Keys per chunk: the vector lanes of the scores, the exponentials and the softmax's sum.
const LANES: usize = 16;

/// Whether the fused kernel serves these inputs.
pub fn supported(q: &Tensor) -> bool {
    q.device().is_cpu() && q.dtype() == DType::F32
}

/// `exp(x)` for 16 lanes at once, `x <= 0` (softmax weights): `2^n * p(r)` with
/// `x = n ln 2 + r`, `|r| <= ln 2 / 2`, `p` a degree-6 polynomial (Horner, relative error about
/// 2e-7), and 0 below -87.3. A NaN stays NaN (a NaN score, or an infinite one less the
/// row's infinite maximum), so a non-finite query or key makes its row's output NaN, as the
/// reference's softmax does, never a finite value. Only adds, multiplies, compares and bit moves,
/// lane by lane, so the compiler vectorises it and every ISA gives the same bits.
#[inline(always)]
fn exp16(x: &mut [f32; LANES]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    for v in x.iter_mut() {
        let a = v.max(-87.3);
        let n = (a * LOG2E + ROUND) - ROUND;
        let r = (a - n * LN2_HI) - n * LN2_LO;
        let mut p = 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
        // `max` above turned a NaN into -87.3: the NaN is taken back here.
        *v = if *v < -87.3 {
            0.0
        } else if v.is_nan() {
            *v
        } else {
            p * scale
        };
    }
}

/// The first 16 values of `x` as an array (the compiler then keeps them in one vector).
#[inline(always)]
fn lanes(x: &[f32]) -> &[f32; LANES] {
    x[..LANES].try_into().expect("16 values")
}

/// What every block reads.
struct Ctx<'a> {
    qs: &'a [f32],
    /// The keys transposed, `[kv_heads, d, tp]`, each row zero past the batch's last token.
    kt: &'a [f32],
    tp: usize,
    vs: &'a [f32],
    heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f32,
    window: Option<usize>,
    /// One logit per query head joining each row's softmax (attention sinks).
    sinks: Option<&'a [f32]>,
}

impl Ctx<'_> {
    /// The softmax's maximum of head `h`'s row: its scores' `max`, or the sink where that is larger.
    #[inline(always)]
    fn with_sink(&self, h: usize, max: f32) -> f32 {
        self.sinks.map_or(max, |s| max.max(s[h]))
    }

    /// The sum of head `h`'s softmax weights `sums` (lane by lane) and of its sink's, all less
    /// `max`: the row's denominator.
    #[inline(always)]
    fn denominator(&self, h: usize, max: f32, sums: &[f32; LANES]) -> f32 {
        let sum: f32 = sums.iter().sum();
        match self.sinks {
            None => sum,
            Some(s) => {
                let mut x = [f32::NEG_INFINITY; LANES];
                x[0] = s[h] - max;
                exp16(&mut x);
                sum + x[0]
            }
        }
    }

    /// Queries `i0..i0 + n` of the sequence starting at `start`, every head, into `dst`. Compiled
    /// for AVX-512 or AVX2 where the CPU has it, portably otherwise: the same operations in the
    /// same order either way (the compiler neither reassociates nor fuses multiply-adds), so the
    /// same bits.
    fn run(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has the features the function is compiled for.
                return unsafe { self.run_avx512(dst, i0, n, start) };
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: as above.
                return unsafe { self.run_avx2(dst, i0, n, start) };
            }
        }
        self.block(dst, i0, n, start)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        match self.heads_per_pass() {
            4 => self.block_grouped::<4>(dst, i0, n, start),
            3 => self.block_grouped::<3>(dst, i0, n, start),
            2 => self.block_grouped::<2>(dst, i0, n, start),
            _ => self.block(dst, i0, n, start),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        self.block(dst, i0, n, start)
    }

    #[inline(always)]
    fn block(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        let (heads, kv_heads, d, tp) = (self.heads, self.kv_heads, self.d, self.tp);
        let group = heads / kv_heads;
        let mut scores: Vec<f32> = Vec::new();
        let mut acc = vec![0f32; d];
        for i in i0..i0 + n {
            let p = i - start;
            let lo = start + self.window.map_or(0, |w| (p + 1).saturating_sub(w));
            let nk = i + 1 - lo;
            let chunks = nk.div_ceil(LANES);
            for h in 0..heads {
                let kh = h / group;
                let qi = &self.qs[(i * heads + h) * d..][..d];
                let kt = &self.kt[kh * d * tp..][..d * tp];
                scores.clear();
                scores.resize(chunks * LANES, 0.0);
                let mut maxes = [f32::NEG_INFINITY; LANES];
                // Four chunks at a time keep four independent sums in flight; each lane's sum
                // runs over the head dimension in order, however the chunks are grouped.
                let mut c = 0;
                while c < chunks {
                    let m = if chunks - c >= 4 { 4 } else { 1 };
                    let mut s = [[0f32; LANES]; 4];
                    let j0 = lo + c * LANES;
                    if m == 4 {
                        let [mut s0, mut s1, mut s2, mut s3] = s;
                        for (dd, &qv) in qi.iter().enumerate() {
                            let at = dd * tp + j0;
                            let r0 = lanes(&kt[at..]);
                            let r1 = lanes(&kt[at + LANES..]);
                            let r2 = lanes(&kt[at + 2 * LANES..]);
                            let r3 = lanes(&kt[at + 3 * LANES..]);
                            for l in 0..LANES {
                                s0[l] += qv * r0[l];
                                s1[l] += qv * r1[l];
                                s2[l] += qv * r2[l];
                                s3[l] += qv * r3[l];
                            }
                        }
                        s = [s0, s1, s2, s3];
                    } else {
                        let mut s0 = [0f32; LANES];
                        for (dd, &qv) in qi.iter().enumerate() {
                            let r0 = lanes(&kt[dd * tp + j0..]);
                            for l in 0..LANES {
                                s0[l] += qv * r0[l];
                            }
                        }
                        s[0] = s0;
                    }
                    for (u, su) in s.iter().enumerate().take(m) {
                        let at = (c + u) * LANES;
                        let valid = (nk - at).min(LANES);
                        for l in 0..LANES {
                            let v = if l < valid { su[l] * self.scale } else { f32::NEG_INFINITY };
                            scores[at + l] = v;
                            maxes[l] = maxes[l].max(v);
                        }
                    }
                    c += m;
                }
                let max = self.with_sink(h, maxes.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)));
                let mut sums = [0f32; LANES];
                for out in scores.chunks_exact_mut(LANES) {
                    let w: &mut [f32; LANES] = out.try_into().expect("LANES scores");
                    for v in w.iter_mut() {
                        *v -= max;
                    }
                    exp16(w);
                    for l in 0..LANES {
                        sums[l] += w[l];
                    }
                }
                let sum = self.denominator(h, max, &sums);
                let o = &mut dst[((i - i0) * heads + h) * d..][..d];
                if d % LANES == 0 {
                    // Up to four 16-column pieces of the output at a time, in registers; each
                    // element's sum runs over the keys in order.
                    for g0 in (0..d).step_by(4 * LANES) {
                        if d - g0 >= 4 * LANES {
                            let (mut a0, mut a1, mut a2, mut a3) =
                                ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
                            for (j, &w) in (lo..=i).zip(scores.iter()) {
                                let at = (j * kv_heads + kh) * d + g0;
                                let v0 = lanes(&self.vs[at..]);
                                let v1 = lanes(&self.vs[at + LANES..]);
                                let v2 = lanes(&self.vs[at + 2 * LANES..]);
                                let v3 = lanes(&self.vs[at + 3 * LANES..]);
                                for l in 0..LANES {
                                    a0[l] += w * v0[l];
                                    a1[l] += w * v1[l];
                                    a2[l] += w * v2[l];
                                    a3[l] += w * v3[l];
                                }
                            }
                            for (u, au) in [a0, a1, a2, a3].iter().enumerate() {
                                let ou = &mut o[g0 + u * LANES..][..LANES];
                                for l in 0..LANES {
                                    ou[l] = au[l] / sum;
                                }
                            }
                        } else {
                            for g in (g0..d).step_by(LANES) {
                                let mut a0 = [0f32; LANES];
                                for (j, &w) in (lo..=i).zip(scores.iter()) {
                                    let v0 = lanes(&self.vs[(j * kv_heads + kh) * d + g..]);
                                    for l in 0..LANES {
                                        a0[l] += w * v0[l];
                                    }
                                }
                                let ou = &mut o[g..][..LANES];
                                for l in 0..LANES {
                                    ou[l] = a0[l] / sum;
                                }
                            }
                        }
                    }
                } else {
                    acc.iter_mut().for_each(|x| *x = 0.0);
                    for (j, &w) in (lo..=i).zip(scores.iter()) {
                        let vj = &self.vs[(j * kv_heads + kh) * d..][..d];
                        acc.iter_mut().zip(vj).for_each(|(a, x)| *a += w * x);
                    }
                    o.iter_mut().zip(&acc).for_each(|(o, a)| *o = a / sum);
                }
            }
        }
    }
}

/// The keys `[T, kv_heads, d]` as `[kv_heads, d, tp]`, each row zero past the last token so
/// every group of four 16-key chunks reads within its row; and `tp`.
fn transpose_keys(ks: &[f32], t: usize, kv_heads: usize, d: usize) -> (Vec<f32>, usize) {
    let tp = t + 4 * LANES;
    let mut kt = vec![0f32; kv_heads * d * tp];
    kt.par_chunks_mut(tp).enumerate().for_each(|(row, dst)| {
        let (kh, dd) = (row / d, row % d);
        for (j, x) in dst[..t].iter_mut().enumerate() {
            *x = ks[(j * kv_heads + kh) * d + dd];
        }
    });
    (kt, tp)
}

/// `q`: `[T, heads, d]`, `k`, `v`: `[T, kv_heads, d]`, f32 on the CPU, rope applied; `seqs`: the
/// `(start, len)` of each sequence; `sinks`: one logit per query head that joins each row's
/// softmax and is dropped after it. Returns `[T, heads * d]`.
pub fn packed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[(usize, usize)],
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) -> candle_core::Result<Tensor> {
    let (t, heads, d) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    if kv_heads == 0 || heads % kv_heads != 0 || k.dims() != [t, kv_heads, d] || v.dims() != k.dims() {
        candle_core::bail!("cpu attention: q {:?}, k {:?}, v {:?} do not fit", q.dims(), k.dims(), v.dims());
    }
    if sinks.is_some_and(|s| s.len() != heads) {
        candle_core::bail!("cpu attention: {} sinks for {heads} heads", sinks.map_or(0, <[f32]>::len));
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (qg, ql) = q.storage_and_layout();
    let (kg, kl) = k.storage_and_layout();
    let (vg, vl) = v.storage_and_layout();
    let qs = f32s(&qg, ql.start_offset(), t * heads * d)?;
    let ks = f32s(&kg, kl.start_offset(), t * kv_heads * d)?;
    let vs = f32s(&vg, vl.start_offset(), t * kv_heads * d)?;

    // Blocks of queries in token order: (first token, tokens, the sequence's start).
    let mut blocks = Vec::new();
    for &(start, len) in seqs {
        for b in (0..len).step_by(BLOCK) {
            blocks.push((start + b, BLOCK.min(len - b), start));
        }
    }
    let covered: usize = blocks.iter().map(|b| b.1).sum();
    if covered != t {
        candle_core::bail!("cpu attention: the sequences cover {covered} tokens, the batch has {t}");
    }
    let mut out = vec![0f32; t * heads * d];
    let mut parts = Vec::with_capacity(blocks.len());
    let mut rest: &mut [f32] = &mut out;
    for &(_, n, _) in &blocks {
        let (head, tail) = rest.split_at_mut(n * heads * d);
        parts.push(head);
        rest = tail;
    }
    let (kt, tp) = transpose_keys(ks, t, kv_heads, d);
    let ctx = Ctx { qs, kt: &kt, tp, vs, heads, kv_heads, d, scale, window, sinks };
    parts.into_par_iter().zip(blocks.par_iter()).for_each(|(dst, &(i0, n, start))| ctx.run(dst, i0, n, start));
    Tensor::from_vec(out, (t, heads * d), q.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::layers::sdpa::{chunk_masks, sequence_attention};
    use candle_core::Device;

    /// The fused kernel equals the portable path (scores, mask, softmax, matmul) per sequence,
    /// with grouped-query heads, a sliding window, a one-token sequence and a head size that is
    /// not a multiple of the lanes.
    #[test]
    fn fused_cpu_attention_equals_the_portable_path() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let seqs = [(0, 1), (1, 37), (38, 16), (54, 70)];
        let t = 124;
        for (heads, kv, d) in [(4, 2, 8), (3, 3, 20), (6, 1, 64)] {
            let q = Tensor::randn(0f32, 1.0, (t, heads, d), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (t, kv, d), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (t, kv, d), &dev)?;
            // Sinks both below and above the rows' largest scores.
            let sink_values: Vec<f32> = (0..heads).map(|h| [-2.0, 0.5, 3.0][h % 3]).collect();
            for (window, sinks) in
                [(None, None), (Some(5), None), (None, Some(&sink_values)), (Some(5), Some(&sink_values))]
            {
                let got = packed_attention(&q, &k, &v, &seqs, 0.3, window, sinks.map(|s| s.as_slice()))?;
                let sink_tensor = sinks.map(|s| Tensor::new(s.as_slice(), &dev)).transpose()?;
                for &(s, l) in &seqs {
                    let masks = chunk_masks(l, window, 1024, &dev)?;
                    let (qs, ks, vs) = (q.narrow(0, s, l)?, k.narrow(0, s, l)?, v.narrow(0, s, l)?);
                    let want = sequence_attention(&qs, &ks, &vs, 0.3, &masks, sink_tensor.as_ref())?;
                    let diff = (got.narrow(0, s, l)? - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    let case = format!("h{heads}/{kv} d{d} window {window:?} sinks {}", sinks.is_some());
                    assert!(diff < 1e-5, "{case} seq ({s}, {l}): max diff {diff}");
                }
            }
            // The sinks take weight off the values: the output differs from attention without them.
            let plain = packed_attention(&q, &k, &v, &seqs, 0.3, None, None)?;
            let sunk = packed_attention(&q, &k, &v, &seqs, 0.3, None, Some(&sink_values))?;
            assert!((plain - sunk)?.abs()?.max_all()?.to_scalar::<f32>()? > 1e-3);
        }
        Ok(())
    }

    /// A NaN in a query or a key makes the rows that read it NaN (the reference's softmax
    /// propagates it), and only those: a query's own row, or every later row for a key.
    #[test]
    fn a_nan_query_or_key_gives_nan_rows_not_numbers() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (t, heads, d) = (40, 2, 16);
        let q = Tensor::randn(0f32, 1.0, (t, heads, d), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (t, heads, d), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (t, heads, d), &dev)?;
        let poison = |x: &Tensor, row: usize| -> candle_core::Result<Tensor> {
            let mut vals = x.flatten_all()?.to_vec1::<f32>()?;
            vals[row * heads * d] = f32::NAN; // head 0, first component
            Tensor::from_vec(vals, x.dims(), &dev)
        };
        // Head 0's columns of each output row `[T, heads * d]`.
        let nan_rows = |o: &Tensor| -> candle_core::Result<Vec<bool>> {
            let o = o.narrow(1, 0, d)?.to_vec2::<f32>()?;
            Ok(o.iter().map(|r| r.iter().any(|x| x.is_nan())).collect())
        };
        let scale = 1.0 / (d as f32).sqrt();
        let attention = |q: &Tensor, k: &Tensor| packed_attention(q, k, &v, &[(0, t)], scale, None, None);
        let out = attention(&poison(&q, 7)?, &k)?;
        let rows = nan_rows(&out)?;
        assert!(rows[7], "the NaN query's row must be NaN");
        assert_eq!(rows.iter().filter(|&&b| b).count(), 1, "only that row: {rows:?}");
        let out = attention(&q, &poison(&k, 5)?)?;
        let rows = nan_rows(&out)?;
        assert_eq!(rows, (0..t).map(|i| i >= 5).collect::<Vec<_>>(), "every row that sees key 5");
        let mut x =
            [f32::NAN, -1.0, f32::NAN, 0.0, -100.0, -0.5, f32::NAN, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        exp16(&mut x);
        assert!(x[0].is_nan() && x[2].is_nan() && x[6].is_nan());
        assert_eq!(x[4], 0.0);
        assert!((x[1] - (-1f32).exp()).abs() < 1e-6);
        Ok(())
    }

    /// The vector exponential is within 3e-7 of f64's over the softmax's range, and 0 below it.
    #[test]
    fn exp16_is_accurate() {
        let mut worst = 0f64;
        for k in 0..200_000 {
            let mut x = [0f32; LANES];
            for (l, v) in x.iter_mut().enumerate() {
                *v = -87.0 * ((k * LANES + l) as f32 / (200_000 * LANES) as f32);
            }
            let want: Vec<f64> = x.iter().map(|&v| (v as f64).exp()).collect();
            exp16(&mut x);
            for (g, w) in x.iter().zip(&want) {
                worst = worst.max((*g as f64 - w).abs() / w);
            }
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        let mut x = [-88.0f32; LANES];
        x[1] = f32::NEG_INFINITY;
        exp16(&mut x);
        assert!(x.iter().all(|&v| v == 0.0), "{x:?}");
    }

    /// The AVX-512, AVX2 and portable builds of the kernel give the same bits: with 1, 2, 3 and 4
    /// query heads per key/value head (the AVX-512 build runs them together), head sizes of 64,
    /// 80 and 128 (pieces of 64 and 16 columns), a sliding window, and a block of queries in the
    /// middle of a sequence.
    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let t = 77;
        for (heads, kv, d) in [(4, 2, 64), (9, 3, 64), (8, 2, 128), (6, 2, 80), (3, 3, 64), (8, 1, 32)] {
            let noise = |rows: usize| {
                Tensor::randn(0f32, 1.0, (t, rows, d), &Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            let (q, k, v) = (noise(heads), noise(kv), noise(kv));
            let (kt, tp) = transpose_keys(&k, t, kv, d);
            let sink_values: Vec<f32> = (0..heads).map(|h| h as f32 - 1.5).collect();
            for (window, sinks) in [(None, None), (Some(20), None), (Some(20), Some(sink_values.as_slice()))] {
                let ctx = Ctx { qs: &q, kt: &kt, tp, vs: &v, heads, kv_heads: kv, d, scale: 0.125, window, sinks };
                // The whole of one sequence, then queries 40..56 of a sequence starting at 30.
                for (i0, n, start) in [(0, t, 0), (40, 16, 30)] {
                    let case = format!(
                        "heads {heads}/{kv}, d {d}, window {window:?}, sinks {}, queries {i0}+{n} from {start}",
                        sinks.is_some()
                    );
                    let mut portable = vec![0f32; n * heads * d];
                    ctx.block(&mut portable, i0, n, start);
                    #[cfg(target_arch = "x86_64")]
                    {
                        let mut other = vec![0f32; n * heads * d];
                        let same = |other: &[f32]| other.iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits());
                        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                            // SAFETY: the CPU has the features.
                            unsafe { ctx.run_avx2(&mut other, i0, n, start) };
                            assert!(same(&other), "AVX2 differs: {case}");
                        }
                        if std::arch::is_x86_feature_detected!("avx512f") {
                            // SAFETY: as above.
                            unsafe { ctx.run_avx512(&mut other, i0, n, start) };
                            assert!(same(&other), "AVX-512 differs: {case}");
                        }
                    }
                }
            }
        }
    }

    /// A sequence's rows are the same bits packed with others as alone.
    #[test]
    fn fused_cpu_attention_is_batch_invariant() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (heads, kv, d) = (4, 2, 64);
        let seqs = [(0, 50), (50, 3), (53, 90)];
        let q = Tensor::randn(0f32, 1.0, (143, heads, d), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (143, kv, d), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (143, kv, d), &dev)?;
        let all = packed_attention(&q, &k, &v, &seqs, 0.125, None, None)?;
        for &(s, l) in &seqs {
            let part = |x: &Tensor| x.narrow(0, s, l);
            let alone = packed_attention(&part(&q)?, &part(&k)?, &part(&v)?, &[(0, l)], 0.125, None, None)?;
            let diff = (part(&all)? - alone)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "sequence ({s}, {l}) differs alone by {diff}");
        }
        Ok(())
    }
}
