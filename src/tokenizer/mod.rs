//! Text and chat tokenization, matching Hugging Face transformers: `tok(text)` for plain text and
//! `apply_chat_template(messages, tokenize=True)` for chats, plus a loss mask over assistant turns.

mod budget;
mod chat;
mod gguf;
mod input;
mod text;

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::TokenizerSource;
pub use budget::Budget;
pub use input::Input;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The model cannot do what was asked (no tokenizer, no chat template).
    #[error("{0}")]
    Unsupported(String),
    /// The input is malformed (bad message, template raised an exception).
    #[error("{0}")]
    Invalid(String),
    #[error("cannot load the tokenizer: {0}")]
    Load(String),
    /// The input has (or would have) more tokens, or more messages, than allowed.
    #[error("{0}")]
    TooLarge(String),
    /// The caller went away; the work was stopped.
    #[error("the request was cancelled")]
    Cancelled,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// "system", "user", "assistant", "tool", or another role the model's chat template names.
    pub role: String,
    pub content: String,
    /// An assistant's reasoning (also accepted as `thinking` or `reasoning`). Templates see it
    /// under both `reasoning_content` and `thinking`, as transformers passes it; a template that
    /// writes it (Qwen3 and gpt-oss in the last turn) puts it inside the turn's loss mask.
    #[serde(default, skip_serializing_if = "Option::is_none", alias = "thinking", alias = "reasoning")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), reasoning_content: None }
    }
}

/// Extra variables a chat template is rendered with (transformers' `apply_chat_template` kwargs).
pub type TemplateKwargs = serde_json::Map<String, Value>;

/// Variables the renderer sets itself, which callers may not override.
const RESERVED_TEMPLATE_VARIABLES: [&str; 4] = ["messages", "add_generation_prompt", "bos_token", "eos_token"];

/// Checks extra template variables: none of the names the renderer sets itself.
pub fn check_template_kwargs(kwargs: &TemplateKwargs) -> Result<(), String> {
    match kwargs.keys().find(|k| RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "chat_template_kwargs sets {k:?}, which the server sets itself ({})",
            RESERVED_TEMPLATE_VARIABLES.join(", ")
        )),
        None => Ok(()),
    }
}

/// Roles every chat template is written for; others are accepted only where the template names them.
const STANDARD_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
/// Roles some templates know beside the standard ones.
const EXTRA_ROLES: [&str; 4] = ["developer", "ipython", "function", "tool_response"];

pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens matched as plain text.
    split: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Text of each special token, longest first.
    specials: Vec<String>,
    /// A bound on the bytes of input text one token can cover (None when the normalizer may
    /// delete text, so that no such bound holds).
    bytes_per_token: Option<usize>,
    /// Roles the chat template accepts.
    roles: Vec<String>,
}

/// Token ids with a per-token loss mask (1 = assistant token).
#[derive(Clone, Debug, PartialEq)]
pub struct Tokenized {
    pub ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

/// A special token in tokenizer_config.json: a plain string or `{"content": "…"}`.
fn special(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

fn template_from_config(cfg: &Value) -> Option<String> {
    match cfg.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(String::from),
        _ => None,
    }
}

impl TextTokenizer {
    pub fn from_source(src: &TokenizerSource) -> Result<Option<Self>, TokenizeError> {
        match src {
            TokenizerSource::None => Ok(None),
            TokenizerSource::HfFiles { tokenizer_json, tokenizer_config, chat_template } => {
                Self::from_hf_files(tokenizer_json, tokenizer_config.as_deref(), chat_template.as_deref()).map(Some)
            }
            TokenizerSource::Gguf(data) => {
                let g = gguf::build(data).map_err(TokenizeError::Load)?;
                Ok(Some(Self::new(g.tokenizer, g.chat_template, g.bos_token, g.eos_token)))
            }
        }
    }

    fn from_hf_files(json: &Path, config: Option<&Path>, template: Option<&Path>) -> Result<Self, TokenizeError> {
        let tok = tokenizers::Tokenizer::from_file(json)
            .map_err(|e| TokenizeError::Load(format!("{}: {e}", json.display())))?;
        let cfg: Value = match config {
            Some(p) => {
                let text =
                    std::fs::read_to_string(p).map_err(|e| TokenizeError::Load(format!("{}: {e}", p.display())))?;
                serde_json::from_str(&text).map_err(|e| TokenizeError::Load(format!("{}: {e}", p.display())))?
            }
            None => Value::Null,
        };
        let chat_template = match template {
            Some(p) => {
                Some(std::fs::read_to_string(p).map_err(|e| TokenizeError::Load(format!("{}: {e}", p.display())))?)
            }
            None => template_from_config(&cfg),
        };
        Ok(Self::new(tok, chat_template, special(&cfg, "bos_token"), special(&cfg, "eos_token")))
    }

    pub fn new(
        tok: tokenizers::Tokenizer,
        chat_template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Self {
        let mut split = tok.clone();
        split.set_encode_special_tokens(true);
        let mut specials: Vec<String> =
            tok.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect();
        specials.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        specials.dedup();
        let bytes_per_token = budget::text_bound(&tok);
        let roles = known_roles(chat_template.as_deref());
        TextTokenizer { tok, split, chat_template, bos_token, eos_token, specials, bytes_per_token, roles }
    }

    /// Roles the chat template accepts: the standard ones and any other it names.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }
}

/// The standard roles, and the others that `template` names.
fn known_roles(template: Option<&str>) -> Vec<String> {
    let mut roles: Vec<String> = STANDARD_ROLES.iter().map(|r| r.to_string()).collect();
    if let Some(t) = template {
        let word = |w: &str| {
            t.match_indices(w).any(|(i, _)| {
                let before = t[..i].chars().next_back();
                let after = t[i + w.len()..].chars().next();
                let edge = |c: Option<char>| c.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                edge(before) && edge(after)
            })
        };
        roles.extend(EXTRA_ROLES.iter().filter(|r| word(r)).map(|r| r.to_string()));
    }
    roles
}
