//! The HTTP layer: parse and validate, admit or refuse, encode the answer.

mod extract;
pub mod hidden_states;
pub mod openapi;
pub mod ops;
pub mod types;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use subtle::ConstantTimeEq;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub use extract::ApiJson;

use crate::batching::Scheduler;
use crate::engine::{MemoryProbe, ModelInfo};
use crate::error::{ApiError, ErrorKind};
use crate::metrics::Metrics;
use crate::tokenizer::TextTokenizer;

/// Limits the HTTP layer enforces.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_batch_tokens: usize,
    pub max_input_tokens: usize,
    pub max_queue_tokens: usize,
    pub max_body_bytes: usize,
    pub max_json_values: usize,
    pub zstd_level: i32,
    pub request_timeout: Duration,
}

impl Default for Limits {
    /// The defaults of `layertap serve` (see its flags).
    fn default() -> Self {
        Limits {
            max_batch_tokens: 1024,
            max_input_tokens: 8192,
            max_queue_tokens: 131072,
            max_body_bytes: 64 << 20,
            max_json_values: 4 << 20,
            zstd_level: 3,
            request_timeout: Duration::from_secs(600),
        }
    }
}

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub info: Arc<ModelInfo>,
    pub devices: Arc<Vec<String>>,
    pub tokenizer: Option<Arc<TextTokenizer>>,
    pub scheduler: Scheduler,
    pub metrics: Arc<Metrics>,
    pub limits: Arc<Limits>,
    pub api_keys: Arc<Vec<String>>,
    /// Every device has loaded its model.
    pub loaded: Arc<AtomicBool>,
    /// Memory readers of the loaded devices, by device name.
    pub memory: Arc<std::sync::Mutex<Vec<(String, MemoryProbe)>>>,
    /// Shutdown has begun.
    pub draining: Arc<AtomicBool>,
}

impl AppState {
    pub fn is_ready(&self) -> bool {
        self.loaded.load(Ordering::SeqCst) && !self.draining.load(Ordering::SeqCst)
    }
}

static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The whole router: `/v1/*` behind optional bearer auth; health, readiness, metrics and docs open.
pub fn app(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/hidden-states", post(hidden_states::hidden_states))
        .route("/v1/tokenize", post(hidden_states::tokenize))
        .route("/v1/info", get(ops::info))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let open = Router::new()
        .route("/health", get(ops::health))
        .route("/ready", get(ops::ready))
        .route("/metrics", get(ops::metrics))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/docs", get(openapi::docs));
    let body_limit = state.limits.max_body_bytes;
    api.merge(open)
        .fallback(|| async { ApiError::new(ErrorKind::NotFound, "no such route; see /docs for the API") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(ErrorKind::MethodNotAllowed, "method not allowed on this route; see /docs")
        })
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(
            ServiceBuilder::new()
                .layer(SetRequestIdLayer::new(REQUEST_ID.clone(), MakeRequestUuid))
                .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
                    let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_owned());
                    let id = req.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-").to_owned();
                    tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), route, request_id = %id)
                }))
                .layer(PropagateRequestIdLayer::new(REQUEST_ID.clone())),
        )
        .with_state(state)
}

/// Counts requests by matched route and status, times them, and tracks those in flight.
async fn track(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let route =
        req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_owned()).unwrap_or_else(|| "unmatched".into());
    let in_flight = s.metrics.in_flight.with_label_values(&[&route]);
    in_flight.inc();
    struct Guard(prometheus::IntGauge);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.dec();
        }
    }
    let _guard = Guard(in_flight);
    let start = Instant::now();
    let resp = next.run(req).await;
    s.metrics.request_duration.with_label_values(&[&route]).observe(start.elapsed().as_secs_f64());
    s.metrics.requests.with_label_values(&[&route, resp.status().as_str()]).inc();
    resp
}

/// Bearer-token check (constant-time) when API keys are configured.
async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if s.api_keys.is_empty() {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let ok = given.is_some_and(|g| {
        // Fold over every key so timing does not reveal which one (if any) matched.
        s.api_keys.iter().fold(0u8, |acc, k| acc | k.as_bytes().ct_eq(g.as_bytes()).unwrap_u8()) == 1
    });
    if ok {
        next.run(req).await
    } else {
        let mut r =
            ApiError::new(ErrorKind::Unauthorized, "missing or wrong API key: send Authorization: Bearer <key>")
                .into_response();
        r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        r
    }
}

/// 503 while loading or draining.
pub(crate) fn require_ready(s: &AppState) -> Result<(), ApiError> {
    if s.draining.load(Ordering::SeqCst) {
        Err(ApiError::new(ErrorKind::Unavailable, "the server is shutting down; retry on another replica"))
    } else if !s.loaded.load(Ordering::SeqCst) {
        Err(ApiError { retry_after_s: Some(5), ..ApiError::new(ErrorKind::Unavailable, "the model is still loading") })
    } else {
        Ok(())
    }
}

pub(crate) fn status_code_ok(ready: bool) -> StatusCode {
    if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}
