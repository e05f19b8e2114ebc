//! Properties and seeds: request bodies, arbitrary, mutated and well-formed, sent to the real
//! router and over its socket.

use std::collections::HashMap;
use std::path::Path;

use proptest::prelude::*;
use serde_json::{json, Value};

use crate::common::{self, FAKE_LAYERS, FAKE_VOCAB};
use crate::oracle::{check_error, check_reply};
use crate::{call, call_socket, config, corpus_files, fail_with, nasty_text};

// ---------------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------------

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
// Seeds
// ---------------------------------------------------------------------------------------------

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
