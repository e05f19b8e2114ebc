//! The HTTP layer: parse and validate, admit or refuse, encode the answer.

pub mod conn;
pub mod encode;
pub mod hidden_states;
mod json;
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
use tower_http::classify::ServerErrorsFailureClass;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub use json::ApiJson;

use crate::batching::Scheduler;
use crate::cli::{ServeArgs, TokenLimits};
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
    /// Most tokens in one request, over all its inputs.
    pub max_request_tokens: usize,
    /// Most inputs in one request.
    pub max_inputs: usize,
    /// Most messages in one chat input.
    pub max_messages: usize,
    /// Largest answer (the hidden states' bytes before compression) in any encoding.
    pub max_answer_bytes: usize,
    /// Largest `logprobs.top_k` a request may ask.
    pub max_top_k: usize,
    /// A request's head (request line and headers) must arrive within this, counted from the
    /// connection's accept or, on a keep-alive connection, from the first byte of the request.
    pub header_read_timeout: Duration,
    /// A request's whole body must arrive within this, counted from its head; else 408.
    pub body_read_timeout: Duration,
    /// A keep-alive connection with no request in flight is closed after this long; also the
    /// longest a response write may stay blocked on a client that does not read.
    pub idle_timeout: Duration,
    /// Most open client connections; past it new ones get a 503 and are closed at once.
    pub max_connections: usize,
}

impl Limits {
    /// The limits `layertap serve` enforces with these flags, with the token limits `tokens` (see
    /// [`ServeArgs::token_limits`]) and `max_batch_tokens` in force.
    pub fn from_args(args: &ServeArgs, tokens: TokenLimits, max_batch_tokens: usize) -> Self {
        Limits {
            max_batch_tokens,
            max_input_tokens: tokens.input,
            max_queue_tokens: tokens.queue,
            max_body_bytes: args.max_body_bytes,
            max_json_values: args.max_json_values,
            zstd_level: args.zstd_level,
            request_timeout: Duration::from_secs(args.request_timeout_s),
            max_request_tokens: tokens.request,
            max_inputs: args.max_inputs,
            max_messages: args.max_messages,
            max_answer_bytes: args.max_answer_bytes,
            max_top_k: args.max_top_k,
            header_read_timeout: Duration::from_secs(args.header_read_timeout_s),
            body_read_timeout: Duration::from_secs(args.body_read_timeout_s),
            idle_timeout: Duration::from_secs(args.idle_timeout_s),
            max_connections: args.max_connections,
        }
    }
}

impl Default for Limits {
    /// The defaults of `layertap serve` on the CPU (its flags' defaults, [`crate::cli::default`]).
    fn default() -> Self {
        use crate::cli::default as d;
        let tokens = TokenLimits::resolve([None; 3], 0, false).expect("the default token limits are consistent");
        Limits {
            max_batch_tokens: d::CPU_MAX_BATCH_TOKENS,
            max_input_tokens: tokens.input,
            max_queue_tokens: tokens.queue,
            max_body_bytes: d::MAX_BODY_BYTES,
            max_json_values: d::MAX_JSON_VALUES,
            zstd_level: d::ZSTD_LEVEL,
            request_timeout: Duration::from_secs(d::REQUEST_TIMEOUT_S),
            max_request_tokens: tokens.request,
            max_inputs: d::MAX_INPUTS,
            max_messages: d::MAX_MESSAGES,
            max_answer_bytes: d::MAX_ANSWER_BYTES,
            max_top_k: d::MAX_TOP_K,
            header_read_timeout: Duration::from_secs(d::HEADER_READ_TIMEOUT_S),
            body_read_timeout: Duration::from_secs(d::BODY_READ_TIMEOUT_S),
            idle_timeout: Duration::from_secs(d::IDLE_TIMEOUT_S),
            max_connections: d::MAX_CONNECTIONS,
        }
    }
}

/// A loaded replica's device name and its stages, in order.
pub type ReplicaStages = (String, Vec<crate::engine::StageLayout>);

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
    /// The stages of each loaded replica, by its device name.
    pub stages: Arc<std::sync::Mutex<Vec<ReplicaStages>>>,
    /// Shutdown has begun.
    pub draining: Arc<AtomicBool>,
    /// The drain deadline has passed (or a second signal came): handlers stop waiting for the
    /// queue and answer 503 with Retry-After.
    pub abandon: tokio_util::sync::CancellationToken,
    /// The start-up self-check: its mode, each device's report, and whether it refused readiness.
    pub selfcheck: Arc<SelfCheckState>,
}

/// What the start-up self-check found, shared with the handlers.
#[derive(Debug, Default)]
pub struct SelfCheckState {
    pub mode: crate::cli::SelfCheckMode,
    /// One per device, as each finishes loading.
    pub reports: std::sync::Mutex<Vec<crate::engine::selfcheck::Report>>,
    /// The check failed under `enforce`: the server stays unready.
    pub refused: AtomicBool,
    /// What it found, once it failed: what the serving routes answer under `enforce`.
    pub failed: std::sync::Mutex<Option<String>>,
}

impl SelfCheckState {
    pub fn new(mode: crate::cli::SelfCheckMode) -> Self {
        SelfCheckState { mode, ..Default::default() }
    }

    /// What the self-check found, if it failed (under `warn` too).
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|f| f.clone())
    }
}

impl AppState {
    /// The largest `top_k` a request may ask: `--max-top-k`, at most the vocabulary (a model
    /// with fewer entries has no more to rank).
    pub fn max_top_k(&self) -> usize {
        self.limits.max_top_k.min(self.info.vocab_size)
    }

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
                .layer(
                    TraceLayer::new_for_http()
                        .make_span_with(|req: &Request| {
                            let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_owned());
                            let id = req.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
                            // Debug formatting quotes and escapes what the client sent, so a request id
                            // cannot forge log fields or lines.
                            tracing::info_span!("request", method = %req.method(), path = ?req.uri().path(), route, request_id = ?id)
                        })
                        // Status codes are logged where they arise, once and at their level (our faults at
                        // ERROR in ApiError; loading, draining and overload are expected states).
                        .on_failure(|class: ServerErrorsFailureClass, _latency: Duration, _span: &tracing::Span| {
                            if let ServerErrorsFailureClass::Error(e) = class {
                                tracing::warn!(error = %e, "the response failed while streaming");
                            }
                        }),
                )
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
    // Counted when dropped unanswered: the client hung up (or the connection was closed) first.
    struct Unanswered<'a> {
        s: &'a AppState,
        route: &'a str,
        start: Instant,
        answered: bool,
    }
    impl Drop for Unanswered<'_> {
        fn drop(&mut self) {
            if !self.answered {
                self.s
                    .metrics
                    .request_duration
                    .with_label_values(&[self.route])
                    .observe(self.start.elapsed().as_secs_f64());
                self.s.metrics.requests.with_label_values(&[self.route, CLIENT_CLOSED]).inc();
            }
        }
    }
    let mut pending = Unanswered { s: &s, route: &route, start: Instant::now(), answered: false };
    let resp = next.run(req).await;
    pending.answered = true;
    s.metrics.request_duration.with_label_values(&[&route]).observe(pending.start.elapsed().as_secs_f64());
    s.metrics.requests.with_label_values(&[&route, resp.status().as_str()]).inc();
    resp
}

/// The `status` label of requests whose client went away before the answer (as nginx's 499).
pub const CLIENT_CLOSED: &str = "499";

/// Bearer-token check (constant-time) when API keys are configured.
async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if s.api_keys.is_empty() {
        return next.run(req).await;
    }
    // The scheme is case-insensitive (RFC 9110 section 11.1); the token is compared as sent.
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
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

/// 503 while loading or draining (with Retry-After while loading), and 503 `selfcheck_failed`
/// (no Retry-After: waiting does not help) with the self-check's finding once it refused
/// readiness.
pub(crate) fn require_ready(s: &AppState) -> Result<(), ApiError> {
    if s.draining.load(Ordering::SeqCst) {
        Err(ApiError::new(ErrorKind::Unavailable, "the server is shutting down; retry on another replica"))
    } else if s.selfcheck.refused.load(Ordering::SeqCst) {
        let why = s.selfcheck.failure().unwrap_or_else(|| "the start-up self-check failed".into());
        Err(ApiError::new(
            ErrorKind::SelfCheckFailed,
            format!("this server will not serve: {why}. Retrying does not help; see /ready and the server's log"),
        ))
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
