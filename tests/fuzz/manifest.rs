//! Properties and seeds: the bulk manifest as crashes, disk trouble or hand edits may leave it.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{json, Value};

use crate::{check, config, corpus_files, fail_with, new_harness, Harness};

/// A harness of its own for the bulk properties, which read which ids the engine saw.
fn bulk_harness() -> &'static Mutex<Harness> {
    static H: OnceLock<Mutex<Harness>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(new_harness()))
}

/// One line of a manifest as it may be found after crashes, disk trouble or hand edits.
#[derive(Clone, Debug)]
enum ManifestLine {
    /// A finished sample (index into the samples), as bulk writes it.
    Done(usize),
    /// The first `cut` bytes of a finished sample's line: a write torn by a crash.
    Torn(usize, usize),
    /// Anything at all, newlines aside.
    Garbage(Vec<u8>),
    Blank,
}

fn manifest_line(samples: usize) -> impl Strategy<Value = ManifestLine> {
    prop_oneof![
        6 => (0..samples).prop_map(ManifestLine::Done),
        2 => (0..samples, any::<usize>()).prop_map(|(i, c)| ManifestLine::Torn(i, c)),
        2 => prop::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..40).prop_map(ManifestLine::Garbage),
        1 => prop::sample::select(vec![
            b"\xef\xbb\xbf".to_vec(), b"\xff\xfe\x00".to_vec(), b"{\"id\": 7}".to_vec(), b"{\"id\": null}".to_vec(),
            b"[\"id\"]".to_vec(), b"{\"id\":\"\xff\"}".to_vec(), b"\r".to_vec(), b"{\"file\":\"x\"}".to_vec(),
        ]).prop_map(ManifestLine::Garbage),
        1 => Just(ManifestLine::Blank),
    ]
}

fn sample_id(i: usize) -> String {
    format!("s{i}")
}

fn sample_ids(i: usize) -> Vec<u32> {
    vec![100 + i as u32, 7]
}

fn done_line(i: usize) -> String {
    json!({"id": sample_id(i), "file": format!("shard-00000/{}.safetensors", sample_id(i)), "tokens": 2, "bytes": 1})
        .to_string()
}

/// The ids of a manifest's complete, well-formed lines (what bulk itself writes: an id and a
/// file).
fn strict_manifest_ids(bytes: &[u8]) -> Vec<String> {
    bytes
        .split(|&b| b == b'\n')
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
        .filter(|v| v.get("file").and_then(Value::as_str).is_some())
        .filter_map(|v| v.get("id").and_then(Value::as_str).map(String::from))
        .collect()
}

/// Runs `layertap bulk` over `n` samples with `manifest` already in the output folder; returns
/// the ids the engine was asked for and the manifest afterwards.
fn run_bulk(n: usize, manifest: &[u8]) -> (Vec<String>, Vec<u8>, i32) {
    let h = bulk_harness().lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let lines: String =
        (0..n).map(|i| json!({"id": sample_id(i), "input_ids": sample_ids(i)}).to_string() + "\n").collect();
    std::fs::write(&input, lines).unwrap();
    std::fs::write(out.join("manifest.jsonl"), manifest).unwrap();
    h.server.control.seen.lock().unwrap().clear();
    let args = layertap::cli::BulkArgs {
        server: vec![h.server.base.clone()],
        input: Some(input),
        out: out.clone(),
        layers: vec![layertap::answer::LayerRef::Index(1)],
        dtype: Some("float32".into()),
        concurrency: 2,
        api_key: None,
        retries: 2,
        timeout_s: 30.0,
        verify: false,
        id_column: "id".into(),
        ..Default::default()
    };
    let code = h.rt.block_on(layertap::bulk::run(args)).expect("bulk runs");
    let seen = h.server.control.seen.lock().unwrap().clone();
    let fetched: Vec<String> =
        seen.chunks(2).filter(|c| c.len() == 2 && c[1] == 7).map(|c| sample_id((c[0] - 100) as usize)).collect();
    let after = std::fs::read(out.join("manifest.jsonl")).unwrap();
    (fetched, after, code)
}

/// After a bulk run over a manifest holding `valid` finished samples (and whatever else):
/// none of them was fetched again, the others were fetched once, and every sample is recorded
/// by a complete line of the manifest.
fn check_bulk(n: usize, manifest: &[u8]) -> Result<(), TestCaseError> {
    let valid: HashSet<String> = strict_manifest_ids(manifest).into_iter().collect();
    let (fetched, after, code) = run_bulk(n, manifest);
    check!(code == 0, "bulk exited {code}");
    let refetched: Vec<&String> = fetched.iter().filter(|f| valid.contains(*f)).collect();
    check!(refetched.is_empty(), "finished samples fetched again (their manifest entries were lost): {refetched:?}");
    let want: HashSet<String> = (0..n).map(sample_id).filter(|i| !valid.contains(i)).collect();
    let got: HashSet<String> = fetched.iter().cloned().collect();
    check!(got == want && fetched.len() == want.len(), "fetched {fetched:?}, expected each of {want:?} once");
    let recorded: HashSet<String> = strict_manifest_ids(&after).into_iter().collect();
    let missing: Vec<String> = (0..n).map(sample_id).filter(|i| !recorded.contains(i)).collect();
    check!(
        missing.is_empty(),
        "samples missing from the manifest afterwards: {missing:?}\n{}",
        String::from_utf8_lossy(&after)
    );
    Ok(())
}

fn render_manifest(lines: &[ManifestLine], torn_tail: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for l in lines {
        match l {
            ManifestLine::Done(i) => out.extend(done_line(*i).bytes()),
            ManifestLine::Torn(i, c) => {
                let full = done_line(*i);
                out.extend(&full.as_bytes()[..c % full.len()]);
            }
            ManifestLine::Garbage(g) => out.extend(g),
            ManifestLine::Blank => {}
        }
        out.push(b'\n');
    }
    if torn_tail {
        // A crash in the middle of the last append: no newline at the end.
        out.pop();
    }
    out
}

proptest! {
    #![proptest_config(config(24))]

    /// Arbitrary, truncated and corrupted manifest lines: the run never panics, never redoes a
    /// sample a complete line records, and leaves every sample recorded.
    #[test]
    fn corrupted_manifests_lose_no_finished_sample(
        n in 1usize..6,
        lines in prop::collection::vec(manifest_line(6), 0..10),
        torn_tail in any::<bool>(),
    ) {
        let lines: Vec<ManifestLine> = lines.into_iter().filter(|l| match l {
            ManifestLine::Done(i) | ManifestLine::Torn(i, _) => *i < n,
            _ => true,
        }).collect();
        check_bulk(n, &render_manifest(&lines, torn_tail))?;
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------------------------

/// Every seed manifest: no finished sample is redone or lost.
#[test]
fn seed_manifests() {
    for f in corpus_files("manifests") {
        let bytes = std::fs::read(&f).unwrap();
        fail_with(&f, check_bulk(6, &bytes));
    }
}
