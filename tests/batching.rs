//! Batches that nobody waits for stop between layers, and running out of device memory never
//! fails a request that fits alone: against the fake engine on a real socket, and the real
//! decoder's cancellation check on a tiny checkpoint.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use layertap::engine::{Batch, Cancel, DType, Device, Engine, EngineError};
use layertap::http::Limits;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn post(base: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{base}/v1/hidden-states"))
        .header("accept-encoding", "identity")
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The value of an unlabelled metric in the server's exposition (0 when absent).
async fn metric(base: &str, name: &str) -> f64 {
    let text = client().get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// Sends a whole request on a raw socket and keeps the socket open without reading: dropping
/// it is a client hanging up mid-request.
async fn raw_request(base: &str, body: &Value) -> tokio::net::TcpStream {
    let addr = base.trim_start_matches("http://");
    let body = body.to_string();
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/hidden-states HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    sock
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A request that holds the worker for `delay_ms` in a batch of its own (index 0: no layers).
fn blocker(s: &FakeServer, delay_ms: usize) -> tokio::task::JoinHandle<u16> {
    s.control.delay_ms.store(delay_ms, Ordering::SeqCst);
    let base = s.base.clone();
    tokio::spawn(
        async move { post(&base, &json!({"inputs": [{"input_ids": [7]}], "layers": [0]})).await.status().as_u16() },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_clients_all_hung_up_stops_between_layers_and_the_next_request_runs_at_once() {
    const LAYER_MS: usize = 2000;
    let s = fake_server(limits(), vec![]).await;
    s.control.layer_delay_ms.store(LAYER_MS, Ordering::SeqCst);
    let first = blocker(&s, 1500);
    until("the blocker to start", || s.control.batches.load(Ordering::SeqCst) == 1).await;
    s.control.delay_ms.store(0, Ordering::SeqCst);
    // Six clients queue behind it, all asking for the deepest index (every layer runs).
    let mut socks = Vec::new();
    for i in 0..6u32 {
        let ids: Vec<u32> = (0..3).map(|k| 100 + i * 3 + k).collect();
        socks.push(raw_request(&s.base, &json!({"inputs": [{"input_ids": ids}], "layers": [FAKE_LAYERS]})).await);
    }
    let m = s.running.state.metrics.clone();
    until("the six requests to be queued", || m.queue_tokens.get() == 18).await;
    assert_eq!(first.await.unwrap(), 200);
    until("their batch to start", || s.control.batches.load(Ordering::SeqCst) == 2).await;
    let batch_started = Instant::now();
    assert_eq!(s.control.batch_tokens.lock().unwrap()[1], 18, "the six requests share one batch");
    // Every client hangs up while its batch runs its first layer.
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(socks);
    // A short request sent now is answered long before the abandoned batch would have ended.
    let r = post(&s.base, &json!({"inputs": [{"input_ids": [5, 6]}], "layers": [0]})).await;
    assert_eq!(r.status(), 200);
    let (t, _) = read_safetensors_bytes(&r.bytes().await.unwrap());
    assert_eq!(t["hidden_states"].f32[0], fake_value(5, 0, 0));
    let waited = batch_started.elapsed();
    let full = Duration::from_millis((FAKE_LAYERS * LAYER_MS) as u64);
    assert!(waited < full, "the short request waited {waited:?}, as long as the whole abandoned batch ({full:?})");
    let run = s.control.layers_run.lock().unwrap().clone();
    assert!(run[1] <= 2, "the abandoned batch ran {} of {FAKE_LAYERS} layers", run[1]);
    assert_eq!(metric(&s.base, "layertap_cancelled_batches_total").await, 1.0);
    assert_eq!(metric(&s.base, "layertap_cancelled_sequences_total").await, 6.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_times_out_in_the_server_stops_its_batch() {
    let mut l = limits();
    l.request_timeout = Duration::from_secs(1);
    let s = fake_server(l, vec![]).await;
    s.control.layer_delay_ms.store(1500, Ordering::SeqCst);
    let r = post(&s.base, &json!({"inputs": [{"input_ids": [1, 2, 3]}], "layers": [FAKE_LAYERS]})).await;
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "unavailable");
    until("the batch to stop", || !s.control.layers_run.lock().unwrap().is_empty()).await;
    let run = s.control.layers_run.lock().unwrap()[0];
    assert!(run < FAKE_LAYERS, "the timed-out batch ran all {run} layers");
    assert_eq!(metric(&s.base, "layertap_cancelled_batches_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_one_live_request_runs_to_the_end() {
    let s = fake_server(limits(), vec![]).await;
    s.control.layer_delay_ms.store(300, Ordering::SeqCst);
    let first = blocker(&s, 1500);
    until("the blocker to start", || s.control.batches.load(Ordering::SeqCst) == 1).await;
    s.control.delay_ms.store(0, Ordering::SeqCst);
    let gone = raw_request(&s.base, &json!({"inputs": [{"input_ids": [40, 41]}], "layers": [FAKE_LAYERS]})).await;
    let live = tokio::spawn({
        let base = s.base.clone();
        async move { post(&base, &json!({"inputs": [{"input_ids": [50, 51, 52]}], "layers": [FAKE_LAYERS, 1]})).await }
    });
    let m = s.running.state.metrics.clone();
    until("both requests to be queued", || m.queue_tokens.get() == 5).await;
    assert_eq!(first.await.unwrap(), 200);
    until("their batch to start", || s.control.batches.load(Ordering::SeqCst) == 2).await;
    drop(gone);
    let r = live.await.unwrap();
    assert_eq!(r.status(), 200);
    let (t, _) = read_safetensors_bytes(&r.bytes().await.unwrap());
    for (row, id) in [50u32, 51, 52].into_iter().enumerate() {
        for (k, layer) in [FAKE_LAYERS, 1].into_iter().enumerate() {
            assert_eq!(t["hidden_states"].f32[(row * 2 + k) * FAKE_HIDDEN], fake_value(id, layer, 0));
        }
    }
    assert_eq!(s.control.batch_tokens.lock().unwrap()[1], 5, "the two requests share one batch");
    assert_eq!(s.control.layers_run.lock().unwrap()[1], FAKE_LAYERS);
    assert_eq!(metric(&s.base, "layertap_cancelled_batches_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_sequences_go_before_a_long_one_which_waits_at_most_its_own_length() {
    const LONG: usize = 40;
    let s = fake_server(Limits { max_batch_tokens: 16, ..limits() }, vec![]).await;
    let first = blocker(&s, 1000);
    until("the blocker to start", || s.control.batches.load(Ordering::SeqCst) == 1).await;
    s.control.delay_ms.store(0, Ordering::SeqCst);
    let m = s.running.state.metrics.clone();
    // A sequence longer than the budget (it runs alone), then forty 2-token requests behind it.
    let long: Vec<u32> = (200..200 + LONG as u32).collect();
    let mut tasks = vec![tokio::spawn({
        let base = s.base.clone();
        async move { post(&base, &json!({"inputs": [{"input_ids": long}], "layers": [1]})).await.status() }
    })];
    until("the long request to be queued", || m.queue_tokens.get() as usize == LONG).await;
    for i in 0..40u32 {
        let base = s.base.clone();
        tasks.push(tokio::spawn(async move {
            post(&base, &json!({"inputs": [{"input_ids": [i, i + 1]}], "layers": [1]})).await.status()
        }));
    }
    until("every request to be queued", || m.queue_tokens.get() as usize == LONG + 80).await;
    assert_eq!(first.await.unwrap(), 200);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let sizes = s.control.batch_tokens.lock().unwrap()[1..].to_vec();
    let at = sizes.iter().position(|&t| t == LONG).expect("the long sequence ran alone");
    let before: usize = sizes[..at].iter().sum();
    assert!(before > 0, "the long sequence ran ahead of every short one: {sizes:?}");
    assert!(before < LONG + 16, "the long sequence waited behind {before} tokens of later work: {sizes:?}");
    assert!(at + 1 < sizes.len(), "every short sequence went first: {sizes:?}");
}

/// Requests of several inputs each, with layers and dtypes that differ between requests.
fn oom_requests() -> Vec<Value> {
    (0..8u32)
        .map(|i| {
            let a: Vec<u32> = (0..(8 + i % 5)).map(|k| 10 + i * 20 + k).collect();
            let b: Vec<u32> = (0..(14 - i % 4)).map(|k| 300 + i * 20 + k).collect();
            let (layers, dtype) = if i % 2 == 0 { (json!([1, 3]), "float32") } else { (json!([4, 0, 2]), "bfloat16") };
            json!({"inputs": [{"input_ids": a}, {"input_ids": b}], "layers": layers, "dtype": dtype})
        })
        .collect()
}

async fn oom_splits_batches_and_answers_every_request_unchanged(at_wait: bool) {
    const FITS: usize = 40;
    let s = fake_server(limits(), vec![]).await;
    let reqs = oom_requests();
    // The answers when every request runs alone and nothing runs out of memory.
    let mut want = Vec::new();
    for body in &reqs {
        let r = post(&s.base, body).await;
        assert_eq!(r.status(), 200);
        want.push(r.bytes().await.unwrap());
    }
    let budget = s.running.state.scheduler.max_batch_tokens();
    s.control.oom_above.store(FITS, Ordering::SeqCst);
    s.control.oom_at_wait.store(at_wait, Ordering::SeqCst);
    let launched_before = s.control.batch_tokens.lock().unwrap().len();
    // Everything queues behind a blocker, so the worker packs it into batches too big to fit.
    let first = blocker(&s, 1000);
    until("the blocker to start", || s.control.batches.load(Ordering::SeqCst) == launched_before + 1).await;
    s.control.delay_ms.store(0, Ordering::SeqCst);
    let tasks: Vec<_> = reqs
        .iter()
        .cloned()
        .map(|body| {
            let base = s.base.clone();
            tokio::spawn(async move {
                let r = post(&base, &body).await;
                (r.status().as_u16(), r.bytes().await.unwrap())
            })
        })
        .collect();
    let total: usize = reqs
        .iter()
        .flat_map(|r| r["inputs"].as_array().unwrap())
        .map(|i| i["input_ids"].as_array().unwrap().len())
        .sum();
    let m = s.running.state.metrics.clone();
    until("every request to be queued", || m.queue_tokens.get() as usize == total).await;
    assert_eq!(first.await.unwrap(), 200);
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, bytes) = t.await.unwrap();
        assert_eq!(status, 200, "request {i}: {}", String::from_utf8_lossy(&bytes));
        assert!(bytes == want[i], "request {i}: the answer differs from the one computed unsplit");
    }
    let sizes = s.control.batch_tokens.lock().unwrap()[launched_before + 1..].to_vec();
    assert!(sizes.iter().any(|&t| t > FITS), "no batch was too big to fit: {sizes:?}");
    assert!(metric(&s.base, "layertap_oom_retries_total").await >= 1.0);
    let now = s.running.state.scheduler.max_batch_tokens();
    assert!(now < budget, "the batch budget stayed at {now}");
    assert_eq!(metric(&s.base, "layertap_batch_token_budget").await, now as f64);
    let info: Value = client().get(format!("{}/v1/info", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["max_batch_tokens"], now);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_at_launch_splits_the_batch_and_every_answer_is_unchanged() {
    oom_splits_batches_and_answers_every_request_unchanged(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_when_collected_splits_the_batch_and_every_answer_is_unchanged() {
    oom_splits_batches_and_answers_every_request_unchanged(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_that_does_not_fit_alone_gets_413_and_the_budget_stays_sane() {
    let s = fake_server(limits(), vec![]).await;
    s.control.oom_above.store(40, Ordering::SeqCst);
    let budget = s.running.state.scheduler.max_batch_tokens();
    let long: Vec<u32> = (0..60).collect();
    let r = post(&s.base, &json!({"inputs": [{"input_ids": [1, 2]}, {"input_ids": long}], "layers": [1]})).await;
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "too_large");
    let msg = v["error"].as_str().unwrap();
    assert!(msg.contains("inputs[1]") && msg.contains("60 tokens"), "{msg}");
    assert!(msg.contains(&format!("{} tokens", s.running.state.scheduler.max_batch_tokens())), "{msg}");
    // It ran once more alone before being refused; the short input beside it ran on its own.
    let sizes = s.control.batch_tokens.lock().unwrap().clone();
    assert_eq!(sizes.iter().filter(|&&t| t == 60).count(), 2, "{sizes:?}");
    assert!(sizes.contains(&2), "{sizes:?}");
    // The lone sequence's size says nothing of packing: only the batch of both lowered the budget.
    let now = s.running.state.scheduler.max_batch_tokens();
    assert_eq!(now, 62 / 2, "budget {budget} -> {now}");
    // A lone long input alone leaves the budget where it is; later batches of inputs that
    // fit are answered.
    let r = post(&s.base, &json!({"inputs": [{"input_ids": (0..50).collect::<Vec<u32>>()}], "layers": [1]})).await;
    assert_eq!(r.status(), 413);
    assert_eq!(s.running.state.scheduler.max_batch_tokens(), now);
    let r = post(&s.base, &json!({"inputs": [{"input_ids": vec![3; 30]}, {"input_ids": vec![4; 30]}], "layers": [2]}))
        .await;
    assert_eq!(r.status(), 200);
    assert!(metric(&s.base, "layertap_oom_retries_total").await >= 3.0);
}

#[test]
fn candle_out_of_memory_errors_become_out_of_memory() {
    let oom =
        EngineError::from(candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into()));
    assert!(matches!(oom, EngineError::OutOfMemory(_)), "{oom:?}");
    let other = EngineError::from(candle_core::Error::Msg("shape mismatch in matmul".into()));
    assert!(matches!(other, EngineError::Compute(_)), "{other:?}");
}

/// The real decoder asks its cancellation check before every layer and stops when told.
#[test]
fn the_decoder_stops_between_layers_when_its_batch_is_cancelled() {
    let dir = fixtures().join("tiny/qwen3_qknorm");
    let (mut m, _) = layertap::engine::load(&dir.to_string_lossy(), &Device::Cpu, DType::F32).unwrap();
    let n = m.info.num_layers;
    assert!(n >= 2, "the fixture has {n} layers");
    let batch = Batch::new(vec![1, 2, 3, 4, 5], vec![0, 2, 5], vec![n]);
    for stop_after in 0..n {
        let asked = Arc::new(AtomicUsize::new(0));
        let cancel = Cancel::new({
            let asked = asked.clone();
            move || asked.fetch_add(1, Ordering::SeqCst) >= stop_after
        });
        match m.engine.launch_cancellable(&batch, &cancel) {
            Err(EngineError::Cancelled { layers_run }) => assert_eq!(layers_run, stop_after),
            Err(e) => panic!("stopping after {stop_after} layers: {e}"),
            Ok(_) => panic!("the decoder ran every layer although cancelled after {stop_after}"),
        }
        assert_eq!(asked.load(Ordering::SeqCst), stop_after + 1, "one check per layer");
    }
    // Never cancelled: every layer runs, each after a check.
    let asked = Arc::new(AtomicUsize::new(0));
    let cancel = Cancel::new({
        let asked = asked.clone();
        move || {
            asked.fetch_add(1, Ordering::SeqCst);
            false
        }
    });
    let taps = m.engine.launch_cancellable(&batch, &cancel).unwrap().wait().unwrap();
    assert_eq!(taps.layers_run, n);
    assert_eq!(asked.load(Ordering::SeqCst), n);
}
