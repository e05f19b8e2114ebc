//! Soak test: the real `layertap serve` binary under a minute of mixed traffic from 64
//! concurrent clients, with every answer checked.
//!
//! ```text
//! cargo run --example soak -- [--bin target/debug/layertap] [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf]
//!                             [--seconds 80] [--warmup 20] [--clients 64] [--seed N]
//! ```
//!
//! Traffic: valid requests (input_ids, text, messages; several layer sets and dtypes; zstd and
//! identity; safetensors and JSON), invalid ones (bad JSON, unknown fields, bad layers, ids out of
//! the vocabulary, not JSON), cancelled ones (the client hangs up while waiting, or halfway
//! through sending the body) and oversized ones (too many tokens, a body past the size limit).
//!
//! Fails (exit status 1) on any of: a 5xx other than 429/503 with Retry-After (those are counted
//! apart, they are allowed under overload); a 200 whose tensors differ bitwise from the answer to
//! the same request computed alone before the soak; a request the client did not cancel that got
//! no answer (reset, timeout); a status other than the one the API documents for that request;
//! memory at rest (every answer delivered, 3 s later) growing from the end of the warm-up round to
//! the end of the load round: the heap in use (`layertap_heap_in_use_bytes`, what a leak grows) by
//! 5 % or more, or resident memory (which the allocator's fragmentation moves too, by 1.8–6.3 % in
//! leak-free runs) by 10 % or more; a panic in the server's log; a server that does not stop on SIGTERM.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Server limits for the soak, small enough that oversized requests are cheap to make.
const MAX_INPUT_TOKENS: usize = 256;
const MAX_BODY_BYTES: usize = 1 << 20;
const MAX_QUEUE_TOKENS: usize = 2048;
const MAX_BATCH_TOKENS: usize = 1024;
const SHUTDOWN_TIMEOUT_S: u64 = 30;
/// A request (one that is not cancelled on purpose) that takes longer than this is a failure.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the clients' last requests may take to come back once the soak is over.
const DRAIN_CAP: Duration = Duration::from_secs(150);
/// Rest before resident memory is read at the end of a round.
const REST: Duration = Duration::from_secs(3);
const HEAP_GROWTH_LIMIT: f64 = 0.05;
const RSS_GROWTH_LIMIT: f64 = 0.10;

struct Args {
    bin: PathBuf,
    model: String,
    seconds: u64,
    warmup: u64,
    clients: usize,
    seed: u64,
}

fn parse_args() -> Args {
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let mut a = Args {
        bin: std::env::var("LAYERTAP_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from(target).join("debug/layertap")),
        model: ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
        seconds: 80,
        warmup: 20,
        clients: 64,
        seed: 0x5eed,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| die(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--bin" => a.bin = PathBuf::from(val()),
            "--model" => a.model = val(),
            "--seconds" => a.seconds = val().parse().unwrap_or_else(|_| die("--seconds: a number")),
            "--warmup" => a.warmup = val().parse().unwrap_or_else(|_| die("--warmup: a number")),
            "--clients" => a.clients = val().parse().unwrap_or_else(|_| die("--clients: a number")),
            "--seed" => a.seed = val().parse().unwrap_or_else(|_| die("--seed: a number")),
            "-h" | "--help" => {
                println!(
                    "usage: soak [--bin PATH] [--model PATH] [--seconds 80] [--warmup 20] [--clients 64] [--seed N]"
                );
                std::process::exit(0);
            }
            other => die(&format!("unknown flag {other}")),
        }
    }
    if a.warmup >= a.seconds {
        die("--warmup must be shorter than --seconds");
    }
    a
}

fn die(msg: &str) -> ! {
    eprintln!("soak: {msg}");
    std::process::exit(2);
}

/// xorshift64*: reproducible traffic without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

// ---------------------------------------------------------------------------------------------
// Answers
// ---------------------------------------------------------------------------------------------

/// The tensors of one answer, as raw little-endian bytes (hidden states also as f32, for JSON).
#[derive(Clone, PartialEq)]
struct Tensors {
    dtype: String,
    shape: Vec<usize>,
    hidden: Vec<u8>,
    hidden_f32: Vec<f32>,
    input_ids: Vec<i64>,
    cu_seqlens: Vec<i64>,
    loss_mask: Vec<u8>,
}

fn to_f32(dtype: &str, b: &[u8]) -> Vec<f32> {
    match dtype {
        "float32" => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        "bfloat16" => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    }
}

fn from_safetensors(raw: &[u8]) -> Result<Tensors, String> {
    let st = safetensors::SafeTensors::deserialize(raw).map_err(|e| format!("not safetensors: {e}"))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(raw).map_err(|e| e.to_string())?;
    let dtype = meta.metadata().as_ref().and_then(|m| m.get("dtype").cloned()).ok_or("no dtype in the metadata")?;
    let t = |n: &str| st.tensor(n).map_err(|e| format!("{n}: {e}"));
    let hs = t("hidden_states")?;
    let i64s = |b: &[u8]| b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    Ok(Tensors {
        hidden_f32: to_f32(&dtype, hs.data()),
        dtype,
        shape: hs.shape().to_vec(),
        hidden: hs.data().to_vec(),
        input_ids: i64s(t("input_ids")?.data()),
        cu_seqlens: i64s(t("cu_seqlens")?.data()),
        loss_mask: t("loss_mask")?.data().to_vec(),
    })
}

fn from_json(body: &[u8]) -> Result<Tensors, String> {
    #[derive(serde::Deserialize)]
    struct J {
        shape: Vec<usize>,
        dtype: String,
        hidden_states: Vec<f32>,
        input_ids: Vec<i64>,
        cu_seqlens: Vec<i64>,
        loss_mask: Vec<u8>,
    }
    let j: J = serde_json::from_slice(body).map_err(|e| format!("JSON answer: {e}"))?;
    Ok(Tensors {
        dtype: j.dtype,
        shape: j.shape,
        hidden: vec![],
        hidden_f32: j.hidden_states,
        input_ids: j.input_ids,
        cu_seqlens: j.cu_seqlens,
        loss_mask: j.loss_mask,
    })
}

/// Where `got` differs from `want` (None: identical, bit for bit), with the largest relative
/// difference of the hidden states, to tell corruption from rounding.
fn compare(got: &Tensors, want: &Tensors, json: bool) -> Option<String> {
    let mut diffs = Vec::new();
    for (name, same) in [
        ("dtype", got.dtype == want.dtype),
        ("shape", got.shape == want.shape),
        ("input_ids", got.input_ids == want.input_ids),
        ("cu_seqlens", got.cu_seqlens == want.cu_seqlens),
        ("loss_mask", got.loss_mask == want.loss_mask),
        ("hidden_states", if json { bits_equal(&got.hidden_f32, &want.hidden_f32) } else { got.hidden == want.hidden }),
    ] {
        if !same {
            diffs.push(name);
        }
    }
    if diffs.is_empty() {
        return None;
    }
    let (mut worst, mut n) = (0f64, 0usize);
    if got.hidden_f32.len() == want.hidden_f32.len() {
        for (a, b) in got.hidden_f32.iter().zip(&want.hidden_f32) {
            if a.to_bits() != b.to_bits() {
                n += 1;
                worst = worst.max(((a - b).abs() / b.abs().max(1e-6)) as f64);
            }
        }
    }
    Some(format!("{} differ ({n} values, worst relative difference {worst:.2e})", diffs.join(", ")))
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

// ---------------------------------------------------------------------------------------------
// Traffic
// ---------------------------------------------------------------------------------------------

struct Model {
    vocab: usize,
    layers: i64,
}

/// The valid requests of the soak; each one's answer is computed alone first.
fn valid_bodies(m: &Model, rng: &mut Rng) -> Vec<Value> {
    let mut ids = |n: usize| -> Vec<usize> { (0..n).map(|_| rng.below(m.vocab)).collect() };
    let l = m.layers;
    let chat = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? <|im_start|> is not a turn."},
        {"role": "assistant", "content": "Rome, naturally. 🍝"}
    ]);
    vec![
        json!({"inputs": [{"input_ids": ids(8)}], "layers": [1, -1]}),
        json!({"inputs": [{"input_ids": ids(40)}], "layers": [0, l / 2, l], "dtype": "bfloat16"}),
        json!({"inputs": [{"input_ids": ids(3)}, {"input_ids": ids(17)}], "layers": [-1, 2, 3], "dtype": "float16"}),
        json!({"inputs": [{"text": "The quick brown fox jumps over the lazy dog."}], "layers": [3, -2]}),
        json!({"inputs": [{"text": "Hello world"}, {"text": "Bonjour le monde, ça va ?"}], "layers": [l], "dtype": "float32"}),
        json!({"inputs": [{"messages": chat}], "layers": [2, 17, -1], "dtype": "bfloat16"}),
        json!({"inputs": [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}], "layers": [0]}),
        json!({"inputs": [{"input_ids": ids(64)}, {"text": "mixed kinds in one request"}, {"messages": chat}], "layers": [1, 8, 16, 24, -1]}),
        json!({"inputs": [{"input_ids": ids(120)}], "layers": [-1], "dtype": "f16"}),
        json!({"inputs": [{"input_ids": ids(1)}], "layers": [5]}),
        json!({"inputs": [{"text": "a longer passage of text, ".repeat(12)}], "layers": [10, 20], "dtype": "bf16"}),
        json!({"inputs": (0..6).map(|k| json!({"input_ids": ids(5 + k)})).collect::<Vec<_>>(), "layers": [-3, 1]}),
    ]
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Kind {
    Valid,
    Invalid,
    Cancelled,
    Oversized,
}

/// What one request of the soak is, and what the API says it must get.
struct Plan {
    kind: Kind,
    label: &'static str,
    body: Vec<u8>,
    content_type: &'static str,
    /// Index of the reference answer (valid requests).
    reference: Option<usize>,
    zstd: bool,
    json: bool,
    /// The documented status (valid: 200).
    expect: u16,
    /// Cancelled: hang up after this long (or halfway through the body when None).
    hang_up: Option<Duration>,
}

fn plan(rng: &mut Rng, m: &Model, valid: &[Vec<u8>]) -> Plan {
    let base = |kind, label, body: Vec<u8>, expect| Plan {
        kind,
        label,
        body,
        content_type: "application/json",
        reference: None,
        zstd: false,
        json: false,
        expect,
        hang_up: None,
    };
    let roll = rng.below(100);
    if roll < 55 {
        let r = rng.below(valid.len());
        let mut p = base(Kind::Valid, "valid", valid[r].clone(), 200);
        p.reference = Some(r);
        p.zstd = rng.below(2) == 0;
        p.json = rng.below(5) == 0;
        p.label = match (p.json, p.zstd) {
            (true, _) => "valid json",
            (false, true) => "valid safetensors zstd",
            (false, false) => "valid safetensors identity",
        };
        return p;
    }
    let ids = |n: usize, rng: &mut Rng| -> Vec<usize> { (0..n).map(|_| rng.below(m.vocab)).collect() };
    let to = |v: Value| serde_json::to_vec(&v).unwrap();
    if roll < 72 {
        return match rng.below(6) {
            0 => base(Kind::Invalid, "bad json", br#"{"inputs": [{"input_ids": [1, 2,"#.to_vec(), 400),
            1 => base(
                Kind::Invalid,
                "unknown field",
                to(json!({"inputs": [{"input_ids": [1]}], "layers": [1], "temperature": 0.7})),
                422,
            ),
            2 => {
                // Out of range, or one index named twice (-1 and L are the same index).
                let layers = if rng.below(2) == 0 {
                    json!([m.layers + 1 + rng.below(50) as i64])
                } else {
                    json!([-1, 1, m.layers])
                };
                base(Kind::Invalid, "bad layers", to(json!({"inputs": [{"input_ids": [1, 2]}], "layers": layers})), 422)
            }
            3 => {
                let mut v = ids(4, rng);
                v.push(m.vocab + rng.below(1000));
                base(
                    Kind::Invalid,
                    "id out of vocabulary",
                    to(json!({"inputs": [{"input_ids": v}], "layers": [1]})),
                    422,
                )
            }
            4 => base(
                Kind::Invalid,
                "bad dtype",
                to(json!({"inputs": [{"text": "x"}], "layers": [1], "dtype": "float64"})),
                422,
            ),
            _ => {
                let mut p =
                    base(Kind::Invalid, "not json", to(json!({"inputs": [{"input_ids": [1]}], "layers": [1]})), 415);
                p.content_type = "text/plain";
                p
            }
        };
    }
    if roll < 84 {
        let r = rng.below(valid.len());
        let mut p = base(Kind::Cancelled, "cancelled while waiting", valid[r].clone(), 200);
        if rng.below(3) == 0 {
            p.label = "cancelled mid-body";
        } else {
            p.hang_up = Some(Duration::from_millis(1 + rng.below(400) as u64));
        }
        return p;
    }
    match rng.below(3) {
        0 => base(
            Kind::Oversized,
            "too many tokens (ids)",
            to(json!({"inputs": [{"input_ids": ids(MAX_INPUT_TOKENS + 1 + rng.below(200), rng)}], "layers": [1]})),
            413,
        ),
        1 => base(
            Kind::Oversized,
            "too many tokens (text)",
            to(json!({"inputs": [{"text": "many words in a row ".repeat(80)}], "layers": [1]})),
            413,
        ),
        _ => {
            let mut body = br#"{"inputs": [{"text": ""#.to_vec();
            body.resize(MAX_BODY_BYTES + 1 + rng.below(MAX_BODY_BYTES), b'a');
            body.extend(br#""}], "layers": [1]}"#);
            base(Kind::Oversized, "body too large", body, 413)
        }
    }
}

/// What happened to one request.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Status(u16),
    /// 429 or 503 with Retry-After.
    Overloaded(u16),
    Cancelled,
    NoAnswer(String),
}

#[derive(Default)]
struct Stats {
    counts: BTreeMap<(&'static str, String), usize>,
    by_kind: BTreeMap<(Kind, String), usize>,
    violations: Vec<String>,
    checked: usize,
    latencies_ms: Vec<f64>,
}

impl Stats {
    fn violation(&mut self, v: String) {
        if self.violations.len() < 10_000 {
            self.violations.push(v);
        }
    }
}

fn outcome_name(o: &Outcome) -> String {
    match o {
        Outcome::Status(s) => s.to_string(),
        Outcome::Overloaded(s) => format!("{s}+Retry-After"),
        Outcome::Cancelled => "cancelled".into(),
        Outcome::NoAnswer(_) => "no answer".into(),
    }
}

async fn send(client: &reqwest::Client, url: &str, p: &Plan) -> Result<reqwest::Response, String> {
    let mut req = client
        .post(format!("{url}/v1/hidden-states"))
        .header("content-type", p.content_type)
        .header("accept-encoding", if p.zstd { "zstd" } else { "identity" })
        .body(p.body.clone());
    if p.json {
        req = req.header("accept", "application/json");
    }
    req.send().await.map_err(|e| format!("{e:?}"))
}

/// Sends the headers and half the body on a raw socket, then closes it.
async fn hang_up_mid_body(addr: &str, body: &[u8]) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let head = format!(
        "POST /v1/hidden-states HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.map_err(|e| e.to_string())?;
    s.write_all(&body[..body.len() / 2]).await.map_err(|e| e.to_string())?;
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(())
}

async fn run_one(client: &reqwest::Client, url: &str, addr: &str, p: &Plan, refs: &[Tensors], stats: &Mutex<Stats>) {
    let start = Instant::now();
    if p.kind == Kind::Cancelled {
        match p.hang_up {
            None => {
                if let Err(e) = hang_up_mid_body(addr, &p.body).await {
                    stats.lock().unwrap().violation(format!("{}: could not even connect: {e}", p.label));
                }
            }
            Some(d) => {
                // Hanging up early is the point; an answer that beats it is fine too.
                if let Ok(Ok(r)) = tokio::time::timeout(d, send(client, url, p)).await {
                    let _ = tokio::time::timeout(d, r.bytes()).await;
                }
            }
        }
        record(stats, p, Outcome::Cancelled);
        return;
    }
    let r = match send(client, url, p).await {
        Ok(r) => r,
        Err(e) => {
            let o = Outcome::NoAnswer(e.clone());
            stats.lock().unwrap().violation(format!("{}: no answer: {e}", p.label));
            record(stats, p, o);
            return;
        }
    };
    let status = r.status().as_u16();
    let retry_after = r.headers().contains_key("retry-after");
    let encoding = r.headers().get("content-encoding").and_then(|v| v.to_str().ok()).map(String::from);
    let body = match r.bytes().await {
        Ok(b) => b,
        Err(e) => {
            stats.lock().unwrap().violation(format!("{}: status {status} but the body broke off: {e:?}", p.label));
            record(stats, p, Outcome::NoAnswer(e.to_string()));
            return;
        }
    };
    let elapsed = start.elapsed();
    let outcome = if (status == 429 || status == 503) && retry_after {
        Outcome::Overloaded(status)
    } else {
        Outcome::Status(status)
    };
    {
        let mut s = stats.lock().unwrap();
        match &outcome {
            Outcome::Overloaded(_) => {}
            Outcome::Status(st) if *st == p.expect => {}
            Outcome::Status(st) => {
                let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
                s.violation(format!("{}: status {st}, expected {}: {text}", p.label, p.expect));
            }
            _ => {}
        }
        if status != 200 && !matches!(outcome, Outcome::Overloaded(_)) {
            let is_error_json = serde_json::from_slice::<Value>(&body)
                .ok()
                .is_some_and(|v| v["error"].is_string() && v["type"].is_string());
            if !is_error_json {
                s.violation(format!("{}: status {status} without a JSON error body", p.label));
            }
        }
    }
    if status == 200 {
        if let Some(r) = p.reference {
            let decoded = if p.json {
                from_json(&body)
            } else if encoding.as_deref() == Some("zstd") {
                layertap::answer::codec::unzstd(&body[..])
                    .map_err(|e| format!("bad zstd: {e}"))
                    .and_then(|raw| from_safetensors(&raw))
            } else {
                from_safetensors(&body)
            };
            let mut s = stats.lock().unwrap();
            s.checked += 1;
            s.latencies_ms.push(elapsed.as_secs_f64() * 1e3);
            if p.zstd != (encoding.as_deref() == Some("zstd")) && !p.json {
                s.violation(format!("{}: content-encoding {encoding:?}", p.label));
            }
            match decoded {
                Err(e) => s.violation(format!("{}: corrupted answer: {e}", p.label)),
                Ok(t) => {
                    if let Some(d) = compare(&t, &refs[r], p.json) {
                        s.violation(format!("{} (request {r}): corrupted answer: {d}", p.label));
                    }
                }
            }
        }
    }
    let overloaded = matches!(outcome, Outcome::Overloaded(_));
    record(stats, p, outcome);
    if overloaded {
        // As a client should: wait as long as Retry-After says (the server sends 1 s).
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn record(stats: &Mutex<Stats>, p: &Plan, o: Outcome) {
    let mut s = stats.lock().unwrap();
    *s.counts.entry((p.label, outcome_name(&o))).or_default() += 1;
    *s.by_kind.entry((p.kind, outcome_name(&o))).or_default() += 1;
}

// ---------------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------------

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| die(&e.to_string()))
}

/// `layertap_heap_in_use_bytes` from the server's /metrics.
async fn heap_in_use(client: &reqwest::Client, url: &str) -> Option<u64> {
    let text = client.get(format!("{url}/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("layertap_heap_in_use_bytes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn start_server(a: &Args, port: u16, log: &std::path::Path) -> Child {
    let log_file = std::fs::File::create(log).unwrap_or_else(|e| die(&format!("{}: {e}", log.display())));
    Command::new(&a.bin)
        .args(["serve", "--model", &a.model, "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--max-input-tokens", &MAX_INPUT_TOKENS.to_string()])
        .args(["--max-batch-tokens", &MAX_BATCH_TOKENS.to_string()])
        .args(["--max-queue-tokens", &MAX_QUEUE_TOKENS.to_string()])
        .args(["--max-body-bytes", &MAX_BODY_BYTES.to_string()])
        .args(["--shutdown-timeout", &SHUTDOWN_TIMEOUT_S.to_string()])
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .unwrap_or_else(|e| {
            die(&format!("cannot start {}: {e} (build it with `cargo build --bin layertap`)", a.bin.display()))
        })
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let a = parse_args();
    if !std::path::Path::new(&a.model).exists() {
        die(&format!("no model at {} (run `make model`)", a.model));
    }
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let url = format!("http://{addr}");
    let log = std::env::temp_dir().join(format!("layertap-soak-{port}.log"));
    let t0 = Instant::now();
    let mut child = start_server(&a, port, &log);
    let pid = child.id();
    let probe = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().unwrap();
    let mut ready = false;
    for _ in 0..600 {
        if let Ok(Some(st)) = child.try_wait() {
            die(&format!("the server exited at startup ({st}); log: {}", log.display()));
        }
        if probe.get(format!("{url}/ready")).send().await.is_ok_and(|r| r.status() == 200) {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if !ready {
        let _ = child.kill();
        die(&format!("the server never became ready; log: {}", log.display()));
    }
    let info: Value = probe.get(format!("{url}/v1/info")).send().await.unwrap().json().await.unwrap();
    let model =
        Model { vocab: info["vocab_size"].as_u64().unwrap() as usize, layers: info["num_layers"].as_i64().unwrap() };
    println!(
        "soak: server pid {pid} ready in {:.1} s ({}, {} layers, vocab {})",
        t0.elapsed().as_secs_f64(),
        info["model_id"],
        model.layers,
        model.vocab
    );

    // Reference answers, each request alone.
    let mut rng = Rng(a.seed | 1);
    let bodies = valid_bodies(&model, &mut rng);
    let mut refs = Vec::new();
    let solo = reqwest::Client::builder().no_proxy().timeout(CLIENT_TIMEOUT).build().unwrap();
    for (i, b) in bodies.iter().enumerate() {
        let r = solo.post(format!("{url}/v1/hidden-states")).header("accept-encoding", "identity").json(b).send().await;
        let r = r.unwrap_or_else(|e| die(&format!("reference {i}: {e}")));
        let status = r.status();
        let bytes = r.bytes().await.unwrap_or_else(|e| die(&format!("reference {i}: {e}")));
        if status != 200 {
            die(&format!("reference {i}: status {status}: {}", String::from_utf8_lossy(&bytes)));
        }
        refs.push(from_safetensors(&bytes).unwrap_or_else(|e| die(&format!("reference {i}: {e}"))));
    }
    let valid: Vec<Vec<u8>> = bodies.iter().map(|b| serde_json::to_vec(b).unwrap()).collect();
    println!(
        "soak: {} reference answers computed alone; {} clients for {} s (warm-up {} s)",
        refs.len(),
        a.clients,
        a.seconds,
        a.warmup
    );

    // The soak.
    let refs = Arc::new(refs);
    let valid = Arc::new(valid);
    let model = Arc::new(model);
    let stats = Arc::new(Mutex::new(Stats::default()));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(a.seconds);
    let rss: Arc<Mutex<Vec<(f64, u64)>>> = Arc::default();
    let sampler = {
        let rss = rss.clone();
        tokio::spawn(async move {
            while Instant::now() < deadline {
                if let Some(k) = rss_kib(pid) {
                    rss.lock().unwrap().push((start.elapsed().as_secs_f64(), k));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if let Some(k) = rss_kib(pid) {
                rss.lock().unwrap().push((start.elapsed().as_secs_f64(), k));
            }
        })
    };
    // Two rounds: the warm-up, then the load. Each ends when every client's last request is
    // answered; resident memory is compared at those two points of rest (plus a moment for the
    // server's free memory to go back), so answers in flight at one instant do not count and a
    // leak does.
    let warm_end = start + Duration::from_secs(a.warmup);
    let mut stuck = 0;
    let mut at_rest = Vec::new();
    let mut load_end = Duration::ZERO;
    let mut drained = Duration::ZERO;
    for (round, until) in [(0u64, warm_end), (1, deadline)] {
        let mut tasks = Vec::new();
        for c in 0..a.clients {
            let (refs, valid, model, stats, url, addr) =
                (refs.clone(), valid.clone(), model.clone(), stats.clone(), url.clone(), addr.clone());
            let seed = a.seed ^ (c as u64 + 1 + round * 1_000_003).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut rng = Rng(seed | 1);
            tasks.push(tokio::spawn(async move {
                let client = reqwest::Client::builder().no_proxy().timeout(CLIENT_TIMEOUT).build().unwrap();
                while Instant::now() < until {
                    let p = plan(&mut rng, &model, &valid);
                    run_one(&client, &url, &addr, &p, &refs, &stats).await;
                }
            }));
        }
        tokio::time::sleep_until(until.into()).await;
        load_end = start.elapsed();
        let drain_start = Instant::now();
        for t in tasks {
            let left = DRAIN_CAP.saturating_sub(drain_start.elapsed());
            if tokio::time::timeout(left, t).await.is_err() {
                stuck += 1;
            }
        }
        drained = drain_start.elapsed();
        tokio::time::sleep(REST).await;
        let mut v: Vec<u64> = Vec::new();
        for _ in 0..5 {
            v.extend(rss_kib(pid));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        v.sort();
        at_rest.push((v.get(v.len() / 2).copied(), heap_in_use(&probe, &url).await));
    }
    let _ = sampler.await;

    // After the soak: still healthy, then a clean stop.
    let exited_early = child.try_wait().ok().flatten();
    let healthy = probe.get(format!("{url}/health")).send().await.is_ok_and(|r| r.status() == 200);
    let rss_after_drain = rss_kib(pid);
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let stop_start = Instant::now();
    let mut exit = None;
    while stop_start.elapsed() < Duration::from_secs(SHUTDOWN_TIMEOUT_S + 15) {
        if let Ok(Some(st)) = child.try_wait() {
            exit = Some(st);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if exit.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut log_text = String::new();
    let _ = std::fs::File::open(&log).and_then(|mut f| f.read_to_string(&mut log_text));
    let panics: Vec<&str> = log_text.lines().filter(|l| l.contains("panicked")).collect();

    // Report.
    let mut s = stats.lock().unwrap();
    let rss = rss.lock().unwrap().clone();
    let ((at_warmup, heap_warmup), (at_end, heap_end)) = (at_rest[0], at_rest[1]);
    let peak = rss.iter().map(|x| x.1).max();
    if stuck > 0 {
        s.violation(format!("{stuck} clients still waiting on an answer {} s after the soak", DRAIN_CAP.as_secs()));
    }
    if !healthy {
        s.violation("/health did not answer 200 after the soak".into());
    }
    match (at_warmup, at_end) {
        (Some(w), Some(e)) if (e as f64) >= (w as f64) * (1.0 + RSS_GROWTH_LIMIT) => s.violation(format!(
            "resident memory at rest grew {:.1} % after the warm-up ({w} KiB -> {e} KiB)",
            (e as f64 / w as f64 - 1.0) * 100.0
        )),
        (Some(_), Some(_)) => {}
        _ => s.violation("resident memory could not be read".into()),
    }
    match (heap_warmup, heap_end) {
        (Some(w), Some(e)) if w > 0 && (e as f64) >= (w as f64) * (1.0 + HEAP_GROWTH_LIMIT) => s.violation(format!(
            "heap in use at rest grew {:.1} % after the warm-up ({w} B -> {e} B)",
            (e as f64 / w as f64 - 1.0) * 100.0
        )),
        (Some(_), Some(_)) => {}
        _ => s.violation("layertap_heap_in_use_bytes could not be read from /metrics".into()),
    }
    for p in panics.iter().take(5) {
        s.violation(format!("the server panicked: {p}"));
    }
    if let Some(st) = exited_early {
        s.violation(format!("the server exited by itself during the soak ({st}); see its log"));
    }
    match exit {
        Some(_) if exited_early.is_some() => {}
        Some(st) if st.success() => {}
        Some(st) => s.violation(format!("the server exited with {st} on SIGTERM")),
        None => s.violation(format!("the server did not stop within {} s of SIGTERM", SHUTDOWN_TIMEOUT_S + 15)),
    }
    let total: usize = s.counts.values().sum();
    println!(
        "\nsoak: {total} requests in {:.1} s of load, {:.1} s to drain",
        load_end.as_secs_f64(),
        drained.as_secs_f64()
    );
    println!("{:<30} {:>16} {:>8}", "request", "outcome", "count");
    for ((label, o), n) in &s.counts {
        println!("{label:<30} {o:>16} {n:>8}");
    }
    println!("\nby kind:");
    for ((k, o), n) in &s.by_kind {
        println!("  {:<12} {o:>16} {n:>8}", format!("{k:?}").to_lowercase());
    }
    let overload: usize = s.by_kind.iter().filter(|((_, o), _)| o.contains("Retry-After")).map(|(_, n)| n).sum();
    let mut lat = s.latencies_ms.clone();
    lat.sort_by(f64::total_cmp);
    println!(
        "\nanswers checked bitwise against their reference: {}; refused for overload (429/503 + Retry-After): {overload}",
        s.checked
    );
    println!("latency of valid 200s: p50 {:.0} ms, p99 {:.0} ms", percentile(&lat, 0.5), percentile(&lat, 0.99));
    let mb = |k: Option<u64>| k.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0));
    println!(
        "server RSS at rest: {} after the {} s warm-up, {} after the load; peak under load {}; {} at the stop",
        mb(at_warmup),
        a.warmup,
        mb(at_end),
        mb(peak),
        mb(rss_after_drain)
    );
    let mib = |b: Option<u64>| b.map_or("?".into(), |b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64));
    println!("server heap in use at rest: {} after the warm-up, {} after the load", mib(heap_warmup), mib(heap_end));
    println!("server stop on SIGTERM: {:?} in {:.1} s", exit, stop_start.elapsed().as_secs_f64());
    if s.violations.is_empty() {
        println!("\nsoak: PASS");
        let _ = std::fs::remove_file(&log);
        return;
    }
    let mut grouped: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for v in &s.violations {
        // Group by the text before the first digit-laden detail, keep one example.
        let key: String = v.split(':').take(2).collect::<Vec<_>>().join(":");
        let e = grouped.entry(key).or_insert((0, v.clone()));
        e.0 += 1;
    }
    println!("\nsoak: FAIL, {} violations:", s.violations.len());
    for (k, (n, example)) in grouped {
        println!("  {n:>6} x {k}\n         e.g. {}", example.chars().take(400).collect::<String>());
    }
    println!("server log: {}", log.display());
    let _ = std::io::stdout().flush();
    std::process::exit(1);
}
