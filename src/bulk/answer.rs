//! What `layertap bulk` makes of an answer: checked against its checksums, then the file of the
//! layout asked for.

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{Map, Value};

use super::settings::check_answer;
use super::Attempt;
use crate::answer::checksum::{verify_checksums, xxh64_hex, CHECKSUM_ALGORITHM};
use crate::cli::BulkLayout;

/// The name hs-connectors reads an fp8 sample's scales under (`SCALES_KEY`).
const SCALES: &str = "hidden_states_scales";

/// A sample's file, ready to write.
pub struct Prepared {
    pub bytes: Vec<u8>,
    /// Tensor name → xxh64 of its bytes in `bytes`.
    pub checksums: Map<String, Value>,
    pub rows: usize,
}

/// The metadata of a safetensors file (empty when it has none).
pub fn metadata(file: &[u8]) -> Result<std::collections::HashMap<String, String>, String> {
    let (_, meta) = SafeTensors::read_metadata(file).map_err(|e| format!("not a safetensors file: {e}"))?;
    Ok(meta.metadata().clone().unwrap_or_default())
}

/// Checks an answer against its checksums and its metadata against `expected` (the folder's
/// model, layers and dtype), and turns it into the file `layout` asks for. A checksum mismatch
/// (or an answer too damaged to read) is worth retrying; an answer without checksums, or of
/// another model, is not.
pub fn prepare(answer: &[u8], layout: BulkLayout, expected: &[(&str, String)]) -> Attempt<Prepared> {
    if let Err(e) = verify_checksums(answer) {
        if metadata(answer).is_ok_and(|m| !m.contains_key("checksum_algorithm")) {
            return Err((false, "the answer carries no checksums (is the server older than this client?)".into()));
        }
        return Err((true, format!("the answer failed its checksum check ({e})")));
    }
    let meta = metadata(answer).map_err(|e| (true, e))?;
    check_answer(&meta, expected).map_err(|e| (false, e))?;
    let st = SafeTensors::deserialize(answer).map_err(|e| (false, format!("the answer is not safetensors: {e}")))?;
    let ids = st.tensor("input_ids").map_err(|e| (false, format!("the answer has no input_ids: {e}")))?;
    let rows = ids.shape().first().copied().unwrap_or(0);
    match layout {
        BulkLayout::Plain => {
            let checksums = metadata(answer)
                .ok()
                .and_then(|m| serde_json::from_str::<Map<String, Value>>(m.get("checksums")?).ok())
                .unwrap_or_default();
            Ok(Prepared { bytes: answer.to_vec(), checksums, rows })
        }
        BulkLayout::Speculators => speculators_file(answer, &st).map_err(|e| (false, e)),
    }
}

/// The file speculators' trainers read for one sample, made from its answer (all rows).
///
/// Checked against vllm-project/speculators: `FileTransfer.get_cached` in
/// `hs_connectors/src/hs_connectors/transfer.py` loads `<hidden states path>/hs_{file_idx}.safetensors`
/// with `safetensors.torch.load_file`, where `file_idx` is the sample's row in the dataset
/// (`ArrowDataset._map_to_file_idx`, `src/speculators/train/data.py`), and the path defaults to
/// `<data path>/hidden_states` (or `--hidden-states-path`). `ArrowDataset._get_raw_data` reads
/// exactly two tensors: `hidden_states` [seq_len, num_layers, hidden_size] (slot -1 is the
/// verifier's last state, the others are flattened to the draft's input) and `token_ids` [seq_len],
/// which must `torch.equal` the dataset's `input_ids` (int64) or the sample is dropped; the loss
/// mask and positions come from the dataset, not the file. `CollateFn` casts `hidden_states` to the
/// training dtype, so F32, BF16 and F16 all load. fp8 is read by hs-connectors' `FP8Transfer`
/// (`hs_connectors/src/hs_connectors/transfer.py`, the `fp8` hidden-states backend): a sample holding
/// `hidden_states_scales` is dequantised as `hidden_states.to(dtype) * hidden_states_scales.to(dtype)`,
/// broadcasting, so the answer's `[rows, n_layers]` scales are written as `[rows, n_layers, 1]` f32
/// (the same bytes). The metadata (checksums) is ignored by `load_file`.
fn speculators_file(answer: &[u8], st: &SafeTensors) -> Result<Prepared, String> {
    let hs = st.tensor("hidden_states").map_err(|e| format!("the answer has no hidden_states: {e}"))?;
    let ids = st.tensor("input_ids").map_err(|e| format!("the answer has no input_ids: {e}"))?;
    if !matches!(hs.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16 | Dtype::F8_E4M3) {
        return Err(format!("speculators reads float32, bfloat16, float16 or fp8 hidden states, not {:?}", hs.dtype()));
    }
    let shape = hs.shape();
    let scales = match hs.dtype() {
        Dtype::F8_E4M3 => {
            let s = st.tensor("hidden_states_scale").map_err(|e| format!("the fp8 answer has no scales: {e}"))?;
            if s.dtype() != Dtype::F32 || shape.len() != 3 || s.shape() != [shape[0], shape[1]] {
                return Err(format!(
                    "the answer's hidden_states_scale {:?} ({:?}) does not fit its hidden_states {shape:?}",
                    s.shape(),
                    s.dtype()
                ));
            }
            Some(TensorView::new(Dtype::F32, vec![shape[0], shape[1], 1], s.data()).map_err(|e| e.to_string())?)
        }
        _ => None,
    };
    if shape.len() != 3 || ids.dtype() != Dtype::I64 || ids.shape() != [shape[0]] {
        return Err(format!(
            "the answer's hidden_states {:?} and input_ids {:?} ({:?}) do not match",
            shape,
            ids.shape(),
            ids.dtype()
        ));
    }
    if st.tensor("positions").is_ok() {
        return Err("the answer holds a selection of rows; speculators needs every token".into());
    }
    let mut checksums = Map::new();
    checksums.insert("hidden_states".into(), xxh64_hex([hs.data()]).into());
    checksums.insert("token_ids".into(), xxh64_hex([ids.data()]).into());
    if let Some(s) = &scales {
        checksums.insert(SCALES.into(), xxh64_hex([s.data()]).into());
    }
    let mut meta = metadata(answer)?;
    meta.insert("format".into(), "speculators".into());
    meta.insert("checksum_algorithm".into(), CHECKSUM_ALGORITHM.into());
    meta.insert("checksums".into(), Value::Object(checksums.clone()).to_string());
    let rows = shape[0];
    let mut tensors = vec![("hidden_states", hs), ("token_ids", ids)];
    tensors.extend(scales.map(|s| (SCALES, s)));
    let bytes = safetensors::tensor::serialize(tensors, Some(meta)).map_err(|e| format!("writing the file: {e}"))?;
    Ok(Prepared { bytes, checksums, rows })
}
