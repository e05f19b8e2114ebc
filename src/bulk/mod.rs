//! `layertap bulk`: extract hidden states for every line of a JSONL file through a running server,
//! one safetensors file per sample, resumable after a crash or Ctrl-C.
//!
//! Layout of `--out`: `manifest.jsonl` (one line per finished sample: id, file, tokens, bytes, the
//! xxh64 of each tensor and of the whole file), `failures.jsonl` (samples that failed for good,
//! rewritten each run) and the samples' files:
//! - `--layout plain` (default): `shard-NNNNN/ID.safetensors` (1,000 samples per shard, in input
//!   order), the server's answer as it came: `hidden_states` [T, n_layers, H], `input_ids` [T],
//!   `loss_mask` [T], `cu_seqlens` [2] (and `hidden_states_scale` for fp8, `positions` for a
//!   token selection), its metadata holding every tensor's checksum;
//! - `--layout speculators`: `hs_I.safetensors` (I = the sample's index in the input, from 0)
//!   holding `hidden_states` [T, n_layers, H] and `token_ids` [T] (I64), as speculators reads them.
//!
//! Every answer is checked against its checksums on receipt (a mismatch is retried like a 5xx)
//! and written to a temporary name, synced, renamed, and only then recorded in the manifest, so a
//! restart never trusts a partial file. `--verify` re-reads every recorded file and drops the
//! lines of missing or corrupt ones from the manifest, so the next run redoes exactly those.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde_json::{json, Map, Value};
use tokio::sync::Mutex;

use crate::cli::{BulkArgs, BulkLayout, BulkTokens};
use crate::codec::{verify_checksums, xxh64_hex, CHECKSUM_ALGORITHM};
use crate::engine::{LayerRef, OutDType, FINAL_PRENORM};

const SHARD_SIZE: usize = 1000;

/// One line of the input file.
struct Sample {
    /// Index among the input's non-empty lines, from 0.
    index: usize,
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
        out.push(Sample { index: out.len(), id, input: v });
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
    url: String,
    /// The request body without its inputs.
    body: Value,
    layout: BulkLayout,
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

async fn fetch(client: &reqwest::Client, a: &BulkArgs, sh: &Shared, s: &Sample) -> Attempt<bytes::Bytes> {
    let mut body = sh.body.clone();
    body["inputs"] = json!([s.input]);
    let mut req = client.post(&sh.url).header("accept-encoding", "zstd").json(&body);
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

/// A sample's file, ready to write.
struct Prepared {
    bytes: Vec<u8>,
    /// Tensor name → xxh64 of its bytes in `bytes`.
    checksums: Map<String, Value>,
    rows: usize,
}

/// The metadata of a safetensors file (empty when it has none).
fn metadata(file: &[u8]) -> Result<std::collections::HashMap<String, String>, String> {
    let (_, meta) = SafeTensors::read_metadata(file).map_err(|e| format!("not a safetensors file: {e}"))?;
    Ok(meta.metadata().clone().unwrap_or_default())
}

/// Checks an answer against its checksums and turns it into the file `layout` asks for. A
/// checksum mismatch (or an answer too damaged to read) is worth retrying; an answer without
/// checksums is not.
fn prepare(answer: &[u8], layout: BulkLayout) -> Attempt<Prepared> {
    if let Err(e) = verify_checksums(answer) {
        if metadata(answer).is_ok_and(|m| !m.contains_key("checksum_algorithm")) {
            return Err((false, "the answer carries no checksums (is the server older than this client?)".into()));
        }
        return Err((true, format!("the answer failed its checksum check ({e})")));
    }
    let st = SafeTensors::deserialize(answer).map_err(|e| (false, format!("the answer is not safetensors: {e}")))?;
    let ids = st.tensor("input_ids").map_err(|e| (false, format!("the answer has no input_ids: {e}")))?;
    let rows = ids.shape().first().copied().unwrap_or(0);
    match layout {
        BulkLayout::Plain => {
            let checksums = metadata(answer)
                .ok()
                .and_then(|m| serde_json::from_str::<Map<String, Value>>(m.get("checksums")?).ok())
                .unwrap_or_default();
            Ok(Prepared { bytes: answer.to_vec(), checksums, rows })
        }
        BulkLayout::Speculators => speculators_file(answer, &st).map_err(|e| (false, e)),
    }
}

/// The file speculators' trainers read for one sample, made from its answer (all rows).
///
/// Checked against vllm-project/speculators: `FileTransfer.get_cached` in
/// `hs_connectors/src/hs_connectors/transfer.py` loads `<hidden states path>/hs_{file_idx}.safetensors`
/// with `safetensors.torch.load_file`, where `file_idx` is the sample's row in the dataset
/// (`ArrowDataset._map_to_file_idx`, `src/speculators/train/data.py`), and the path defaults to
/// `<data path>/hidden_states` (or `--hidden-states-path`). `ArrowDataset._get_raw_data` reads
/// exactly two tensors: `hidden_states` [seq_len, num_layers, hidden_size] (slot -1 is the
/// verifier's last state, the others are flattened to the draft's input) and `token_ids` [seq_len],
/// which must `torch.equal` the dataset's `input_ids` (int64) or the sample is dropped; the loss
/// mask and positions come from the dataset, not the file. `CollateFn` casts `hidden_states` to the
/// training dtype, so F32, BF16 and F16 all load; fp8 would be cast without its scales, so the
/// layout refuses it. The metadata (checksums) is ignored by `load_file`.
fn speculators_file(answer: &[u8], st: &SafeTensors) -> Result<Prepared, String> {
    let hs = st.tensor("hidden_states").map_err(|e| format!("the answer has no hidden_states: {e}"))?;
    let ids = st.tensor("input_ids").map_err(|e| format!("the answer has no input_ids: {e}"))?;
    if !matches!(hs.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16) {
        return Err(format!("speculators reads float32, bfloat16 or float16 hidden states, not {:?}", hs.dtype()));
    }
    let shape = hs.shape();
    if shape.len() != 3 || ids.dtype() != Dtype::I64 || ids.shape() != [shape[0]] {
        return Err(format!(
            "the answer's hidden_states {:?} and input_ids {:?} ({:?}) do not match",
            shape,
            ids.shape(),
            ids.dtype()
        ));
    }
    if st.tensor("positions").is_ok() {
        return Err("the answer holds a selection of rows; speculators needs every token".into());
    }
    let mut checksums = Map::new();
    checksums.insert("hidden_states".into(), xxh64_hex([hs.data()]).into());
    checksums.insert("token_ids".into(), xxh64_hex([ids.data()]).into());
    let mut meta = metadata(answer)?;
    meta.insert("format".into(), "speculators".into());
    meta.insert("checksum_algorithm".into(), CHECKSUM_ALGORITHM.into());
    meta.insert("checksums".into(), Value::Object(checksums.clone()).to_string());
    let rows = shape[0];
    let tensors = [("hidden_states", hs), ("token_ids", ids)];
    let bytes = safetensors::tensor::serialize(tensors, Some(meta)).map_err(|e| format!("writing the file: {e}"))?;
    Ok(Prepared { bytes, checksums, rows })
}

/// Where a sample's file goes, relative to `--out`.
fn relative_path(layout: BulkLayout, s: &Sample) -> PathBuf {
    match layout {
        BulkLayout::Plain => PathBuf::from(format!("shard-{:05}", s.index / SHARD_SIZE))
            .join(format!("{}.safetensors", file_stem(&s.id))),
        BulkLayout::Speculators => PathBuf::from(format!("hs_{}.safetensors", s.index)),
    }
}

async fn process(client: &reqwest::Client, a: &BulkArgs, sh: &Shared, s: &Sample) -> Outcome {
    let mut delay = Duration::from_millis(500);
    let mut attempt = 0;
    let prepared = loop {
        if sh.stop.is_cancelled() {
            return Outcome::Stopped;
        }
        let r = match fetch(client, a, sh, s).await {
            Ok(answer) => {
                let layout = sh.layout;
                tokio::task::spawn_blocking(move || prepare(&answer, layout))
                    .await
                    .unwrap_or_else(|e| Err((false, format!("checking the answer: {e}"))))
            }
            Err(e) => Err(e),
        };
        match r {
            Ok(p) => break p,
            Err((retry, msg)) => {
                attempt += 1;
                if !retry {
                    return Outcome::Failed(msg);
                }
                if attempt > a.retries {
                    return Outcome::Failed(format!("after {attempt} attempts: {msg}"));
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = sh.stop.cancelled() => return Outcome::Stopped,
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    };
    let rel = relative_path(sh.layout, s);
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
    if a.dtype.as_deref().and_then(OutDType::parse) == Some(OutDType::Float8E4M3) {
        anyhow::bail!(
            "--layout speculators cannot hold fp8: speculators' loader casts hidden_states to its training \
             dtype and has no place for the per-token scales; use --dtype bfloat16, float16 or float32"
        );
    }
    if a.tokens != BulkTokens::All {
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

/// Runs the extraction (or, with `--verify`, the check of what is already written); returns the
/// process exit code (0 all done, 1 some failed, 130 interrupted).
pub async fn run(a: BulkArgs) -> anyhow::Result<i32> {
    if a.verify {
        return tokio::task::spawn_blocking(move || verify(&a)).await?;
    }
    let server = a.server.clone().ok_or_else(|| anyhow::anyhow!("--server is required"))?;
    let input = a.input.clone().ok_or_else(|| anyhow::anyhow!("--input is required"))?;
    anyhow::ensure!(!a.layers.is_empty(), "--layers needs at least one index");
    check_layout(&a)?;
    std::fs::create_dir_all(&a.out)?;
    let samples = read_samples(&input)?;
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
    let mut body = json!({"layers": a.layers});
    if let Some(d) = &a.dtype {
        body["dtype"] = json!(d);
    }
    if let Some(t) = a.tokens.request() {
        body["tokens"] = t;
    }
    let sh = Arc::new(Shared {
        out: a.out.clone(),
        url: format!("{}/v1/hidden-states", server.trim_end_matches('/')),
        body,
        layout: a.layout,
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
                let t = sh.tokens.load(Ordering::Relaxed);
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

/// One sample recorded in the manifest, as `--verify` checks it.
struct Entry {
    /// Line number in the manifest (from 0).
    line: usize,
    id: String,
    file: Option<String>,
    xxh64: Option<String>,
}

/// Checks one recorded file: present, its whole-file xxh64 as the manifest recorded it, and each
/// tensor against the checksums in its own metadata (where it has them). Returns its size.
fn check_file(out: &Path, e: &Entry) -> Result<u64, String> {
    let file = e.file.as_deref().ok_or("the manifest line names no file")?;
    let data = match std::fs::read(out.join(file)) {
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

/// `--verify`: re-reads every file the manifest lists, reports those missing or corrupt and drops
/// their lines from the manifest. Returns 0 when all are intact, 1 otherwise.
fn verify(a: &BulkArgs) -> anyhow::Result<i32> {
    let path = a.out.join("manifest.jsonl");
    let bytes =
        std::fs::read(&path).map_err(|e| anyhow::anyhow!("nothing to verify: cannot read {}: {e}", path.display()))?;
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    let entries: Vec<Entry> = lines
        .iter()
        .enumerate()
        .filter_map(|(line, l)| {
            let v: Value = serde_json::from_slice(l).ok()?;
            let str_of = |k: &str| v[k].as_str().map(String::from);
            Some(Entry { line, id: str_of("id")?, file: str_of("file"), xxh64: str_of("xxh64") })
        })
        .collect();
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
                let r = check_file(&a.out, e);
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
            eprintln!("{}: {}: {what}", e.id, e.file.as_deref().unwrap_or("(no file)"));
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
    replace_atomically(&path, &kept).map_err(|e| anyhow::anyhow!("rewriting {}: {e}", path.display()))?;
    eprintln!(
        "verified {} files, {total} bytes ({:.1} MB) intact in {secs:.1} s; {} missing or corrupt, dropped from \
         the manifest: run the same bulk command again to extract them anew",
        entries.len() - bad.len(),
        total as f64 / 1e6,
        bad.len()
    );
    Ok(1)
}
