//! `layertap bulk` against a live server: a run killed midway resumes without redoing or losing
//! samples, and every file is intact.
//!
//! By topic: `resume` (interrupted runs, refused samples, `--verify`), `retries` (answers
//! corrupted or throttled on the way), `layouts` (`--layout speculators`), `tokens` (`--tokens`),
//! `input` (ShareGPT chats and Parquet files), `shards` (`--shard I/N` and several servers),
//! `integrity` (a file of its own for every sample, only paths inside the folder read) and
//! `pinning` (the settings and the model a folder is made with).
//! This file holds what they share: running `layertap bulk` and reading what it wrote.

#[path = "../common/mod.rs"]
mod common;

mod input;
mod integrity;
mod layouts;
mod logprobs;
mod pinning;
mod resume;
mod retries;
mod shards;
mod tokens;

use std::process::{Command, Stdio};

use common::*;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Running bulk
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

// ---------------------------------------------------------------------------------------------
// Reading what it wrote
// ---------------------------------------------------------------------------------------------

fn manifest(dir: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("manifest.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn entry<'a>(m: &'a [Value], id: &str) -> &'a Value {
    m.iter().find(|v| v["id"] == id).unwrap_or_else(|| panic!("{id} is not in the manifest"))
}

/// Where the manifest of `out` says the sample `id` is.
fn file_path(out: &std::path::Path, id: &str) -> std::path::PathBuf {
    out.join(entry(&manifest(out), id)["file"].as_str().unwrap())
}

fn failures_of(out: &std::path::Path, name: &str) -> Vec<Value> {
    std::fs::read_to_string(out.join(name)).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn ids_of(m: &[Value]) -> Vec<String> {
    m.iter().map(|v| v["id"].as_str().unwrap().to_string()).collect()
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
