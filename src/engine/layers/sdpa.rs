//! Causal attention over packed sequences: each sequence attends only to itself, queries are
//! processed in chunks, so no (total tokens)² matrix is ever built.

use candle_core::{DType, Device, Tensor};

use super::linear::matmul;

/// Queries per chunk; bounds the score matrix to `heads × CHUNK × seq_len`.
pub const QUERY_CHUNK: usize = 1024;

/// Additive mask `[q_len, k_len]` (0 or -inf) for queries at positions `q0..q0+q_len` over keys
/// `0..k_len`: causal, and within `window` positions when set. Built on the device.
fn mask(q0: usize, q_len: usize, k_len: usize, window: Option<usize>, device: &Device) -> candle_core::Result<Tensor> {
    let qi = Tensor::arange(q0 as i64, (q0 + q_len) as i64, device)?.reshape((q_len, 1))?;
    let kj = Tensor::arange(0i64, k_len as i64, device)?.reshape((1, k_len))?;
    let mut allowed = kj.broadcast_le(&qi)?;
    if let Some(w) = window {
        // Key j is visible from query i when i - j < w.
        let lo = (qi - w as f64)?;
        allowed = (allowed * kj.broadcast_gt(&lo)?)?;
    }
    let zero = Tensor::zeros((q_len, k_len), DType::F32, device)?;
    let neg = Tensor::full(f32::NEG_INFINITY, (q_len, k_len), device)?;
    allowed.where_cond(&zero, &neg)
}

/// `q`: `[T, heads, d]`, `k`, `v`: `[T, kv_heads, d]` (one sequence, rope applied).
/// Returns `[T, heads * d]`.
/// The masks of every query chunk of a sequence of `t` tokens, `chunk` queries per chunk. They
/// depend only on the length, so one set serves every layer and every sequence of that length.
pub fn chunk_masks(t: usize, window: Option<usize>, chunk: usize, device: &Device) -> candle_core::Result<Vec<Tensor>> {
    (0..t).step_by(chunk.max(1)).map(|q0| mask(q0, chunk.min(t - q0), q0 + chunk.min(t - q0), window, device)).collect()
}

/// `q`: `[T, heads, d]`, `k`, `v`: `[T, kv_heads, d]` (one sequence, rope applied); `masks` from
/// [`chunk_masks`] for this length; `sinks`: one f32 logit per head `[heads]` that joins each
/// row's softmax and is dropped after it. Returns `[T, heads * d]`.
pub fn sequence_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    masks: &[Tensor],
    sinks: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (t, heads, d) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    let group = heads / kv_heads;
    let dtype = q.dtype();
    let q = q.transpose(0, 1)?.contiguous()?; // [h, T, d]
    let expand = |x: &Tensor| -> candle_core::Result<Tensor> {
        let x = x.transpose(0, 1)?; // [kv, T, d]
        if group == 1 {
            x.contiguous()
        } else {
            x.unsqueeze(1)?.expand((kv_heads, group, t, d))?.reshape((heads, t, d))
        }
    };
    let k = expand(k)?;
    let v = expand(v)?;
    let mut outs = Vec::with_capacity(masks.len());
    let mut q0 = 0;
    for m in masks {
        let (q_len, k_len) = m.dims2()?;
        let qc = q.narrow(1, q0, q_len)?;
        // [h, d, k_len] as a transposed view of the first k_len keys: no copy, and a layout
        // cuBLAS takes directly (batch stride T*d, leading dimension d).
        let kc = k.narrow(1, 0, k_len)?.t()?;
        let scores = (matmul(&qc, &kc)? * scale)?.to_dtype(DType::F32)?.broadcast_add(m)?;
        let probs = match sinks {
            None => candle_nn::ops::softmax_last_dim(&scores)?,
            Some(s) => {
                let column = s.reshape((heads, 1, 1))?.broadcast_as((heads, q_len, 1))?;
                candle_nn::ops::softmax_last_dim(&Tensor::cat(&[&scores, &column.contiguous()?], 2)?)?
                    .narrow(2, 0, k_len)?
            }
        }
        .to_dtype(dtype)?;
        // Without the sinks' column the rows are k_len apart again: cuBLAS takes no other stride
        // (in f32 the cast above is no copy).
        let probs = if sinks.is_some() { probs.contiguous()? } else { probs };
        outs.push(matmul(&probs, &v.narrow(1, 0, k_len)?)?);
        q0 += q_len;
    }
    if q0 != t {
        candle_core::bail!("attention masks cover {q0} queries, the sequence has {t}");
    }
    let out = if outs.len() == 1 { outs.swap_remove(0) } else { Tensor::cat(&outs, 1)? }; // [h, T, d]
    out.transpose(0, 1)?.reshape((t, heads * d))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Query chunks see exactly the keys a whole-sequence pass sees, windowed or not.
    #[test]
    fn chunked_queries_equal_one_pass() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (t, heads, kv, d) = (37, 4, 2, 8);
        let q = Tensor::randn(0f32, 1.0, (t, heads, d), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (t, kv, d), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (t, kv, d), &dev)?;
        for window in [None, Some(5)] {
            let whole = sequence_attention(&q, &k, &v, 0.3, &chunk_masks(t, window, 1024, &dev)?, None)?;
            for chunk in [1, 4, 16] {
                let parts = sequence_attention(&q, &k, &v, 0.3, &chunk_masks(t, window, chunk, &dev)?, None)?;
                let diff = (&whole - &parts)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff < 1e-5, "chunk {chunk} window {window:?}: max diff {diff}");
            }
        }
        // And the window really masks: the last query differs from full causal attention.
        let full = sequence_attention(&q, &k, &v, 0.3, &chunk_masks(t, None, 1024, &dev)?, None)?;
        let windowed = sequence_attention(&q, &k, &v, 0.3, &chunk_masks(t, Some(5), 1024, &dev)?, None)?;
        let diff = (&full - &windowed)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff > 1e-3);
        Ok(())
    }
}
