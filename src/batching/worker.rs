use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use super::queue::{Item, Queue};
use super::{BatchError, Part};
use crate::engine::{Batch, Engine, EngineError, LoadedEngine, MemoryProbe};
use crate::extract::{cu_seqlens, distinct};

/// What a worker reports once its model is resident.
pub struct Loaded {
    pub device: String,
    /// Tokens per batch that fit in the device's free memory, where that can be measured.
    pub max_batch_tokens: Option<usize>,
    pub memory: MemoryProbe,
}

/// A device worker thread. Join it after closing the queue.
pub struct WorkerHandle {
    pub device: String,
    join: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    pub fn join(mut self) {
        if let Some(j) = self.join.take() {
            if j.join().is_err() {
                tracing::error!(device = %self.device, "worker thread panicked");
            }
        }
    }
}

/// Builds the engine on its own thread (a model stays resident on one device), reports the
/// outcome on `loaded`, then serves batches from `queue` until it is closed and drained.
pub fn spawn_worker<F>(
    device: String,
    queue: Arc<Queue>,
    make_engine: F,
    loaded: std::sync::mpsc::Sender<Result<Loaded, String>>,
) -> std::io::Result<WorkerHandle>
where
    F: FnOnce() -> Result<LoadedEngine, EngineError> + Send + 'static,
{
    let name = device.clone();
    let join = std::thread::Builder::new().name(format!("layertap-{device}")).spawn(move || {
        let mut engine = match make_engine() {
            Ok(l) => {
                let report = Loaded { device: name.clone(), max_batch_tokens: l.max_batch_tokens, memory: l.memory };
                let _ = loaded.send(Ok(report));
                drop(loaded);
                l.engine
            }
            Err(e) => {
                let _ = loaded.send(Err(format!("{name}: {e}")));
                return;
            }
        };
        while let Some(items) = queue.next_batch() {
            run_batch(engine.as_mut(), &queue, items);
        }
        tracing::info!(device = %name, "worker stopped");
    })?;
    Ok(WorkerHandle { device, join: Some(join) })
}

fn run_batch(engine: &mut dyn Engine, queue: &Queue, items: Vec<Item>) {
    let m = &queue.metrics;
    let lens: Vec<usize> = items.iter().map(|i| i.ids().len()).collect();
    let cu = cu_seqlens(lens.iter());
    let all_layers: Vec<usize> = items.iter().flat_map(|i| i.req.sub.layers.iter().copied()).collect();
    let batch = Batch {
        input_ids: items.iter().flat_map(|i| i.ids().iter().copied()).collect(),
        cu_seqlens: cu.clone(),
        layers: distinct(&all_layers),
    };
    let start = Instant::now();
    for it in &items {
        it.req.started(start, m);
    }
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| engine.forward(&batch)));
    m.inference_duration.observe(start.elapsed().as_secs_f64());
    m.batch_tokens.observe(batch.input_ids.len() as f64);
    m.batch_sequences.observe(items.len() as f64);
    let taps = match result {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::error!(error = %e, tokens = batch.input_ids.len(), "batch failed");
            let err = match e {
                EngineError::InvalidInput(msg) => BatchError::Invalid(msg),
                other => BatchError::Internal(other.to_string()),
            };
            items.iter().for_each(|i| i.req.fail(err.clone()));
            return;
        }
        Err(_) => {
            tracing::error!(tokens = batch.input_ids.len(), "the engine panicked on a batch");
            items.iter().for_each(|i| i.req.fail(BatchError::Internal("the engine failed on this batch".into())));
            return;
        }
    };
    m.tokens.inc_by(batch.input_ids.len() as u64);
    let taps = Arc::new(taps);
    for (k, it) in items.iter().enumerate() {
        it.req.complete(it.idx, Part { taps: taps.clone(), start: cu[k], rows: lens[k] });
    }
}
