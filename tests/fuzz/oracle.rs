//! The oracle: what any answer of /v1/hidden-states or /v1/tokenize must look like, worked out
//! from the request, the tokenizer and the fake engine's values without the server's code.

use axum::http::{HeaderMap, StatusCode};
use layertap::answer::checksum::verify_checksums;
use layertap::engine::OutDType;
use layertap::tokenizer::ChatMessage;
use proptest::test_runner::TestCaseError;
use serde_json::{json, Value};

use crate::common::{self, fake_value, FAKE_HIDDEN, FAKE_LAYERS, FAKE_VOCAB};
use crate::{check, tokenizer, Reply};

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

pub(crate) fn check_error(r: &Reply) -> Result<(), TestCaseError> {
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
    check!(verify_checksums(&raw).is_ok(), "checksums do not verify");
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
pub(crate) fn check_reply(path: &str, body: &[u8], headers: &[(&str, String)], r: &Reply) -> Result<(), TestCaseError> {
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
