//! The model engine: the only part of layertap that touches candle. It loads a decoder and runs
//! forward passes over packed batches, keeping the hidden states of the requested layers.

pub mod attention;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda_attention;
#[cfg(feature = "cuda")]
pub mod cuda_ops;
pub mod gguf;
pub mod loader;
pub mod model;
pub mod rope;
pub mod weights;

use candle_core::Tensor;
pub use candle_core::{DType, Device};

pub use config::{resolve_layers, Family, ModelConfig, SUPPORTED_ARCHITECTURES};
pub use loader::{load, LoadedModel, TokenizerSource};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded; the message says what is wrong and how to fix it.
    #[error("{0}")]
    Load(String),
    /// The caller asked for something the model cannot do (layer out of range, token id too large).
    #[error("{0}")]
    InvalidInput(String),
    #[error("model computation failed: {0}")]
    Compute(#[from] candle_core::Error),
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
}

impl OutDType {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(OutDType::Float32),
            "bf16" | "bfloat16" => Some(OutDType::Bfloat16),
            "f16" | "float16" => Some(OutDType::Float16),
            _ => None,
        }
    }

    pub fn candle(self) -> DType {
        match self {
            OutDType::Float32 => DType::F32,
            OutDType::Bfloat16 => DType::BF16,
            OutDType::Float16 => DType::F16,
        }
    }

    pub fn from_candle(d: DType) -> Self {
        match d {
            DType::BF16 => OutDType::Bfloat16,
            DType::F16 => OutDType::Float16,
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
        }
    }
}

impl std::str::FromStr for OutDType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        OutDType::parse(s)
            .ok_or_else(|| format!("unknown dtype {s:?}; use f32, bf16 or f16 (or float32, bfloat16, float16)"))
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
            Device::new_cuda(idx).map_err(|e| {
                EngineError::Load(format!(
                    "cannot open {s}: {e} (was layertap built with `--features cuda`, and is the GPU visible?)"
                ))
            })
        }
    }
}

/// Number of visible CUDA devices (0 without the `cuda` feature).
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().map(|n| n as usize).unwrap_or(0)
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
        if let Device::Cuda(d) = device {
            return d
                .cuda_stream()
                .context()
                .mem_get_info()
                .ok()
                .map(|(free, total)| ((total - free) as u64, total as u64));
        }
    }
    let _ = device;
    None
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
}

/// How many tokens one forward pass can hold in `free_bytes` of device memory: a conservative
/// estimate of the activations per token (residual stream, norm output, q/k/v, attention output,
/// the MLP's gate/up/activation, every layer kept as a tap) plus the attention scores of one
/// query chunk of the longest allowed input (f32 scores and probabilities), using 80% of what
/// is free.
pub fn tokens_for_memory(cfg: &ModelConfig, dtype: DType, free_bytes: u64, max_input_tokens: usize) -> usize {
    let b = dtype.size_in_bytes() as u64;
    let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let qkv = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim) as u64;
    let attn = (cfg.num_attention_heads * cfg.head_dim) as u64;
    // Every index may be tapped (L + 1 states), kept in f32 (the residual stream on CUDA) and
    // stacked in the compute dtype, plus the previous batch's stack still being copied out; and
    // the working set of one layer.
    let taps = (cfg.num_hidden_layers as u64 + 1) * h * (4 + 2 * b);
    let per_token = taps + b * (4 * h + 2 * qkv + attn + 3 * i) + 8 * 2;
    let chunk = attention::QUERY_CHUNK.min(max_input_tokens) as u64;
    let scores = cfg.num_attention_heads as u64 * chunk * max_input_tokens as u64 * (4 + 4 + b) * 2;
    let budget = (free_bytes as f64 * 0.8) as u64;
    (budget.saturating_sub(scores) / per_token.max(1)) as usize
}

/// Sequences packed along one token dimension, and the layers wanted from them.
#[derive(Clone, Debug)]
pub struct Batch {
    pub input_ids: Vec<u32>,
    /// `n + 1` offsets: sequence `i` is `input_ids[cu_seqlens[i]..cu_seqlens[i + 1]]`.
    pub cu_seqlens: Vec<usize>,
    /// Resolved hidden-state indices in `0..=num_layers`, each at most once.
    pub layers: Vec<usize>,
}

/// Hidden states of a batch in host memory: `[total_tokens, layers.len(), hidden]` in the
/// compute dtype, copied from the device in one transfer. [`Taps::gather`] cuts out one
/// sequence's rows and layers; it runs wherever the answer is encoded, off the device's thread.
pub struct Taps {
    /// The indices in `host`'s second dimension.
    pub layers: Vec<usize>,
    pub host: HostTensor,
    /// Decoder layers actually run (early exit stops after the deepest requested index).
    pub layers_run: usize,
}

impl Taps {
    /// The bytes of tokens `start..start + rows` without copying, when they are already laid out
    /// as asked: the same layers in the same order and the same dtype. Otherwise `None` (use
    /// [`Taps::gather`]).
    pub fn view(&self, start: usize, rows: usize, layers: &[usize], dtype: OutDType) -> Option<&[u8]> {
        let [total, width, hidden] = self.host.shape[..] else { return None };
        if layers != self.layers.as_slice() || dtype != self.host.dtype || start + rows > total {
            return None;
        }
        let row = width * hidden * dtype.size_in_bytes();
        self.host.data.get(start * row..(start + rows) * row)
    }

    /// The bytes of tokens `start..start + rows` as asked: borrowed from the batch's buffer when
    /// [`Taps::view`] can, a gathered copy otherwise. What every answer is written from.
    pub fn bytes(
        &self,
        start: usize,
        rows: usize,
        layers: &[usize],
        dtype: OutDType,
    ) -> Result<std::borrow::Cow<'_, [u8]>, EngineError> {
        match self.view(start, rows, layers, dtype) {
            Some(v) => Ok(std::borrow::Cow::Borrowed(v)),
            None => Ok(std::borrow::Cow::Owned(self.gather(start, rows, layers, dtype)?.data.into_vec())),
        }
    }

    /// `[rows, layers.len(), hidden]` for tokens `start..start + rows`, layers in the given order
    /// (each must be one of `self.layers`), in `dtype`.
    pub fn gather(
        &self,
        start: usize,
        rows: usize,
        layers: &[usize],
        dtype: OutDType,
    ) -> Result<HostTensor, EngineError> {
        let [total, width, hidden] = self.host.shape[..] else {
            return Err(EngineError::InvalidInput("taps must be [tokens, layers, hidden]".into()));
        };
        if start + rows > total {
            return Err(EngineError::InvalidInput(format!("rows {start}..{} past {total} tokens", start + rows)));
        }
        let cols = layers
            .iter()
            .map(|l| {
                self.layers
                    .iter()
                    .position(|x| x == l)
                    .ok_or_else(|| EngineError::InvalidInput(format!("layer {l} was not part of this batch")))
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let es = self.host.dtype.candle().size_in_bytes();
        let row_bytes = hidden * es;
        let mut data = Vec::with_capacity(rows * cols.len() * row_bytes);
        for r in start..start + rows {
            for &c in &cols {
                let at = (r * width + c) * row_bytes;
                data.extend_from_slice(&self.host.data[at..at + row_bytes]);
            }
        }
        let out = HostTensor { dtype: self.host.dtype, shape: vec![rows, cols.len(), hidden], data: data.into() };
        Ok(out.to_dtype(dtype))
    }
}

/// The bytes of 16-bit floats in memory order (one copy).
fn half_bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    const { assert!(std::mem::size_of::<T>() == 2) };
    // SAFETY: `T` is half::bf16 or half::f16, both `#[repr(transparent)]` over u16: plain 2-byte
    // values with no padding, so every byte of the slice is initialised and readable as u8.
    let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) };
    bytes.to_vec()
}

#[cfg(target_endian = "big")]
compile_error!("layertap writes little-endian safetensors from memory and needs a little-endian host");

/// A host buffer lent by a device (page-locked memory that goes back to its pool when dropped).
pub trait LentBuffer: Send + Sync {
    fn bytes(&self) -> &[u8];
}

/// Bytes in host memory: a vector, or a buffer lent by a device.
pub enum HostBytes {
    Vec(Vec<u8>),
    Lent(Box<dyn LentBuffer>),
}

impl std::ops::Deref for HostBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            HostBytes::Vec(v) => v,
            HostBytes::Lent(b) => b.bytes(),
        }
    }
}

impl HostBytes {
    /// The bytes as a vector (no copy when they already are one).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            HostBytes::Vec(v) => v,
            lent => lent.to_vec(),
        }
    }
}

impl From<Vec<u8>> for HostBytes {
    fn from(v: Vec<u8>) -> Self {
        HostBytes::Vec(v)
    }
}

impl Clone for HostBytes {
    fn clone(&self) -> Self {
        HostBytes::Vec(self.to_vec())
    }
}

impl PartialEq for HostBytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len())
    }
}

/// A dense tensor in host memory as little-endian bytes: what the codec writes out.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dtype: OutDType,
    pub shape: Vec<usize>,
    pub data: HostBytes,
}

impl HostTensor {
    fn from_tensor(t: &Tensor, dtype: OutDType) -> Result<Self, EngineError> {
        let flat = t.flatten_all()?;
        // Little-endian host (checked at compile time below): memory order is the file order.
        let data = match dtype {
            OutDType::Float32 => bytemuck::cast_slice(&flat.to_vec1::<f32>()?).to_vec(),
            OutDType::Bfloat16 => half_bytes(&flat.to_vec1::<half::bf16>()?),
            OutDType::Float16 => half_bytes(&flat.to_vec1::<half::f16>()?),
        };
        Ok(HostTensor { dtype, shape: t.dims().to_vec(), data: data.into() })
    }

    /// `[..]` f32 values as a host tensor (for engines other than the model, e.g. test fakes).
    pub fn from_f32(values: &[f32], shape: Vec<usize>) -> Self {
        HostTensor { dtype: OutDType::Float32, shape, data: bytemuck::cast_slice(values).to_vec().into() }
    }

    /// The same values in another dtype (round to nearest even when narrowing).
    pub fn to_dtype(self, dtype: OutDType) -> Self {
        if dtype == self.dtype {
            return self;
        }
        let v = self.to_f32();
        let data = match dtype {
            OutDType::Float32 => bytemuck::cast_slice(&v).to_vec(),
            OutDType::Bfloat16 => half_bytes(&v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>()),
            OutDType::Float16 => half_bytes(&v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>()),
        };
        HostTensor { dtype, shape: self.shape, data: data.into() }
    }

    /// Values as f32 (for tests and JSON output).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            OutDType::Float32 => {
                self.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            OutDType::Bfloat16 => {
                self.data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
            OutDType::Float16 => {
                self.data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
        }
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
}

/// The real engine: a resident decoder on one device.
pub struct ModelEngine {
    pub decoder: model::Decoder,
    /// The stream that copies results to the host, on CUDA devices.
    #[cfg(feature = "cuda")]
    copy_stream: Option<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>>,
    #[cfg(feature = "cuda")]
    pinned: Option<std::sync::Arc<cuda_copy::PinnedPool>>,
}

impl ModelEngine {
    pub fn new(decoder: model::Decoder) -> Result<Self, EngineError> {
        #[cfg(feature = "cuda")]
        {
            let (copy_stream, pinned) = match decoder.device() {
                Device::Cuda(d) => {
                    let ctx = d.cuda_stream().context().clone();
                    let stream = ctx
                        .new_stream()
                        .map_err(|e| EngineError::Load(format!("cannot create a CUDA copy stream: {e}")))?;
                    (Some(stream), Some(cuda_copy::PinnedPool::new(ctx)))
                }
                _ => (None, None),
            };
            Ok(ModelEngine { decoder, copy_stream, pinned })
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
        if let Some(l) = batch.layers.iter().find(|&&l| l > n) {
            return Err(EngineError::InvalidInput(format!("layer index {l} is out of range 0..={n}")));
        }
        let device = self.decoder.device().clone();
        let ids = Tensor::new(batch.input_ids.as_slice(), &device)?;
        let packing = self.decoder.packing(cu)?;
        let mut layers_run = 0;
        let states = self.decoder.forward_taps(&ids, &packing, &batch.layers, &mut layers_run)?;
        let stacked = Tensor::stack(&states, 1)?;
        drop(states);
        let layers = batch.layers.clone();
        let dtype = OutDType::from_candle(stacked.dtype());
        #[cfg(feature = "cuda")]
        if let (Some(stream), Some(pool)) = (&self.copy_stream, &self.pinned) {
            let (stream, pool) = (stream.clone(), pool.clone());
            return Ok(Pending::new(move || {
                let host = cuda_copy::to_host(&stacked, dtype, &stream, &pool)?;
                Ok(Taps { layers, host, layers_run })
            }));
        }
        let host = HostTensor::from_tensor(&stacked, dtype)?;
        Ok(Pending::ready(Ok(Taps { layers, host, layers_run })))
    }
}

/// Device-to-host copies on a stream of their own, into page-locked buffers that are reused.
#[cfg(feature = "cuda")]
mod cuda_copy {
    use super::{EngineError, HostBytes, HostTensor, LentBuffer, OutDType};
    use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};
    use candle_core::cuda_backend::CudaStorageSlice;
    use candle_core::{Storage, Tensor};
    use std::sync::{Arc, Mutex};

    fn fail(msg: String) -> EngineError {
        EngineError::Compute(candle_core::Error::Msg(msg))
    }

    /// Page-locked host buffers: the device copies into them directly (no staging, no page
    /// faults), and a buffer returns here when the last answer cut from it is encoded.
    pub struct PinnedPool {
        ctx: Arc<CudaContext>,
        free: Mutex<Vec<PinnedHostSlice<u8>>>,
    }

    /// Buffers are sized in steps of this many bytes so batches of similar size share them.
    const STEP: usize = 64 << 20;
    /// Idle buffers kept for reuse; more are freed.
    const KEEP: usize = 4;

    impl PinnedPool {
        pub fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
            Arc::new(PinnedPool { ctx, free: Mutex::new(Vec::new()) })
        }

        fn take(self: &Arc<Self>, len: usize) -> Result<PinnedBuf, EngineError> {
            let reused = {
                let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
                // The smallest idle buffer that fits.
                let best = free.iter().enumerate().filter(|(_, b)| b.len() >= len).min_by_key(|(_, b)| b.len());
                best.map(|(i, _)| i).map(|i| free.swap_remove(i))
            };
            let buf = match reused {
                Some(b) => b,
                None => {
                    let size = len.div_ceil(STEP).max(1) * STEP;
                    // SAFETY: the memory is uninitialised until the copy writes it; only the first
                    // `len` bytes, which the copy fills, are ever read.
                    unsafe { self.ctx.alloc_pinned_with_flags::<u8>(size, 0) }
                        .map_err(|e| fail(format!("cannot allocate {size} bytes of page-locked host memory: {e}")))?
                }
            };
            Ok(PinnedBuf { buf: Some(buf), len, pool: self.clone() })
        }

        fn give_back(&self, buf: PinnedHostSlice<u8>) {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            free.push(buf);
            if free.len() > KEEP {
                // Drop the smallest: the large ones fit every batch.
                if let Some(i) = free.iter().enumerate().min_by_key(|(_, b)| b.len()).map(|(i, _)| i) {
                    free.swap_remove(i);
                }
            }
        }
    }

    pub struct PinnedBuf {
        buf: Option<PinnedHostSlice<u8>>,
        len: usize,
        pool: Arc<PinnedPool>,
    }

    impl LentBuffer for PinnedBuf {
        fn bytes(&self) -> &[u8] {
            match &self.buf {
                // The copy into it has been waited for before the buffer is handed out.
                Some(b) => b.as_slice().map(|s| &s[..self.len]).unwrap_or(&[]),
                None => &[],
            }
        }
    }

    impl Drop for PinnedBuf {
        fn drop(&mut self) {
            if let Some(b) = self.buf.take() {
                self.pool.give_back(b);
            }
        }
    }

    fn copy<T: DeviceRepr>(
        s: &CudaSlice<T>,
        range: (usize, usize),
        stream: &Arc<CudaStream>,
        pool: &Arc<PinnedPool>,
    ) -> Result<HostBytes, EngineError> {
        let view = s.slice(range.0..range.1);
        let bytes = (range.1 - range.0) * std::mem::size_of::<T>();
        let mut dst = pool.take(bytes)?;
        let buf = dst.buf.as_mut().ok_or_else(|| fail("pinned buffer missing".into()))?;
        // SAFETY: a view of the same bytes as `T` (16- or 32-bit floats, for which every bit
        // pattern is valid); the buffer holds at least `bytes` bytes and is page-aligned.
        let dst_t: &mut [T] = unsafe {
            let p = buf.as_mut_ptr().map_err(|e| fail(format!("pinned buffer: {e}")))?;
            std::slice::from_raw_parts_mut(p.cast::<T>(), range.1 - range.0)
        };
        stream.memcpy_dtoh(&view, dst_t).map_err(|e| fail(format!("device-to-host copy: {e}")))?;
        stream.synchronize().map_err(|e| fail(format!("device-to-host copy: {e}")))?;
        Ok(HostBytes::Lent(Box::new(dst)))
    }

    /// Copies a contiguous tensor into host memory on `stream`, which first waits for the work
    /// that wrote it (the context tracks events once a second stream exists).
    pub fn to_host(
        t: &Tensor,
        dtype: OutDType,
        stream: &Arc<CudaStream>,
        pool: &Arc<PinnedPool>,
    ) -> Result<HostTensor, EngineError> {
        let (storage, layout) = t.storage_and_layout();
        let range =
            layout.contiguous_offsets().ok_or_else(|| fail("hidden states must be contiguous to copy".into()))?;
        let mismatch = || fail("dtype mismatch in the device-to-host copy".into());
        let data = match (&*storage, dtype) {
            (Storage::Cuda(c), OutDType::Bfloat16) => match &c.slice {
                CudaStorageSlice::BF16(s) => copy(s, range, stream, pool)?,
                _ => return Err(mismatch()),
            },
            (Storage::Cuda(c), OutDType::Float16) => match &c.slice {
                CudaStorageSlice::F16(s) => copy(s, range, stream, pool)?,
                _ => return Err(mismatch()),
            },
            (Storage::Cuda(c), OutDType::Float32) => match &c.slice {
                CudaStorageSlice::F32(s) => copy(s, range, stream, pool)?,
                _ => return Err(mismatch()),
            },
            _ => return Err(fail("the device-to-host copy expects a CUDA tensor".into())),
        };
        Ok(HostTensor { dtype, shape: t.dims().to_vec(), data })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taps() -> Taps {
        // 3 tokens, layers [3, 1], hidden 2: value = token * 100 + layer * 10 + component.
        let v: Vec<f32> = (0..3)
            .flat_map(|t| [3usize, 1].into_iter().flat_map(move |l| (0..2).map(move |h| (t * 100 + l * 10 + h) as f32)))
            .collect();
        Taps { layers: vec![3, 1], host: HostTensor::from_f32(&v, vec![3, 2, 2]), layers_run: 3 }
    }

    /// A view is offered exactly when the batch already holds the rows as asked, and then it
    /// is the same bytes a gather would copy.
    #[test]
    fn view_only_when_the_layout_matches_and_then_equals_gather() {
        let t = taps();
        let v = t.view(1, 2, &[3, 1], OutDType::Float32).expect("same layers, same dtype");
        assert_eq!(v, &t.gather(1, 2, &[3, 1], OutDType::Float32).unwrap().data[..]);
        let first: Vec<f32> = v[..8].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(first, vec![130.0, 131.0]);
        assert!(t.view(1, 2, &[1, 3], OutDType::Float32).is_none(), "other layer order");
        assert!(t.view(1, 2, &[3], OutDType::Float32).is_none(), "a subset of layers");
        assert!(t.view(1, 2, &[3, 1], OutDType::Bfloat16).is_none(), "another dtype");
        assert!(t.view(2, 2, &[3, 1], OutDType::Float32).is_none(), "rows past the end");
        // `bytes` borrows exactly when a view exists, and copies the gathered rows otherwise.
        assert!(matches!(t.bytes(1, 2, &[3, 1], OutDType::Float32).unwrap(), std::borrow::Cow::Borrowed(_)));
        let owned = t.bytes(1, 2, &[1, 3], OutDType::Float32).unwrap();
        assert!(matches!(owned, std::borrow::Cow::Owned(_)));
        assert_eq!(&owned[..], &t.gather(1, 2, &[1, 3], OutDType::Float32).unwrap().data[..]);
    }
}
