//! A JSON body extractor whose rejections are our JSON errors with the right status.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ErrorKind};

pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if let Some(enc) = req.headers().get(axum::http::header::CONTENT_ENCODING) {
            let enc = String::from_utf8_lossy(enc.as_bytes()).trim().to_ascii_lowercase();
            if enc != "identity" {
                return Err(ApiError::new(
                    ErrorKind::UnsupportedMediaType,
                    format!("request bodies are read uncompressed; Content-Encoding {enc:?} is not supported: send plain JSON"),
                ));
            }
        }
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(rej) => Err(match rej {
                JsonRejection::MissingJsonContentType(_) => ApiError::new(
                    ErrorKind::UnsupportedMediaType,
                    "the body must be JSON: send Content-Type: application/json",
                ),
                JsonRejection::JsonSyntaxError(e) => {
                    ApiError::new(ErrorKind::BadRequest, format!("the body is not valid JSON: {}", e.body_text()))
                }
                JsonRejection::JsonDataError(e) => ApiError::invalid(e.body_text()),
                JsonRejection::BytesRejection(e) if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                    ApiError::new(ErrorKind::TooLarge, "the request body is larger than --max-body-bytes allows")
                }
                other => ApiError::new(ErrorKind::BadRequest, other.body_text()),
            }),
        }
    }
}
