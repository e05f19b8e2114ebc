//! Named tensors from safetensors files or from memory (GGUF), checked for shape and cast to the
//! compute dtype and device.

use std::path::PathBuf;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::EngineError;

pub enum TensorSource {
    Safetensors { files: Vec<PathBuf>, tensors: MmapedSafetensors },
    Gguf(super::gguf::GgufTensors),
}

pub struct Weights {
    source: TensorSource,
    /// Prefix in front of every decoder tensor name ("model." in `*ForCausalLM` checkpoints).
    prefix: String,
    pub device: Device,
    pub dtype: DType,
}

impl Weights {
    pub fn new(source: TensorSource, device: Device, dtype: DType) -> Self {
        // Multimodal wrappers (`*ForConditionalGeneration`) keep the text decoder under
        // "model.language_model."; `*ForCausalLM` checkpoints name it "model."; bare decoder
        // checkpoints use no prefix. GGUF names are mapped without a prefix. Tensors outside
        // the decoder (vision tower, multi-token-prediction head) are never read.
        let prefix = match &source {
            TensorSource::Safetensors { tensors, .. } => ["model.language_model.", "model."]
                .into_iter()
                .find(|p| tensors.get(&format!("{p}embed_tokens.weight")).is_ok())
                .unwrap_or(""),
            TensorSource::Gguf(_) => "",
        };
        Weights { source, prefix: prefix.into(), device, dtype }
    }

    /// `name` as the checkpoint spells it (with the decoder prefix).
    pub fn full_name(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Whether the checkpoint has `name` (without the decoder prefix).
    pub fn has(&self, name: &str) -> bool {
        let full = self.full_name(name);
        match &self.source {
            TensorSource::Safetensors { tensors, .. } => tensors.get(&full).is_ok(),
            TensorSource::Gguf(g) => g.has(name),
        }
    }

    fn where_from(&self) -> String {
        match &self.source {
            TensorSource::Safetensors { files, .. } => {
                let names: Vec<_> =
                    files.iter().filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
                names.join(", ")
            }
            TensorSource::Gguf(g) => g.describe(),
        }
    }

    /// Loads `name` (without the "model." prefix), checks its shape and casts it to the
    /// compute dtype.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        self.get_as(name, shape, self.dtype)
    }

    /// Loads `name` in f32 whatever the compute dtype: for the few tensors that are computed
    /// with in f32 (gate constants, zero-centred norm weights), so an f32 tensor inside a
    /// 16-bit checkpoint keeps its precision.
    pub fn get_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        self.get_as(name, shape, DType::F32)
    }

    fn get_as(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, EngineError> {
        let full = self.full_name(name);
        let t = match &self.source {
            TensorSource::Safetensors { tensors, .. } => {
                if tensors.get(&full).is_err() {
                    return Err(self.missing(&full));
                }
                tensors.load(&full, &Device::Cpu)?
            }
            TensorSource::Gguf(g) => g.load(name)?.ok_or_else(|| self.missing(&full))?,
        };
        if t.dims() != shape {
            return Err(EngineError::Load(format!(
                "tensor {full:?} in {} has shape {:?}, but the model config implies {:?}; \
                 the weights do not match the model config",
                self.where_from(),
                t.dims(),
                shape
            )));
        }
        Ok(t.to_dtype(dtype)?.to_device(&self.device)?)
    }

    pub fn get_opt(&self, name: &str, shape: &[usize], present: bool) -> Result<Option<Tensor>, EngineError> {
        if present {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    fn missing(&self, full: &str) -> EngineError {
        EngineError::Load(format!(
            "tensor {full:?} is missing from {}; the checkpoint is incomplete or does not match config.json",
            self.where_from()
        ))
    }
}
