//! Every sample in a file of its own, and only files inside the folder read: ids alike once made
//! safe for a file name, an id given twice, a row whose `--layout speculators` file belongs to
//! another sample, folders written with the earlier names, manifest paths leading out of the
//! folder, and `--timeout-s` values that cannot be a timeout.

use std::collections::HashSet;

use serde_json::Value;

use crate::common::*;
use crate::{assert_states, entry, failures_of, manifest, p, run_bulk, run_extract, walk, write_input, xxh64};

fn file_of(m: &[Value], id: &str) -> String {
    entry(m, id)["file"].as_str().unwrap().to_string()
}

fn write_manifest(out: &std::path::Path, m: &[Value]) {
    let text: String = m.iter().map(|v| v.to_string() + "\n").collect();
    std::fs::write(out.join("manifest.jsonl"), text).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_alike_once_made_safe_each_get_a_file_of_their_own() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    let long = "y".repeat(130);
    let ids: Vec<String> = vec![
        "a/b".into(),
        "a b".into(),
        "é".into(),
        "è".into(),
        "".into(),
        " ".into(),
        format!("{long}1"),
        format!("{long}2"),
    ];
    let samples: Vec<(&str, Vec<u32>)> =
        ids.iter().enumerate().map(|(i, id)| (id.as_str(), vec![10 * i as u32 + 1, 10 * i as u32 + 2])).collect();
    write_input(&input, &samples);
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    let m = manifest(&out);
    assert_eq!(m.len(), ids.len(), "{m:?}");
    let files: HashSet<String> = ids.iter().map(|id| file_of(&m, id)).collect();
    assert_eq!(files.len(), ids.len(), "one file per sample: {files:?}");
    let on_disk = walk(&out).into_iter().filter(|f| f.to_string_lossy().ends_with(".safetensors")).count();
    assert_eq!(on_disk, ids.len());
    for (id, tokens) in &samples {
        assert_states(&read_safetensors(&out.join(file_of(&m, id))), tokens, &[1, FAKE_LAYERS], &format!("{id:?}"));
    }
    // The name: the id made safe, then the xxh64 of the exact id.
    assert_eq!(file_of(&m, "a/b"), format!("shard-00000/a_b-{}.safetensors", xxh64(b"a/b")));
    assert_eq!(file_of(&m, ""), format!("shard-00000/_-{}.safetensors", xxh64(b"")));

    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains(&format!("verified {} files", ids.len())), "{err}");
    // A rerun has nothing to do and overwrites nothing.
    s.control.seen.lock().unwrap().clear();
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains(&format!("{} samples already done, 0 to go", ids.len())), "{err}");
    assert!(s.control.seen.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_given_twice_is_refused_naming_both_rows_and_the_first_is_kept() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    write_input(&input, &[("x", vec![1, 2]), ("y", vec![3]), ("x", vec![4, 5, 6])]);
    for run in 0..2 {
        let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
        assert_eq!(code, Some(1), "run {run}: {err}");
        let f = failures_of(&out, "failures.jsonl");
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!((f[0]["id"].as_str(), f[0]["row"].as_u64()), (Some("x"), Some(2)));
        assert!(f[0]["error"].as_str().unwrap().contains("first at row 0"), "{f:?}");
        let m = manifest(&out);
        assert_eq!(m.len(), 2);
        assert_states(&read_safetensors(&out.join(file_of(&m, "x"))), &[1, 2], &[1, FAKE_LAYERS], "x");
    }
}

/// speculators' files are named by input row: a resume whose input moved its rows would write a
/// new sample over a recorded one's file. It fails that sample instead, naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speculators_row_whose_file_belongs_to_another_sample_is_refused() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (first, moved, out) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"), dir.path().join("out"));
    write_input(&first, &[("a", vec![1, 2]), ("b", vec![3])]);
    write_input(&moved, &[("new", vec![7, 8, 9]), ("a", vec![1, 2]), ("b", vec![3])]);
    let flags = ["--layout", "speculators", "--dtype", "float32"];
    let (code, err) = run_extract(&s.base, &first, &out, "1,final_prenorm", &flags).await;
    assert_eq!(code, Some(0), "{err}");
    let before = std::fs::read(out.join("hs_0.safetensors")).unwrap();
    let (code, err) = run_extract(&s.base, &moved, &out, "1,final_prenorm", &flags).await;
    assert_eq!(code, Some(1), "{err}");
    let f = failures_of(&out, "failures.jsonl");
    assert_eq!(f.len(), 1, "{f:?}");
    let msg = f[0]["error"].as_str().unwrap();
    assert_eq!(f[0]["id"], "new");
    assert!(msg.contains("hs_0.safetensors") && msg.contains("\"a\""), "{msg}");
    assert_eq!(std::fs::read(out.join("hs_0.safetensors")).unwrap(), before, "a's file is untouched");
    assert_eq!(manifest(&out).len(), 2);
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
}

/// A folder written with the earlier names (`shard-NNNNN/<id made safe>.safetensors`) resumes:
/// its recorded files are read where the manifest says, new samples get the new names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_of_the_earlier_names_resumes_by_its_recorded_paths() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (head, input, out) = (dir.path().join("head.jsonl"), dir.path().join("all.jsonl"), dir.path().join("out"));
    let samples = [("a", vec![1, 2]), ("b/c", vec![3]), ("d", vec![4, 5])];
    write_input(&head, &samples[..2]);
    write_input(&input, &samples);
    let (code, err) = run_extract(&s.base, &head, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    // What an earlier version wrote: its names, and no record of the settings.
    let mut m = manifest(&out);
    for e in m.iter_mut() {
        let old = if e["id"] == "a" { "shard-00000/a.safetensors" } else { "shard-00000/b_c.safetensors" };
        std::fs::rename(out.join(e["file"].as_str().unwrap()), out.join(old)).unwrap();
        e["file"] = old.into();
    }
    write_manifest(&out, &m);
    let _ = std::fs::remove_file(out.join("bulk.json"));

    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("2 samples already done, 1 to go"), "{err}");
    let m = manifest(&out);
    assert_eq!(file_of(&m, "a"), "shard-00000/a.safetensors");
    assert_eq!(file_of(&m, "d"), format!("shard-00000/d-{}.safetensors", xxh64(b"d")));
    for (id, tokens) in &samples {
        assert_states(&read_safetensors(&out.join(file_of(&m, id))), tokens, &[1, FAKE_LAYERS], id);
    }
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("verified 3 files"), "{err}");
}

/// Two ids recorded with one file (as an earlier naming could write them, inputs alike so the
/// bytes match both): `--verify` names both and drops them, and the next run gives each its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_two_samples_recorded_with_one_file() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    write_input(&input, &[("p", vec![1, 2]), ("q", vec![1, 2]), ("r", vec![3])]);
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    let mut m = manifest(&out);
    let shared = file_of(&m, "p");
    let q = m.iter_mut().find(|v| v["id"] == "q").unwrap();
    std::fs::remove_file(out.join(q["file"].as_str().unwrap())).unwrap();
    q["file"] = shared.clone().into();
    write_manifest(&out, &m);

    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(1), "{err}");
    for id in ["p", "q"] {
        let line = err.lines().find(|l| l.starts_with(&format!("{id}: "))).unwrap_or_else(|| panic!("{err}"));
        assert!(line.contains(&shared) && line.contains("also recorded"), "{line}");
    }
    assert_eq!(crate::ids_of(&manifest(&out)), ["r"]);
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    let m = manifest(&out);
    assert_ne!(file_of(&m, "p"), file_of(&m, "q"));
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
}

/// Manifest paths that leave the folder (`..`, absolute, a link out of it) are not read: `--verify`
/// names them and drops their lines, as it does lines without an id or a file, and the next run
/// extracts those samples into the folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_refuses_manifest_paths_that_leave_the_folder() {
    let s = fake_server(limits(), vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    let samples = [("up", vec![1, 2]), ("abs", vec![3]), ("link", vec![4, 5]), ("nofile", vec![6]), ("ok", vec![7])];
    write_input(&input, &samples);
    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    let mut m = manifest(&out);
    // Each file moved out of the folder, intact, and the manifest pointed at it.
    for e in m.iter_mut() {
        let id = e["id"].as_str().unwrap().to_string();
        let file = out.join(e["file"].as_str().unwrap());
        let outside = dir.path().join(format!("{id}.safetensors"));
        match id.as_str() {
            "up" => {
                std::fs::rename(&file, &outside).unwrap();
                e["file"] = "../up.safetensors".into();
            }
            "abs" => {
                std::fs::rename(&file, &outside).unwrap();
                e["file"] = p(&outside).into();
            }
            "link" => {
                std::fs::rename(&file, &outside).unwrap();
                std::os::unix::fs::symlink(&outside, &file).unwrap();
            }
            "nofile" => {
                e.as_object_mut().unwrap().remove("file");
            }
            _ => {}
        }
    }
    m.push(serde_json::json!({"file": file_of(&m, "ok")}));
    write_manifest(&out, &m);

    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(1), "{err}");
    let line_of = |id: &str| err.lines().find(|l| l.starts_with(&format!("{id}: "))).map(String::from);
    for id in ["up", "abs", "link"] {
        let line = line_of(id).unwrap_or_else(|| panic!("{id} not named: {err}"));
        assert!(line.contains("out of the folder") || line.contains("absolute"), "{line}");
        assert!(line.contains("inside the folder"), "{line}");
    }
    assert!(line_of("nofile").is_some_and(|l| l.contains("no file")), "{err}");
    assert!(err.lines().any(|l| l.contains("line 6") && l.contains("no id")), "{err}");
    assert!(line_of("ok").is_none(), "{err}");
    assert_eq!(crate::ids_of(&manifest(&out)), ["ok"]);

    let (code, err) = run_extract(&s.base, &input, &out, "1,-1", &["--dtype", "float32"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("1 samples already done, 4 to go"), "{err}");
    let m = manifest(&out);
    for (id, tokens) in &samples {
        let file = file_of(&m, id);
        assert!(file.starts_with("shard-00000/"), "{id}: {file}");
        let path = out.join(&file);
        assert!(!path.symlink_metadata().unwrap().file_type().is_symlink(), "{id}");
        assert_states(&read_safetensors(&path), tokens, &[1, FAKE_LAYERS], id);
    }
    let (code, err) = run_bulk(&["--verify", "--out", &p(&out)]).await;
    assert_eq!(code, Some(0), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_that_is_not_a_positive_number_of_seconds_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("data.jsonl"), dir.path().join("out"));
    write_input(&input, &[("a", vec![1])]);
    for bad in ["0", "-1", "nan", "inf", "0.0"] {
        let flag = format!("--timeout-s={bad}");
        let (code, err) = run_extract("http://127.0.0.1:9", &input, &out, "1", &[&flag]).await;
        assert_eq!(code, Some(2), "--timeout-s {bad}: {err}");
        assert!(err.contains("--timeout-s") && err.contains("more than 0"), "--timeout-s {bad}: {err}");
    }
    assert!(!out.exists(), "nothing written");
}
