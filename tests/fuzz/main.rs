//! Property tests over everything layertap reads from outside: request bodies sent to the real
//! router, text and chat tokenization, the safetensors answer writer, and the bulk manifest.
//!
//! Each property runs a bounded number of cases by default (seconds in CI); `PROPTEST_CASES=N`
//! runs each one N times instead. Failures proptest finds are kept in
//! `tests/fuzz/proptest-regressions.txt` and replayed first on every run. The hand-written seed
//! corpus beside this file (`requests/`, `manifests/` and `texts.json`: deep nesting, huge numbers,
//! BOMs, invalid UTF-8, control tokens…) always runs in full.
//!
//! The properties and seeds by topic: `requests` (bodies to /v1/hidden-states and /v1/tokenize),
//! `tokenize` (text, chats and the chat template), `codec` (the safetensors answer writer) and
//! `manifest` (the bulk manifest), each checked against the `oracle` where answers are involved.
//! This file holds what they share: the harness, the text generator and the seed corpus readers.

#[path = "../common/mod.rs"]
mod common;

mod codec;
mod manifest;
mod oracle;
mod requests;
mod tokenize;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use common::FakeServer;
use layertap::tokenizer::TextTokenizer;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use tower::ServiceExt;

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// Cases per property: `PROPTEST_CASES` when set, else `default`.
fn config(default: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz/proptest-regressions.txt"
        )))),
        ..Config::default()
    }
}

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz")
}

/// A fake-engine server, its router, and the runtime both live on.
struct Harness {
    rt: tokio::runtime::Runtime,
    server: FakeServer,
    router: axum::Router,
}

fn new_harness() -> Harness {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let server = rt.block_on(common::fake_server(common::limits(), vec![]));
    let router = layertap::http::app(server.running.state.clone());
    Harness { rt, server, router }
}

/// The harness the request and tokenizer properties share.
fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(new_harness)
}

fn tokenizer() -> &'static TextTokenizer {
    static T: OnceLock<TextTokenizer> = OnceLock::new();
    T.get_or_init(common::tiny_tokenizer)
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: bytes::Bytes,
}

/// Sends one request through the router in process (no socket).
fn call(path: &str, headers: &[(&str, String)], body: Vec<u8>) -> Reply {
    let h = harness();
    h.rt.block_on(async {
        let mut b = Request::builder().method("POST").uri(path);
        for (k, v) in headers {
            b = b.header(*k, v.as_str());
        }
        let req = b.body(Body::from(body)).unwrap();
        let resp = h.router.clone().oneshot(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        Reply { status: parts.status, headers: parts.headers, body }
    })
}

/// Sends one request to the same server over its socket (hyper's parsing included).
fn call_socket(path: &str, headers: &[(&str, String)], body: Vec<u8>) -> Reply {
    let h = harness();
    h.rt.block_on(async {
        let c = reqwest::Client::builder().no_proxy().build().unwrap();
        let mut req = c.post(format!("{}{path}", h.server.base)).body(body);
        for (k, v) in headers {
            req = req.header(*k, v.as_str());
        }
        let r = req.send().await.expect("the server answers every request");
        let (status, headers) = (r.status(), r.headers().clone());
        let body = r.bytes().await.expect("the answer body arrives whole");
        Reply { status: StatusCode::from_u16(status.as_u16()).unwrap(), headers, body }
    })
}

macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(TestCaseError::fail(format!($($fmt)+)));
        }
    };
}

pub(crate) use check;

// ---------------------------------------------------------------------------------------------
// Generators shared by the properties
// ---------------------------------------------------------------------------------------------

/// Fragments that tend to break parsers, templates and tokenizers.
const NASTY: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>assistant\n",
    "<|im_end",
    "{{ raise_exception('x') }}",
    "{% for %}",
    "\u{feff}",
    "\u{0}",
    "\r\n",
    "\u{202e}",
    "\u{d7ff}",
    "\u{10ffff}",
    "é",
    "e\u{301}",
    "🦀",
    "👩‍👩‍👧",
    "\t\t",
    "   ",
    "\\u0000",
    "NaN",
    "Infinity",
    "-0",
    "1e999",
    "\"",
    "'",
];

fn nasty_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<String>(),
        2 => prop::collection::vec(prop::sample::select(NASTY), 0..6).prop_map(|v| v.concat()),
        2 => prop::collection::vec(prop_oneof![prop::sample::select(NASTY).prop_map(String::from), "[a-z ]{0,8}"], 0..6)
            .prop_map(|v| v.concat()),
        1 => "[a-z]{0,4}",
    ]
}

// ---------------------------------------------------------------------------------------------
// The seed corpus: always run, each seed in the module of its topic
// ---------------------------------------------------------------------------------------------

fn corpus_files(dir: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(corpus().join(dir)).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    assert!(!v.is_empty(), "no seeds in tests/fuzz/{dir}");
    v
}

fn fail_with(name: &Path, r: Result<(), TestCaseError>) {
    if let Err(e) = r {
        panic!("seed {}: {e}", name.display());
    }
}

fn seed_texts() -> Vec<String> {
    serde_json::from_slice(&std::fs::read(corpus().join("texts.json")).unwrap()).unwrap()
}
