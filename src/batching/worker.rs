use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use super::queue::{Item, Queue};
use super::{BatchError, Part};
use crate::engine::{Batch, Engine, EngineError, LoadedEngine, MemoryProbe, Pending};
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
        // The device thread launches batches; a second thread waits for each one's results and
        // hands them out, so the device starts the next batch while the last one is copied out.
        // The rendezvous channel keeps at most one batch waiting beside the one being launched.
        let (tx, rx) = std::sync::mpsc::sync_channel::<Launched>(0);
        let finisher = std::thread::Builder::new().name(format!("layertap-{name}-finish")).spawn({
            let queue = queue.clone();
            move || rx.into_iter().for_each(|l| finish_batch(&queue, l))
        });
        let finisher = match finisher {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(device = %name, error = %e, "cannot start the result thread; serving without it");
                while let Some(items) = queue.next_batch() {
                    if let Some(l) = launch_batch(engine.as_mut(), &queue, items) {
                        finish_batch(&queue, l);
                    }
                }
                return;
            }
        };
        while let Some(items) = queue.next_batch() {
            if let Some(l) = launch_batch(engine.as_mut(), &queue, items) {
                if let Err(back) = tx.send(l) {
                    finish_batch(&queue, back.0);
                }
            }
        }
        drop(tx);
        if finisher.join().is_err() {
            tracing::error!(device = %name, "result thread panicked");
        }
        tracing::info!(device = %name, "worker stopped");
    })?;
    Ok(WorkerHandle { device, join: Some(join) })
}

/// A batch whose device work has been started.
struct Launched {
    items: Vec<Item>,
    pending: Pending,
    start: Instant,
    tokens: usize,
    cu: Vec<usize>,
    lens: Vec<usize>,
}

fn fail_all(items: &[Item], e: EngineError, tokens: usize) {
    tracing::error!(error = %e, tokens, "batch failed");
    let err = match e {
        EngineError::InvalidInput(msg) => BatchError::Invalid(msg),
        other => BatchError::Internal(other.to_string()),
    };
    items.iter().for_each(|i| i.req.fail(err.clone()));
}

fn panicked(items: &[Item], tokens: usize) {
    tracing::error!(tokens, "the engine panicked on a batch");
    items.iter().for_each(|i| i.req.fail(BatchError::Internal("the engine failed on this batch".into())));
}

/// Builds the packed batch and starts it on the device; `None` when it failed at once (the
/// requests are answered with the error).
fn launch_batch(engine: &mut dyn Engine, queue: &Queue, items: Vec<Item>) -> Option<Launched> {
    let m = &queue.metrics;
    let lens: Vec<usize> = items.iter().map(|i| i.ids().len()).collect();
    let cu = cu_seqlens(lens.iter());
    let all_layers: Vec<usize> = items.iter().flat_map(|i| i.req.sub.layers.iter().copied()).collect();
    let batch = Batch {
        input_ids: items.iter().flat_map(|i| i.ids().iter().copied()).collect(),
        cu_seqlens: cu.clone(),
        layers: distinct(&all_layers),
    };
    let tokens = batch.input_ids.len();
    let start = Instant::now();
    for it in &items {
        it.req.started(start, m);
    }
    match std::panic::catch_unwind(AssertUnwindSafe(|| engine.launch(&batch))) {
        Ok(Ok(pending)) => Some(Launched { items, pending, start, tokens, cu, lens }),
        Ok(Err(e)) => {
            fail_all(&items, e, tokens);
            None
        }
        Err(_) => {
            panicked(&items, tokens);
            None
        }
    }
}

/// Waits for a launched batch's results and hands each request its part.
fn finish_batch(queue: &Queue, l: Launched) {
    let m = &queue.metrics;
    let Launched { items, pending, start, tokens, cu, lens } = l;
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| pending.wait()));
    m.inference_duration.observe(start.elapsed().as_secs_f64());
    m.batch_tokens.observe(tokens as f64);
    m.batch_sequences.observe(items.len() as f64);
    let taps = match result {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return fail_all(&items, e, tokens),
        Err(_) => return panicked(&items, tokens),
    };
    m.tokens.inc_by(tokens as u64);
    let taps = Arc::new(taps);
    for (k, it) in items.iter().enumerate() {
        it.req.complete(it.idx, Part { taps: taps.clone(), start: cu[k], rows: lens[k] });
    }
}
