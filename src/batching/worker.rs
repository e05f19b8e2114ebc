use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use super::queue::{Item, Queue, Request};
use super::{BatchError, Part};
use crate::engine::{
    Batch, Cancel, Engine, EngineError, LoadedEngine, LogprobRows, MemoryProbe, Output, Pending, Rows,
};

/// What a worker reports once its model is resident.
pub struct Loaded {
    pub device: String,
    /// Tokens per batch that fit in the device's free memory, where that can be measured.
    pub max_batch_tokens: Option<usize>,
    pub memory: MemoryProbe,
    /// The start-up self-check of the device's serving path, unless it is off.
    pub selfcheck: Option<crate::engine::selfcheck::Report>,
    /// The replica's stages, in order.
    pub stages: Vec<crate::engine::StageLayout>,
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
                let report = Loaded {
                    device: name.clone(),
                    max_batch_tokens: l.max_batch_tokens,
                    memory: l.memory,
                    selfcheck: l.selfcheck,
                    stages: l.stages,
                };
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
        // (Named `finish-<device>`: a thread's name holds 15 bytes, and `layertap-<device>-finish`
        // would read as the device thread's own name in `top -H` and /proc.)
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(0);
        let finisher = std::thread::Builder::new().name(format!("finish-{name}")).spawn({
            let queue = queue.clone();
            move || {
                rx.into_iter().for_each(|job| {
                    if let Job::Finish(l) = job {
                        finish_batch(&queue, l)
                    }
                })
            }
        });
        let finisher = match finisher {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(device = %name, error = %e, "cannot start the result thread; serving without it");
                while let Some(items) = queue.next_batch() {
                    if let Some(l) = launch_batch(engine.as_mut(), &queue, items, &|| ()) {
                        finish_batch(&queue, l);
                    }
                }
                return;
            }
        };
        // Handing the result thread a no-op returns once it has finished the batch before:
        // after an out-of-memory error, the memory that batch held is free again.
        let flush = || {
            let _ = tx.send(Job::Flush);
        };
        while let Some(items) = queue.next_batch() {
            if let Some(l) = launch_batch(engine.as_mut(), &queue, items, &flush) {
                if let Err(back) = tx.send(Job::Finish(l)) {
                    if let Job::Finish(l) = back.0 {
                        finish_batch(&queue, l);
                    }
                }
            }
        }
        drop(tx);
        if finisher.join().is_err() {
            tracing::error!(device = %name, "result thread panicked");
        }
        // The last batch collected may have been put back (out of memory) after the queue
        // closed: run what is left here. The queue is closed, so this never blocks.
        while let Some(items) = queue.next_batch() {
            if let Some(l) = launch_batch(engine.as_mut(), &queue, items, &|| ()) {
                finish_batch(&queue, l);
            }
        }
        tracing::info!(device = %name, "worker stopped");
    })?;
    Ok(WorkerHandle { device, join: Some(join) })
}

/// What the device thread hands the result thread.
enum Job {
    Finish(Launched),
    /// Nothing to do: received once the batch before it is finished.
    Flush,
}

/// A batch whose device work has been started.
struct Launched {
    items: Vec<Item>,
    pending: Pending,
    start: Instant,
    tokens: usize,
    /// Per item: where its rows are.
    places: Vec<Place>,
}

/// Where an item's rows land: among the fp8 rows or not, first row, rows, and the first of its
/// log-probability rows when it asked for them.
#[derive(Clone, Copy)]
struct Place {
    fp8: bool,
    start: usize,
    rows: usize,
    logprobs: Option<usize>,
}

/// The rows a batch returns for its items (each item's request says which of its positions, and
/// whether as fp8), and where each item's rows land among the plain or the fp8 rows. Every row
/// in the compute dtype when no item selects or quantises (the usual case, with no copy). Items
/// that ask for log-probabilities have them for the same rows, computed with the largest k any
/// of them asks (each takes the first k of its own).
fn output_of(items: &[Item], cu: &[usize]) -> (Output, Vec<Place>) {
    let plain_all = items.iter().all(|i| !i.req.sub.fp8 && i.req.sub.positions.is_none());
    let fp8_all = items.iter().all(|i| i.req.sub.fp8 && i.req.sub.positions.is_none());
    let (mut plain, mut fp8, mut lp) = (Vec::new(), Vec::new(), Vec::new());
    let mut places = Vec::with_capacity(items.len());
    for (k, it) in items.iter().enumerate() {
        let sub = &it.req.sub;
        let rows = if sub.fp8 { &mut fp8 } else { &mut plain };
        let first = rows.len();
        match &sub.positions {
            Some(p) => rows.extend(p[it.idx].iter().map(|&x| cu[k] as u32 + x)),
            None => rows.extend(cu[k] as u32..cu[k + 1] as u32),
        }
        let logprobs = sub.top_k.map(|_| {
            let at = lp.len();
            lp.extend_from_slice(&rows[first..]);
            at
        });
        places.push(Place { fp8: sub.fp8, start: first, rows: rows.len() - first, logprobs });
    }
    let mut output = if plain_all {
        Output::default()
    } else if fp8_all {
        Output::all_fp8()
    } else {
        Output { plain: Rows::Only(plain), fp8: Rows::Only(fp8), ..Output::default() }
    };
    if let Some(top_k) = items.iter().filter_map(|i| i.req.sub.top_k).max() {
        let every = lp.len() == cu.last().copied().unwrap_or(0);
        output.logprobs = Some(LogprobRows { rows: if every { Rows::All } else { Rows::Only(lp) }, top_k });
    }
    (output, places)
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

/// The engine stopped a batch between layers because every request in it had gone.
fn cancelled(queue: &Queue, items: &[Item], tokens: usize, layers_run: usize) {
    tracing::info!(tokens, sequences = items.len(), layers_run, "batch stopped: every request in it has gone");
    queue.metrics.batches_cancelled.inc();
    queue.metrics.sequences_cancelled.inc_by(items.len() as u64);
    // Nobody is listening; this only matters to an engine that stopped while someone was.
    items.iter().for_each(|i| i.req.fail(BatchError::Internal("the batch was cancelled".into())));
}

/// A batch ran out of device memory. Several sequences: the batch budget drops to half of this
/// batch and the sequences go back to the front of the queue, where the next batches take them
/// in pieces that fit the new budget (halving again if need be, down to one sequence). One
/// sequence: it runs once more; when it runs out of memory alone again, it does not fit and its
/// request is refused. The budget is not lowered for a lone sequence: its own length, not
/// the packing, is what did not fit.
fn out_of_memory(queue: &Queue, mut items: Vec<Item>, tokens: usize, error: &str) {
    let m = &queue.metrics;
    if items.len() > 1 {
        let budget = queue.lower_max_batch_tokens(tokens / 2);
        m.oom_retries.inc();
        tracing::warn!(
            tokens,
            sequences = items.len(),
            budget,
            error,
            "out of device memory: retrying the batch in smaller pieces, with a lower batch budget"
        );
        queue.requeue_front(items);
        return;
    }
    let Some(it) = items.first_mut() else { return };
    if !it.oom_retried {
        it.oom_retried = true;
        m.oom_retries.inc();
        tracing::warn!(tokens, error, "out of device memory on one sequence: running it once more");
        queue.requeue_front(items);
        return;
    }
    tracing::warn!(tokens, error, "one sequence does not fit in device memory even alone: refusing its request");
    it.req.fail(BatchError::TooLarge(format!(
        "inputs[{}] has {tokens} tokens, which do not fit in the device's memory even in a batch of their own \
         (the batch budget is {} tokens, but the device ran out of memory on this input); send shorter inputs",
        it.idx,
        queue.max_batch_tokens()
    )));
}

/// Builds the packed batch and starts it on the device; `None` when it ended at once (answered
/// with the error, cancelled, or put back to be retried after running out of memory; `flush`
/// first waits for the batch being collected, so that its memory is free for the retry).
fn launch_batch(engine: &mut dyn Engine, queue: &Queue, items: Vec<Item>, flush: &dyn Fn()) -> Option<Launched> {
    let m = &queue.metrics;
    let mut batch =
        Batch::pack(items.iter().map(|i| i.ids()), items.iter().flat_map(|i| i.req.sub.layers.iter().copied()));
    let (output, places) = output_of(&items, &batch.cu_seqlens);
    batch.output = output;
    let tokens = batch.input_ids.len();
    let start = Instant::now();
    for it in &items {
        it.req.started(start, m);
    }
    // Gone for good once every request of the batch is (a request never comes back).
    let mut reqs: Vec<Arc<Request>> = Vec::new();
    for it in &items {
        if !reqs.iter().any(|r| Arc::ptr_eq(r, &it.req)) {
            reqs.push(it.req.clone());
        }
    }
    let cancel = Cancel::new(move || reqs.iter().all(|r| r.is_cancelled()));
    match std::panic::catch_unwind(AssertUnwindSafe(|| engine.launch_cancellable(&batch, &cancel))) {
        Ok(Ok(pending)) => Some(Launched { items, pending, start, tokens, places }),
        Ok(Err(EngineError::Cancelled { layers_run })) => {
            cancelled(queue, &items, tokens, layers_run);
            None
        }
        Ok(Err(EngineError::OutOfMemory(e))) => {
            flush();
            out_of_memory(queue, items, tokens, &e);
            None
        }
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
    let Launched { items, pending, start, tokens, places } = l;
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| pending.wait()));
    if !matches!(result, Ok(Err(EngineError::Cancelled { .. } | EngineError::OutOfMemory(_)))) {
        m.inference_duration.observe(start.elapsed().as_secs_f64());
        m.batch_tokens.observe(tokens as f64);
        m.batch_sequences.observe(items.len() as f64);
    }
    let taps = match result {
        Ok(Ok(t)) => t,
        Ok(Err(EngineError::Cancelled { layers_run })) => return cancelled(queue, &items, tokens, layers_run),
        Ok(Err(EngineError::OutOfMemory(e))) => return out_of_memory(queue, items, tokens, &e),
        Ok(Err(e)) => return fail_all(&items, e, tokens),
        Err(_) => return panicked(&items, tokens),
    };
    m.tokens.inc_by(tokens as u64);
    let taps = Arc::new(taps);
    for (k, it) in items.iter().enumerate() {
        let Place { fp8, start, rows, logprobs } = places[k];
        let layers = it.req.sub.layers.clone();
        it.req.complete(it.idx, Part { taps: taps.clone(), layers, fp8, start, rows, logprobs });
    }
}
