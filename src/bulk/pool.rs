//! The servers `layertap bulk` spreads its requests over: each request goes to the server with
//! the fewest requests outstanding (ties taken in turn); a server that fails (no connection, a
//! timeout, a 5xx) is left alone for a backoff that doubles with each failure in a row (1 s to
//! 30 s, or its Retry-After if longer), and one that answers 429 for its Retry-After.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const LAST_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Health {
    /// Not picked before this instant.
    down_until: Option<Instant>,
    failures_in_row: u32,
}

pub struct Server {
    /// As given on the command line, without a trailing '/'.
    pub base: String,
    /// The hidden-states endpoint.
    pub url: String,
    outstanding: AtomicUsize,
    health: Mutex<Health>,
    /// Answers taken (checked and kept).
    pub answered: AtomicU64,
    /// Attempts that failed here: no connection, a timeout, a 5xx.
    pub failed: AtomicU64,
    /// 429 answers.
    pub throttled: AtomicU64,
}

pub struct Pool {
    pub servers: Vec<Server>,
    turn: AtomicUsize,
}

/// A request in flight to one server; dropping it ends the request's count there.
pub struct Lease<'a> {
    pub server: &'a Server,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.server.outstanding.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Pool {
    pub fn new(bases: &[String]) -> Pool {
        let servers = bases
            .iter()
            .map(|b| {
                let base = b.trim().trim_end_matches('/').to_string();
                Server {
                    url: format!("{base}/v1/hidden-states"),
                    base,
                    outstanding: AtomicUsize::new(0),
                    health: Mutex::new(Health::default()),
                    answered: AtomicU64::new(0),
                    failed: AtomicU64::new(0),
                    throttled: AtomicU64::new(0),
                }
            })
            .collect();
        Pool { servers, turn: AtomicUsize::new(0) }
    }

    /// The server up with the fewest requests outstanding, its count taken; or, when every
    /// server is down, the instant the first comes back.
    pub fn pick(&self) -> Result<Lease<'_>, Instant> {
        let now = Instant::now();
        let n = self.servers.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(usize, &Server)> = None;
        let mut first_back: Option<Instant> = None;
        for k in 0..n {
            let s = &self.servers[(start + k) % n];
            let until = s.health.lock().unwrap_or_else(|p| p.into_inner()).down_until;
            if let Some(t) = until.filter(|&t| t > now) {
                first_back = Some(first_back.map_or(t, |f| f.min(t)));
                continue;
            }
            let load = s.outstanding.load(Ordering::SeqCst);
            if best.is_none_or(|(b, _)| load < b) {
                best = Some((load, s));
            }
        }
        match best {
            Some((_, s)) => {
                s.outstanding.fetch_add(1, Ordering::SeqCst);
                Ok(Lease { server: s })
            }
            None => Err(first_back.unwrap_or(now)),
        }
    }

    /// The server answered well: it is up, its backoff starts again from the first.
    pub fn ok(&self, s: &Server) {
        s.answered.fetch_add(1, Ordering::Relaxed);
        *s.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::default();
    }

    /// The server failed: down for its next backoff (at least `retry_after`).
    pub fn down(&self, s: &Server, retry_after: Option<Duration>) {
        s.failed.fetch_add(1, Ordering::Relaxed);
        let mut h = s.health.lock().unwrap_or_else(|p| p.into_inner());
        let backoff = FIRST_BACKOFF.saturating_mul(1 << h.failures_in_row.min(5)).min(LAST_BACKOFF);
        h.failures_in_row += 1;
        let until = Instant::now() + backoff.max(retry_after.unwrap_or_default());
        h.down_until = Some(h.down_until.map_or(until, |t| t.max(until)));
    }

    /// The server asked for a pause (429): not picked for `retry_after`.
    pub fn busy(&self, s: &Server, retry_after: Duration) {
        s.throttled.fetch_add(1, Ordering::Relaxed);
        let mut h = s.health.lock().unwrap_or_else(|p| p.into_inner());
        let until = Instant::now() + retry_after;
        h.down_until = Some(h.down_until.map_or(until, |t| t.max(until)));
    }
}
