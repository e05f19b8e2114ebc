//! The gated delta rule over a packed batch, in chunks of 64 tokens (the WY/UT form), all in
//! f32. Per value head, with state `S` `[dk, dv]` starting at zero for every sequence:
//! `S = exp(g_t) S;  S += k_t (x) beta_t (v_t - S^T k_t);  o_t = S^T q_t`.
//! Within a chunk the updates collapse into `(I + A)^-1` with
//! `A_ij = beta_i (k_i . k_j) exp(G_i - G_j)` for `j < i` (`G` the running sum of `g`); the
//! chunks of one sequence are then scanned in order. Every chunk of every sequence is
//! prepared at once, and the scan advances all sequences together: step `j` handles chunk `j`
//! of every sequence that has one ([`GdnPlan`]).

use candle_core::{DType, Tensor};

use crate::engine::batch::{GdnPlan, GDN_CHUNK};

/// `[T, h, d]` packed rows into `[C * h, 64, d]` chunks (zero rows pad each sequence's last
/// chunk).
fn to_chunks(x: &Tensor, plan: &GdnPlan) -> candle_core::Result<Tensor> {
    let (_, h, d) = x.dims3()?;
    let padded = Tensor::cat(&[x, &Tensor::zeros((1, h, d), x.dtype(), x.device())?], 0)?;
    padded
        .index_select(&plan.gather, 0)?
        .reshape((plan.chunks, GDN_CHUNK, h, d))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((plan.chunks * h, GDN_CHUNK, d))
}

/// `(I + A)^-1` for unit lower-triangular `I + A` (`a`: `[N, 64, 64]`, strictly lower), by
/// forward substitution one row at a time, in f32.
fn unit_lower_inverse(a: &Tensor) -> candle_core::Result<Tensor> {
    let (n, c, _) = a.dims3()?;
    let eye = Tensor::eye(c, DType::F32, a.device())?;
    let mut m = eye.narrow(0, 0, 1)?.unsqueeze(0)?.broadcast_as((n, 1, c))?.contiguous()?;
    for i in 1..c {
        // Row i of the inverse: e_i - sum_{j < i} A_ij M_j.
        let a_i = a.narrow(1, i, 1)?.narrow(2, 0, i)?.contiguous()?;
        let e_i = eye.narrow(0, i, 1)?.unsqueeze(0)?;
        let row = e_i.broadcast_sub(&a_i.matmul(&m)?)?;
        m = Tensor::cat(&[&m, &row], 1)?;
    }
    Ok(m)
}

/// `q`, `k`: `[T, h, dk]` (normalised and scaled, one row per value head), `v`: `[T, h, dv]`,
/// `beta`, `g`: `[T, h]`, all f32. Returns `o`: `[T, h, dv]`.
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    g: &Tensor,
    plan: &GdnPlan,
) -> candle_core::Result<Tensor> {
    let (t, h, dk) = k.dims3()?;
    let dv = v.dim(2)?;
    let dev = q.device();
    let (lower, strict) = (&plan.lower, &plan.strict);
    let q = to_chunks(q, plan)?;
    let k = to_chunks(k, plan)?;
    let v = to_chunks(v, plan)?;
    let beta = to_chunks(&beta.unsqueeze(2)?, plan)?; // [N, 64, 1]
    let cum = to_chunks(&g.unsqueeze(2)?, plan)?.squeeze(2)?.cumsum(1)?; // [N, 64]
    let k_beta = k.broadcast_mul(&beta)?;
    let v_beta = v.broadcast_mul(&beta)?;
    // decay[i][j] = exp(G_i - G_j) for j <= i, 0 above the diagonal (never exponentiated into
    // the result there).
    let diff = cum.unsqueeze(2)?.broadcast_sub(&cum.unsqueeze(1)?)?;
    let decay = diff.broadcast_mul(lower)?.exp()?.broadcast_mul(lower)?;
    let kt = k.transpose(1, 2)?.contiguous()?;
    let a = (k_beta.matmul(&kt)? * &decay)?.broadcast_mul(strict)?;
    let intra = (q.matmul(&kt)? * &decay)?;
    let inv = unit_lower_inverse(&a)?;
    let exp_cum = cum.exp()?.unsqueeze(2)?;
    let new_values = inv.matmul(&v_beta)?;
    let k_cumdecay = inv.matmul(&k_beta.broadcast_mul(&exp_cum)?)?;
    let q_dec = q.broadcast_mul(&exp_cum)?;
    let last = cum.narrow(1, GDN_CHUNK - 1, 1)?; // [N, 1]
    let k_dec = k.broadcast_mul(&last.broadcast_sub(&cum)?.exp()?.unsqueeze(2)?)?.transpose(1, 2)?.contiguous()?;
    let chunk_decay = last.exp()?.unsqueeze(2)?; // [N, 1, 1]

    let first = plan.steps.first().map(|s| s.1).unwrap_or(0);
    let mut state = Tensor::zeros((first * h, dk, dv), DType::F32, dev)?;
    let mut outs = Vec::with_capacity(plan.steps.len());
    for &(offset, active) in &plan.steps {
        let rows = active * h;
        if state.dim(0)? != rows {
            // The sequences that ended are the last ones: their states are no longer needed.
            state = state.narrow(0, 0, rows)?;
        }
        let at = |x: &Tensor| x.narrow(0, offset * h, rows);
        let v_new = (at(&new_values)? - at(&k_cumdecay)?.matmul(&state)?)?;
        outs.push((at(&q_dec)?.matmul(&state)? + at(&intra)?.matmul(&v_new)?)?);
        state = (state.broadcast_mul(&at(&chunk_decay)?)? + at(&k_dec)?.matmul(&v_new)?)?;
    }
    let out = Tensor::cat(&outs, 0)?; // [N, 64, dv], chunks in plan order
    let out =
        out.reshape((plan.chunks, h, GDN_CHUNK, dv))?.transpose(1, 2)?.reshape((plan.chunks * GDN_CHUNK, h, dv))?;
    let out = out.index_select(&plan.scatter, 0)?;
    debug_assert_eq!(out.dims(), &[t, h, dv]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, one token at a time, per sequence and head.
    #[allow(clippy::too_many_arguments)]
    fn recurrence(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        beta: &[f32],
        g: &[f32],
        seqs: &[(usize, usize)],
        h: usize,
        dk: usize,
        dv: usize,
    ) -> Vec<f32> {
        let t_total: usize = seqs.iter().map(|s| s.1).sum();
        let mut out = vec![0f32; t_total * h * dv];
        for &(start, len) in seqs {
            for head in 0..h {
                let mut s = vec![0f32; dk * dv];
                for t in start..start + len {
                    let qt = &q[(t * h + head) * dk..][..dk];
                    let kt = &k[(t * h + head) * dk..][..dk];
                    let vt = &v[(t * h + head) * dv..][..dv];
                    let (b, decay) = (beta[t * h + head], g[t * h + head].exp());
                    s.iter_mut().for_each(|x| *x *= decay);
                    for j in 0..dv {
                        let mem: f32 = (0..dk).map(|i| s[i * dv + j] * kt[i]).sum();
                        let delta = (vt[j] - mem) * b;
                        (0..dk).for_each(|i| s[i * dv + j] += kt[i] * delta);
                    }
                    for j in 0..dv {
                        out[(t * h + head) * dv + j] = (0..dk).map(|i| s[i * dv + j] * qt[i]).sum();
                    }
                }
            }
        }
        out
    }

    #[test]
    fn chunked_equals_the_token_by_token_recurrence() -> candle_core::Result<()> {
        let dev = candle_core::Device::Cpu;
        let seqs = [(0, 1), (1, 63), (64, 64), (128, 65), (193, 130), (323, 3)];
        let t = 326;
        let (h, dk, dv) = (3, 8, 12);
        let unit = |x: Tensor| -> candle_core::Result<Tensor> { x.broadcast_div(&x.sqr()?.sum_keepdim(2)?.sqrt()?) };
        let q = (unit(Tensor::randn(0f32, 1.0, (t, h, dk), &dev)?)? * (dk as f64).powf(-0.5))?;
        let k = unit(Tensor::randn(0f32, 1.0, (t, h, dk), &dev)?)?;
        let v = Tensor::randn(0f32, 1.0, (t, h, dv), &dev)?;
        let beta = candle_nn::ops::sigmoid(&Tensor::randn(0f32, 1.0, (t, h), &dev)?)?;
        let g = (Tensor::rand(0f32, 1.0, (t, h), &dev)? * -0.3)?;
        let plan = GdnPlan::new(&seqs, 4, &dev)?;
        let got = chunked(&q, &k, &v, &beta, &g, &plan)?.flatten_all()?.to_vec1::<f32>()?;
        let flat = |x: &Tensor| x.flatten_all().and_then(|x| x.to_vec1::<f32>());
        let want = recurrence(&flat(&q)?, &flat(&k)?, &flat(&v)?, &flat(&beta)?, &flat(&g)?, &seqs, h, dk, dv);
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in got.iter().zip(&want) {
            num += f64::from(a - b).powi(2);
            den += f64::from(*b).powi(2);
        }
        let rel = (num / den).sqrt();
        assert!(rel < 1e-5, "relative error {rel:.3e}");
        // And the states really carry across chunks: a sequence's late tokens see its start.
        assert!(den > 0.0);
        Ok(())
    }
}
