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

fn st_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "F32",
        Dtype::BF16 => "BF16",
        Dtype::F16 => "F16",
        Dtype::I64 => "I64",
        _ => "U8",
    }
}

/// An answer whose hidden states are still in pieces (each sequence's rows, often a view into
/// its batch's host buffer): [`encode_answer`] writes it without first joining the pieces.
pub struct AnswerParts<'a> {
    pub dtype: OutDType,
    /// `[total_tokens, n_layers, hidden]`.
    pub shape: Vec<usize>,
    /// The hidden states' bytes in token order.
    pub chunks: Vec<&'a [u8]>,
    pub input_ids: Vec<i64>,
    pub cu_seqlens: Vec<i64>,
    pub loss_mask: Vec<u8>,
    pub metadata: HashMap<String, String>,
}

/// Writes `a` as a safetensors file (header, then hidden_states, input_ids, cu_seqlens,
/// loss_mask), streaming the hidden-state pieces.
pub fn write_safetensors(w: &mut impl std::io::Write, a: &AnswerParts) -> std::io::Result<()> {
    let hs_len: usize = a.chunks.iter().map(|c| c.len()).sum();
    let expect = a.shape.iter().product::<usize>() * a.dtype.size_in_bytes();
    if hs_len != expect {
        return Err(std::io::Error::other(format!(
            "hidden states hold {hs_len} bytes, shape {:?} needs {expect}",
            a.shape
        )));
    }
    let ids = le_i64(&a.input_ids);
    let cu = le_i64(&a.cu_seqlens);
    let tensors: [(&str, Dtype, Vec<usize>, usize); 4] = [
        ("hidden_states", st_dtype(a.dtype), a.shape.clone(), hs_len),
        ("input_ids", Dtype::I64, vec![a.input_ids.len()], ids.len()),
        ("cu_seqlens", Dtype::I64, vec![a.cu_seqlens.len()], cu.len()),
        ("loss_mask", Dtype::U8, vec![a.loss_mask.len()], a.loss_mask.len()),
    ];
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::to_value(&a.metadata)?);
    let mut at = 0;
    for (name, dtype, shape, len) in tensors {
        header.insert(
            name.into(),
            serde_json::json!({"dtype": st_name(dtype), "shape": shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))?;
    // The data starts 8-byte aligned, as the format recommends.
    h.resize(h.len().next_multiple_of(8), b' ');
    w.write_all(&(h.len() as u64).to_le_bytes())?;
    w.write_all(&h)?;
    for c in &a.chunks {
        w.write_all(c)?;
    }
    w.write_all(&ids)?;
    w.write_all(&cu)?;
    w.write_all(&a.loss_mask)
}

/// The answer's bytes: safetensors, zstd-compressed at `zstd_level` when given (several threads
/// for large answers), written straight from the pieces.
pub fn encode_answer(a: &AnswerParts, zstd_level: Option<i32>) -> std::io::Result<Vec<u8>> {
    let size: usize = a.chunks.iter().map(|c| c.len()).sum::<usize>() + 4096 + a.input_ids.len() * 9;
    match zstd_level {
        None => {
            let mut out = Vec::with_capacity(size);
            write_safetensors(&mut out, a)?;
            Ok(out)
        }
        Some(level) => {
            let mut enc = zstd::stream::Encoder::new(Vec::with_capacity(size / 2), level)?;
            if size > 8 << 20 {
                let threads = std::thread::available_parallelism().map(|n| n.get().min(8)).unwrap_or(1) as u32;
                enc.multithread(threads)?;
            }
            write_safetensors(&mut enc, a)?;
            enc.finish()
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(chunks: Vec<&[u8]>) -> AnswerParts<'_> {
        AnswerParts {
            dtype: OutDType::Bfloat16,
            shape: vec![3, 2, 4],
            chunks,
            input_ids: vec![5, 6, 7],
            cu_seqlens: vec![0, 1, 3],
            loss_mask: vec![1, 0, 1],
            metadata: HashMap::from([("model".to_string(), "m".to_string())]),
        }
    }

    /// The streamed writer produces a file the safetensors library reads back to the same
    /// tensors and metadata as the library's own serialiser, however the rows are split.
    #[test]
    fn streamed_answer_reads_back_like_the_library_serialiser() {
        let hs: Vec<u8> = (0..48u8).collect();
        let x = Extraction {
            hidden_states: HostTensor { dtype: OutDType::Bfloat16, shape: vec![3, 2, 4], data: hs.clone().into() },
            input_ids: vec![5, 6, 7],
            cu_seqlens: vec![0, 1, 3],
            loss_mask: vec![1, 0, 1],
            metadata: HashMap::from([("model".to_string(), "m".to_string())]),
        };
        let reference = to_safetensors(&x).unwrap();
        let (a, b) = hs.split_at(16);
        for zstd in [None, Some(3)] {
            let bytes = encode_answer(&parts(vec![a, b]), zstd).unwrap();
            let raw = if zstd.is_some() { zstd::decode_all(&bytes[..]).unwrap() } else { bytes };
            let ours = safetensors::SafeTensors::deserialize(&raw).unwrap();
            let theirs = safetensors::SafeTensors::deserialize(&reference).unwrap();
            let mut names = ours.names();
            names.sort();
            assert_eq!(names, vec!["cu_seqlens", "hidden_states", "input_ids", "loss_mask"]);
            for n in names {
                let (o, t) = (ours.tensor(n).unwrap(), theirs.tensor(n).unwrap());
                assert_eq!((o.dtype(), o.shape(), o.data()), (t.dtype(), t.shape(), t.data()), "{n}");
            }
            let (_, meta) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
            assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("model")).map(String::as_str), Some("m"));
        }
    }

    /// Pieces that do not add up to the shape are refused, not written.
    #[test]
    fn mismatched_pieces_are_an_error() {
        let hs = [0u8; 40];
        assert!(encode_answer(&parts(vec![&hs]), None).is_err());
    }
}
