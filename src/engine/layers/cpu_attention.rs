//! Causal attention over the packed batch on the CPU, in f32, fused: for each query, the scores
//! against the keys it may see (its own sequence, up to itself, within the sliding window), the
//! softmax and the weighted sum of the values, in one pass that never builds a score matrix or a
//! mask and skips the causal upper triangle. Blocks of queries run in parallel; each query's
//! result is computed the same way whatever else is in the batch.

use candle_core::{DType, Tensor};

use super::cpu_ops::f32s;
use rayon::prelude::*;

/// Queries per work item.
const BLOCK: usize = 16;
/// Lanes of the dot product's partial sums (a fixed order, vectorised by the compiler).
const LANES: usize = 16;

/// Whether the fused kernel serves these inputs.
pub fn supported(q: &Tensor) -> bool {
    q.device().is_cpu() && q.dtype() == DType::F32
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

/// What every block reads.
struct Ctx<'a> {
    qs: &'a [f32],
    ks: &'a [f32],
    vs: &'a [f32],
    heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f32,
    window: Option<usize>,
}

impl Ctx<'_> {
    /// Queries `i0..i0 + n` of the sequence starting at `start`, every head, into `dst`. Compiled
    /// for AVX2 where the CPU has it, portably otherwise: the same operations in the same order
    /// either way (the compiler does not reassociate), so the same bits.
    fn run(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has the features the function is compiled for.
                return unsafe { self.run_avx2(dst, i0, n, start) };
            }
        }
        self.block(dst, i0, n, start)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        self.block(dst, i0, n, start)
    }

    #[inline(always)]
    fn block(&self, dst: &mut [f32], i0: usize, n: usize, start: usize) {
        let (heads, kv_heads, d) = (self.heads, self.kv_heads, self.d);
        let group = heads / kv_heads;
        let mut scores = Vec::new();
        let mut acc = vec![0f32; d];
        for i in i0..i0 + n {
            let p = i - start;
            let lo = start + self.window.map_or(0, |w| (p + 1).saturating_sub(w));
            for h in 0..heads {
                let kh = h / group;
                let qi = &self.qs[(i * heads + h) * d..][..d];
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for j in lo..=i {
                    let s = dot(qi, &self.ks[(j * kv_heads + kh) * d..][..d]) * self.scale;
                    max = max.max(s);
                    scores.push(s);
                }
                acc.iter_mut().for_each(|x| *x = 0.0);
                let mut sum = 0f32;
                for (j, s) in (lo..=i).zip(scores.iter()) {
                    let w = (s - max).exp();
                    sum += w;
                    let vj = &self.vs[(j * kv_heads + kh) * d..][..d];
                    acc.iter_mut().zip(vj).for_each(|(a, x)| *a += w * x);
                }
                let o = &mut dst[((i - i0) * heads + h) * d..][..d];
                o.iter_mut().zip(&acc).for_each(|(o, a)| *o = a / sum);
            }
        }
    }
}

/// `q`: `[T, heads, d]`, `k`, `v`: `[T, kv_heads, d]`, f32 on the CPU, rope applied; `seqs`: the
/// `(start, len)` of each sequence. Returns `[T, heads * d]`.
pub fn packed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[(usize, usize)],
    scale: f32,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let (t, heads, d) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    if kv_heads == 0 || heads % kv_heads != 0 || k.dims() != [t, kv_heads, d] || v.dims() != k.dims() {
        candle_core::bail!("cpu attention: q {:?}, k {:?}, v {:?} do not fit", q.dims(), k.dims(), v.dims());
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
    let ctx = Ctx { qs, ks, vs, heads, kv_heads, d, scale, window };
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
            for window in [None, Some(5)] {
                let got = packed_attention(&q, &k, &v, &seqs, 0.3, window)?;
                for &(s, l) in &seqs {
                    let masks = chunk_masks(l, window, 1024, &dev)?;
                    let want =
                        sequence_attention(&q.narrow(0, s, l)?, &k.narrow(0, s, l)?, &v.narrow(0, s, l)?, 0.3, &masks)?;
                    let diff = (got.narrow(0, s, l)? - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(diff < 1e-5, "h{heads}/{kv} d{d} window {window:?} seq ({s}, {l}): max diff {diff}");
                }
            }
        }
        Ok(())
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
        let all = packed_attention(&q, &k, &v, &seqs, 0.125, None)?;
        for &(s, l) in &seqs {
            let part = |x: &Tensor| x.narrow(0, s, l);
            let alone = packed_attention(&part(&q)?, &part(&k)?, &part(&v)?, &[(0, l)], 0.125, None)?;
            let diff = (part(&all)? - alone)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "sequence ({s}, {l}) differs alone by {diff}");
        }
        Ok(())
    }
}
