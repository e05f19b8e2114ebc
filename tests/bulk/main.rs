//! `layertap bulk` against a live server: a run killed midway resumes without redoing or losing
//! samples, and every file is intact.

#[path = "../common/mod.rs"]
mod common;

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn manifest(dir: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("manifest.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn bulk(base: &str, input: &std::path::Path, out: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_layertap"));
    c.args(["bulk", "--server", base, "--input", &input.to_string_lossy(), "--out", &out.to_string_lossy()])
        .args(["--layers", "1,-1", "--concurrency", "4", "--dtype", "float32"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_run_resumes_and_every_sample_lands_once_and_intact() {
    let s = fake_server(limits(), vec![]).await;
    s.control.delay_ms.store(20, Ordering::SeqCst);
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let out = dir.path().join("out");
    let mut lines = Vec::new();
    let mut expected: Vec<(String, Vec<u32>)> = Vec::new();
    for i in 0..60u32 {
        let ids: Vec<u32> = (0..(i % 7 + 1)).map(|k| (i * 7 + k) % 500).collect();
        if i % 3 == 0 {
            lines.push(serde_json::json!({"input_ids": ids}).to_string());
            expected.push((format!("line-{}", i + 1), ids));
        } else {
            lines.push(serde_json::json!({"id": format!("sample/{i}"), "input_ids": ids}).to_string());
            expected.push((format!("sample/{i}"), ids));
        }
    }
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();

    let mut child = bulk(&s.base, &input, &out).spawn().unwrap();
    for _ in 0..500 {
        if manifest(&out).len() >= 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    child.kill().unwrap(); // a crash: no chance to clean up
    child.wait().unwrap();
    let first = manifest(&out).len();
    assert!((10..60).contains(&first), "the first run should stop midway, it finished {first}");

    let o = tokio::task::spawn_blocking({
        let (base, input, out) = (s.base.clone(), input.clone(), out.clone());
        move || bulk(&base, &input, &out).output().unwrap()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(&format!("{first} samples already done")), "{err}");

    let m = manifest(&out);
    let ids: Vec<String> = m.iter().map(|v| v["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 60, "every sample once");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 60, "no sample twice");
    for (id, want_ids) in &expected {
        let entry = m.iter().find(|v| v["id"] == id.as_str()).unwrap_or_else(|| panic!("{id} missing"));
        let (t, _) = read_safetensors_bytes(&std::fs::read(out.join(entry["file"].as_str().unwrap())).unwrap());
        let got: Vec<u32> = t["input_ids"].i64.iter().map(|&x| x as u32).collect();
        assert_eq!(&got, want_ids, "{id}");
        assert_eq!(t["hidden_states"].shape, vec![want_ids.len(), 2, FAKE_HIDDEN]);
        assert_eq!(t["loss_mask"].i64, vec![1; want_ids.len()]);
        for (row, &tok) in want_ids.iter().enumerate() {
            assert_eq!(t["hidden_states"].f32[(row * 2 + 1) * FAKE_HIDDEN], fake_value(tok, FAKE_LAYERS, 0), "{id}");
        }
    }
    let leftovers: Vec<_> = walk(&out).into_iter().filter(|p| p.to_string_lossy().ends_with(".tmp")).collect();
    // A sample cut off mid-write was redone, which rewrote and renamed its temporary file.
    assert!(leftovers.is_empty(), "temporary files left behind: {leftovers:?}");
    assert!(m.iter().all(|v| !v["file"].as_str().unwrap().ends_with(".tmp")));
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_the_server_refuses_are_reported_and_the_rest_land() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let out = dir.path().join("out");
    std::fs::write(
        &input,
        format!("{{\"id\": \"a\", \"input_ids\": [1, 2]}}\n{{\"id\": \"bad\", \"input_ids\": [{FAKE_VOCAB}]}}\n{{\"id\": \"c\", \"text\": \"hello\"}}\n"),
    )
    .unwrap();
    let o = tokio::task::spawn_blocking({
        let (base, input, out) = (s.base.clone(), input.clone(), out.clone());
        move || bulk(&base, &input, &out).output().unwrap()
    })
    .await
    .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    let ids: HashSet<String> = manifest(&out).iter().map(|v| v["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, HashSet::from(["a".to_string(), "c".to_string()]));
    let failures = std::fs::read_to_string(out.join("failures.jsonl")).unwrap();
    assert!(failures.contains("\"bad\"") && failures.contains("422"), "{failures}");
}

// ---------------------------------------------------------------------------------------------
// Checksums, --verify, --layout speculators and --tokens
// ---------------------------------------------------------------------------------------------

/// `layertap bulk` with `args`, stdout dropped, stderr captured.
fn bulk_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_layertap"));
    c.arg("bulk").args(args).env_remove("LAYERTAP_SERVER").stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

/// Runs [`bulk_cmd`] off the runtime; returns the exit code and stderr.
async fn run_bulk(args: &[&str]) -> (Option<i32>, String) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let o = tokio::task::spawn_blocking(move || {
        bulk_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>()).output().unwrap()
    })
    .await
    .unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn p(path: &std::path::Path) -> String {
    path.to_string_lossy().into_owned()
}

/// `layertap bulk --server server --input input --out out --layers layers`, then `extra`.
async fn run_extract(
    server: &str,
    input: &std::path::Path,
    out: &std::path::Path,
    layers: &str,
    extra: &[&str],
) -> (Option<i32>, String) {
    let (input, out) = (p(input), p(out));
    let mut args = vec!["--server", server, "--input", &input, "--out", &out, "--layers", layers];
    args.extend_from_slice(extra);
    run_bulk(&args).await
}

/// Writes `samples` (id, token ids) as a JSONL input file.
fn write_input(path: &std::path::Path, samples: &[(&str, Vec<u32>)]) {
    let text: String =
        samples.iter().map(|(id, ids)| serde_json::json!({"id": id, "input_ids": ids}).to_string() + "\n").collect();
    std::fs::write(path, text).unwrap();
}

fn xxh64(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh64::xxh64(bytes, 0))
}

/// Where a tensor's bytes start in a safetensors file.
fn tensor_start(file: &[u8], name: &str) -> usize {
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize
}

/// Each tensor's (dtype, shape, raw bytes), read with the safetensors library.
fn raw_tensors(file: &[u8]) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let st = safetensors::SafeTensors::deserialize(file).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// Asserts that a file holds the fake model's states of `ids` at `layers` (resolved indices).
fn assert_states(t: &std::collections::HashMap<String, Read>, ids: &[u32], layers: &[usize], what: &str) {
    let hs = &t["hidden_states"];
    assert_eq!(hs.shape, vec![ids.len(), layers.len(), FAKE_HIDDEN], "{what}");
    for (r, &tok) in ids.iter().enumerate() {
        for (j, &l) in layers.iter().enumerate() {
            for h in 0..FAKE_HIDDEN {
                let got = hs.f32[(r * layers.len() + j) * FAKE_HIDDEN + h];
                assert_eq!(got, fake_value(tok, l, h), "{what}: row {r}, layer {l}, component {h}");
            }
        }
    }
}

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
    let app = axum::Router::new().route("/v1/hidden-states", axum::routing::post(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Proxy { base, hits }
}

/// A proxy that corrupts the answers `corrupt` picks.
async fn corrupting_proxy(target: String, corrupt: fn(&[u64], usize) -> bool) -> Proxy {
    proxy(target, move |k, n| if corrupt(k, n) { Act::Corrupt } else { Act::Pass }).await
}

fn entry<'a>(m: &'a [Value], id: &str) -> &'a Value {
    m.iter().find(|v| v["id"] == id).unwrap_or_else(|| panic!("{id} is not in the manifest"))
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
    assert!(!files.iter().any(|f| f.contains("b.safetensors")), "a file was written for b: {files:?}");
    assert_eq!(files.iter().filter(|f| f.ends_with(".safetensors")).count(), 2, "{files:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_drops_missing_and_corrupt_files_and_the_next_run_redoes_exactly_those() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    let samples: Vec<(String, Vec<u32>)> =
        (0..6u32).map(|i| (format!("s{i}"), (0..i + 2).map(|k| 20 * i + k + 1).collect())).collect();
    let refs: Vec<(&str, Vec<u32>)> = samples.iter().map(|(id, ids)| (id.as_str(), ids.clone())).collect();
    write_input(&input, &refs);
    let run_args = ["--server", &s.base, "--input", &p(&input), "--out", &p(&out), "--layers", "1,-1"];
    let (code, err) = run_bulk(&run_args).await;
    assert_eq!(code, Some(0), "{err}");
    let before = std::fs::read_to_string(out.join("manifest.jsonl")).unwrap();
    let m = manifest(&out);
    let file_of = |id: &str| entry(&m, id)["file"].as_str().unwrap().to_string();
    let (corrupt, missing) = (file_of("s1"), file_of("s4"));
    let mut bytes = std::fs::read(out.join(&corrupt)).unwrap();
    let at = tensor_start(&bytes, "hidden_states") + 9;
    bytes[at] ^= 0x10;
    std::fs::write(out.join(&corrupt), bytes).unwrap();
    std::fs::remove_file(out.join(&missing)).unwrap();

    // Neither --server nor --input nor --layers is needed to verify.
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(1), "{err}");
    let line_of = |id: &str| err.lines().find(|l| l.starts_with(&format!("{id}: "))).map(String::from);
    let bad = line_of("s1").unwrap_or_else(|| panic!("s1 not named: {err}"));
    assert!(bad.contains(&corrupt) && bad.contains("corrupt") && bad.contains("hidden_states"), "{bad}");
    let gone = line_of("s4").unwrap_or_else(|| panic!("s4 not named: {err}"));
    assert!(gone.contains(&missing) && gone.contains("missing"), "{gone}");
    for id in ["s0", "s2", "s3", "s5"] {
        assert!(line_of(id).is_none(), "{id} is intact: {err}");
    }
    let after = std::fs::read_to_string(out.join("manifest.jsonl")).unwrap();
    let expected: Vec<&str> =
        before.lines().filter(|l| !l.contains("\"id\":\"s1\"") && !l.contains("\"id\":\"s4\"")).collect();
    assert_eq!(expected.len(), 4);
    assert_eq!(after.lines().collect::<Vec<_>>(), expected, "exactly the two lines are gone");
    assert!(!out.join("manifest.jsonl.tmp").exists());

    s.control.seen.lock().unwrap().clear();
    let (code, err) = run_bulk(&run_args).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("4 samples already done, 2 to go"), "{err}");
    let mut seen = s.control.seen.lock().unwrap().clone();
    seen.sort();
    let mut want: Vec<u32> = samples[1].1.iter().chain(&samples[4].1).copied().collect();
    want.sort();
    assert_eq!(seen, want, "only s1 and s4 were extracted again");
    let m = manifest(&out);
    let new_ids: HashSet<&str> = m[4..].iter().map(|v| v["id"].as_str().unwrap()).collect();
    assert_eq!((m.len(), new_ids), (6, HashSet::from(["s1", "s4"])));
    for (id, ids) in &samples {
        assert_states(&read_safetensors(&out.join(file_of(id))), ids, &[1, FAKE_LAYERS], id);
    }

    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
    let total: u64 = m.iter().map(|v| std::fs::metadata(out.join(v["file"].as_str().unwrap())).unwrap().len()).sum();
    assert!(err.contains(&format!("verified 6 files, {total} bytes")) && err.contains("all intact"), "{err}");
    assert_eq!(std::fs::read_to_string(out.join("manifest.jsonl")).unwrap().lines().count(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_speculators_layout_writes_what_speculators_reads_and_resumes() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, head) = (dir.path().join("data.jsonl"), dir.path().join("head.jsonl"));
    let (plain, spec) = (dir.path().join("plain"), dir.path().join("spec"));
    let samples: Vec<(String, Vec<u32>)> =
        (0..5u32).map(|i| (format!("conv/{i}"), (0..i + 1).map(|k| 50 + 10 * i + k).collect())).collect();
    let refs: Vec<(&str, Vec<u32>)> = samples.iter().map(|(id, ids)| (id.as_str(), ids.clone())).collect();
    write_input(&input, &refs);
    write_input(&head, &refs[..3]);
    let layers = ["--layers", "1,3,final_prenorm", "--dtype", "float32"];
    let args = |inp: &std::path::Path, out: &std::path::Path, layout: &str| -> Vec<String> {
        ["--server", &s.base, "--input", &p(inp), "--out", &p(out), "--layout", layout]
            .iter()
            .chain(&layers)
            .map(|x| x.to_string())
            .collect()
    };
    let run = |a: Vec<String>| async move { run_bulk(&a.iter().map(String::as_str).collect::<Vec<_>>()).await };
    let (code, err) = run(args(&input, &plain, "plain")).await;
    assert_eq!(code, Some(0), "{err}");
    // A first run over the first three samples, then the whole input: the three are not redone.
    let (code, err) = run(args(&head, &spec, "speculators")).await;
    assert_eq!(code, Some(0), "{err}");
    s.control.seen.lock().unwrap().clear();
    let (code, err) = run(args(&input, &spec, "speculators")).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("3 samples already done, 2 to go"), "{err}");
    let mut seen = s.control.seen.lock().unwrap().clone();
    seen.sort();
    let mut want: Vec<u32> = samples[3..].iter().flat_map(|(_, ids)| ids.clone()).collect();
    want.sort();
    assert_eq!(seen, want, "resume asked for the last two samples only");

    let pm = manifest(&plain);
    let sm = manifest(&spec);
    assert_eq!(sm.len(), 5);
    for (i, (id, ids)) in samples.iter().enumerate() {
        let name = format!("hs_{i}.safetensors");
        let e = entry(&sm, id);
        assert_eq!(e["file"], name.as_str(), "{id}");
        let bytes = std::fs::read(spec.join(&name)).unwrap();
        let t = raw_tensors(&bytes);
        assert_eq!(t.keys().collect::<Vec<_>>(), ["hidden_states", "token_ids"], "{id}: nothing else");
        let (dt, shape, hs) = &t["hidden_states"];
        assert_eq!((dt.as_str(), shape.clone()), ("F32", vec![ids.len(), 3, FAKE_HIDDEN]), "{id}");
        let (dt, shape, tok) = &t["token_ids"];
        assert_eq!((dt.as_str(), shape.clone()), ("I64", vec![ids.len()]), "{id}");
        let tok: Vec<i64> = tok.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(tok, ids.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), "{id}: token_ids are the input ids");
        let plain_bytes = std::fs::read(plain.join(entry(&pm, id)["file"].as_str().unwrap())).unwrap();
        assert_eq!(hs, &raw_tensors(&plain_bytes)["hidden_states"].2, "{id}: the plain layout's states");
        let (vals, _) = read_safetensors_bytes(&bytes);
        assert_states(&vals, ids, &[1, 3, FAKE_LAYERS + 1], id);
        assert_eq!(e["xxh64"], xxh64(&bytes), "{id}");
        assert_eq!(e["checksums"]["hidden_states"], xxh64(hs), "{id}");
        assert_eq!(e["checksums"]["token_ids"], xxh64(&t["token_ids"].2), "{id}");
    }
    let mut names: Vec<String> =
        std::fs::read_dir(&spec).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let mut want: Vec<String> = (0..5).map(|i| format!("hs_{i}.safetensors")).collect();
    want.extend(["failures.jsonl".to_string(), "manifest.jsonl".to_string()]);
    want.sort();
    assert_eq!(names, want, "one flat folder");

    // --verify checks this layout too: its files carry their own checksums.
    let (code, err) = run_bulk(&["--verify", "--out", &p(&spec)]).await;
    assert_eq!(code, Some(0), "{err}");
    let mut bytes = std::fs::read(spec.join("hs_2.safetensors")).unwrap();
    let at = tensor_start(&bytes, "token_ids");
    bytes[at] ^= 0x01;
    std::fs::write(spec.join("hs_2.safetensors"), bytes).unwrap();
    // A change in the header leaves every tensor intact: only the whole file's xxh64 sees it.
    let mut bytes = std::fs::read(spec.join("hs_3.safetensors")).unwrap();
    let at = bytes.windows(11).position(|w| w == b"speculators").unwrap();
    bytes[at] = b'S';
    std::fs::write(spec.join("hs_3.safetensors"), bytes).unwrap();
    let (code, err) = run_bulk(&["--verify", "--out", &p(&spec)]).await;
    assert_eq!(code, Some(1), "{err}");
    let line_of = |id: &str| err.lines().find(|l| l.starts_with(&format!("{id}: "))).unwrap_or_default().to_string();
    let two = line_of("conv/2");
    assert!(two.starts_with("conv/2: hs_2.safetensors: corrupt") && two.contains("token_ids"), "{err}");
    let three = line_of("conv/3");
    assert!(three.starts_with("conv/3: hs_3.safetensors: corrupt") && three.contains("xxh64"), "{err}");
    // Manifest lines are in the order samples finished, which several in flight make vary.
    let mut left: Vec<String> = manifest(&spec).iter().map(|v| v["id"].as_str().unwrap().to_string()).collect();
    left.sort();
    assert_eq!(left, ["conv/0", "conv/1", "conv/4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_speculators_layout_cannot_hold_is_refused_before_any_request() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    write_input(&input, &[("a", vec![1, 2, 3])]);
    for (extra, says) in [
        (["--dtype", "fp8"], "fp8"),
        (["--dtype", "float8_e4m3fn"], "fp8"),
        (["--tokens", "assistant"], "--tokens all"),
        (["--tokens", "last:2"], "--tokens all"),
    ] {
        let out = dir.path().join(format!("out-{}", extra[1]));
        let mut args = vec!["--server", &s.base, "--input", &input.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(["--layers", "1,final_prenorm", "--layout", "speculators"]);
        args.extend(extra);
        let (code, err) = run_bulk(&args).await;
        assert_eq!(code, Some(1), "{extra:?}: {err}");
        assert!(err.contains(says) && err.contains("speculators"), "{extra:?}: {err}");
        assert!(s.control.seen.lock().unwrap().is_empty(), "{extra:?}: a request was made");
        assert!(!out.join("hs_0.safetensors").exists());
    }
    // The plain layout takes fp8 (with its scales) and selections.
    let out = dir.path().join("plain-fp8");
    let (code, err) = run_extract(&s.base, &input, &out, "1", &["--dtype", "fp8"]).await;
    assert_eq!(code, Some(0), "{err}");
    let t = raw_tensors(&std::fs::read(out.join("shard-00000/a.safetensors")).unwrap());
    assert_eq!((t["hidden_states"].0.as_str(), t["hidden_states_scale"].1.clone()), ("F8_E4M3", vec![3, 1]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_values_other_than_all_assistant_and_last_k_are_refused_at_parse_time() {
    for bad in ["last:0", "last:", "last:-1", "first:2", "ranges", "Assistant"] {
        let (code, err) = run_extract(
            "http://127.0.0.1:9",
            std::path::Path::new("x"),
            std::path::Path::new("y"),
            "1",
            &["--tokens", bad],
        )
        .await;
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--tokens") && err.contains("last:"), "{bad}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_assistant_and_last_k_keep_the_selected_rows_and_their_positions() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let lines = [
        serde_json::json!({"id": "chat", "messages": [
            {"role": "user", "content": "Hi there, how are you?"},
            {"role": "assistant", "content": "Very well, thank you."}]}),
        serde_json::json!({"id": "ids", "input_ids": [3, 4, 5, 6, 7]}),
        serde_json::json!({"id": "one", "input_ids": [9]}),
    ];
    std::fs::write(&input, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let mut outs = Vec::new();
    for tokens in ["all", "assistant", "last:2"] {
        let out = dir.path().join(tokens.replace(':', "-"));
        let (code, err) = run_extract(&s.base, &input, &out, "2,-1", &["--tokens", tokens]).await;
        assert_eq!(code, Some(0), "{tokens}: {err}");
        outs.push(out);
    }
    let mut partial = false;
    for id in ["chat", "ids", "one"] {
        let read = |out: &std::path::Path| {
            let bytes = std::fs::read(out.join(format!("shard-00000/{id}.safetensors"))).unwrap();
            read_safetensors_bytes(&bytes)
        };
        let (full, meta) = read(&outs[0]);
        assert_eq!(meta["tokens"], "all");
        assert!(!full.contains_key("positions"));
        let ids = &full["input_ids"].i64;
        let mask = &full["loss_mask"].i64;
        let n = ids.len();
        let assistant: Vec<usize> = (0..n).filter(|&i| mask[i] == 1).collect();
        partial |= !assistant.is_empty() && assistant.len() < n;
        for (out, rows, label) in
            [(&outs[1], assistant, "assistant"), (&outs[2], (n.saturating_sub(2)..n).collect(), "last:2")]
        {
            let (t, meta) = read(out);
            assert_eq!(meta["tokens"], label, "{id}");
            let what = format!("{id} with --tokens {label}");
            assert_eq!(t["positions"].i64, rows.iter().map(|&r| r as i64).collect::<Vec<_>>(), "{what}");
            assert_eq!(t["input_ids"].i64, rows.iter().map(|&r| ids[r]).collect::<Vec<_>>(), "{what}");
            assert_eq!(t["loss_mask"].i64, rows.iter().map(|&r| mask[r]).collect::<Vec<_>>(), "{what}");
            let sel: Vec<u32> = rows.iter().map(|&r| ids[r] as u32).collect();
            assert_states(&t, &sel, &[2, FAKE_LAYERS], &what);
            let width = 2 * FAKE_HIDDEN;
            let want: Vec<f32> =
                rows.iter().flat_map(|&r| full["hidden_states"].f32[r * width..(r + 1) * width].to_vec()).collect();
            assert_eq!(t["hidden_states"].f32, want, "{what}: the full run's rows");
        }
    }
    assert!(partial, "the chat sample has rows outside the assistant turn");
}

/// A ShareGPT chat (`conversations` of `{from, value}`, read with `--messages-column
/// conversations`) gives the same tokens, loss mask and states as the same chat in `{role,
/// content}`; an unknown speaker is a failed sample naming it, and the rest land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharegpt_conversations_extract_as_the_same_chat_in_roles() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (roles, sharegpt) = (dir.path().join("roles.jsonl"), dir.path().join("sharegpt.jsonl"));
    let chat = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there, how are you?"},
        {"role": "assistant", "content": "Very well, thank you."}]);
    let shared = serde_json::json!([
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi there, how are you?"},
        {"from": "gpt", "value": "Very well, thank you."}]);
    let odd = serde_json::json!([{"from": "narrator", "value": "Once"}]);
    std::fs::write(&roles, serde_json::json!({"id": "c", "messages": chat}).to_string() + "\n").unwrap();
    let lines = [
        serde_json::json!({"id": "c", "conversations": shared}),
        serde_json::json!({"id": "odd", "conversations": odd}),
    ];
    std::fs::write(&sharegpt, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let (out_roles, out_sharegpt) = (dir.path().join("out-roles"), dir.path().join("out-sharegpt"));
    let (code, err) = run_extract(&s.base, &roles, &out_roles, "2,-1", &[]).await;
    assert_eq!(code, Some(0), "{err}");
    let (code, err) =
        run_extract(&s.base, &sharegpt, &out_sharegpt, "2,-1", &["--messages-column", "conversations"]).await;
    assert_eq!(code, Some(1), "the unknown speaker fails its sample: {err}");
    let failures = failures_of(&out_sharegpt, "failures.jsonl");
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["id"], "odd");
    let error = failures[0]["error"].as_str().unwrap();
    assert!(error.contains("message 0: its from is \"narrator\", not one of human"), "{error}");
    let read = |out: &std::path::Path| {
        read_safetensors_bytes(&std::fs::read(out.join("shard-00000/c.safetensors")).unwrap()).0
    };
    let (a, b) = (read(&out_roles), read(&out_sharegpt));
    assert!(b["loss_mask"].i64.contains(&1) && b["loss_mask"].i64.contains(&0), "a chat's loss mask");
    for name in ["input_ids", "loss_mask"] {
        assert_eq!(a[name].i64, b[name].i64, "{name}");
    }
    assert_eq!(a["hidden_states"].f32, b["hidden_states"].f32);
}

// ---------------------------------------------------------------------------------------------
// Parquet input, --shard I/N and several servers
// ---------------------------------------------------------------------------------------------

/// Every manifest of `out` (manifest.jsonl and manifest-I-of-N.jsonl), by name; complete lines
/// only (a run may be writing them). None before `out` exists.
fn manifests(out: &std::path::Path) -> std::collections::BTreeMap<String, Vec<Value>> {
    std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .filter(|n| n.starts_with("manifest") && n.ends_with(".jsonl"))
        .map(|n| {
            let lines = std::fs::read_to_string(out.join(&n)).unwrap();
            (n, lines.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
        })
        .collect()
}

fn failures_of(out: &std::path::Path, name: &str) -> Vec<Value> {
    std::fs::read_to_string(out.join(name)).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn ids_of(m: &[Value]) -> Vec<String> {
    m.iter().map(|v| v["id"].as_str().unwrap().to_string()).collect()
}

fn shard_of(id: &str, n: u64) -> u64 {
    xxhash_rust::xxh64::xxh64(id.as_bytes(), 0) % n
}

/// (answered, failed) of `base` in a run's closing report.
fn server_counts(err: &str, base: &str) -> (u64, u64) {
    let line = err
        .lines()
        .find(|l| l.starts_with(&format!("server {base}: ")))
        .unwrap_or_else(|| panic!("no report for {base}: {err}"));
    let num = |what: &str| -> u64 {
        let before = line.split(&format!(" {what}")).next().unwrap();
        before.rsplit(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("{line}"))
    };
    (num("answered"), num("failed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_shards_over_two_servers_one_shut_down_midway_land_every_sample_once() {
    let a = fake_server(limits(), vec![]).await;
    let b = fake_server(limits(), vec![]).await;
    a.control.delay_ms.store(25, Ordering::SeqCst);
    b.control.delay_ms.store(25, Ordering::SeqCst);
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    let samples: Vec<(String, Vec<u32>)> =
        (0..90u32).map(|i| (format!("s{i}"), (0..i % 5 + 1).map(|k| (i * 5 + k) % 500).collect())).collect();
    let refs: Vec<(&str, Vec<u32>)> = samples.iter().map(|(id, ids)| (id.as_str(), ids.clone())).collect();
    write_input(&input, &refs);
    let mut children = Vec::new();
    for k in 0..3 {
        let shard = format!("{k}/3");
        let mut args = vec!["--input".to_string(), p(&input), "--out".into(), p(&out), "--shard".into(), shard];
        if k == 0 {
            // The comma-separated form; the others repeat --server.
            args.extend(["--server".into(), format!("{},{}", a.base, b.base)]);
        } else {
            args.extend(["--server".into(), a.base.clone(), "--server".into(), b.base.clone()]);
        }
        args.extend(["--layers", "1,-1", "--dtype", "float32", "--concurrency", "2"].map(String::from));
        let mut c = bulk_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>());
        children.push(c.spawn().unwrap());
    }
    let landed = || manifests(&out).values().map(Vec::len).sum::<usize>();
    for _ in 0..1000 {
        if landed() >= 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    b.running.shutdown.cancel();
    let at_shutdown = landed();
    assert!((20..80).contains(&at_shutdown), "server b should go down midway, {at_shutdown} had landed");
    let outputs = tokio::task::spawn_blocking(move || {
        children.into_iter().map(|c| c.wait_with_output().unwrap()).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let (mut from_a, mut from_b, mut b_failed) = (0, 0, 0);
    for (k, o) in outputs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "shard {k}: {err}");
        let (ok_a, _) = server_counts(&err, &a.base);
        let (ok_b, fail_b) = server_counts(&err, &b.base);
        let m = &manifests(&out)[&format!("manifest-{k}-of-3.jsonl")];
        assert_eq!((ok_a + ok_b) as usize, m.len(), "shard {k}: the counts add up to its samples: {err}");
        from_a += ok_a;
        from_b += ok_b;
        b_failed += fail_b;
        assert!(failures_of(&out, &format!("failures-{k}-of-3.jsonl")).is_empty(), "shard {k}");
    }
    assert!(from_a > 0 && from_b > 0, "both servers answered: a {from_a}, b {from_b}");
    assert!(b_failed > 0, "requests to the shut-down server failed and went elsewhere");
    assert_eq!(from_a + from_b, 90);
    println!("{at_shutdown} samples had landed when server b shut down; a answered {from_a}, b {from_b}, {b_failed} requests to b failed and went to a");

    let all = manifests(&out);
    assert_eq!(
        all.keys().collect::<Vec<_>>(),
        ["manifest-0-of-3.jsonl", "manifest-1-of-3.jsonl", "manifest-2-of-3.jsonl"]
    );
    let mut union: Vec<String> = Vec::new();
    for (k, (_, m)) in all.iter().enumerate() {
        for id in ids_of(m) {
            assert_eq!(shard_of(&id, 3), k as u64, "{id} is shard {}'s", shard_of(&id, 3));
            union.push(id);
        }
    }
    assert_eq!(union.len(), 90, "every sample once: {union:?}");
    let distinct: HashSet<&String> = union.iter().collect();
    assert_eq!(distinct.len(), 90, "no sample twice");
    for m in all.values() {
        for e in m {
            let id = e["id"].as_str().unwrap();
            let ids = &samples.iter().find(|(i, _)| i == id).unwrap().1;
            let bytes = std::fs::read(out.join(e["file"].as_str().unwrap())).unwrap();
            assert_eq!(e["xxh64"], xxh64(&bytes), "{id}");
            assert_states(&read_safetensors_bytes(&bytes).0, ids, &[1, FAKE_LAYERS], id);
        }
    }
    let files: Vec<_> = walk(&out).into_iter().map(|f| p(f.strip_prefix(&out).unwrap())).collect();
    assert_eq!(files.iter().filter(|f| f.ends_with(".safetensors")).count(), 90, "{files:?}");
    assert!(!files.iter().any(|f| f.ends_with(".tmp")), "{files:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_split_is_deterministic_verify_knows_shards_and_bad_shards_are_refused() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let samples: Vec<(String, Vec<u32>)> = (0..40u32).map(|i| (format!("item-{i}"), vec![i + 1, i + 2])).collect();
    let refs: Vec<(&str, Vec<u32>)> = samples.iter().map(|(id, ids)| (id.as_str(), ids.clone())).collect();
    write_input(&input, &refs);
    let mut splits = Vec::new();
    for (run, conc) in [("one", "4"), ("two", "1")] {
        let out = dir.path().join(run);
        for k in 0..4 {
            let shard = format!("{k}/4");
            let (code, err) =
                run_extract(&s.base, &input, &out, "1", &["--shard", &shard, "--concurrency", conc]).await;
            assert_eq!(code, Some(0), "{err}");
            let want = samples.iter().filter(|(id, _)| shard_of(id, 4) == k).count();
            assert!(err.contains(&format!("0 samples already done, {want} to go (shard {k}/4)")), "{err}");
        }
        let split: Vec<HashSet<String>> = manifests(&out).values().map(|m| ids_of(m).into_iter().collect()).collect();
        splits.push(split);
    }
    assert_eq!(splits[0], splits[1], "the same split twice");
    assert_eq!(splits[0].len(), 4);
    for (k, part) in splits[0].iter().enumerate() {
        let want: HashSet<String> =
            samples.iter().map(|(id, _)| id.clone()).filter(|id| shard_of(id, 4) == k as u64).collect();
        assert_eq!(part, &want, "shard {k} holds the ids whose xxh64 mod 4 is {k}");
        assert!(!part.is_empty(), "shard {k} is empty: the split is not spread");
    }
    // A second run of one shard finds its own manifest only.
    let out = dir.path().join("one");
    let (code, err) = run_extract(&s.base, &input, &out, "1", &["--shard", "2/4"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains(&format!("{} samples already done, 0 to go", splits[0][2].len())), "{err}");

    // --verify checks every manifest, or --shard's alone.
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(err.matches("all intact").count(), 4, "{err}");
    let m = &manifests(&out)["manifest-3-of-4.jsonl"];
    let victim = m[0]["file"].as_str().unwrap();
    std::fs::remove_file(out.join(victim)).unwrap();
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out), "--shard", "1/4"]).await;
    assert_eq!((code, err.matches("all intact").count()), (Some(0), 1), "{err}");
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(victim) && err.contains("missing"), "{err}");
    assert_eq!(manifests(&out)["manifest-3-of-4.jsonl"].len(), m.len() - 1);

    for bad in ["4/4", "0/0", "5/2", "x/3", "3", "1/-2"] {
        let (code, err) = run_extract(&s.base, &input, &dir.path().join("bad"), "1", &["--shard", bad]).await;
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--shard") && err.contains("I/N"), "{bad}: {err}");
    }
    assert!(!dir.path().join("bad").exists(), "nothing was started for a refused shard");
}

/// Writes a Parquet file with the crate's own writer: columns id (string), text (optional
/// string), n (int64) and ids (optional list of optional int64), in row groups of `group` rows.
type PqRow = (String, Option<String>, i64, Option<Vec<Option<i64>>>);

fn write_parquet(path: &std::path::Path, rows: &[PqRow], group: usize) {
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::types::ColumnPath;
    let schema = parquet::schema::parser::parse_message_type(
        "message schema {
            REQUIRED BYTE_ARRAY id (UTF8);
            OPTIONAL BYTE_ARRAY text (UTF8);
            REQUIRED INT64 n;
            OPTIONAL group ids (LIST) { REPEATED group list { OPTIONAL INT64 element; } }
        }",
    )
    .unwrap();
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(Default::default()))
        .set_column_compression(ColumnPath::from("text"), Compression::SNAPPY)
        .set_column_compression(
            ColumnPath::from(vec!["ids".into(), "list".into(), "element".into()]),
            Compression::GZIP(Default::default()),
        )
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, std::sync::Arc::new(schema), std::sync::Arc::new(props)).unwrap();
    for chunk in rows.chunks(group) {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ids: Vec<ByteArray> = chunk.iter().map(|r| ByteArray::from(r.0.as_str())).collect();
        col.typed::<ByteArrayType>().write_batch(&ids, None, None).unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let texts: Vec<ByteArray> = chunk.iter().filter_map(|r| r.1.as_deref().map(ByteArray::from)).collect();
        let defs: Vec<i16> = chunk.iter().map(|r| i16::from(r.1.is_some())).collect();
        col.typed::<ByteArrayType>().write_batch(&texts, Some(&defs), None).unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>().write_batch(&chunk.iter().map(|r| r.2).collect::<Vec<_>>(), None, None).unwrap();
        col.close().unwrap();
        // A list's levels: definition 0 null list, 1 empty list, 2 null element, 3 a value.
        let (mut vals, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
        for r in chunk {
            match &r.3 {
                None => {
                    defs.push(0);
                    reps.push(0);
                }
                Some(l) if l.is_empty() => {
                    defs.push(1);
                    reps.push(0);
                }
                Some(l) => {
                    for (i, e) in l.iter().enumerate() {
                        reps.push(i16::from(i > 0));
                        defs.push(if e.is_some() { 3 } else { 2 });
                        vals.extend(*e);
                    }
                }
            }
        }
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>().write_batch(&vals, Some(&defs), Some(&reps)).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

/// The tensors of a run's file for `id` (via its manifest `m`), but the metadata.
fn tensors_of(
    out: &std::path::Path,
    m: &[Value],
    id: &str,
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    raw_tensors(&std::fs::read(out.join(entry(m, id)["file"].as_str().unwrap())).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_input_with_bad_rows_reports_them_with_id_and_row_and_the_rest_land() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.parquet");
    let rows: Vec<PqRow> = (0..12i64)
        .map(|i| {
            let text = (i != 3).then(|| format!("sample number {i} says hello"));
            let ids = match i {
                4 => Some(vec![]),
                6 => None,
                8 => Some(vec![Some(5), None, Some(6)]),
                9 => Some(vec![Some(FAKE_VOCAB as i64)]),
                10 => Some(vec![Some(-3)]),
                _ => Some((0..i % 4 + 1).map(|k| Some((i * 10 + k) % 500)).collect()),
            };
            (format!("r{i}"), text, i, ids)
        })
        .collect();
    write_parquet(&input, &rows, 5);

    // --ids-column: the reader's bad rows and the server's refusal are failures, the rest land.
    let out = dir.path().join("ids");
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--ids-column", "ids", "--dtype", "float32"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    let got: Vec<(String, u64)> =
        f.iter().map(|v| (v["id"].as_str().unwrap().into(), v["row"].as_u64().unwrap())).collect();
    let want: Vec<(String, u64)> = [4, 6, 8, 9, 10].iter().map(|&i| (format!("r{i}"), i)).collect();
    assert_eq!(got, want, "{f:?}");
    let msg = |id: &str| f.iter().find(|v| v["id"] == id).unwrap()["error"].as_str().unwrap().to_string();
    assert!(msg("r4").contains("empty"), "{}", msg("r4"));
    assert!(msg("r6").contains("null"), "{}", msg("r6"));
    assert!(msg("r8").contains("token id 1") && msg("r8").contains("null"), "{}", msg("r8"));
    assert!(msg("r9").contains("422"), "{}", msg("r9"));
    assert!(msg("r10").contains("-3"), "{}", msg("r10"));
    let m = manifest(&out);
    assert_eq!(
        ids_of(&m).into_iter().collect::<HashSet<_>>(),
        ["r0", "r1", "r2", "r3", "r5", "r7", "r11"].map(String::from).into_iter().collect()
    );
    for (id, _, _, ids) in &rows {
        if let Some(e) = m.iter().find(|v| v["id"] == id.as_str()) {
            let want: Vec<u32> = ids.as_ref().unwrap().iter().map(|x| x.unwrap() as u32).collect();
            let t = read_safetensors(&out.join(e["file"].as_str().unwrap()));
            assert_eq!(t["input_ids"].i64, want.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), "{id}");
            assert_states(&t, &want, &[1, FAKE_LAYERS], id);
        }
    }

    // --text-column, ids taken from a column that is not there: the row numbers. The same texts
    // from JSONL give the same states.
    let out = dir.path().join("text");
    let (code, err) = run_extract(&s.base, &input, &out, "2", &["--text-column", "text", "--id-column", "key"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0]["id"].as_str(), f[0]["row"].as_u64()), (Some("3"), Some(3)));
    assert!(f[0]["error"].as_str().unwrap().contains("null"), "{f:?}");
    let jsonl = dir.path().join("text.jsonl");
    let lines: String = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            r.1.as_ref().map(|t| serde_json::json!({"id": i.to_string(), "text": t}).to_string() + "\n")
        })
        .collect();
    std::fs::write(&jsonl, lines).unwrap();
    let out_j = dir.path().join("text-jsonl");
    let (code, err) = run_extract(&s.base, &jsonl, &out_j, "2", &[]).await;
    assert_eq!(code, Some(0), "{err}");
    let (m, mj) = (manifest(&out), manifest(&out_j));
    assert_eq!(m.len(), 11);
    for i in (0..12).filter(|&i| i != 3) {
        let id = i.to_string();
        let t = tensors_of(&out, &m, &id);
        assert!(t["input_ids"].1[0] > 0, "{id}");
        assert_eq!(t, tensors_of(&out_j, &mj, &id), "row {i}: Parquet and JSONL agree");
    }

    // A column of the wrong type: every row fails, and no request is made.
    s.control.seen.lock().unwrap().clear();
    let out = dir.path().join("n");
    let (code, err) = run_extract(&s.base, &input, &out, "1", &["--text-column", "n"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 12);
    assert!(f.iter().all(|v| v["error"].as_str().unwrap().contains("an integer, not a string")), "{f:?}");
    assert!(s.control.seen.lock().unwrap().is_empty());
    assert!(manifest(&out).is_empty());

    // Exactly one input column for Parquet; a missing column is named with those there.
    for (extra, says) in [
        (vec!["--text-column", "text", "--ids-column", "ids"], "exactly one"),
        (vec![], "exactly one"),
        (vec!["--messages-column", "chat"], "no column \"chat\" (its columns: id, text, n, ids)"),
    ] {
        let (code, err) = run_extract(&s.base, &input, &dir.path().join("refused"), "1", &extra).await;
        assert_eq!(code, Some(1), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_file_written_by_pyarrow_reads_its_text_messages_and_ids_columns() {
    // tests/fixtures/bulk/mixed.parquet, from scripts/make_parquet_fixture.py.
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let input = fixtures().join("bulk/mixed.parquet");
    let chat = |turns: &[(&str, &str)]| -> Value {
        turns.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect()
    };
    let texts =
        [("a", "hello world"), ("c", "the quick brown fox"), ("d", "a b c"), ("e", "Zürich ✓"), ("f", "last row")];
    let chats = [
        ("a", chat(&[("user", "Hi"), ("assistant", "Hello!")])),
        ("d", chat(&[("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4")])),
        ("e", chat(&[("user", "x"), ("assistant", "y")])),
    ];
    let ids: [(&str, Vec<u32>); 4] =
        [("a", vec![1, 2, 3]), ("d", vec![7]), ("e", vec![100, 200, 300, 400]), ("f", vec![511])];
    let expect_bad = |column: &str, out: &std::path::Path, want: &[(&str, u64, &str)]| {
        let f = failures_of(out, "failures.jsonl");
        let got: Vec<(&str, u64)> = f.iter().map(|v| (v["id"].as_str().unwrap(), v["row"].as_u64().unwrap())).collect();
        assert_eq!(got, want.iter().map(|w| (w.0, w.1)).collect::<Vec<_>>(), "{column}: {f:?}");
        for (v, w) in f.iter().zip(want) {
            assert!(v["error"].as_str().unwrap().contains(w.2), "{column}: {v}");
        }
    };

    let out = dir.path().join("ids");
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--ids-column", "ids", "--dtype", "float32"]).await;
    assert_eq!(code, Some(1), "{err}");
    expect_bad("ids", &out, &[("b", 1, "empty"), ("c", 2, "null")]);
    let m = manifest(&out);
    assert_eq!(m.len(), 4);
    for (id, want) in &ids {
        let t = read_safetensors(&out.join(entry(&m, id)["file"].as_str().unwrap()));
        assert_eq!(t["input_ids"].i64, want.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), "{id}");
        assert_states(&t, want, &[1, FAKE_LAYERS], id);
    }

    // Text and messages: the same states as the same inputs given as JSONL.
    for (column, key, inputs, bad) in [
        (
            "--text-column",
            "text",
            texts.iter().map(|(i, t)| (*i, Value::from(*t))).collect::<Vec<_>>(),
            vec![("b", 1, "null")],
        ),
        (
            "--messages-column",
            "messages",
            chats.to_vec(),
            vec![("b", 1, "null"), ("c", 2, "message 1: its content is null"), ("f", 5, "empty")],
        ),
    ] {
        let out = dir.path().join(key);
        let col = key.to_string();
        let (code, err) = run_extract(&s.base, &input, &out, "2", &[column, &col]).await;
        assert_eq!(code, Some(1), "{column}: {err}");
        expect_bad(key, &out, &bad);
        let jsonl = dir.path().join(format!("{key}.jsonl"));
        let lines: String =
            inputs.iter().map(|(id, v)| serde_json::json!({"id": id, key: v}).to_string() + "\n").collect();
        std::fs::write(&jsonl, lines).unwrap();
        let out_j = dir.path().join(format!("{key}-jsonl"));
        let (code, err) = run_extract(&s.base, &jsonl, &out_j, "2", &[]).await;
        assert_eq!(code, Some(0), "{err}");
        let (m, mj) = (manifest(&out), manifest(&out_j));
        assert_eq!(m.len(), inputs.len(), "{column}");
        for (id, _) in &inputs {
            let t = tensors_of(&out, &m, id);
            assert!(t["input_ids"].1[0] > 0, "{column} {id}");
            assert_eq!(t, tensors_of(&out_j, &mj, id), "{column} {id}: Parquet and JSONL agree");
        }
    }
}

/// tests/fixtures/bulk/sharegpt.parquet (scripts/make_parquet_fixture.py): ShareGPT chats of
/// `{from, value}` read with `--messages-column conversations` give the same files as
/// mixed.parquet's `{role, content}` chats of the same messages; the unknown speaker is a
/// failed row naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_file_of_sharegpt_conversations_reads_as_the_same_chats_in_roles() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (out, out_roles) = (dir.path().join("sharegpt"), dir.path().join("roles"));
    let input = fixtures().join("bulk/sharegpt.parquet");
    let (code, err) = run_extract(&s.base, &input, &out, "2", &["--messages-column", "conversations"]).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0]["id"].as_str(), f[0]["row"].as_u64()), (Some("odd"), Some(2)));
    assert!(f[0]["error"].as_str().unwrap().contains("message 0: its from is \"narrator\""), "{}", f[0]);
    let roles = fixtures().join("bulk/mixed.parquet");
    let (code, err) = run_extract(&s.base, &roles, &out_roles, "2", &["--messages-column", "messages"]).await;
    assert_eq!(code, Some(1), "{err}");
    let (m, mr) = (manifest(&out), manifest(&out_roles));
    assert_eq!(ids_of(&m).len(), 2, "{m:?}");
    for id in ["a", "d"] {
        let t = tensors_of(&out, &m, id);
        assert!(t["input_ids"].1[0] > 0, "{id}");
        assert_eq!(t, tensors_of(&out_roles, &mr, id), "{id}: ShareGPT and roles agree");
    }
}

/// A proxy that answers 429 with `Retry-After: 1` to the first request for each sample (by its
/// token ids) and passes the others on.
async fn throttling_proxy(target: String) -> Proxy {
    proxy(target, |_, n| if n == 0 { Act::Throttle } else { Act::Pass }).await
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
