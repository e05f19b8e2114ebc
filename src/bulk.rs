//! `layertap bulk`: extract hidden states for every line of a JSONL file through a running server,
//! one safetensors file per sample, resumable after a crash or Ctrl-C.
//!
//! Layout of `--out`: `manifest.jsonl` (one line per finished sample: id, file, tokens, bytes),
//! `failures.jsonl` (samples that failed for good, rewritten each run) and `shard-NNNNN/ID.safetensors`
//! (1,000 samples per shard, in input order). Each file holds `hidden_states` [T, n_layers, H],
//! `input_ids` [T], `loss_mask` [T] (and `cu_seqlens` [2]); it is written to a temporary name,
//! synced, renamed, and only then recorded in the manifest, so a restart never trusts a partial file.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::cli::BulkArgs;

const SHARD_SIZE: usize = 1000;

/// One line of the input file.
struct Sample {
    line: usize,
    id: String,
    input: Value,
}

/// A file name for a sample id: letters, digits, '-', '_', '.' kept, anything else replaced.
fn file_stem(id: &str) -> String {
    let s: String =
        id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).take(120).collect();
    if s.is_empty() || s.starts_with('.') {
        format!("_{s}")
    } else {
        s
    }
}

fn read_samples(path: &Path) -> anyhow::Result<Vec<Sample>> {
    let f = std::fs::File::open(path).map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let mut v: Value =
            serde_json::from_str(&line).map_err(|e| anyhow::anyhow!("{}:{}: not JSON: {e}", path.display(), n + 1))?;
        let obj = v.as_object_mut().ok_or_else(|| anyhow::anyhow!("{}:{}: not an object", path.display(), n + 1))?;
        let id = match obj.remove("id") {
            Some(Value::String(s)) => s,
            Some(other) => other.to_string(),
            None => format!("line-{}", n + 1),
        };
        anyhow::ensure!(seen.insert(id.clone()), "{}:{}: id {id:?} appears twice", path.display(), n + 1);
        out.push(Sample { line: out.len(), id, input: v });
    }
    Ok(out)
}

/// Ids already recorded in the manifest, and whether its last line is torn (no newline). Lines
/// are read as bytes, so a corrupted line (a torn write, invalid UTF-8) hides no line after it.
fn read_manifest(path: &Path) -> (HashSet<String>, bool) {
    let Ok(bytes) = std::fs::read(path) else { return (HashSet::new(), false) };
    let ids = bytes
        .split(|&b| b == b'\n')
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
        .filter_map(|v| v["id"].as_str().map(String::from))
        .collect();
    (ids, bytes.last().is_some_and(|&b| b != b'\n'))
}

struct Shared {
    out: PathBuf,
    manifest: Mutex<std::fs::File>,
    failures: Mutex<Vec<Value>>,
    bar: indicatif::ProgressBar,
    tokens: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
    stop: tokio_util::sync::CancellationToken,
}

enum Outcome {
    Done,
    Failed(String),
    Stopped,
}

async fn fetch(client: &reqwest::Client, a: &BulkArgs, s: &Sample) -> Result<bytes::Bytes, (bool, String)> {
    let mut body = json!({"inputs": [s.input], "layers": a.layers});
    if let Some(d) = &a.dtype {
        body["dtype"] = json!(d);
    }
    let mut req = client
        .post(format!("{}/v1/hidden-states", a.server.trim_end_matches('/')))
        .header("accept-encoding", "zstd")
        .json(&body);
    if let Some(k) = &a.api_key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.map_err(|e| (true, format!("request failed: {e}")))?;
    let status = r.status();
    if status.is_success() {
        let compressed = r.headers().get("content-encoding").is_some_and(|v| v == "zstd");
        let b = r.bytes().await.map_err(|e| (true, format!("reading the answer: {e}")))?;
        return if compressed {
            zstd::stream::decode_all(&b[..]).map(bytes::Bytes::from).map_err(|e| (true, format!("bad zstd: {e}")))
        } else {
            Ok(b)
        };
    }
    let retry = status.as_u16() == 429 || status.is_server_error();
    let msg = r.text().await.unwrap_or_default();
    Err((retry, format!("HTTP {status}: {msg}")))
}

async fn process(client: &reqwest::Client, a: &BulkArgs, sh: &Shared, s: &Sample) -> Outcome {
    let mut delay = Duration::from_millis(500);
    let mut attempt = 0;
    let answer = loop {
        if sh.stop.is_cancelled() {
            return Outcome::Stopped;
        }
        match fetch(client, a, s).await {
            Ok(b) => break b,
            Err((retry, msg)) => {
                attempt += 1;
                if !retry || attempt > a.retries {
                    return Outcome::Failed(msg);
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = sh.stop.cancelled() => return Outcome::Stopped,
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    };
    let tokens = match safetensors::SafeTensors::deserialize(&answer) {
        Ok(st) => st.tensor("input_ids").map(|t| t.shape()[0]).unwrap_or(0),
        Err(e) => return Outcome::Failed(format!("the answer is not safetensors: {e}")),
    };
    let shard = sh.out.join(format!("shard-{:05}", s.line / SHARD_SIZE));
    let file = shard.join(format!("{}.safetensors", file_stem(&s.id)));
    let write = {
        let (shard, file, answer) = (shard.clone(), file.clone(), answer.clone());
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            std::fs::create_dir_all(&shard)?;
            let tmp = file.with_extension("safetensors.tmp");
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&answer)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &file)
        })
    };
    match write.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Outcome::Failed(format!("writing {}: {e}", file.display())),
        Err(e) => return Outcome::Failed(format!("writer task: {e}")),
    }
    let rel = file.strip_prefix(&sh.out).unwrap_or(&file).to_string_lossy().into_owned();
    let line = json!({"id": s.id, "file": rel, "tokens": tokens, "bytes": answer.len()}).to_string() + "\n";
    {
        let mut m = sh.manifest.lock().await;
        if let Err(e) = m.write_all(line.as_bytes()).and_then(|_| m.flush()) {
            return Outcome::Failed(format!("writing the manifest: {e}"));
        }
    }
    sh.tokens.fetch_add(tokens as u64, std::sync::atomic::Ordering::Relaxed);
    sh.bytes.fetch_add(answer.len() as u64, std::sync::atomic::Ordering::Relaxed);
    Outcome::Done
}

/// Runs the extraction; returns the process exit code (0 all done, 1 some failed, 130 interrupted).
pub async fn run(a: BulkArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(!a.layers.is_empty(), "--layers needs at least one index");
    std::fs::create_dir_all(&a.out)?;
    let samples = read_samples(&a.input)?;
    let manifest_path = a.out.join("manifest.jsonl");
    let (done, torn) = read_manifest(&manifest_path);
    let todo: Vec<Sample> = samples.into_iter().filter(|s| !done.contains(&s.id)).collect();
    eprintln!("{} samples already done, {} to go", done.len(), todo.len());
    let mut manifest = std::fs::OpenOptions::new().create(true).append(true).open(&manifest_path)?;
    if torn {
        // End the torn line, or the next entry would be glued to it and lost.
        manifest.write_all(b"\n")?;
    }
    let bar = indicatif::ProgressBar::new(todo.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} samples  {msg}  eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let sh = Arc::new(Shared {
        out: a.out.clone(),
        manifest: Mutex::new(manifest),
        failures: Mutex::new(Vec::new()),
        bar,
        tokens: Default::default(),
        bytes: Default::default(),
        stop: tokio_util::sync::CancellationToken::new(),
    });
    {
        let stop = sh.stop.clone();
        tokio::spawn(async move {
            crate::server::termination_signal().await;
            eprintln!("\ninterrupted: finishing the samples in flight; run the same command again to resume");
            stop.cancel();
        });
    }
    let client = reqwest::Client::builder().timeout(Duration::from_secs(a.timeout_s)).build()?;
    let a = Arc::new(a);
    let queue = Arc::new(Mutex::new(todo.into_iter()));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..a.concurrency.max(1) {
        let (sh, a, queue, client) = (sh.clone(), a.clone(), queue.clone(), client.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let Some(s) = queue.lock().await.next() else { return };
                match process(&client, &a, &sh, &s).await {
                    Outcome::Done => {}
                    Outcome::Stopped => return,
                    Outcome::Failed(e) => sh.failures.lock().await.push(json!({"id": s.id, "error": e})),
                }
                sh.bar.inc(1);
                let secs = start.elapsed().as_secs_f64().max(1e-9);
                let t = sh.tokens.load(std::sync::atomic::Ordering::Relaxed);
                sh.bar.set_message(format!("{:.0} tokens/s", t as f64 / secs));
            }
        }));
    }
    for w in workers {
        w.await?;
    }
    sh.bar.finish_and_clear();
    let failures = sh.failures.lock().await;
    let fail_path = a.out.join("failures.jsonl");
    let text: String = failures.iter().map(|f| f.to_string() + "\n").collect();
    std::fs::write(&fail_path, text)?;
    let secs = start.elapsed().as_secs_f64();
    let tokens = sh.tokens.load(std::sync::atomic::Ordering::Relaxed);
    let bytes = sh.bytes.load(std::sync::atomic::Ordering::Relaxed);
    let this_run = sh.bar.position() as usize - failures.len();
    let written = done.len() + this_run;
    eprintln!(
        "done: {written} samples in the manifest ({} this run, {tokens} tokens, {:.1} MB, {:.1} s, {:.0} tokens/s); \
         {} failed{}",
        this_run,
        bytes as f64 / 1e6,
        secs,
        tokens as f64 / secs.max(1e-9),
        failures.len(),
        if failures.is_empty() { String::new() } else { format!(" (see {})", fail_path.display()) }
    );
    for f in failures.iter().take(10) {
        eprintln!("  {}: {}", f["id"], f["error"]);
    }
    Ok(if sh.stop.is_cancelled() {
        130
    } else if failures.is_empty() {
        0
    } else {
        1
    })
}
