use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::oneshot;

use super::{Answer, BatchError, Part, Submission};
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the queue is full ({queued} tokens waiting, limit {limit}); retry later")]
    Overloaded { queued: usize, limit: usize },
    #[error("the server is shutting down")]
    Closed,
}

/// One request in flight: its sequences' results as they come back from batches.
pub(super) struct Request {
    pub(super) sub: Submission,
    enqueued: Instant,
    progress: Mutex<Progress>,
    reply: Mutex<Option<oneshot::Sender<Result<Answer, BatchError>>>>,
}

struct Progress {
    parts: Vec<Option<Part>>,
    remaining: usize,
    first_start: Option<Instant>,
}

impl Request {
    /// The client is gone (its receiver was dropped) or an answer was already sent.
    pub(super) fn is_cancelled(&self) -> bool {
        self.reply.lock().map(|r| r.as_ref().is_none_or(|s| s.is_closed())).unwrap_or(true)
    }

    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn started(&self, at: Instant, metrics: &Metrics) {
        let mut p = self.progress();
        if p.first_start.is_none() {
            p.first_start = Some(at);
            metrics.queue_duration.observe(at.duration_since(self.enqueued).as_secs_f64());
        }
    }

    fn send(&self, r: Result<Answer, BatchError>) {
        if let Some(tx) = self.reply.lock().ok().and_then(|mut g| g.take()) {
            let _ = tx.send(r);
        }
    }

    pub(super) fn fail(&self, e: BatchError) {
        self.send(Err(e));
    }

    /// Stores the result of sequence `idx`; answers the request when it was the last one.
    pub(super) fn complete(&self, idx: usize, part: Part) {
        let mut p = self.progress();
        if p.parts[idx].replace(part).is_none() {
            p.remaining -= 1;
        }
        if p.remaining > 0 {
            return;
        }
        let start = p.first_start.unwrap_or(self.enqueued);
        let parts = p.parts.iter_mut().filter_map(Option::take).collect();
        drop(p);
        self.send(Ok(Answer {
            parts,
            queue_time: start.duration_since(self.enqueued),
            inference_time: start.elapsed(),
        }));
    }
}

/// One sequence waiting to run.
pub(super) struct Item {
    pub(super) req: Arc<Request>,
    pub(super) idx: usize,
    /// Already run again alone after running out of device memory alone.
    pub(super) oom_retried: bool,
    /// Tokens of later, shorter sequences run ahead of this one while it waited (only sequences
    /// longer than the batch budget are passed over; see [`Queue::next_batch`]).
    overtaken: usize,
}

impl Item {
    pub(super) fn ids(&self) -> &[u32] {
        &self.req.sub.seqs[self.idx].ids
    }
}

struct State {
    items: VecDeque<Item>,
    queued_tokens: usize,
    closed: bool,
}

/// The shared queue. Workers block on it; the HTTP layer submits to it.
pub struct Queue {
    state: Mutex<State>,
    ready: Condvar,
    max_queue_tokens: usize,
    max_batch_tokens: AtomicUsize,
    pub(super) metrics: Arc<Metrics>,
}

impl Queue {
    pub fn new(max_batch_tokens: usize, max_queue_tokens: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        metrics.batch_token_budget.set(max_batch_tokens as i64);
        Arc::new(Queue {
            state: Mutex::new(State { items: VecDeque::new(), queued_tokens: 0, closed: false }),
            ready: Condvar::new(),
            max_queue_tokens,
            max_batch_tokens: AtomicUsize::new(max_batch_tokens),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a submission or refuses it when the queue's token budget is spent.
    pub fn submit(&self, sub: Submission) -> Result<oneshot::Receiver<Result<Answer, BatchError>>, SubmitError> {
        let tokens = sub.tokens();
        let mut st = self.lock();
        if st.closed {
            return Err(SubmitError::Closed);
        }
        // An empty queue always admits, so a request within the input limits can never starve.
        if st.queued_tokens > 0 && st.queued_tokens + tokens > self.max_queue_tokens {
            return Err(SubmitError::Overloaded { queued: st.queued_tokens, limit: self.max_queue_tokens });
        }
        let (tx, rx) = oneshot::channel();
        let n = sub.seqs.len();
        let req = Arc::new(Request {
            sub,
            enqueued: Instant::now(),
            progress: Mutex::new(Progress { parts: (0..n).map(|_| None).collect(), remaining: n, first_start: None }),
            reply: Mutex::new(Some(tx)),
        });
        for idx in 0..n {
            st.items.push_back(Item { req: req.clone(), idx, oom_retried: false, overtaken: 0 });
        }
        st.queued_tokens += tokens;
        self.metrics.queue_tokens.set(st.queued_tokens as i64);
        drop(st);
        self.ready.notify_all();
        Ok(rx)
    }

    /// Blocks until there is work; returns up to `max_batch_tokens` tokens of sequences in
    /// arrival order, skipping those whose client has gone. `None` once closed and drained.
    ///
    /// A sequence longer than the budget runs in a batch of its own, and may cost minutes on a
    /// CPU: shorter sequences queued behind it go first, until they have taken as many tokens as
    /// it has. So a short request does not wait behind a long backlog, and a long sequence waits
    /// at most about its own length of other work more than it would have in arrival order.
    pub(super) fn next_batch(&self) -> Option<Vec<Item>> {
        let mut st = self.lock();
        loop {
            let budget = self.max_batch_tokens();
            let mut batch: Vec<Item> = Vec::new();
            let mut tokens = 0;
            // Long sequences passed over; taking or dropping an item only shifts those after it.
            let mut passed: Vec<usize> = Vec::new();
            let mut i = 0;
            while let Some(it) = st.items.get(i) {
                let len = it.ids().len();
                if it.req.is_cancelled() {
                    st.items.remove(i);
                    st.queued_tokens -= len;
                    self.metrics.sequences_cancelled.inc();
                    continue;
                }
                if len > budget {
                    if it.overtaken < len {
                        passed.push(i);
                        i += 1;
                        continue;
                    }
                    if batch.is_empty() {
                        tokens = len;
                        st.queued_tokens -= len;
                        batch.extend(st.items.remove(i));
                    }
                    break;
                }
                if !batch.is_empty() && tokens + len > budget {
                    break;
                }
                tokens += len;
                st.queued_tokens -= len;
                batch.extend(st.items.remove(i));
            }
            if batch.is_empty() {
                if let Some(&first) = passed.first() {
                    if let Some(it) = st.items.remove(first) {
                        st.queued_tokens -= it.ids().len();
                        batch.push(it);
                    }
                }
            } else {
                for &k in &passed {
                    st.items[k].overtaken += tokens;
                }
            }
            self.metrics.queue_tokens.set(st.queued_tokens as i64);
            if !batch.is_empty() {
                return Some(batch);
            }
            if st.closed {
                return None;
            }
            st = self.ready.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stops admitting; workers finish what is queued and then exit.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// The current token budget of one batch.
    pub fn max_batch_tokens(&self) -> usize {
        self.max_batch_tokens.load(Ordering::Relaxed)
    }

    /// Changes the batch budget (once the devices have measured their free memory).
    pub fn set_max_batch_tokens(&self, n: usize) {
        self.max_batch_tokens.store(n, Ordering::Relaxed);
        self.metrics.batch_token_budget.set(n as i64);
    }

    /// Lowers the batch budget to at most `n` tokens (at least 1: a sequence longer than the
    /// budget still runs, in a batch of its own); returns the budget now in force.
    pub fn lower_max_batch_tokens(&self, n: usize) -> usize {
        let n = n.max(1);
        let now = self.max_batch_tokens.fetch_min(n, Ordering::Relaxed).min(n);
        self.metrics.batch_token_budget.set(now as i64);
        now
    }

    /// Puts sequences back at the front of the queue, in their order, ahead of everything that
    /// waits (they were taken first): a batch that ran out of memory is retried this way, in
    /// the smaller pieces the lowered budget allows.
    pub(super) fn requeue_front(&self, items: Vec<Item>) {
        let mut st = self.lock();
        for it in items.into_iter().rev() {
            st.queued_tokens += it.ids().len();
            st.items.push_front(it);
        }
        self.metrics.queue_tokens.set(st.queued_tokens as i64);
        drop(st);
        self.ready.notify_all();
    }
}
