//! Runs killed midway resume without redoing or losing samples; refused samples are reported
//! and the rest land; `--verify` drops missing and corrupt files, and the next run redoes them.

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use crate::{assert_states, entry, manifest, p, run_bulk, tensor_start, walk, write_input};

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
