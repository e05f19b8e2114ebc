//! `layertap bulk` against a live server: a run killed midway resumes without redoing or losing
//! samples, and every file is intact.

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
