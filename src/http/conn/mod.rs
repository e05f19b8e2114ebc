//! Client connections: the accept loop here (the cap, refusals, accept errors) and each accepted
//! connection in [`client`] (HTTP/1 over hyper and its deadlines); together they
//! keep slow or idle clients from holding the server.
//!
//! - **Connection cap** (`max_connections`): an accepted connection takes a slot; when none is free
//!   it gets a short 503 JSON answer with `Connection: close` and is closed (a few such answers are
//!   written at once; past that the socket is closed without one). Connections never pile up.
//! - **Header read timeout**: a request's line and headers must arrive within it, counted from
//!   the accept or, on a keep-alive connection, from the request's first byte; else the connection
//!   is closed. (hyper's own `header_read_timeout` starts as soon as the connection is ready for the
//!   next request, so on a keep-alive connection it counts idle time and head time together; it
//!   is kept only as a backstop at header + idle.)
//! - **Idle timeout**: a connection with no request in flight is closed after it; a response write
//!   that stays blocked that long (a client that does not read) also ends the connection.
//! - **Body read timeout**: a request's whole body must arrive within it, counted from its head;
//!   else 408 JSON and the connection is closed.
//! - A `Content-Length` over `max_body_bytes` is refused with 413 JSON before any of the body is
//!   read, so `Expect: 100-continue` clients never get `100 Continue` for it.
//! - While draining, requests (other than `/health`, `/ready` and `/metrics`) get 503 with
//!   `Retry-After` and `Connection: close`; every answer carries `Connection: close`.
//! - A request line plus headers over 64 KiB gets hyper's 431 (hyper's own parse-error answers
//!   have empty bodies: they are written by hyper before any service sees the request).
//! - Accept errors that are not about one connection (EMFILE, ENFILE, ENOBUFS, ENOMEM) back off
//!   from 10 ms up to 1 s, and are logged at most once every 10 s with a count of the rest.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod client;

use client::serve_connection;

use super::{AppState, Limits};
use crate::error::{ErrorBody, ErrorKind};

/// Connections over the cap that may be getting their 503 at once; past it they are just closed.
const MAX_REFUSING: usize = 32;
/// How long a refused connection is given to take its 503 before it is closed.
const REFUSE_GRACE: Duration = Duration::from_millis(250);
/// Seconds sent in `Retry-After` while draining or over the cap.
const RETRY_AFTER_S: u64 = 1;
/// Accept-error back-off bounds, and how often such errors are logged.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The per-connection limits, from [`Limits`].
#[derive(Clone, Debug)]
pub struct ConnLimits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_body_bytes: usize,
}

impl ConnLimits {
    pub fn from_limits(l: &Limits) -> Self {
        ConnLimits {
            header_read_timeout: l.header_read_timeout,
            body_read_timeout: l.body_read_timeout,
            idle_timeout: l.idle_timeout,
            max_connections: l.max_connections.max(1),
            max_body_bytes: l.max_body_bytes,
        }
    }
}

struct Shared {
    router: Router,
    state: AppState,
    limits: ConnLimits,
}

/// Accepts connections on `listener` until `shutdown` is cancelled and serves each one in a task
/// of `conns`; every connection task starts closing when `closing` is cancelled. Returns (and
/// drops the listener, so new connections are refused) once `shutdown` is cancelled.
pub async fn accept_until(
    mut listener: TcpListener,
    router: Router,
    state: AppState,
    shutdown: &CancellationToken,
    closing: CancellationToken,
    conns: &mut JoinSet<()>,
) {
    let limits = ConnLimits::from_limits(&state.limits);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let refusal: Bytes = over_cap_answer().into();
    let shared = Arc::new(Shared { router, state, limits });
    let mut backoff = Backoff::default();
    let mut over_cap = RateLog::default();
    loop {
        let stream = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            s = next_connection(&mut listener, &mut backoff) => s,
        };
        while let Some(done) = conns.try_join_next() {
            if done.is_err_and(|e| e.is_panic()) {
                tracing::error!("a connection task panicked");
            }
        }
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                let _ = stream.set_nodelay(true);
                conns.spawn(serve_connection(stream, shared.clone(), closing.clone(), slot));
            }
            Err(_) => {
                if over_cap.due() {
                    tracing::warn!(
                        max_connections = shared.limits.max_connections,
                        refused_since_last_log = over_cap.take(),
                        "connection limit reached: refusing new connections with 503"
                    );
                }
                if let Ok(p) = refusing.clone().try_acquire_owned() {
                    conns.spawn(refuse(stream, refusal.clone(), p));
                }
            }
        }
    }
}

/// Where connections come from (a trait so the back-off can be tested without running out of
/// file descriptors).
pub(crate) trait Accept {
    fn accept_stream(&mut self) -> impl Future<Output = io::Result<TcpStream>> + Send;
}

impl Accept for TcpListener {
    async fn accept_stream(&mut self) -> io::Result<TcpStream> {
        self.accept().await.map(|(s, _)| s)
    }
}

/// Accept-error state: the current delay and the log limiter.
#[derive(Default)]
struct Backoff {
    delay: Duration,
    log: RateLog,
}

/// The next accepted connection. Errors of one connection are skipped at once; others (out of
/// file descriptors or memory) wait, from BACKOFF_MIN doubling up to BACKOFF_MAX, and are
/// logged at most once per LOG_EVERY.
async fn next_connection<L: Accept>(listener: &mut L, b: &mut Backoff) -> TcpStream {
    loop {
        match listener.accept_stream().await {
            Ok(s) => {
                b.delay = Duration::ZERO;
                return s;
            }
            Err(e) if per_connection(&e) => {}
            Err(e) => {
                b.delay = (b.delay * 2).clamp(BACKOFF_MIN, BACKOFF_MAX);
                if b.log.due() {
                    tracing::error!(
                        error = %e,
                        retry_in_ms = b.delay.as_millis() as u64,
                        failures_since_last_log = b.log.take(),
                        "accepting a connection failed; backing off (for EMFILE lower --max-connections or raise the open-file limit)"
                    );
                }
                tokio::time::sleep(b.delay).await;
            }
        }
    }
}

/// Errors of one connection that went away before it was accepted: try the next one at once.
fn per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// Logs at most once per [`LOG_EVERY`], counting what it skipped.
#[derive(Default)]
struct RateLog {
    last: Option<Instant>,
    count: u64,
    /// Lines logged so far.
    lines: u64,
}

impl RateLog {
    fn due(&mut self) -> bool {
        self.count += 1;
        let now = Instant::now();
        if self.last.is_none_or(|t| now.duration_since(t) >= LOG_EVERY) {
            self.last = Some(now);
            self.lines += 1;
            true
        } else {
            false
        }
    }

    /// Events since the last log line, this one included.
    fn take(&mut self) -> u64 {
        std::mem::take(&mut self.count)
    }
}

fn over_cap_answer() -> Vec<u8> {
    let body = serde_json::to_string(&ErrorBody {
        error: "too many open connections; retry shortly".into(),
        kind: ErrorKind::Unavailable.name().into(),
    })
    .unwrap_or_default();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Writes the 503 to a connection over the cap, then reads what the client sent (so closing
/// does not reset the connection before the client reads the answer), bounded by REFUSE_GRACE.
async fn refuse(mut stream: TcpStream, answer: Bytes, _slot: OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(REFUSE_GRACE, async {
        stream.write_all(&answer).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), io::Error>(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener whose every accept fails with EMFILE, counting the attempts.
    struct OutOfFiles(u64);

    impl Accept for OutOfFiles {
        async fn accept_stream(&mut self) -> io::Result<TcpStream> {
            self.0 += 1;
            Err(io::Error::from_raw_os_error(24))
        }
    }

    #[tokio::test]
    async fn accept_errors_back_off_and_are_logged_once_not_every_time() {
        let mut l = OutOfFiles(0);
        let mut b = Backoff::default();
        let waited = tokio::time::timeout(Duration::from_millis(1500), next_connection(&mut l, &mut b)).await;
        assert!(waited.is_err(), "no connection can be accepted");
        // 10 + 20 + 40 + ... ms, capped at 1 s: 7 or 8 attempts in 1.5 s, not a busy loop.
        assert!((3..=12).contains(&l.0), "{} accept attempts in 1.5 s", l.0);
        assert_eq!(b.delay, BACKOFF_MAX);
        assert_eq!(b.log.lines, 1, "logged {} times in 1.5 s", b.log.lines);
    }
}
