//! The model engine: the only part of layertap that touches candle. It loads a decoder and runs
//! forward passes over packed batches, keeping the hidden states of the requested layers.

pub mod batch;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decoder;
pub mod gguf;
pub mod host;
pub mod large;
pub mod layers;
pub mod loader;
pub mod options;
pub mod output;
pub mod profile;
pub mod selfcheck;
pub mod weights;

use candle_core::Tensor;
pub use candle_core::{DType, Device};

pub use config::{Family, LayerKinds, ModelConfig, ARCHITECTURES};
pub use host::{Fp8Taps, HostBytes, HostTensor, LentBuffer, Taps};
pub use loader::{load, LoadedModel, TokenizerSource};
pub use options::{AttentionKernel, EngineOptions};
pub use output::{Output, Rows};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded; the message says what is wrong and how to fix it.
    #[error("{0}")]
    Load(String),
    /// The caller asked for something the model cannot do (layer out of range, token id too large).
    #[error("{0}")]
    InvalidInput(String),
    #[error("model computation failed: {0}")]
    Compute(candle_core::Error),
    /// The device ran out of memory; a smaller batch may fit. Candle reports CUDA's
    /// `CUDA_ERROR_OUT_OF_MEMORY` (and allocation failures) as text, so it is recognised there.
    #[error("the device ran out of memory: {0}")]
    OutOfMemory(String),
    /// Every request of the batch has gone, so the engine stopped between layers and its
    /// device work was abandoned. Not a failure: nobody is waiting for the result.
    #[error("the batch was cancelled after {layers_run} layers: every request in it has gone")]
    Cancelled { layers_run: usize },
}

impl EngineError {
    /// Whether a candle error's text says the device ran out of memory.
    pub fn is_out_of_memory_text(text: &str) -> bool {
        text.contains("CUDA_ERROR_OUT_OF_MEMORY")
            || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
            || text.to_ascii_lowercase().contains("out of memory")
    }
}

impl From<candle_core::Error> for EngineError {
    /// Every candle error enters the engine's errors here, so an out-of-memory error is
    /// recognised wherever it surfaces (a kernel launch, an allocation, a copy to the host).
    fn from(e: candle_core::Error) -> Self {
        let text = e.to_string();
        if EngineError::is_out_of_memory_text(&text) {
            EngineError::OutOfMemory(one_line(&e))
        } else {
            EngineError::Compute(e)
        }
    }
}

/// A candle error's message on one line, without the backtrace candle may have attached (a
/// device error's backtrace is many lines of `<unknown>` frames, useless in a log line).
fn one_line(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => one_line(inner),
        candle_core::Error::Context { inner, context } => format!("{context}: {}", one_line(inner)),
        other => other.to_string().split('\n').map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_error_is_one_line_without_its_backtrace() {
        let inner = candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        let e = candle_core::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        }
        .context("allocating 3 GiB");
        assert!(e.to_string().lines().count() > 2, "candle's own text carries the backtrace");
        match EngineError::from(e) {
            EngineError::OutOfMemory(m) => {
                assert_eq!(m, "allocating 3 GiB: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
            }
            other => panic!("not recognised as out of memory: {other}"),
        }
    }
}

/// Asked by the engine between layers whether anyone still wants the batch it is running.
/// The batching worker builds it from its requests (cancelled when every one has gone);
/// [`Cancel::never`] for callers that always want the result.
#[derive(Clone, Default)]
pub struct Cancel(Option<std::sync::Arc<dyn Fn() -> bool + Send + Sync>>);

impl Cancel {
    /// Cancelled once `gone` returns true (it must stay true from then on).
    pub fn new(gone: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Cancel(Some(std::sync::Arc::new(gone)))
    }

    pub fn never() -> Self {
        Cancel(None)
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.as_ref().is_some_and(|gone| gone())
    }

    /// The check run between layers: `Err(Cancelled)` once nobody wants the batch, with the
    /// number of layers already run.
    pub fn check(&self, layers_run: usize) -> Result<(), EngineError> {
        if self.is_cancelled() {
            Err(EngineError::Cancelled { layers_run })
        } else {
            Ok(())
        }
    }
}

impl std::fmt::Debug for Cancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Cancel(checked)" } else { "Cancel(never)" })
    }
}

/// Output dtypes a caller can ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutDType {
    #[serde(alias = "f32")]
    Float32,
    #[serde(alias = "bf16")]
    Bfloat16,
    #[serde(alias = "f16")]
    Float16,
    /// 8-bit floats (E4M3, finite only, max 448) with one f32 scale per token per layer; only
    /// ever produced by the engine (quantised on the device after the taps are taken).
    #[serde(rename = "float8_e4m3fn", alias = "fp8", alias = "f8_e4m3")]
    Float8E4M3,
}

impl OutDType {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(OutDType::Float32),
            "bf16" | "bfloat16" => Some(OutDType::Bfloat16),
            "f16" | "float16" => Some(OutDType::Float16),
            "fp8" | "f8_e4m3" | "float8_e4m3fn" => Some(OutDType::Float8E4M3),
            _ => None,
        }
    }

    pub fn candle(self) -> DType {
        match self {
            OutDType::Float32 => DType::F32,
            OutDType::Bfloat16 => DType::BF16,
            OutDType::Float16 => DType::F16,
            OutDType::Float8E4M3 => DType::F8E4M3,
        }
    }

    pub fn from_candle(d: DType) -> Self {
        match d {
            DType::BF16 => OutDType::Bfloat16,
            DType::F16 => OutDType::Float16,
            DType::F8E4M3 => OutDType::Float8E4M3,
            _ => OutDType::Float32,
        }
    }

    pub fn size_in_bytes(self) -> usize {
        self.candle().size_in_bytes()
    }

    /// The name used in safetensors metadata and the API ("float32", …).
    pub fn name(self) -> &'static str {
        match self {
            OutDType::Float32 => "float32",
            OutDType::Bfloat16 => "bfloat16",
            OutDType::Float16 => "float16",
            OutDType::Float8E4M3 => "float8_e4m3fn",
        }
    }
}

impl std::str::FromStr for OutDType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        OutDType::parse(s).ok_or_else(|| {
            format!("unknown dtype {s:?}; use f32, bf16, f16 or fp8 (or float32, bfloat16, float16, float8_e4m3fn)")
        })
    }
}

/// Parses `cpu` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device, EngineError> {
    match s {
        "cpu" => Ok(Device::Cpu),
        _ => {
            let idx = s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse::<usize>().ok())
                .ok_or_else(|| EngineError::Load(format!("unknown device {s:?}; use cpu or cuda:N")))?;
            #[cfg(feature = "cuda")]
            let options = EngineOptions::startup();
            #[cfg(feature = "cuda")]
            if !options.spin_wait {
                if let Err(e) = cuda::device::sleep_in_device_waits(idx) {
                    tracing::warn!(device = s, "waits on the device keep the driver's default scheduling: {e}");
                }
            }
            let d = Device::new_cuda(idx).map_err(|e| {
                EngineError::Load(format!(
                    "cannot open {s}: {e} (was layertap built with `--features cuda`, and is the GPU visible?)"
                ))
            })?;
            #[cfg(feature = "cuda")]
            {
                tracing::info!(
                    device = s,
                    kernels = cuda::module::ARCHS,
                    "CUDA device opened; kernels built for these compute capabilities"
                );
                if !options.pool_release {
                    if let Err(e) = cuda::device::keep_freed_device_memory(&d) {
                        tracing::warn!(device = s, "the device's memory pool keeps its default release threshold: {e}");
                    }
                }
            }
            Ok(d)
        }
    }
}

/// Number of visible CUDA devices (0 without the `cuda` feature).
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        cuda::device::count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Memory used and total on a device, in bytes, or None where it cannot be read (the CPU).
pub fn device_memory(device: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    {
        cuda::device::memory(device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// A handle for reading a device's memory from another thread (the metrics endpoint), taken once
/// the device's model is loaded.
#[derive(Clone)]
pub struct MemoryProbe(Device);

impl MemoryProbe {
    pub fn new(device: &Device) -> Self {
        MemoryProbe(device.clone())
    }

    /// Used and total bytes, where the device reports them (GPUs).
    pub fn sample(&self) -> Option<(u64, u64)> {
        device_memory(&self.0)
    }
}

/// A device's engine, once loaded, with what the server sizes itself by.
pub struct LoadedEngine {
    pub engine: Box<dyn Engine>,
    /// Tokens per batch that fit in the device's free memory, where that can be measured.
    pub max_batch_tokens: Option<usize>,
    pub memory: MemoryProbe,
    /// The start-up self-check of this device's serving path, unless it is off.
    pub selfcheck: Option<selfcheck::Report>,
}

/// How many tokens one forward pass can hold in `free_bytes` of device memory: a conservative
/// estimate of the activations per token (every layer kept as a tap, plus the working set of
/// the most demanding layer kind the model has: see [`ModelConfig::layer_bytes_per_token`])
/// plus, where the portable attention runs (not the CUDA kernels, which keep scores on chip), the
/// attention scores of one query chunk of the longest allowed input (f32 scores and
/// probabilities), using 80% of what is free. Whether the CUDA attention kernels serve follows
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
    let per_token = taps + layer + 8 * 2;
    // The CUDA attention kernels keep scores on chip; only the portable path holds them.
    #[cfg(feature = "cuda")]
    let on_chip = EngineOptions::startup().cuda_attention && cuda::attention::supported(device, dtype, cfg.head_dim);
    #[cfg(not(feature = "cuda"))]
    let on_chip = {
        let _ = device;
        false
    };
    let has_attention = !on_chip && cfg.layers.iter().any(|l| l.mixer == config::MixerKind::FullAttention);
    let chunk = layers::sdpa::QUERY_CHUNK.min(max_input_tokens) as u64;
    let scores = if has_attention {
        cfg.num_attention_heads as u64 * chunk * max_input_tokens as u64 * (4 + 4 + b) * 2
    } else {
        0
    };
    let budget = (free_bytes as f64 * 0.8) as u64;
    (budget.saturating_sub(scores) / per_token.max(1)) as usize
}

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
    pub dtype: OutDType,
    pub layer_kinds: LayerKinds,
}

impl ModelInfo {
    pub fn new(model_id: &str, cfg: &ModelConfig, dtype: OutDType) -> Self {
        ModelInfo {
            model_id: model_id.into(),
            architecture: cfg.architecture.clone(),
            num_layers: cfg.num_hidden_layers,
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            dtype,
            layer_kinds: cfg.layer_kinds(),
        }
    }
}

/// A batch whose device work is under way; [`Pending::wait`] finishes it (on GPUs: waits for
/// the copy of its hidden states to host memory, which runs on a second stream while the device
/// computes the next batch).
pub struct Pending(Box<dyn FnOnce() -> Result<Taps, EngineError> + Send>);

impl Pending {
    /// A batch that `finish` completes.
    pub fn new(finish: impl FnOnce() -> Result<Taps, EngineError> + Send + 'static) -> Self {
        Pending(Box::new(finish))
    }

    /// An already finished batch.
    pub fn ready(result: Result<Taps, EngineError>) -> Self {
        Pending(Box::new(move || result))
    }

    pub fn wait(self) -> Result<Taps, EngineError> {
        (self.0)()
    }
}

/// What the batching layer needs from a device worker. The real implementation wraps the
/// decoder; tests use a fake.
pub trait Engine: Send {
    fn forward(&mut self, batch: &Batch) -> Result<Taps, EngineError>;

    /// Starts `batch` and returns what completes it, so the caller can start the next batch
    /// before this one's results are in host memory. The default does all the work now.
    fn launch(&mut self, batch: &Batch) -> Result<Pending, EngineError> {
        Ok(Pending::ready(self.forward(batch)))
    }

    /// [`Engine::launch`], asking `cancel` between layers and stopping with
    /// [`EngineError::Cancelled`] once it says nobody wants the batch. What the batching worker
    /// calls. The default never stops early.
    fn launch_cancellable(&mut self, batch: &Batch, cancel: &Cancel) -> Result<Pending, EngineError> {
        let _ = cancel;
        self.launch(batch)
    }
}

/// The real engine: a resident decoder on one device.
pub struct ModelEngine {
    pub decoder: decoder::Decoder,
    /// The copies of results to the host, on CUDA devices.
    #[cfg(feature = "cuda")]
    copies: Option<cuda::pinned::HostCopies>,
}

impl ModelEngine {
    pub fn new(decoder: decoder::Decoder) -> Result<Self, EngineError> {
        #[cfg(feature = "cuda")]
        {
            let copies = cuda::pinned::HostCopies::for_device(decoder.device(), decoder.options().spin_wait)?;
            Ok(ModelEngine { decoder, copies })
        }
        #[cfg(not(feature = "cuda"))]
        Ok(ModelEngine { decoder })
    }
}

impl Engine for ModelEngine {
    fn forward(&mut self, batch: &Batch) -> Result<Taps, EngineError> {
        self.launch(batch)?.wait()
    }

    fn launch(&mut self, batch: &Batch) -> Result<Pending, EngineError> {
        self.launch_cancellable(batch, &Cancel::never())
    }

    fn launch_cancellable(&mut self, batch: &Batch, cancel: &Cancel) -> Result<Pending, EngineError> {
        let vocab = self.decoder.cfg.vocab_size;
        if let Some(bad) = batch.input_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is out of range: the vocabulary has {vocab} entries (0..{})",
                vocab - 1
            )));
        }
        let cu = &batch.cu_seqlens;
        if cu.first() != Some(&0) || cu.last() != Some(&batch.input_ids.len()) || cu.windows(2).any(|w| w[1] <= w[0]) {
            return Err(EngineError::InvalidInput(
                "cu_seqlens must start at 0, end at the token count and grow strictly (no empty sequence)".into(),
            ));
        }
        let n = self.decoder.cfg.num_hidden_layers;
        if let Some(l) = batch.layers.iter().find(|&&l| l > n + 1) {
            return Err(EngineError::InvalidInput(format!(
                "layer index {l} is out of range 0..={} ({} is the pre-norm final state)",
                n + 1,
                n + 1
            )));
        }
        batch.output.check(batch.input_ids.len())?;
        let device = self.decoder.device().clone();
        let ids = Tensor::new(batch.input_ids.as_slice(), &device)?;
        let packing = self.decoder.packing(cu)?;
        let mut layers_run = 0;
        let states = self.decoder.forward_taps(&ids, &packing, &batch.layers, &mut layers_run, cancel)?;
        // Candle's stack copies with 32-bit indices, which wrap once the taps pass 2^32 elements
        // (262,144 tokens x 5 layers x 4,096); on CUDA a kernel of ours indexes in 64 bits.
        #[cfg(feature = "cuda")]
        let stacked = if device.is_cuda() && !states.is_empty() && states.iter().all(|s| s.rank() == 2) {
            cuda::ops::stack_rows(&states)?
        } else {
            Tensor::stack(&states, 1)?
        };
        #[cfg(not(feature = "cuda"))]
        let stacked = Tensor::stack(&states, 1)?;
        drop(states);
        let layers = batch.layers.clone();
        let dtype = OutDType::from_candle(stacked.dtype());
        let hidden = self.decoder.cfg.hidden_size;
        // Selection, screen and quantisation run here, on the device, before any copy.
        let prepared = output::prepare(&stacked, &batch.output)?;
        drop(stacked);
        #[cfg(feature = "cuda")]
        if let Some(copies) = &self.copies {
            return Ok(Pending::new(copies.start(layers, prepared, dtype, hidden, layers_run)?));
        }
        Ok(Pending::ready(Taps::from_prepared(layers, prepared, dtype, hidden, layers_run)))
    }
}
