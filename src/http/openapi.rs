//! The OpenAPI document, generated from the code, and a browsable page.

use axum::response::{Html, IntoResponse};
use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "layertap", description = "Hidden states of chosen layers of a decoder LLM, exact to Hugging Face transformers."),
    paths(
        super::hidden_states::hidden_states,
        super::hidden_states::tokenize,
        super::ops::info,
        super::ops::health,
        super::ops::ready,
        super::ops::metrics,
    ),
    components(schemas(crate::error::ErrorBody, crate::answer::HiddenStatesJson)),
    modifiers(&BearerAuth),
    tags((name = "layertap", description = "Hidden states"), (name = "operations", description = "Health, readiness, metrics"))
)]
pub struct ApiDoc;

/// The document as pretty JSON (what `openapi/openapi.json` holds).
pub fn openapi_pretty() -> String {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").into();
    doc.to_pretty_json().unwrap_or_default() + "\n"
}

pub async fn openapi_json() -> impl IntoResponse {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").into();
    Json(doc)
}

/// A self-contained page listing the routes and schemas of the OpenAPI document.
pub async fn docs() -> Html<&'static str> {
    Html(include_str!("docs.html"))
}
