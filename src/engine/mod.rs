//! The model engine: the only part of layertap that touches candle. It loads a decoder and runs
//! forward passes over packed batches, keeping the hidden states of the requested layers.

pub mod batch;
mod budget;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decoder;
mod device;
mod dtype;
mod error;
pub mod gguf;
pub mod host;
pub mod large;
pub mod layers;
pub mod loader;
pub mod logprobs;
pub mod options;
pub mod output;
pub mod profile;
mod runner;
pub mod selfcheck;
pub mod stages;
pub mod synthetic;
pub mod weights;

pub use candle_core::{DType, Device};

pub use budget::tokens_for_memory;
pub use config::quant::Quantize;
pub use config::{Family, LayerKinds, ModelConfig, ARCHITECTURES};
pub use device::{cuda_device_count, device_memory, parse_device, MemoryProbe};
pub use dtype::{ComputeDType, OutDType};
pub use error::EngineError;
pub use host::{Fp8Taps, HostBytes, HostTensor, LentBuffer, Taps};
pub use loader::{load, LoadedModel, TokenizerSource};
pub use logprobs::{HostTopK, LogprobRows, MAX_TOP_K};
pub use options::{AttentionKernel, EngineOptions};
pub use output::{Output, Rows};
pub use runner::{Cancel, Engine, LoadedEngine, ModelEngine, Pending};
pub use stages::{Stage, StageLayout};

/// Sequences packed along one token dimension, and the layers wanted from them.
#[derive(Clone, Debug)]
pub struct Batch {
    pub input_ids: Vec<u32>,
    /// `n + 1` offsets: sequence `i` is `input_ids[cu_seqlens[i]..cu_seqlens[i + 1]]`.
    pub cu_seqlens: Vec<usize>,
    /// Resolved hidden-state indices in `0..=num_layers + 1` (`num_layers + 1` is the last
    /// decoder layer's output before the final norm), each at most once.
    pub layers: Vec<usize>,
    /// Which rows come back, and which of them as fp8.
    pub output: Output,
}

impl Batch {
    /// Every row of the packed sequences, in the compute dtype.
    pub fn new(input_ids: Vec<u32>, cu_seqlens: Vec<usize>, layers: Vec<usize>) -> Self {
        Batch { input_ids, cu_seqlens, layers, output: Output::default() }
    }

    /// Packs `seqs` one after the other (their offsets in `cu_seqlens`) to compute every layer
    /// any of their callers asked for, each once, in first-asked order.
    pub fn pack<'a>(seqs: impl IntoIterator<Item = &'a [u32]>, layers: impl IntoIterator<Item = usize>) -> Self {
        let (mut input_ids, mut cu_seqlens) = (Vec::new(), vec![0]);
        for s in seqs {
            input_ids.extend_from_slice(s);
            cu_seqlens.push(input_ids.len());
        }
        let mut distinct: Vec<usize> = Vec::new();
        for l in layers {
            if !distinct.contains(&l) {
                distinct.push(l);
            }
        }
        Batch::new(input_ids, cu_seqlens, distinct)
    }
}

/// Static description of the loaded model.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelInfo {
    pub model_id: String,
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub dtype: ComputeDType,
    pub layer_kinds: LayerKinds,
    /// Whether the model has an output head (`lm_head`, or embeddings it ties), so next-token
    /// log-probabilities can be computed.
    pub lm_head: bool,
    /// How the checkpoint's weights are quantised (None: float weights).
    pub quantization: Option<String>,
    /// The longest input the model is computed exactly for, and why, where it has such a limit
    /// (sparse attention's `index_topk`, [`ModelConfig::max_sequence_tokens`]): a longer input is
    /// refused.
    #[serde(skip)]
    pub sequence_limit: Option<(usize, String)>,
}

impl ModelInfo {
    pub fn new(model_id: &str, cfg: &ModelConfig, dtype: ComputeDType) -> Self {
        ModelInfo {
            model_id: model_id.into(),
            architecture: cfg.architecture.clone(),
            num_layers: cfg.num_hidden_layers,
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            dtype,
            layer_kinds: cfg.layer_kinds(),
            lm_head: cfg.tie_word_embeddings,
            quantization: cfg.quantization.as_ref().map(config::quant::Quantization::describe),
            sequence_limit: cfg.max_sequence_tokens(),
        }
    }

    /// The same, with whether the model has an output head.
    pub fn with_head(self, lm_head: bool) -> Self {
        ModelInfo { lm_head, ..self }
    }
}
