//! Request and response bodies of the HTTP API (serde + OpenAPI schemas).

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
    /// With `messages`: more variables for the chat template, as transformers'
    /// `apply_chat_template(messages, **kwargs)` passes them, e.g. `{"reasoning_effort": "high"}`
    /// (gpt-oss) or `{"enable_thinking": false}` (Qwen3). `messages`, `add_generation_prompt`,
    /// `bos_token` and `eos_token` are set by the server and refused here.
    #[schema(value_type = Option<Object>, example = json!({"reasoning_effort": "high"}))]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `POST /v1/hidden-states`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HiddenStatesRequest {
    /// The sequences; each becomes a slice of the token dimension of the answer.
    pub inputs: Vec<InputItem>,
    /// Hugging Face `hidden_states` indices: 0 = embedding output, i = output of decoder layer i
    /// (1-based), L = final output after the last norm; negative indices count from the end (-1 = L).
    /// The name "final_prenorm" asks for the last decoder layer's output before the final norm
    /// (which Hugging Face does not return), and mixes with indices. The answer keeps this order.
    /// May be empty when `logprobs` is asked (then `hidden_states` is `[rows, 0, hidden]`).
    #[schema(example = json!([2, 17, -1, "final_prenorm"]))]
    pub layers: Vec<crate::answer::LayerRef>,
    /// Output dtype: float32, bfloat16, float16 or float8_e4m3fn (also f32, bf16, f16, fp8).
    /// Default: the compute dtype. fp8 answers add `hidden_states_scale` [rows, n_layers] f32, one
    /// scale per token and layer (amax / 448), quantised on the device:
    /// `hidden_states.float() * hidden_states_scale[..., None]` restores the states.
    #[schema(example = "bfloat16")]
    pub dtype: Option<String>,
    /// Which tokens' rows to return: "all" (default), "assistant" (rows whose loss_mask is 1),
    /// {"last": k} (the last k tokens of each input), or one list of [start, end) pairs per input.
    /// With a selection the answer adds `positions` [rows] int64, each row's position in its
    /// input; `input_ids`, `loss_mask` and `cu_seqlens` then describe the returned rows.
    #[schema(schema_with = tokens_schema)]
    pub tokens: Option<serde_json::Value>,
    /// Return states holding NaN or infinity (as sent, in the answer's dtype) or non-finite
    /// log-probabilities instead of refusing the request (422); the answer's `nonfinite` metadata
    /// then counts the rows per layer, and under `"logprobs"` the rows whose log-probabilities are
    /// not finite.
    #[serde(default)]
    pub allow_nonfinite: bool,
    /// Tokenize special-token text (such as `<|im_start|>`) inside `text` and message content as
    /// plain text, as transformers' `split_special_tokens=True`, so content cannot forge control
    /// tokens; the chat template's own control tokens stay special. Default false (transformers'
    /// default: such text becomes the control token).
    #[serde(default)]
    pub split_special_tokens: bool,
    /// Also the teacher's top-k next-token log-probabilities of every returned row:
    /// `topk_ids` [rows, top_k] int64 and `topk_logprobs` [rows, top_k] float32 (descending,
    /// ties by ascending id; the f32 log-softmax over the whole vocabulary of the model's output
    /// head on the final-norm state), and with `target` `target_logprobs` [rows] float32.
    #[serde(default)]
    pub logprobs: Option<LogprobsRequest>,
}

/// `logprobs` of `POST /v1/hidden-states`.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LogprobsRequest {
    /// Entries per row, 1 to the server's `max_top_k` (`--max-top-k`, default 64, at most the
    /// vocabulary's size).
    #[schema(example = 8, minimum = 1)]
    pub top_k: i64,
    /// Also `target_logprobs` [rows] float32: the log-probability of each row's actual next input
    /// token; NaN (null in JSON) on an input's last token, which has no next token.
    #[serde(default)]
    pub target: bool,
}

fn tokens_schema() -> impl Into<utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>> {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
    let int = || ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(0));
    let pair = ArrayBuilder::new().items(int()).min_items(Some(2)).max_items(Some(2));
    OneOfBuilder::new()
        .item(ObjectBuilder::new().schema_type(Type::String).enum_values(Some(["all", "assistant"])))
        .item(
            ObjectBuilder::new()
                .property("last", ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(1)))
                .required("last"),
        )
        .item(
            ArrayBuilder::new()
                .items(ArrayBuilder::new().items(pair))
                .description(Some("one list of [start, end) pairs per input, ascending and not overlapping")),
        )
        .description(Some("Which tokens' rows to return; default \"all\"."))
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
    pub layer_kinds: LayerKinds,
    /// How the weights are quantised, when they are: as the checkpoint stores them (e.g. "fp8
    /// e4m3 weights in 128x128 blocks, dynamic per-token fp8 activations"), or by layertap at
    /// load from a float checkpoint ("fp8 e4m3 weights in 128x128 blocks quantised at load
    /// (--quantize fp8), dynamic per-token fp8 activations").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    /// Compute dtype (the default output dtype).
    pub dtype: String,
    pub devices: Vec<String>,
    /// Each loaded replica (one per entry of `devices`) and its stages, in order (`--pipeline`;
    /// one stage holding every layer without it).
    pub replicas: Vec<ReplicaInfo>,
    pub max_batch_tokens: usize,
    /// Most tokens one input may hold: `--max-input-tokens`, or less where the model computes
    /// exactly only up to a length of its own (sparse attention's `index_topk`).
    pub max_input_tokens: usize,
    pub max_queue_tokens: usize,
    /// Most tokens, inputs and chat messages one request may hold, and the largest answer in bytes.
    pub max_request_tokens: usize,
    pub max_inputs: usize,
    pub max_messages: usize,
    pub max_answer_bytes: usize,
    /// Largest `logprobs.top_k` a request may ask: `--max-top-k`, at most the vocabulary's size
    /// (0 when the model has no output head).
    pub max_top_k: usize,
    /// Whether the model has an output head (`lm_head`, or tied embeddings), which
    /// `logprobs` needs.
    pub lm_head: bool,
    /// Chat roles the model's template accepts.
    pub chat_roles: Vec<String>,
    pub has_tokenizer: bool,
    pub has_chat_template: bool,
    /// The layer-index convention.
    pub convention: String,
    /// The start-up self-check's worst figure, once a device has run it (absent when it is off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selfcheck: Option<SelfCheckInfo>,
    pub version: String,
}

/// A replica in `/v1/info`: its name (as in `devices`) and its stages.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ReplicaInfo {
    pub device: String,
    pub stages: Vec<StageInfo>,
}

/// One stage of a replica: its device, the decoder layers it runs (`first_layer..=last_layer`,
/// 1-based: the hidden-state indices they produce) and its weight bytes as the checkpoint stores
/// them (the embeddings count with the first stage, the final norm and output head with the last).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StageInfo {
    pub device: String,
    pub first_layer: usize,
    pub last_layer: usize,
    pub weight_bytes: u64,
}

impl From<&crate::engine::StageLayout> for StageInfo {
    fn from(s: &crate::engine::StageLayout) -> Self {
        StageInfo {
            device: s.device.clone(),
            first_layer: s.first_layer,
            last_layer: s.last_layer,
            weight_bytes: s.weight_bytes,
        }
    }
}

/// How many layers of each kind, for `/v1/info`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LayerKinds {
    pub full_attention: usize,
    /// Attention layers over a sliding window.
    #[serde(default)]
    pub sliding_attention: usize,
    /// Multi-head latent attention layers (DeepSeek-V2 and later).
    #[serde(default)]
    pub latent_attention: usize,
    pub linear_attention: usize,
    pub dense_mlp: usize,
    pub moe: usize,
    /// Experts per MoE layer (absent without MoE layers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<usize>,
    /// Experts each token is routed to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts_per_token: Option<usize>,
    /// Whether MoE layers add a gated shared expert.
    pub shared_expert: bool,
}

impl From<&crate::engine::LayerKinds> for LayerKinds {
    fn from(k: &crate::engine::LayerKinds) -> Self {
        LayerKinds {
            full_attention: k.full_attention,
            sliding_attention: k.sliding_attention,
            latent_attention: k.latent_attention,
            linear_attention: k.linear_attention,
            dense_mlp: k.dense_mlp,
            moe: k.moe,
            experts: k.experts,
            experts_per_token: k.experts_per_token,
            shared_expert: k.shared_expert,
        }
    }
}

/// The start-up self-check in `/v1/info`: the worst relative error over every device and index
/// (the serving path against the portable f32 path on a fixed probe).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SelfCheckInfo {
    /// off, warn or enforce.
    pub mode: String,
    /// Every device's every index within the tolerance.
    pub passed: bool,
    /// The worst relative error; null when the serving path returned a non-finite value.
    pub worst_relative_error: Option<f64>,
    pub worst_device: String,
    /// The hidden-state index of the worst error ("final_prenorm" by name).
    pub worst_index: String,
    /// The tolerance of the compute dtype.
    pub tolerance: f64,
    pub devices_checked: usize,
    /// What the check added to the slowest device's start: its probe, and any wait for the
    /// reference past its own load (the reference is computed on the CPU while devices load).
    pub seconds: f64,
    /// When it failed: what it found, and whether the checkpoint's own values (the reference
    /// itself is not finite) or the serving path is at fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /health` and `GET /ready`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StatusResponse {
    /// ok, loading, draining or selfcheck_failed.
    pub status: String,
    /// With selfcheck_failed: what the self-check found and whether the checkpoint's own values
    /// or the serving path is at fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
