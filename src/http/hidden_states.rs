//! `POST /v1/hidden-states` and `POST /v1/tokenize`.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::encode::{encode_permit, zstd_threads};
use super::types::{
    HiddenStatesRequest, InputItem, LogprobsRequest, TokenizeRequest, TokenizeResponse, TokenizedInput,
};
use super::{require_ready, ApiJson, AppState};
use crate::answer::assemble::state_bytes;
use crate::answer::{metadata, Assembly, HiddenStatesJson, LayerSet, LogprobsAsk, Selection};
use crate::batching::Submission;
use crate::engine::OutDType;
use crate::error::{ApiError, ErrorKind};
use crate::tokenizer::{Budget, Input, TokenizeError, Tokenized};

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
    if item.chat_template_kwargs.is_some() && item.messages.is_none() {
        return Err(ApiError::invalid(format!(
            "inputs[{i}].chat_template_kwargs goes with messages (a chat template renders only chats)"
        )));
    }
    if let Some(t) = item.text {
        return Ok(Input::Text(t));
    }
    Ok(Input::Messages(item.messages.unwrap_or_default(), item.chat_template_kwargs.unwrap_or_default()))
}

/// Sets its flag when dropped: the handler holding it has finished or was dropped (the client
/// went away or the request timed out), so work done on its behalf can stop.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn too_large(message: String) -> ApiError {
    ApiError::new(ErrorKind::TooLarge, message)
}

/// Validates and tokenizes every input, off the async runtime, within the request's limits:
/// counts are checked before any tokenization, and tokenization stops as soon as an input is
/// certainly over its budget or the caller has gone.
async fn tokenize_all(
    s: &AppState,
    inputs: Vec<InputItem>,
    split_special_tokens: bool,
) -> Result<Vec<Tokenized>, ApiError> {
    let l = &s.limits;
    if inputs.is_empty() {
        return Err(ApiError::invalid("\"inputs\" is empty: send at least one input"));
    }
    if inputs.len() > l.max_inputs {
        return Err(too_large(format!(
            "the request has {} inputs; this server accepts at most {} per request (--max-inputs)",
            inputs.len(),
            l.max_inputs
        )));
    }
    let vocab = s.info.vocab_size;
    let inputs = inputs.into_iter().enumerate().map(|(i, x)| to_input(i, x, vocab)).collect::<Result<Vec<_>, _>>()?;
    let (max_input, max_request, max_messages) = (l.max_input_tokens, l.max_request_tokens, l.max_messages);
    let mut ids_total = 0usize;
    for (i, input) in inputs.iter().enumerate() {
        match input {
            Input::Ids(ids) => {
                if ids.len() > max_input {
                    return Err(too_large(format!(
                        "inputs[{i}] has {} tokens; this server accepts at most {max_input} per input",
                        ids.len()
                    )));
                }
                ids_total += ids.len();
            }
            Input::Messages(m, _) if m.len() > max_messages => {
                return Err(too_large(format!(
                    "inputs[{i}] has {} messages; this server accepts at most {max_messages} per chat (--max-messages)",
                    m.len()
                )));
            }
            _ => {}
        }
    }
    if ids_total > max_request {
        return Err(request_too_large(ids_total, max_request));
    }
    let tok = s.tokenizer.clone();
    let sequence_limit = s.info.sequence_limit.clone();
    let gone = Arc::new(AtomicBool::new(false));
    let _guard = CancelOnDrop(gone.clone());
    tokio::task::spawn_blocking(move || {
        let cancelled = || gone.load(Ordering::Relaxed);
        let mut used = 0usize;
        let mut out = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.iter().enumerate() {
            let budget = Budget {
                max_tokens: max_input.min(max_request.saturating_sub(used)),
                max_messages,
                split_special_tokens,
                cancelled: &cancelled,
            };
            let t = input.tokenize_within(tok.as_deref(), &budget).map_err(|e| match e {
                TokenizeError::TooLarge(m) if budget.max_tokens < max_input => {
                    too_large(format!("inputs[{i}]: {m} (the request's inputs may hold {max_request} tokens in all)"))
                }
                TokenizeError::TooLarge(m) => {
                    too_large(format!("inputs[{i}]: {m} (this server accepts at most {max_input} per input)"))
                }
                other => ApiError::from(other).prefixed(i),
            })?;
            if let Some((max, why)) = sequence_limit.as_ref().filter(|(max, _)| t.ids.len() > *max) {
                return Err(too_large(format!(
                    "inputs[{i}] has {} tokens; this model accepts at most {max} per input: {why}",
                    t.ids.len()
                )));
            }
            if let Some(bad) = t.ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::internal(format!(
                    "the tokenizer produced id {bad} outside the model's vocabulary"
                )));
            }
            used += t.ids.len();
            out.push(t);
        }
        Ok(out)
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

/// Checks `logprobs` of a request: `top_k` within `--max-top-k`, a model with an output head.
fn logprobs_ask(s: &AppState, req: Option<LogprobsRequest>) -> Result<Option<LogprobsAsk>, ApiError> {
    let Some(r) = req else { return Ok(None) };
    if !s.info.lm_head {
        return Err(ApiError::invalid(format!(
            "logprobs: the model {} has no output head (its checkpoint holds no lm_head.weight and its config does \
             not tie the embeddings: tie_word_embeddings is false), so it gives no log-probabilities",
            s.info.model_id
        )));
    }
    let max = s.max_top_k();
    match usize::try_from(r.top_k) {
        Ok(k) if (1..=max).contains(&k) => Ok(Some(LogprobsAsk { top_k: k, target: r.target })),
        _ => Err(ApiError::invalid(format!(
            "logprobs.top_k must be between 1 and {max} (--max-top-k, at most the vocabulary's {} entries), got {}",
            s.info.vocab_size, r.top_k
        ))),
    }
}

/// Whether some returned row has a next input token: a row that is not its input's last.
fn has_next_token(seqs: &[Tokenized], positions: Option<&[Vec<u32>]>) -> bool {
    match positions {
        None => seqs.iter().any(|s| s.ids.len() > 1),
        Some(p) => seqs.iter().zip(p).any(|(s, p)| p.iter().any(|&x| (x as usize) + 1 < s.ids.len())),
    }
}

fn request_too_large(tokens: usize, max: usize) -> ApiError {
    too_large(format!(
        "the request has {tokens} tokens over its inputs; this server accepts at most {max} per request \
         (--max-request-tokens): split it into several requests"
    ))
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
    let seqs = tokenize_all(&s, req.inputs, req.split_special_tokens).await?;
    Ok(Json(TokenizeResponse {
        results: seqs.into_iter().map(|t| TokenizedInput { input_ids: t.ids, loss_mask: t.loss_mask }).collect(),
    }))
}

/// The elements of a comma-separated header with their quality (`q`, default 1), names lowercased.
fn weighted(v: &str) -> Vec<(String, f32)> {
    v.split(',')
        .filter_map(|part| {
            let mut it = part.split(';');
            let name = it.next()?.trim().to_ascii_lowercase();
            if name.is_empty() {
                return None;
            }
            let q = it
                .find_map(|p| {
                    let (k, v) = p.split_once('=')?;
                    k.trim().eq_ignore_ascii_case("q").then(|| v.trim().parse::<f32>().ok())?
                })
                .unwrap_or(1.0);
            Some((name, if q.is_finite() { q.clamp(0.0, 1.0) } else { 0.0 }))
        })
        .collect()
}

/// True when the client accepts zstd: no Accept-Encoding at all, or zstd (or `*`, when zstd is not
/// named) with a quality above 0.
pub fn wants_zstd(headers: &HeaderMap) -> bool {
    let Some(v) = headers.get(header::ACCEPT_ENCODING).and_then(|v| v.to_str().ok()) else { return true };
    let list = weighted(v);
    let q = |name: &str| list.iter().find(|(n, _)| n == name).map(|&(_, q)| q);
    q("zstd").or_else(|| q("*")).unwrap_or(0.0) > 0.0
}

/// Quality and specificity (2 exact, 1 `type/*`, 0 `*/*`) the Accept list gives `media`.
fn accepts(list: &[(String, f32)], media: &str) -> (f32, u8) {
    let kind = media.split('/').next().unwrap_or("");
    let mut best: Option<(f32, u8)> = None;
    for (name, q) in list {
        let spec = if name == media {
            2
        } else if name.strip_suffix("/*") == Some(kind) {
            1
        } else if name == "*/*" {
            0
        } else {
            continue;
        };
        if best.is_none_or(|(_, s)| spec > s) {
            best = Some((*q, spec));
        }
    }
    best.unwrap_or((0.0, 0))
}

/// True for a JSON answer: the Accept header prefers application/json (higher quality, or equal
/// quality named more specifically) to application/octet-stream. 406 when it accepts neither.
fn wants_json(headers: &HeaderMap) -> Result<bool, ApiError> {
    let Some(v) = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).filter(|v| !v.trim().is_empty()) else {
        return Ok(false);
    };
    let list = weighted(v);
    let (json, octets) = (accepts(&list, "application/json"), accepts(&list, "application/octet-stream"));
    if json.0 <= 0.0 && octets.0 <= 0.0 {
        return Err(ApiError::new(
            ErrorKind::NotAcceptable,
            "this route answers application/octet-stream (safetensors) or application/json; the Accept header allows neither",
        ));
    }
    Ok(json.0 > 0.0 && (json.0, json.1) > (octets.0, octets.1))
}

fn ms(d: std::time::Duration) -> HeaderValue {
    HeaderValue::from_str(&format!("{:.3}", d.as_secs_f64() * 1000.0)).unwrap_or(HeaderValue::from_static("0"))
}

#[utoipa::path(post, path = "/v1/hidden-states", tag = "layertap", request_body = HiddenStatesRequest,
    description = "Hidden states of the requested layers for each input, packed along the token dimension. \
        The answer is a safetensors file (zstd-compressed unless the client sends Accept-Encoding without zstd) \
        holding hidden_states [total_tokens, n_layers, hidden], input_ids [total_tokens] int64, \
        cu_seqlens [n_inputs + 1] int64 and loss_mask [total_tokens] uint8; with logprobs also topk_ids \
        [total_tokens, top_k] int64, topk_logprobs [total_tokens, top_k] float32 and (with target) \
        target_logprobs [total_tokens] float32; Accept: application/json gives the same content as JSON.",
    responses(
        (status = 200, description = "safetensors bytes (Content-Encoding: zstd when accepted)", content_type = "application/octet-stream", body = Vec<u8>,
         headers(("x-queue-time" = String, description = "ms waiting for a batch"), ("x-inference-time" = String, description = "ms from first batch to answer"), ("x-tokens" = String, description = "tokens in the answer"))),
        (status = 400, body = crate::error::ErrorBody), (status = 401, body = crate::error::ErrorBody),
        (status = 406, body = crate::error::ErrorBody),
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
        None => s.info.dtype.out(),
        Some(d) => OutDType::parse(d).ok_or_else(|| {
            ApiError::invalid(format!("unknown dtype {d:?}; use float32, bfloat16, float16 or float8_e4m3fn"))
        })?,
    };
    let fp8 = dtype == OutDType::Float8E4M3;
    let logprobs = logprobs_ask(&s, req.logprobs)?;
    let layers = if req.layers.is_empty() && logprobs.is_some() {
        LayerSet::none(s.info.num_layers)
    } else {
        LayerSet::resolve(&req.layers, s.info.num_layers).map_err(|e| {
            ApiError::invalid(if req.layers.is_empty() { format!("{e} (or ask for \"logprobs\" alone)") } else { e })
        })?
    };
    let selection = Selection::parse(req.tokens.as_ref(), req.inputs.len()).map_err(ApiError::invalid)?;
    let json = wants_json(&headers)?;
    let seqs = tokenize_all(&s, req.inputs, req.split_special_tokens).await?;
    let positions = selection.positions(&seqs).map_err(ApiError::invalid)?.map(Arc::new);
    let hidden = s.info.hidden_size;
    let total: usize = match &positions {
        Some(p) => p.iter().map(Vec::len).sum(),
        None => seqs.iter().map(|t| t.ids.len()).sum(),
    };
    if logprobs.is_some_and(|a| a.target) && !has_next_token(&seqs, positions.as_deref().map(|p| &p[..])) {
        return Err(ApiError::invalid(if total == 0 {
            "logprobs.target asks for the log-probability of each returned row's next input token, but the \
             \"tokens\" selection returns no row at all; select some tokens or drop \"target\""
        } else {
            "logprobs.target asks for the log-probability of each returned row's next input token, but no \
             returned row has one (each is the last token of its input); return earlier tokens or drop \
             \"target\""
        }));
    }
    // Log-probabilities add 12 bytes per row and entry (an int64 id, a float32) and 4 per row.
    let lp_bytes = logprobs.map_or(0, |a| total * (a.top_k * 12 + if a.target { 4 } else { 0 }));
    let answer_bytes = state_bytes(total, layers.len(), hidden, dtype) + lp_bytes;
    if answer_bytes > s.limits.max_answer_bytes {
        return Err(too_large(format!(
            "the answer would hold {answer_bytes} bytes of hidden states and log-probabilities ({total} tokens x {} \
             layers x {hidden} x {}, plus {lp_bytes} bytes of log-probabilities), more than the {} allowed \
             (--max-answer-bytes); ask for fewer layers, a smaller dtype, a smaller top_k or fewer tokens",
            layers.len(),
            dtype.name(),
            s.limits.max_answer_bytes
        )));
    }
    let json_values = total * layers.len() * hidden + logprobs.map_or(0, |a| total * (2 * a.top_k + 1));
    if json && json_values > s.limits.max_json_values {
        return Err(ApiError::new(
            ErrorKind::TooLarge,
            format!(
                "a JSON answer would hold {json_values} values, more than the {} allowed; ask for safetensors (drop Accept: application/json) or send less",
                s.limits.max_json_values
            ),
        ));
    }
    let seqs = Arc::new(seqs);
    let sub = Submission {
        seqs: seqs.clone(),
        layers: layers.indices().into(),
        positions: positions.clone(),
        fp8,
        top_k: logprobs.map(|a| a.top_k),
    };
    let mut meta = metadata(&s.info, &layers, dtype, &selection);
    if let Some(a) = logprobs {
        meta.insert("top_k".into(), a.top_k.to_string());
    }
    let rx = s.scheduler.submit(sub)?;
    // Counted until this request is answered or dropped: a client that hangs up drops this
    // handler's future mid-await, and the guard takes it off the gauge then too.
    let in_queue = GaugeGuard::inc(&s.metrics.queue_requests);
    // Stop waiting when the drain deadline passes: dropping `rx` makes the queue skip the rest.
    let waited = tokio::select! {
        w = tokio::time::timeout(s.limits.request_timeout, rx) => Some(w),
        _ = s.abandon.cancelled() => None,
    };
    drop(in_queue);
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
            tracing::warn!(timeout_s = s.limits.request_timeout.as_secs_f64(), "a request timed out in the server");
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                "the request timed out in the server; retry later or send less",
            ));
        }
        Ok(Err(_)) => return Err(ApiError::new(ErrorKind::Unavailable, "the server is shutting down")),
        Ok(Ok(r)) => r?,
    };
    let assembly = Assembly { seqs, positions, parts: answer.parts, layers, dtype, hidden, logprobs, metadata: meta };
    // Non-finite values never pass silently: counted, then refused unless the caller allows them.
    // Off the async runtime: where the answer's dtype is narrower than the compute dtype, the
    // screen reads every value of the answer.
    let (assembly, found) = tokio::task::spawn_blocking(move || {
        let found = assembly.screen();
        (assembly, found)
    })
    .await
    .map_err(|e| ApiError::internal(format!("screen task failed: {e}")))?;
    let mut assembly = assembly;
    let found = found?;
    let nonfinite = found.counts(&assembly.layers);
    for (label, count) in &nonfinite {
        s.metrics.nonfinite.with_label_values(&[label.as_str()]).inc_by(count.as_u64().unwrap_or(0));
    }
    if let (Some(why), false) = (found.refusal(&assembly.layers), req.allow_nonfinite) {
        tracing::warn!(found = %serde_json::Value::Object(nonfinite.clone()), "non-finite answer: request refused");
        return Err(ApiError::invalid(format!(
            "{why}; nothing is returned. Send allow_nonfinite: true to receive such an answer anyway"
        )));
    }
    assembly.metadata.insert("nonfinite".into(), serde_json::Value::Object(nonfinite).to_string());
    let (queue_time, inference_time) = (answer.queue_time, answer.inference_time);
    let zstd = wants_zstd(&headers) && !json;
    let level = s.limits.zstd_level;
    let metrics = s.metrics.clone();
    // Encoding waits for its share of the cores that answers may use (see encode::encode_threads).
    let threads = if zstd { zstd_threads(total * assembly.layers.len() * hidden * dtype.size_in_bytes()) } else { 1 };
    let permit = encode_permit(threads).await;
    let body = tokio::task::spawn_blocking(move || -> Result<(bytes::Bytes, bool), ApiError> {
        let _permit = permit;
        if json {
            let x = assembly.extraction()?;
            metrics.hidden_state_bytes.with_label_values(&["raw"]).inc_by(x.hidden_states.data.len() as u64);
            let j = HiddenStatesJson::from(x);
            return serde_json::to_vec(&j).map(|b| (b.into(), false)).map_err(|e| ApiError::internal(e.to_string()));
        }
        let (bytes, raw) = assembly.encode(zstd.then_some(level), threads)?;
        metrics.hidden_state_bytes.with_label_values(&["raw"]).inc_by(raw as u64);
        // The body is the pooled buffer itself: it goes back to the pool once written out.
        Ok((bytes.into_bytes(), zstd))
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

/// One unit of a gauge, held until dropped (however the holder ends: answered, failed, or its
/// future dropped when the client hung up).
struct GaugeGuard(prometheus::IntGauge);

impl GaugeGuard {
    fn inc(g: &prometheus::IntGauge) -> Self {
        g.inc();
        GaugeGuard(g.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
