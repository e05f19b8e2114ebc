//! `layertap bulk --verify`: every file a manifest lists re-read and checked.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use safetensors::SafeTensors;
use serde_json::Value;

use super::answer::metadata;
use super::manifest::{manifest_name, manifests};
use super::paths::{file_inside, recorded_path};
use crate::answer::checksum::{verify_checksums, xxh64_hex};
use crate::cli::BulkArgs;

/// One sample recorded in the manifest, as `--verify` checks it.
struct Entry {
    /// Line number in the manifest (from 0).
    line: usize,
    id: Option<String>,
    file: Option<String>,
    xxh64: Option<String>,
    /// What is wrong with the line before its file is read.
    problem: Option<String>,
}

impl Entry {
    /// How a report names the entry: its id, or its line.
    fn name(&self) -> String {
        self.id.clone().unwrap_or_else(|| format!("(line {})", self.line + 1))
    }
}

/// A JSON line of a manifest as an entry; a line that is not JSON (a write torn by a crash) is
/// none.
fn entry(line: usize, text: &[u8]) -> Option<Entry> {
    let v: Value = serde_json::from_slice(text).ok()?;
    let str_of = |k: &str| v.get(k).and_then(Value::as_str).map(String::from);
    let (id, file) = (str_of("id"), str_of("file"));
    let problem = if !v.is_object() {
        Some("the manifest line is not a JSON object".to_string())
    } else if id.is_none() {
        Some("the manifest line has no id".to_string())
    } else {
        None
    };
    Some(Entry { line, id, file, xxh64: str_of("xxh64"), problem })
}

/// A recorded path as one key per file (`./a` and `a` alike); None for a path outside the folder.
fn file_key(file: &str) -> Option<PathBuf> {
    let p = recorded_path(file).ok()?;
    Some(p.components().filter(|c| matches!(c, std::path::Component::Normal(_))).collect())
}

/// Every file the manifests of `out` record for more than one sample: file → the ids.
fn shared_files(out: &Path) -> HashMap<PathBuf, BTreeSet<String>> {
    let mut by_file: HashMap<PathBuf, BTreeSet<String>> = HashMap::new();
    for m in manifests(out) {
        let Ok(bytes) = std::fs::read(&m) else { continue };
        for (i, l) in bytes.split(|&b| b == b'\n').enumerate() {
            let Some(Entry { id: Some(id), file: Some(file), .. }) = entry(i, l) else { continue };
            if let Some(key) = file_key(&file) {
                by_file.entry(key).or_default().insert(id);
            }
        }
    }
    by_file.retain(|_, ids| ids.len() > 1);
    by_file
}

/// Checks one recorded file: inside the folder, given to this sample only, present, its
/// whole-file xxh64 as the manifest recorded it, and each tensor against the checksums in its own
/// metadata (where it has them). Returns its size.
fn check_file(out: &Path, e: &Entry, shared: &HashMap<PathBuf, BTreeSet<String>>) -> Result<u64, String> {
    if let Some(p) = &e.problem {
        return Err(p.clone());
    }
    let file = e.file.as_deref().ok_or("the manifest line names no file")?;
    let path = file_inside(out, file)?;
    if let Some(ids) = file_key(file).and_then(|k| shared.get(&k)) {
        let others: Vec<String> = ids.iter().filter(|i| Some(*i) != e.id.as_ref()).map(|i| format!("{i:?}")).collect();
        return Err(format!("the file is also recorded for {}: one file cannot hold two samples", others.join(", ")));
    }
    let data = match std::fs::read(&path) {
        Ok(d) => d,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Err("missing".into()),
        Err(err) => return Err(format!("unreadable: {err}")),
    };
    let mut problems = Vec::new();
    if let Some(want) = &e.xxh64 {
        let got = xxh64_hex([&data[..]]);
        if &got != want {
            problems.push(format!("its xxh64 is {got}, the manifest recorded {want}"));
        }
    }
    match metadata(&data) {
        Err(err) => problems.push(err),
        Ok(m) if m.contains_key("checksum_algorithm") => {
            if let Err(err) = verify_checksums(&data) {
                problems.push(err);
            }
        }
        Ok(_) => {
            if let Err(err) = SafeTensors::deserialize(&data) {
                problems.push(format!("not a safetensors file: {err}"));
            }
        }
    }
    if problems.is_empty() {
        Ok(data.len() as u64)
    } else {
        Err(format!("corrupt: {}", problems.join("; ")))
    }
}

/// Replaces `path` with `bytes`: a temporary file, synced, renamed over it, and the folder synced.
fn replace_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("jsonl.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        // The rename itself is durable once the folder is synced.
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// `--verify`: checks every manifest of `--out` (or `--shard`'s only). Returns 0 when every file
/// is intact, 1 otherwise.
pub fn verify(a: &BulkArgs) -> anyhow::Result<i32> {
    let paths = match a.shard {
        Some(shard) => vec![a.out.join(manifest_name(Some(shard)))],
        None => manifests(&a.out),
    };
    if paths.is_empty() {
        anyhow::bail!("nothing to verify: {} holds no manifest", a.out.display());
    }
    // Files are shared by every manifest of the folder, whichever is checked.
    let shared = shared_files(&a.out);
    let mut code = 0;
    for path in &paths {
        if paths.len() > 1 {
            eprintln!("{}:", path.file_name().unwrap_or_default().to_string_lossy());
        }
        code = code.max(verify_manifest(a, path, &shared)?);
    }
    Ok(code)
}

/// Re-reads every file one manifest lists, reports those missing or corrupt and drops their
/// lines from it. Returns 0 when all are intact, 1 otherwise.
fn verify_manifest(a: &BulkArgs, path: &Path, shared: &HashMap<PathBuf, BTreeSet<String>>) -> anyhow::Result<i32> {
    let bytes =
        std::fs::read(path).map_err(|e| anyhow::anyhow!("nothing to verify: cannot read {}: {e}", path.display()))?;
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    let entries: Vec<Entry> = lines.iter().enumerate().filter_map(|(line, l)| entry(line, l)).collect();
    let bar = indicatif::ProgressBar::new(entries.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} files  {msg}  eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let (next, total) = (AtomicUsize::new(0), AtomicU64::new(0));
    let results: Vec<std::sync::Mutex<Option<Result<u64, String>>>> =
        entries.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..a.concurrency.clamp(1, 64) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(e) = entries.get(i) else { return };
                let r = check_file(&a.out, e, shared);
                if let Ok(n) = r {
                    let t = total.fetch_add(n, Ordering::Relaxed) + n;
                    bar.set_message(format!("{:.1} MB", t as f64 / 1e6));
                }
                *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
                bar.inc(1);
            });
        }
    });
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let total = total.load(Ordering::Relaxed);
    let mut bad = HashSet::new();
    for (e, r) in entries.iter().zip(results) {
        if let Some(Err(what)) = r.into_inner().unwrap_or_else(|p| p.into_inner()) {
            eprintln!("{}: {}: {what}", e.name(), e.file.as_deref().unwrap_or("(no file)"));
            bad.insert(e.line);
        }
    }
    if bad.is_empty() {
        eprintln!(
            "verified {} files, {total} bytes ({:.1} MB) in {secs:.1} s: all intact",
            entries.len(),
            total as f64 / 1e6
        );
        return Ok(0);
    }
    let kept: Vec<u8> = lines
        .iter()
        .enumerate()
        .filter(|(i, l)| !bad.contains(i) && !l.is_empty())
        .flat_map(|(_, l)| l.iter().copied().chain([b'\n']))
        .collect();
    replace_atomically(path, &kept).map_err(|e| anyhow::anyhow!("rewriting {}: {e}", path.display()))?;
    eprintln!(
        "verified {} files, {total} bytes ({:.1} MB) intact in {secs:.1} s; {} missing or corrupt, dropped from \
         the manifest: run the same bulk command again to extract them anew",
        entries.len() - bad.len(),
        total as f64 / 1e6,
        bad.len()
    );
    Ok(1)
}
