//! Plain text: `tok(text)` as transformers tokenizes it, within a budget.

use super::{Budget, TextTokenizer, TokenizeError};

impl TextTokenizer {
    pub(super) fn encoder(&self, split_special_tokens: bool) -> &tokenizers::Tokenizer {
        if split_special_tokens {
            &self.split
        } else {
            &self.tok
        }
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

    /// Ids of plain text, special tokens (e.g. BOS) added as the tokenizer is configured to.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_text_within(text, &Budget::unlimited())
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tok.decode(ids, false).map_err(|e| TokenizeError::Invalid(format!("decoding: {e}")))
    }

    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }
}
