//! The model's shape and variant flags, normalised from a Hugging Face `config.json` or GGUF metadata.

use serde::Serialize;
use serde_json::Value;

use super::EngineError;

/// Architectures the engine can run, as Hugging Face names them in `config.json`.
pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Family {
    pub fn from_architecture(arch: &str) -> Result<Self, EngineError> {
        match arch {
            "LlamaForCausalLM" => Ok(Family::Llama),
            "MistralForCausalLM" => Ok(Family::Mistral),
            "Qwen2ForCausalLM" => Ok(Family::Qwen2),
            "Qwen3ForCausalLM" => Ok(Family::Qwen3),
            other => Err(EngineError::Load(format!(
                "unsupported architecture {other:?}; supported: {}",
                SUPPORTED_ARCHITECTURES.join(", ")
            ))),
        }
    }
}

/// How rotary frequencies are rescaled for long contexts.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelConfig {
    pub architecture: String,
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    /// Keys further back than this many positions are masked (Mistral's sliding window).
    pub sliding_window: Option<usize>,
    /// Bias on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorm on queries and keys before rotary embedding (Qwen3).
    pub qk_norm: bool,
    pub tie_word_embeddings: bool,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::Load(msg.into())
}

fn req_usize(cfg: &Value, key: &str) -> Result<usize, EngineError> {
    cfg.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| bad(format!("config.json: missing or non-integer field {key:?}")))
}

fn opt_usize(cfg: &Value, key: &str) -> Option<usize> {
    cfg.get(key).and_then(Value::as_u64).map(|v| v as usize)
}

fn opt_f64(cfg: &Value, key: &str) -> Option<f64> {
    cfg.get(key).and_then(Value::as_f64)
}

fn opt_bool(cfg: &Value, key: &str) -> Option<bool> {
    cfg.get(key).and_then(Value::as_bool)
}

/// Parses `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
fn parse_rope(cfg: &Value) -> Result<(f64, Option<RopeScaling>), EngineError> {
    let params = cfg
        .get("rope_parameters")
        .filter(|v| v.is_object())
        .or_else(|| cfg.get("rope_scaling").filter(|v| v.is_object()));
    let theta = params.and_then(|p| opt_f64(p, "rope_theta")).or_else(|| opt_f64(cfg, "rope_theta")).unwrap_or(10000.0);
    let Some(p) = params else {
        return Ok((theta, None));
    };
    let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    let factor =
        || opt_f64(p, "factor").ok_or_else(|| bad(format!("config.json: rope type {kind:?} needs \"factor\"")));
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: opt_f64(p, "low_freq_factor").unwrap_or(1.0),
            high_freq_factor: opt_f64(p, "high_freq_factor").unwrap_or(4.0),
            original_max_position_embeddings: opt_f64(p, "original_max_position_embeddings")
                .ok_or_else(|| bad("config.json: llama3 rope needs original_max_position_embeddings"))?,
        }),
        other => {
            return Err(bad(format!(
                "config.json: rope type {other:?} is not supported (supported: default, linear, llama3)"
            )))
        }
    };
    Ok((theta, scaling))
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json` value.
    pub fn from_hf_json(cfg: &Value) -> Result<Self, EngineError> {
        let architecture = cfg
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| bad("config.json: missing \"architectures\""))?
            .to_string();
        let family = Family::from_architecture(&architecture)?;
        let hidden_size = req_usize(cfg, "hidden_size")?;
        let num_attention_heads = req_usize(cfg, "num_attention_heads")?;
        let num_key_value_heads = opt_usize(cfg, "num_key_value_heads").unwrap_or(num_attention_heads);
        let head_dim = opt_usize(cfg, "head_dim").unwrap_or(hidden_size / num_attention_heads.max(1));
        if let Some(act) = cfg.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(bad(format!("config.json: hidden_act {act:?} is not supported (only silu)")));
            }
        }
        let (rope_theta, rope_scaling) = parse_rope(cfg)?;
        let sliding_window = match family {
            Family::Mistral => opt_usize(cfg, "sliding_window"),
            Family::Qwen2 | Family::Qwen3 if opt_bool(cfg, "use_sliding_window") == Some(true) => {
                return Err(bad("config.json: use_sliding_window=true is not supported for Qwen models"))
            }
            _ => None,
        };
        let attention_bias = opt_bool(cfg, "attention_bias").unwrap_or(false);
        let (qkv_bias, o_bias) = match family {
            Family::Qwen2 => (true, false),
            Family::Llama | Family::Qwen3 => (attention_bias, attention_bias),
            Family::Mistral => (false, false),
        };
        let c = ModelConfig {
            architecture,
            family,
            hidden_size,
            intermediate_size: req_usize(cfg, "intermediate_size")?,
            num_hidden_layers: req_usize(cfg, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: req_usize(cfg, "vocab_size")?,
            rms_norm_eps: opt_f64(cfg, "rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: opt_usize(cfg, "max_position_embeddings").unwrap_or(4096),
            sliding_window,
            qkv_bias,
            o_bias,
            mlp_bias: family == Family::Llama && opt_bool(cfg, "mlp_bias").unwrap_or(false),
            qk_norm: family == Family::Qwen3,
            tie_word_embeddings: opt_bool(cfg, "tie_word_embeddings").unwrap_or(false),
        };
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), EngineError> {
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return Err(bad("model config: head counts must be positive"));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(bad(format!(
                "model config: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return Err(bad(format!("model config: head_dim {} must be even and positive", self.head_dim)));
        }
        if self.num_hidden_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err(bad("model config: layers, hidden size and vocab size must be positive"));
        }
        Ok(())
    }

    pub fn resolve_layers(&self, layers: &[i64]) -> Result<Vec<usize>, EngineError> {
        resolve_layers(layers, self.num_hidden_layers)
    }
}

/// Turns caller layer indices (Hugging Face `hidden_states` indices, negative from the end)
/// into indices in `0..=num_hidden_layers`, keeping the caller's order.
pub fn resolve_layers(layers: &[i64], num_layers: usize) -> Result<Vec<usize>, EngineError> {
    let n = num_layers as i64;
    if layers.is_empty() {
        return Err(EngineError::InvalidInput("\"layers\" must name at least one index".into()));
    }
    layers
        .iter()
        .map(|&i| {
            let r = if i < 0 { n + 1 + i } else { i };
            if (0..=n).contains(&r) {
                Ok(r as usize)
            } else {
                Err(EngineError::InvalidInput(format!(
                    "layer index {i} is out of range: this model has {n} layers, so indices go from \
                         {} to {n} (0 = embeddings, {n} = final normed output)",
                    -(n + 1)
                )))
            }
        })
        .collect()
}
