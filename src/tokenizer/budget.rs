//! How much one tokenization may take: the token and message budget, cancellation, and the
//! bounds that refuse a text far over its budget before tokenizing all of it.

use serde_json::Value;

use super::{TextTokenizer, TokenizeError};

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

    pub(super) fn check(&self) -> Result<(), TokenizeError> {
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

impl TextTokenizer {
    /// Refuses `text` when it cannot fit `max_tokens` (from its length alone, then by counting
    /// its tokens in pieces, stopping as soon as the count is certainly over).
    pub(super) fn precheck(&self, text: &str, budget: &Budget, what: &str) -> Result<(), TokenizeError> {
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
pub(super) fn text_bound(tok: &tokenizers::Tokenizer) -> Option<usize> {
    let factor = match tok.get_normalizer() {
        None => 1,
        Some(n) => shrink_factor(&serde_json::to_value(n).ok()?)?,
    };
    let longest = tok.get_vocab(true).keys().map(String::len).max()?.max(1);
    Some(longest.saturating_mul(factor))
}
