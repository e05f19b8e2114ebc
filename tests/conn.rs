//! Connection hardening and shutdown, on real sockets: raw bytes over TcpStream where HTTP
//! clients would hide what the server does (half-sent heads, idle keep-alive, the connection
//! cap, Expect: 100-continue), and a drain with requests in flight on the fake engine.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use layertap::http::Limits;
use layertap::server::Running;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A server on the fake engine with `drain` as its shutdown timeout.
async fn server(limits: Limits, drain: Duration) -> (Running, Arc<FakeControl>) {
    let s = fake_server_with(fake_setup(limits), drain).await;
    (s.running, s.control)
}

/// One response read off a raw connection.
struct Raw {
    status: u16,
    /// The head, lower-cased.
    head: String,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| l.strip_prefix(&format!("{name}: ")).map(str::trim))
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&self.body)))
    }
}

/// Reads exactly one response (head and Content-Length body); panics after 5 s.
async fn read_one(s: &mut TcpStream) -> Raw {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = s.read(&mut chunk).await.expect("read");
            assert!(n > 0, "connection closed before a whole response head: {:?}", String::from_utf8_lossy(&buf));
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status line");
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map(|v| v.trim().parse().unwrap())
            .unwrap_or(0);
        let mut body = buf[end..].to_vec();
        while body.len() < len {
            let n = s.read(&mut chunk).await.expect("read");
            assert!(n > 0, "connection closed inside a body");
            body.extend_from_slice(&chunk[..n]);
        }
        Raw { status, head, body }
    })
    .await
    .expect("no response within 5 s")
}

/// Whether the server closes `s` (EOF or reset) within `d`; what it sends first is discarded.
async fn closed_within(s: &mut TcpStream, d: Duration) -> bool {
    tokio::time::timeout(d, async {
        let mut chunk = [0u8; 1024];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

const GET_HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_must_arrive_whole_within_the_header_timeout() {
    let limits =
        Limits { header_read_timeout: Duration::from_millis(600), idle_timeout: Duration::from_secs(30), ..limits() };
    let (running, _) = server(limits, Duration::from_secs(5)).await;
    // One client trickles a header byte every 100 ms (never quiet, never done); one sends nothing.
    let mut trickle = TcpStream::connect(running.addr).await.unwrap();
    let mut silent = TcpStream::connect(running.addr).await.unwrap();
    let t0 = Instant::now();
    trickle.write_all(b"POST /v1/tokenize HTTP/1.1\r\nhost: t\r\nx-slow: ").await.unwrap();
    let writer = tokio::spawn(async move {
        for _ in 0..60 {
            if trickle.write_all(b"a").await.is_err() {
                return (true, t0.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut probe = [0u8; 1];
            if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(Duration::from_millis(1), trickle.read(&mut probe)).await {
                return (true, t0.elapsed());
            }
        }
        (false, t0.elapsed())
    });
    assert!(closed_within(&mut silent, Duration::from_secs(5)).await, "a connection that sends nothing stays open");
    let silent_at = t0.elapsed();
    let (closed, trickle_at) = writer.await.unwrap();
    assert!(closed, "a head trickled byte by byte was never cut off");
    for at in [silent_at, trickle_at] {
        assert!(at >= Duration::from_millis(500) && at < Duration::from_secs(4), "closed after {at:?}");
    }
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_lives_for_the_idle_timeout_then_is_closed() {
    // The idle timeout is longer than the header timeout: idle time must not count as head time.
    let limits = Limits {
        header_read_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(1500),
        ..limits()
    };
    let (running, _) = server(limits, Duration::from_secs(5)).await;
    let mut s = TcpStream::connect(running.addr).await.unwrap();
    s.write_all(GET_HEALTH).await.unwrap();
    assert_eq!(read_one(&mut s).await.status, 200);
    tokio::time::sleep(Duration::from_millis(800)).await;
    s.write_all(GET_HEALTH).await.unwrap();
    assert_eq!(read_one(&mut s).await.status, 200, "the keep-alive connection was closed before its idle timeout");
    let t = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(5)).await, "an idle connection is never closed");
    let at = t.elapsed();
    assert!(at >= Duration::from_millis(1200) && at < Duration::from_secs(4), "closed after {at:?}");
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_get_a_503_and_health_answers_once_slow_ones_are_dropped() {
    let cap = 4;
    let limits = Limits {
        max_connections: cap,
        // Long enough that the slow connections certainly hold their slots while the refusals
        // below run on a loaded machine (at 1.5 s a slot was once freed before the last one).
        header_read_timeout: Duration::from_secs(4),
        idle_timeout: Duration::from_secs(30),
        ..limits()
    };
    let (running, _) = server(limits, Duration::from_secs(5)).await;
    let mut slow = Vec::new();
    for _ in 0..cap {
        let mut s = TcpStream::connect(running.addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: t\r\n").await.unwrap();
        slow.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Every further connection is answered 503 and closed at once, /health included.
    for _ in 0..3 {
        let t = Instant::now();
        let mut s = TcpStream::connect(running.addr).await.unwrap();
        s.write_all(GET_HEALTH).await.unwrap();
        let r = read_one(&mut s).await;
        assert_eq!(r.status, 503);
        assert_eq!(r.json()["type"], "unavailable");
        assert!(r.header("retry-after").is_some());
        assert_eq!(r.header("connection"), Some("close"));
        assert!(closed_within(&mut s, Duration::from_secs(1)).await, "a connection over the cap was kept open");
        assert!(t.elapsed() < Duration::from_secs(1), "refusing took {:?}", t.elapsed());
    }
    // The slow ones still hold their slots (the server holds no more than the cap) ...
    for s in &mut slow {
        assert!(!closed_within(s, Duration::from_millis(20)).await, "a slow connection was closed early");
    }
    // ... until the header timeout drops them; then /health is served again.
    for s in &mut slow {
        assert!(closed_within(s, Duration::from_secs(8)).await, "a half-sent request kept its connection");
    }
    let mut s = TcpStream::connect(running.addr).await.unwrap();
    s.write_all(GET_HEALTH).await.unwrap();
    let r = read_one(&mut s).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "ok");
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_length_over_the_body_limit_gets_413_before_100_continue() {
    let (running, _) = server(limits(), Duration::from_secs(5)).await;
    let max = limits().max_body_bytes;
    let head = |len: usize| {
        format!(
            "POST /v1/tokenize HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\
             expect: 100-continue\r\n\r\n"
        )
    };
    let mut s = TcpStream::connect(running.addr).await.unwrap();
    s.write_all(head(1_000_000_000).as_bytes()).await.unwrap();
    let r = read_one(&mut s).await;
    assert_eq!(r.status, 413, "got {:?}", r.head);
    assert_eq!(r.json()["type"], "too_large");
    assert!(r.json()["error"].as_str().unwrap().contains(&max.to_string()));
    assert!(closed_within(&mut s, Duration::from_secs(2)).await, "the unread body's connection stays open");
    // Headers over 64 KiB are refused too (by hyper: 431, empty body) and the connection closed.
    let mut s = TcpStream::connect(running.addr).await.unwrap();
    let big = format!("GET /health HTTP/1.1\r\nhost: t\r\nx-big: {}\r\n\r\n", "a".repeat(100 << 10));
    let _ = s.write_all(big.as_bytes()).await;
    assert_eq!(read_one(&mut s).await.status, 431);
    assert!(closed_within(&mut s, Duration::from_secs(2)).await);
    // Within the limit, the client is still told to go on, and served.
    let body = json!({"inputs": [{"input_ids": [1, 2, 3]}]}).to_string();
    let mut s = TcpStream::connect(running.addr).await.unwrap();
    s.write_all(head(body.len()).as_bytes()).await.unwrap();
    assert_eq!(read_one(&mut s).await.status, 100);
    s.write_all(body.as_bytes()).await.unwrap();
    let r = read_one(&mut s).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["results"][0]["input_ids"], json!([1, 2, 3]));
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_sending_a_refused_body_reads_its_413() {
    let (running, _) = server(limits(), Duration::from_secs(5)).await;
    let max = limits().max_body_bytes;
    let url = format!("http://{}/v1/tokenize", running.addr);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    // An HTTP client writes the whole body while the answer comes: the server must read on (and
    // drop) what follows its 413 for a moment, or the client's writes fail on a closed socket
    // before it has read the answer.
    let body = format!("{{\"inputs\": [{{\"text\": \"{}\"}}]}}", "x".repeat(4 * max));
    for i in 0..20 {
        let r = client.post(&url).header("content-type", "application/json").body(body.clone()).send().await;
        let r = r.unwrap_or_else(|e| panic!("request {i}: no answer: {e:?}"));
        assert_eq!(r.status(), 413);
        assert_eq!(r.headers()["connection"], "close");
        assert_eq!(r.json::<Value>().await.unwrap()["type"], "too_large");
    }
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_in_time_gets_a_json_408() {
    let limits = Limits { body_read_timeout: Duration::from_millis(500), ..limits() };
    let (running, _) = server(limits, Duration::from_secs(5)).await;
    let mut s = TcpStream::connect(running.addr).await.unwrap();
    let t = Instant::now();
    s.write_all(
        b"POST /v1/tokenize HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 60\r\n\r\n{\"inputs\":",
    )
    .await
    .unwrap();
    let r = read_one(&mut s).await;
    assert_eq!(r.status, 408, "got {:?}", r.head);
    assert_eq!(r.json()["type"], "request_timeout");
    assert_eq!(r.header("connection"), Some("close"));
    assert!(t.elapsed() >= Duration::from_millis(400), "answered after {:?}", t.elapsed());
    assert!(closed_within(&mut s, Duration::from_secs(2)).await);
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}

/// Sends `n` hidden-state requests of `tokens` tokens each at once; each result is
/// (status, has Retry-After) or the transport error.
fn in_flight(
    addr: std::net::SocketAddr,
    n: usize,
    tokens: u32,
) -> Vec<tokio::task::JoinHandle<Result<(u16, bool), String>>> {
    (0..n)
        .map(|k| {
            tokio::spawn(async move {
                let ids: Vec<u32> = (0..tokens).map(|t| (t + k as u32) % 500).collect();
                let r = reqwest::Client::new()
                    .post(format!("http://{addr}/v1/hidden-states"))
                    .json(&json!({"inputs": [{"input_ids": ids}], "layers": [1]}))
                    .send()
                    .await
                    .map_err(|e| format!("{e:?}"))?;
                let status = r.status().as_u16();
                let retry = r.headers().contains_key("retry-after");
                r.bytes().await.map_err(|e| format!("{e:?}"))?;
                Ok((status, retry))
            })
        })
        .collect()
}

/// Waits until every one of `n` requests has been admitted (queued, running or answered).
async fn wait_admitted(running: &Running, control: &FakeControl, n: usize) {
    let t = Instant::now();
    // Each batch holds one request here, so batches started count the requests answered or running.
    while (running.state.metrics.queue_requests.get() as usize)
        + control.batches.load(Ordering::SeqCst).saturating_sub(1)
        < n
    {
        assert!(t.elapsed() < Duration::from_secs(10), "the requests were never all admitted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every request got 200 or 503 with Retry-After; returns how many of each.
async fn tally(tasks: Vec<tokio::task::JoinHandle<Result<(u16, bool), String>>>) -> (usize, usize) {
    let (mut ok, mut unavailable) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok((200, _)) => ok += 1,
            Ok((503, true)) => unavailable += 1,
            other => panic!("a request in flight got {other:?}"),
        }
    }
    (ok, unavailable)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_every_request_in_flight_and_keeps_to_its_timeout() {
    // One 100-token request per batch, 250 ms each: 30 requests are ~7.5 s of work.
    let limits = Limits { max_batch_tokens: 128, max_queue_tokens: 1 << 20, ..limits() };
    let drain = Duration::from_secs(1);
    let (running, control) = server(limits, drain).await;
    control.delay_ms.store(250, Ordering::SeqCst);
    // Two connections in the middle of a request head when the signal comes.
    let mut mid_api = TcpStream::connect(running.addr).await.unwrap();
    mid_api.write_all(b"POST /v1/tokenize HTTP/1.1\r\nhost: t\r\n").await.unwrap();
    let mut mid_ready = TcpStream::connect(running.addr).await.unwrap();
    mid_ready.write_all(b"GET /ready HTTP/1.1\r\nhost: t\r\n").await.unwrap();
    // An idle keep-alive connection.
    let mut idle = TcpStream::connect(running.addr).await.unwrap();
    idle.write_all(GET_HEALTH).await.unwrap();
    assert_eq!(read_one(&mut idle).await.status, 200);
    let tasks = in_flight(running.addr, 30, 100);
    wait_admitted(&running, &control, 30).await;
    let t0 = Instant::now();
    running.shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!running.state.is_ready(), "readiness did not turn 503 at once");
    assert!(TcpStream::connect(running.addr).await.is_err(), "a new connection was accepted while draining");
    assert!(closed_within(&mut idle, Duration::from_millis(500)).await, "an idle connection was kept while draining");
    // A request that arrives on an open connection is refused, and its connection closed.
    let body = json!({"inputs": [{"input_ids": [1]}]}).to_string();
    let rest = format!("content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    mid_api.write_all(rest.as_bytes()).await.unwrap();
    let r = read_one(&mut mid_api).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["type"], "unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(r.header("connection"), Some("close"));
    mid_ready.write_all(b"\r\n").await.unwrap();
    let r = read_one(&mut mid_ready).await;
    assert_eq!((r.status, r.json()["status"].as_str()), (503, Some("draining")));
    assert_eq!(r.header("connection"), Some("close"));
    let (ok, unavailable) = tally(tasks).await;
    running.task.await.unwrap().unwrap();
    let took = t0.elapsed();
    assert!(ok >= 1, "no finished work was delivered");
    assert!(unavailable >= 1, "nothing was still in flight at the deadline");
    assert!(took < drain + Duration::from_millis(2500), "shutdown took {took:?} with a {drain:?} timeout");
    assert!(took >= drain - Duration::from_millis(200), "shutdown did not wait for the work in flight ({took:?})");
    eprintln!("drain: {ok} answered 200, {unavailable} answered 503, stopped after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoning_the_drain_early_still_answers_every_request() {
    let limits = Limits { max_batch_tokens: 128, max_queue_tokens: 1 << 20, ..limits() };
    let (running, control) = server(limits, Duration::from_secs(60)).await;
    control.delay_ms.store(250, Ordering::SeqCst);
    let tasks = in_flight(running.addr, 12, 100);
    wait_admitted(&running, &control, 12).await;
    let t0 = Instant::now();
    running.shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // What a second SIGTERM does.
    running.state.abandon.cancel();
    let (_, unavailable) = tally(tasks).await;
    running.task.await.unwrap().unwrap();
    assert!(unavailable >= 1);
    assert!(t0.elapsed() < Duration::from_secs(4), "stopping took {:?}", t0.elapsed());
}
