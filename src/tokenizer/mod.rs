//! Text and chat tokenization, matching Hugging Face transformers: `tok(text)` for plain text and
//! `apply_chat_template(messages, tokenize=True)` for chats, plus a loss mask over assistant turns.

mod gguf;
mod input;

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::TokenizerSource;
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
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Roles every chat template is written for; others are accepted only where the template names them.
const STANDARD_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
/// Roles some templates know beside the standard ones.
const EXTRA_ROLES: [&str; 4] = ["developer", "ipython", "function", "tool_response"];

/// How one tokenization may run: its token budget, whether control-token text in the caller's
/// content is tokenized as plain text, and a way to learn that the caller has gone.
#[derive(Clone, Copy)]
pub struct Budget<'a> {
    /// Most tokens the result may have.
    pub max_tokens: usize,
    /// Most messages in one chat.
    pub max_messages: usize,
    /// Tokenize special-token text inside text or message content as plain text (as transformers'
    /// `split_special_tokens=True`), so that content cannot forge control tokens.
    pub split_special_tokens: bool,
    /// True once the caller no longer wants the result.
    pub cancelled: &'a (dyn Fn() -> bool + Sync),
}

impl Budget<'_> {
    /// No limits and no cancellation (the one-shot `extract` path).
    pub fn unlimited() -> Budget<'static> {
        Budget { max_tokens: usize::MAX, max_messages: usize::MAX, split_special_tokens: false, cancelled: &|| false }
    }

    fn check(&self) -> Result<(), TokenizeError> {
        if (self.cancelled)() {
            Err(TokenizeError::Cancelled)
        } else {
            Ok(())
        }
    }
}

/// Text longer than this is first counted in pieces, so that a text far over the token budget is
/// refused after reading about as much of it as the budget allows.
const COUNT_PIECE_BYTES: usize = 16 << 10;

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
        let bytes_per_token = text_bound(&tok);
        let roles = known_roles(chat_template.as_deref());
        TextTokenizer { tok, split, chat_template, bos_token, eos_token, specials, bytes_per_token, roles }
    }

    /// Roles the chat template accepts: the standard ones and any other it names.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    fn encoder(&self, split_special_tokens: bool) -> &tokenizers::Tokenizer {
        if split_special_tokens {
            &self.split
        } else {
            &self.tok
        }
    }

    /// Refuses `text` when it cannot fit `max_tokens` (from its length alone, then by counting
    /// its tokens in pieces, stopping as soon as the count is certainly over).
    fn precheck(&self, text: &str, budget: &Budget, what: &str) -> Result<(), TokenizeError> {
        let max = budget.max_tokens;
        if max == usize::MAX {
            return Ok(());
        }
        let too_long = |at_least: usize| {
            TokenizeError::TooLarge(format!("{what} has at least {at_least} tokens; at most {max} fit here"))
        };
        if let Some(b) = self.bytes_per_token {
            // Every token covers at most `b` bytes, so `text` has at least len / b tokens.
            let at_least = text.len() / b;
            if at_least > max {
                return Err(too_long(at_least));
            }
        }
        if text.len() <= COUNT_PIECE_BYTES {
            return Ok(());
        }
        // Pieces end just before whitespace, where pre-tokenizers split anyway; each cut can change
        // the count by at most one token on either side, hence the margin of two per piece.
        let enc = self.encoder(budget.split_special_tokens);
        let (mut counted, mut pieces, mut rest) = (0usize, 0usize, text);
        while !rest.is_empty() {
            budget.check()?;
            let cut = piece_end(rest, COUNT_PIECE_BYTES);
            let (piece, tail) = rest.split_at(cut);
            counted +=
                enc.encode(piece, false).map_err(|e| TokenizeError::Invalid(format!("tokenizing {what}: {e}")))?.len();
            pieces += 1;
            rest = tail;
            let at_least = counted.saturating_sub(2 * pieces);
            if at_least > max {
                return Err(too_long(at_least));
            }
        }
        Ok(())
    }

    /// [`Self::encode_text`] within `budget`.
    pub fn encode_text_within(&self, text: &str, budget: &Budget) -> Result<Vec<u32>, TokenizeError> {
        self.precheck(text, budget, "the text")?;
        budget.check()?;
        let enc = self
            .encoder(budget.split_special_tokens)
            .encode(text, true)
            .map_err(|e| TokenizeError::Invalid(format!("tokenizing text: {e}")))?;
        let ids = enc.get_ids().to_vec();
        if ids.len() > budget.max_tokens {
            return Err(TokenizeError::TooLarge(format!(
                "the text has {} tokens; at most {} fit here",
                ids.len(),
                budget.max_tokens
            )));
        }
        Ok(ids)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Ids of plain text, special tokens (e.g. BOS) added as the tokenizer is configured to.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_text_within(text, &Budget::unlimited())
    }

    /// Renders the chat template as transformers' `apply_chat_template(..., tokenize=False)`.
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizeError> {
        let template = self.chat_template.as_deref().ok_or_else(no_template)?;
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
        self.encode_chat_within(messages, &Budget::unlimited())
    }

    /// [`Self::encode_chat`] within `budget`. The chat is rendered once for its text; each
    /// assistant turn's bounds come from rendering the messages before it (templates are programs,
    /// and only rendering tells where a turn begins), so the work grows with messages × assistant
    /// turns: `budget.max_messages` bounds it, and the caller's departure stops it.
    pub fn encode_chat_within(&self, messages: &[ChatMessage], budget: &Budget) -> Result<Tokenized, TokenizeError> {
        if messages.is_empty() {
            return Err(TokenizeError::Invalid("\"messages\" must hold at least one message".into()));
        }
        if messages.len() > budget.max_messages {
            return Err(TokenizeError::TooLarge(format!(
                "the chat has {} messages; at most {} are accepted per input",
                messages.len(),
                budget.max_messages
            )));
        }
        if self.chat_template.is_none() {
            return Err(no_template());
        }
        for (i, m) in messages.iter().enumerate() {
            if !self.roles.iter().any(|r| r == &m.role) {
                return Err(TokenizeError::Invalid(format!(
                    "messages[{i}].role is {:?}, which this model's chat template does not know; use one of {}",
                    m.role,
                    self.roles.join(", ")
                )));
            }
        }
        if let Some(b) = self.bytes_per_token {
            let at_least = messages.iter().map(|m| m.content.len()).sum::<usize>() / b;
            if at_least > budget.max_tokens {
                return Err(TokenizeError::TooLarge(format!(
                    "the chat has at least {at_least} tokens; at most {} fit here",
                    budget.max_tokens
                )));
            }
        }
        let protected = if budget.split_special_tokens { Some(self.protect(messages)?) } else { None };
        let (msgs, table): (&[ChatMessage], &[String]) = match &protected {
            Some((m, t)) => (m, t),
            None => (messages, &[]),
        };
        let rendered = self.render_chat(msgs, false)?;
        budget.check()?;
        let real = Unprotected::new(&rendered, table);
        // Counted with control tokens as single tokens, which never overcounts.
        let count = Budget { split_special_tokens: false, ..*budget };
        self.precheck(&real.text, &count, "the chat")?;
        let full = rendered.as_str();
        let mut spans = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            budget.check()?;
            let before = self.render_chat(&msgs[..i], false).unwrap_or_default();
            let header = self.render_chat(&msgs[..i], true).unwrap_or_default();
            let upto = self.render_chat(&msgs[..=i], false)?;
            let start =
                if full.starts_with(&header) && header.len() >= before.len() { header.len() } else { before.len() };
            let end = if full.starts_with(&upto) { upto.len() } else { full.len() };
            if full.starts_with(&before) {
                spans.push((real.map(start), real.map(end.max(start))));
            } else if let Some(pos) = full.find(m.content.as_str()) {
                // Templates that rewrite earlier turns: fall back to the content itself.
                spans.push((real.map(pos), real.map(pos + m.content.len())));
            }
        }
        budget.check()?;
        let mut ids = Vec::new();
        let mut offsets = Vec::new();
        for (range, plain) in real.segments() {
            let enc = self
                .encoder(plain)
                .encode(&real.text[range.clone()], false)
                .map_err(|e| TokenizeError::Invalid(format!("tokenizing chat: {e}")))?;
            ids.extend_from_slice(enc.get_ids());
            offsets.extend(enc.get_offsets().iter().map(|&(s, e)| (s + range.start, e + range.start)));
        }
        if ids.len() > budget.max_tokens {
            return Err(TokenizeError::TooLarge(format!(
                "the chat has {} tokens; at most {} fit here",
                ids.len(),
                budget.max_tokens
            )));
        }
        let loss_mask = offsets
            .iter()
            .map(|&(s, e)| {
                let mid = if e > s { s } else { s.saturating_sub(1) };
                u8::from(spans.iter().any(|&(a, b)| mid >= a && mid < b))
            })
            .collect();
        Ok(Tokenized { ids, loss_mask })
    }

    /// The messages with every special-token text in their content replaced by a placeholder
    /// character, and the table of what each placeholder stands for.
    fn protect(&self, messages: &[ChatMessage]) -> Result<(Vec<ChatMessage>, Vec<String>), TokenizeError> {
        let mut table: Vec<String> = Vec::new();
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            let mut content = String::with_capacity(m.content.len());
            let mut rest = m.content.as_str();
            while let Some(c) = rest.chars().next() {
                let hit = if is_placeholder(c) {
                    Some(c.len_utf8())
                } else {
                    self.specials.iter().find(|t| rest.starts_with(t.as_str())).map(|t| t.len())
                };
                match hit {
                    Some(n) => {
                        let k = table.len() as u32;
                        let p =
                            char::from_u32(PLACEHOLDER_BASE + k).filter(|&p| is_placeholder(p)).ok_or_else(|| {
                                TokenizeError::TooLarge("the chat holds too many special-token texts".into())
                            })?;
                        table.push(rest[..n].to_string());
                        content.push(p);
                        rest = &rest[n..];
                    }
                    None => {
                        content.push(c);
                        rest = &rest[c.len_utf8()..];
                    }
                }
            }
            out.push(ChatMessage { role: m.role.clone(), content });
        }
        Ok((out, table))
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tok.decode(ids, false).map_err(|e| TokenizeError::Invalid(format!("decoding: {e}")))
    }

    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }
}

fn no_template() -> TokenizeError {
    TokenizeError::Unsupported("this model has no chat template; send \"text\" or \"input_ids\" instead".into())
}

/// Placeholders for protected content: Supplementary Private Use Area-A.
const PLACEHOLDER_BASE: u32 = 0xF0000;
const PLACEHOLDER_LAST: u32 = 0xFFFFD;

fn is_placeholder(c: char) -> bool {
    (PLACEHOLDER_BASE..=PLACEHOLDER_LAST).contains(&(c as u32))
}

/// A rendered chat with its placeholders put back: the real text, which parts of it came from
/// placeholders (tokenized as plain text), and how positions move.
struct Unprotected {
    text: String,
    /// (position in the rendered text, position in the real text) after each placeholder.
    moves: Vec<(usize, usize)>,
    /// Ranges of the real text that stood behind placeholders.
    plain: Vec<std::ops::Range<usize>>,
}

impl Unprotected {
    fn new(rendered: &str, table: &[String]) -> Self {
        if table.is_empty() {
            return Unprotected { text: rendered.to_string(), moves: Vec::new(), plain: Vec::new() };
        }
        let mut text = String::with_capacity(rendered.len());
        let (mut moves, mut plain) = (Vec::new(), Vec::<std::ops::Range<usize>>::new());
        for (pos, c) in rendered.char_indices() {
            let k = (c as u32).wrapping_sub(PLACEHOLDER_BASE) as usize;
            match table.get(k).filter(|_| is_placeholder(c)) {
                Some(orig) => {
                    let start = text.len();
                    text.push_str(orig);
                    match plain.last_mut() {
                        Some(r) if r.end == start => r.end = text.len(),
                        _ => plain.push(start..text.len()),
                    }
                    moves.push((pos + c.len_utf8(), text.len()));
                }
                None => text.push(c),
            }
        }
        Unprotected { text, moves, plain }
    }

    /// The real-text position of a position in the rendered text.
    fn map(&self, pos: usize) -> usize {
        let i = self.moves.partition_point(|&(p, _)| p <= pos);
        match i {
            0 => pos,
            _ => {
                let (p, r) = self.moves[i - 1];
                r + (pos - p)
            }
        }
    }

    /// The real text cut into ranges, each with whether it is tokenized as plain text.
    fn segments(&self) -> Vec<(std::ops::Range<usize>, bool)> {
        let mut out = Vec::new();
        let mut at = 0;
        for r in &self.plain {
            if r.start > at {
                out.push((at..r.start, false));
            }
            out.push((r.clone(), true));
            at = r.end;
        }
        if at < self.text.len() || out.is_empty() {
            out.push((at..self.text.len(), false));
        }
        out
    }
}

/// The byte index at most `max` into `s` (on a char boundary) just before a whitespace, or the
/// whole of `s` when it is short; never 0 for a non-empty `s`.
fn piece_end(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    let head = &s[..cut];
    // Back to the start of the last whitespace run, so the run stays with the next piece.
    match head
        .char_indices()
        .rev()
        .find(|&(i, c)| c.is_whitespace() && head[..i].chars().next_back().is_some_and(|p| !p.is_whitespace()))
    {
        Some((i, _)) if i > 0 => i,
        _ => cut.max(s.chars().next().map_or(1, char::len_utf8)),
    }
}

/// How many times longer than its normalized form a text can be, for the normalizers that never
/// delete text (composition and case mapping shrink a few characters at most threefold); None for
/// those that may delete any amount (stripping, accent removal, control-character removal).
fn shrink_factor(n: &Value) -> Option<usize> {
    match n.get("type").and_then(Value::as_str)? {
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(3),
        "Prepend" | "ByteLevel" => Some(1),
        "Replace" => {
            let pattern = n.get("pattern")?.get("String")?.as_str()?;
            let content = n.get("content")?.as_str()?;
            (content.len() >= pattern.len() && !pattern.is_empty()).then_some(1)
        }
        "Sequence" => n
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |acc, m| shrink_factor(m).map(|f| acc.saturating_mul(f))),
        _ => None,
    }
}

/// Most bytes of input text one token can stand for: the longest vocabulary entry (its text is
/// never shorter than the bytes it covers) times what the normalizer may shrink.
fn text_bound(tok: &tokenizers::Tokenizer) -> Option<usize> {
    let factor = match tok.get_normalizer() {
        None => 1,
        Some(n) => shrink_factor(&serde_json::to_value(n).ok()?)?,
    };
    let longest = tok.get_vocab(true).keys().map(String::len).max()?.max(1);
    Some(longest.saturating_mul(factor))
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
