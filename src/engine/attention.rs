//! Causal attention over packed sequences: each sequence attends only to itself, queries are
//! processed in chunks, so no (total tokens)² matrix is ever built.

use candle_core::{DType, Device, Tensor};

use super::model::matmul;

/// Queries per chunk; bounds the score matrix to `heads × CHUNK × seq_len`.
const QUERY_CHUNK: usize = 1024;

/// Additive mask `[q_len, k_len]` for queries at positions `q0..q0+q_len` over keys `0..k_len`.
fn mask(q0: usize, q_len: usize, k_len: usize, window: Option<usize>, device: &Device) -> candle_core::Result<Tensor> {
    let mut m = vec![0f32; q_len * k_len];
    for r in 0..q_len {
        let i = q0 + r;
        for j in 0..k_len {
            let too_far = window.is_some_and(|w| i >= j + w);
            if j > i || too_far {
                m[r * k_len + j] = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(m, (q_len, k_len), device)
}

/// `q`: `[T, heads, d]`, `k`, `v`: `[T, kv_heads, d]` (one sequence, rope applied).
/// Returns `[T, heads * d]`.
pub fn sequence_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
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
    let kt = k.t()?.contiguous()?; // [h, d, T]
    let mut outs = Vec::with_capacity(t.div_ceil(QUERY_CHUNK));
    let mut q0 = 0;
    while q0 < t {
        let q_len = QUERY_CHUNK.min(t - q0);
        let k_len = q0 + q_len;
        let qc = q.narrow(1, q0, q_len)?;
        let kc = kt.narrow(2, 0, k_len)?;
        let scores = (matmul(&qc, &kc)? * scale)?.to_dtype(DType::F32)?;
        let m = mask(q0, q_len, k_len, window, q.device())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&m)?)?.to_dtype(dtype)?;
        outs.push(matmul(&probs, &v.narrow(1, 0, k_len)?.contiguous()?)?);
        q0 += q_len;
    }
    let out = Tensor::cat(&outs, 1)?; // [h, T, d]
    out.transpose(0, 1)?.reshape((t, heads * d))
}
