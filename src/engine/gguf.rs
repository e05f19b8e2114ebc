//! GGUF files: model config from the metadata, tensors dequantised lazily to the compute dtype
//! under Hugging Face names, and the tokenizer stored in the metadata.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};

use super::config::{Family, LayerSpec, ModelConfig, RopeScaling};
use super::EngineError;

pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    reader: Mutex<File>,
}

fn load_err(path: &Path, e: impl std::fmt::Display) -> EngineError {
    EngineError::Load(format!("cannot read GGUF file {}: {e}", path.display()))
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let mut f = File::open(path).map_err(|e| load_err(path, e))?;
        let content = Content::read(&mut f).map_err(|e| load_err(path, e))?;
        Ok(GgufFile { path: path.to_path_buf(), content, reader: Mutex::new(f) })
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    pub fn meta_str(&self, key: &str) -> Option<&str> {
        self.meta(key).and_then(|v| v.to_string().ok()).map(String::as_str)
    }

    fn meta_u64(&self, key: &str) -> Option<u64> {
        let v = self.meta(key)?;
        v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)).or_else(|| v.to_i32().ok().map(|x| x as u64))
    }

    fn meta_f64(&self, key: &str) -> Option<f64> {
        let v = self.meta(key)?;
        v.to_f32().ok().map(f64::from).or_else(|| v.to_f64().ok())
    }

    fn req_usize(&self, key: &str) -> Result<usize, EngineError> {
        self.meta_u64(key)
            .map(|v| v as usize)
            .ok_or_else(|| EngineError::Load(format!("GGUF {}: metadata key {key:?} is missing", self.path.display())))
    }

    pub fn architecture(&self) -> Result<&str, EngineError> {
        self.meta_str("general.architecture")
            .ok_or_else(|| EngineError::Load(format!("GGUF {}: no general.architecture", self.path.display())))
    }

    /// Builds the model config the way transformers does for the same file.
    pub fn model_config(&self) -> Result<ModelConfig, EngineError> {
        let arch = self.architecture()?.to_string();
        let (family, hf_arch) = match arch.as_str() {
            "llama" => (Family::Llama, "LlamaForCausalLM"),
            "mistral" => (Family::Mistral, "MistralForCausalLM"),
            "qwen2" => (Family::Qwen2, "Qwen2ForCausalLM"),
            "qwen3" => (Family::Qwen3, "Qwen3ForCausalLM"),
            other => {
                return Err(EngineError::Load(format!(
                    "GGUF architecture {other:?} is not supported; supported: llama, mistral, qwen2, qwen3 (for the \
                     MoE and hybrid families, e.g. qwen3moe or qwen3next, load the Hugging Face safetensors checkpoint)"
                )))
            }
        };
        let k = |s: &str| format!("{arch}.{s}");
        let hidden_size = self.req_usize(&k("embedding_length"))?;
        let heads = self.req_usize(&k("attention.head_count"))?;
        let kv_heads = self.meta_u64(&k("attention.head_count_kv")).map(|v| v as usize).unwrap_or(heads);
        let head_dim =
            self.meta_u64(&k("attention.key_length")).map(|v| v as usize).unwrap_or(hidden_size / heads.max(1));
        let vocab_size = match self.content.tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims()[0],
            None => return Err(EngineError::Load("GGUF: tensor \"token_embd.weight\" is missing".into())),
        };
        if self.content.tensor_infos.contains_key("rope_freqs.weight") {
            return Err(EngineError::Load(
                "GGUF: per-dimension rope frequencies (rope_freqs.weight) are not supported; use the Hugging Face \
                 safetensors checkpoint of this model instead"
                    .into(),
            ));
        }
        let rope_scaling = match self.meta_str(&k("rope.scaling.type")) {
            None | Some("none") => None,
            Some("linear") => {
                Some(RopeScaling::Linear { factor: self.meta_f64(&k("rope.scaling.factor")).unwrap_or(1.0) })
            }
            Some(other) => {
                return Err(EngineError::Load(format!("GGUF: rope scaling {other:?} is not supported")));
            }
        };
        let has = |n: &str| self.content.tensor_infos.contains_key(n);
        let num_hidden_layers = self.req_usize(&k("block_count"))?;
        let cfg = ModelConfig {
            architecture: hf_arch.into(),
            family,
            hidden_size,
            intermediate_size: self.req_usize(&k("feed_forward_length"))?,
            num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rotary_dim: head_dim,
            vocab_size,
            rms_norm_eps: self.meta_f64(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
            rope_theta: self.meta_f64(&k("rope.freq_base")).unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: self.meta_u64(&k("context_length")).map(|v| v as usize).unwrap_or(4096),
            sliding_window: None,
            attention_sinks: false,
            qkv_bias: has("blk.0.attn_q.bias"),
            o_bias: has("blk.0.attn_output.bias"),
            mlp_bias: has("blk.0.ffn_up.bias"),
            qk_norm: has("blk.0.attn_q_norm.weight"),
            full_attention: None,
            v_norm: false,
            attention_scale: None,
            sandwich_norms: false,
            embed_scale: None,
            mlp_activation: super::config::ExpertActivation::Silu,
            final_logit_softcapping: None,
            tie_word_embeddings: !has("output.weight"),
            zero_centred_norms: false,
            f32_norms: false,
            attn_output_gate: false,
            linear_attention: None,
            mla: None,
            mtp_layers: 0,
            mlp_widths: Vec::new(),
            kv_sources: Vec::new(),
            per_layer_inputs: None,
            moe: None,
            layers: vec![LayerSpec::DENSE_ATTENTION; num_hidden_layers],
            quantization: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads one tensor by its GGUF name, dequantised to f32 on the CPU.
    fn read(&self, name: &str) -> Result<Tensor, EngineError> {
        let mut f = self.reader.lock().map_err(|_| EngineError::Load("GGUF reader poisoned".into()))?;
        let q = self.content.tensor(&mut *f, name, &Device::Cpu).map_err(|e| load_err(&self.path, e))?;
        Ok(q.dequantize(&Device::Cpu)?)
    }
}

/// GGUF tensor name for a Hugging Face decoder tensor name (without "model."), or None.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "embed_tokens.weight" => Some("token_embd.weight"),
        "norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.into());
    }
    let rest = hf.strip_prefix("layers.")?;
    let (idx, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{idx}.{g}.{suffix}"))
}

/// Tensors of a GGUF file under Hugging Face names, read on demand.
pub struct GgufTensors {
    file: std::sync::Arc<GgufFile>,
    /// llama.cpp stores llama q/k rows permuted for its rotary layout; transformers undoes it.
    unpermute: Option<(usize, usize)>,
}

impl GgufTensors {
    pub fn new(file: std::sync::Arc<GgufFile>, cfg: &ModelConfig) -> Self {
        let unpermute = matches!(cfg.family, Family::Llama | Family::Mistral)
            .then_some((cfg.num_attention_heads, cfg.num_key_value_heads));
        GgufTensors { file, unpermute }
    }

    pub fn describe(&self) -> String {
        format!("GGUF file {}", self.file.path.display())
    }

    /// Every tensor's bytes as stored, under the Hugging Face names of the decoder's parts
    /// (`layers.{i}.*`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`); others as named.
    pub fn stored_bytes(&self) -> Vec<(String, u64)> {
        let infos = &self.file.content.tensor_infos;
        infos
            .iter()
            .map(|(name, info)| {
                let d = info.ggml_dtype;
                let bytes = (info.shape.elem_count() / d.block_size() * d.type_size()) as u64;
                let hf = match name.as_str() {
                    "token_embd.weight" => "embed_tokens.weight".to_string(),
                    "output_norm.weight" => "norm.weight".to_string(),
                    "output.weight" => "lm_head.weight".to_string(),
                    other => other.strip_prefix("blk.").map_or_else(|| other.to_string(), |r| format!("layers.{r}")),
                };
                (hf, bytes)
            })
            .collect()
    }

    /// Whether the file holds the tensor transformers names `hf`.
    pub fn has(&self, hf: &str) -> bool {
        gguf_name(hf).is_some_and(|g| self.file.content.tensor_infos.contains_key(&g))
    }

    pub fn load(&self, hf: &str) -> Result<Option<Tensor>, EngineError> {
        let Some(g) = gguf_name(hf) else { return Ok(None) };
        if !self.file.content.tensor_infos.contains_key(&g) {
            return Ok(None);
        }
        let t = self.file.read(&g)?;
        let heads = match (self.unpermute, hf.ends_with("q_proj.weight"), hf.ends_with("k_proj.weight")) {
            (Some((q, _)), true, _) => Some(q),
            (Some((_, k)), _, true) => Some(k),
            _ => None,
        };
        match heads {
            Some(n) => {
                let (rows, cols) = t.dims2()?;
                let half = rows / n / 2;
                Ok(Some(t.reshape((n, half, 2, cols))?.transpose(1, 2)?.reshape((rows, cols))?))
            }
            None => Ok(Some(t)),
        }
    }
}

/// String-valued and array metadata for building the tokenizer.
pub struct GgufTokenizerData {
    pub model: String,
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub chat_template: Option<String>,
}

impl GgufFile {
    pub fn tokenizer_data(&self) -> Result<GgufTokenizerData, EngineError> {
        let strings = |key: &str| -> Vec<String> {
            self.meta(key)
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.iter().filter_map(|x| x.to_string().ok().cloned()).collect())
                .unwrap_or_default()
        };
        let tokens = strings("tokenizer.ggml.tokens");
        if tokens.is_empty() {
            return Err(EngineError::Load(format!(
                "GGUF {} has no tokenizer (tokenizer.ggml.tokens); pass --input-ids instead of text",
                self.path.display()
            )));
        }
        let token_types = self
            .meta("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
            .map(|v| v.iter().map(|x| x.to_i32().unwrap_or(1)).collect())
            .unwrap_or_default();
        let id = |k: &str| self.meta_u64(k).map(|v| v as u32);
        let flag = |k: &str| self.meta(k).and_then(|v| v.to_bool().ok());
        Ok(GgufTokenizerData {
            model: self.meta_str("tokenizer.ggml.model").unwrap_or("gpt2").to_string(),
            pre: self.meta_str("tokenizer.ggml.pre").map(String::from),
            tokens,
            token_types,
            merges: strings("tokenizer.ggml.merges"),
            bos_id: id("tokenizer.ggml.bos_token_id"),
            eos_id: id("tokenizer.ggml.eos_token_id"),
            unk_id: id("tokenizer.ggml.unknown_token_id"),
            pad_id: id("tokenizer.ggml.padding_token_id"),
            add_bos: flag("tokenizer.ggml.add_bos_token"),
            add_eos: flag("tokenizer.ggml.add_eos_token"),
            chat_template: self.meta_str("tokenizer.chat_template").map(String::from),
        })
    }
}
