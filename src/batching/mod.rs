//! Dynamic batching: a token-budgeted queue of sequences shared by one worker thread per device.
//! Requests are admitted (or refused with 429) in one place, [`Scheduler::submit`]; workers pack
//! sequences from many requests into batches and hand each request its own slices back.

mod queue;
mod worker;

use std::sync::Arc;
use std::time::Duration;

pub use queue::{Queue, SubmitError};
pub use worker::{spawn_worker, Loaded, WorkerHandle};

use crate::engine::{EngineError, HostTensor, OutDType, Taps};
use crate::tokenizer::Tokenized;

/// A validated, tokenized request, ready to queue. The caller keeps its own handle on `seqs` to
/// build the answer; the output dtype and metadata never enter the queue.
#[derive(Clone, Debug)]
pub struct Submission {
    pub seqs: Arc<Vec<Tokenized>>,
    /// Resolved hidden-state indices, in the order the caller asked, each once.
    pub layers: Arc<[usize]>,
    /// Per sequence, the positions to return (ascending); `None`: every position.
    pub positions: Option<Arc<Vec<Vec<u32>>>>,
    /// Quantise the returned rows to fp8 on the device.
    pub fp8: bool,
    /// Also the top-k next-token log-probabilities of the returned rows, with this k.
    pub top_k: Option<usize>,
}

impl Submission {
    /// Every row of every sequence, in the compute dtype.
    pub fn new(seqs: Arc<Vec<Tokenized>>, layers: &[usize]) -> Self {
        Submission { seqs, layers: layers.into(), positions: None, fp8: false, top_k: None }
    }

    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.ids.len()).sum()
    }
}

/// One sequence's returned rows: where they sit in its batch's taps (among the plain rows, or
/// among the fp8 rows), and the layers its caller asked for, in the caller's order.
#[derive(Clone)]
pub struct Part {
    pub taps: Arc<Taps>,
    pub layers: Arc<[usize]>,
    pub fp8: bool,
    pub start: usize,
    pub rows: usize,
    /// Where the rows' log-probabilities start among the batch's, when asked.
    pub logprobs: Option<usize>,
}

impl Part {
    /// The rows' bytes as asked, borrowed from the batch where its layout already matches (fp8
    /// rows stay fp8: `dtype` applies to plain rows).
    pub fn bytes(&self, dtype: OutDType) -> Result<std::borrow::Cow<'_, [u8]>, EngineError> {
        if self.fp8 {
            self.taps.fp8_bytes(self.start, self.rows, &self.layers)
        } else {
            self.taps.bytes(self.start, self.rows, &self.layers, dtype)
        }
    }

    /// `[rows, layers, hidden]` in `dtype` (a host copy; run it off the async runtime); fp8 rows
    /// as fp8.
    pub fn gather(&self, dtype: OutDType) -> Result<HostTensor, EngineError> {
        if self.fp8 {
            let data = self.taps.fp8_bytes(self.start, self.rows, &self.layers)?.into_owned();
            let hidden = self.taps.host.shape.get(2).copied().unwrap_or(0);
            return Ok(HostTensor {
                dtype: OutDType::Float8E4M3,
                shape: vec![self.rows, self.layers.len(), hidden],
                data: data.into(),
            });
        }
        self.taps.gather(self.start, self.rows, &self.layers, dtype)
    }

    /// `[rows, layers]` scales of fp8 rows.
    pub fn scale(&self) -> Result<Vec<f32>, EngineError> {
        self.taps.fp8_scale(self.start, self.rows, &self.layers)
    }

    /// `[rows, layers]`: 1 where a row holds a NaN or an infinity at that layer as it is sent
    /// in `dtype` (fp8 rows: before quantisation, whose scales keep finite values finite).
    pub fn nonfinite(&self, dtype: OutDType) -> Result<Vec<u8>, EngineError> {
        self.taps.nonfinite(self.fp8, self.start, self.rows, &self.layers, dtype)
    }

    /// The rows' top-`k` ids `[rows, k]`, their log-probabilities `[rows, k]` and the next
    /// token's log-probability `[rows]` (NaN on a sequence's last row).
    pub fn logprobs(&self, k: usize) -> Result<crate::engine::logprobs::RowsLogprobs, EngineError> {
        let (Some(start), Some(lp)) = (self.logprobs, self.taps.logprobs.as_ref()) else {
            return Err(EngineError::InvalidInput("this batch computed no log-probabilities".into()));
        };
        lp.slice(start, self.rows, k)
    }
}

/// Each sequence of a submission, in order, as a slice of its batch's taps.
pub struct Answer {
    pub parts: Vec<Part>,
    pub queue_time: Duration,
    pub inference_time: Duration,
}

/// Why a queued request failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BatchError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Internal(String),
    /// A sequence does not fit in the device's memory even in a batch of its own.
    #[error("{0}")]
    TooLarge(String),
}

/// The one admission point, shared by the HTTP layer.
pub type Scheduler = Arc<Queue>;
