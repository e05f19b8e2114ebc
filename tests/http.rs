//! The HTTP API and batching against a fake engine on a real socket: fast and exhaustive.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_request_returns_zstd_safetensors_with_every_tensor() {
    let s = fake_server(limits(), vec![]).await;
    let msgs = json!([{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "General Kenobi"}]);
    let body = json!({
        "inputs": [{"input_ids": [1, 2, 3]}, {"text": "plain text, tokenized"}, {"messages": msgs}],
        "layers": [2, -1, 0],
        "dtype": "bfloat16"
    });
    let r = post(&s.base, "/v1/hidden-states", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-encoding"], "zstd");
    for h in ["x-queue-time", "x-inference-time", "x-tokens", "x-request-id"] {
        assert!(r.headers().contains_key(h), "missing header {h}");
    }
    let bytes = unzstd(&r.bytes().await.unwrap());
    let (t, meta) = read_safetensors_bytes(&bytes);
    // The same inputs through /v1/tokenize give the ids and mask the answer must carry.
    let tk: Value = post(
        &s.base,
        "/v1/tokenize",
        json!({"inputs": [{"input_ids": [1, 2, 3]}, {"text": "plain text, tokenized"}, {"messages": msgs}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    let results = tk["results"].as_array().unwrap();
    let ids: Vec<i64> =
        results.iter().flat_map(|r| r["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap())).collect();
    let mask: Vec<i64> =
        results.iter().flat_map(|r| r["loss_mask"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap())).collect();
    assert_eq!(t["input_ids"].i64, ids);
    assert_eq!(t["loss_mask"].i64, mask);
    let lens: Vec<i64> = results.iter().map(|r| r["input_ids"].as_array().unwrap().len() as i64).collect();
    assert_eq!(t["cu_seqlens"].i64, vec![0, lens[0], lens[0] + lens[1], lens[0] + lens[1] + lens[2]]);
    // Plain inputs count every token; the chat counts only the assistant's part.
    assert!(mask[..(lens[0] + lens[1]) as usize].iter().all(|&m| m == 1));
    let chat_mask = &mask[(lens[0] + lens[1]) as usize..];
    assert!(chat_mask.contains(&0) && chat_mask.contains(&1), "chat mask {chat_mask:?}");
    let total = ids.len();
    assert_eq!(t["hidden_states"].shape, vec![total, 3, FAKE_HIDDEN]);
    for (row, &id) in ids.iter().enumerate() {
        for (k, layer) in [2usize, FAKE_LAYERS, 0].into_iter().enumerate() {
            for h in 0..FAKE_HIDDEN {
                let want = half::bf16::from_f32(fake_value(id as u32, layer, h)).to_f32();
                assert_eq!(t["hidden_states"].f32[(row * 3 + k) * FAKE_HIDDEN + h], want);
            }
        }
    }
    assert_eq!(meta["layers"], "[2,4,0]");
    assert_eq!(meta["dtype"], "bfloat16");
    assert!(meta["convention"].contains("index 0 = embedding output"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_and_json_modes() {
    let s = fake_server(limits(), vec![]).await;
    let body = json!({"inputs": [{"input_ids": [5, 6]}], "layers": [1]});
    let r = client()
        .post(format!("{}/v1/hidden-states", s.base))
        .header("accept-encoding", "identity")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("content-encoding").is_none());
    let (t, _) = read_safetensors_bytes(&r.bytes().await.unwrap());
    assert_eq!(t["hidden_states"].f32[0], fake_value(5, 1, 0));
    let r = client()
        .post(format!("{}/v1/hidden-states", s.base))
        .header("accept-encoding", "gzip, zstd;q=0")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("content-encoding").is_none(), "zstd;q=0 refuses zstd");
    let r = client()
        .post(format!("{}/v1/hidden-states", s.base))
        .header("accept", "application/json")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["shape"], json!([2, 1, FAKE_HIDDEN]));
    assert_eq!(v["hidden_states"][FAKE_HIDDEN].as_f64().unwrap() as f32, fake_value(6, 1, 0));
    assert_eq!(v["input_ids"], json!([5, 6]));
    assert_eq!(v["cu_seqlens"], json!([0, 2]));
    // A JSON answer past the cap is refused with a hint.
    let mut small = limits();
    small.max_json_values = 10;
    let s2 = fake_server(small, vec![]).await;
    let r = client()
        .post(format!("{}/v1/hidden-states", s2.base))
        .header("accept", "application/json")
        .json(&body)
        .send()
        .await
        .unwrap();
    let (code, kind, msg) = error_of(r).await;
    assert_eq!((code, kind.as_str()), (413, "too_large"));
    assert!(msg.contains("safetensors"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_class_has_its_status_and_a_json_body() {
    let s = fake_server(limits(), vec![]).await;
    let url = format!("{}/v1/hidden-states", s.base);
    let c = client();
    let r = c.post(&url).header("content-type", "application/json").body("{not json").send().await.unwrap();
    assert_eq!(error_of(r).await.0, 400);
    let r = c.post(&url).header("content-type", "text/plain").body("{}").send().await.unwrap();
    assert_eq!(error_of(r).await.0, 415);
    let cases = [
        (json!({"inputs": [{"input_ids": [1]}], "layers": [FAKE_LAYERS + 1]}), "out of range"),
        (json!({"inputs": [{"input_ids": [1]}], "layers": [-(FAKE_LAYERS as i64) - 2]}), "out of range"),
        (json!({"inputs": [{"input_ids": [1]}], "layers": []}), "at least one"),
        (json!({"inputs": [{"input_ids": [FAKE_VOCAB]}], "layers": [1]}), "vocabulary"),
        (json!({"inputs": [{"input_ids": [-1]}], "layers": [1]}), "vocabulary"),
        (json!({"inputs": [], "layers": [1]}), "empty"),
        (json!({"inputs": [{"input_ids": []}], "layers": [1]}), "no tokens"),
        (json!({"inputs": [{"input_ids": [1]}], "layers": [1], "dtype": "int8"}), "unknown dtype"),
        (json!({"inputs": [{"input_ids": [1], "text": "x"}], "layers": [1]}), "exactly one"),
        (json!({"inputs": [{}], "layers": [1]}), "give one of"),
        (json!({"inputs": [{"messages": []}], "layers": [1]}), "at least one message"),
        (json!({"inputs": [{"input_ids": [1]}], "layers": "all"}), "layers"),
        (json!({"inputs": [{"input_ids": [1]}], "layers": [1], "extra": 1}), "unknown field"),
        (
            json!({"inputs": [{"messages": [{"role": "assistant", "content": "a", "thinking": "b",
                                              "reasoning_content": "c"}]}], "layers": [1]}),
            "duplicate field",
        ),
        (
            json!({"inputs": [{"messages": [{"role": "assistant", "content": "a", "reasoning": 5}]}], "layers": [1]}),
            "invalid type",
        ),
        (json!({"inputs": [{"text": "a", "chat_template_kwargs": {"x": 1}}], "layers": [1]}), "goes with messages"),
        (
            json!({"inputs": [{"messages": [{"role": "user", "content": "a"}],
                               "chat_template_kwargs": {"add_generation_prompt": true}}], "layers": [1]}),
            "sets itself",
        ),
        (
            json!({"inputs": [{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": 3}],
                   "layers": [1]}),
            "invalid type",
        ),
    ];
    for (body, needle) in cases {
        let (code, kind, msg) = error_of(post(&s.base, "/v1/hidden-states", body.clone()).await).await;
        assert_eq!((code, kind.as_str()), (422, "invalid_request"), "{body}: {msg}");
        assert!(msg.contains(needle), "{body}: {msg:?} should mention {needle:?}");
    }
    let long: Vec<u32> = vec![1; limits().max_input_tokens + 1];
    let (code, _, msg) =
        error_of(post(&s.base, "/v1/hidden-states", json!({"inputs": [{"input_ids": long}], "layers": [1]})).await)
            .await;
    assert_eq!(code, 413, "{msg}");
    let huge = "x".repeat(limits().max_body_bytes + 10);
    let (code, _, _) =
        error_of(post(&s.base, "/v1/hidden-states", json!({"inputs": [{"text": huge}], "layers": [1]})).await).await;
    assert_eq!(code, 413);
    let (code, kind, _) = error_of(c.get(format!("{}/nope", s.base)).send().await.unwrap()).await;
    assert_eq!((code, kind.as_str()), (404, "not_found"));
    let (code, _, _) = error_of(c.get(&url).send().await.unwrap()).await;
    assert_eq!(code, 405);
    // None of it reached the engine.
    assert!(s.control.seen.lock().unwrap().is_empty());
}

/// An assistant's reasoning is taken under each of the names transformers reads
/// (`reasoning_content`, `thinking`, `reasoning`), with the same answer, and a chat takes its
/// template variables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_taken_under_each_of_its_names() {
    let s = fake_server(limits(), vec![]).await;
    let mut answers = Vec::new();
    for name in ["reasoning_content", "thinking", "reasoning"] {
        let msgs =
            json!([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", name: "Two and two."}]);
        let r = post(&s.base, "/v1/tokenize", json!({"inputs": [{"messages": msgs}]})).await;
        assert_eq!(r.status(), 200, "{name}");
        let v: Value = r.json().await.unwrap();
        assert!(v["results"][0]["loss_mask"].as_array().unwrap().contains(&json!(1)), "{name}: {v}");
        answers.push(v);
    }
    assert!(answers.windows(2).all(|w| w[0] == w[1]));
    // Template variables go with the chat (this template reads none: the same answer).
    let msgs =
        json!([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "Two and two."}]);
    let body = json!({"inputs": [{"messages": msgs, "chat_template_kwargs": {"reasoning_effort": "high"}}]});
    let r = post(&s.base, "/v1/tokenize", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), answers[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after() {
    let mut l = limits();
    l.max_queue_tokens = 150;
    l.max_batch_tokens = 128;
    let s = fake_server(l, vec![]).await;
    s.control.delay_ms.store(400, Ordering::SeqCst);
    let body = json!({"inputs": [{"input_ids": vec![1; 100]}], "layers": [1]});
    let base = s.base.clone();
    let first = tokio::spawn({
        let b = body.clone();
        let base = base.clone();
        async move { post(&base, "/v1/hidden-states", b).await.status() }
    });
    // Wait until the worker has taken the first request; the second then waits in the queue.
    while s.control.batches.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = tokio::spawn({
        let b = body.clone();
        let base = base.clone();
        async move { post(&base, "/v1/hidden-states", b).await.status() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = post(&base, "/v1/hidden-states", body.clone()).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(error_of(r).await.1, "overloaded");
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
    let m = client().get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(m.contains(r#"layertap_requests_total{route="/v1/hidden-states",status="429"} 1"#), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_is_dropped_before_its_sequences_run() {
    let s = fake_server(limits(), vec![]).await;
    s.control.delay_ms.store(500, Ordering::SeqCst);
    let base = s.base.clone();
    let blocker = tokio::spawn({
        let base = base.clone();
        async move {
            post(&base, "/v1/hidden-states", json!({"inputs": [{"input_ids": [7]}], "layers": [1]})).await.status()
        }
    });
    while s.control.seen.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // This client gives up while its request waits behind the blocker: it closes its socket.
    {
        use tokio::io::AsyncWriteExt;
        let body = json!({"inputs": [{"input_ids": [99, 98]}], "layers": [1]}).to_string();
        let addr = base.trim_start_matches("http://");
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "POST /v1/hidden-states HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        sock.write_all(req.as_bytes()).await.unwrap();
        // Let the server admit it to the queue, then hang up.
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(sock);
    }
    assert_eq!(blocker.await.unwrap(), 200);
    // A later request runs; the abandoned ids never reached the engine.
    s.control.delay_ms.store(0, Ordering::SeqCst);
    assert_eq!(
        post(&base, "/v1/hidden-states", json!({"inputs": [{"input_ids": [8]}], "layers": [1]})).await.status(),
        200
    );
    let seen = s.control.seen.lock().unwrap().clone();
    assert_eq!(seen, vec![7, 8], "the abandoned request ran: {seen:?}");
    let m = client().get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("layertap_cancelled_sequences_total 1"), "{m}");
    // The hang-up is counted as a request, under nginx's status for it.
    assert!(m.contains(r#"layertap_requests_total{route="/v1/hidden-states",status="499"} 1"#), "{m}");
    // and it leaves the queue's gauge, as the answered ones do.
    assert!(m.lines().any(|l| l == "layertap_queue_requests 0"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_batched_and_each_gets_its_own_slices() {
    let s = fake_server(limits(), vec![]).await;
    s.control.delay_ms.store(50, Ordering::SeqCst);
    let mut tasks = Vec::new();
    for i in 0..12u32 {
        let base = s.base.clone();
        tasks.push(tokio::spawn(async move {
            let ids: Vec<u32> = (0..(i % 5 + 1)).map(|k| i * 10 + k).collect();
            let layers = if i % 2 == 0 { vec![0, 3] } else { vec![4] };
            let r = post(&base, "/v1/hidden-states", json!({"inputs": [{"input_ids": ids}], "layers": layers})).await;
            assert_eq!(r.status(), 200);
            let (t, _) = read_safetensors_bytes(&unzstd(&r.bytes().await.unwrap()));
            for (row, &id) in ids.iter().enumerate() {
                for (k, &l) in layers.iter().enumerate() {
                    let got = t["hidden_states"].f32[(row * layers.len() + k) * FAKE_HIDDEN];
                    assert_eq!(got, fake_value(id, l, 0));
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let batches = s.control.batches.load(Ordering::SeqCst);
    assert!(batches < 12, "12 concurrent requests should share batches, ran {batches}");
}

/// The device worker starts the next batch while the previous one's results are still being
/// collected (the copy to host memory), and every answer still arrives intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_batch_starts_while_the_last_one_is_collected() {
    let mut l = limits();
    l.max_batch_tokens = 4;
    l.max_input_tokens = 4;
    let s = fake_server(l, vec![]).await;
    s.control.collect_ms.store(500, Ordering::SeqCst);
    let mut tasks = Vec::new();
    for i in 0..3u32 {
        let base = s.base.clone();
        tasks.push(tokio::spawn(async move {
            let ids: Vec<u32> = (0..4).map(|k| i * 10 + k).collect();
            let r = post(&base, "/v1/hidden-states", json!({"inputs": [{"input_ids": ids}], "layers": [2]})).await;
            assert_eq!(r.status(), 200);
            let (t, _) = read_safetensors_bytes(&unzstd(&r.bytes().await.unwrap()));
            for (row, &id) in ids.iter().enumerate() {
                assert_eq!(t["hidden_states"].f32[row * FAKE_HIDDEN], fake_value(id, 2, 0));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let events = s.control.events.lock().unwrap().clone();
    assert_eq!(events.iter().filter(|e| e.0 == "launch").count(), 3, "one batch per request: {events:?}");
    let at = |e: (&'static str, usize)| events.iter().position(|x| *x == e).unwrap();
    assert!(at(("launch", 1)) < at(("done", 0)), "batch 1 should start before batch 0 is collected: {events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_in_flight_requests_and_turns_readiness_off() {
    let s = fake_server(limits(), vec![]).await;
    s.control.delay_ms.store(300, Ordering::SeqCst);
    let base = s.base.clone();
    let inflight = tokio::spawn({
        let base = base.clone();
        async move {
            post(&base, "/v1/hidden-states", json!({"inputs": [{"input_ids": [3]}], "layers": [1]})).await.status()
        }
    });
    while s.control.seen.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.running.shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!s.running.state.is_ready());
    assert_eq!(inflight.await.unwrap(), 200, "the in-flight request must finish");
    tokio::time::timeout(Duration::from_secs(10), s.running.task).await.expect("server stops").unwrap().unwrap();
    assert!(client().get(format!("{base}/health")).send().await.is_err(), "the socket is closed after shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_v1_routes_only() {
    let s = fake_server(limits(), vec!["k1".into(), "secret".into()]).await;
    let c = client();
    let url = format!("{}/v1/info", s.base);
    let (code, kind, _) = error_of(c.get(&url).send().await.unwrap()).await;
    assert_eq!((code, kind.as_str()), (401, "unauthorized"));
    assert_eq!(c.get(&url).bearer_auth("wrong").send().await.unwrap().status(), 401);
    assert_eq!(c.get(&url).bearer_auth("secret").send().await.unwrap().status(), 200);
    assert_eq!(c.get(&url).bearer_auth("k1").send().await.unwrap().status(), 200);
    for open in ["/health", "/ready", "/metrics", "/openapi.json", "/docs"] {
        assert_eq!(c.get(format!("{}{open}", s.base)).send().await.unwrap().status(), 200, "{open}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_metrics_report_the_model_and_move_with_traffic() {
    let s = fake_server(limits(), vec![]).await;
    let c = client();
    let info: Value = c.get(format!("{}/v1/info", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["num_layers"], FAKE_LAYERS);
    assert_eq!(info["hidden_size"], FAKE_HIDDEN);
    assert_eq!(info["max_input_tokens"], limits().max_input_tokens);
    let before = c.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    for name in [
        "layertap_model_info",
        "layertap_device_memory_used_bytes",
        "layertap_device_memory_total_bytes",
        "process_resident_memory_bytes",
    ] {
        assert!(before.contains(name), "missing {name}");
    }
    assert!(!before.contains("layertap_tokens_total 5"));
    let r =
        post(&s.base, "/v1/hidden-states", json!({"inputs": [{"input_ids": [1, 2, 3, 4, 5]}], "layers": [1]})).await;
    assert_eq!(r.status(), 200);
    let after = c.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    for needle in [
        "layertap_tokens_total 5",
        r#"layertap_requests_total{route="/v1/hidden-states",status="200"} 1"#,
        "layertap_batch_tokens_count 1",
        "layertap_batch_sequences_count 1",
        "layertap_inference_duration_seconds_count 1",
        "layertap_queue_duration_seconds_count 1",
        r#"layertap_request_duration_seconds_count{route="/v1/hidden-states"} 1"#,
        r#"layertap_hidden_state_bytes_total{stage="raw"} 160"#,
    ] {
        assert!(after.contains(needle), "missing {needle:?} in\n{after}");
    }
}

/// `layertap_answer_buffers_idle_bytes` from a /metrics scrape.
async fn idle_answer_bytes(base: &str) -> u64 {
    let text = client().get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("layertap_answer_buffers_idle_bytes "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the scrape carries layertap_answer_buffers_idle_bytes")
}

/// Large answers are written into reused buffers: once an answer has been sent its buffer is
/// idle in the pool (and on /metrics), the next answers of that size write into it instead of a
/// new one, and every answer still holds exactly its states, in either encoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answers_reuse_their_buffers_and_stay_exact() {
    let tokens = 7000;
    let lim =
        layertap::http::Limits { max_batch_tokens: 8192, max_input_tokens: 8192, max_queue_tokens: 16384, ..limits() };
    let s = fake_server(lim, vec![]).await;
    assert_eq!(idle_answer_bytes(&s.base).await, 0, "nothing idle before the first large answer");
    let ids: Vec<u32> = (0..tokens).map(|i| (i * 7 + 3) % FAKE_VOCAB as u32).collect();
    let layers = [0usize, 1, 2, 3, 4];
    let body = json!({"inputs": [{"input_ids": ids}], "layers": layers});
    let check = |bytes: &[u8]| {
        let (t, _) = read_safetensors_bytes(bytes);
        let hs = &t["hidden_states"];
        assert_eq!(hs.shape, vec![tokens as usize, layers.len(), FAKE_HIDDEN]);
        for (r, &id) in ids.iter().enumerate() {
            for (c, &l) in layers.iter().enumerate() {
                for h in 0..FAKE_HIDDEN {
                    let got = hs.f32[(r * layers.len() + c) * FAKE_HIDDEN + h];
                    assert_eq!(got, fake_value(id, l, h), "row {r}, layer {l}, component {h}");
                }
            }
        }
    };
    let mut idle_after_first = 0;
    for (i, encoding) in ["identity", "zstd", "identity", "zstd"].into_iter().enumerate() {
        let r = post_encoded(&s.base, &body, encoding).await;
        assert_eq!(r.status(), 200);
        let bytes = r.bytes().await.unwrap();
        let raw = if encoding == "zstd" { unzstd(&bytes) } else { bytes.to_vec() };
        assert!(raw.len() > 1 << 20, "an answer large enough to be pooled");
        check(&raw);
        // The buffer comes back once the response has been written out.
        let mut idle = 0;
        for _ in 0..100 {
            idle = idle_answer_bytes(&s.base).await;
            if idle > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(idle as usize >= bytes.len(), "answer {i}: its buffer is idle after it was sent ({idle} bytes)");
        if i == 0 {
            idle_after_first = idle;
        } else {
            assert_eq!(idle, idle_after_first, "answer {i} wrote into the first answer's buffer, not a new one");
        }
    }
}

#[test]
fn openapi_file_matches_the_code() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi/openapi.json");
    let generated = layertap::http::openapi::openapi_pretty();
    if std::env::var("LAYERTAP_UPDATE_OPENAPI").is_ok() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(committed == generated, "openapi/openapi.json is out of date: run `make openapi` and commit the result");
}
