//! Request and response bodies of the HTTP API (serde + OpenAPI schemas).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::tokenizer::ChatMessage;

/// One input sequence: exactly one of `input_ids`, `text` or `messages`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InputItem {
    /// Token ids, each in `0..vocab_size`.
    #[schema(example = json!([1, 2, 3]))]
    pub input_ids: Option<Vec<i64>>,
    /// Plain text, tokenized by the model's tokenizer (special tokens added as it is configured to).
    pub text: Option<String>,
    /// A chat, rendered with the model's chat template; `loss_mask` marks the assistant turns.
    pub messages: Option<Vec<ChatMessage>>,
}

/// `POST /v1/hidden-states`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HiddenStatesRequest {
    /// The sequences; each becomes a slice of the token dimension of the answer.
    pub inputs: Vec<InputItem>,
    /// Hugging Face `hidden_states` indices: 0 = embedding output, i = output of decoder layer i
    /// (1-based), L = final output after the last norm; negative indices count from the end (-1 = L).
    /// The answer keeps this order.
    #[schema(example = json!([2, 17, -1]))]
    pub layers: Vec<i64>,
    /// Output dtype: float32, bfloat16 or float16 (also f32, bf16, f16). Default: the compute dtype.
    #[schema(example = "bfloat16")]
    pub dtype: Option<String>,
    /// Tokenize special-token text (such as `<|im_start|>`) inside `text` and message content as
    /// plain text, as transformers' `split_special_tokens=True`, so content cannot forge control
    /// tokens; the chat template's own control tokens stay special. Default false (transformers'
    /// default: such text becomes the control token).
    #[serde(default)]
    pub split_special_tokens: bool,
}

/// `POST /v1/tokenize`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub inputs: Vec<InputItem>,
    /// As in `/v1/hidden-states`.
    #[serde(default)]
    pub split_special_tokens: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenizedInput {
    pub input_ids: Vec<u32>,
    /// 1 on tokens that count for the loss: assistant turns of chats, every token otherwise.
    pub loss_mask: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenizeResponse {
    pub results: Vec<TokenizedInput>,
}

/// The answer of `/v1/hidden-states` as JSON (`Accept: application/json`), for debugging.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HiddenStatesJson {
    /// `[total_tokens, n_layers, hidden]`.
    pub shape: Vec<usize>,
    pub dtype: String,
    /// Row-major values of `hidden_states`.
    pub hidden_states: Vec<f32>,
    pub input_ids: Vec<i64>,
    pub cu_seqlens: Vec<i64>,
    pub loss_mask: Vec<u8>,
    pub metadata: HashMap<String, String>,
}

/// `GET /v1/info`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct InfoResponse {
    pub model_id: String,
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// How many decoder layers of each kind (full or linear attention, dense MLP or mixture of
    /// experts), and the experts' count and top-k.
    pub layer_kinds: crate::engine::LayerKinds,
    /// Compute dtype (the default output dtype).
    pub dtype: String,
    pub devices: Vec<String>,
    pub max_batch_tokens: usize,
    pub max_input_tokens: usize,
    pub max_queue_tokens: usize,
    /// Most tokens, inputs and chat messages one request may hold, and the largest answer in bytes.
    pub max_request_tokens: usize,
    pub max_inputs: usize,
    pub max_messages: usize,
    pub max_answer_bytes: usize,
    /// Chat roles the model's template accepts.
    pub chat_roles: Vec<String>,
    pub has_tokenizer: bool,
    pub has_chat_template: bool,
    /// The layer-index convention.
    pub convention: String,
    pub version: String,
}

/// `GET /health` and `GET /ready`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StatusResponse {
    /// ok, loading or draining.
    pub status: String,
}
