//! Property tests over everything layertap reads from outside: request bodies sent to the real
//! router, text and chat tokenization, the safetensors answer writer, and the bulk manifest.
//!
//! Each property runs a bounded number of cases by default (seconds in CI); `PROPTEST_CASES=N`
//! runs each one N times instead. Failures proptest finds are kept in
//! `tests/fuzz/proptest-regressions.txt` and replayed first on every run. The hand-written seed
//! corpus under `tests/fuzz/` (deep nesting, huge numbers, BOMs, invalid UTF-8, control tokens…)
//! always runs in full.

#[path = "../common/mod.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use common::{fake_value, FakeServer, FAKE_HIDDEN, FAKE_LAYERS, FAKE_VOCAB};
use layertap::answer::codec::{self, AnswerParts};
use layertap::answer::Extraction;
use layertap::engine::{HostTensor, OutDType};
use layertap::tokenizer::{ChatMessage, TextTokenizer};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use serde_json::{json, Value};
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

/// A harness of its own for the bulk properties, which read which ids the engine saw.
fn bulk_harness() -> &'static Mutex<Harness> {
    static H: OnceLock<Mutex<Harness>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(new_harness()))
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

// ---------------------------------------------------------------------------------------------
// The oracle: what any answer of /v1/hidden-states or /v1/tokenize must look like
// ---------------------------------------------------------------------------------------------

/// The error type each status carries (src/error.rs).
fn error_type_for(status: u16) -> Option<&'static str> {
    Some(match status {
        400 => "bad_request",
        401 => "unauthorized",
        404 => "not_found",
        405 => "method_not_allowed",
        413 => "too_large",
        415 => "unsupported_media_type",
        422 => "invalid_request",
        429 => "overloaded",
        503 => "unavailable",
        _ => return None,
    })
}

fn check_error(r: &Reply) -> Result<(), TestCaseError> {
    let s = r.status.as_u16();
    check!(s < 500, "server error {s}: {}", String::from_utf8_lossy(&r.body));
    check!(r.status.is_client_error(), "unexpected status {s}");
    let v: Value = serde_json::from_slice(&r.body).map_err(|e| {
        TestCaseError::fail(format!("{s} body is not JSON ({e}): {:?}", String::from_utf8_lossy(&r.body)))
    })?;
    let (err, kind) = (v["error"].as_str(), v["type"].as_str());
    check!(err.is_some_and(|e| !e.is_empty()), "{s} body has no \"error\" message: {v}");
    check!(kind.is_some(), "{s} body has no \"type\": {v}");
    check!(v.as_object().is_some_and(|o| o.len() == 2), "{s} body has keys besides error and type: {v}");
    check!(error_type_for(s) == kind, "status {s} with type {kind:?}");
    Ok(())
}

/// An input as the server must have understood it, when the request was accepted.
enum Seen {
    Ids(Vec<u32>),
    Text(String),
    Chat(Vec<ChatMessage>),
}

fn seen_inputs(req: &Value) -> Result<Vec<Seen>, TestCaseError> {
    let inputs = req["inputs"].as_array().ok_or_else(|| TestCaseError::fail("accepted without an inputs array"))?;
    inputs
        .iter()
        .map(|i| {
            if let Some(ids) = i.get("input_ids") {
                let ids = ids.as_array().ok_or_else(|| TestCaseError::fail("accepted non-array input_ids"))?;
                let ids: Option<Vec<u32>> =
                    ids.iter().map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok())).collect();
                ids.map(Seen::Ids).ok_or_else(|| TestCaseError::fail(format!("accepted input_ids {i}")))
            } else if let Some(t) = i.get("text") {
                t.as_str()
                    .map(|t| Seen::Text(t.to_string()))
                    .ok_or_else(|| TestCaseError::fail("accepted non-string text"))
            } else {
                serde_json::from_value(i["messages"].clone())
                    .map(Seen::Chat)
                    .map_err(|e| TestCaseError::fail(format!("accepted messages that do not parse: {e}")))
            }
        })
        .collect()
}

/// Ids and mask the tokenizer gives an accepted input, computed without the server.
fn expected_tokens(s: &Seen) -> (Vec<u32>, Vec<u8>) {
    let tok = tokenizer();
    match s {
        Seen::Ids(ids) => (ids.clone(), vec![1; ids.len()]),
        Seen::Text(t) => {
            let ids = tok.encode_text(t).expect("accepted text tokenizes");
            let n = ids.len();
            (ids, vec![1; n])
        }
        Seen::Chat(m) => {
            let t = tok.encode_chat(m).expect("accepted chat tokenizes");
            (t.ids, t.loss_mask)
        }
    }
}

/// A 200 of /v1/tokenize: one result per input, ids and mask of equal length, as the tokenizer
/// gives them.
fn check_tokenize_ok(req: &Value, r: &Reply) -> Result<(), TestCaseError> {
    let v: Value =
        serde_json::from_slice(&r.body).map_err(|e| TestCaseError::fail(format!("tokenize 200 not JSON: {e}")))?;
    let results = v["results"].as_array().ok_or_else(|| TestCaseError::fail("no results"))?;
    let inputs = seen_inputs(req)?;
    check!(results.len() == inputs.len(), "{} results for {} inputs", results.len(), inputs.len());
    for (k, (res, inp)) in results.iter().zip(&inputs).enumerate() {
        let ids: Vec<u32> =
            serde_json::from_value(res["input_ids"].clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mask: Vec<u8> =
            serde_json::from_value(res["loss_mask"].clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check!(!ids.is_empty() && ids.len() == mask.len(), "results[{k}]: {} ids, {} mask", ids.len(), mask.len());
        check!(ids.iter().all(|&i| (i as usize) < FAKE_VOCAB), "results[{k}]: id outside the vocabulary");
        let (want_ids, want_mask) = expected_tokens(inp);
        check!(ids == want_ids, "results[{k}]: ids {ids:?}, the tokenizer gives {want_ids:?}");
        check!(mask == want_mask, "results[{k}]: mask {mask:?}, the tokenizer gives {want_mask:?}");
    }
    Ok(())
}

/// A 200 of /v1/hidden-states: safetensors (or JSON) whose tensors agree with each other, with
/// the request, with the tokenizer and with the fake engine's values.
/// An input's ids and loss mask.
type Tokens = (Vec<u32>, Vec<u8>);

/// The positions of each input an accepted `tokens` value keeps (`None`: every position),
/// worked out here from the request alone, not with the server's code.
fn expected_positions(
    tokens: Option<&Value>,
    seqs: &[(Vec<u32>, Vec<u8>)],
) -> Result<Option<Vec<Vec<usize>>>, TestCaseError> {
    let all = |f: &dyn Fn(usize, &Tokens) -> Vec<usize>| Some(seqs.iter().enumerate().map(|(i, s)| f(i, s)).collect());
    Ok(match tokens {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) if t == "all" => None,
        Some(Value::String(t)) if t == "assistant" => all(&|_, s| (0..s.1.len()).filter(|&p| s.1[p] == 1).collect()),
        Some(Value::Object(o)) => {
            let k = o.get("last").and_then(Value::as_u64).filter(|&k| k >= 1 && o.len() == 1);
            let k = k.ok_or_else(|| TestCaseError::fail(format!("accepted tokens {o:?}")))? as usize;
            all(&|_, s| (s.0.len().saturating_sub(k)..s.0.len()).collect())
        }
        Some(Value::Array(per)) => {
            check!(per.len() == seqs.len(), "accepted {} token lists for {} inputs", per.len(), seqs.len());
            let mut out = Vec::new();
            for (i, ranges) in per.iter().enumerate() {
                let ranges = ranges.as_array().ok_or_else(|| TestCaseError::fail("accepted a non-list of ranges"))?;
                let mut ps: Vec<usize> = Vec::new();
                for r in ranges {
                    let pair: Option<(u64, u64)> =
                        r.as_array().filter(|a| a.len() == 2).and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)));
                    let (a, b) = pair.ok_or_else(|| TestCaseError::fail(format!("accepted range {r}")))?;
                    let (a, b) = (a as usize, b as usize);
                    check!(
                        a < b && b <= seqs[i].0.len(),
                        "accepted range [{a}, {b}) of a {}-token input",
                        seqs[i].0.len()
                    );
                    check!(ps.last().is_none_or(|&l| l < a), "accepted overlapping or unsorted ranges {ranges:?}");
                    ps.extend(a..b);
                }
                out.push(ps);
            }
            Some(out)
        }
        Some(other) => return Err(TestCaseError::fail(format!("accepted tokens {other}"))),
    })
}

/// A 200 of /v1/hidden-states: the shape, dtype, tokens, positions, values (bit for bit, fp8 and
/// its scales included), metadata and checksums the request asked for.
fn check_hidden_states_ok(req: &Value, headers: &[(&str, String)], r: &Reply) -> Result<(), TestCaseError> {
    let dtype = match req.get("dtype") {
        None | Some(Value::Null) => OutDType::Float32,
        Some(d) => OutDType::parse(d.as_str().ok_or_else(|| TestCaseError::fail("accepted a non-string dtype"))?)
            .ok_or_else(|| TestCaseError::fail(format!("accepted dtype {d}")))?,
    };
    let fp8 = dtype == OutDType::Float8E4M3;
    let asked = req["layers"].as_array().ok_or_else(|| TestCaseError::fail("accepted non-list layers"))?;
    let n = FAKE_LAYERS as i64;
    let mut layers: Vec<usize> = Vec::new();
    let mut labels: Vec<Value> = Vec::new();
    for l in asked {
        let idx = match l {
            Value::String(s) if s == "final_prenorm" => FAKE_LAYERS + 1,
            _ => {
                let i = l.as_i64().ok_or_else(|| TestCaseError::fail(format!("accepted layer {l}")))?;
                let r = if i < 0 { n + 1 + i } else { i };
                check!((0..=n).contains(&r), "accepted layer {i}");
                r as usize
            }
        };
        check!(!layers.contains(&idx), "accepted layer {l} twice");
        layers.push(idx);
        labels.push(if idx == FAKE_LAYERS + 1 { json!("final_prenorm") } else { json!(idx) });
    }
    check!(!layers.is_empty(), "accepted no layers");
    let inputs = seen_inputs(req)?;
    let seqs: Vec<(Vec<u32>, Vec<u8>)> = inputs.iter().map(expected_tokens).collect();
    let positions = expected_positions(req.get("tokens"), &seqs)?;
    let (mut ids, mut mask, mut cu, mut pos) = (Vec::new(), Vec::new(), vec![0i64], Vec::new());
    for (i, (si, sm)) in seqs.iter().enumerate() {
        let ps: Vec<usize> = positions.as_ref().map_or_else(|| (0..si.len()).collect(), |p| p[i].clone());
        for p in ps {
            ids.push(i64::from(si[p]));
            mask.push(sm[p]);
            pos.push(p as i64);
        }
        cu.push(ids.len() as i64);
    }
    let total = ids.len();
    check!(r.headers.get("x-tokens").and_then(|v| v.to_str().ok()) == Some(&total.to_string()), "x-tokens header");
    let width = layers.len();
    let row_of = |row: usize, k: usize| -> Vec<f32> {
        (0..FAKE_HIDDEN).map(|h| fake_value(ids[row] as u32, layers[k], h)).collect()
    };
    // The values as stored (fp8: the fp8 values themselves) and, for fp8, the scales.
    let mut want = Vec::with_capacity(total * width * FAKE_HIDDEN);
    let mut want_scale = Vec::new();
    for row in 0..total {
        for k in 0..width {
            let v = row_of(row, k);
            match dtype {
                OutDType::Float32 => want.extend(v),
                OutDType::Bfloat16 => want.extend(v.iter().map(|&x| half::bf16::from_f32(x).to_f32())),
                OutDType::Float16 => want.extend(v.iter().map(|&x| half::f16::from_f32(x).to_f32())),
                OutDType::Float8E4M3 => {
                    let (q, sc) = common::fp8_of(&v);
                    want.extend(q.iter().map(|&b| float8::F8E4M3::from_bits(b).to_f32()));
                    want_scale.push(sc);
                }
            }
        }
    }
    let json_asked =
        headers.iter().any(|(k, v)| *k == "accept" && v.split(',').any(|p| p.trim().starts_with("application/json")));
    let ctype = r.headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    if json_asked {
        check!(ctype == "application/json", "JSON asked, content-type {ctype}");
        let v: Value = serde_json::from_slice(&r.body).map_err(|e| TestCaseError::fail(format!("JSON answer: {e}")))?;
        check!(v["shape"] == json!([total, width, FAKE_HIDDEN]), "shape {}", v["shape"]);
        check!(v["dtype"] == dtype.name(), "dtype {}", v["dtype"]);
        check!(v["input_ids"] == json!(ids), "input_ids");
        check!(v["cu_seqlens"] == json!(cu), "cu_seqlens");
        check!(v["loss_mask"] == json!(mask), "loss_mask");
        check!(
            v.get("positions") == positions.as_ref().map(|_| json!(pos)).as_ref(),
            "positions {:?}",
            v.get("positions")
        );
        let scales: Option<Vec<f32>> = v.get("hidden_states_scale").map(|a| {
            a.as_array().map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect()).unwrap_or_default()
        });
        check!(scales == fp8.then(|| want_scale.clone()), "scales {scales:?}");
        let hs = v["hidden_states"].as_array().ok_or_else(|| TestCaseError::fail("no hidden_states"))?;
        check!(hs.len() == want.len(), "{} values", hs.len());
        for (i, x) in hs.iter().enumerate() {
            check!(x.as_f64().map(|x| x as f32) == Some(want[i]), "value {i}: {x}");
        }
        return Ok(());
    }
    check!(ctype == "application/octet-stream", "content-type {ctype}");
    let zstd = r.headers.get("content-encoding").is_some_and(|v| v == "zstd");
    let identity = headers.iter().any(|(k, v)| {
        *k == "accept-encoding"
            && !layertap::http::hidden_states::wants_zstd(&{
                let mut h = HeaderMap::new();
                if let Ok(v) = v.parse() {
                    h.insert("accept-encoding", v);
                }
                h
            })
    });
    check!(zstd != identity, "content-encoding zstd={zstd} for accept-encoding {headers:?}");
    let raw = if zstd {
        zstd::stream::decode_all(&r.body[..]).map_err(|e| TestCaseError::fail(format!("bad zstd: {e}")))?
    } else {
        r.body.to_vec()
    };
    let st = safetensors::SafeTensors::deserialize(&raw)
        .map_err(|e| TestCaseError::fail(format!("not safetensors: {e}")))?;
    let mut names = st.names();
    names.sort();
    let mut want_names = vec!["cu_seqlens", "hidden_states", "input_ids", "loss_mask"];
    if fp8 {
        want_names.push("hidden_states_scale");
    }
    if positions.is_some() {
        want_names.push("positions");
    }
    want_names.sort();
    check!(names == want_names, "tensors {names:?}");
    check!(codec::verify_checksums(&raw).is_ok(), "checksums do not verify");
    let (map, _) = common::read_safetensors_bytes(&raw);
    let hs = &map["hidden_states"];
    check!(hs.shape == [total, width, FAKE_HIDDEN], "hidden_states shape {:?}", hs.shape);
    let st_dtype = st.tensor("hidden_states").unwrap().dtype();
    let want_dtype = match dtype {
        OutDType::Float32 => safetensors::Dtype::F32,
        OutDType::Bfloat16 => safetensors::Dtype::BF16,
        OutDType::Float16 => safetensors::Dtype::F16,
        OutDType::Float8E4M3 => safetensors::Dtype::F8_E4M3,
    };
    check!(st_dtype == want_dtype, "hidden_states dtype {st_dtype:?}, asked {dtype:?}");
    check!(map["input_ids"].shape == [total] && map["input_ids"].i64 == ids, "input_ids");
    check!(map["cu_seqlens"].shape == [inputs.len() + 1] && map["cu_seqlens"].i64 == cu, "cu_seqlens");
    let m: Vec<i64> = mask.iter().map(|&x| i64::from(x)).collect();
    check!(map["loss_mask"].shape == [total] && map["loss_mask"].i64 == m, "loss_mask");
    if positions.is_some() {
        check!(map["positions"].i64 == pos, "positions {:?}", map["positions"].i64);
    }
    if fp8 {
        let sc: Vec<u32> = map["hidden_states_scale"].f32.iter().map(|x| x.to_bits()).collect();
        check!(sc == want_scale.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "scales");
    }
    for (i, x) in hs.f32.iter().enumerate() {
        check!(x.to_bits() == want[i].to_bits(), "value {i}: {x}");
    }
    let (_, meta) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    check!(meta.get("layers") == Some(&Value::from(labels).to_string()), "metadata layers {:?}", meta.get("layers"));
    check!(meta.get("dtype").map(String::as_str) == Some(dtype.name()), "metadata dtype");
    check!(meta.get("nonfinite").map(String::as_str) == Some("{}"), "metadata nonfinite {:?}", meta.get("nonfinite"));
    Ok(())
}

/// Every answer: a 4xx JSON error, or a 200 that passes the checks above. Never a 5xx.
fn check_reply(path: &str, body: &[u8], headers: &[(&str, String)], r: &Reply) -> Result<(), TestCaseError> {
    if r.status != StatusCode::OK {
        return check_error(r);
    }
    let req: Value = serde_json::from_slice(body)
        .map_err(|e| TestCaseError::fail(format!("200 for a body that is not JSON: {e}")))?;
    if path == "/v1/tokenize" {
        check_tokenize_ok(&req, r)
    } else {
        check_hidden_states_ok(&req, headers, r)
    }
}

// ---------------------------------------------------------------------------------------------
// Generators
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

fn json_id() -> impl Strategy<Value = Value> {
    prop_oneof![
        12 => (0u32..FAKE_VOCAB as u32).prop_map(|i| json!(i)),
        1 => any::<i64>().prop_map(|i| json!(i)),
        1 => prop::sample::select(vec![json!(-1), json!(FAKE_VOCAB), json!(u64::MAX), json!(1.5), json!("1"), json!(null), json!(1e300), json!([1])]),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        8 => prop::sample::select(vec!["user", "assistant", "system", "tool"]).prop_map(String::from),
        1 => nasty_text(),
    ];
    prop_oneof![
        12 => (role, nasty_text()).prop_map(|(r, c)| json!({"role": r, "content": c})),
        1 => Just(json!({"role": "user"})),
        1 => Just(json!({"role": "user", "content": null})),
        1 => Just(json!({"role": "user", "content": [{"type": "text", "text": "hi"}]})),
        1 => nasty_text().prop_map(|c| json!({"role": "user", "content": c, "name": "x"})),
        1 => Just(json!("user: hi")),
    ]
}

fn input_item() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => prop::collection::vec(json_id(), 0..12).prop_map(|ids| json!({"input_ids": ids})),
        5 => nasty_text().prop_map(|t| json!({"text": t})),
        5 => prop::collection::vec(message(), 0..5).prop_map(|m| json!({"messages": m})),
        1 => Just(json!({})),
        1 => Just(json!({"input_ids": [1], "text": "two kinds"})),
        1 => Just(json!({"input_ids": [1], "extra": true})),
        1 => Just(json!({"text": null})),
        1 => Just(json!([1, 2, 3])),
    ]
}

fn layer() -> impl Strategy<Value = Value> {
    prop_oneof![
        10 => (-7i64..7).prop_map(|l| json!(l)),
        1 => any::<i64>().prop_map(|l| json!(l)),
        1 => prop::sample::select(vec![json!(i64::MIN), json!(u64::MAX), json!(1.0), json!("1"), json!(null)]),
        2 => prop::sample::select(vec![json!("final_prenorm"), json!("final_prenorm "), json!("FINAL_PRENORM"), json!("")]),
    ]
}

/// `tokens`: the forms the API takes, near misses, and junk.
fn tokens() -> impl Strategy<Value = Option<Value>> {
    let range = prop_oneof![
        6 => (0u64..12, 1u64..12).prop_map(|(a, n)| json!([a, a + n])),
        1 => prop::sample::select(vec![json!([3, 3]), json!([4, 2]), json!([-1, 2]), json!([0]), json!([0, 1, 2]), json!(["0", 1]), json!(null)]),
    ];
    prop_oneof![
        4 => Just(None),
        1 => prop::sample::select(vec![json!("all"), json!("assistant"), json!(null)]).prop_map(Some),
        2 => prop::sample::select(vec![1i64, 2, 5, 100]).prop_map(|k| Some(json!({"last": k}))),
        1 => prop::sample::select(vec![json!({"last": 0}), json!({"last": -1}), json!({"last": 1.5}), json!({"first": 2}), json!({"last": 1, "x": 2}), json!("some"), json!(7), json!([])]).prop_map(Some),
        3 => prop::collection::vec(prop::collection::vec(range, 0..3), 0..4).prop_map(|v| Some(json!(v))),
    ]
}

fn dtype() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        3 => Just(None),
        6 => prop::sample::select(vec!["float32", "bfloat16", "float16", "f32", "bf16", "f16", "BF16", "Float16"])
            .prop_map(|d| Some(json!(d))),
        3 => prop::sample::select(vec!["fp8", "float8_e4m3fn", "F8_E4M3", "fp8 ", "float8"]).prop_map(|d| Some(json!(d))),
        1 => prop::sample::select(vec![json!("float64"), json!(""), json!(" f32"), json!(null), json!(32)]).prop_map(Some),
        1 => nasty_text().prop_map(|d| Some(json!(d))),
    ]
}

fn request_value() -> impl Strategy<Value = Value> {
    let allow =
        prop_oneof![6 => Just(None), 2 => any::<bool>().prop_map(|b| Some(json!(b))), 1 => Just(Some(json!("yes")))];
    (prop::collection::vec(input_item(), 0..4), prop::collection::vec(layer(), 0..5), dtype(), tokens(), allow, 0u8..16)
        .prop_map(|(inputs, layers, dtype, tokens, allow, shape)| {
            let mut o = serde_json::Map::new();
            if shape != 0 {
                o.insert("inputs".into(), json!(inputs));
            }
            if shape != 1 {
                o.insert("layers".into(), json!(layers));
            }
            if let Some(d) = dtype {
                o.insert("dtype".into(), d);
            }
            if let Some(t) = tokens {
                o.insert("tokens".into(), t);
            }
            if let Some(a) = allow {
                o.insert("allow_nonfinite".into(), a);
            }
            match shape {
                2 => {
                    o.insert("unknown".into(), json!(1));
                }
                3 => return json!([o]),
                4 => {
                    o.insert("inputs".into(), json!({"text": "not a list"}));
                }
                _ => {}
            }
            Value::Object(o)
        })
}

/// A byte-level edit of a serialised body.
#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
    Repeat(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), prop::sample::select(b"{}[],:\"\\0123456789-.eE \xff\xc3\x00".to_vec()))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Repeat(i, n)),
    ]
}

fn mutate(mut b: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
    for m in ms {
        if b.is_empty() {
            break;
        }
        let at = |i: usize| i % b.len();
        match *m {
            Mutation::Flip(i, x) => {
                let i = at(i);
                b[i] ^= x;
            }
            Mutation::Insert(i, x) => {
                let i = at(i);
                b.insert(i, x);
            }
            Mutation::Delete(i) => {
                let i = at(i);
                b.remove(i);
            }
            Mutation::Truncate(i) => {
                let i = at(i);
                b.truncate(i);
            }
            Mutation::Repeat(i, n) => {
                let i = at(i);
                let end = (i + n).min(b.len());
                let piece = b[i..end].to_vec();
                b.splice(i..i, piece);
            }
        }
    }
    b
}

fn request_headers() -> impl Strategy<Value = Vec<(&'static str, String)>> {
    let ctype = prop_oneof![
        12 => Just(Some("application/json")),
        1 => Just(Some("application/json; charset=utf-8")),
        1 => Just(Some("text/plain")),
        1 => Just(None),
    ];
    let accept = prop::sample::select(vec![
        None,
        None,
        None,
        Some("application/json"),
        Some("*/*"),
        Some("application/octet-stream"),
    ]);
    let enc = prop::sample::select(vec![
        None,
        Some("zstd"),
        Some("identity"),
        Some("gzip, zstd;q=0"),
        Some("*"),
        Some("zstd;q=0.5, identity"),
    ]);
    (ctype, accept, enc).prop_map(|(c, a, e)| {
        let mut h = Vec::new();
        if let Some(c) = c {
            h.push(("content-type", c.to_string()));
        }
        if let Some(a) = a {
            h.push(("accept", a.to_string()));
        }
        if let Some(e) = e {
            h.push(("accept-encoding", e.to_string()));
        }
        h
    })
}

/// Bodies the server should mostly accept: real inputs and layers, every output option (dtype,
/// fp8, token selections valid and not, the pre-norm state), so that most answers are 200s
/// whose every value is checked.
fn answer_options_request() -> impl Strategy<Value = Value> {
    let input = prop_oneof![
        3 => prop::collection::vec(0u32..FAKE_VOCAB as u32, 1..12).prop_map(|ids| json!({"input_ids": ids})),
        1 => "[a-z ]{1,24}".prop_map(|t| json!({"text": t})),
        1 => ("[a-z ]{1,12}", "[a-z ]{1,12}").prop_map(|(u, a)| json!({"messages": [
            {"role": "user", "content": u}, {"role": "assistant", "content": a}]})),
    ];
    let layer = prop_oneof![
        6 => (-(FAKE_LAYERS as i64) - 1..=FAKE_LAYERS as i64).prop_map(|l| json!(l)),
        2 => Just(json!("final_prenorm")),
    ];
    let dtype = prop::sample::select(vec![
        None,
        Some("float32"),
        Some("bf16"),
        Some("f16"),
        Some("fp8"),
        Some("float8_e4m3fn"),
    ]);
    (prop::collection::vec(input, 1..4), prop::collection::vec(layer, 1..4), dtype, tokens(), any::<bool>()).prop_map(
        |(inputs, layers, dtype, tokens, allow)| {
            let mut o = serde_json::Map::new();
            o.insert("inputs".into(), json!(inputs));
            o.insert("layers".into(), json!(layers));
            if let Some(d) = dtype {
                o.insert("dtype".into(), json!(d));
            }
            if let Some(t) = tokens {
                o.insert("tokens".into(), t);
            }
            if allow {
                o.insert("allow_nonfinite".into(), json!(true));
            }
            Value::Object(o)
        },
    )
}

// ---------------------------------------------------------------------------------------------
// Properties: requests
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(192))]

    /// Arbitrary and mutated bodies to /v1/hidden-states and /v1/tokenize: never a 5xx or a
    /// panic; every error is a JSON {"error", "type"}; every 200 is a consistent answer.
    #[test]
    fn requests_get_a_json_error_or_a_consistent_answer(
        req in request_value(),
        mutations in prop_oneof![3 => Just(vec![]), 1 => prop::collection::vec(mutation(), 1..4)],
        headers in request_headers(),
        tokenize in prop::bool::weighted(0.25),
    ) {
        let path = if tokenize { "/v1/tokenize" } else { "/v1/hidden-states" };
        let body = mutate(serde_json::to_vec(&req).unwrap(), &mutations);
        let r = call(path, &headers, body.clone());
        check_reply(path, &body, &headers, &r)?;
    }

    /// Well-formed bodies with every answer option (dtypes and fp8, token selections, the
    /// pre-norm state): each is a 4xx JSON error or an answer right to the bit, scales,
    /// positions, metadata and checksums included.
    #[test]
    fn answer_options_give_exactly_the_rows_dtypes_and_layers_asked(
        req in answer_options_request(),
        headers in request_headers(),
    ) {
        let body = serde_json::to_vec(&req).unwrap();
        let r = call("/v1/hidden-states", &headers, body.clone());
        check_reply("/v1/hidden-states", &body, &headers, &r)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Properties: tokenizer and chat template
// ---------------------------------------------------------------------------------------------

fn chat() -> impl Strategy<Value = Vec<ChatMessage>> {
    let role = prop_oneof![
        8 => prop::sample::select(vec!["user", "assistant", "system", "tool"]).prop_map(String::from),
        1 => nasty_text(),
    ];
    prop::collection::vec((role, nasty_text()).prop_map(|(role, content)| ChatMessage { role, content }), 0..6)
}

fn check_chat(m: &[ChatMessage]) -> Result<(), TestCaseError> {
    let tok = tokenizer();
    let r = tok.encode_chat(m);
    if m.is_empty() {
        check!(r.is_err(), "an empty chat was accepted");
        return Ok(());
    }
    // Roles the template does not know are refused, naming the first such message.
    if let Some(i) = m.iter().position(|x| !tok.roles().contains(&x.role)) {
        let e = match r {
            Err(layertap::tokenizer::TokenizeError::Invalid(e)) => e,
            other => return Err(TestCaseError::fail(format!("role {:?} was not refused: {other:?}", m[i].role))),
        };
        check!(e.contains(&format!("messages[{i}].role")), "the refusal names another message: {e}");
        return Ok(());
    }
    let t = r.map_err(|e| TestCaseError::fail(format!("chat refused: {e}")))?;
    check!(t.ids.len() == t.loss_mask.len(), "{} ids, {} mask", t.ids.len(), t.loss_mask.len());
    check!(t.loss_mask.iter().all(|&x| x <= 1), "mask values {:?}", t.loss_mask);
    check!(t.ids.iter().all(|&i| (i as usize) < tok.vocab_size()), "ids outside the vocabulary");
    let has_assistant = m.iter().any(|x| x.role == "assistant");
    check!(
        has_assistant == t.loss_mask.contains(&1),
        "assistant turn present: {has_assistant}, mask {:?}",
        t.loss_mask
    );
    // The ids are those of the rendered template, which holds every turn.
    let rendered = tok.render_chat(m, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let text = tok.decode(&t.ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
    check!(text == rendered, "decoded {text:?} != rendered {rendered:?}");
    for x in m {
        check!(rendered.contains(&x.content) && rendered.contains(&x.role), "a turn is missing from {rendered:?}");
    }
    // Content's control-token text as plain text: the same text, the same turns counted.
    let split = layertap::tokenizer::Budget { split_special_tokens: true, ..layertap::tokenizer::Budget::unlimited() };
    let p = tok.encode_chat_within(m, &split).map_err(|e| TestCaseError::fail(format!("split chat refused: {e}")))?;
    check!(p.ids.len() == p.loss_mask.len(), "split: {} ids, {} mask", p.ids.len(), p.loss_mask.len());
    let text = tok.decode(&p.ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
    check!(text == rendered, "split: decoded {text:?} != rendered {rendered:?}");
    check!(has_assistant == p.loss_mask.contains(&1), "split: assistant turn present: {has_assistant}");
    Ok(())
}

/// `encode_text(s)` and `/v1/tokenize {"text": s}` agree: the same ids, a mask of ones, or the
/// documented refusal when the text gives no tokens or too many.
fn check_text(s: &str) -> Result<(), TestCaseError> {
    let tok = tokenizer();
    let ids = tok.encode_text(s).map_err(|e| TestCaseError::fail(format!("text refused: {e}")))?;
    check!(tok.decode(&ids).ok().as_deref() == Some(s), "text does not round-trip: {s:?}");
    let body = serde_json::to_vec(&json!({"inputs": [{"text": s}]})).unwrap();
    let r = call("/v1/tokenize", &[("content-type", "application/json".into())], body);
    let max = common::limits().max_input_tokens;
    if ids.is_empty() || ids.len() > max {
        check!(r.status == if ids.is_empty() { 422 } else { 413 }, "{} tokens answered {}", ids.len(), r.status);
        return check_error(&r);
    }
    check!(r.status == 200, "status {} for {s:?}", r.status);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    check!(v["results"][0]["input_ids"] == json!(ids), "ids {} vs {ids:?}", v["results"][0]["input_ids"]);
    check!(v["results"][0]["loss_mask"] == json!(vec![1; ids.len()]), "mask {}", v["results"][0]["loss_mask"]);
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary roles, contents and unicode: no panic, ids and loss_mask of equal length, the
    /// mask on exactly the chats with an assistant turn, and the ids decode to the rendering.
    #[test]
    fn chats_render_and_tokenize_consistently(m in chat()) {
        check_chat(&m)?;
    }

    #[test]
    fn text_tokenizes_like_the_tokenize_route(s in nasty_text()) {
        check_text(&s)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Properties: the answer writer
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct AnswerCase {
    dtype: OutDType,
    shape: Vec<usize>,
    hs: Vec<u8>,
    cuts: Vec<usize>,
    input_ids: Vec<i64>,
    cu_seqlens: Vec<i64>,
    loss_mask: Vec<u8>,
    metadata: HashMap<String, String>,
}

fn answer_case() -> impl Strategy<Value = AnswerCase> {
    let dtype = prop::sample::select(vec![OutDType::Float32, OutDType::Bfloat16, OutDType::Float16]);
    (dtype, 0usize..6, 0usize..4, 0usize..9).prop_flat_map(|(dtype, t, l, h)| {
        let n = t * l * h * dtype.size_in_bytes();
        (
            Just(dtype),
            Just(vec![t, l, h]),
            prop::collection::vec(any::<u8>(), n),
            prop::collection::vec(0..=n, 0..4),
            prop::collection::vec(any::<i64>(), t),
            prop::collection::vec(any::<i64>(), 0..5),
            prop::collection::vec(any::<u8>(), t),
            prop::collection::hash_map(nasty_text(), nasty_text(), 0..5),
        )
            .prop_map(|(dtype, shape, hs, mut cuts, input_ids, cu_seqlens, loss_mask, metadata)| {
                cuts.sort();
                AnswerCase { dtype, shape, hs, cuts, input_ids, cu_seqlens, loss_mask, metadata }
            })
    })
}

fn check_answer_writer(c: &AnswerCase) -> Result<(), TestCaseError> {
    let mut chunks = Vec::new();
    let mut at = 0;
    for &cut in &c.cuts {
        chunks.push(&c.hs[at..cut]);
        at = cut;
    }
    chunks.push(&c.hs[at..]);
    let parts = AnswerParts {
        dtype: c.dtype,
        shape: c.shape.clone(),
        chunks,
        scale: None,
        input_ids: c.input_ids.clone(),
        cu_seqlens: c.cu_seqlens.clone(),
        loss_mask: c.loss_mask.clone(),
        positions: None,
        metadata: c.metadata.clone(),
    };
    let plain = codec::encode_answer(&parts, None).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let header = u64::from_le_bytes(plain[..8].try_into().unwrap());
    check!(header % 8 == 0, "header of {header} bytes: the data is not 8-byte aligned");
    for level in [1, 3, 19] {
        let z = codec::encode_answer(&parts, Some(level)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back = zstd::stream::decode_all(&z[..]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check!(back == plain, "zstd level {level} does not round-trip to the identity answer");
    }
    let x = Extraction {
        hidden_states: HostTensor { dtype: c.dtype, shape: c.shape.clone(), data: c.hs.clone().into() },
        hidden_states_scale: None,
        input_ids: c.input_ids.clone(),
        cu_seqlens: c.cu_seqlens.clone(),
        loss_mask: c.loss_mask.clone(),
        positions: None,
        metadata: c.metadata.clone(),
    };
    let library = x.to_safetensors().map_err(|e| TestCaseError::fail(e.to_string()))?;
    for bytes in [&plain, &library] {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| TestCaseError::fail(format!("unreadable: {e}")))?;
        let le = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let want_dtype = match c.dtype {
            OutDType::Float32 => safetensors::Dtype::F32,
            OutDType::Bfloat16 => safetensors::Dtype::BF16,
            OutDType::Float16 => safetensors::Dtype::F16,
            OutDType::Float8E4M3 => safetensors::Dtype::F8_E4M3,
        };
        let expect: [(&str, safetensors::Dtype, Vec<usize>, Vec<u8>); 4] = [
            ("hidden_states", want_dtype, c.shape.clone(), c.hs.clone()),
            ("input_ids", safetensors::Dtype::I64, vec![c.input_ids.len()], le(&c.input_ids)),
            ("cu_seqlens", safetensors::Dtype::I64, vec![c.cu_seqlens.len()], le(&c.cu_seqlens)),
            ("loss_mask", safetensors::Dtype::U8, vec![c.loss_mask.len()], c.loss_mask.clone()),
        ];
        check!(st.len() == 4, "{} tensors", st.len());
        for (name, dtype, shape, data) in expect {
            let t = st.tensor(name).map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?;
            check!(t.dtype() == dtype && t.shape() == shape && t.data() == &data[..], "{name} differs");
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
        let mut meta = meta.metadata().clone().unwrap_or_default();
        check!(codec::verify_checksums(bytes).is_ok(), "checksums do not verify");
        check!(meta.remove("checksum_algorithm").as_deref() == Some("xxh64"), "checksum algorithm");
        check!(meta.remove("checksums").is_some(), "no checksums");
        check!(meta == c.metadata, "metadata {meta:?} != {:?}", c.metadata);
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary shapes (empty ones included), dtypes, splits into pieces and metadata: the
    /// streamed writer's file reads back through the safetensors library to exactly what was
    /// written, like the library's own serialiser, and zstd at any level round-trips it.
    #[test]
    fn answers_round_trip_through_safetensors_and_zstd(c in answer_case()) {
        check_answer_writer(&c)?;
    }

    /// Pieces that do not add up to the shape are an error, never a file.
    #[test]
    fn answers_with_missing_bytes_are_refused(c in answer_case(), cut in 1usize..64) {
        let n = c.hs.len();
        prop_assume!(n > 0);
        let short = &c.hs[..n.saturating_sub(cut)];
        let parts = AnswerParts {
            dtype: c.dtype, shape: c.shape.clone(), chunks: vec![short], scale: None, input_ids: c.input_ids.clone(),
            cu_seqlens: c.cu_seqlens.clone(), loss_mask: c.loss_mask.clone(), positions: None,
            metadata: c.metadata.clone(),
        };
        prop_assert!(codec::encode_answer(&parts, None).is_err());
        prop_assert!(codec::encode_answer(&parts, Some(3)).is_err());
    }
}

// ---------------------------------------------------------------------------------------------
// Properties: the bulk manifest
// ---------------------------------------------------------------------------------------------

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

/// The ids of a manifest's complete, well-formed lines (what bulk itself writes).
fn strict_manifest_ids(bytes: &[u8]) -> Vec<String> {
    bytes
        .split(|&b| b == b'\n')
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
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
        timeout_s: 30,
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
// The seed corpus: always run
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

/// Every seed body, to both routes, in process and over the socket, with each answer format.
#[test]
fn seed_requests() {
    let header_sets: Vec<Vec<(&str, String)>> = vec![
        vec![("content-type", "application/json".into())],
        vec![("content-type", "application/json".into()), ("accept-encoding", "identity".into())],
        vec![("content-type", "application/json".into()), ("accept", "application/json".into())],
    ];
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for f in corpus_files("requests") {
        let body = std::fs::read(&f).unwrap();
        for path in ["/v1/hidden-states", "/v1/tokenize"] {
            for h in &header_sets {
                let r = call(path, h, body.clone());
                *statuses.entry(r.status.as_u16()).or_default() += 1;
                fail_with(&f, check_reply(path, &body, h, &r));
                let s = call_socket(path, h, body.clone());
                assert_eq!(s.status, r.status, "seed {}: the socket and the router disagree", f.display());
                fail_with(&f, check_reply(path, &body, h, &s));
            }
        }
    }
    // The corpus holds accepted requests as well as refused ones.
    assert!(statuses.get(&200).is_some_and(|&n| n > 0), "{statuses:?}");
    assert!(statuses.keys().any(|&s| s != 200), "{statuses:?}");
}

fn seed_texts() -> Vec<String> {
    serde_json::from_slice(&std::fs::read(corpus().join("texts.json")).unwrap()).unwrap()
}

/// Every seed string as text, as chat content and as a role, alone and in an assistant turn.
#[test]
fn seed_texts_tokenize_and_render() {
    let texts = seed_texts();
    assert!(texts.len() > 10);
    for t in &texts {
        let p = Path::new(t.as_str());
        fail_with(p, check_text(t));
        let user = ChatMessage { role: "user".into(), content: t.clone() };
        let asst = ChatMessage { role: "assistant".into(), content: t.clone() };
        let odd = ChatMessage { role: t.clone(), content: "hi".into() };
        for chat in [vec![user.clone()], vec![user.clone(), asst.clone()], vec![odd.clone(), asst], vec![odd]] {
            fail_with(p, check_chat(&chat));
        }
    }
}

/// Answers of every dtype and edge shape (nothing at all, one token, no layers).
#[test]
fn seed_answers() {
    let texts = seed_texts();
    let meta: HashMap<String, String> =
        texts.iter().enumerate().map(|(i, t)| (t.clone(), texts[(i + 1) % texts.len()].clone())).collect();
    for dtype in [OutDType::Float32, OutDType::Bfloat16, OutDType::Float16] {
        for shape in [[0, 0, 0], [0, 3, 5], [1, 1, 1], [3, 0, 2], [2, 3, 4]] {
            let n: usize = shape.iter().product::<usize>() * dtype.size_in_bytes();
            let c = AnswerCase {
                dtype,
                shape: shape.to_vec(),
                hs: (0..n).map(|i| (i * 37 % 256) as u8).collect(),
                cuts: vec![0, n / 2, n / 2, n],
                input_ids: (0..shape[0] as i64).map(|i| i64::MIN + i).collect(),
                cu_seqlens: vec![0, shape[0] as i64],
                loss_mask: (0..shape[0]).map(|i| (i % 2) as u8).collect(),
                metadata: meta.clone(),
            };
            fail_with(Path::new(&format!("{dtype:?} {shape:?}")), check_answer_writer(&c));
        }
    }
}

/// Every seed manifest: no finished sample is redone or lost.
#[test]
fn seed_manifests() {
    for f in corpus_files("manifests") {
        let bytes = std::fs::read(&f).unwrap();
        fail_with(&f, check_bulk(6, &bytes));
    }
}

/// A body nested far deeper than any parser's recursion limit is a 4xx, a body past the size
/// limit a 413, and the server keeps serving.
#[test]
fn deep_and_oversized_bodies_are_refused_and_the_server_keeps_serving() {
    let json = [("content-type", "application/json".to_string())];
    for (open, close) in [("[", "]"), ("{\"a\":", "}")] {
        let deep = format!("{{\"inputs\":{}1{}, \"layers\": [1]}}", open.repeat(100_000), close.repeat(100_000));
        let r = call("/v1/hidden-states", &json, deep.clone().into_bytes());
        assert!([400, 422].contains(&r.status.as_u16()), "{} {}", r.status, String::from_utf8_lossy(&r.body));
        fail_with(Path::new("deep nesting"), check_reply("/v1/hidden-states", deep.as_bytes(), &json, &r));
    }
    // One byte past --max-body-bytes: 413, through the router and over the socket.
    let max = common::limits().max_body_bytes;
    let mut big = br#"{"inputs":[{"text":""#.to_vec();
    big.resize(max - 3, b'a');
    big.extend(br#""}],"layers":[1]}"#);
    assert!(big.len() > max);
    for r in [call("/v1/tokenize", &json, big.clone()), call_socket("/v1/tokenize", &json, big.clone())] {
        assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
        fail_with(Path::new("oversized body"), check_error(&r).map(|_| ()));
    }
    let ok = call("/v1/hidden-states", &json, br#"{"inputs":[{"input_ids":[1]}],"layers":[1]}"#.to_vec());
    assert_eq!(ok.status, 200);
}
