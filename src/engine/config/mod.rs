//! The model's shape and variant flags, normalised from a Hugging Face `config.json` (see
//! [`hf`]) or GGUF metadata: one [`LayerSpec`] per decoder layer says which mixer and which
//! feed-forward block it has.

mod hf;
pub mod quant;

use serde::Serialize;

use super::EngineError;

/// Architectures the engine can run, as Hugging Face names them in `config.json`, with the
/// family each belongs to: the one table of both.
pub const ARCHITECTURES: &[(&str, Family)] = &[
    ("LlamaForCausalLM", Family::Llama),
    ("MistralForCausalLM", Family::Mistral),
    ("Qwen2ForCausalLM", Family::Qwen2),
    ("Qwen3ForCausalLM", Family::Qwen3),
    ("Qwen3MoeForCausalLM", Family::Qwen3Moe),
    ("Qwen3NextForCausalLM", Family::Qwen3Next),
    ("Qwen3_5ForConditionalGeneration", Family::Qwen3_5),
    ("Qwen3_5ForCausalLM", Family::Qwen3_5),
    ("Qwen3_5MoeForConditionalGeneration", Family::Qwen3_5Moe),
    ("Qwen3_5MoeForCausalLM", Family::Qwen3_5Moe),
    ("GptOssForCausalLM", Family::GptOss),
    ("Gemma4ForCausalLM", Family::Gemma4),
    ("Gemma4ForConditionalGeneration", Family::Gemma4),
    ("DeepseekV2ForCausalLM", Family::DeepseekV2),
    ("DeepseekV3ForCausalLM", Family::DeepseekV3),
    ("Glm4MoeLiteForCausalLM", Family::Glm4MoeLite),
    ("DeepseekV32ForCausalLM", Family::DeepseekV32),
    ("GlmMoeDsaForCausalLM", Family::GlmMoeDsa),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Qwen3Next,
    Qwen3_5,
    Qwen3_5Moe,
    GptOss,
    Gemma4,
    DeepseekV2,
    DeepseekV3,
    Glm4MoeLite,
    /// DeepSeek-V3.2: DeepSeek-V3 with DeepSeek's sparse attention (a lightning indexer keeps the
    /// `index_topk` best keys per query).
    DeepseekV32,
    /// GLM-5: DeepSeek-V3.2's sparse attention with the indexers' choice shared across layers.
    GlmMoeDsa,
}

impl Family {
    pub fn from_architecture(arch: &str) -> Result<Self, EngineError> {
        match ARCHITECTURES.iter().find(|(a, _)| *a == arch) {
            Some(&(_, family)) => Ok(family),
            None => Err(EngineError::Load(format!(
                "unsupported architecture {arch:?}; supported: {}",
                ARCHITECTURES.iter().map(|(a, _)| *a).collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): zero-centred norms `x * (1 + w)`,
    /// gated attention with partial rotary, linear-attention layers.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Family::Qwen3Next | Family::Qwen3_5 | Family::Qwen3_5Moe)
    }

    /// Multi-head latent attention and DeepSeek's routing (DeepSeek-V2, DeepSeek-V3,
    /// GLM-4.7-Flash, DeepSeek-V3.2, GLM-5).
    pub fn is_mla(self) -> bool {
        matches!(
            self,
            Family::DeepseekV2 | Family::DeepseekV3 | Family::Glm4MoeLite | Family::DeepseekV32 | Family::GlmMoeDsa
        )
    }

    /// DeepSeek's sparse attention (DeepSeek-V3.2, GLM-5): latent attention whose keys a
    /// lightning indexer selects, `index_topk` per query.
    pub fn is_sparse_attention(self) -> bool {
        matches!(self, Family::DeepseekV32 | Family::GlmMoeDsa)
    }
}

/// How rotary frequencies are rescaled for long contexts.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: frequencies blended between interpolated (`/ factor`) and original along a ramp
    /// between the dimensions that turn `beta_fast` and `beta_slow` times over
    /// `original_max_position_embeddings` (the ramp's ends rounded outwards when `truncate`), and
    /// cos/sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The factor cos and sin are multiplied by (1 but for YaRN).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn { attention_factor, .. } => *attention_factor,
            _ => 1.0,
        }
    }
}

/// A decoder layer's token mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MixerKind {
    /// Causal softmax attention over the whole sequence.
    FullAttention,
    /// Causal softmax attention over the last `sliding_window` positions.
    SlidingAttention,
    /// Gated DeltaNet: causal conv1d, then the gated delta rule.
    LinearAttention,
    /// Multi-head latent attention ([`MlaConfig`]): causal softmax attention whose keys and
    /// values are expanded per head from a compressed latent, with a rotary part shared by all
    /// heads.
    LatentAttention,
}

impl MixerKind {
    /// Softmax attention, windowed or not.
    pub fn is_attention(self) -> bool {
        matches!(self, MixerKind::FullAttention | MixerKind::SlidingAttention | MixerKind::LatentAttention)
    }
}

/// A decoder layer's feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnKind {
    /// SwiGLU MLP with `intermediate_size`.
    Dense,
    /// Sparse mixture of experts ([`MoeConfig`]).
    Moe,
    /// The dense MLP and the experts side by side, both fed from the residual stream, each
    /// output normed, the two added (`MoeConfig::router_norm` routes from the stream).
    DenseAndMoe,
}

impl FfnKind {
    pub fn has_dense(self) -> bool {
        matches!(self, FfnKind::Dense | FfnKind::DenseAndMoe)
    }

    pub fn has_moe(self) -> bool {
        matches!(self, FfnKind::Moe | FfnKind::DenseAndMoe)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerSpec {
    pub mixer: MixerKind,
    pub ffn: FfnKind,
}

impl LayerSpec {
    pub const DENSE_ATTENTION: LayerSpec = LayerSpec { mixer: MixerKind::FullAttention, ffn: FfnKind::Dense };
}

/// How the Gated DeltaNet input projections are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GdnLayout {
    /// `in_proj_qkvz` and `in_proj_ba`, grouped per key head (Qwen3-Next).
    Fused,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (Qwen3.5).
    Separate,
}

/// Tokens per chunk of the chunked delta rule (chunks never straddle two sequences).
pub const GDN_CHUNK: usize = 64;

/// Shape of the Gated DeltaNet (linear-attention) layers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinearAttentionConfig {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
    pub layout: GdnLayout,
}

impl LinearAttentionConfig {
    /// Channels of the causal conv: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
    }
}

/// Shape of multi-head latent attention (DeepSeek-V2 and later): queries from `q_proj`, or
/// through the low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`; keys and values from
/// `kv_a_proj_with_mqa`, whose first `kv_lora_rank` outputs (the latent) go through
/// `kv_a_layernorm` and `kv_b_proj` (per head: the key's `qk_nope_head_dim` dimensions, then the
/// value's `v_head_dim`), and whose last `qk_rope_head_dim` outputs are a rotated key part shared
/// by every head. Each head's query and key are its `qk_nope_head_dim` unrotated dimensions then
/// the `qk_rope_head_dim` rotated ones.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MlaConfig {
    /// The low-rank query path's width (`None`: a plain `q_proj`).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The rotated dimensions come as interleaved pairs `(x0, x1), (x2, x3), ...` (DeepSeek's
    /// layout) rather than as two halves.
    pub rope_interleaved: bool,
    /// The softmax scale: `(qk_nope_head_dim + qk_rope_head_dim)^-1/2`, times YaRN's
    /// `mscale(factor, mscale_all_dim)^2` where the rope scaling sets `mscale_all_dim`.
    pub softmax_scale: f64,
    /// Sparse attention's key selection, where the model has one ([`KeyIndexer`]).
    pub indexer: Option<KeyIndexer>,
}

/// A lightning indexer that keeps the `topk` best-scored keys of each query (sparse attention).
/// A query with at most `topk` causal keys keeps them all, whatever the scores: the attention is
/// then exactly dense causal attention. That is the only case computed: the indexer's weights
/// (`{attention}.indexer.*`, shapes checked) are accepted and never read, and every sequence
/// longer than `topk` tokens is refused ([`ModelConfig::max_sequence_tokens`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KeyIndexer {
    /// `index_topk`.
    pub topk: usize,
    /// `index_n_heads`, `index_head_dim`: the shapes of its weights.
    pub heads: usize,
    pub head_dim: usize,
}

/// How the router's logits become the scores experts are chosen by (DeepSeek's routing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoreFunction {
    Softmax,
    Sigmoid,
}

/// How a group of experts is scored for group-limited routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupScore {
    /// Its best expert's score (DeepSeek-V2's `group_limited_greedy`).
    Max,
    /// The sum of its two best experts' scores, correction bias included (DeepSeek-V3).
    TopTwoSum,
}

/// DeepSeek's routing: scores from the f32 router (`ScoreFunction`), plus
/// `e_score_correction_bias` for choosing only; where `groups` is set, only experts in the
/// `topk_group` best of `n_group` equal groups can be chosen; the k best are chosen, weighted by
/// their scores (without the bias), renormalised (plus 1e-20) when `norm_topk_prob`, times
/// `routed_scaling_factor`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeepseekRouting {
    pub scores: ScoreFunction,
    pub correction_bias: bool,
    /// `(n_group, topk_group, how a group is scored)`.
    pub groups: Option<(usize, usize, GroupScore)>,
    pub routed_scaling_factor: f64,
}

/// How a token's experts and their weights are chosen from the router's logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// A softmax over every expert, then the k most probable (renormalised when
    /// `norm_topk_prob`).
    SoftmaxTopK,
    /// The k largest logits, then a softmax over those k.
    TopKSoftmax,
    /// DeepSeek's routing ([`MoeConfig::deepseek`]).
    Deepseek,
}

/// What joins an expert's gate and up projections.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExpertActivation {
    /// `silu(gate) * up`.
    Silu,
    /// `(u + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)` and
    /// `u = clamp(up, -limit, limit)`.
    ClampedSwiglu { limit: f64, alpha: f64 },
    /// `gelu_tanh(gate) * up` (GELU's tanh approximation).
    GeluTanh,
}

/// How the experts' projections are stored when fused into 3-D tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertsLayout {
    /// `experts.gate_up_proj` `[E, 2I, H]` (each expert's gate rows, then its up rows) and
    /// `experts.down_proj` `[E, H, I]`, or one module per expert.
    GateThenUp,
    /// `experts.gate_up_proj` `[E, H, 2I]` multiplied as `x W`, the gate in the even columns and
    /// up in the odd ones, and `experts.down_proj` `[E, I, H]`; or both in MXFP4
    /// (`*_blocks` `[E, out, in / 32, 16]`, `*_scales` `[E, out, in / 32]`, rows `out`).
    Interleaved,
}

/// Shape of the sparse mixture-of-experts blocks.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate_size: usize,
    /// A shared expert of this size, scaled by `sigmoid(x . shared_expert_gate)`.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Renormalise the top-k routing weights to sum to one ([`Routing::SoftmaxTopK`]).
    pub norm_topk_prob: bool,
    pub routing: Routing,
    /// The router's module under the layer's `mlp` (`gate`, `router`).
    pub router: &'static str,
    /// Bias on the router.
    pub router_bias: bool,
    pub layout: ExpertsLayout,
    /// Biases on the experts' projections (`gate_up_proj_bias`, `down_proj_bias`).
    pub expert_bias: bool,
    pub activation: ExpertActivation,
    /// The router reads the residual stream through a scale-free RMSNorm times `router.scale`
    /// times `hidden^-1/2`, and each chosen expert's weight (after the renormalisation) is
    /// multiplied by its `router.per_expert_scale`.
    pub router_norm: bool,
    /// The parameters of [`Routing::Deepseek`].
    pub deepseek: Option<DeepseekRouting>,
    /// The shared expert is `shared_experts` (DeepSeek), added without a gate, rather than
    /// `shared_expert` scaled by `shared_expert_gate`.
    pub ungated_shared_experts: bool,
}

/// The shape of the full-attention layers where it differs from the sliding ones': their own
/// head size and key-value heads, their own rotary embedding, and values that may be the keys.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FullAttentionShape {
    pub head_dim: usize,
    pub num_key_value_heads: usize,
    /// No `v_proj`: the values are the key projection's output (before the key norm).
    pub k_eq_v: bool,
    pub rope_theta: f64,
    /// "Proportional" rotary: the first `rotated_pairs` of the `head_dim / 2` frequency pairs
    /// turn at `theta^(-2i / head_dim)` (divided by `rope_factor`), the rest not at all; halves
    /// of the whole head rotate.
    pub rotated_pairs: usize,
    pub rope_factor: f64,
}

/// Per-layer inputs (per-layer embeddings): each decoder layer gets a `width`-wide input of its
/// own per token, `(norm(proj(e) * projection_scale) + table(id) * embed_scale) * combine_scale`,
/// where `e` are the token's scaled embeddings, `proj` is `per_layer_model_projection`
/// (`[layers * width, hidden]`), `norm` the RMSNorm `per_layer_projection_norm` (`[width]`) of
/// each layer's slice, and `table` is `embed_tokens_per_layer` (`[vocab_size, layers * width]`).
/// After its feed-forward block a layer adds
/// `post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) * input))` to its
/// stream (before its scalar).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PerLayerInputs {
    pub width: usize,
    /// Rows of the table (at least the model's `vocab_size`).
    pub vocab_size: usize,
    /// Layers the table and the projection hold inputs for: the checkpoint's layer count, kept
    /// when the config is truncated.
    pub layers: usize,
    /// The table's rows are multiplied by this (rounded to the compute dtype first).
    pub embed_scale: f64,
    pub projection_scale: f64,
    pub combine_scale: f64,
    /// What follows the gate projection in each layer.
    pub activation: ExpertActivation,
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelConfig {
    pub architecture: String,
    pub family: Family,
    pub hidden_size: usize,
    /// The dense MLP's width (0 when every layer is a mixture of experts).
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that rotate (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    /// The window of [`MixerKind::SlidingAttention`] layers: keys this many positions back or
    /// further are masked.
    pub sliding_window: Option<usize>,
    /// One learned logit per query head (`self_attn.sinks`) joins every row's softmax and is
    /// dropped after it.
    pub attention_sinks: bool,
    /// Bias on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorm on queries and keys before rotary embedding (Qwen3 and later).
    pub qk_norm: bool,
    /// RMSNorms (decoder, final, q/k) scale by `1 + w` instead of `w` (the hybrids).
    pub zero_centred_norms: bool,
    /// The decoder's RMSNorms (each layer's two and the final one) normalise in f32 with an f32
    /// weight and round once (transformers keeps gpt-oss's norms in f32 whatever the dtype).
    pub f32_norms: bool,
    /// `q_proj` also emits a per-head output gate: `attn * sigmoid(gate)` before `o_proj`.
    pub attn_output_gate: bool,
    /// Full-attention layers shaped apart from the rest ([`FullAttentionShape`]).
    pub full_attention: Option<FullAttentionShape>,
    /// A scale-free RMSNorm on each value head.
    pub v_norm: bool,
    /// The softmax scale of attention (None: `head_dim^-1/2`).
    pub attention_scale: Option<f64>,
    /// Norms around both sublayers: `x + post_attn(attn(norm(x)))`, then
    /// `x + post_ffn(ffn(pre_ffn(x)))`, the layer's output times its `layer_scalar`.
    pub sandwich_norms: bool,
    /// The embeddings are multiplied by this (rounded to the compute dtype first).
    pub embed_scale: Option<f64>,
    /// What joins the dense MLP's gate and up projections.
    pub mlp_activation: ExpertActivation,
    /// Logits become `cap * tanh(logits / cap)` before the log-softmax.
    pub final_logit_softcapping: Option<f64>,
    pub tie_word_embeddings: bool,
    pub linear_attention: Option<LinearAttentionConfig>,
    /// The shape of [`MixerKind::LatentAttention`] layers.
    pub mla: Option<MlaConfig>,
    /// Multi-token-prediction layers the checkpoint stores after the decoder's
    /// (`layers.{num_hidden_layers}..`): never read.
    pub mtp_layers: usize,
    pub moe: Option<MoeConfig>,
    /// One entry per decoder layer.
    pub layers: Vec<LayerSpec>,
    /// The dense MLP's width per layer where the layers differ (empty: `intermediate_size`
    /// everywhere; else one entry per layer).
    pub mlp_widths: Vec<usize>,
    /// Key-value sharing: per layer, the earlier attention layer (of the same kind) whose keys
    /// and values, after their norms and rotary embedding, it attends over instead of its own; it
    /// has no key or value projections. Empty: none; else one entry per layer.
    pub kv_sources: Vec<Option<usize>>,
    /// Per-layer inputs ([`PerLayerInputs`]).
    pub per_layer_inputs: Option<PerLayerInputs>,
    /// The checkpoint's quantisation scheme (None: float weights, or GGUF types dequantised), or
    /// the one its float projections are quantised to at load (`ModelFiles::quantize`).
    pub quantization: Option<quant::Quantization>,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::Load(msg.into())
}

/// How many decoder layers of each kind, and the experts of MoE layers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct LayerKinds {
    pub full_attention: usize,
    /// Attention layers over a sliding window.
    #[serde(default)]
    pub sliding_attention: usize,
    /// Multi-head latent attention layers.
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

impl ModelConfig {
    /// The same model with only its first `depth` decoder layers (at least one).
    pub fn truncated(&self, depth: usize) -> Self {
        let depth = depth.clamp(1, self.num_hidden_layers);
        let mut c = self.clone();
        c.num_hidden_layers = depth;
        c.layers.truncate(depth);
        c.mlp_widths.truncate(depth);
        c.kv_sources.truncate(depth);
        c
    }

    /// The dense MLP's width in layer `i`.
    pub fn intermediate_size_of(&self, i: usize) -> usize {
        self.mlp_widths.get(i).copied().unwrap_or(self.intermediate_size)
    }

    /// The layer whose keys and values layer `i` reuses, if it shares them.
    pub fn kv_source(&self, i: usize) -> Option<usize> {
        self.kv_sources.get(i).copied().flatten()
    }

    /// Whether a later layer reuses layer `i`'s keys and values.
    pub fn kv_reused(&self, i: usize) -> bool {
        self.kv_sources.contains(&Some(i))
    }

    /// The longest sequence this model is computed exactly for, and why, where it has a limit
    /// below its context: sparse attention's `index_topk` (a longer sequence's queries would
    /// attend to the keys its indexer picks, which is not built). The engine refuses a longer
    /// sequence, and the HTTP layer a longer input, with this message.
    pub fn max_sequence_tokens(&self) -> Option<(usize, String)> {
        let k = self.mla.as_ref()?.indexer.as_ref()?.topk;
        Some((
            k,
            format!(
                "{} attends each query to the index_topk = {k} keys its sparse attention's indexer selects; \
                 layertap computes it exactly for sequences of at most {k} tokens (every key kept) and does not \
                 build the indexer's selection beyond that",
                self.architecture
            ),
        ))
    }

    pub fn validate(&self) -> Result<(), EngineError> {
        const MAX_DIMENSION: usize = 1 << 24;
        const MAX_TABLE_ELEMENTS: usize = 1 << 36;
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return Err(bad("model config: head counts must be positive"));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(bad(format!(
                "model config: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(bad(format!("model config: head_dim {} must be even and positive", self.head_dim)));
        }
        if self.num_hidden_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err(bad("model config: layers, hidden size and vocab size must be positive"));
        }
        // Sizes past any real model's are refused here, before any of them sizes an allocation
        // or a product that could overflow: the largest released models have vocabularies near
        // 2^18, hidden sizes near 2^14 and a few hundred layers.
        for (what, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("head_dim", self.head_dim),
            ("num_attention_heads", self.num_attention_heads),
        ] {
            if v > MAX_DIMENSION {
                return Err(bad(format!(
                    "model config: {what} {v} is larger than layertap serves (at most {MAX_DIMENSION}); it is not a \
                     real model's size"
                )));
            }
        }
        if self.vocab_size.saturating_mul(self.hidden_size) > MAX_TABLE_ELEMENTS {
            return Err(bad(format!(
                "model config: an embedding table of {} x {} is larger than layertap serves (at most 2^36 values)",
                self.vocab_size, self.hidden_size
            )));
        }
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(bad(format!(
                "model config: the rotary dimension {} (head_dim x partial_rotary_factor) must be even, positive \
                 and at most head_dim {}",
                self.rotary_dim, self.head_dim
            )));
        }
        if self.layers.len() != self.num_hidden_layers {
            return Err(bad(format!(
                "model config: {} layer kinds for num_hidden_layers {}",
                self.layers.len(),
                self.num_hidden_layers
            )));
        }
        let uses = |m: MixerKind| self.layers.iter().any(|l| l.mixer == m);
        if uses(MixerKind::SlidingAttention) && self.sliding_window.is_none_or(|w| w == 0) {
            return Err(bad("model config: sliding-attention layers need a positive sliding_window"));
        }
        if uses(MixerKind::LinearAttention) {
            let Some(la) = &self.linear_attention else {
                return Err(bad("model config: linear-attention layers without their dimensions"));
            };
            let dims = [la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel];
            if dims.contains(&0) {
                return Err(bad("model config: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, \
                     linear_value_head_dim and linear_conv_kernel_dim must be positive"));
            }
            if la.num_value_heads % la.num_key_heads != 0 {
                return Err(bad(format!(
                    "model config: linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
                    la.num_value_heads, la.num_key_heads
                )));
            }
        }
        if let Some(f) = &self.full_attention {
            if f.head_dim == 0 || !f.head_dim.is_multiple_of(2) || f.head_dim > MAX_DIMENSION {
                return Err(bad(format!(
                    "model config: the full-attention head_dim {} must be even and positive",
                    f.head_dim
                )));
            }
            if f.num_key_value_heads == 0 || !self.num_attention_heads.is_multiple_of(f.num_key_value_heads) {
                return Err(bad(format!(
                    "model config: num_attention_heads ({}) is not a multiple of the full-attention layers' key-value \
                     heads ({})",
                    self.num_attention_heads, f.num_key_value_heads
                )));
            }
            if f.rotated_pairs > f.head_dim / 2 || !(f.rope_theta > 0.0 && f.rope_factor > 0.0) {
                return Err(bad("model config: the full-attention rotary parameters are out of range"));
            }
        }
        if self.layers.iter().any(|l| l.ffn.has_moe()) {
            let Some(m) = &self.moe else { return Err(bad("model config: MoE layers without their dimensions")) };
            if m.num_experts == 0 || m.experts_per_token == 0 || m.expert_intermediate_size == 0 {
                return Err(bad("model config: num_experts, num_experts_per_tok and moe_intermediate_size must be \
                     positive"));
            }
            if m.experts_per_token > m.num_experts {
                return Err(bad(format!(
                    "model config: num_experts_per_tok ({}) exceeds num_experts ({})",
                    m.experts_per_token, m.num_experts
                )));
            }
        }
        if uses(MixerKind::LatentAttention) {
            let Some(m) = &self.mla else {
                return Err(bad("model config: latent-attention layers without their dimensions"));
            };
            let dims =
                [m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank.unwrap_or(1)];
            if dims.contains(&0) || dims.iter().any(|&d| d > MAX_DIMENSION) {
                return Err(bad(format!(
                    "model config: kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim must \
                     be positive and real sizes, got {m:?}"
                )));
            }
            if !(m.softmax_scale.is_finite() && m.softmax_scale > 0.0) {
                return Err(bad(format!(
                    "model config: the attention's softmax scale {} is not positive",
                    m.softmax_scale
                )));
            }
        }
        if let Some(r) = self.moe.as_ref().and_then(|m| m.deepseek.as_ref().map(|r| (m, r))) {
            let (m, r) = r;
            if let Some((groups, topk_group, _)) = r.groups {
                if groups == 0 || !m.num_experts.is_multiple_of(groups) || topk_group == 0 || topk_group > groups {
                    return Err(bad(format!(
                        "model config: n_group {groups} must divide the {} experts and topk_group {topk_group} be in \
                         1..=n_group",
                        m.num_experts
                    )));
                }
                if m.experts_per_token > topk_group * (m.num_experts / groups) {
                    return Err(bad(format!(
                        "model config: num_experts_per_tok {} is more than the {topk_group} groups of {} experts \
                         that topk_group lets a token choose from",
                        m.experts_per_token,
                        m.num_experts / groups
                    )));
                }
                if r.groups.is_some_and(|g| g.2 == GroupScore::TopTwoSum) && m.num_experts / groups < 2 {
                    return Err(bad("model config: groups scored by their two best experts need two experts a group"));
                }
            }
            if !(r.routed_scaling_factor.is_finite()) {
                return Err(bad("model config: routed_scaling_factor must be finite"));
            }
        }
        if self.layers.iter().any(|l| l.ffn.has_dense()) && self.intermediate_size == 0 {
            return Err(bad("model config: dense MLP layers need a positive intermediate_size"));
        }
        if !self.mlp_widths.is_empty() && self.mlp_widths.len() != self.num_hidden_layers {
            return Err(bad("model config: per-layer MLP widths must name every layer"));
        }
        if self.mlp_widths.iter().any(|&w| w == 0 || w > MAX_DIMENSION) {
            return Err(bad(format!("model config: per-layer MLP widths {:?} out of range", self.mlp_widths)));
        }
        if !self.kv_sources.is_empty() && self.kv_sources.len() != self.num_hidden_layers {
            return Err(bad("model config: key-value sources must name every layer"));
        }
        for (i, s) in self.kv_sources.iter().enumerate() {
            let Some(j) = *s else { continue };
            let ok = j < i
                && self.layers[i].mixer.is_attention()
                && self.layers[j].mixer == self.layers[i].mixer
                && self.kv_sources[j].is_none();
            if !ok {
                return Err(bad(format!(
                    "model config: layer {i} cannot reuse the keys and values of layer {j} (an earlier attention layer \
                     of the same kind that computes its own)"
                )));
            }
        }
        if let Some(p) = &self.per_layer_inputs {
            if p.width == 0 || p.width > MAX_DIMENSION || p.layers < self.num_hidden_layers || p.layers > MAX_DIMENSION
            {
                return Err(bad(format!(
                    "model config: per-layer inputs of width {} for {} layers",
                    p.width, p.layers
                )));
            }
            if p.vocab_size < self.vocab_size {
                return Err(bad(format!(
                    "model config: vocab_size_per_layer_input {} is below vocab_size {}: tokens past it have no \
                     per-layer embedding",
                    p.vocab_size, self.vocab_size
                )));
            }
            if p.vocab_size.saturating_mul(p.width.saturating_mul(p.layers)) > MAX_TABLE_ELEMENTS {
                return Err(bad("model config: the per-layer embedding table is larger than layertap serves"));
            }
        }
        Ok(())
    }

    /// Activation bytes per token one layer of kind `spec` holds at its peak (`b` bytes per
    /// compute-dtype value): what the automatic batch budget sizes batches by. Linear-attention
    /// layers count their f32 conv, chunk and 64 x 64 per-chunk matrices (with padding of short
    /// sequences to whole chunks); MoE layers count the router, every token's k expert rows and
    /// the shared expert.
    pub fn layer_bytes_per_token(&self, spec: &LayerSpec, b: u64) -> u64 {
        let h = self.hidden_size as u64;
        let (nq, nkv, hd) = (self.num_attention_heads as u64, self.num_key_value_heads as u64, self.head_dim as u64);
        let (nkv, hd) = match (&self.full_attention, spec.mixer) {
            (Some(f), MixerKind::FullAttention) => (nkv.max(f.num_key_value_heads as u64), hd.max(f.head_dim as u64)),
            _ => (nkv, hd),
        };
        let q = if self.attn_output_gate { 2 * nq * hd } else { nq * hd };
        let mixer = match spec.mixer {
            MixerKind::FullAttention | MixerKind::SlidingAttention => b * (2 * (q + 2 * nkv * hd) + 2 * nq * hd),
            MixerKind::LatentAttention => self.mla.as_ref().map_or(0, |m| {
                let latent = (m.q_lora_rank.unwrap_or(0) + m.kv_lora_rank + m.qk_rope_head_dim) as u64;
                let per_head = (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 3 * m.v_head_dim) as u64;
                b * (2 * latent + 3 * nq * per_head)
            }),
            MixerKind::LinearAttention => self.linear_attention.as_ref().map_or(0, |la| {
                let (nv, dk, dv) = (la.num_value_heads as u64, la.key_head_dim as u64, la.value_head_dim as u64);
                let conv = la.conv_dim() as u64;
                let projections = b * (conv + 2 * nv * dv + 2 * nv);
                let conv_f32 = 4 * conv * (la.conv_kernel as u64 + 3);
                let chunk_rows = 4 * (8 * nv * dk + 6 * nv * dv);
                let matrices = 4 * 8 * nv * GDN_CHUNK as u64;
                // Chunk tensors are padded to whole chunks: count them one and a half times.
                projections + conv_f32 + (chunk_rows + matrices) * 3 / 2 + 4 * 3 * nv * dv
            }),
        };
        // The widest MLP of any layer (where the widths differ).
        let width = self.mlp_widths.iter().copied().max().unwrap_or(0).max(self.intermediate_size) as u64;
        let dense = if spec.ffn.has_dense() { 3 * width * b } else { 0 };
        let ffn = dense
            + match (spec.ffn, &self.moe) {
                (FfnKind::Dense, _) => 0,
                (FfnKind::Moe | FfnKind::DenseAndMoe, Some(m)) => {
                    let k = m.experts_per_token as u64;
                    let router = 3 * 4 * m.num_experts as u64 + 8 * k;
                    let experts = k * b * (2 * h + 3 * m.expert_intermediate_size as u64);
                    let shared = m.shared_expert_intermediate_size.map_or(0, |s| b * (3 * s as u64 + h));
                    // The rows gathered back per token and slot, then weighted and summed in f32.
                    let gathered = k * h * (b + 8);
                    router + experts + shared + 2 * h * b + gathered
                }
                (FfnKind::Moe | FfnKind::DenseAndMoe, None) => 0,
            };
        b * 4 * h + mixer + ffn
    }

    /// What this model computes that layertap's CUDA paths do not (yet): a model that needs any
    /// of it is refused on a CUDA device, named by these, rather than run with kernels that leave
    /// it out.
    pub fn needs_beyond_cuda(&self) -> Vec<&'static str> {
        let mut needs = Vec::new();
        if self.attention_sinks {
            needs.push("attention sinks");
        }
        if self.rope_scaling.as_ref().is_some_and(|s| s.attention_factor() != 1.0) {
            needs.push("YaRN's attention factor on the rotary tables");
        }
        if self.full_attention.is_some() {
            needs.push("full-attention layers with their own head size, key-value heads and proportional rotary");
        }
        if self.v_norm {
            needs.push("the value norm");
        }
        if self.attention_scale.is_some() {
            needs.push("an attention scale other than head_dim^-1/2");
        }
        if self.sandwich_norms {
            needs.push("sandwich norms and the per-layer scalar");
        }
        if self.embed_scale.is_some() {
            needs.push("the embedding scale");
        }
        if self.mlp_activation != ExpertActivation::Silu {
            needs.push("the GELU-tanh MLP");
        }
        if self.final_logit_softcapping.is_some() {
            needs.push("final-logit softcapping");
        }
        if self.layers.iter().any(|l| l.ffn == FfnKind::DenseAndMoe) {
            needs.push("a dense MLP beside the experts");
        }
        if let Some(m) = self.moe.as_ref().filter(|_| self.layers.iter().any(|l| l.ffn.has_moe())) {
            if m.router_norm {
                needs.push("the normed, scaled router with per-expert scales");
            }
            if m.routing == Routing::TopKSoftmax {
                needs.push("top-k-then-softmax routing");
            }
            if m.router_bias || m.expert_bias {
                needs.push("router and expert biases");
            }
            if matches!(m.activation, ExpertActivation::ClampedSwiglu { .. }) {
                needs.push("the clamped SwiGLU experts");
            }
            if m.activation == ExpertActivation::GeluTanh {
                needs.push("GELU-tanh experts");
            }
            if m.layout == ExpertsLayout::Interleaved {
                needs.push("interleaved gate/up experts (MXFP4 or float)");
            }
            if m.routing == Routing::Deepseek {
                needs.push("DeepSeek's routing (sigmoid or softmax scores, correction bias, expert groups, scaling)");
            }
            if m.ungated_shared_experts {
                needs.push("ungated shared experts");
            }
        }
        if self.layers.iter().any(|l| l.mixer == MixerKind::LatentAttention) {
            needs.push("multi-head latent attention");
        }
        if self.per_layer_inputs.is_some() {
            needs.push("per-layer embeddings (per-layer inputs)");
        }
        if self.kv_sources.iter().any(Option::is_some) {
            needs.push("key-value sharing across layers");
        }
        needs
    }

    /// The key-value heads, head size and rotated dimensions of an attention layer of kind
    /// `mixer`, whether its values are its keys, and whether it takes the full-attention rotary
    /// tables ([`FullAttentionShape`]; they rotate the whole head).
    pub fn attention_shape(&self, mixer: MixerKind) -> (usize, usize, usize, bool, bool) {
        match (&self.full_attention, mixer) {
            (Some(f), MixerKind::FullAttention) => (f.num_key_value_heads, f.head_dim, f.head_dim, f.k_eq_v, true),
            _ => (self.num_key_value_heads, self.head_dim, self.rotary_dim, false, false),
        }
    }

    /// The attention window of a layer of kind `spec`.
    pub fn window_of(&self, spec: &LayerSpec) -> Option<usize> {
        (spec.mixer == MixerKind::SlidingAttention).then_some(self.sliding_window).flatten()
    }

    /// Counts of each layer kind (what `/v1/info` reports).
    pub fn layer_kinds(&self) -> LayerKinds {
        let count = |f: &dyn Fn(&LayerSpec) -> bool| self.layers.iter().filter(|l| f(l)).count();
        let moe_layers = count(&|l| l.ffn.has_moe());
        let moe = self.moe.as_ref().filter(|_| moe_layers > 0);
        LayerKinds {
            full_attention: count(&|l| l.mixer == MixerKind::FullAttention),
            sliding_attention: count(&|l| l.mixer == MixerKind::SlidingAttention),
            latent_attention: count(&|l| l.mixer == MixerKind::LatentAttention),
            linear_attention: count(&|l| l.mixer == MixerKind::LinearAttention),
            dense_mlp: count(&|l| l.ffn.has_dense()),
            moe: moe_layers,
            experts: moe.map(|m| m.num_experts),
            experts_per_token: moe.map(|m| m.experts_per_token),
            shared_expert: moe.is_some_and(|m| m.shared_expert_intermediate_size.is_some()),
        }
    }
}
