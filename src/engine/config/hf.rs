//! Reading a Hugging Face `config.json` into a [`ModelConfig`], for every supported family.
//! Anything the engine cannot reproduce exactly is a load error naming the field and value.

use serde_json::Value;

use super::{
    bad, DeepseekRouting, ExpertActivation, ExpertsLayout, Family, FfnKind, FullAttentionShape, GdnLayout, GroupScore,
    KeyIndexer, LayerSpec, LinearAttentionConfig, MixerKind, MlaConfig, ModelConfig, MoeConfig, PerLayerInputs,
    RopeScaling, Routing, ScoreFunction,
};
use crate::engine::EngineError;

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

/// `rope_parameters` (transformers 5) or `rope_scaling` (transformers 4), when an object.
fn rope_params(cfg: &Value) -> Option<&Value> {
    cfg.get("rope_parameters").filter(|v| v.is_object()).or_else(|| cfg.get("rope_scaling").filter(|v| v.is_object()))
}

/// gpt-oss's rotary parameters where its config.json gives none (transformers' defaults).
fn gpt_oss_default_rope() -> Value {
    serde_json::json!({
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": false,
        "original_max_position_embeddings": 4096
    })
}

/// Parses `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
fn parse_rope(cfg: &Value, family: Family) -> Result<(f64, Option<RopeScaling>), EngineError> {
    let default_params = (family == Family::GptOss).then(gpt_oss_default_rope);
    let params = rope_params(cfg).or(default_params.as_ref());
    let default_theta = if family == Family::GptOss { 150000.0 } else { 10000.0 };
    let theta =
        params.and_then(|p| opt_f64(p, "rope_theta")).or_else(|| opt_f64(cfg, "rope_theta")).unwrap_or(default_theta);
    let Some(p) = params else {
        return Ok((theta, None));
    };
    let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    let factor =
        || opt_f64(p, "factor").ok_or_else(|| bad(format!("config.json: rope type {kind:?} needs \"factor\"")));
    let scaling =
        match kind {
            "default" => None,
            "linear" => Some(RopeScaling::Linear { factor: factor()? }),
            "llama3" => Some(RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: opt_f64(p, "low_freq_factor").unwrap_or(1.0),
                high_freq_factor: opt_f64(p, "high_freq_factor").unwrap_or(4.0),
                original_max_position_embeddings: opt_f64(p, "original_max_position_embeddings")
                    .ok_or_else(|| bad("config.json: llama3 rope needs original_max_position_embeddings"))?,
            }),
            "yarn" if family == Family::GptOss || family.is_mla() => Some(yarn(cfg, p)?),
            "yarn" => return Err(bad(
                "config.json: rope type \"yarn\" is read for GptOssForCausalLM and the latent-attention families only \
                 (those its fidelity is tested on); supported for this architecture: default, linear, llama3",
            )),
            other => {
                return Err(bad(format!(
                    "config.json: rope type {other:?} is not supported (supported: default, linear, llama3; yarn for \
                 GptOssForCausalLM and the latent-attention families)"
                )))
            }
        };
    Ok((theta, scaling))
}

/// YaRN's parameters as transformers reads them: `original_max_position_embeddings` from the
/// top level or else `max_position_embeddings`, `factor` from their ratio when absent,
/// `beta_fast` and `beta_slow` 32 and 1 when absent or zero, `truncate` true when absent, and the
/// attention factor given, or from `mscale` and `mscale_all_dim`, or `0.1 ln(factor) + 1`.
fn yarn(cfg: &Value, p: &Value) -> Result<RopeScaling, EngineError> {
    let original = opt_f64(cfg, "original_max_position_embeddings")
        .or_else(|| opt_f64(p, "original_max_position_embeddings"))
        .or_else(|| opt_f64(cfg, "max_position_embeddings"))
        .ok_or_else(|| bad("config.json: yarn rope needs original_max_position_embeddings"))?;
    let factor = match opt_f64(p, "factor") {
        Some(f) => f,
        None => {
            opt_f64(cfg, "max_position_embeddings")
                .ok_or_else(|| bad("config.json: yarn rope needs \"factor\" or max_position_embeddings"))?
                / original
        }
    };
    let nonzero = |key: &str, default: f64| opt_f64(p, key).filter(|&v| v != 0.0).unwrap_or(default);
    let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let attention_factor = match (opt_f64(p, "attention_factor"), opt_f64(p, "mscale"), opt_f64(p, "mscale_all_dim")) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
        _ => mscale(factor, 1.0),
    };
    let scaling = RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: nonzero("beta_fast", 32.0),
        beta_slow: nonzero("beta_slow", 1.0),
        truncate: opt_bool(p, "truncate").unwrap_or(true),
        attention_factor,
    };
    let finite = [factor, original, attention_factor].iter().all(|v| v.is_finite() && *v > 0.0);
    if !finite {
        return Err(bad(format!("config.json: yarn rope parameters must be positive and finite, got {scaling:?}")));
    }
    Ok(scaling)
}

/// `partial_rotary_factor` from `rope_parameters` or the top level; the hybrids default to 0.25
/// as transformers does.
fn rotary_dim(cfg: &Value, family: Family, head_dim: usize) -> Result<usize, EngineError> {
    let default = if family.is_hybrid() { 0.25 } else { 1.0 };
    let factor = rope_params(cfg)
        .and_then(|p| opt_f64(p, "partial_rotary_factor"))
        .or_else(|| opt_f64(cfg, "partial_rotary_factor"))
        .unwrap_or(default);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(bad(format!("config.json: partial_rotary_factor {factor} must be in (0, 1]")));
    }
    // transformers: int(head_dim * partial_rotary_factor).
    Ok((head_dim as f64 * factor) as usize)
}

/// Layer kinds from `layer_types`; without it, for gpt-oss sliding and full layers in turn
/// (sliding first), for the hybrids every `full_attention_interval`-th layer (default 4) full.
fn mixers(cfg: &Value, family: Family, n: usize) -> Result<Vec<MixerKind>, EngineError> {
    if let Some(types) = cfg.get("layer_types").filter(|v| !v.is_null()) {
        let types = types.as_array().ok_or_else(|| bad("config.json: \"layer_types\" must be a list"))?;
        if types.len() != n {
            return Err(bad(format!(
                "config.json: \"layer_types\" has {} entries for num_hidden_layers {n}",
                types.len()
            )));
        }
        return types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("full_attention") => Ok(MixerKind::FullAttention),
                Some("linear_attention") if family.is_hybrid() => Ok(MixerKind::LinearAttention),
                Some("sliding_attention") if family == Family::GptOss => Ok(MixerKind::SlidingAttention),
                _ => Err(bad(format!(
                    "config.json: layer_types[{i}] = {t} is not supported for {family:?} (supported: \
                     \"full_attention\", and \"{}\")",
                    if family.is_hybrid() { "linear_attention" } else { "sliding_attention" }
                ))),
            })
            .collect();
    }
    if family == Family::GptOss {
        return Ok((0..n)
            .map(|i| if i % 2 == 0 { MixerKind::SlidingAttention } else { MixerKind::FullAttention })
            .collect());
    }
    let interval = opt_usize(cfg, "full_attention_interval").unwrap_or(4);
    if interval == 0 {
        return Err(bad("config.json: full_attention_interval must be positive"));
    }
    Ok((0..n)
        .map(|i| if (i + 1) % interval == 0 { MixerKind::FullAttention } else { MixerKind::LinearAttention })
        .collect())
}

fn linear_attention(cfg: &Value, family: Family) -> Result<LinearAttentionConfig, EngineError> {
    Ok(LinearAttentionConfig {
        num_key_heads: req_usize(cfg, "linear_num_key_heads")?,
        num_value_heads: req_usize(cfg, "linear_num_value_heads")?,
        key_head_dim: req_usize(cfg, "linear_key_head_dim")?,
        value_head_dim: req_usize(cfg, "linear_value_head_dim")?,
        conv_kernel: opt_usize(cfg, "linear_conv_kernel_dim").unwrap_or(4),
        layout: if family == Family::Qwen3Next { GdnLayout::Fused } else { GdnLayout::Separate },
    })
}

/// Which layers are sparse: every `decoder_sparse_step`-th unless listed in `mlp_only_layers`
/// (Qwen3-MoE, Qwen3-Next); Qwen3.5-MoE has experts in every layer.
fn ffns(cfg: &Value, family: Family, n: usize) -> Result<(Vec<FfnKind>, Option<MoeConfig>), EngineError> {
    // transformers writes Qwen3-MoE's count as `num_local_experts` (its attribute map); the
    // released checkpoints spell it `num_experts`.
    let experts = match family {
        Family::Qwen3Moe | Family::Qwen3Next | Family::Qwen3_5Moe => {
            opt_usize(cfg, "num_experts").or_else(|| opt_usize(cfg, "num_local_experts")).unwrap_or(0)
        }
        Family::GptOss => {
            return Ok((vec![FfnKind::Moe; n], Some(gpt_oss_moe(cfg)?)));
        }
        _ if family.is_mla() => return deepseek_ffns(cfg, family, n),
        _ => 0,
    };
    if experts == 0 {
        return Ok((vec![FfnKind::Dense; n], None));
    }
    let moe = MoeConfig {
        num_experts: experts,
        experts_per_token: req_usize(cfg, "num_experts_per_tok")?,
        expert_intermediate_size: req_usize(cfg, "moe_intermediate_size")?,
        shared_expert_intermediate_size: match family {
            Family::Qwen3Moe => None,
            _ => Some(req_usize(cfg, "shared_expert_intermediate_size")?).filter(|&s| s > 0),
        },
        norm_topk_prob: match family {
            Family::Qwen3_5Moe => true,
            Family::Qwen3Next => opt_bool(cfg, "norm_topk_prob").unwrap_or(true),
            _ => opt_bool(cfg, "norm_topk_prob").unwrap_or(false),
        },
        routing: Routing::SoftmaxTopK,
        router: "gate",
        router_bias: false,
        layout: ExpertsLayout::GateThenUp,
        expert_bias: false,
        activation: ExpertActivation::Silu,
        router_norm: false,
        deepseek: None,
        ungated_shared_experts: false,
    };
    if family == Family::Qwen3_5Moe {
        return Ok((vec![FfnKind::Moe; n], Some(moe)));
    }
    let step = opt_usize(cfg, "decoder_sparse_step").unwrap_or(1);
    if step == 0 {
        return Err(bad("config.json: decoder_sparse_step must be positive"));
    }
    let mlp_only: Vec<u64> = match cfg.get("mlp_only_layers").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .ok_or_else(|| bad(format!("config.json: \"mlp_only_layers\" must be a list of layer indices, got {v}")))?,
    };
    let kinds = (0..n)
        .map(|i| if !mlp_only.contains(&(i as u64)) && (i + 1) % step == 0 { FfnKind::Moe } else { FfnKind::Dense })
        .collect();
    Ok((kinds, Some(moe)))
}

/// gpt-oss's experts (every layer): `num_local_experts` (or `num_experts`) of
/// `intermediate_size`, a router with bias (`mlp.router`) whose k largest logits are
/// softmaxed, biased experts stored interleaved, the clamped SwiGLU (`swiglu_limit`,
/// `swiglu_alpha`; 7 and 1.702 by default, as transformers).
fn gpt_oss_moe(cfg: &Value) -> Result<MoeConfig, EngineError> {
    let limit = opt_f64(cfg, "swiglu_limit").unwrap_or(7.0);
    let alpha = opt_f64(cfg, "swiglu_alpha").unwrap_or(1.702);
    if !(limit.is_finite() && limit > 0.0 && alpha.is_finite()) {
        return Err(bad(format!(
            "config.json: swiglu_limit {limit} and swiglu_alpha {alpha} must be finite (the limit positive)"
        )));
    }
    Ok(MoeConfig {
        num_experts: opt_usize(cfg, "num_local_experts")
            .or_else(|| opt_usize(cfg, "num_experts"))
            .ok_or_else(|| bad("config.json: missing or non-integer field \"num_local_experts\""))?,
        experts_per_token: opt_usize(cfg, "num_experts_per_tok")
            .or_else(|| opt_usize(cfg, "experts_per_token"))
            .unwrap_or(4),
        expert_intermediate_size: req_usize(cfg, "intermediate_size")?,
        shared_expert_intermediate_size: None,
        norm_topk_prob: false,
        routing: Routing::TopKSoftmax,
        router: "router",
        router_bias: true,
        layout: ExpertsLayout::Interleaved,
        expert_bias: true,
        activation: ExpertActivation::ClampedSwiglu { limit, alpha },
        router_norm: false,
        deepseek: None,
        ungated_shared_experts: false,
    })
}

/// A field as a float, or `default` where absent (null counts as absent only where `null_ok`).
fn f64_or(cfg: &Value, key: &str, default: f64) -> Result<f64, EngineError> {
    match cfg.get(key) {
        None => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| bad(format!("config.json: {key:?} must be a number, got {v}"))),
    }
}

fn usize_or(cfg: &Value, key: &str, default: usize) -> Result<usize, EngineError> {
    match cfg.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| bad(format!("config.json: {key:?} must be a non-negative integer, got {v}"))),
    }
}

/// A string field that, where present, must be one of `allowed` (what transformers builds).
fn check_str(cfg: &Value, key: &str, allowed: &[&str], family: Family) -> Result<Option<String>, EngineError> {
    match cfg.get(key).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => match v.as_str() {
            Some(s) if allowed.contains(&s) => Ok(Some(s.to_string())),
            _ => Err(bad(format!(
                "config.json: {key} = {v} is not supported for {family:?} (supported: {})",
                allowed.join(", ")
            ))),
        },
    }
}

/// DeepSeek-style feed-forward blocks: dense MLPs (`intermediate_size`) in the first
/// `first_k_dense_replace` layers (GLM-4.7-Flash: where `mlp_layer_types` says "dense"), then
/// `n_routed_experts` experts of `moe_intermediate_size` with `n_shared_experts` shared ones as
/// one MLP, routed as [`DeepseekRouting`] says, with transformers' defaults for each family.
fn deepseek_ffns(cfg: &Value, family: Family, n: usize) -> Result<(Vec<FfnKind>, Option<MoeConfig>), EngineError> {
    let v2 = family == Family::DeepseekV2;
    let kinds: Vec<FfnKind> = if family == Family::Glm4MoeLite || family.is_sparse_attention() {
        // Without mlp_layer_types, GLM-4.7-Flash's first layer is dense; DeepSeek-V3.2's and
        // GLM-5's first first_k_dense_replace (3 by default), as their configs derive the list.
        let dense = if family == Family::Glm4MoeLite { 1 } else { usize_or(cfg, "first_k_dense_replace", 3)? };
        let kinds = match cfg.get("mlp_layer_types").filter(|v| !v.is_null()) {
            None => (0..n).map(|i| if i < dense { FfnKind::Dense } else { FfnKind::Moe }).collect::<Vec<_>>(),
            Some(v) => {
                let a = v.as_array().filter(|a| a.len() == n).ok_or_else(|| {
                    bad(format!("config.json: \"mlp_layer_types\" must list num_hidden_layers ({n}) entries, got {v}"))
                })?;
                a.iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        Some("dense") => Ok(FfnKind::Dense),
                        Some("sparse") => Ok(FfnKind::Moe),
                        _ => Err(bad(format!(
                            "config.json: mlp_layer_types[{i}] = {t} is not supported (\"dense\" or \"sparse\")"
                        ))),
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        // transformers builds GLM-4.7-Flash's layers from mlp_layer_types alone; a
        // first_k_dense_replace that says otherwise leaves the checkpoint ambiguous.
        if let Some(k) = opt_usize(cfg, "first_k_dense_replace") {
            let agrees = kinds.iter().enumerate().all(|(i, f)| (*f == FfnKind::Dense) == (i < k));
            if !agrees {
                return Err(bad(format!(
                    "config.json: first_k_dense_replace = {k} disagrees with the dense/sparse layers of \
                     mlp_layer_types (transformers builds the latter); refused as ambiguous"
                )));
            }
        }
        kinds
    } else {
        let k = usize_or(cfg, "first_k_dense_replace", if v2 { 0 } else { 3 })?;
        if let Some(freq) = cfg.get("moe_layer_freq").filter(|v| !v.is_null()) {
            if freq.as_u64() != Some(1) {
                return Err(bad(format!(
                    "config.json: moe_layer_freq = {freq} is not supported (only 1: every layer from \
                     first_k_dense_replace on has experts, as transformers builds it)"
                )));
            }
        }
        (0..n).map(|i| if i >= k { FfnKind::Moe } else { FfnKind::Dense }).collect()
    };
    if v2 && opt_bool(cfg, "mlp_bias") == Some(true) {
        return Err(bad("config.json: mlp_bias = true is not supported for DeepseekV2ForCausalLM"));
    }
    let experts = req_usize(cfg, "n_routed_experts")?;
    let shared = usize_or(cfg, "n_shared_experts", if v2 { 2 } else { 1 })?;
    let inter = req_usize(cfg, "moe_intermediate_size")?;
    let routing = if v2 {
        check_str(cfg, "scoring_func", &["softmax"], family)?;
        if opt_bool(cfg, "norm_topk_prob") == Some(true) {
            return Err(bad(
                "config.json: norm_topk_prob = true is not supported for DeepseekV2ForCausalLM (transformers ignores \
                 it, DeepSeek's own code renormalises: the two disagree)",
            ));
        }
        let method = check_str(cfg, "topk_method", &["greedy", "group_limited_greedy"], family)?;
        let groups = match method.as_deref().unwrap_or("greedy") {
            "greedy" => None,
            _ => Some((req_usize(cfg, "n_group")?, req_usize(cfg, "topk_group")?, GroupScore::Max)),
        };
        DeepseekRouting {
            scores: ScoreFunction::Softmax,
            correction_bias: false,
            groups,
            routed_scaling_factor: f64_or(cfg, "routed_scaling_factor", 1.0)?,
        }
    } else {
        check_str(cfg, "scoring_func", &["sigmoid"], family)?;
        check_str(cfg, "topk_method", &["noaux_tc"], family)?;
        // transformers' defaults: one group for the GLMs, 8 of which 4 kept for DeepSeek.
        let one_group = matches!(family, Family::Glm4MoeLite | Family::GlmMoeDsa);
        DeepseekRouting {
            scores: ScoreFunction::Sigmoid,
            correction_bias: true,
            groups: Some((
                usize_or(cfg, "n_group", if one_group { 1 } else { 8 })?,
                usize_or(cfg, "topk_group", if one_group { 1 } else { 4 })?,
                GroupScore::TopTwoSum,
            )),
            routed_scaling_factor: f64_or(
                cfg,
                "routed_scaling_factor",
                if family == Family::Glm4MoeLite { 1.8 } else { 2.5 },
            )?,
        }
    };
    let moe = MoeConfig {
        num_experts: experts,
        experts_per_token: opt_usize(cfg, "num_experts_per_tok")
            .ok_or_else(|| bad("config.json: missing or non-integer field \"num_experts_per_tok\""))?,
        expert_intermediate_size: inter,
        shared_expert_intermediate_size: Some(shared * inter).filter(|&s| s > 0),
        norm_topk_prob: !v2 && opt_bool(cfg, "norm_topk_prob").unwrap_or(true),
        routing: Routing::Deepseek,
        router: "gate",
        router_bias: false,
        layout: ExpertsLayout::GateThenUp,
        expert_bias: false,
        activation: ExpertActivation::Silu,
        router_norm: false,
        deepseek: Some(routing),
        ungated_shared_experts: true,
    };
    Ok((kinds, Some(moe)))
}

/// Multi-head latent attention's shape ([`MlaConfig`]), refusing what transformers would build
/// differently: biased attention projections, a partial rotary factor, V2 with
/// `rope_interleave` off (its rotation is always DeepSeek's interleaved one).
fn mla(cfg: &Value, family: Family) -> Result<MlaConfig, EngineError> {
    if opt_bool(cfg, "attention_bias") == Some(true) {
        return Err(bad(format!("config.json: attention_bias = true is not supported for {family:?}")));
    }
    let q_lora_rank = match cfg.get("q_lora_rank") {
        None => return Err(bad("config.json: missing field \"q_lora_rank\" (null for a plain q_proj)")),
        Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("config.json: q_lora_rank must be an integer, got {v}")))?,
        ),
    };
    if let Some(f) = rope_params(cfg)
        .and_then(|p| opt_f64(p, "partial_rotary_factor"))
        .or_else(|| opt_f64(cfg, "partial_rotary_factor"))
    {
        if f != 1.0 {
            return Err(bad(format!(
                "config.json: partial_rotary_factor {f} is not supported for {family:?} (only 1: all \
                 qk_rope_head_dim dimensions rotate)"
            )));
        }
    }
    let rope_interleaved = match family {
        Family::DeepseekV2 | Family::DeepseekV32 | Family::GlmMoeDsa => {
            if opt_bool(cfg, "rope_interleave") == Some(false) {
                return Err(bad(format!(
                    "config.json: rope_interleave = false is not supported for {family:?} (transformers always \
                     rotates its interleaved pairs)"
                )));
            }
            true
        }
        _ => opt_bool(cfg, "rope_interleave").unwrap_or(true),
    };
    let indexer = if family.is_sparse_attention() {
        if q_lora_rank.is_none() {
            return Err(bad(format!(
                "config.json: q_lora_rank = null is not supported for {family:?} (transformers always builds its \
                 low-rank queries, which its indexer reads)"
            )));
        }
        Some(KeyIndexer {
            topk: usize_or(cfg, "index_topk", 2048)?,
            heads: usize_or(cfg, "index_n_heads", if family == Family::GlmMoeDsa { 32 } else { 64 })?,
            head_dim: usize_or(cfg, "index_head_dim", 128)?,
        })
    } else {
        None
    };
    if indexer.as_ref().is_some_and(|i| i.topk == 0) {
        return Err(bad("config.json: index_topk must be positive"));
    }
    let qk_nope_head_dim = req_usize(cfg, "qk_nope_head_dim")?;
    let qk_rope_head_dim = req_usize(cfg, "qk_rope_head_dim")?;
    let mut softmax_scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
    if let Some(p) = rope_params(cfg) {
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        let all_dim = opt_f64(p, "mscale_all_dim").unwrap_or(0.0);
        if kind != "default" && all_dim != 0.0 {
            let factor = opt_f64(p, "factor").ok_or_else(|| bad("config.json: mscale_all_dim needs \"factor\""))?;
            let m = if factor <= 1.0 { 1.0 } else { 0.1 * all_dim * factor.ln() + 1.0 };
            softmax_scale = softmax_scale * m * m;
        }
    }
    Ok(MlaConfig {
        q_lora_rank,
        kv_lora_rank: req_usize(cfg, "kv_lora_rank")?,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim: req_usize(cfg, "v_head_dim")?,
        rope_interleaved,
        softmax_scale,
        indexer,
    })
}

/// Gemma 4's text decoder (`Gemma4ForCausalLM`, or the `text_config` of
/// `Gemma4ForConditionalGeneration`), read with transformers' defaults: sliding and full layers
/// from `layer_types` (5:1 by default, the last layer full), full layers with `global_head_dim`
/// (512 by default) and, when `attention_k_eq_v`, `num_global_key_value_heads` (or as
/// `per_layer_config` gives them), default rotary on sliding layers and proportional rotary on
/// full ones, norms in f32 with plain weights, sandwich norms, GELU-tanh, the experts beside the
/// MLP when `enable_moe_block`; per-layer embeddings (`hidden_size_per_layer_input`, 256 by
/// default) and key-value sharing of the last `num_kv_shared_layers` layers (each reuses the last
/// earlier layer of its kind that computes its own, their MLPs twice as wide when
/// `use_double_wide_mlp`), as E2B and E4B have them.
fn gemma4(root: &Value, cfg: &Value, architecture: String) -> Result<ModelConfig, EngineError> {
    let family = Family::Gemma4;
    let refuse = |what: String| Err(unsupported(&architecture, what));
    match cfg.get("use_bidirectional_attention").filter(|v| !v.is_null()) {
        None => {}
        // Bidirectional among vision tokens only: text is causal.
        Some(v) if v.as_str() == Some("vision") => {}
        Some(v) => return refuse(format!("use_bidirectional_attention {v}")),
    }
    if let Some(act) = cfg.get("hidden_activation").and_then(Value::as_str) {
        if act != "gelu_pytorch_tanh" {
            return refuse(format!("hidden_activation {act:?} (supported: \"gelu_pytorch_tanh\")"));
        }
    }
    let hidden_size = req_usize(cfg, "hidden_size")?;
    let num_attention_heads = req_usize(cfg, "num_attention_heads")?;
    let num_key_value_heads = opt_usize(cfg, "num_key_value_heads").unwrap_or(num_attention_heads);
    let head_dim = opt_usize(cfg, "head_dim").unwrap_or(256);
    let n = req_usize(cfg, "num_hidden_layers")?;
    let mut mixers = match cfg.get("layer_types").filter(|v| !v.is_null()) {
        None => (0..n)
            .map(|i| if (i + 1) % 6 == 0 { MixerKind::FullAttention } else { MixerKind::SlidingAttention })
            .collect(),
        Some(types) => {
            let types = types.as_array().ok_or_else(|| bad("config.json: \"layer_types\" must be a list"))?;
            if types.len() != n {
                return Err(bad(format!(
                    "config.json: \"layer_types\" has {} entries for num_hidden_layers {n}",
                    types.len()
                )));
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("full_attention") => Ok(MixerKind::FullAttention),
                    Some("sliding_attention") => Ok(MixerKind::SlidingAttention),
                    _ => Err(bad(format!(
                        "config.json: layer_types[{i}] = {t} is not supported for {architecture} (supported: \
                         \"full_attention\", \"sliding_attention\")"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    // transformers forces the last layer to full attention.
    if let Some(last) = mixers.last_mut() {
        *last = MixerKind::FullAttention;
    }
    // Rotary parameters per layer type.
    let rope = cfg.get("rope_parameters").filter(|v| !v.is_null());
    let rope_of = |kind: &str| -> Result<Option<&Value>, EngineError> {
        match rope {
            None => Ok(None),
            Some(r) => match r.get(kind) {
                Some(p) if p.is_object() => Ok(Some(p)),
                Some(p) if p.is_null() => Ok(None),
                None => Ok(None),
                Some(p) => Err(bad(format!("config.json: rope_parameters.{kind} must be an object, got {p}"))),
            },
        }
    };
    let rope_type = |p: Option<&Value>, default: &'static str| -> String {
        p.and_then(|p| p.get("rope_type")).and_then(Value::as_str).unwrap_or(default).to_string()
    };
    let sliding_rope = rope_of("sliding_attention")?;
    if rope_type(sliding_rope, "default") != "default" {
        return refuse(format!(
            "rope_parameters.sliding_attention.rope_type {:?} (supported: \"default\")",
            rope_type(sliding_rope, "default")
        ));
    }
    let rope_theta = sliding_rope.and_then(|p| opt_f64(p, "rope_theta")).unwrap_or(10_000.0);
    let full_rope = rope_of("full_attention")?;
    // transformers' defaults where rope_parameters is absent.
    let full_kind = if rope.is_none() { "proportional".to_string() } else { rope_type(full_rope, "default") };
    let full_theta =
        full_rope.and_then(|p| opt_f64(p, "rope_theta")).unwrap_or(if rope.is_none() { 1_000_000.0 } else { 10_000.0 });
    // Full layers' head size and key-value heads: `per_layer_config` (written by newer
    // transformers) or `global_head_dim` and `num_global_key_value_heads`.
    let k_eq_v = opt_bool(cfg, "attention_k_eq_v").unwrap_or(false);
    let (mut full_hd, mut full_kv) = (opt_usize(cfg, "global_head_dim").unwrap_or(512), None);
    if k_eq_v {
        full_kv = opt_usize(cfg, "num_global_key_value_heads");
    }
    if let Some(per_layer) = cfg.get("per_layer_config").filter(|v| !v.is_null()) {
        let per_layer =
            per_layer.as_object().ok_or_else(|| bad("config.json: \"per_layer_config\" must be an object"))?;
        let (mut hd, mut kv) = (None, None);
        for (i, kind) in mixers.iter().enumerate() {
            let entry = per_layer.get(&i.to_string());
            if *kind == MixerKind::SlidingAttention {
                if entry.is_some_and(|e| e.as_object().is_some_and(|o| !o.is_empty())) {
                    return refuse(format!("per_layer_config for sliding layer {i}"));
                }
                continue;
            }
            let e = entry.and_then(Value::as_object).cloned().unwrap_or_default();
            if let Some(k) = e.keys().find(|k| !matches!(k.as_str(), "head_dim" | "num_key_value_heads")) {
                return refuse(format!("per_layer_config[{i}].{k}"));
            }
            let this =
                (e.get("head_dim").and_then(Value::as_u64), e.get("num_key_value_heads").and_then(Value::as_u64));
            if hd.is_some_and(|h| (h, kv) != this) {
                return refuse(format!("per_layer_config[{i}] differing from the other full-attention layers"));
            }
            (hd, kv) = (Some(this.0), this.1);
        }
        full_hd = hd.flatten().map_or(head_dim, |h| h as usize);
        full_kv = kv.map(|k| k as usize);
    }
    let full_kv = full_kv.unwrap_or(num_key_value_heads);
    let (rotated_pairs, rope_factor) = match full_kind.as_str() {
        "default" => (full_hd / 2, 1.0),
        "proportional" => {
            let p = opt_f64_in(full_rope, "partial_rotary_factor").unwrap_or(if rope.is_none() { 0.25 } else { 1.0 });
            if !(p > 0.0 && p <= 1.0) {
                return refuse(format!("rope_parameters.full_attention.partial_rotary_factor {p}"));
            }
            // transformers: int(partial_rotary_factor * head_dim // 2).
            (((p * full_hd as f64) / 2.0).floor() as usize, opt_f64_in(full_rope, "factor").unwrap_or(1.0))
        }
        other => {
            return refuse(format!(
                "rope_parameters.full_attention.rope_type {other:?} (supported: \"proportional\", \"default\")"
            ))
        }
    };
    let (kv_sources, mlp_widths) = kv_sharing(cfg, &mixers, &architecture)?;
    let per_layer_inputs = per_layer_inputs(cfg, n, hidden_size, &architecture)?;
    let moe_on = opt_bool(cfg, "enable_moe_block").unwrap_or(false);
    let moe = if moe_on {
        Some(MoeConfig {
            num_experts: req_usize(cfg, "num_experts")?,
            experts_per_token: req_usize(cfg, "top_k_experts")?,
            expert_intermediate_size: req_usize(cfg, "moe_intermediate_size")?,
            shared_expert_intermediate_size: None,
            norm_topk_prob: true,
            routing: Routing::SoftmaxTopK,
            router: "router.proj",
            router_bias: false,
            layout: ExpertsLayout::GateThenUp,
            expert_bias: false,
            activation: ExpertActivation::GeluTanh,
            router_norm: true,
            deepseek: None,
            ungated_shared_experts: false,
        })
    } else {
        None
    };
    let ffn = if moe_on { FfnKind::DenseAndMoe } else { FfnKind::Dense };
    let layers = mixers.into_iter().map(|mixer| LayerSpec { mixer, ffn }).collect();
    let softcap = opt_f64(cfg, "final_logit_softcapping").or_else(|| opt_f64(root, "final_logit_softcapping"));
    if softcap.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
        return refuse(format!("final_logit_softcapping {softcap:?}"));
    }
    let attention_bias = opt_bool(cfg, "attention_bias").unwrap_or(false);
    let c = ModelConfig {
        architecture,
        family,
        hidden_size,
        intermediate_size: req_usize(cfg, "intermediate_size")?,
        num_hidden_layers: n,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rotary_dim: head_dim,
        vocab_size: req_usize(cfg, "vocab_size")?,
        rms_norm_eps: opt_f64(cfg, "rms_norm_eps").unwrap_or(1e-6),
        rope_theta,
        rope_scaling: None,
        max_position_embeddings: opt_usize(cfg, "max_position_embeddings").unwrap_or(131_072),
        sliding_window: Some(opt_usize(cfg, "sliding_window").unwrap_or(512)),
        attention_sinks: false,
        qkv_bias: attention_bias,
        o_bias: attention_bias,
        mlp_bias: false,
        qk_norm: true,
        zero_centred_norms: false,
        f32_norms: true,
        attn_output_gate: false,
        full_attention: Some(FullAttentionShape {
            head_dim: full_hd,
            num_key_value_heads: full_kv,
            k_eq_v,
            rope_theta: full_theta,
            rotated_pairs,
            rope_factor,
        }),
        v_norm: true,
        attention_scale: Some(1.0),
        sandwich_norms: true,
        embed_scale: Some((hidden_size as f64).sqrt()),
        mlp_activation: ExpertActivation::GeluTanh,
        final_logit_softcapping: softcap,
        tie_word_embeddings: opt_bool(root, "tie_word_embeddings")
            .or_else(|| opt_bool(cfg, "tie_word_embeddings"))
            .unwrap_or(true),
        linear_attention: None,
        mla: None,
        mtp_layers: 0,
        moe,
        layers,
        mlp_widths,
        kv_sources,
        per_layer_inputs,
        quantization: None,
    };
    c.validate()?;
    Ok(c)
}

/// A config value of `architecture` that layertap does not build, by name.
fn unsupported(architecture: &str, what: String) -> EngineError {
    bad(format!("config.json: {what} is not supported for {architecture} yet"))
}

/// Gemma 4's key-value sharing as transformers builds it: the last `num_kv_shared_layers` layers
/// reuse the keys and values of the last layer before them of the same kind (a kind with none is
/// refused, as transformers refuses it, and so is sharing in every layer); with
/// `use_double_wide_mlp`, those layers' MLPs are `2 * intermediate_size` wide. Returns the sources
/// and the MLP widths per layer (both empty without sharing).
fn kv_sharing(
    cfg: &Value,
    mixers: &[MixerKind],
    architecture: &str,
) -> Result<(Vec<Option<usize>>, Vec<usize>), EngineError> {
    let n = mixers.len();
    let shared = usize_or(cfg, "num_kv_shared_layers", 0)?;
    if shared == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let Some(first) = n.checked_sub(shared).filter(|&f| f > 0) else {
        return Err(unsupported(
            architecture,
            format!(
                "num_kv_shared_layers {shared} of {n} layers (no layer is left to compute the keys and values the \
                 others would reuse)"
            ),
        ));
    };
    let mut sources = vec![None; n];
    for i in first..n {
        match (0..first).rev().find(|&j| mixers[j] == mixers[i]) {
            Some(j) => sources[i] = Some(j),
            None => {
                return Err(unsupported(
                    architecture,
                    format!(
                        "num_kv_shared_layers {shared} (layer {i}, {:?}, has no earlier layer of its kind whose keys \
                         and values it could reuse)",
                        mixers[i]
                    ),
                ))
            }
        }
    }
    let widths = match opt_bool(cfg, "use_double_wide_mlp").unwrap_or(false) {
        true => {
            let inter = req_usize(cfg, "intermediate_size")?;
            (0..n).map(|i| if i >= first { 2 * inter } else { inter }).collect()
        }
        false => Vec::new(),
    };
    Ok((sources, widths))
}

/// Gemma 4's per-layer embeddings: `hidden_size_per_layer_input` (absent: transformers'
/// default, 256; null or 0: none) wide, a table of `vocab_size_per_layer_input` rows (262,144 by
/// default), scaled by its width's square root; the projection scaled by `hidden_size^-1/2`, the
/// sum by `2^-1/2`; GELU-tanh after each layer's gate.
fn per_layer_inputs(
    cfg: &Value,
    n: usize,
    hidden_size: usize,
    architecture: &str,
) -> Result<Option<PerLayerInputs>, EngineError> {
    let width = match cfg.get("hidden_size_per_layer_input") {
        None => 256,
        Some(Value::Null) => 0,
        Some(v) => match v.as_u64() {
            Some(w) => w as usize,
            None => return Err(unsupported(architecture, format!("hidden_size_per_layer_input {v}"))),
        },
    };
    if width == 0 {
        return Ok(None);
    }
    Ok(Some(PerLayerInputs {
        width,
        vocab_size: usize_or(cfg, "vocab_size_per_layer_input", 262_144)?,
        layers: n,
        embed_scale: (width as f64).sqrt(),
        projection_scale: (hidden_size as f64).powf(-0.5),
        combine_scale: 2f64.powf(-0.5),
        activation: ExpertActivation::GeluTanh,
    }))
}

fn opt_f64_in(p: Option<&Value>, key: &str) -> Option<f64> {
    p.and_then(|p| opt_f64(p, key))
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json` value. Multimodal wrappers keep the decoder's fields
    /// under `text_config`; only the text model is read.
    pub fn from_hf_json(root: &Value) -> Result<Self, EngineError> {
        let architecture = root
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| bad("config.json: missing \"architectures\""))?
            .to_string();
        let family = Family::from_architecture(&architecture)?;
        let cfg = match root.get("text_config").filter(|v| v.is_object()) {
            Some(text) if matches!(family, Family::Qwen3_5 | Family::Qwen3_5Moe | Family::Gemma4) => text,
            _ => root,
        };
        // Declared beside or inside text_config, whatever the family.
        let text = root.get("text_config").filter(|v| v.is_object()).unwrap_or(root);
        let quantization = super::quant::parse(&[root, text])?;
        if let Some(q) = &quantization {
            super::quant::check_family(q, family, &architecture)?;
        }
        if family == Family::Gemma4 {
            return gemma4(root, cfg, architecture);
        }
        let hidden_size = req_usize(cfg, "hidden_size")?;
        let num_attention_heads = req_usize(cfg, "num_attention_heads")?;
        let num_key_value_heads = opt_usize(cfg, "num_key_value_heads").unwrap_or(num_attention_heads);
        let mla = if family.is_mla() { Some(mla(cfg, family)?) } else { None };
        // Latent attention: every query head has a key and value of its own after the expansion.
        if mla.is_some() && num_key_value_heads != num_attention_heads {
            return Err(bad(format!(
                "config.json: num_key_value_heads {num_key_value_heads} is not supported for {architecture} (latent \
                 attention expands keys and values for every one of the {num_attention_heads} heads; transformers \
                 builds no other grouping for it)"
            )));
        }
        let head_dim = match &mla {
            Some(m) => m.qk_nope_head_dim + m.qk_rope_head_dim,
            None => opt_usize(cfg, "head_dim").unwrap_or(hidden_size / num_attention_heads.max(1)),
        };
        if let Some(act) = cfg.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(bad(format!("config.json: hidden_act {act:?} is not supported (only silu)")));
            }
        }
        let (rope_theta, rope_scaling) = parse_rope(cfg, family)?;
        let sliding_window = match family {
            Family::Mistral => opt_usize(cfg, "sliding_window"),
            Family::GptOss => Some(opt_usize(cfg, "sliding_window").unwrap_or(128)),
            Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe if opt_bool(cfg, "use_sliding_window") == Some(true) => {
                return Err(bad("config.json: use_sliding_window=true is not supported for Qwen models"))
            }
            _ => None,
        };
        if family.is_hybrid() && opt_bool(cfg, "attn_output_gate") == Some(false) {
            return Err(bad(
                "config.json: attn_output_gate=false is not supported (transformers always gates these models' \
                 attention output)",
            ));
        }
        let attention_bias = opt_bool(cfg, "attention_bias").unwrap_or(family == Family::GptOss);
        let (qkv_bias, o_bias) = match family {
            Family::Qwen2 => (true, false),
            Family::Mistral => (false, false),
            _ => (attention_bias, attention_bias),
        };
        let n = req_usize(cfg, "num_hidden_layers")?;
        let mixer_kinds = match family {
            _ if family.is_hybrid() || family == Family::GptOss => mixers(cfg, family, n)?,
            // Mistral's window applies to every layer.
            Family::Mistral if sliding_window.is_some() => vec![MixerKind::SlidingAttention; n],
            _ if family.is_mla() => vec![MixerKind::LatentAttention; n],
            _ => vec![MixerKind::FullAttention; n],
        };
        let (ffn_kinds, moe) = ffns(cfg, family, n)?;
        let layers = mixer_kinds.into_iter().zip(ffn_kinds).map(|(mixer, ffn)| LayerSpec { mixer, ffn }).collect();
        let dense_needed = !matches!(family, Family::Qwen3_5Moe | Family::GptOss);
        let c = ModelConfig {
            architecture,
            family,
            hidden_size,
            intermediate_size: if dense_needed {
                req_usize(cfg, "intermediate_size")?
            } else if family == Family::GptOss {
                // Every layer's experts are `intermediate_size` wide; there is no dense MLP.
                0
            } else {
                opt_usize(cfg, "intermediate_size").unwrap_or(0)
            },
            num_hidden_layers: n,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rotary_dim: match &mla {
                Some(m) => m.qk_rope_head_dim,
                None => rotary_dim(cfg, family, head_dim)?,
            },
            vocab_size: req_usize(cfg, "vocab_size")?,
            rms_norm_eps: opt_f64(cfg, "rms_norm_eps").unwrap_or(match family {
                Family::GptOss | Family::Glm4MoeLite | Family::GlmMoeDsa => 1e-5,
                _ => 1e-6,
            }),
            rope_theta,
            rope_scaling,
            max_position_embeddings: opt_usize(cfg, "max_position_embeddings").unwrap_or(4096),
            sliding_window,
            attention_sinks: family == Family::GptOss,
            qkv_bias,
            o_bias,
            mlp_bias: family == Family::Llama && opt_bool(cfg, "mlp_bias").unwrap_or(false),
            qk_norm: !matches!(family, Family::Llama | Family::Mistral | Family::Qwen2 | Family::GptOss)
                && !family.is_mla(),
            zero_centred_norms: family.is_hybrid(),
            f32_norms: family == Family::GptOss,
            attn_output_gate: family.is_hybrid(),
            full_attention: None,
            v_norm: false,
            attention_scale: None,
            sandwich_norms: false,
            embed_scale: None,
            mlp_activation: ExpertActivation::Silu,
            final_logit_softcapping: None,
            tie_word_embeddings: opt_bool(root, "tie_word_embeddings")
                .or_else(|| opt_bool(cfg, "tie_word_embeddings"))
                .unwrap_or(false),
            linear_attention: if family.is_hybrid() { Some(linear_attention(cfg, family)?) } else { None },
            mla,
            mlp_widths: Vec::new(),
            kv_sources: Vec::new(),
            per_layer_inputs: None,
            mtp_layers: match family {
                Family::DeepseekV3 | Family::Glm4MoeLite | Family::DeepseekV32 | Family::GlmMoeDsa => {
                    opt_usize(cfg, "num_nextn_predict_layers").or_else(|| opt_usize(cfg, "num_mtp_layers")).unwrap_or(0)
                }
                _ => 0,
            },
            moe,
            layers,
            quantization,
        };
        c.validate()?;
        Ok(c)
    }
}
