//! Running batches: the [`Engine`] a device worker drives, the real one over a resident decoder,
//! a batch under way ([`Pending`]) and the cancellation the engine checks between layers.

use candle_core::Tensor;

#[cfg(feature = "cuda")]
use super::cuda;
use super::logprobs::{self, DeviceTopK, LogprobRows};
use super::{decoder, output, selfcheck, Batch, EngineError, Fp8Taps, HostTensor, MemoryProbe, OutDType, Taps};

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

/// A device's engine, once loaded, with what the server sizes itself by.
pub struct LoadedEngine {
    pub engine: Box<dyn Engine>,
    /// Tokens per batch that fit in the device's free memory, where that can be measured.
    pub max_batch_tokens: Option<usize>,
    pub memory: MemoryProbe,
    /// The start-up self-check of this device's serving path, unless it is off.
    pub selfcheck: Option<selfcheck::Report>,
    /// Its stages, in order (empty where the engine does not say: a test's fake).
    pub stages: Vec<super::StageLayout>,
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
            let copies = cuda::pinned::HostCopies::for_device(decoder.output_device(), decoder.options().spin_wait)?;
            Ok(ModelEngine { decoder, copies })
        }
        #[cfg(not(feature = "cuda"))]
        Ok(ModelEngine { decoder })
    }
}

impl ModelEngine {
    /// The log-probabilities of the rows `l` names, from the final-norm state `last`
    /// `[tokens, hidden]` of `batch`: only those rows go through the head, on the device.
    fn logprobs(&self, last: &Tensor, l: &LogprobRows, batch: &Batch) -> Result<DeviceTopK, EngineError> {
        let head = self.decoder.head().ok_or_else(|| EngineError::InvalidInput("no output head".into()))?;
        let (rows, targets) = logprobs::rows_and_targets(&l.rows, &batch.input_ids, &batch.cu_seqlens);
        let states = match &l.rows {
            output::Rows::All => last.clone(),
            output::Rows::Only(_) => last.index_select(&Tensor::new(rows.as_slice(), last.device())?, 0)?,
        };
        logprobs::top_k_capped(&states, head, l.top_k, &targets, self.decoder.cfg.final_logit_softcapping)
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
        if let Some((max, why)) = self.decoder.cfg.max_sequence_tokens() {
            if let Some(len) = cu.windows(2).map(|w| w[1] - w[0]).find(|&len| len > max) {
                return Err(EngineError::InvalidInput(format!("a sequence of {len} tokens is refused: {why}")));
            }
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
        let lp = batch.output.logprobs.as_ref();
        if lp.is_some() && self.decoder.head().is_none() {
            return Err(EngineError::InvalidInput(
                "this model has no output head (no lm_head tensor and untied embeddings), so it gives no \
                 log-probabilities"
                    .into(),
            ));
        }
        let ids = Tensor::new(batch.input_ids.as_slice(), self.decoder.device())?;
        // The states come back on the last stage's device, where they are prepared and copied out.
        #[cfg(feature = "cuda")]
        let device = self.decoder.output_device().clone();
        let mut layers_run = 0;
        // Log-probabilities read the final-norm state (index L), computed for them when the
        // caller did not ask for it.
        let mut taps = batch.layers.clone();
        let extra = lp.is_some() && !taps.contains(&n);
        if extra {
            taps.push(n);
        }
        let mut states = self.decoder.forward_taps(&ids, cu, &taps, &mut layers_run, cancel)?;
        let logprobs = match lp {
            Some(l) => {
                let at = taps.iter().position(|&t| t == n).unwrap_or(0);
                let last = if extra { states.pop() } else { states.get(at).cloned() };
                let last = last.ok_or_else(|| EngineError::InvalidInput("the final state was not computed".into()))?;
                Some(self.logprobs(&last, l, batch)?)
            }
            None => None,
        };
        let layers = batch.layers.clone();
        let hidden = self.decoder.cfg.hidden_size;
        if states.is_empty() {
            // Log-probabilities only: the answer's rows hold no layers.
            let dtype = OutDType::from_candle(self.decoder.dtype());
            let (plain, fp8, _) = batch.output.row_counts(batch.input_ids.len());
            let mut taps = Taps::from_prepared(
                layers,
                output::Prepared { plain: None, fp8: None, logprobs },
                dtype,
                hidden,
                layers_run,
            )?;
            taps.host = HostTensor::no_layers(dtype, plain, 0, hidden);
            if fp8 > 0 {
                let host = HostTensor::no_layers(OutDType::Float8E4M3, fp8, 0, hidden);
                taps.fp8 = Some(Fp8Taps { host, scale: Vec::new(), nonfinite: Vec::new() });
            }
            return Ok(Pending::ready(Ok(taps)));
        }
        // Candle's stack copies with 32-bit indices, which wrap once the taps pass 2^32 elements
        // (262,144 tokens x 5 layers x 4,096); on CUDA a kernel of ours indexes in 64 bits.
        #[cfg(feature = "cuda")]
        let stacked = if device.is_cuda() && states.iter().all(|s| s.rank() == 2) {
            cuda::ops::stack_rows(&states)?
        } else {
            Tensor::stack(&states, 1)?
        };
        #[cfg(not(feature = "cuda"))]
        let stacked = Tensor::stack(&states, 1)?;
        drop(states);
        let dtype = OutDType::from_candle(stacked.dtype());
        // Selection, screen and quantisation run here, on the device, before any copy.
        let mut prepared = output::prepare(&stacked, &batch.output)?;
        prepared.logprobs = logprobs;
        drop(stacked);
        #[cfg(feature = "cuda")]
        if let Some(copies) = &self.copies {
            return Ok(Pending::new(copies.start(layers, prepared, dtype, hidden, layers_run)?));
        }
        Ok(Pending::ready(Taps::from_prepared(layers, prepared, dtype, hidden, layers_run)))
    }
}
