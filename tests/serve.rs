//! The real server with the real engine: tiny fixture models in-process on 127.0.0.1:0, and the
//! `layertap` binary itself (serve with SIGTERM, extract).

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use layertap::engine::loader::ModelFiles;
use layertap::engine::{DType, Device};
use serde_json::{json, Value};

async fn hidden(base: &str, body: Value) -> std::collections::HashMap<String, Read> {
    let r = reqwest::Client::new().post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    read_safetensors_bytes(&unzstd(&r.bytes().await.unwrap())).0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_equal_solo_requests_bitwise_and_match_transformers() {
    let (running, base) = real_server("tiny/qwen3_qknorm", limits()).await;
    let reference = read_safetensors(&fixtures().join("tiny/qwen3_qknorm/reference.safetensors"));
    let seqs: Vec<Vec<i64>> = (0..3).map(|i| reference[&format!("seq{i}.input_ids")].i64.clone()).collect();
    let n = running.state.info.num_layers;
    let layers = json!([-1, 0, 2]);
    let mut solo = Vec::new();
    for s in &seqs {
        solo.push(
            hidden(&base, json!({"inputs": [{"input_ids": s}], "layers": layers})).await["hidden_states"].f32.clone(),
        );
    }
    // Many concurrent requests in mixed orders share batches with different mates.
    let mut tasks = Vec::new();
    for k in 0..9 {
        let base = base.clone();
        let s = seqs[k % 3].clone();
        let layers = layers.clone();
        tasks.push(tokio::spawn(async move {
            (k % 3, hidden(&base, json!({"inputs": [{"input_ids": s}], "layers": layers})).await)
        }));
    }
    for t in tasks {
        let (i, got) = t.await.unwrap();
        let a: Vec<u32> = got["hidden_states"].f32.iter().map(|x| x.to_bits()).collect();
        let b: Vec<u32> = solo[i].iter().map(|x| x.to_bits()).collect();
        assert_eq!(a, b, "sequence {i} changed when batched with others");
    }
    // And the served values are transformers' values.
    let hs = &reference["seq2.hidden_states"];
    let (t, h) = (hs.shape[1], hs.shape[2]);
    for (k, idx) in [n, 0, 2].into_iter().enumerate() {
        let want = &hs.f32[idx * t * h..(idx + 1) * t * h];
        let ours: Vec<f32> = (0..t).flat_map(|r| solo[2][(r * 3 + k) * h..][..h].to_vec()).collect();
        assert!(rel_err(&ours, want) <= 1e-5, "index {idx}");
    }
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_then_drains_on_sigterm() {
    let (mut child, base) = serve_binary(&fixtures().join("tiny/llama_gqa_rope3"), &[], |c| {
        c.env("LAYERTAP_MAX_INPUT_TOKENS", "64");
    })
    .await;
    let c = reqwest::Client::new();
    let info: Value = c.get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["architecture"], "LlamaForCausalLM");
    assert_eq!(info["max_input_tokens"], 64, "the LAYERTAP_ env variable is read");
    // The binary self-checks by default before turning ready (the CPU in f32: packed against alone).
    let sc = &info["selfcheck"];
    assert_eq!((sc["mode"].as_str(), sc["passed"].as_bool()), (Some("enforce"), Some(true)), "{sc}");
    assert!(sc["worst_relative_error"].as_f64().unwrap() < 1e-5, "{sc}");
    let metrics = c.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("layertap_selfcheck_relative_error{device=\"cpu\",index=\"2\"}"), "{metrics}");
    let t = hidden(
        &base,
        json!({"inputs": [{"text": "hello world"}, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
               "layers": [1, -1], "dtype": "float16"}),
    )
    .await;
    assert_eq!(t["hidden_states"].shape[1..], [2, 64]);
    assert_eq!(t["cu_seqlens"].i64.len(), 3);
    // Threads carry their role in their names (what `top -H` and bench/gpu/thread_cpu.py read):
    // the runtime's workers, its blocking threads (one has just encoded the answer), the device
    // thread and its result thread.
    #[cfg(target_os = "linux")]
    {
        let names: std::collections::BTreeSet<String> = std::fs::read_dir(format!("/proc/{}/task", child.id()))
            .unwrap()
            .map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).unwrap().trim().to_string())
            .collect();
        for want in ["layertap-http", "layertap-encode", "layertap-cpu", "finish-cpu"] {
            assert!(names.contains(want), "no thread named {want} among {names:?}");
        }
    }
    // A request in flight when SIGTERM arrives still gets its answer.
    let long: Vec<u32> = (0..60).collect();
    let inflight = tokio::spawn({
        let base = base.clone();
        async move {
            let mut n = 0;
            for _ in 0..20 {
                let r = reqwest::Client::new()
                    .post(format!("{base}/v1/hidden-states"))
                    .json(&json!({"inputs": [{"input_ids": long}], "layers": [-1]}))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 200 => n += 1,
                    _ => break,
                }
            }
            n
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let code = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(code.success(), "exit status {code:?}");
    assert!(inflight.await.unwrap() >= 1, "requests before the signal were served");
}

/// The default model (slow enough in a test build for work to be in flight at the signal).
fn default_model() -> std::path::PathBuf {
    let p = std::env::var("LAYERTAP_DEFAULT_MODEL").map(std::path::PathBuf::from).unwrap_or_else(|_| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(p.is_file(), "{} is missing: run `make model`", p.display());
    p
}

async fn queued(base: &str) -> i64 {
    let Ok(r) = reqwest::get(format!("{base}/metrics")).await else { return 0 };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("layertap_queue_requests "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as i64)
}

/// Serves the default model with `--shutdown-timeout timeout_s`, puts 30 requests in flight,
/// sends SIGTERM (and a second one `second_after` later, if given). Checks that every request
/// got 200 or 503 with Retry-After and the exit status is 0; returns (200s, 503s, time from the
/// first signal to exit).
async fn drain_the_binary(timeout_s: u64, second_after: Option<Duration>) -> (usize, usize, Duration) {
    let timeout = timeout_s.to_string();
    let args = ["--shutdown-timeout", &timeout, "--max-input-tokens", "256", "--max-batch-tokens", "256"];
    let (mut child, base) = serve_binary(&default_model(), &args, |_| {}).await;
    // One 256-token batch per request: about a second each on the CPU, far more than the timeout.
    let tasks: Vec<_> = (0..30u32)
        .map(|k| {
            let base = base.clone();
            tokio::spawn(async move {
                let ids: Vec<u32> = (0..256u32).map(|t| 1 + (t * 7 + k) % 40000).collect();
                let r = reqwest::Client::new()
                    .post(format!("{base}/v1/hidden-states"))
                    .json(&json!({"inputs": [{"input_ids": ids}], "layers": [-1]}))
                    .send()
                    .await
                    .map_err(|e| format!("{e:?}"))?;
                let (status, retry) = (r.status().as_u16(), r.headers().contains_key("retry-after"));
                r.bytes().await.map_err(|e| format!("{e:?}"))?;
                Ok::<_, String>((status, retry))
            })
        })
        .collect();
    let t = std::time::Instant::now();
    while queued(&base).await < 30 {
        assert!(t.elapsed() < Duration::from_secs(30), "the 30 requests were never all admitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = child.id().to_string();
    let term = move || assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    term();
    let signalled = std::time::Instant::now();
    if let Some(d) = second_after {
        tokio::time::sleep(d).await;
        term();
    }
    let (code, exited) =
        tokio::task::spawn_blocking(move || (child.wait().unwrap(), signalled.elapsed())).await.unwrap();
    assert!(code.success(), "exit status {code:?}");
    let (mut ok, mut unavailable) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok((200, _)) => ok += 1,
            Ok((503, true)) => unavailable += 1,
            other => panic!("a request in flight got {other:?}"),
        }
    }
    eprintln!("30 in flight, --shutdown-timeout {timeout_s}, second signal {second_after:?}: {ok} x 200, {unavailable} x 503, exit after {exited:?}");
    (ok, unavailable, exited)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_with_thirty_requests_in_flight_answers_each_and_exits_within_the_timeout() {
    let (_, unavailable, exited) = drain_the_binary(2, None).await;
    assert!(unavailable >= 1, "nothing was left in flight at the deadline");
    assert!(exited < Duration::from_secs(2 + 3), "exited {exited:?} after SIGTERM with --shutdown-timeout 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_sigterm_cuts_the_drain_short_and_still_answers_each_request() {
    let (_, unavailable, exited) = drain_the_binary(60, Some(Duration::from_millis(500))).await;
    assert!(unavailable >= 1);
    assert!(exited < Duration::from_secs(4), "exited {exited:?} after two signals with --shutdown-timeout 60");
}

#[test]
fn extract_writes_the_same_tensors_as_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    let model = fixtures().join("tiny/mistral_sliding");
    let reference = read_safetensors(&model.join("reference.safetensors"));
    let ids: Vec<String> = reference["seq2.input_ids"].i64.iter().map(|x| x.to_string()).collect();
    let st = Command::new(env!("CARGO_BIN_EXE_layertap"))
        .args(["extract", "--model", &model.to_string_lossy(), "--layers", "0,-1,2", "--input-ids", &ids.join(",")])
        .args(["--dtype", "float32", "--out", &out.to_string_lossy()])
        .status()
        .unwrap();
    assert!(st.success());
    let t = read_safetensors(&out);
    let hs = &reference["seq2.hidden_states"];
    let (l1, tt, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
    assert_eq!(t["hidden_states"].shape, vec![tt, 3, h]);
    assert_eq!(t["input_ids"].i64, reference["seq2.input_ids"].i64);
    assert_eq!(t["cu_seqlens"].i64, vec![0, tt as i64]);
    assert!(t["loss_mask"].i64.iter().all(|&m| m == 1));
    for (k, idx) in [0, l1 - 1, 2].into_iter().enumerate() {
        let want = &hs.f32[idx * tt * h..(idx + 1) * tt * h];
        let ours: Vec<f32> = (0..tt).flat_map(|r| t["hidden_states"].f32[(r * 3 + k) * h..][..h].to_vec()).collect();
        assert!(rel_err(&ours, want) <= 1e-5, "index {idx}");
    }
    // Bad input is a clear error, not a panic.
    let o = Command::new(env!("CARGO_BIN_EXE_layertap"))
        .args(["extract", "--model", &model.to_string_lossy(), "--layers", "99", "--input-ids", "1,2"])
        .args(["--out", &out.to_string_lossy()])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("out of range"));
}

#[test]
fn loading_errors_name_what_is_wrong() {
    let e = |spec: &str| ModelFiles::locate(spec).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e("/definitely/not/here").contains("neither an existing path"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"architectures": ["GPT2LMHeadModel"]}"#).unwrap();
    let msg = e(&dir.path().to_string_lossy());
    assert!(msg.contains("unsupported architecture") && msg.contains("Qwen3ForCausalLM"), "{msg}");
    // A checkpoint missing a tensor names it.
    let src = fixtures().join("tiny/qwen2_bias_tied");
    let d2 = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), d2.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| n != "model.layers.1.self_attn.k_proj.bias").collect();
    safetensors::tensor::serialize_to_file(kept, None, &d2.path().join("model.safetensors")).unwrap();
    let files = ModelFiles::locate(&d2.path().to_string_lossy()).unwrap();
    let msg = files.load(&Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("model.layers.1.self_attn.k_proj.bias") && msg.contains("missing"), "{msg}");
    // A config that does not match the weights names the first tensor whose shape is off.
    let d3 = tempfile::tempdir().unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = json!(100);
    std::fs::write(d3.path().join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join("model.safetensors"), d3.path().join("model.safetensors")).unwrap();
    let files = ModelFiles::locate(&d3.path().to_string_lossy()).unwrap();
    let msg = files.load(&Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("model.layers.0.mlp.gate_proj.weight") && msg.contains("[128, 64]"), "{msg}");
}

#[test]
fn an_unreachable_hub_fails_fast_with_a_clear_error() {
    let start = std::time::Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_layertap"))
        .args([
            "extract",
            "--model",
            "nobody-here/no-such-model",
            "--layers",
            "1",
            "--input-ids",
            "1",
            "--out",
            "/dev/null",
        ])
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env("HF_HOME", tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("nobody-here/no-such-model") && err.contains("hub"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn bench_runs_a_workload_file_and_reports_every_token() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("w.json"), r#"{"layers": [1, -1], "dtype": "float32", "file": "w.jsonl"}"#).unwrap();
    std::fs::write(
        dir.path().join("w.jsonl"),
        "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}\n{\"input_ids\": [6]}\n",
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_layertap"))
        .args(["bench", "--workload", &dir.path().join("w.json").to_string_lossy()])
        .args(["--model", &fixtures().join("tiny/qwen2_bias_tied").to_string_lossy(), "--max-batch-tokens", "4"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(v["tokens"], 6);
    assert_eq!(v["batches"], 2, "sorted by length, 1+2 tokens fit in 4 and 3 more do not: two batches");
    assert_eq!(v["output_bytes"], 6 * 2 * 64 * 4);
    assert_eq!(v["stages"], serde_json::json!([[0, 3]]));
    // In stages on the one device (what the stages cost against one): the same tokens, the
    // layers split; more stages than layers refused with the numbers.
    let bench = |pipeline: &str| {
        Command::new(env!("CARGO_BIN_EXE_layertap"))
            .args(["bench", "--workload", &dir.path().join("w.json").to_string_lossy()])
            .args(["--model", &fixtures().join("tiny/qwen2_bias_tied").to_string_lossy(), "--pipeline", pipeline])
            .output()
            .unwrap()
    };
    let o = bench("2");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    assert_eq!((v["tokens"].clone(), v["pipeline"].clone()), (serde_json::json!(6), serde_json::json!(2)));
    let stages = v["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2);
    assert_eq!(
        (&stages[0][0], &stages[0][1], &stages[1][0], &stages[1][1]),
        (&0.into(), &stages[1][0], &stages[0][1], &3.into())
    );
    for bad in ["4", "0"] {
        let o = bench(bad);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(&format!("--pipeline {bad}")), "{err}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_model_that_cannot_load_makes_serve_exit_with_an_error() {
    // This build has no CUDA (tests run on the CPU build), so loading on cuda:0 fails.
    let o = Command::new(env!("CARGO_BIN_EXE_layertap"))
        .args(["serve", "--model", &fixtures().join("tiny/qwen3_qknorm").to_string_lossy()])
        .args(["--host", "127.0.0.1", "--port", "0", "--device", "cuda:0"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "serve must not exit 0 when the model did not load");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cuda:0") && err.contains("loading the model failed"), "{err}");
}
