//! The manifests of `layertap bulk`: their names (one pair per shard), the lock that keeps a
//! second process of a shard out, and reading back what they record.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::Value;

use super::paths::recorded_path;
use crate::cli::Shard;

/// The manifest's name: `manifest.jsonl`, or `manifest-I-of-N.jsonl` for a shard.
pub(super) fn manifest_name(shard: Option<Shard>) -> String {
    match shard {
        None => "manifest.jsonl".into(),
        Some(Shard { index, count }) => format!("manifest-{index}-of-{count}.jsonl"),
    }
}

pub(super) fn failures_name(shard: Option<Shard>) -> String {
    match shard {
        None => "failures.jsonl".into(),
        Some(Shard { index, count }) => format!("failures-{index}-of-{count}.jsonl"),
    }
}

/// Takes an exclusive lock on the open manifest, so two processes of one shard never write the
/// same samples. Where the file system cannot lock, says so and goes on.
pub(super) fn lock_manifest(f: &std::fs::File, name: &str) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor this process holds open.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        anyhow::bail!("another layertap bulk is writing {name} in this folder: one process per shard");
    }
    eprintln!("note: cannot lock {name} ({e}); make sure no other process writes it");
    Ok(())
}

/// The (id, file) of each line of a manifest's bytes that records both; the file as recorded,
/// checked or not. Lines are read as bytes, so a corrupted line (a torn write, invalid UTF-8)
/// hides no line after it.
fn entries(bytes: &[u8]) -> impl Iterator<Item = (String, String)> + '_ {
    bytes.split(|&b| b == b'\n').filter_map(|l| serde_json::from_slice::<Value>(l).ok()).filter_map(|v| {
        let (id, file) = (v["id"].as_str()?, v["file"].as_str()?);
        Some((id.to_string(), file.to_string()))
    })
}

/// Ids already recorded in the manifest with a file inside the folder, and whether its last line
/// is torn (no newline). An id's last line counts: one without a file, or with a file outside the
/// folder, records nothing, and its sample is done again.
pub(super) fn read_manifest(path: &Path) -> (HashSet<String>, bool) {
    let Ok(bytes) = std::fs::read(path) else { return (HashSet::new(), false) };
    let mut last: HashMap<String, bool> = HashMap::new();
    for v in bytes.split(|&b| b == b'\n').filter_map(|l| serde_json::from_slice::<Value>(l).ok()) {
        if let Some(id) = v["id"].as_str() {
            let usable = v["file"].as_str().is_some_and(|f| recorded_path(f).is_ok());
            last.insert(id.to_string(), usable);
        }
    }
    let ids = last.into_iter().filter(|&(_, usable)| usable).map(|(id, _)| id).collect();
    (ids, bytes.last().is_some_and(|&b| b != b'\n'))
}

/// The files every manifest of `out` records: xxh64 of the path as recorded → xxh64 of the id.
pub(super) fn recorded_files(out: &Path) -> HashMap<u64, u64> {
    let hash = |s: &str| xxhash_rust::xxh64::xxh64(s.as_bytes(), 0);
    let mut files = HashMap::new();
    for m in manifests(out) {
        if let Ok(bytes) = std::fs::read(&m) {
            files.extend(entries(&bytes).map(|(id, file)| (hash(&file), hash(&id))));
        }
    }
    files
}

/// The id a manifest of `out` records with `file` (the last one that does).
pub(super) fn recorded_for(out: &Path, file: &str) -> Option<String> {
    manifests(out)
        .iter()
        .filter_map(|m| std::fs::read(m).ok())
        .flat_map(|bytes| entries(&bytes).filter(|(_, f)| f == file).map(|(id, _)| id).collect::<Vec<_>>())
        .last()
}

/// The manifests of `out`: `manifest.jsonl` and every `manifest-I-of-N.jsonl`, sorted.
pub(super) fn manifests(out: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name == "manifest.jsonl"
                || name
                    .strip_prefix("manifest-")
                    .and_then(|r| r.strip_suffix(".jsonl"))
                    .and_then(|r| r.split_once("-of-"))
                    .is_some_and(|(i, n)| i.parse::<u64>().is_ok() && n.parse::<u64>().is_ok())
        })
        .collect();
    v.sort();
    v
}
