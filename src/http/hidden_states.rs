//! `POST /v1/hidden-states` and `POST /v1/tokenize`.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::types::{
    HiddenStatesJson, HiddenStatesRequest, InputItem, TokenizeRequest, TokenizeResponse, TokenizedInput,
};
use super::{require_ready, ApiJson, AppState};
use crate::batching::{Part, Submission};
use crate::codec;
use crate::engine::{HostTensor, OutDType};
use crate::error::{ApiError, ErrorKind};
use crate::extract::{extraction, metadata, token_columns, tokenize as tokenize_input, Input};
use crate::tokenizer::Tokenized;

/// Checks one input's shape (exactly one kind, ids in range) and turns it into an [`Input`].
fn to_input(i: usize, item: InputItem, vocab: usize) -> Result<Input, ApiError> {
    let kinds = [item.input_ids.is_some(), item.text.is_some(), item.messages.is_some()];
    match kinds.iter().filter(|k| **k).count() {
        1 => {}
        0 => return Err(ApiError::invalid(format!("inputs[{i}] is empty: give one of input_ids, text or messages"))),
        _ => {
            return Err(ApiError::invalid(format!(
                "inputs[{i}] has more than one of input_ids, text and messages; give exactly one"
            )))
        }
    }
    if let Some(ids) = item.input_ids {
        let bad = ids.iter().find(|&&t| t < 0 || t as u64 >= vocab as u64);
        if let Some(t) = bad {
            return Err(ApiError::invalid(format!(
                "inputs[{i}].input_ids contains {t}, outside the vocabulary (0..{vocab})"
            )));
        }
        return Ok(Input::Ids(ids.into_iter().map(|t| t as u32).collect()));
    }
    if let Some(t) = item.text {
        return Ok(Input::Text(t));
    }
    Ok(Input::Messages(item.messages.unwrap_or_default()))
}

/// Validates and tokenizes every input, off the async runtime.
async fn tokenize_all(s: &AppState, inputs: Vec<InputItem>) -> Result<Vec<Tokenized>, ApiError> {
    if inputs.is_empty() {
        return Err(ApiError::invalid("\"inputs\" is empty: send at least one input"));
    }
    let vocab = s.info.vocab_size;
    let inputs = inputs.into_iter().enumerate().map(|(i, x)| to_input(i, x, vocab)).collect::<Result<Vec<_>, _>>()?;
    let tok = s.tokenizer.clone();
    let max = s.limits.max_input_tokens;
    tokio::task::spawn_blocking(move || {
        inputs
            .iter()
            .enumerate()
            .map(|(i, input)| {
                let t = tokenize_input(tok.as_deref(), input).map_err(|e| ApiError::from(e).prefixed(i))?;
                if let Some(bad) = t.ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(ApiError::internal(format!(
                        "the tokenizer produced id {bad} outside the model's vocabulary"
                    )));
                }
                if t.ids.len() > max {
                    return Err(ApiError::new(
                        ErrorKind::TooLarge,
                        format!("inputs[{i}] has {} tokens; this server accepts at most {max} per input", t.ids.len()),
                    ));
                }
                Ok(t)
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

impl ApiError {
    fn prefixed(mut self, i: usize) -> Self {
        self.message = format!("inputs[{i}]: {}", self.message);
        self
    }
}

#[utoipa::path(post, path = "/v1/tokenize", tag = "layertap", request_body = TokenizeRequest,
    responses((status = 200, body = TokenizeResponse), (status = 422, body = crate::error::ErrorBody)),
    security((), ("bearer" = [])))]
pub async fn tokenize(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let seqs = tokenize_all(&s, req.inputs).await?;
    Ok(Json(TokenizeResponse {
        results: seqs.into_iter().map(|t| TokenizedInput { input_ids: t.ids, loss_mask: t.loss_mask }).collect(),
    }))
}

/// True when the client accepts zstd (or states no preference).
pub fn wants_zstd(headers: &HeaderMap) -> bool {
    let Some(v) = headers.get(header::ACCEPT_ENCODING).and_then(|v| v.to_str().ok()) else { return true };
    v.split(',').any(|part| {
        let mut it = part.split(';');
        let name = it.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = it.find_map(|p| p.trim().strip_prefix("q=").and_then(|q| q.trim().parse::<f32>().ok())).unwrap_or(1.0);
        (name == "zstd" || name == "*") && q > 0.0
    })
}

fn wants_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|p| p.trim().starts_with("application/json")))
}

fn ms(d: std::time::Duration) -> HeaderValue {
    HeaderValue::from_str(&format!("{:.3}", d.as_secs_f64() * 1000.0)).unwrap_or(HeaderValue::from_static("0"))
}

/// Cuts each sequence out of its batch and joins them along the token dimension.
fn concat(parts: &[Part], layers: &[usize], hidden: usize, dtype: OutDType) -> Result<HostTensor, ApiError> {
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    let mut data = Vec::with_capacity(rows * layers.len() * hidden * dtype.size_in_bytes());
    for p in parts {
        data.extend_from_slice(&p.gather(layers, dtype)?.data);
    }
    Ok(HostTensor { dtype, shape: vec![rows, layers.len(), hidden], data: data.into() })
}

#[utoipa::path(post, path = "/v1/hidden-states", tag = "layertap", request_body = HiddenStatesRequest,
    description = "Hidden states of the requested layers for each input, packed along the token dimension. \
        The answer is a safetensors file (zstd-compressed unless the client sends Accept-Encoding without zstd) \
        holding hidden_states [total_tokens, n_layers, hidden], input_ids [total_tokens] int64, \
        cu_seqlens [n_inputs + 1] int64 and loss_mask [total_tokens] uint8; Accept: application/json gives the \
        same content as JSON.",
    responses(
        (status = 200, description = "safetensors bytes (Content-Encoding: zstd when accepted)", content_type = "application/octet-stream", body = Vec<u8>,
         headers(("x-queue-time" = String, description = "ms waiting for a batch"), ("x-inference-time" = String, description = "ms from first batch to answer"), ("x-tokens" = String, description = "tokens in the answer"))),
        (status = 400, body = crate::error::ErrorBody), (status = 401, body = crate::error::ErrorBody),
        (status = 413, body = crate::error::ErrorBody), (status = 415, body = crate::error::ErrorBody),
        (status = 422, body = crate::error::ErrorBody), (status = 429, body = crate::error::ErrorBody),
        (status = 503, body = crate::error::ErrorBody)),
    security((), ("bearer" = [])))]
pub async fn hidden_states(
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<HiddenStatesRequest>,
) -> Result<Response, ApiError> {
    require_ready(&s)?;
    let dtype = match req.dtype.as_deref() {
        None => s.info.dtype,
        Some(d) => OutDType::parse(d)
            .ok_or_else(|| ApiError::invalid(format!("unknown dtype {d:?}; use float32, bfloat16 or float16")))?,
    };
    let layers = crate::engine::resolve_layers(&req.layers, s.info.num_layers)?;
    let seqs = tokenize_all(&s, req.inputs).await?;
    let json = wants_json(&headers);
    let hidden = s.info.hidden_size;
    let total: usize = seqs.iter().map(|t| t.ids.len()).sum();
    if json && total * layers.len() * hidden > s.limits.max_json_values {
        return Err(ApiError::new(
            ErrorKind::TooLarge,
            format!(
                "a JSON answer would hold {} values, more than the {} allowed; ask for safetensors (drop Accept: application/json) or send less",
                total * layers.len() * hidden,
                s.limits.max_json_values
            ),
        ));
    }
    let seqs = std::sync::Arc::new(seqs);
    let sub = Submission { seqs: seqs.clone(), layers: layers.clone() };
    let meta = metadata(&s.info, &layers, dtype);
    let rx = s.scheduler.submit(sub)?;
    s.metrics.queue_requests.inc();
    // Stop waiting when the drain deadline passes: dropping `rx` makes the queue skip the rest.
    let waited = tokio::select! {
        w = tokio::time::timeout(s.limits.request_timeout, rx) => Some(w),
        _ = s.abandon.cancelled() => None,
    };
    s.metrics.queue_requests.dec();
    let Some(waited) = waited else {
        return Err(ApiError {
            retry_after_s: Some(1),
            ..ApiError::new(
                ErrorKind::Unavailable,
                "the server shut down before this request finished; retry on another replica",
            )
        });
    };
    let answer = match waited {
        Err(_) => {
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                "the request timed out in the server; retry later or send less",
            ))
        }
        Ok(Err(_)) => return Err(ApiError::new(ErrorKind::Unavailable, "the server is shutting down")),
        Ok(Ok(r)) => r?,
    };
    let (queue_time, inference_time) = (answer.queue_time, answer.inference_time);
    let zstd = wants_zstd(&headers) && !json;
    let level = s.limits.zstd_level;
    let metrics = s.metrics.clone();
    let body = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, bool), ApiError> {
        if json {
            let x = extraction(&seqs, concat(&answer.parts, &layers, hidden, dtype)?, meta);
            metrics.hidden_state_bytes.with_label_values(&["raw"]).inc_by(x.hidden_states.data.len() as u64);
            let j = HiddenStatesJson {
                shape: x.hidden_states.shape.clone(),
                dtype: dtype.name().into(),
                hidden_states: x.hidden_states.to_f32(),
                input_ids: x.input_ids,
                cu_seqlens: x.cu_seqlens,
                loss_mask: x.loss_mask,
                metadata: x.metadata,
            };
            return serde_json::to_vec(&j).map(|b| (b, false)).map_err(|e| ApiError::internal(e.to_string()));
        }
        // Each sequence's rows straight from its batch's buffer where the layout already matches
        // (the usual case); a copy only where layers or dtype must be rearranged.
        let pieces = answer.parts.iter().map(|p| p.bytes(&layers, dtype)).collect::<Result<Vec<_>, _>>()?;
        let chunks: Vec<&[u8]> = pieces.iter().map(|c| &c[..]).collect();
        let (input_ids, cu_seqlens, loss_mask) = token_columns(&seqs);
        let parts = codec::AnswerParts {
            dtype,
            shape: vec![total, layers.len(), hidden],
            chunks,
            input_ids,
            cu_seqlens,
            loss_mask,
            metadata: meta,
        };
        metrics
            .hidden_state_bytes
            .with_label_values(&["raw"])
            .inc_by(parts.chunks.iter().map(|c| c.len() as u64).sum());
        let bytes = codec::encode_answer(&parts, zstd.then_some(level))
            .map_err(|e| ApiError::internal(format!("encoding the answer: {e}")))?;
        Ok((bytes, zstd))
    })
    .await
    .map_err(|e| ApiError::internal(format!("encoder task failed: {e}")))??;
    let (bytes, compressed) = body;
    s.metrics.hidden_state_bytes.with_label_values(&["encoded"]).inc_by(bytes.len() as u64);
    let mut resp = bytes.into_response();
    let h = resp.headers_mut();
    let ctype = if json { "application/json" } else { "application/octet-stream" };
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    if compressed {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("zstd"));
    }
    h.insert(header::VARY, HeaderValue::from_static("accept, accept-encoding"));
    h.insert("x-queue-time", ms(queue_time));
    h.insert("x-inference-time", ms(inference_time));
    h.insert("x-tokens", HeaderValue::from(total));
    Ok(resp)
}
