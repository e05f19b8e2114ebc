//! Chats: the template rendered as transformers' `apply_chat_template`, tokenized with a loss mask
//! over the assistant turns, and content kept from forging control tokens when asked.

use serde_json::Value;

use super::{Budget, ChatMessage, TemplateKwargs, TextTokenizer, TokenizeError, Tokenized};

impl TextTokenizer {
    /// Renders the chat template as transformers' `apply_chat_template(..., tokenize=False)`.
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizeError> {
        self.render_chat_with(messages, &TemplateKwargs::new(), add_generation_prompt)
    }

    /// [`Self::render_chat`] with extra template variables, as `apply_chat_template(..., **kwargs)`.
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        kwargs: &TemplateKwargs,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        super::check_template_kwargs(kwargs).map_err(TokenizeError::Invalid)?;
        self.renderer()?.render(
            &message_values(messages),
            &minijinja::Value::from_serialize(kwargs),
            add_generation_prompt,
        )
    }

    /// The chat template parsed, to render a chat as many times as its loss mask needs.
    fn renderer(&self) -> Result<Renderer<'_>, TokenizeError> {
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
        Ok(Renderer { env, bos: self.bos_token.as_deref().unwrap_or(""), eos: self.eos_token.as_deref().unwrap_or("") })
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
        self.encode_chat_with(messages, &TemplateKwargs::new(), budget)
    }

    /// [`Self::encode_chat_within`] with extra template variables (`kwargs`), as
    /// `apply_chat_template(..., **kwargs)`. Their strings are caller's content as much as the
    /// messages are: `split_special_tokens` keeps them from forging control tokens too.
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        kwargs: &TemplateKwargs,
        budget: &Budget,
    ) -> Result<Tokenized, TokenizeError> {
        super::check_template_kwargs(kwargs).map_err(TokenizeError::Invalid)?;
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
            let at_least = messages
                .iter()
                .map(|m| m.content.len() + m.reasoning_content.as_ref().map_or(0, String::len))
                .sum::<usize>()
                / b;
            if at_least > budget.max_tokens {
                return Err(TokenizeError::TooLarge(format!(
                    "the chat has at least {at_least} tokens; at most {} fit here",
                    budget.max_tokens
                )));
            }
        }
        let protected = if budget.split_special_tokens { Some(self.protect(messages, kwargs)?) } else { None };
        let (msgs, kwargs, table): (&[ChatMessage], &TemplateKwargs, &[String]) = match &protected {
            Some((m, k, t)) => (m, k, t),
            None => (messages, kwargs, &[]),
        };
        let renderer = self.renderer()?;
        // The chat as the template's values, once: each render below takes them, or a copy with one
        // message changed (the values are shared, not copied).
        let (values, kwargs) = (message_values(msgs), minijinja::Value::from_serialize(kwargs));
        let rendered = renderer.render(&values, &kwargs, false)?;
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
            let header = renderer.render(&values[..i], &kwargs, true).unwrap_or_default();
            let floor = spans.last().map_or(0, |&(_, b)| b);
            // Where the content is: the chat rendered with a marker in its place shows it, where
            // the template writes the text before it alike (it does unless it reads the content).
            let marked = |j: usize| {
                let mut probe = values.clone();
                probe[j] = message_value(&msgs[j].role, CONTENT_MARKER, msgs[j].reasoning_content.as_deref());
                renderer.marker_at(&probe, &kwargs, full)
            };
            let at = marked(i).filter(|&p| p >= floor && full[p..].starts_with(&m.content));
            // Else it is looked for, after the turn's reasoning where the template writes it (the
            // chat rendered without the reasoning tells where that ends) and before the next
            // message's content.
            let (mut after, mut limit) = (0, full.len());
            if at.is_none() {
                if m.reasoning_content.is_some() {
                    let mut plain = values.clone();
                    plain[i] = message_value(&m.role, &m.content, None);
                    let other = renderer.render(&plain, &kwargs, false)?;
                    if other != full {
                        after = full.len() - common_suffix(full, &other);
                    }
                }
                if i + 1 < msgs.len() {
                    limit = marked(i + 1).unwrap_or(full.len());
                }
            }
            let found = Found { at, after, limit };
            let (start, end) = self.turn_span(full, &header, &m.content, floor, found).ok_or_else(|| {
                TokenizeError::Unsupported(format!(
                    "the loss mask cannot be placed: messages[{i}] (assistant) does not appear in the rendered chat \
                     as written (this model's chat template rewrites it); send \"text\" or \"input_ids\" instead"
                ))
            })?;
            spans.push((start, end));
        }
        let spans: Vec<(usize, usize)> = spans.into_iter().map(|(a, b)| (real.map(a), real.map(b))).collect();
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
        // A token is masked when it overlaps a turn (as transformers' assistant mask marks the
        // tokens from the one holding a span's first character to the one holding its last).
        let loss_mask = offsets
            .iter()
            .map(|&(s, e)| {
                let (s, e) = if e > s { (s, e) } else { (s.saturating_sub(1), s) };
                u8::from(spans.iter().any(|&(a, b)| s < b && e > a))
            })
            .collect();
        Ok(Tokenized { ids, loss_mask })
    }

    /// Where an assistant turn lies in the rendered chat `full`: from where the generation prompt
    /// ends (`header` is the chat before the turn rendered with it; where a template writes the
    /// turn otherwise than its prompt, from where the two part) to the end of the content, and on
    /// through the control token that closes the turn when one follows (after whitespace at most)
    /// with the whitespace after it. The end comes from `full` itself, not from rendering the chat
    /// up to this turn: templates write the last turn otherwise (gpt-oss ends it with `<|return|>`,
    /// the others with `<|end|>`; Qwen3 keeps the empty thinking block only there).
    ///
    /// The content is where a marker rendered in its place showed it (`found.at`). Otherwise it
    /// is looked for between `found.after` (the end of the turn's reasoning, where the template
    /// writes it) and `found.limit` (the next message's content), as written, trimmed, or as the
    /// answer after a reasoning block the content holds (`…</think>answer`, which Qwen3's and
    /// DeepSeek's templates split off): of its first [`MAX_PLACES`] places, the first that a
    /// control token closes (text such as "a" also occurs inside "<|channel|>"), or the first where
    /// none is closed. None when it is not there, or only past those places.
    fn turn_span(&self, full: &str, header: &str, content: &str, floor: usize, found: Found) -> Option<(usize, usize)> {
        let start = common_prefix(full, header).max(floor);
        let (start, content, places) = match found.at {
            // A prompt that parts from the turn inside its content ("<|channel>" against
            // "<think>": both begin with "<") does not move the turn's start past the content.
            Some(p) => (start.min(p), content, vec![p]),
            None => {
                let from = found.after.max(start);
                let region = full.get(from..found.limit.max(from))?;
                let (content, from) = if region.contains(content) {
                    (content, from)
                } else if region.contains(content.trim()) {
                    (content.trim(), from)
                } else {
                    // The answer after the reasoning block, after the one the template wrote in
                    // this turn (where it wrote one).
                    let (_, answer) = content.rsplit_once(THINK_END)?;
                    let after = region.find(THINK_END).map_or(from, |p| from + p + THINK_END.len());
                    (answer.trim(), after)
                };
                let region = full.get(from..found.limit.max(from))?;
                let places: Vec<usize> = if content.is_empty() {
                    vec![from]
                } else {
                    region.match_indices(content).take(MAX_PLACES + 1).map(|(p, _)| from + p).collect()
                };
                if places.is_empty() {
                    return None;
                }
                (start, content, places)
            }
        };
        let closed = |body_end: usize| {
            let rest = &full[body_end..];
            let gap = if content.is_empty() { rest.len() } else { rest.len() - rest.trim_start().len() };
            (0..=gap)
                .filter(|&k| rest.is_char_boundary(k))
                .find_map(|k| self.specials.iter().find(|t| rest[k..].starts_with(t.as_str())).map(|t| k + t.len()))
        };
        let (body_end, closing) =
            match places.iter().take(MAX_PLACES).find_map(|&p| closed(p + content.len()).map(|k| (p, k))) {
                Some((p, k)) => (p + content.len(), Some(k)),
                // A content found in too many places to tell is not placed at a guess.
                None if places.len() > MAX_PLACES => return None,
                None => (places.first()? + content.len(), None),
            };
        let end = match closing {
            Some(k) => {
                let after = &full[body_end + k..];
                body_end + k + (after.len() - after.trim_start().len())
            }
            None => body_end,
        };
        Some((start, end))
    }

    /// The messages with every special-token text in their content replaced by a placeholder
    /// character, and the table of what each placeholder stands for.
    fn protect(&self, messages: &[ChatMessage], kwargs: &TemplateKwargs) -> Result<Protected, TokenizeError> {
        let mut table: Vec<String> = Vec::new();
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            let content = self.protect_text(&m.content, &mut table)?;
            let reasoning_content =
                m.reasoning_content.as_deref().map(|r| self.protect_text(r, &mut table)).transpose()?;
            out.push(ChatMessage { role: m.role.clone(), content, reasoning_content });
        }
        let mut kw = TemplateKwargs::new();
        for (k, v) in kwargs {
            kw.insert(k.clone(), self.protect_value(v, &mut table)?);
        }
        Ok((out, kw, table))
    }

    /// A JSON value with every string in it protected as [`Self::protect_text`] does.
    fn protect_value(&self, v: &Value, table: &mut Vec<String>) -> Result<Value, TokenizeError> {
        Ok(match v {
            Value::String(s) => Value::String(self.protect_text(s, table)?),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.protect_value(x, table)).collect::<Result<_, _>>()?),
            Value::Object(o) => Value::Object(
                o.iter().map(|(k, x)| Ok((k.clone(), self.protect_value(x, table)?))).collect::<Result<_, _>>()?,
            ),
            other => other.clone(),
        })
    }

    /// `text` with every special-token text (and placeholder character) replaced by the next
    /// placeholder, recorded in `table`.
    fn protect_text(&self, text: &str, table: &mut Vec<String>) -> Result<String, TokenizeError> {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            let hit = if is_placeholder(c) {
                Some(c.len_utf8())
            } else {
                self.specials.iter().find(|t| rest.starts_with(t.as_str())).map(|t| t.len())
            };
            match hit {
                Some(n) => {
                    let k = table.len() as u32;
                    let p = char::from_u32(PLACEHOLDER_BASE + k)
                        .filter(|&p| is_placeholder(p))
                        .ok_or_else(|| TokenizeError::TooLarge("the chat holds too many special-token texts".into()))?;
                    table.push(rest[..n].to_string());
                    out.push(p);
                    rest = &rest[n..];
                }
                None => {
                    out.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
        }
        Ok(out)
    }
}

/// A chat template parsed once, with the special tokens it is given.
struct Renderer<'a> {
    env: minijinja::Environment<'a>,
    bos: &'a str,
    eos: &'a str,
}

impl Renderer<'_> {
    /// The chat of `messages` (as [`message_values`] gives them) with the variables `kwargs`.
    fn render(
        &self,
        messages: &[minijinja::Value],
        kwargs: &minijinja::Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
            ..kwargs.clone()
        };
        let tmpl = self.env.get_template("chat").map_err(|e| TokenizeError::Invalid(e.to_string()))?;
        tmpl.render(ctx).map_err(|e| TokenizeError::Invalid(format!("chat template: {e}")))
    }

    /// Where the marker begins in `full`: `probe` (the chat with [`CONTENT_MARKER`] as one
    /// message's content) renders it once, and the text before it is `full`'s.
    fn marker_at(&self, probe: &[minijinja::Value], kwargs: &minijinja::Value, full: &str) -> Option<usize> {
        let text = self.render(probe, kwargs, false).ok()?;
        let mut places = text.match_indices(CONTENT_MARKER).map(|(p, _)| p);
        match (places.next(), places.next()) {
            (Some(p), None) if full.get(..p) == text.get(..p) => Some(p),
            _ => None,
        }
    }
}

/// The messages as the template sees them, as transformers passes them: a message's reasoning
/// under both names templates read.
fn message_values(messages: &[ChatMessage]) -> Vec<minijinja::Value> {
    messages.iter().map(|m| message_value(&m.role, &m.content, m.reasoning_content.as_deref())).collect()
}

fn message_value(role: &str, content: &str, reasoning: Option<&str>) -> minijinja::Value {
    let mut fields = vec![("role", role), ("content", content)];
    if let Some(r) = reasoning {
        fields.extend([("thinking", r), ("reasoning_content", r)]);
    }
    minijinja::Value::from_iter(fields.into_iter().map(|(k, v)| (k, minijinja::Value::from(v))))
}

/// The length of the longest common suffix of `a` and `b`, on a character boundary.
fn common_suffix(a: &str, b: &str) -> usize {
    a.char_indices()
        .rev()
        .zip(b.chars().rev())
        .find(|&((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, x), _)| a.len() - i - x.len_utf8())
}

/// The length of the longest common prefix of `a` and `b`, on a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).find(|&((_, x), y)| x != y).map_or(a.len().min(b.len()), |((i, _), _)| i)
}

fn no_template() -> TokenizeError {
    TokenizeError::Unsupported("this model has no chat template; send \"text\" or \"input_ids\" instead".into())
}

/// What stands in for an assistant's content to find where the template writes it (characters of
/// the Private Use Area, which no tokenizer's control token holds).
const CONTENT_MARKER: &str = "\u{E000}\u{E7FF}\u{F8FF}";

/// What is known of where an assistant's content lies in the rendered chat.
struct Found {
    /// Where a marker in its place showed it.
    at: Option<usize>,
    /// Where the turn's reasoning ends, where the template writes it (else 0).
    after: usize,
    /// Where the next message's content begins (else the chat's end).
    limit: usize,
}

/// The end of a reasoning block written into an answer's content.
const THINK_END: &str = "</think>";

/// The places of an assistant's content looked through when the marker cannot show it.
const MAX_PLACES: usize = 64;

/// Protected messages and template variables, and the table of what each placeholder stands for.
type Protected = (Vec<ChatMessage>, TemplateKwargs, Vec<String>);

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
