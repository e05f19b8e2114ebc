//! Quantised checkpoints: which `quantization_config` the engine reads exactly, and a refusal
//! naming the method for every other. A checkpoint read with the wrong arithmetic returns hidden
//! states that look plausible and are wrong, so nothing here is guessed.

use serde_json::Value;

use super::bad;
use crate::engine::EngineError;

/// The `quant_method`s the safetensors loader implements, with their schemes. None yet: every
/// safetensors checkpoint is read as float32, float16 or bfloat16 weights (GGUF files carry their
/// own quantised types, which the GGUF loader dequantises).
pub const SUPPORTED_QUANTIZATION: &[&str] = &[];

/// The config keys under which checkpoints declare their quantisation (`compression_config` is
/// compressed-tensors' older name).
const KEYS: &[&str] = &["quantization_config", "compression_config"];

/// The fields that tell one scheme of a method from another, reported in the refusal.
const DETAIL_FIELDS: &[&str] = &[
    "fmt",
    "format",
    "activation_scheme",
    "weight_block_size",
    "bits",
    "group_size",
    "load_in_4bit",
    "load_in_8bit",
    "bnb_4bit_quant_type",
];

/// Refuses a config (the root or its `text_config`) that declares a quantisation the engine does
/// not implement, naming the method, its scheme and what is supported.
pub fn check(configs: &[&Value]) -> Result<(), EngineError> {
    for cfg in configs {
        for key in KEYS {
            let Some(q) = cfg.get(*key).filter(|v| !v.is_null()) else {
                continue;
            };
            let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unnamed");
            let details: Vec<String> = DETAIL_FIELDS
                .iter()
                .filter_map(|f| q.get(*f).filter(|v| !v.is_null()).map(|v| format!("{f} {v}")))
                .collect();
            let scheme = if details.is_empty() { String::new() } else { format!(" ({})", details.join(", ")) };
            let supported = if SUPPORTED_QUANTIZATION.is_empty() {
                "none yet: layertap reads unquantised safetensors checkpoints (float32, float16 or bfloat16 \
                 weights) and GGUF files"
                    .to_string()
            } else {
                SUPPORTED_QUANTIZATION.join(", ")
            };
            return Err(bad(format!(
                "config.json: {key}.quant_method {method:?}{scheme} is not supported, and reading its weights as \
                 unquantised would return wrong hidden states; supported quantisation: {supported}. Use the \
                 model's unquantised (bf16) release"
            )));
        }
    }
    Ok(())
}
