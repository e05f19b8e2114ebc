//! Quantised checkpoints: which `quantization_config` the engine reads exactly, and a refusal
//! naming the method for every other. A checkpoint read with the wrong arithmetic returns hidden
//! states that look plausible and are wrong, so nothing here is guessed.

use serde::Serialize;
use serde_json::Value;

use super::{bad, Family};
use crate::engine::EngineError;

/// Side of the square weight blocks of the one FP8 scheme read, and the width of the groups its
/// activations are quantised in along the input dimension.
pub const FP8_BLOCK: usize = 128;

/// What the safetensors loader reads besides float32, float16 and bfloat16 weights, as the
/// refusal of every other scheme names it (GGUF files carry their own quantised types, which the
/// GGUF loader dequantises).
pub const SUPPORTED_QUANTIZATION: &str = "quant_method \"fp8\" with fmt \"e4m3\", activation_scheme \"dynamic\" and \
     weight_block_size [128, 128] (Qwen's and DeepSeek-V3's block-wise FP8 releases); quant_method \"mxfp4\" for the experts of \
     GptOssForCausalLM (its released checkpoints)";

/// A scheme a float checkpoint's projections can be quantised to at load (`--quantize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Quantize {
    /// Qwen's block-wise FP8: e4m3 weights in 128x128 blocks, dynamic per-token activations.
    Fp8,
}

impl Quantize {
    /// The flag as written on the command line.
    pub fn flag(self) -> &'static str {
        match self {
            Quantize::Fp8 => "--quantize fp8",
        }
    }

    /// The scheme the loader applies.
    pub fn scheme(self) -> Quantization {
        match self {
            Quantize::Fp8 => Quantization::Fp8AtLoad,
        }
    }
}

/// A quantisation scheme the engine implements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "method", rename_all = "snake_case")]
pub enum Quantization {
    /// Qwen's block-wise FP8 (W8A8 dynamic): a quantised projection holds an `F8_E4M3` weight
    /// `[N, K]` and its `weight_scale_inv` `[ceil(N/128), ceil(K/128)]` (a multiplier per
    /// 128 x 128 block); its input is quantised per token in groups of 128 along K with the scale
    /// `max(amax, 1e-10) / 448`. Which projections are quantised is read from the file, tensor by
    /// tensor; `modules_to_not_convert` is the config's list of those kept unquantised, checked
    /// against it.
    Fp8Block { modules_to_not_convert: Vec<String> },
    /// The same arithmetic on a float checkpoint whose projections are quantised as they are
    /// loaded (`--quantize fp8`): the projections [`quantised_at_load`] names, whose input
    /// features are a multiple of 128, become FP8 projections with the releases' block scheme
    /// (`layers::fp8::quantise_weight`); every other tensor is read as it is stored.
    Fp8AtLoad,
    /// gpt-oss's released MXFP4 experts: `experts.gate_up_proj` and `experts.down_proj` stored as
    /// `*_blocks` (uint8 `[E, out, in / 32, 16]`, two e2m1 values a byte, the low nibble first)
    /// and `*_scales` (uint8 `[E, out, in / 32]`, E8M0: `2^(s - 127)` for each block of 32),
    /// dequantised exactly to the compute dtype at load (`layers::mxfp4`); every other tensor is
    /// read as stored. `modules_to_not_convert` is kept as declared (the modules stored in float).
    Mxfp4 { modules_to_not_convert: Vec<String> },
}

/// The last part of the names of the projections `--quantize fp8` quantises: those Qwen's FP8
/// releases store in FP8. Attention `q/k/v/o_proj`; the MLP's `gate/up/down_proj`, dense, per
/// expert (`experts.N.gate_proj`, ...) and of the shared expert; the experts fused into 3-D
/// tensors (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`), quantised per
/// expert and per projection (gate and up apart), as the releases store them; the Gated
/// DeltaNet's `in_proj_qkv`, `in_proj_z` and `out_proj`.
///
/// Never quantised: the embeddings, `lm_head`, the norms, the router (`mlp.gate`), the
/// `shared_expert_gate`, the Gated DeltaNet's `in_proj_a` / `in_proj_b` / `in_proj_ba` (small
/// gate projections the releases keep in bf16), `conv1d`, and Qwen3-Next's fused `in_proj_qkvz`
/// (its rows are regrouped per key head at load, which does not keep FP8 blocks whole).
const QUANTISED_AT_LOAD: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_qkvz",
    "out_proj",
];

/// Whether `--quantize fp8` quantises the tensor `name` (a projection's `{module}.weight`, or a
/// fused experts tensor): the one place that decides, by module name ([`QUANTISED_AT_LOAD`]).
/// A projection it names stays in float all the same when its input features are not a
/// multiple of 128 (its input could not be quantised in whole groups).
pub fn quantised_at_load(name: &str) -> bool {
    let module = name.strip_suffix(".weight").unwrap_or(name);
    let last = module.rsplit('.').next().unwrap_or(module);
    QUANTISED_AT_LOAD.contains(&last) && (last != "gate_up_proj" || module.ends_with("experts.gate_up_proj"))
}

impl Quantization {
    /// How `/v1/info` and the start-up log describe the weights.
    pub fn describe(&self) -> String {
        match self {
            Quantization::Fp8Block { .. } => {
                format!("fp8 e4m3 weights in {FP8_BLOCK}x{FP8_BLOCK} blocks, dynamic per-token fp8 activations")
            }
            Quantization::Fp8AtLoad => format!(
                "fp8 e4m3 weights in {FP8_BLOCK}x{FP8_BLOCK} blocks quantised at load (--quantize fp8), dynamic \
                 per-token fp8 activations"
            ),
            Quantization::Mxfp4 { .. } => "mxfp4 experts (e2m1 values in blocks of 32 with E8M0 scales), dequantised \
                 exactly to the compute dtype at load"
                .to_string(),
        }
    }

    /// Whether the module `name` (a full tensor name without `.weight`) is listed as kept
    /// unquantised, as transformers matches the list: an entry matches from the start up to a
    /// module boundary, or as a suffix; `*` matches any run of characters. The decoder's prefix
    /// is not told apart (`model.language_model.` and `model.` name the same module).
    pub fn not_converted(&self, name: &str) -> bool {
        let Quantization::Fp8Block { modules_to_not_convert } = self else { return false };
        let strip = |s: &str| {
            let s = s.strip_prefix("model.language_model.").or_else(|| s.strip_prefix("model.")).unwrap_or(s);
            s.to_string()
        };
        let (full, short) = (name.to_string(), strip(name));
        modules_to_not_convert
            .iter()
            .any(|entry| [(entry.clone(), &full), (strip(entry), &short)].iter().any(|(e, n)| matches_module(e, n)))
    }
}

/// The families `--quantize fp8` quantises at load: those whose FP8 releases name the projections
/// [`QUANTISED_AT_LOAD`] lists (latent attention's are not among them).
const QUANTISED_AT_LOAD_FAMILIES: &[Family] = &[
    Family::Llama,
    Family::Mistral,
    Family::Qwen2,
    Family::Qwen3,
    Family::Qwen3Moe,
    Family::Qwen3Next,
    Family::Qwen3_5,
    Family::Qwen3_5Moe,
];

/// Whether the family's FP8 checkpoints are read: those of attention + MLP layers; the MoE
/// families with experts stored one module per expert, as their FP8 releases do (FP8 experts
/// fused into 3-D tensors are refused as a dtype the loader does not read); the Qwen3.5 hybrids,
/// dense and MoE (their Gated DeltaNet projections are separate, each read as stored); Qwen3-Next,
/// whose fused `in_proj_qkvz` is regrouped at load in whole 128-row blocks (the FP8 rows with
/// their block scales); and DeepSeek-V3 (its release: every linear of attention, of the dense
/// MLPs, of each expert and of the shared experts in FP8, the router in bf16), read but not
/// quantised at load. A family added to the engine is refused here until its FP8 layout is
/// checked against references of its own.
fn reads_fp8(family: Family) -> bool {
    QUANTISED_AT_LOAD_FAMILIES.contains(&family) || family == Family::DeepseekV3
}

/// Refuses `q` for a family whose quantised layout is not read yet, naming the architectures
/// whose FP8 checkpoints are read.
pub fn check_family(q: &Quantization, family: Family, architecture: &str) -> Result<(), EngineError> {
    if let Quantization::Mxfp4 { .. } = q {
        if family == Family::GptOss {
            return Ok(());
        }
        return Err(bad(format!(
            "config.json: quantization_config.quant_method \"mxfp4\" is read for GptOssForCausalLM only (its \
             released experts), not for {architecture}, and reading its weights as unquantised would return wrong \
             hidden states; supported quantisation: {SUPPORTED_QUANTIZATION}. Use the model's unquantised (bf16) \
             release"
        )));
    }
    let listed =
        |f: Family| if *q == Quantization::Fp8AtLoad { QUANTISED_AT_LOAD_FAMILIES.contains(&f) } else { reads_fp8(f) };
    if listed(family) {
        return Ok(());
    }
    let read: Vec<&str> = super::ARCHITECTURES.iter().filter(|(_, f)| listed(*f)).map(|(a, _)| *a).collect();
    if *q == Quantization::Fp8AtLoad {
        return Err(bad(format!(
            "--quantize fp8 does not quantise {architecture} yet (only {}); drop --quantize fp8",
            read.join(", ")
        )));
    }
    Err(bad(format!(
        "config.json: {} checkpoints of {architecture} are not read yet (only those of {}); use the model's \
         unquantised (bf16) release",
        q.describe(),
        read.join(", ")
    )))
}

/// `entry` matches `name` from its start up to a module boundary, or as its suffix.
fn matches_module(entry: &str, name: &str) -> bool {
    if entry.is_empty() {
        return false;
    }
    if name.ends_with(entry) && !entry.contains('*') {
        return true;
    }
    glob_prefix(entry.as_bytes(), name.as_bytes())
}

/// Whether `pat` (with `*` for any run of characters; `.*` as in a regex) matches a prefix of
/// `s` that ends at a module boundary (the end of `s` or before a `.`).
fn glob_prefix(pat: &[u8], s: &[u8]) -> bool {
    match pat.split_first() {
        None => s.is_empty() || s[0] == b'.',
        Some((b'.', rest)) if rest.first() == Some(&b'*') => glob_prefix(&rest[1..], s) || any_suffix(&rest[1..], s),
        Some((b'*', rest)) => any_suffix(rest, s),
        Some((&c, rest)) => s.first() == Some(&c) && glob_prefix(rest, &s[1..]),
    }
}

fn any_suffix(pat: &[u8], s: &[u8]) -> bool {
    (0..=s.len()).any(|i| glob_prefix(pat, &s[i..]))
}

/// The config keys under which checkpoints declare their quantisation (`compression_config` is
/// compressed-tensors' older name).
const KEYS: &[&str] = &["quantization_config", "compression_config"];

/// The fields that tell one scheme of a method from another, reported in the refusal.
const DETAIL_FIELDS: &[&str] = &[
    "fmt",
    "format",
    "activation_scheme",
    "weight_block_size",
    "scale_fmt",
    "bits",
    "group_size",
    "load_in_4bit",
    "load_in_8bit",
    "bnb_4bit_quant_type",
];

/// The quantisation a config (the root and its `text_config`) declares: None for none, the
/// scheme when the engine implements it, and otherwise a refusal naming the method, its scheme
/// and what is supported. Declared twice (root and `text_config`), both must agree.
pub fn parse(configs: &[&Value]) -> Result<Option<Quantization>, EngineError> {
    let mut found: Option<Quantization> = None;
    for cfg in configs {
        for key in KEYS {
            let Some(q) = cfg.get(*key).filter(|v| !v.is_null()) else {
                continue;
            };
            let scheme = read(key, q)?;
            match &found {
                Some(f) if *f != scheme => {
                    return Err(bad(format!(
                        "config.json: the {key} of text_config and the one beside it disagree ({} vs {}); layertap \
                         reads one scheme for the whole decoder",
                        describe_fields(q),
                        f.describe()
                    )))
                }
                _ => found = Some(scheme),
            }
        }
    }
    Ok(found)
}

/// The scheme of one `quantization_config` entry, or its refusal.
fn read(key: &str, q: &Value) -> Result<Quantization, EngineError> {
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unnamed");
    let refuse = |why: &str| {
        bad(format!(
            "config.json: {key}.quant_method {method:?}{} is not supported{why}, and reading its weights as \
             unquantised would return wrong hidden states; supported quantisation: {SUPPORTED_QUANTIZATION}. Use \
             the model's unquantised (bf16) release",
            describe_fields(q)
        ))
    };
    let field = |f: &str| q.get(f).filter(|v| !v.is_null());
    let modules_to_not_convert = || match field("modules_to_not_convert") {
        None => Ok(Vec::new()),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|e| e.as_str().map(String::from)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| bad(format!("config.json: {key}.modules_to_not_convert must be a list of names, got {v}"))),
    };
    if key == "quantization_config" && method == "mxfp4" {
        return Ok(Quantization::Mxfp4 { modules_to_not_convert: modules_to_not_convert()? });
    }
    if key != "quantization_config" || method != "fp8" {
        return Err(refuse(""));
    }
    // transformers' FineGrainedFP8Config has no `fmt` (it is always e4m3); Qwen's configs say so.
    if let Some(fmt) = field("fmt") {
        if fmt.as_str() != Some("e4m3") {
            return Err(refuse(&format!(" (fmt {fmt}: only e4m3 is read)")));
        }
    }
    match field("activation_scheme").and_then(Value::as_str) {
        Some("dynamic") => {}
        other => {
            let got = other.map_or("missing".to_string(), |s| format!("{s:?}"));
            return Err(refuse(&format!(
                " (activation_scheme {got}: only dynamic per-token activation scales are read)"
            )));
        }
    }
    let block: Option<Vec<u64>> =
        field("weight_block_size").and_then(Value::as_array).and_then(|a| a.iter().map(Value::as_u64).collect());
    if block.as_deref() != Some(&[FP8_BLOCK as u64, FP8_BLOCK as u64]) {
        let got = field("weight_block_size").map_or("missing (per-tensor scales)".to_string(), |v| v.to_string());
        return Err(refuse(&format!(" (weight_block_size {got}: only [128, 128] blocks are read)")));
    }
    // DeepSeek's power-of-two ("ue8m0") scales quantise activations differently.
    if let Some(f) = field("scale_fmt") {
        return Err(refuse(&format!(" (scale_fmt {f}: only plain float scales are read)")));
    }
    Ok(Quantization::Fp8Block { modules_to_not_convert: modules_to_not_convert()? })
}

/// ` (fmt "e4m3", activation_scheme "dynamic", ...)`: the fields that tell schemes apart.
fn describe_fields(q: &Value) -> String {
    let details: Vec<String> =
        DETAIL_FIELDS.iter().filter_map(|f| q.get(*f).filter(|v| !v.is_null()).map(|v| format!("{f} {v}"))).collect();
    if details.is_empty() {
        String::new()
    } else {
        format!(" ({})", details.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(entries: &[&str]) -> Quantization {
        Quantization::Fp8Block { modules_to_not_convert: entries.iter().map(|s| s.to_string()).collect() }
    }

    /// The projections Qwen's FP8 releases quantise, and nothing else.
    #[test]
    fn quantise_at_load_names_the_releases_projections() {
        for yes in [
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.mlp.gate_proj.weight",
            "layers.0.mlp.up_proj.weight",
            "layers.0.mlp.down_proj.weight",
            "layers.1.mlp.experts.7.gate_proj.weight",
            "layers.1.mlp.experts.7.down_proj.weight",
            "layers.1.mlp.experts.gate_up_proj",
            "layers.1.mlp.experts.down_proj",
            "layers.1.mlp.shared_expert.up_proj.weight",
            "layers.0.linear_attn.in_proj_qkv.weight",
            "layers.0.linear_attn.in_proj_z.weight",
            "layers.0.linear_attn.out_proj.weight",
            "layers.0.linear_attn.in_proj_qkvz.weight",
        ] {
            assert!(quantised_at_load(yes), "{yes}");
        }
        for no in [
            "embed_tokens.weight",
            "lm_head.weight",
            "norm.weight",
            "layers.0.input_layernorm.weight",
            "layers.0.self_attn.q_norm.weight",
            "layers.0.self_attn.q_proj.bias",
            "layers.1.mlp.gate.weight",
            "layers.1.mlp.shared_expert_gate.weight",
            "layers.0.linear_attn.in_proj_a.weight",
            "layers.0.linear_attn.in_proj_b.weight",
            "layers.0.linear_attn.in_proj_ba.weight",
            "layers.0.linear_attn.conv1d.weight",
            "layers.0.linear_attn.A_log",
            "layers.0.mlp.gate_up_proj.weight",
        ] {
            assert!(!quantised_at_load(no), "{no}");
        }
    }

    #[test]
    fn modules_to_not_convert_match_as_transformers_matches_them() {
        let q =
            listed(&["lm_head", "model.layers.1", "mlp.gate", "model.language_model.layers.0.linear_attn.in_proj_a"]);
        assert!(q.not_converted("lm_head"));
        assert!(q.not_converted("model.layers.1.mlp.down_proj"));
        assert!(!q.not_converted("model.layers.11.mlp.down_proj"));
        assert!(q.not_converted("model.layers.3.mlp.gate"));
        assert!(!q.not_converted("model.layers.3.mlp.gate_proj"));
        // Either decoder prefix names the same module.
        assert!(q.not_converted("model.layers.0.linear_attn.in_proj_a"));
        assert!(!q.not_converted("model.layers.0.linear_attn.in_proj_qkv"));
        let q = listed(&["model.layers.*.mlp.down_proj", "model.visual*"]);
        assert!(q.not_converted("model.layers.7.mlp.down_proj"));
        assert!(!q.not_converted("model.layers.7.mlp.up_proj"));
        assert!(q.not_converted("model.visual.blocks.0.attn.qkv"));
    }
}
