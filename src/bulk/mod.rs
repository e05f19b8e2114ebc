//! `layertap bulk`: extract hidden states for every row of a JSONL or Parquet file through one
//! or more running servers, one safetensors file per sample, resumable after a crash or Ctrl-C.
//!
//! Layout of `--out`: `manifest.jsonl` (one line per finished sample: id, file, tokens, bytes, the
//! xxh64 of each tensor and of the whole file), `failures.jsonl` (samples that failed for good,
//! with their id and input row, rewritten each run) and the samples' files; with `--shard I/N`
//! the two lists are `manifest-I-of-N.jsonl` and `failures-I-of-N.jsonl`, one pair per worker,
//! and the files of all workers share the folder (their ids, and so their names, differ);
//! `bulk.json` records the settings and the model the folder is made with (see [`settings`]):
//! - `--layout plain` (default): `shard-NNNNN/ID-HASH.safetensors` (1,000 input rows per folder,
//!   by input row; ID the id made safe for a file name, HASH the xxh64 of the exact id, so every
//!   sample has a file of its own: see [`paths`]), the server's answer as it came:
//!   `hidden_states` [T, n_layers, H], `input_ids` [T], `loss_mask` [T], `cu_seqlens` [2] (and
//!   `hidden_states_scale` for fp8, `positions` for a token selection), its metadata holding every
//!   tensor's checksum;
//! - `--layout speculators`: `hs_I.safetensors` (I = the sample's row in the whole input, from 0,
//!   whatever the shard) holding `hidden_states` [T, n_layers, H] and `token_ids` [T] (I64), and
//!   for fp8 `hidden_states_scales` [T, n_layers, 1] (F32), as speculators and hs-connectors read
//!   them.
//!
//! Every answer is checked against its checksums on receipt (a mismatch is retried like a 5xx)
//! and written to a temporary name, synced, renamed, and only then recorded in the manifest, so a
//! restart never trusts a partial file. Each sample is handled by one task from its first request
//! to its manifest line: a request that timed out or failed is abandoned before the next is sent
//! (to any server), only one answer is ever written, and the manifest is locked against a second
//! process of the same shard. A file is never given to two samples: a sample whose file the
//! folder's manifests record for another fails. `--verify` re-reads every recorded file and drops
//! the lines of missing or corrupt ones (and of paths outside the folder, and of files recorded
//! for two samples) from the manifest, so the next run redoes exactly those.

mod answer;
mod input;
mod manifest;
mod paths;
mod pool;
mod settings;
mod verify;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::answer::checksum::xxh64_hex;
use crate::answer::{LayerRef, Selection, FINAL_PRENORM};
use crate::cli::{BulkArgs, BulkLayout, Shard};
use answer::{prepare, Prepared};
use input::{Input, Row, Sample};
use manifest::{failures_name, lock_manifest, manifest_name, read_manifest, recorded_files, recorded_for};
use paths::relative_path;
use pool::{Pool, Server};

struct Shared {
    out: PathBuf,
    pool: Pool,
    /// The request body without its inputs.
    body: Value,
    layout: BulkLayout,
    /// What each answer's metadata must say (the folder's model, layers and dtype).
    expected: Arc<Vec<(&'static str, String)>>,
    /// The files the folder's manifests record and this run writes: xxh64 of the path → xxh64
    /// of the sample's id. A file is never given to two samples.
    files: std::sync::Mutex<HashMap<u64, u64>>,
    manifest: Mutex<std::fs::File>,
    failures: Mutex<Vec<Value>>,
    bar: indicatif::ProgressBar,
    tokens: AtomicU64,
    bytes: AtomicU64,
    stop: tokio_util::sync::CancellationToken,
}

enum Outcome {
    Done,
    Failed(String),
    Stopped,
}

/// An error of one attempt: whether it is worth retrying, and what went wrong.
type Attempt<T> = Result<T, (bool, String)>;

/// What went wrong with one request.
enum Trouble {
    /// Not worth retrying (a 4xx other than 429): the sample fails.
    Fatal(String),
    /// The server failed (no connection, a timeout, a 5xx): it is left alone for a while and the
    /// request goes elsewhere.
    Down(String, Option<Duration>),
    /// 429: the server asks for a pause of Retry-After.
    Busy(String, Duration),
    /// The answer was damaged (checksums, zstd): asked again after a delay.
    Again(String),
}

/// A Retry-After header in seconds, at most a minute.
fn retry_after(r: &reqwest::Response) -> Option<Duration> {
    let secs: f64 = r.headers().get("retry-after")?.to_str().ok()?.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(60.0)))
}

/// A chat input with `--chat-template-kwargs` under its own (its own win, key by key); other
/// inputs as they are.
fn with_template_kwargs(input: &Value, kwargs: Option<&crate::tokenizer::TemplateKwargs>) -> Value {
    let (Some(kwargs), Some(obj)) = (kwargs, input.as_object()) else { return input.clone() };
    if !obj.contains_key("messages") {
        return input.clone();
    }
    let mut obj = obj.clone();
    let mut merged = kwargs.clone();
    if let Some(Value::Object(own)) = obj.get("chat_template_kwargs") {
        merged.extend(own.clone());
    }
    obj.insert("chat_template_kwargs".into(), Value::Object(merged));
    Value::Object(obj)
}

async fn fetch(
    client: &reqwest::Client,
    a: &BulkArgs,
    sh: &Shared,
    url: &str,
    s: &Sample,
) -> Result<bytes::Bytes, Trouble> {
    let mut body = sh.body.clone();
    body["inputs"] = json!([with_template_kwargs(&s.input, a.chat_template_kwargs.as_ref())]);
    let mut req = client.post(url).header("accept-encoding", "zstd").json(&body);
    if let Some(k) = &a.api_key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.map_err(|e| Trouble::Down(format!("request failed: {e}"), None))?;
    let status = r.status();
    if status.is_success() {
        let compressed = r.headers().get("content-encoding").is_some_and(|v| v == "zstd");
        let b = r.bytes().await.map_err(|e| Trouble::Down(format!("reading the answer: {e}"), None))?;
        return if compressed {
            crate::answer::codec::unzstd(&b[..])
                .map(bytes::Bytes::from)
                .map_err(|e| Trouble::Again(format!("bad zstd: {e}")))
        } else {
            Ok(b)
        };
    }
    let wait = retry_after(&r);
    let msg = format!("HTTP {status}: {}", r.text().await.unwrap_or_default());
    Err(if status.as_u16() == 429 {
        Trouble::Busy(msg, wait.unwrap_or(Duration::from_secs(1)))
    } else if status.is_server_error() {
        Trouble::Down(msg, wait)
    } else {
        Trouble::Fatal(msg)
    })
}

/// One answer for `s`, checked and made into its file: asked of the least busy server up, and
/// again (of any server) while the failures are worth retrying and `--retries` allows.
async fn answer(client: &reqwest::Client, a: &BulkArgs, sh: &Shared, s: &Sample) -> Result<Prepared, Outcome> {
    let mut delay = Duration::from_millis(500);
    let mut attempt = 0;
    loop {
        if sh.stop.is_cancelled() {
            return Err(Outcome::Stopped);
        }
        let lease = match sh.pool.pick() {
            Ok(l) => l,
            Err(back) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(back.into()) => {}
                    _ = sh.stop.cancelled() => return Err(Outcome::Stopped),
                }
                continue;
            }
        };
        let server: &Server = lease.server;
        let r = match fetch(client, a, sh, &server.url, s).await {
            Ok(answer) => {
                let (layout, expected) = (sh.layout, sh.expected.clone());
                let checked = tokio::task::spawn_blocking(move || prepare(&answer, layout, &expected))
                    .await
                    .unwrap_or_else(|e| Err((false, format!("checking the answer: {e}"))));
                checked.map_err(|(retry, msg)| if retry { Trouble::Again(msg) } else { Trouble::Fatal(msg) })
            }
            Err(t) => Err(t),
        };
        drop(lease);
        let (msg, pause) = match r {
            Ok(p) => {
                sh.pool.ok(server);
                return Ok(p);
            }
            Err(Trouble::Fatal(msg)) => return Err(Outcome::Failed(msg)),
            // Another server may be up: try again at once; pick waits when none is.
            Err(Trouble::Down(msg, wait)) => {
                sh.pool.down(server, wait);
                (msg, None)
            }
            Err(Trouble::Busy(msg, wait)) => {
                sh.pool.busy(server, wait);
                (msg, None)
            }
            Err(Trouble::Again(msg)) => {
                let d = delay;
                delay = (delay * 2).min(Duration::from_secs(30));
                (msg, Some(d))
            }
        };
        attempt += 1;
        if attempt > a.retries {
            return Err(Outcome::Failed(format!("after {attempt} attempts: {msg} ({})", server.base)));
        }
        if let Some(d) = pause {
            tokio::select! {
                _ = tokio::time::sleep(d) => {}
                _ = sh.stop.cancelled() => return Err(Outcome::Stopped),
            }
        }
    }
}

/// Takes `rel` for the sample `id`, unless the folder's manifests (or this run) have given it to
/// another sample: the error then names that sample.
fn claim(sh: &Shared, rel: &str, id: &str) -> Result<(), String> {
    let (path, who) = (xxhash_rust::xxh64::xxh64(rel.as_bytes(), 0), xxhash_rust::xxh64::xxh64(id.as_bytes(), 0));
    let mut files = sh.files.lock().unwrap_or_else(|p| p.into_inner());
    match files.get(&path) {
        Some(&other) if other != who => {
            drop(files);
            let other = recorded_for(&sh.out, rel).map(|o| format!("{o:?}")).unwrap_or_else(|| "another sample".into());
            let hint = match sh.layout {
                BulkLayout::Speculators => {
                    " (--layout speculators names files by input row: has the input changed order since the folder \
                     was written?)"
                }
                BulkLayout::Plain => "",
            };
            Err(format!(
                "its file {rel} is already {other}'s: a file holds one sample, so this one is not written{hint}"
            ))
        }
        _ => {
            files.insert(path, who);
            Ok(())
        }
    }
}

async fn process(client: &reqwest::Client, a: &BulkArgs, sh: &Shared, s: &Sample) -> Outcome {
    let rel = relative_path(sh.layout, s);
    if let Err(e) = claim(sh, &rel.to_string_lossy(), &s.id) {
        return Outcome::Failed(e);
    }
    let prepared = match answer(client, a, sh, s).await {
        Ok(p) => p,
        Err(o) => return o,
    };
    let file = sh.out.join(&rel);
    let Prepared { bytes, checksums, rows } = prepared;
    let size = bytes.len();
    let write = {
        let file = file.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<String> {
            let whole = xxh64_hex([&bytes[..]]);
            if let Some(dir) = file.parent() {
                std::fs::create_dir_all(dir)?;
            }
            // One name per sample: a run after a crash rewrites (and renames) what it left, and
            // the manifest's lock keeps a second process of this shard from writing it at once.
            let tmp = file.with_extension("safetensors.tmp");
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &file)?;
            Ok(whole)
        })
    };
    let whole = match write.await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return Outcome::Failed(format!("writing {}: {e}", file.display())),
        Err(e) => return Outcome::Failed(format!("writer task: {e}")),
    };
    let line = json!({
        "id": s.id,
        "file": rel.to_string_lossy(),
        "tokens": rows,
        "bytes": size,
        "checksums": checksums,
        "xxh64": whole,
    })
    .to_string()
        + "\n";
    {
        let mut m = sh.manifest.lock().await;
        if let Err(e) = m.write_all(line.as_bytes()).and_then(|_| m.flush()) {
            return Outcome::Failed(format!("writing the manifest: {e}"));
        }
    }
    sh.tokens.fetch_add(rows as u64, Ordering::Relaxed);
    sh.bytes.fetch_add(size as u64, Ordering::Relaxed);
    Outcome::Done
}

/// Refuses, before any request, what `--layout speculators` cannot hold.
fn check_layout(a: &BulkArgs) -> anyhow::Result<()> {
    if a.layout != BulkLayout::Speculators {
        return Ok(());
    }
    if let Some(k) = a.top_k {
        anyhow::bail!(
            "--layout speculators cannot hold --top-k {k}: its files have fixed keys (hidden_states, token_ids and \
             for fp8 hidden_states_scales) and no slot for log-probabilities; use --layout plain, whose files \
             are the server's answers with topk_ids and topk_logprobs"
        );
    }
    if a.tokens != Selection::All {
        anyhow::bail!(
            "--layout speculators needs --tokens all (not {}): its files hold every token of a sample, \
             and its trainer takes the loss mask and positions from its own dataset",
            a.tokens
        );
    }
    if a.layers.last() != Some(&LayerRef::Name(FINAL_PRENORM.into())) {
        eprintln!(
            "note: speculators' trainers apply the target model's final norm to the last layer of each file; \
             end --layers with {FINAL_PRENORM} to give them the state before that norm"
        );
    }
    Ok(())
}

/// Rows of the input to do: this shard's, not in `done`, each id once (a repeated id is a bad
/// row). With `ids_only` the rows carry no input (for counting).
fn rows_to_do(
    input: &Input,
    shard: Option<Shard>,
    done: &HashSet<String>,
    ids_only: bool,
    mut f: impl FnMut(Row) -> ControlFlow<()>,
) -> anyhow::Result<()> {
    let mut first_row: HashMap<String, usize> = HashMap::new();
    input.for_each(ids_only, |row| {
        if shard.is_some_and(|sh| !sh.holds(row.id())) {
            return ControlFlow::Continue(());
        }
        let index = match &row {
            Row::Ok(s) => s.index,
            Row::Bad { index, .. } => *index,
        };
        if let Some(&first) = first_row.get(row.id()) {
            let id = row.id().to_string();
            return f(Row::Bad { index, id, error: format!("the id appears twice (first at row {first})") });
        }
        first_row.insert(row.id().to_string(), index);
        if done.contains(row.id()) {
            return ControlFlow::Continue(());
        }
        f(row)
    })
}

/// Runs the extraction (or, with `--verify`, the check of what is already written); returns the
/// process exit code (0 all done, 1 some failed, 130 interrupted).
pub async fn run(a: BulkArgs) -> anyhow::Result<i32> {
    if a.verify {
        return tokio::task::spawn_blocking(move || verify::verify(&a)).await?;
    }
    let servers: Vec<String> = a.server.iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    anyhow::ensure!(!servers.is_empty(), "--server is required");
    let input_path = a.input.clone().ok_or_else(|| anyhow::anyhow!("--input is required"))?;
    anyhow::ensure!(!a.layers.is_empty(), "--layers needs at least one index");
    check_layout(&a)?;
    let input = Input::new(&a, &input_path)?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs_f64(a.timeout_s)).build()?;
    // Every server's model, and the settings for it, checked against the folder before anything
    // is written to it.
    let pinned = settings::pin_servers(&client, &a, &servers).await?;
    std::fs::create_dir_all(&a.out)?;
    let pinned = {
        let out = a.out.clone();
        tokio::task::spawn_blocking(move || settings::pin_folder(&out, &pinned).map(|()| pinned)).await??
    };
    let name = manifest_name(a.shard);
    let manifest_path = a.out.join(&name);
    let mut manifest = std::fs::OpenOptions::new().create(true).append(true).open(&manifest_path)?;
    lock_manifest(&manifest, &name)?;
    let (done, torn) = read_manifest(&manifest_path);
    if torn {
        // End the torn line, or the next entry would be glued to it and lost.
        manifest.write_all(b"\n")?;
    }
    let done = Arc::new(done);
    // A first pass over the ids only counts what is left (and finds an unreadable file early).
    let todo = {
        let (input, done, shard) = (input.clone(), done.clone(), a.shard);
        tokio::task::spawn_blocking(move || -> anyhow::Result<u64> {
            let mut n = 0;
            rows_to_do(&input, shard, &done, true, |_| {
                n += 1;
                ControlFlow::Continue(())
            })?;
            Ok(n)
        })
        .await??
    };
    let of_shard = a.shard.map(|s| format!(" (shard {s})")).unwrap_or_default();
    eprintln!("{} samples already done, {todo} to go{of_shard}", done.len());
    let bar = indicatif::ProgressBar::new(todo).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} samples  {msg}  eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut body = json!({"layers": a.layers});
    if let Some(d) = &a.dtype {
        body["dtype"] = json!(d);
    }
    if let Some(t) = a.tokens.to_request() {
        body["tokens"] = t;
    }
    if let Some(k) = a.top_k {
        body["logprobs"] = json!({"top_k": k, "target": a.target_logprobs});
    }
    let sh = Arc::new(Shared {
        out: a.out.clone(),
        pool: Pool::new(&servers),
        body,
        layout: a.layout,
        expected: Arc::new(pinned.expected_metadata()),
        files: std::sync::Mutex::new(recorded_files(&a.out)),
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
            crate::signal::termination().await;
            eprintln!("\ninterrupted: finishing the samples in flight; run the same command again to resume");
            stop.cancel();
        });
    }
    let a = Arc::new(a);
    // The input is read as the samples go, a few ahead of the workers.
    let concurrency = a.concurrency.max(1);
    let (tx, rx) = tokio::sync::mpsc::channel::<Row>(concurrency * 4);
    let reader = {
        let (input, done, shard) = (input.clone(), done.clone(), a.shard);
        tokio::task::spawn_blocking(move || {
            rows_to_do(&input, shard, &done, false, |row| match tx.blocking_send(row) {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            })
        })
    };
    let queue = Arc::new(Mutex::new(rx));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (sh, a, queue, client) = (sh.clone(), a.clone(), queue.clone(), client.clone());
        workers.push(tokio::spawn(async move {
            loop {
                if sh.stop.is_cancelled() {
                    return;
                }
                let Some(row) = queue.lock().await.recv().await else { return };
                match row {
                    Row::Bad { index, id, error } => {
                        sh.failures.lock().await.push(json!({"id": id, "row": index, "error": error}));
                    }
                    Row::Ok(s) => match process(&client, &a, &sh, &s).await {
                        Outcome::Done => {}
                        Outcome::Stopped => return,
                        Outcome::Failed(e) => {
                            sh.failures.lock().await.push(json!({"id": s.id, "row": s.index, "error": e}))
                        }
                    },
                }
                sh.bar.inc(1);
                let secs = start.elapsed().as_secs_f64().max(1e-9);
                let t = sh.tokens.load(Ordering::Relaxed);
                sh.bar.set_message(format!("{:.0} tokens/s", t as f64 / secs));
            }
        }));
    }
    for w in workers {
        w.await?;
    }
    // The workers are gone: a reader still sending stops at its next row.
    drop(queue);
    let read = reader.await?;
    sh.bar.finish_and_clear();
    let mut failures = sh.failures.lock().await;
    failures.sort_by_key(|f| f["row"].as_u64());
    let fail_path = a.out.join(failures_name(a.shard));
    let text: String = failures.iter().map(|f| f.to_string() + "\n").collect();
    std::fs::write(&fail_path, text)?;
    let secs = start.elapsed().as_secs_f64();
    let tokens = sh.tokens.load(Ordering::Relaxed);
    let bytes = sh.bytes.load(Ordering::Relaxed);
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
    for s in &sh.pool.servers {
        eprintln!(
            "server {}: {} answered, {} failed, {} throttled (429)",
            s.base,
            s.answered.load(Ordering::Relaxed),
            s.failed.load(Ordering::Relaxed),
            s.throttled.load(Ordering::Relaxed)
        );
    }
    for f in failures.iter().take(10) {
        eprintln!("  {} (row {}): {}", f["id"], f["row"], f["error"]);
    }
    read?;
    Ok(if sh.stop.is_cancelled() {
        130
    } else if failures.is_empty() {
        0
    } else {
        1
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_kwargs_go_under_a_chat_s_own() {
        let flag: crate::tokenizer::TemplateKwargs =
            serde_json::from_value(json!({"reasoning_effort": "high", "enable_thinking": false})).unwrap();
        let chat =
            json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": true}});
        let got = with_template_kwargs(&chat, Some(&flag));
        assert_eq!(got["chat_template_kwargs"], json!({"reasoning_effort": "high", "enable_thinking": true}));
        assert_eq!(got["messages"], chat["messages"]);
        let bare = json!({"messages": []});
        assert_eq!(with_template_kwargs(&bare, Some(&flag))["chat_template_kwargs"], Value::Object(flag.clone()));
        for other in [json!({"text": "hi"}), json!({"input_ids": [1]})] {
            assert_eq!(with_template_kwargs(&other, Some(&flag)), other);
        }
        assert_eq!(with_template_kwargs(&chat, None), chat);
    }
}
