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
        // `*ForCausalLM` checkpoints name the decoder "model."; bare decoder checkpoints do not.
        // GGUF names are mapped without a prefix.
        let prefix = match &source {
            TensorSource::Safetensors { tensors, .. } if tensors.get("model.embed_tokens.weight").is_ok() => "model.",
            _ => "",
        };
        Weights { source, prefix: prefix.into(), device, dtype }
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

    /// Loads `name` (without the "model." prefix), checks its shape and casts it.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        let full = format!("{}{name}", self.prefix);
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
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
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
