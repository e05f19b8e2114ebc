//! One client connection, once accepted: HTTP/1 over hyper with the header, body and idle
//! deadlines, the draining answers, and the socket wrapper that watches reads and writes.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::{ConnLimits, Shared, RETRY_AFTER_S};
use crate::error::{ApiError, ErrorKind};

/// Largest request line plus headers; past it hyper answers 431 and closes the connection.
const MAX_HEADER_BYTES: usize = 64 << 10;
/// Routes still served normally while draining (each answer then closes its connection).
const OPEN_WHILE_DRAINING: [&str; 3] = ["/health", "/ready", "/metrics"];

/// Serves one connection until the client or a deadline ends it, or `closing` drains it.
pub(super) async fn serve_connection(
    stream: TcpStream,
    shared: Arc<Shared>,
    closing: CancellationToken,
    slot: OwnedSemaphorePermit,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        io: Some(stream),
        activity: activity.clone(),
        write_blocked: false,
        shut_down: false,
        slot: Some(slot),
    });
    let service = {
        let activity = activity.clone();
        let shared = shared.clone();
        hyper::service::service_fn(move |req| {
            let guard = activity.begin();
            let shared = shared.clone();
            async move {
                let resp = respond(req, &shared).await;
                Ok::<_, Infallible>(resp.map(|body| Tracked { body, _guard: guard }))
            }
        })
    };
    let l = &shared.limits;
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .max_header_size(MAX_HEADER_BYTES)
        .header_read_timeout(l.header_read_timeout + l.idle_timeout);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut shutting = false;
    loop {
        let wake = match activity.due(l, Instant::now()) {
            Due::Wait(at) => at,
            Due::Idle => {
                if !shutting {
                    shutting = true;
                    conn.as_mut().graceful_shutdown();
                }
                None
            }
            Due::HeadTimeout => {
                tracing::debug!("closing a connection whose request head did not arrive in time");
                return;
            }
            Due::WriteStalled => {
                tracing::debug!("closing a connection whose client stopped reading its answer");
                return;
            }
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = closing.cancelled(), if !shutting => {
                shutting = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = activity.changed.notified() => {}
            _ = sleep_until(wake) => {}
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// One request: refusals that need no body first, then the router with a body deadline.
async fn respond(req: Request<Incoming>, shared: &Shared) -> Response<Body> {
    let state = &shared.state;
    let draining = state.draining.load(Ordering::SeqCst);
    if draining && !OPEN_WHILE_DRAINING.contains(&req.uri().path()) {
        return closing(
            ApiError {
                retry_after_s: Some(RETRY_AFTER_S),
                ..ApiError::new(ErrorKind::Unavailable, "the server is shutting down; retry on another replica")
            }
            .into_response(),
        );
    }
    let max = shared.limits.max_body_bytes as u64;
    let declared = req.body().size_hint().lower();
    if declared > max {
        return closing(
            ApiError::new(
                ErrorKind::TooLarge,
                format!("the request body ({declared} bytes) is larger than the {max} bytes --max-body-bytes allows"),
            )
            .into_response(),
        );
    }
    let timed_out = Arc::new(AtomicBool::new(false));
    let req = if req.body().is_end_stream() {
        req.map(Body::new)
    } else {
        let deadline = Instant::now() + shared.limits.body_read_timeout;
        let fired = timed_out.clone();
        req.map(|b| Body::new(BodyDeadline { inner: b, sleep: Box::pin(tokio::time::sleep_until(deadline)), fired }))
    };
    let resp = match shared.router.clone().oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    if timed_out.load(Ordering::SeqCst) {
        let secs = shared.limits.body_read_timeout.as_secs_f64();
        return closing(
            ApiError::new(
                ErrorKind::RequestTimeout,
                format!("the request body did not arrive within {secs} s (--body-read-timeout)"),
            )
            .into_response(),
        );
    }
    if state.draining.load(Ordering::SeqCst) {
        let mut resp = closing(resp);
        if resp.status() == StatusCode::SERVICE_UNAVAILABLE && !resp.headers().contains_key(header::RETRY_AFTER) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        return resp;
    }
    resp
}

/// The answer closes its connection.
fn closing(mut resp: Response<Body>) -> Response<Body> {
    resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// A request body that fails (and says so in `fired`) once its deadline passes.
struct BodyDeadline {
    inner: Incoming,
    sleep: Pin<Box<tokio::time::Sleep>>,
    fired: Arc<AtomicBool>,
}

impl HttpBody for BodyDeadline {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(r) => Poll::Ready(r.map(|f| f.map_err(Into::into))),
            Poll::Pending => {
                if this.sleep.as_mut().poll(cx).is_ready() {
                    this.fired.store(true, Ordering::SeqCst);
                    Poll::Ready(Some(Err("the request body did not arrive in time".into())))
                } else {
                    Poll::Pending
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that marks its request finished when hyper is done with it.
struct Tracked {
    body: Body,
    _guard: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// What a connection is doing, for its deadlines.
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
}

struct Phase {
    /// Requests whose answer is not yet fully handed to hyper.
    in_flight: usize,
    /// With none in flight: a request head has begun (or the connection is new).
    reading_head: bool,
    /// When the current idle or head-reading stretch began.
    since: Instant,
    /// Since when a write has been waiting on the client.
    write_blocked: Option<Instant>,
}

enum Due {
    /// Nothing is due; check again at this time (or when the phase changes).
    Wait(Option<Instant>),
    Idle,
    HeadTimeout,
    WriteStalled,
}

impl Activity {
    fn new() -> Self {
        // A new connection is reading its first head from the accept on.
        let phase = Phase { in_flight: 0, reading_head: true, since: Instant::now(), write_blocked: None };
        Activity { phase: Mutex::new(phase), changed: Notify::new() }
    }

    fn lock(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        let mut p = self.lock();
        p.in_flight += 1;
        p.reading_head = false;
        drop(p);
        self.changed.notify_one();
        InFlight(self.clone())
    }

    fn read_some(&self) {
        let mut p = self.lock();
        if p.in_flight == 0 && !p.reading_head {
            p.reading_head = true;
            p.since = Instant::now();
            drop(p);
            self.changed.notify_one();
        }
    }

    fn write_blocked(&self, blocked: bool) {
        self.lock().write_blocked = blocked.then(Instant::now);
        self.changed.notify_one();
    }

    fn due(&self, l: &ConnLimits, now: Instant) -> Due {
        let p = self.lock();
        let mut next = None;
        if let Some(t) = p.write_blocked {
            let at = t + l.idle_timeout;
            if now >= at {
                return Due::WriteStalled;
            }
            next = Some(at);
        }
        if p.in_flight == 0 {
            let (limit, due) =
                if p.reading_head { (l.header_read_timeout, Due::HeadTimeout) } else { (l.idle_timeout, Due::Idle) };
            let at = p.since + limit;
            if now >= at {
                return due;
            }
            next = Some(next.map_or(at, |n: Instant| n.min(at)));
        }
        Due::Wait(next)
    }
}

/// A request in flight on its connection; dropping it ends the request.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut p = self.0.lock();
        p.in_flight -= 1;
        if p.in_flight == 0 {
            p.reading_head = false;
            p.since = Instant::now();
        }
        drop(p);
        self.0.changed.notify_one();
    }
}

/// The socket, reporting reads and blocked writes to its connection's [`Activity`]. It holds the
/// connection's slot, and lingers when dropped after an orderly close (see [`linger`]).
struct Watched {
    /// Present until dropped.
    io: Option<TcpStream>,
    activity: Arc<Activity>,
    write_blocked: bool,
    /// The server closed its side after its last answer.
    shut_down: bool,
    slot: Option<OwnedSemaphorePermit>,
}

/// How long in all, how long between reads, and how many bytes a closed connection keeps reading
/// what its client still sends.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_GAP: Duration = Duration::from_millis(250);
const LINGER_BYTES: usize = 128 << 20;

/// Reads and drops what the client still sends after the server's last answer (typically the
/// rest of a body refused with 413), until it stops (nothing for [`LINGER_GAP`]) or for [`LINGER`]
/// at most. Closing a socket
/// with unread data resets the connection, and a reset can destroy the answer before the client
/// has read it.
async fn linger(mut io: TcpStream) {
    let deadline = Instant::now() + LINGER;
    let mut buf = vec![0u8; 64 << 10];
    let mut read = 0;
    while read < LINGER_BYTES {
        let until = deadline.min(Instant::now() + LINGER_GAP);
        match tokio::time::timeout_at(until, io.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => read += n,
            _ => break,
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let Some(io) = self.io.take() else { return };
        if !self.shut_down {
            return;
        }
        let slot = self.slot.take();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                linger(io).await;
                drop(slot);
            });
        }
    }
}

impl Watched {
    fn io(&mut self) -> Pin<&mut TcpStream> {
        Pin::new(self.io.as_mut().expect("the socket is present until dropped"))
    }

    fn note_write<T>(&mut self, r: &Poll<T>) {
        let blocked = r.is_pending();
        if blocked != self.write_blocked {
            self.write_blocked = blocked;
            self.activity.write_blocked(blocked);
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = this.io().poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.read_some();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = this.io().poll_write(cx, buf);
        this.note_write(&r);
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = this.io().poll_write_vectored(cx, bufs);
        this.note_write(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(|io| io.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().io().poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = this.io().poll_shutdown(cx);
        if r.is_ready() {
            this.shut_down = true;
        }
        r
    }
}
