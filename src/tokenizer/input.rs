//! One input as a caller gives it (token ids, text or a chat) and its tokenization within a
//! budget, the same for the service, `layertap extract` and the tests.

use super::{Budget, ChatMessage, TemplateKwargs, TextTokenizer, TokenizeError, Tokenized};

/// One input sequence, as the caller gave it.
#[derive(Clone, Debug)]
pub enum Input {
    Ids(Vec<u32>),
    Text(String),
    /// A chat and the extra variables its template is rendered with.
    Messages(Vec<ChatMessage>, TemplateKwargs),
}

fn no_tokenizer() -> TokenizeError {
    TokenizeError::Unsupported("this model has no tokenizer; send \"input_ids\" instead of text or messages".into())
}

impl Input {
    /// Tokenizes the input with no limit; the loss mask is all ones except for chats.
    pub fn tokenize(&self, tok: Option<&TextTokenizer>) -> Result<Tokenized, TokenizeError> {
        self.tokenize_within(tok, &Budget::unlimited())
    }

    /// [`Input::tokenize`] within `budget` (token and message limits, cancellation). An input
    /// that produces no tokens is refused.
    pub fn tokenize_within(&self, tok: Option<&TextTokenizer>, budget: &Budget) -> Result<Tokenized, TokenizeError> {
        let ones = |ids: Vec<u32>| Tokenized { loss_mask: vec![1; ids.len()], ids };
        let t = match self {
            Input::Ids(ids) if ids.len() > budget.max_tokens => {
                return Err(TokenizeError::TooLarge(format!(
                    "{} tokens; at most {} fit here",
                    ids.len(),
                    budget.max_tokens
                )))
            }
            Input::Ids(ids) => ones(ids.clone()),
            Input::Text(text) => ones(tok.ok_or_else(no_tokenizer)?.encode_text_within(text, budget)?),
            Input::Messages(m, kwargs) => tok.ok_or_else(no_tokenizer)?.encode_chat_with(m, kwargs, budget)?,
        };
        if t.ids.is_empty() {
            return Err(TokenizeError::Invalid("an input produced no tokens; every input needs at least one".into()));
        }
        Ok(t)
    }
}
