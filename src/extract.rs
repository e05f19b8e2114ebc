//! Turning inputs into an [`Extraction`]: tokenize, pack, run the engine, slice the answer.
//! Shared by the one-shot `extract` command and the service.

use std::collections::HashMap;

use crate::batching::Part;
use crate::codec::{Extraction, CONVENTION};
use crate::engine::{layer_label, Batch, Engine, EngineError, HostTensor, ModelInfo, OutDType, Output};
use crate::select::Selection;
use crate::tokenizer::{Budget, ChatMessage, TextTokenizer, TokenizeError, Tokenized};

/// One input sequence, as the caller gave it.
#[derive(Clone, Debug)]
pub enum Input {
    Ids(Vec<u32>),
    Text(String),
    Messages(Vec<ChatMessage>),
}

#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

fn no_tokenizer() -> TokenizeError {
    TokenizeError::Unsupported("this model has no tokenizer; send \"input_ids\" instead of text or messages".into())
}

/// Tokenizes one input; the loss mask is all ones except for chats.
pub fn tokenize(tok: Option<&TextTokenizer>, input: &Input) -> Result<Tokenized, TokenizeError> {
    tokenize_within(tok, input, &Budget::unlimited())
}

/// [`tokenize`] within `budget` (token and message limits, cancellation).
pub fn tokenize_within(
    tok: Option<&TextTokenizer>,
    input: &Input,
    budget: &Budget,
) -> Result<Tokenized, TokenizeError> {
    let ones = |ids: Vec<u32>| Tokenized { loss_mask: vec![1; ids.len()], ids };
    let t = match input {
        Input::Ids(ids) if ids.len() > budget.max_tokens => {
            return Err(TokenizeError::TooLarge(format!(
                "{} tokens; at most {} fit here",
                ids.len(),
                budget.max_tokens
            )))
        }
        Input::Ids(ids) => ones(ids.clone()),
        Input::Text(text) => ones(tok.ok_or_else(no_tokenizer)?.encode_text_within(text, budget)?),
        Input::Messages(m) => tok.ok_or_else(no_tokenizer)?.encode_chat_within(m, budget)?,
    };
    if t.ids.is_empty() {
        return Err(TokenizeError::Invalid("an input produced no tokens; every input needs at least one".into()));
    }
    Ok(t)
}

/// `cu_seqlens` for sequences of these lengths.
pub fn cu_seqlens<'a>(lens: impl IntoIterator<Item = &'a usize>) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lens {
        cu.push(cu.last().copied().unwrap_or(0) + l);
    }
    cu
}

/// Distinct layers of `layers`, in first-seen order (what the engine computes).
pub fn distinct(layers: &[usize]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::with_capacity(layers.len());
    for &l in layers {
        if !out.contains(&l) {
            out.push(l);
        }
    }
    out
}

/// Metadata stored in every answer (the handler adds `nonfinite`; the codec the checksums).
pub fn metadata(info: &ModelInfo, layers: &[usize], dtype: OutDType, tokens: &Selection) -> HashMap<String, String> {
    let labels: Vec<serde_json::Value> = layers.iter().map(|&l| layer_label(l, info.num_layers)).collect();
    HashMap::from([
        ("model".to_string(), info.model_id.clone()),
        ("architecture".to_string(), info.architecture.clone()),
        ("num_layers".to_string(), info.num_layers.to_string()),
        ("layers".to_string(), serde_json::Value::from(labels).to_string()),
        ("dtype".to_string(), dtype.name().to_string()),
        ("tokens".to_string(), tokens.label()),
        ("convention".to_string(), CONVENTION.to_string()),
        ("format".to_string(), "layertap/1".to_string()),
    ])
}

/// The token columns of an answer for `seqs`, one entry per returned row: input ids, offsets
/// over the rows, loss mask, and (with a selection) each row's position in its input.
pub struct TokenColumns {
    pub input_ids: Vec<i64>,
    pub cu_seqlens: Vec<i64>,
    pub loss_mask: Vec<u8>,
    pub positions: Option<Vec<i64>>,
}

/// [`TokenColumns`] for `seqs`, every row or the `positions` of each.
pub fn token_columns(seqs: &[Tokenized], positions: Option<&[Vec<u32>]>) -> TokenColumns {
    let Some(pos) = positions else {
        let lens: Vec<usize> = seqs.iter().map(|s| s.ids.len()).collect();
        return TokenColumns {
            input_ids: seqs.iter().flat_map(|s| s.ids.iter().map(|&i| i64::from(i))).collect(),
            cu_seqlens: cu_seqlens(lens.iter()).into_iter().map(|x| x as i64).collect(),
            loss_mask: seqs.iter().flat_map(|s| s.loss_mask.iter().copied()).collect(),
            positions: None,
        };
    };
    let lens: Vec<usize> = pos.iter().map(Vec::len).collect();
    let rows = || seqs.iter().zip(pos).flat_map(|(s, p)| p.iter().map(move |&x| (s, x as usize)));
    TokenColumns {
        input_ids: rows().map(|(s, x)| i64::from(s.ids[x])).collect(),
        cu_seqlens: cu_seqlens(lens.iter()).into_iter().map(|x| x as i64).collect(),
        loss_mask: rows().map(|(s, x)| s.loss_mask[x]).collect(),
        positions: Some(rows().map(|(_, x)| x as i64).collect()),
    }
}

/// The answer for `seqs` given their hidden states `[rows, layers, hidden]` (and their fp8
/// scales), every row or the `positions` of each input.
pub fn extraction(
    seqs: &[Tokenized],
    positions: Option<&[Vec<u32>]>,
    hidden_states: HostTensor,
    hidden_states_scale: Option<Vec<f32>>,
    metadata: HashMap<String, String>,
) -> Extraction {
    let c = token_columns(seqs, positions);
    Extraction {
        hidden_states,
        hidden_states_scale,
        input_ids: c.input_ids,
        cu_seqlens: c.cu_seqlens,
        loss_mask: c.loss_mask,
        positions: c.positions,
        metadata,
    }
}

/// Runs all `seqs` as one batch and returns their extraction (the one-shot path). fp8 is
/// quantised on the device, as the service does.
pub fn run_once(
    engine: &mut dyn Engine,
    info: &ModelInfo,
    seqs: &[Tokenized],
    layers: &[usize],
    dtype: OutDType,
) -> Result<Extraction, EngineError> {
    let cu = cu_seqlens(seqs.iter().map(|s| s.ids.len()).collect::<Vec<_>>().iter());
    let fp8 = dtype == OutDType::Float8E4M3;
    let mut batch = Batch::new(seqs.iter().flat_map(|s| s.ids.iter().copied()).collect(), cu, distinct(layers));
    if fp8 {
        batch.output = Output::all_fp8();
    }
    let taps = std::sync::Arc::new(engine.forward(&batch)?);
    let part = Part { taps, fp8, start: 0, rows: batch.input_ids.len() };
    let hidden = part.gather(layers, dtype)?;
    let scale = if fp8 { Some(part.scale(layers)?) } else { None };
    Ok(extraction(seqs, None, hidden, scale, metadata(info, layers, dtype, &Selection::All)))
}
