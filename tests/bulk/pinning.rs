//! What a folder is made with is pinned in its `bulk.json`: the settings (layers, dtype, token
//! selection, log-probabilities, layout) and the model the servers serve. Servers of different
//! models, a resume asking for something else, and an answer from another model are refused.

use std::time::Duration;

use layertap::engine::ModelInfo;
use layertap::server::Setup;
use serde_json::Value;

use crate::common::*;
use crate::{failures_of, manifest, run_extract, walk, write_input};

/// A fake server whose `/v1/info` (and answers) describe the model `info`.
async fn server_of(info: ModelInfo) -> FakeServer {
    fake_server_with(Setup { info, ..fake_setup(limits()) }, Duration::from_secs(10)).await
}

fn safetensors_files(out: &std::path::Path) -> usize {
    if !out.exists() {
        return 0;
    }
    walk(out).into_iter().filter(|f| f.to_string_lossy().ends_with(".safetensors")).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_of_different_models_are_refused_before_any_request() {
    let a = fake_server(limits(), vec![]).await;
    let other_id = server_of(ModelInfo { model_id: "other-model".into(), ..fake_info() }).await;
    let wider = server_of(ModelInfo { hidden_size: 2 * FAKE_HIDDEN, ..fake_info() }).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    write_input(&input, &[("a", vec![1, 2]), ("b", vec![3])]);
    for (k, (b, field, theirs)) in
        [(&other_id, "model_id", "\"other-model\""), (&wider, "hidden_size", "16")].into_iter().enumerate()
    {
        let out = dir.path().join(format!("out{k}"));
        let servers = format!("{},{}", a.base, b.base);
        let (code, err) = run_extract(&servers, &input, &out, "1,-1", &[]).await;
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains(&b.base) && err.contains(&a.base), "names both servers: {err}");
        assert!(err.contains(field) && err.contains(theirs), "says what differs: {err}");
        assert!(manifest(&out).is_empty() && safetensors_files(&out) == 0, "nothing written");
    }
    for s in [&a, &other_id, &wider] {
        assert!(s.control.seen.lock().unwrap().is_empty(), "no request was made");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_with_other_settings_or_another_model_is_refused() {
    let s = fake_server(limits(), vec![]).await;
    let other = server_of(ModelInfo { model_id: "other-model".into(), ..fake_info() }).await;
    let dir = tempfile::tempdir().unwrap();
    let (head, input, out) = (dir.path().join("head.jsonl"), dir.path().join("all.jsonl"), dir.path().join("out"));
    let samples = [("a", vec![1, 2]), ("b", vec![3]), ("c", vec![4, 5, 6])];
    write_input(&head, &samples[..2]);
    write_input(&input, &samples);
    let (code, err) = run_extract(&s.base, &head, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    s.control.seen.lock().unwrap().clear();

    let pinned: Value = serde_json::from_slice(&std::fs::read(out.join("bulk.json")).unwrap()).unwrap();
    assert_eq!(pinned["settings"]["layers"], serde_json::json!([1, FAKE_LAYERS]));
    assert_eq!(pinned["settings"]["dtype"], "float32");
    assert_eq!(pinned["settings"]["tokens"], "all");
    assert_eq!(pinned["settings"]["layout"], "plain");
    assert_eq!(pinned["model"]["model_id"], "fake");
    assert_eq!(pinned["model"]["architecture"], "FakeForCausalLM");
    assert_eq!(pinned["model"]["num_layers"], FAKE_LAYERS);
    assert_eq!(pinned["model"]["hidden_size"], FAKE_HIDDEN);

    let before = std::fs::read(out.join("manifest.jsonl")).unwrap();
    let refused: [(&str, &str, Vec<&str>, &str); 6] = [
        (&s.base, "1,2", vec!["--dtype", "float32"], "--layers"),
        (&s.base, "1,-1", vec!["--dtype", "bfloat16"], "--dtype"),
        (&s.base, "1,-1", vec!["--dtype", "float32", "--tokens", "last:1"], "--tokens"),
        (&s.base, "1,-1", vec!["--dtype", "float32", "--top-k", "2"], "--top-k"),
        (&s.base, "1,-1", vec!["--dtype", "float32", "--layout", "speculators"], "--layout"),
        (&other.base, "1,-1", vec!["--dtype", "float32"], "model_id"),
    ];
    for (server, layers, extra, says) in &refused {
        let (code, err) = run_extract(server, &input, &out, layers, extra).await;
        assert_eq!(code, Some(1), "{layers} {extra:?}: {err}");
        assert!(err.contains(says) && err.contains("bulk.json"), "{layers} {extra:?}: {err}");
        assert_eq!(std::fs::read(out.join("manifest.jsonl")).unwrap(), before, "{layers} {extra:?}");
    }
    assert!(s.control.seen.lock().unwrap().is_empty() && other.control.seen.lock().unwrap().is_empty());

    // The server's own dtype (float32) unasked, the same layers by another name (-1 is 4 here)
    // and the dtype by its alias: the same files, so the folder resumes.
    let (code, err) = run_extract(&s.base, &head, &out, "1,-1", &[]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("2 samples already done, 0 to go"), "{err}");
    let (code, err) = run_extract(&s.base, &input, &out, &format!("1,{FAKE_LAYERS}"), &["--dtype", "f32"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("2 samples already done, 1 to go"), "{err}");
    assert_eq!(manifest(&out).len(), 3);
}

/// A folder an earlier version wrote has no `bulk.json`: its files' metadata say what it holds,
/// a resume asking for other layers is refused, the same settings resume and are recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_without_bulk_json_is_checked_against_its_files() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (head, input, out) = (dir.path().join("head.jsonl"), dir.path().join("all.jsonl"), dir.path().join("out"));
    write_input(&head, &[("a", vec![1, 2])]);
    write_input(&input, &[("a", vec![1, 2]), ("b", vec![3])]);
    let (code, err) = run_extract(&s.base, &head, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    std::fs::remove_file(out.join("bulk.json")).unwrap();
    let (code, err) = run_extract(&s.base, &input, &out, "1,2", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("layers") && err.contains("[1,2]") && err.contains("[1,4]"), "{err}");
    assert!(!out.join("bulk.json").exists());
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(out.join("bulk.json").is_file());
    assert_eq!(manifest(&out).len(), 2);
}

/// A server that answers from another model than its `/v1/info` said at the start (one changed
/// behind a load balancer, say): its answers are not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_of_another_model_is_not_written() {
    let s = fake_server(limits(), vec![]).await;
    let other = server_of(ModelInfo { model_id: "other-model".into(), ..fake_info() }).await;
    // /v1/info from s, the answers from other.
    let (info_from, answers_from) = (s.base.clone(), other.base.clone());
    let app = axum::Router::new()
        .route(
            "/v1/info",
            axum::routing::get(move || {
                let url = format!("{info_from}/v1/info");
                async move { client().get(url).send().await.unwrap().text().await.unwrap() }
            }),
        )
        .route(
            "/v1/hidden-states",
            axum::routing::post(move |body: axum::body::Bytes| {
                let url = format!("{answers_from}/v1/hidden-states");
                async move {
                    let r = client()
                        .post(url)
                        .header("content-type", "application/json")
                        .header("accept-encoding", "identity")
                        .body(body)
                        .send()
                        .await;
                    r.unwrap().bytes().await.unwrap().to_vec()
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    write_input(&input, &[("a", vec![1, 2]), ("b", vec![3])]);
    let (code, err) = run_extract(&base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 2, "{f:?}");
    for v in &f {
        let e = v["error"].as_str().unwrap();
        assert!(e.contains("other-model") && e.contains("\"fake\""), "{e}");
    }
    assert!(manifest(&out).is_empty() && safetensors_files(&out) == 0);
}
