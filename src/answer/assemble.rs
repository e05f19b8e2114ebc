//! An answer put together: each sequence's rows (its [`Part`] of a batch), the tokenized inputs,
//! the layer set, the token selection and the dtype become the answer's columns and metadata,
//! rendered as a safetensors file (see [`super::codec`]) or as JSON. The service, `layertap
//! extract` and `layertap bench` all assemble answers here.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::codec::{self, AnswerParts, Logprobs};
use super::layers::{LayerSet, CONVENTION};
use super::select::Selection;
use crate::batching::Part;
use crate::bufpool::AnswerBuf;
use crate::engine::{Batch, Engine, EngineError, HostTensor, ModelInfo, OutDType, Output};
use crate::tokenizer::Tokenized;

/// Why an answer could not be put together.
#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    /// Reading the rows out of their batch failed.
    #[error(transparent)]
    Rows(#[from] EngineError),
    #[error("encoding the answer: {0}")]
    Encode(#[from] std::io::Error),
}

/// Metadata stored in every answer (the service adds `nonfinite`; the codec the checksums).
pub fn metadata(info: &ModelInfo, layers: &LayerSet, dtype: OutDType, tokens: &Selection) -> HashMap<String, String> {
    HashMap::from([
        ("model".to_string(), info.model_id.clone()),
        ("architecture".to_string(), info.architecture.clone()),
        ("num_layers".to_string(), info.num_layers.to_string()),
        ("layers".to_string(), serde_json::Value::from(layers.labels()).to_string()),
        ("dtype".to_string(), dtype.name().to_string()),
        ("tokens".to_string(), tokens.label()),
        ("convention".to_string(), CONVENTION.to_string()),
        ("format".to_string(), "layertap/1".to_string()),
    ])
}

/// Bytes of hidden states (and fp8 scales) an answer of `rows` rows holds.
pub fn state_bytes(rows: usize, layers: usize, hidden: usize, dtype: OutDType) -> usize {
    let scale = if dtype == OutDType::Float8E4M3 { std::mem::size_of::<f32>() } else { 0 };
    rows * layers * (hidden * dtype.size_in_bytes() + scale)
}

/// The token columns of an answer, one entry per returned row: input ids, offsets over the
/// rows, loss mask, and (with a selection) each row's position in its input.
pub struct TokenColumns {
    pub input_ids: Vec<i64>,
    pub cu_seqlens: Vec<i64>,
    pub loss_mask: Vec<u8>,
    pub positions: Option<Vec<i64>>,
}

impl TokenColumns {
    /// The columns for `seqs`, every row or the `positions` of each.
    pub fn of(seqs: &[Tokenized], positions: Option<&[Vec<u32>]>) -> Self {
        let offsets = |lens: &mut dyn Iterator<Item = usize>| {
            let mut cu = vec![0i64];
            for l in lens {
                cu.push(cu[cu.len() - 1] + l as i64);
            }
            cu
        };
        let Some(pos) = positions else {
            return TokenColumns {
                input_ids: seqs.iter().flat_map(|s| s.ids.iter().map(|&i| i64::from(i))).collect(),
                cu_seqlens: offsets(&mut seqs.iter().map(|s| s.ids.len())),
                loss_mask: seqs.iter().flat_map(|s| s.loss_mask.iter().copied()).collect(),
                positions: None,
            };
        };
        let rows = || seqs.iter().zip(pos).flat_map(|(s, p)| p.iter().map(move |&x| (s, x as usize)));
        TokenColumns {
            input_ids: rows().map(|(s, x)| i64::from(s.ids[x])).collect(),
            cu_seqlens: offsets(&mut pos.iter().map(Vec::len)),
            loss_mask: rows().map(|(s, x)| s.loss_mask[x]).collect(),
            positions: Some(rows().map(|(_, x)| x as i64).collect()),
        }
    }
}

/// Everything returned for a set of sequences, owned (the one-shot path and JSON answers).
#[derive(Clone, Debug)]
pub struct Extraction {
    /// `[rows, n_layers, hidden]`.
    pub hidden_states: HostTensor,
    /// `[rows, n_layers]` scales of fp8 hidden states.
    pub hidden_states_scale: Option<Vec<f32>>,
    /// One per row.
    pub input_ids: Vec<i64>,
    /// `n + 1` offsets into the row dimension.
    pub cu_seqlens: Vec<i64>,
    /// 1 on rows that count for the loss (assistant turns; every token of non-chat inputs).
    pub loss_mask: Vec<u8>,
    /// Each row's position in its input, when a selection left rows out.
    pub positions: Option<Vec<i64>>,
    /// Next-token log-probabilities of the rows, when asked.
    pub logprobs: Option<Logprobs>,
    pub metadata: HashMap<String, String>,
}

impl Extraction {
    /// The answer as it travels: the codec's view of it, every piece borrowed.
    pub fn parts(&self) -> AnswerParts<'_> {
        AnswerParts {
            dtype: self.hidden_states.dtype,
            shape: self.hidden_states.shape.clone(),
            chunks: vec![&self.hidden_states.data[..]],
            scale: self.hidden_states_scale.clone(),
            input_ids: self.input_ids.clone(),
            cu_seqlens: self.cu_seqlens.clone(),
            loss_mask: self.loss_mask.clone(),
            positions: self.positions.clone(),
            logprobs: self.logprobs.clone(),
            metadata: self.metadata.clone(),
        }
    }

    /// The answer as a safetensors file (uncompressed).
    pub fn to_safetensors(&self) -> std::io::Result<Vec<u8>> {
        codec::encode_answer(&self.parts(), None)
    }
}

/// The answer of `/v1/hidden-states` as JSON (`Accept: application/json`), for debugging.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HiddenStatesJson {
    /// `[total_tokens, n_layers, hidden]`.
    pub shape: Vec<usize>,
    pub dtype: String,
    /// Row-major values of `hidden_states` (for fp8, the fp8 values themselves: multiply by
    /// `hidden_states_scale`).
    pub hidden_states: Vec<f32>,
    /// `[rows, n_layers]`, fp8 answers only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_states_scale: Option<Vec<f32>>,
    pub input_ids: Vec<i64>,
    pub cu_seqlens: Vec<i64>,
    pub loss_mask: Vec<u8>,
    /// Each row's position in its input, with a token selection only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub positions: Option<Vec<i64>>,
    /// With `logprobs`: `[rows, top_k]` row-major, the top-k next-token ids of each row, best
    /// first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk_ids: Option<Vec<i64>>,
    /// With `logprobs`: `[rows, top_k]` row-major, their log-probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk_logprobs: Option<Vec<f32>>,
    /// With `logprobs.target`: `[rows]`, the log-probability of each row's next input token;
    /// null on an input's last token (NaN in safetensors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_logprobs: Option<Vec<Option<f32>>>,
    pub metadata: HashMap<String, String>,
}

impl From<Extraction> for HiddenStatesJson {
    fn from(x: Extraction) -> Self {
        HiddenStatesJson {
            shape: x.hidden_states.shape.clone(),
            dtype: x.hidden_states.dtype.name().into(),
            hidden_states: x.hidden_states.to_f32(),
            hidden_states_scale: x.hidden_states_scale,
            input_ids: x.input_ids,
            cu_seqlens: x.cu_seqlens,
            loss_mask: x.loss_mask,
            positions: x.positions,
            topk_ids: x.logprobs.as_ref().map(|l| l.ids.clone()),
            topk_logprobs: x.logprobs.as_ref().map(|l| l.logprobs.clone()),
            target_logprobs: x
                .logprobs
                .and_then(|l| l.target)
                .map(|t| t.into_iter().map(|v| (!v.is_nan()).then_some(v)).collect()),
            metadata: x.metadata,
        }
    }
}

/// What the non-finite screen found in an answer: per layer column, the rows holding a NaN or an
/// infinity as sent (in the answer's dtype), and the first such row (input, position in it,
/// layer column); and the rows whose log-probabilities are not all finite (a top-k entry, or the
/// next token's where the answer carries it and the row has a next token), with the first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Screen {
    pub per_layer: Vec<u64>,
    pub first: Option<(usize, usize, usize)>,
    pub logprobs: u64,
    pub first_logprobs: Option<(usize, usize)>,
}

/// The key of the log-probabilities in the `nonfinite` metadata and the metric's `layer` label.
pub const LOGPROBS_LABEL: &str = "logprobs";

impl Screen {
    /// The counts as the answer's `nonfinite` metadata: each layer's label (as `layers` names
    /// it) and `"logprobs"` with the rows found, where any were.
    pub fn counts(&self, layers: &LayerSet) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        for (col, &count) in self.per_layer.iter().enumerate() {
            if count > 0 {
                m.insert(layers.name(col), count.into());
            }
        }
        if self.logprobs > 0 {
            m.insert(LOGPROBS_LABEL.into(), self.logprobs.into());
        }
        m
    }

    /// Why an answer holding what was found must not go out unless the caller allows it; `None`
    /// when everything is finite.
    pub fn refusal(&self, layers: &LayerSet) -> Option<String> {
        let counts = serde_json::Value::Object(self.counts(layers));
        let states: u64 = self.per_layer.iter().sum();
        if let Some((input, pos, col)) = self.first {
            return Some(format!(
                "the model produced a non-finite value (NaN or infinity, or a value past the largest of the \
                 answer's dtype) at layer {} for inputs[{input}], position {pos} ({states} states in all; per layer \
                 and for the log-probabilities: {counts})",
                layers.name(col)
            ));
        }
        self.first_logprobs.map(|(input, pos)| {
            format!(
                "the model's log-probabilities are not finite (NaN or infinity) for inputs[{input}], position {pos} \
                 ({} rows in all: the final state or the head's logits overflow; {counts})",
                self.logprobs
            )
        })
    }
}

/// One answer's pieces before it is rendered: each input's rows in its batch, in input order.
/// It owns (shares) what it reads, so it can move to the thread that encodes it.
pub struct Assembly {
    pub seqs: Arc<Vec<Tokenized>>,
    /// The positions each input keeps; `None`: every position.
    pub positions: Option<Arc<Vec<Vec<u32>>>>,
    /// One per input, in input order.
    pub parts: Vec<Part>,
    pub layers: LayerSet,
    pub dtype: OutDType,
    pub hidden: usize,
    /// The log-probabilities asked for the rows, if any.
    pub logprobs: Option<LogprobsAsk>,
    pub metadata: HashMap<String, String>,
}

/// What a caller asks of next-token log-probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogprobsAsk {
    /// Entries per row, best first.
    pub top_k: usize,
    /// Also the log-probability of each row's next input token.
    pub target: bool,
}

impl Assembly {
    /// The rows the answer holds.
    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    fn fp8(&self) -> bool {
        self.dtype == OutDType::Float8E4M3
    }

    /// Counts the rows holding non-finite values as sent, per layer column, and the rows whose
    /// log-probabilities are not finite (run it off the async runtime).
    pub fn screen(&self) -> Result<Screen, EngineError> {
        let width = self.layers.len();
        let mut found = Screen { per_layer: vec![0u64; width], ..Screen::default() };
        let position = |i: usize, row: usize| self.positions.as_ref().map_or(row, |ps| ps[i][row] as usize);
        for (i, p) in self.parts.iter().enumerate() {
            for (k, &f) in p.nonfinite(self.dtype)?.iter().enumerate() {
                if f != 0 {
                    let (row, col) = (k / width, k % width);
                    found.per_layer[col] += 1;
                    if found.first.is_none() {
                        found.first = Some((i, position(i, row), col));
                    }
                }
            }
            let Some(ask) = self.logprobs else { continue };
            let (_, lps, target) = p.logprobs(ask.top_k)?;
            let last = self.seqs[i].ids.len().saturating_sub(1);
            for row in 0..p.rows {
                let pos = position(i, row);
                // The next token's log-probability is NaN by design on an input's last row.
                let bad = lps[row * ask.top_k..(row + 1) * ask.top_k].iter().any(|v| !v.is_finite())
                    || (ask.target && pos != last && !target[row].is_finite());
                if bad {
                    found.logprobs += 1;
                    if found.first_logprobs.is_none() {
                        found.first_logprobs = Some((i, pos));
                    }
                }
            }
        }
        Ok(found)
    }

    /// `[rows, layers]` scales of an fp8 answer.
    fn scale(&self) -> Result<Option<Vec<f32>>, EngineError> {
        if !self.fp8() {
            return Ok(None);
        }
        let mut all = Vec::with_capacity(self.rows() * self.layers.len());
        for p in &self.parts {
            all.extend(p.scale()?);
        }
        Ok(Some(all))
    }

    /// The log-probabilities of the answer's rows, gathered from their batches.
    fn logprobs(&self) -> Result<Option<Logprobs>, EngineError> {
        let Some(ask) = self.logprobs else { return Ok(None) };
        let rows = self.rows();
        let (mut ids, mut lps) = (Vec::with_capacity(rows * ask.top_k), Vec::with_capacity(rows * ask.top_k));
        let mut target = Vec::with_capacity(rows);
        for p in &self.parts {
            let (i, l, t) = p.logprobs(ask.top_k)?;
            ids.extend(i);
            lps.extend(l);
            target.extend(t);
        }
        Ok(Some(Logprobs { top_k: ask.top_k, ids, logprobs: lps, target: ask.target.then_some(target) }))
    }

    /// The answer, owned: each input's rows copied out of its batch and joined.
    pub fn extraction(self) -> Result<Extraction, EngineError> {
        let rows = self.rows();
        let mut data = Vec::with_capacity(rows * self.layers.len() * self.hidden * self.dtype.size_in_bytes());
        for p in &self.parts {
            data.extend_from_slice(&p.gather(self.dtype)?.data);
        }
        let hidden_states =
            HostTensor { dtype: self.dtype, shape: vec![rows, self.layers.len(), self.hidden], data: data.into() };
        let c = TokenColumns::of(&self.seqs, self.positions.as_deref().map(|p| &p[..]));
        Ok(Extraction {
            hidden_states,
            hidden_states_scale: self.scale()?,
            input_ids: c.input_ids,
            cu_seqlens: c.cu_seqlens,
            loss_mask: c.loss_mask,
            positions: c.positions,
            logprobs: self.logprobs()?,
            metadata: self.metadata,
        })
    }

    /// The answer as a safetensors file, zstd-compressed at `zstd_level` on `threads` threads
    /// when given, written from each input's rows where they sit in its batch's buffer (a copy
    /// only where layers or dtype must be rearranged). Returns the file and the bytes of hidden
    /// states it holds.
    pub fn encode(&self, zstd_level: Option<i32>, threads: usize) -> Result<(AnswerBuf, usize), AssembleError> {
        let pieces: Vec<Cow<'_, [u8]>> = self.parts.iter().map(|p| p.bytes(self.dtype)).collect::<Result<_, _>>()?;
        let cols = TokenColumns::of(&self.seqs, self.positions.as_deref().map(|p| &p[..]));
        let parts = AnswerParts {
            dtype: self.dtype,
            shape: vec![self.rows(), self.layers.len(), self.hidden],
            chunks: pieces.iter().map(|c| &c[..]).collect(),
            scale: self.scale()?,
            input_ids: cols.input_ids,
            cu_seqlens: cols.cu_seqlens,
            loss_mask: cols.loss_mask,
            positions: cols.positions,
            logprobs: self.logprobs()?,
            metadata: self.metadata.clone(),
        };
        let raw = parts.chunks.iter().map(|c| c.len()).sum();
        Ok((codec::encode_answer_on(&parts, zstd_level, threads)?, raw))
    }
}

/// Runs all `seqs` as one batch and returns their answer (the one-shot path) with what the
/// non-finite screen found, which the answer's `nonfinite` metadata also records (as the
/// service's answers do). fp8 is quantised on the device, as the service does.
pub fn once(
    engine: &mut dyn Engine,
    info: &ModelInfo,
    seqs: &[Tokenized],
    layers: &LayerSet,
    dtype: OutDType,
) -> Result<(Extraction, Screen), EngineError> {
    let mut batch = Batch::pack(seqs.iter().map(|s| &s.ids[..]), layers.indices().iter().copied());
    let fp8 = dtype == OutDType::Float8E4M3;
    if fp8 {
        batch.output = Output::all_fp8();
    }
    let taps = Arc::new(engine.forward(&batch)?);
    let parts: Vec<Part> = seqs
        .iter()
        .zip(batch.cu_seqlens.iter())
        .map(|(s, &start)| Part {
            taps: taps.clone(),
            layers: layers.indices().into(),
            fp8,
            start,
            rows: s.ids.len(),
            logprobs: None,
        })
        .collect();
    let mut assembly = Assembly {
        seqs: Arc::new(seqs.to_vec()),
        positions: None,
        parts,
        layers: layers.clone(),
        dtype,
        hidden: info.hidden_size,
        logprobs: None,
        metadata: metadata(info, layers, dtype, &Selection::All),
    };
    let found = assembly.screen()?;
    assembly.metadata.insert("nonfinite".into(), serde_json::Value::Object(found.counts(layers)).to_string());
    Ok((assembly.extraction()?, found))
}
