//! The one place where errors become HTTP status codes. Every error body is
//! `{"error": "<what to fix>", "type": "<kind>"}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::answer::assemble::AssembleError;
use crate::batching::{BatchError, SubmitError};
use crate::engine::EngineError;
use crate::tokenizer::TokenizeError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: the body is not valid JSON.
    BadRequest,
    /// 401: missing or wrong API key.
    Unauthorized,
    /// 404: no such route.
    NotFound,
    /// 405: wrong HTTP method.
    MethodNotAllowed,
    /// 406: the Accept header allows no format this route answers in.
    NotAcceptable,
    /// 408: the request body did not arrive in time.
    RequestTimeout,
    /// 413: body, input or answer too large.
    TooLarge,
    /// 415: the body is not `application/json`.
    UnsupportedMediaType,
    /// 422: valid JSON with invalid values.
    Invalid,
    /// 429: the queue is full.
    Overloaded,
    /// 503: not ready, draining, or timed out.
    Unavailable,
    /// 503 without Retry-After: the start-up self-check refused readiness, for good.
    SelfCheckFailed,
    /// 500: our fault.
    Internal,
}

impl ErrorKind {
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::NotAcceptable => StatusCode::NOT_ACCEPTABLE,
            ErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::Invalid => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorKind::Overloaded => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Unavailable | ErrorKind::SelfCheckFailed => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::NotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::NotAcceptable => "not_acceptable",
            ErrorKind::RequestTimeout => "request_timeout",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::UnsupportedMediaType => "unsupported_media_type",
            ErrorKind::Invalid => "invalid_request",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::SelfCheckFailed => "selfcheck_failed",
            ErrorKind::Internal => "internal",
        }
    }
}

#[derive(Debug)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    pub retry_after_s: Option<u64>,
}

/// The JSON body of every error.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong and how to fix it.
    pub error: String,
    /// bad_request, unauthorized, not_found, method_not_allowed, not_acceptable, request_timeout, too_large,
    /// unsupported_media_type, invalid_request, overloaded, unavailable, selfcheck_failed or internal.
    #[serde(rename = "type")]
    pub kind: String,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError { kind, message: message.into(), retry_after_s: None }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.kind == ErrorKind::Internal {
            tracing::error!(error = %self.message, "internal error");
        }
        let status = self.kind.status();
        let body = ErrorBody { error: self.message, kind: self.kind.name().into() };
        let mut resp = (status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

impl From<TokenizeError> for ApiError {
    fn from(e: TokenizeError) -> Self {
        match e {
            TokenizeError::Unsupported(m) | TokenizeError::Invalid(m) => ApiError::invalid(m),
            TokenizeError::Load(m) => ApiError::internal(m),
            TokenizeError::TooLarge(m) => ApiError::new(ErrorKind::TooLarge, m),
            TokenizeError::Cancelled => ApiError::new(ErrorKind::Unavailable, "the request was cancelled"),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidInput(m) => ApiError::invalid(m),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl From<AssembleError> for ApiError {
    fn from(e: AssembleError) -> Self {
        match e {
            AssembleError::Rows(e) => e.into(),
            e @ AssembleError::Encode(_) => ApiError::internal(e.to_string()),
        }
    }
}

impl From<BatchError> for ApiError {
    fn from(e: BatchError) -> Self {
        match e {
            BatchError::Invalid(m) => ApiError::invalid(m),
            BatchError::Internal(m) => ApiError::internal(m),
            BatchError::TooLarge(m) => ApiError::new(ErrorKind::TooLarge, m),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Overloaded { .. } => {
                ApiError { kind: ErrorKind::Overloaded, message: e.to_string(), retry_after_s: Some(1) }
            }
            SubmitError::Closed => ApiError::new(ErrorKind::Unavailable, e.to_string()),
        }
    }
}
