//! The batch budget: how many tokens one forward pass can hold in a device's free memory.

#[cfg(feature = "cuda")]
use super::{cuda, EngineOptions};
use super::{layers, DType, Device, ModelConfig};

/// How many tokens one forward pass can hold in `free_bytes` of device memory: a conservative
/// estimate of the activations per token (every layer kept as a tap, plus the working set of
/// the most demanding layer kind the model has: see [`ModelConfig::layer_bytes_per_token`])
/// plus, where the portable attention runs (not the CUDA kernels, which keep scores on chip), the
/// attention scores of one query chunk of the longest allowed input (f32 scores and
/// probabilities), using 80% of what is free, less the f32 logits of one chunk of rows going
/// through the output head for next-token log-probabilities
/// ([`super::logprobs::LOGITS_BUDGET_BYTES`]). Whether the CUDA attention kernels serve follows
/// this process's [`EngineOptions::startup`], as the models it loads do.
pub fn tokens_for_memory(
    cfg: &ModelConfig,
    device: &Device,
    dtype: DType,
    free_bytes: u64,
    max_input_tokens: usize,
) -> usize {
    let b = dtype.size_in_bytes() as u64;
    let h = cfg.hidden_size as u64;
    // Every index may be tapped (L + 1 states), kept in f32 (the residual stream on CUDA) and
    // stacked in the compute dtype, plus the previous batch's stack still being copied out; and
    // the working set of one layer.
    let taps = (cfg.num_hidden_layers as u64 + 1) * h * (4 + 2 * b);
    let layer = cfg.layers.iter().map(|l| cfg.layer_bytes_per_token(l, b)).max().unwrap_or(0);
    // Per-layer inputs: every layer's, for every token, from the table and the projection.
    let per_layer = cfg.per_layer_inputs.as_ref().map_or(0, |p| (p.layers * p.width) as u64 * (3 * b + 4));
    let per_token = taps + layer + per_layer + 8 * 2;
    // The CUDA attention kernels keep scores on chip; only the portable path holds them.
    #[cfg(feature = "cuda")]
    let on_chip = EngineOptions::startup().cuda_attention && cuda::attention::supported(device, dtype, cfg.head_dim);
    #[cfg(not(feature = "cuda"))]
    let on_chip = {
        let _ = device;
        false
    };
    let has_attention = !on_chip && cfg.layers.iter().any(|l| l.mixer.is_attention());
    let chunk = layers::sdpa::QUERY_CHUNK.min(max_input_tokens) as u64;
    let scores = if has_attention {
        cfg.num_attention_heads as u64 * chunk * max_input_tokens as u64 * (4 + 4 + b) * 2
    } else {
        0
    };
    let budget = (free_bytes as f64 * 0.8) as u64;
    let logits = super::logprobs::LOGITS_BUDGET_BYTES as u64;
    (budget.saturating_sub(scores + logits) / per_token.max(1)) as usize
}
