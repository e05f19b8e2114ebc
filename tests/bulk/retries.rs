//! Answers damaged or throttled between the server and `layertap bulk`: a proxy corrupts or
//! answers 429 to the requests it picks; checksums catch the damage and retries land every sample.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;

use crate::common::*;
use crate::{assert_states, entry, manifest, p, raw_tensors, run_extract, tensor_start, walk, write_input, xxh64};

/// A proxy in front of a server that flips one bit of the hidden states in the answers `corrupt`
/// picks (given the sample's token ids and how many requests for them came before), and counts
/// the requests per sample. Answers go out uncompressed.
struct Proxy {
    base: String,
    hits: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<Vec<u64>, usize>>>,
}

impl Proxy {
    fn hits(&self, ids: &[u32]) -> usize {
        let key: Vec<u64> = ids.iter().map(|&x| u64::from(x)).collect();
        self.hits.lock().unwrap().get(&key).copied().unwrap_or(0)
    }
}

/// What a [`proxy`] does with one request.
#[derive(Clone, Copy, PartialEq)]
enum Act {
    Pass,
    /// Flip one bit of the hidden states in the answer.
    Corrupt,
    /// Answer 429 with `Retry-After: 1` instead.
    Throttle,
}

/// A front for `target` that does with each request what `act` says (given the sample's token
/// ids and how many requests for them came before) and counts the requests per sample.
async fn proxy(target: String, act: impl Fn(&[u64], usize) -> Act + Clone + Send + Sync + 'static) -> Proxy {
    use axum::body::Bytes;
    let hits: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<Vec<u64>, usize>>> = Default::default();
    let h = hits.clone();
    let info_of = target.clone();
    let handler = move |body: Bytes| {
        let (target, hits, act) = (target.clone(), h.clone(), act.clone());
        async move {
            let req: Value = serde_json::from_slice(&body).unwrap();
            let key: Vec<u64> =
                req["inputs"][0]["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            let n = {
                let mut m = hits.lock().unwrap();
                let c = m.entry(key.clone()).or_insert(0);
                *c += 1;
                *c - 1
            };
            let act = act(&key, n);
            if act == Act::Throttle {
                let headers = [("content-type", "application/json"), ("retry-after", "1")];
                return (axum::http::StatusCode::TOO_MANY_REQUESTS, headers, b"{\"error\":\"busy\"}".to_vec());
            }
            let r = client()
                .post(format!("{target}/v1/hidden-states"))
                .header("content-type", "application/json")
                .header("accept-encoding", "identity")
                .body(body.to_vec())
                .send()
                .await
                .unwrap();
            let status = axum::http::StatusCode::from_u16(r.status().as_u16()).unwrap();
            let mut answer = r.bytes().await.unwrap().to_vec();
            if status.is_success() && act == Act::Corrupt {
                let at = tensor_start(&answer, "hidden_states");
                answer[at] ^= 0x01;
            }
            let headers = [("content-type", "application/octet-stream"), ("x-proxy", "1")];
            (status, headers, answer)
        }
    };
    // The model's description passes through as it is (bulk reads it before any request).
    let info = move || {
        let url = format!("{info_of}/v1/info");
        async move {
            let r = client().get(url).send().await.unwrap();
            let status = axum::http::StatusCode::from_u16(r.status().as_u16()).unwrap();
            (status, [("content-type", "application/json")], r.bytes().await.unwrap().to_vec())
        }
    };
    let app = axum::Router::new()
        .route("/v1/hidden-states", axum::routing::post(handler))
        .route("/v1/info", axum::routing::get(info));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Proxy { base, hits }
}

/// A proxy that corrupts the answers `corrupt` picks.
async fn corrupting_proxy(target: String, corrupt: fn(&[u64], usize) -> bool) -> Proxy {
    proxy(target, move |k, n| if corrupt(k, n) { Act::Corrupt } else { Act::Pass }).await
}

/// A proxy that answers 429 with `Retry-After: 1` to the first request for each sample (by its
/// token ids) and passes the others on.
async fn throttling_proxy(target: String) -> Proxy {
    proxy(target, |_, n| if n == 0 { Act::Throttle } else { Act::Pass }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_corrupted_in_transit_is_retried_and_lands_intact() {
    let s = fake_server(limits(), vec![]).await;
    // Only the first answer for sample b is damaged.
    let proxy = corrupting_proxy(s.base.clone(), |ids, n| ids == [11, 12, 13] && n == 0).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    let samples = [("a", vec![1, 2]), ("b", vec![11, 12, 13]), ("c", vec![5])];
    write_input(&input, &samples);
    let (code, err) = run_extract(&proxy.base, &input, &out, "1,-1", &["--dtype", "float32", "--retries", "3"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(proxy.hits(&[11, 12, 13]), 2, "the corrupted answer was asked again");
    assert_eq!(proxy.hits(&[1, 2]), 1);
    let m = manifest(&out);
    assert_eq!(m.len(), 3);
    for (id, ids) in &samples {
        let e = entry(&m, id);
        let bytes = std::fs::read(out.join(e["file"].as_str().unwrap())).unwrap();
        let (t, meta) = read_safetensors_bytes(&bytes);
        assert_states(&t, ids, &[1, FAKE_LAYERS], id);
        // The manifest records the whole file's xxh64 and each tensor's, as the file's metadata does.
        assert_eq!(e["xxh64"], xxh64(&bytes), "{id}");
        let sums: Value = serde_json::from_str(&meta["checksums"]).unwrap();
        assert_eq!(e["checksums"], sums, "{id}");
        for (name, (_, _, data)) in raw_tensors(&bytes) {
            assert_eq!(e["checksums"][&name], xxh64(&data), "{id}: {name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_corrupted_every_time_fails_with_a_checksum_message_and_no_file() {
    let s = fake_server(limits(), vec![]).await;
    let proxy = corrupting_proxy(s.base.clone(), |ids, _| ids == [11, 12, 13]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    write_input(&input, &[("a", vec![1, 2]), ("b", vec![11, 12, 13]), ("c", vec![5])]);
    let (code, err) = run_extract(&proxy.base, &input, &out, "1,-1", &["--retries", "2"]).await;
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(proxy.hits(&[11, 12, 13]), 3, "one attempt and two retries");
    let ids: HashSet<String> = manifest(&out).iter().map(|v| v["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, HashSet::from(["a".to_string(), "c".to_string()]));
    let failures: Vec<Value> = std::fs::read_to_string(out.join("failures.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["id"], "b");
    let msg = failures[0]["error"].as_str().unwrap();
    assert!(msg.contains("checksum") && msg.contains("hidden_states"), "{msg}");
    let files: Vec<_> = walk(&out).into_iter().map(|f| p(f.strip_prefix(&out).unwrap())).collect();
    let b_file = format!("shard-00000/b-{}.safetensors", xxh64(b"b"));
    assert!(!files.iter().any(|f| f.starts_with(&b_file)), "a file was written for b: {files:?}");
    assert_eq!(files.iter().filter(|f| f.ends_with(".safetensors")).count(), 2, "{files:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_retried_after_its_retry_after_and_every_sample_lands_once() {
    let s = fake_server(limits(), vec![]).await;
    let proxy = throttling_proxy(s.base.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    let samples = [("a", vec![1, 2]), ("b", vec![11, 12, 13]), ("c", vec![5])];
    write_input(&input, &samples);
    let started = std::time::Instant::now();
    let (code, err) = run_extract(&proxy.base, &input, &out, "1,-1", &["--dtype", "float32", "--retries", "2"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(started.elapsed() >= Duration::from_secs(1), "Retry-After: 1 was not waited out");
    for (id, ids) in &samples {
        assert_eq!(proxy.hits(ids), 2, "{id}: one 429, then one answer");
    }
    let line = err.lines().find(|l| l.starts_with(&format!("server {}: ", proxy.base))).unwrap_or_default();
    assert_eq!(line, format!("server {}: 3 answered, 0 failed, 3 throttled (429)", proxy.base), "{err}");
    let m = manifest(&out);
    assert_eq!(m.len(), 3);
    for (id, ids) in &samples {
        assert_states(
            &read_safetensors(&out.join(entry(&m, id)["file"].as_str().unwrap())),
            ids,
            &[1, FAKE_LAYERS],
            id,
        );
    }
}
