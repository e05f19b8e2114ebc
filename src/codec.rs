//! The answer format: a safetensors file (hidden states, ids, offsets, loss mask, metadata),
//! optionally zstd-compressed. Pure functions, meant to run off the async runtime.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, TensorView};

use crate::engine::{HostTensor, OutDType};

/// The layer-index convention, stored in every file's metadata.
pub const CONVENTION: &str = "hf_hidden_states: index 0 = embedding output, index i = output of decoder layer i \
     (1-based), index L = final output after the last norm; negative indices count from L";

/// Everything returned for a set of sequences.
#[derive(Clone, Debug)]
pub struct Extraction {
    /// `[total_tokens, n_layers, hidden]`.
    pub hidden_states: HostTensor,
    pub input_ids: Vec<i64>,
    /// `n + 1` offsets into the token dimension.
    pub cu_seqlens: Vec<i64>,
    /// 1 on tokens that count for the loss (assistant turns; every token of non-chat inputs).
    pub loss_mask: Vec<u8>,
    pub metadata: HashMap<String, String>,
}

fn st_dtype(d: OutDType) -> Dtype {
    match d {
        OutDType::Float32 => Dtype::F32,
        OutDType::Bfloat16 => Dtype::BF16,
        OutDType::Float16 => Dtype::F16,
    }
}

fn le_i64(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Serialises an extraction to safetensors bytes.
pub fn to_safetensors(x: &Extraction) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let ids = le_i64(&x.input_ids);
    let cu = le_i64(&x.cu_seqlens);
    let hs = &x.hidden_states;
    let views = vec![
        ("hidden_states", TensorView::new(st_dtype(hs.dtype), hs.shape.clone(), &hs.data)?),
        ("input_ids", TensorView::new(Dtype::I64, vec![x.input_ids.len()], &ids)?),
        ("cu_seqlens", TensorView::new(Dtype::I64, vec![x.cu_seqlens.len()], &cu)?),
        ("loss_mask", TensorView::new(Dtype::U8, vec![x.loss_mask.len()], &x.loss_mask)?),
    ];
    safetensors::tensor::serialize(views, Some(x.metadata.clone()))
}

/// zstd-compresses `bytes`; large payloads use several threads.
pub fn compress(bytes: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    let mut enc = zstd::stream::Encoder::new(Vec::with_capacity(bytes.len() / 2), level)?;
    if bytes.len() > 8 << 20 {
        let threads = std::thread::available_parallelism().map(|n| n.get().min(8)).unwrap_or(1) as u32;
        enc.multithread(threads)?;
    }
    std::io::Write::write_all(&mut enc, bytes)?;
    enc.finish()
}
