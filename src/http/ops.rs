//! Operational routes: health, readiness, model info, metrics.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;

use super::types::{InfoResponse, ReplicaInfo, SelfCheckInfo, StageInfo, StatusResponse};
use super::{status_code_ok, AppState};
use crate::answer::CONVENTION;

#[utoipa::path(get, path = "/health", tag = "operations", description = "The process is alive.",
    responses((status = 200, body = StatusResponse)))]
pub async fn health() -> Json<StatusResponse> {
    Json(StatusResponse { status: "ok".into(), error: None })
}

#[utoipa::path(get, path = "/ready", tag = "operations",
    description = "200 when every device has loaded the model, passed the start-up self-check (unless it is off or \
        warn-only) and the server is not draining; 503 otherwise (status loading, draining or selfcheck_failed).",
    responses((status = 200, body = StatusResponse), (status = 503, body = StatusResponse)))]
pub async fn ready(State(s): State<AppState>) -> impl IntoResponse {
    let status = if s.draining.load(Ordering::SeqCst) {
        "draining"
    } else if s.selfcheck.refused.load(Ordering::SeqCst) {
        "selfcheck_failed"
    } else if !s.loaded.load(Ordering::SeqCst) {
        "loading"
    } else {
        "ok"
    };
    let error = (status == "selfcheck_failed").then(|| s.selfcheck.failure()).flatten();
    (status_code_ok(s.is_ready()), Json(StatusResponse { status: status.into(), error }))
}

#[utoipa::path(get, path = "/v1/info", tag = "layertap", description = "The served model and the server's limits.",
    responses((status = 200, body = InfoResponse), (status = 401, body = crate::error::ErrorBody)),
    security((), ("bearer" = [])))]
pub async fn info(State(s): State<AppState>) -> Json<InfoResponse> {
    let i = &s.info;
    Json(InfoResponse {
        model_id: i.model_id.clone(),
        architecture: i.architecture.clone(),
        num_layers: i.num_layers,
        hidden_size: i.hidden_size,
        vocab_size: i.vocab_size,
        layer_kinds: (&i.layer_kinds).into(),
        quantization: i.quantization.clone(),
        dtype: i.dtype.name().into(),
        devices: s.devices.as_ref().clone(),
        replicas: replicas(&s),
        max_batch_tokens: s.scheduler.max_batch_tokens(),
        max_input_tokens: i
            .sequence_limit
            .as_ref()
            .map_or(s.limits.max_input_tokens, |(max, _)| s.limits.max_input_tokens.min(*max)),
        max_queue_tokens: s.limits.max_queue_tokens,
        max_request_tokens: s.limits.max_request_tokens,
        max_inputs: s.limits.max_inputs,
        max_messages: s.limits.max_messages,
        max_answer_bytes: s.limits.max_answer_bytes,
        max_top_k: if i.lm_head { s.max_top_k() } else { 0 },
        lm_head: i.lm_head,
        chat_roles: s
            .tokenizer
            .as_ref()
            .filter(|t| t.has_chat_template())
            .map(|t| t.roles().to_vec())
            .unwrap_or_default(),
        has_tokenizer: s.tokenizer.is_some(),
        has_chat_template: s.tokenizer.as_ref().is_some_and(|t| t.has_chat_template()),
        convention: CONVENTION.into(),
        selfcheck: selfcheck_info(&s),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

/// The loaded replicas' stages, in the order of `devices`.
fn replicas(s: &AppState) -> Vec<ReplicaInfo> {
    let loaded = s.stages.lock().map(|l| l.clone()).unwrap_or_default();
    s.devices
        .iter()
        .filter_map(|d| loaded.iter().find(|(name, _)| name == d))
        .map(|(name, stages)| ReplicaInfo {
            device: name.clone(),
            stages: stages.iter().map(StageInfo::from).collect(),
        })
        .collect()
}

/// The self-check's worst figure over the devices that have reported (None while none has, or
/// when it is off).
fn selfcheck_info(s: &AppState) -> Option<SelfCheckInfo> {
    let reports = s.selfcheck.reports.lock().ok()?;
    let (report, (index, error)) =
        reports.iter().map(|r| (r, r.worst())).fold(None, |w: Option<(&_, (usize, f64))>, c| match w {
            Some(w) if !(c.1 .1 > w.1 .1 || c.1 .1.is_nan()) => Some(w),
            _ => Some(c),
        })?;
    Some(SelfCheckInfo {
        mode: s.selfcheck.mode.name().into(),
        passed: reports.iter().all(|r| r.passed()),
        worst_relative_error: Some(error).filter(|e| e.is_finite()),
        worst_device: report.device.clone(),
        worst_index: crate::answer::layers::name(index, s.info.num_layers),
        tolerance: report.tolerance,
        devices_checked: reports.len(),
        seconds: reports.iter().map(|r| r.seconds + r.waited_seconds).fold(0.0, f64::max),
        error: s.selfcheck.failure(),
    })
}

#[utoipa::path(get, path = "/metrics", tag = "operations", description = "Prometheus text exposition.",
    responses((status = 200, content_type = "text/plain", body = String)))]
pub async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    let probes = s.memory.lock().map(|p| p.clone()).unwrap_or_default();
    for d in s.devices.iter() {
        let probe = probes.iter().find(|(name, _)| name == d).and_then(|(_, p)| p.sample());
        // The CPU reports no device memory: count the process's resident memory and host RAM.
        let sample = probe.or_else(|| (d == "cpu").then(crate::metrics::host_memory));
        if let Some((used, total)) = sample {
            s.metrics.device_memory_used.with_label_values(&[d]).set(used as i64);
            s.metrics.device_memory_total.with_label_values(&[d]).set(total as i64);
        }
    }
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render())
}
