//! Text and chat tokenization, matching Hugging Face transformers: `tok(text)` for plain text and
//! `apply_chat_template(messages, tokenize=True)` for chats, plus a loss mask over assistant turns.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::TokenizerSource;

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
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ChatMessage {
    /// "system", "user", "assistant" (or any role the template knows).
    pub role: String,
    pub content: String,
}

pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
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
                let g = crate::gguf_tokenizer::build(data).map_err(TokenizeError::Load)?;
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
        Ok(TextTokenizer {
            tok,
            chat_template,
            bos_token: special(&cfg, "bos_token"),
            eos_token: special(&cfg, "eos_token"),
        })
    }

    pub fn new(
        tok: tokenizers::Tokenizer,
        chat_template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Self {
        TextTokenizer { tok, chat_template, bos_token, eos_token }
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Ids of plain text, special tokens (e.g. BOS) added as the tokenizer is configured to.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let enc = self.tok.encode(text, true).map_err(|e| TokenizeError::Invalid(format!("tokenizing text: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Renders the chat template as transformers' `apply_chat_template(..., tokenize=False)`.
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizeError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            TokenizeError::Unsupported("this model has no chat template; send \"text\" or \"input_ids\" instead".into())
        })?;
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            // Templates use it for "today's date"; a fixed, well-formed value keeps outputs reproducible.
            fmt.replace("%d", "01")
                .replace("%B", "January")
                .replace("%b", "Jan")
                .replace("%Y", "2025")
                .replace("%m", "01")
        });
        env.add_template("chat", template)
            .map_err(|e| TokenizeError::Unsupported(format!("the model's chat template does not parse: {e}")))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        let tmpl = env.get_template("chat").map_err(|e| TokenizeError::Invalid(e.to_string()))?;
        tmpl.render(ctx).map_err(|e| TokenizeError::Invalid(format!("chat template: {e}")))
    }

    /// Ids of a rendered chat (as `apply_chat_template(tokenize=True)`) and a loss mask that is 1
    /// on every assistant turn: its content and the end-of-turn text the template puts after it,
    /// not the role header (the generation prompt) before it.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Tokenized, TokenizeError> {
        if messages.is_empty() {
            return Err(TokenizeError::Invalid("\"messages\" must hold at least one message".into()));
        }
        let full = self.render_chat(messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let before = self.render_chat(&messages[..i], false).unwrap_or_default();
            let header = self.render_chat(&messages[..i], true).unwrap_or_default();
            let upto = self.render_chat(&messages[..=i], false)?;
            let start =
                if full.starts_with(&header) && header.len() >= before.len() { header.len() } else { before.len() };
            let end = if full.starts_with(&upto) { upto.len() } else { full.len() };
            if full.starts_with(&before) {
                spans.push((start, end.max(start)));
            } else if let Some(pos) = full.find(m.content.as_str()) {
                // Templates that rewrite earlier turns: fall back to the content itself.
                spans.push((pos, pos + m.content.len()));
            }
        }
        let enc = self
            .tok
            .encode(full.as_str(), false)
            .map_err(|e| TokenizeError::Invalid(format!("tokenizing chat: {e}")))?;
        let loss_mask = enc
            .get_offsets()
            .iter()
            .map(|&(s, e)| {
                let mid = if e > s { s } else { s.saturating_sub(1) };
                u8::from(spans.iter().any(|&(a, b)| mid >= a && mid < b))
            })
            .collect();
        Ok(Tokenized { ids: enc.get_ids().to_vec(), loss_mask })
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tok.decode(ids, false).map_err(|e| TokenizeError::Invalid(format!("decoding: {e}")))
    }

    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }
}
