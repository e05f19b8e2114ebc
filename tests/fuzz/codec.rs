//! Properties and seeds: the safetensors answer writer, plain and zstd-compressed.

use std::collections::HashMap;
use std::path::Path;

use layertap::answer::codec::{self, AnswerParts};
use layertap::answer::Extraction;
use layertap::engine::{HostTensor, OutDType};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use crate::{check, config, fail_with, nasty_text, seed_texts};

#[derive(Debug, Clone)]
struct AnswerCase {
    dtype: OutDType,
    shape: Vec<usize>,
    hs: Vec<u8>,
    cuts: Vec<usize>,
    input_ids: Vec<i64>,
    cu_seqlens: Vec<i64>,
    loss_mask: Vec<u8>,
    metadata: HashMap<String, String>,
}

fn answer_case() -> impl Strategy<Value = AnswerCase> {
    let dtype = prop::sample::select(vec![OutDType::Float32, OutDType::Bfloat16, OutDType::Float16]);
    (dtype, 0usize..6, 0usize..4, 0usize..9).prop_flat_map(|(dtype, t, l, h)| {
        let n = t * l * h * dtype.size_in_bytes();
        (
            Just(dtype),
            Just(vec![t, l, h]),
            prop::collection::vec(any::<u8>(), n),
            prop::collection::vec(0..=n, 0..4),
            prop::collection::vec(any::<i64>(), t),
            prop::collection::vec(any::<i64>(), 0..5),
            prop::collection::vec(any::<u8>(), t),
            prop::collection::hash_map(nasty_text(), nasty_text(), 0..5),
        )
            .prop_map(|(dtype, shape, hs, mut cuts, input_ids, cu_seqlens, loss_mask, metadata)| {
                cuts.sort();
                AnswerCase { dtype, shape, hs, cuts, input_ids, cu_seqlens, loss_mask, metadata }
            })
    })
}

fn check_answer_writer(c: &AnswerCase) -> Result<(), TestCaseError> {
    let mut chunks = Vec::new();
    let mut at = 0;
    for &cut in &c.cuts {
        chunks.push(&c.hs[at..cut]);
        at = cut;
    }
    chunks.push(&c.hs[at..]);
    let parts = AnswerParts {
        dtype: c.dtype,
        shape: c.shape.clone(),
        chunks,
        scale: None,
        input_ids: c.input_ids.clone(),
        cu_seqlens: c.cu_seqlens.clone(),
        loss_mask: c.loss_mask.clone(),
        positions: None,
        logprobs: None,
        metadata: c.metadata.clone(),
    };
    let plain = codec::encode_answer(&parts, None).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let header = u64::from_le_bytes(plain[..8].try_into().unwrap());
    check!(header % 8 == 0, "header of {header} bytes: the data is not 8-byte aligned");
    for level in [1, 3, 19] {
        let z = codec::encode_answer(&parts, Some(level)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back = zstd::stream::decode_all(&z[..]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check!(back == plain, "zstd level {level} does not round-trip to the identity answer");
    }
    let x = Extraction {
        hidden_states: HostTensor { dtype: c.dtype, shape: c.shape.clone(), data: c.hs.clone().into() },
        hidden_states_scale: None,
        input_ids: c.input_ids.clone(),
        cu_seqlens: c.cu_seqlens.clone(),
        loss_mask: c.loss_mask.clone(),
        positions: None,
        logprobs: None,
        metadata: c.metadata.clone(),
    };
    let library = x.to_safetensors().map_err(|e| TestCaseError::fail(e.to_string()))?;
    for bytes in [&plain, &library] {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| TestCaseError::fail(format!("unreadable: {e}")))?;
        let le = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let want_dtype = match c.dtype {
            OutDType::Float32 => safetensors::Dtype::F32,
            OutDType::Bfloat16 => safetensors::Dtype::BF16,
            OutDType::Float16 => safetensors::Dtype::F16,
            OutDType::Float8E4M3 => safetensors::Dtype::F8_E4M3,
        };
        let expect: [(&str, safetensors::Dtype, Vec<usize>, Vec<u8>); 4] = [
            ("hidden_states", want_dtype, c.shape.clone(), c.hs.clone()),
            ("input_ids", safetensors::Dtype::I64, vec![c.input_ids.len()], le(&c.input_ids)),
            ("cu_seqlens", safetensors::Dtype::I64, vec![c.cu_seqlens.len()], le(&c.cu_seqlens)),
            ("loss_mask", safetensors::Dtype::U8, vec![c.loss_mask.len()], c.loss_mask.clone()),
        ];
        check!(st.len() == 4, "{} tensors", st.len());
        for (name, dtype, shape, data) in expect {
            let t = st.tensor(name).map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?;
            check!(t.dtype() == dtype && t.shape() == shape && t.data() == &data[..], "{name} differs");
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
        let mut meta = meta.metadata().clone().unwrap_or_default();
        check!(layertap::answer::checksum::verify_checksums(bytes).is_ok(), "checksums do not verify");
        check!(meta.remove("checksum_algorithm").as_deref() == Some("xxh64"), "checksum algorithm");
        check!(meta.remove("checksums").is_some(), "no checksums");
        check!(meta == c.metadata, "metadata {meta:?} != {:?}", c.metadata);
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary shapes (empty ones included), dtypes, splits into pieces and metadata: the
    /// streamed writer's file reads back through the safetensors library to exactly what was
    /// written, like the library's own serialiser, and zstd at any level round-trips it.
    #[test]
    fn answers_round_trip_through_safetensors_and_zstd(c in answer_case()) {
        check_answer_writer(&c)?;
    }

    /// Pieces that do not add up to the shape are an error, never a file.
    #[test]
    fn answers_with_missing_bytes_are_refused(c in answer_case(), cut in 1usize..64) {
        let n = c.hs.len();
        prop_assume!(n > 0);
        let short = &c.hs[..n.saturating_sub(cut)];
        let parts = AnswerParts {
            dtype: c.dtype, shape: c.shape.clone(), chunks: vec![short], scale: None, input_ids: c.input_ids.clone(),
            cu_seqlens: c.cu_seqlens.clone(), loss_mask: c.loss_mask.clone(), positions: None,
        logprobs: None,
            metadata: c.metadata.clone(),
        };
        prop_assert!(codec::encode_answer(&parts, None).is_err());
        prop_assert!(codec::encode_answer(&parts, Some(3)).is_err());
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------------------------

/// Answers of every dtype and edge shape (nothing at all, one token, no layers).
#[test]
fn seed_answers() {
    let texts = seed_texts();
    let meta: HashMap<String, String> =
        texts.iter().enumerate().map(|(i, t)| (t.clone(), texts[(i + 1) % texts.len()].clone())).collect();
    for dtype in [OutDType::Float32, OutDType::Bfloat16, OutDType::Float16] {
        for shape in [[0, 0, 0], [0, 3, 5], [1, 1, 1], [3, 0, 2], [2, 3, 4]] {
            let n: usize = shape.iter().product::<usize>() * dtype.size_in_bytes();
            let c = AnswerCase {
                dtype,
                shape: shape.to_vec(),
                hs: (0..n).map(|i| (i * 37 % 256) as u8).collect(),
                cuts: vec![0, n / 2, n / 2, n],
                input_ids: (0..shape[0] as i64).map(|i| i64::MIN + i).collect(),
                cu_seqlens: vec![0, shape[0] as i64],
                loss_mask: (0..shape[0]).map(|i| (i % 2) as u8).collect(),
                metadata: meta.clone(),
            };
            fail_with(Path::new(&format!("{dtype:?} {shape:?}")), check_answer_writer(&c));
        }
    }
}
