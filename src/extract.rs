//! Turning inputs into an [`Extraction`]: tokenize, pack, run the engine, slice the answer.
//! Shared by the one-shot `extract` command and the service.

use std::collections::HashMap;

use crate::codec::{Extraction, CONVENTION};
use crate::engine::{Batch, Engine, EngineError, HostTensor, ModelInfo, OutDType};
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

/// Metadata stored in every answer.
pub fn metadata(info: &ModelInfo, layers: &[usize], dtype: OutDType) -> HashMap<String, String> {
    HashMap::from([
        ("model".to_string(), info.model_id.clone()),
        ("architecture".to_string(), info.architecture.clone()),
        ("num_layers".to_string(), info.num_layers.to_string()),
        ("layers".to_string(), serde_json::to_string(layers).unwrap_or_default()),
        ("dtype".to_string(), dtype.name().to_string()),
        ("convention".to_string(), CONVENTION.to_string()),
        ("format".to_string(), "layertap/1".to_string()),
    ])
}

/// The token columns of an answer for `seqs`: input ids, offsets, loss mask.
pub fn token_columns(seqs: &[Tokenized]) -> (Vec<i64>, Vec<i64>, Vec<u8>) {
    let lens: Vec<usize> = seqs.iter().map(|s| s.ids.len()).collect();
    (
        seqs.iter().flat_map(|s| s.ids.iter().map(|&i| i64::from(i))).collect(),
        cu_seqlens(lens.iter()).into_iter().map(|x| x as i64).collect(),
        seqs.iter().flat_map(|s| s.loss_mask.iter().copied()).collect(),
    )
}

/// The answer for `seqs` given their hidden states `[total_tokens, layers, hidden]`.
pub fn extraction(seqs: &[Tokenized], hidden_states: HostTensor, metadata: HashMap<String, String>) -> Extraction {
    let (input_ids, cu_seqlens, loss_mask) = token_columns(seqs);
    Extraction { hidden_states, input_ids, cu_seqlens, loss_mask, metadata }
}

/// Runs all `seqs` as one batch and returns their extraction (the one-shot path).
pub fn run_once(
    engine: &mut dyn Engine,
    info: &ModelInfo,
    seqs: &[Tokenized],
    layers: &[usize],
    dtype: OutDType,
) -> Result<Extraction, EngineError> {
    let cu = cu_seqlens(seqs.iter().map(|s| s.ids.len()).collect::<Vec<_>>().iter());
    let batch = Batch {
        input_ids: seqs.iter().flat_map(|s| s.ids.iter().copied()).collect(),
        cu_seqlens: cu.clone(),
        layers: distinct(layers),
    };
    let taps = engine.forward(&batch)?;
    let hidden = taps.gather(0, batch.input_ids.len(), layers, dtype)?;
    Ok(extraction(seqs, hidden, metadata(info, layers, dtype)))
}
