//! Never a silent wrong answer: everything an answer carries is screened as it is sent
//! (states in the answer's dtype, log-probabilities whatever layers were asked), a checkpoint
//! whose values are not finite or do not match its config is refused at load, a failed
//! self-check is told on every route with its cause, and `top_k` is bounded by the vocabulary.
//! Each test runs a real model (tiny fixtures edited to show the fault) behind a real server.

mod common;

use common::{client, error_of, fixtures, limits, post, real_server, real_server_with, wait_ready, OwnedTensor};
use layertap::cli::SelfCheckMode;
use safetensors::Dtype;
use serde_json::{json, Value};

/// f32 little-endian bytes.
fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A copy of the tiny fixture `name` (tokenizer files included) with its tensors and config
/// edited.
fn edited(name: &str, tensors: impl Fn(&mut Vec<OwnedTensor>), config: impl Fn(&mut Value)) -> tempfile::TempDir {
    let src = fixtures().join(name);
    let dir = common::edited_fixture(&src, tensors, config);
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
    }
    dir
}

/// Sets every value of tensor `name` (f32) to `value`.
fn fill(t: &mut [OwnedTensor], name: &str, value: f32) {
    let e = t.iter_mut().find(|e| e.0 == name).unwrap_or_else(|| panic!("no tensor {name}"));
    assert_eq!(e.1, Dtype::F32, "{name}");
    let n = e.3.len() / 4;
    e.3 = bytes(&vec![value; n]);
}

fn path(dir: &tempfile::TempDir) -> String {
    dir.path().to_string_lossy().into_owned()
}

async fn metric(base: &str, line_start: &str) -> Option<f64> {
    let text = client().get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn hidden_states(base: &str, body: Value) -> (u16, Vec<u8>) {
    let r = common::post_encoded(base, &body, "identity").await;
    (r.status().as_u16(), r.bytes().await.unwrap().to_vec())
}

/// A model whose final state overflows (a final-norm weight of f32::MAX: finite in the
/// checkpoint, infinite once a normalised value above 1 multiplies it) gives NaN log-probabilities. They
/// are refused when the layers asked are finite and do not include the final state, counted in
/// the metadata and the metric under "logprobs" when allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_probabilities_are_screened_whatever_layers_are_asked() {
    let dir = edited("tiny/qwen3_qknorm", |t| fill(t, "model.norm.weight", f32::MAX), |_| {});
    // The self-check compares the CPU path with itself; its reference is not finite here.
    let (_running, base) = real_server_with(&path(&dir), limits(), SelfCheckMode::Off, |e| e);
    wait_ready(&base).await;
    let body = |extra: Value| {
        let mut b = json!({"inputs": [{"input_ids": [5, 9, 17, 30]}], "layers": [1], "logprobs": {"top_k": 3}});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let (status, kind, msg) = error_of(post(&base, "/v1/hidden-states", body(json!({}))).await).await;
    assert_eq!((status, kind.as_str()), (422, "invalid_request"), "{msg}");
    assert!(msg.contains("log-probabilities are not finite") && msg.contains("inputs[0], position 0"), "{msg}");
    let (status, raw) = hidden_states(&base, body(json!({"allow_nonfinite": true}))).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&raw));
    let (t, meta) = common::read_safetensors_bytes(&raw);
    assert_eq!(serde_json::from_str::<Value>(&meta["nonfinite"]).unwrap(), json!({"logprobs": 4}));
    assert!(t["hidden_states"].f32.iter().all(|v| v.is_finite()), "layer 1 itself is finite");
    assert!(t["topk_logprobs"].f32.iter().all(|v| v.is_nan()));
    assert_eq!(metric(&base, "layertap_nonfinite_total{layer=\"logprobs\"}").await, Some(8.0));
    // The same model's first layer alone, without log-probabilities, is served.
    let (status, _) = hidden_states(&base, json!({"inputs": [{"input_ids": [5, 9]}], "layers": [1]})).await;
    assert_eq!(status, 200);
}

/// States finite in the compute dtype (f32) that overflow float16 (embeddings of 1e5) are
/// refused when asked as float16, and served as float32 and bfloat16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn states_are_screened_in_the_dtype_they_are_sent_in() {
    let dir = edited("tiny/qwen3_qknorm", |t| fill(t, "model.embed_tokens.weight", 1e5), |_| {});
    let (_running, base) = real_server(&path(&dir), limits()).await;
    let body = |dtype: &str, allow: bool| {
        json!({"inputs": [{"input_ids": [3, 4]}, {"input_ids": [5]}], "layers": [2, 0], "dtype": dtype,
               "allow_nonfinite": allow})
    };
    let (status, kind, msg) = error_of(post(&base, "/v1/hidden-states", body("float16", false)).await).await;
    assert_eq!((status, kind.as_str()), (422, "invalid_request"), "{msg}");
    // Layer 2 is asked first: the residual stream carries the embeddings' 1e5 there too.
    assert!(msg.contains("at layer 2 for inputs[0], position 0"), "{msg}");
    assert!(msg.contains("largest of the answer's dtype"), "{msg}");
    let (status, raw) = hidden_states(&base, body("float16", true)).await;
    assert_eq!(status, 200);
    let (t, meta) = common::read_safetensors_bytes(&raw);
    let counts: Value = serde_json::from_str(&meta["nonfinite"]).unwrap();
    assert_eq!(counts, json!({"0": 3, "2": 3}));
    assert!(t["hidden_states"].f32.iter().any(|v| v.is_infinite()));
    assert_eq!(metric(&base, "layertap_nonfinite_total{layer=\"0\"}").await, Some(6.0));
    for dtype in ["float32", "bfloat16"] {
        let (status, raw) = hidden_states(&base, body(dtype, false)).await;
        assert_eq!(status, 200, "{dtype}: {}", String::from_utf8_lossy(&raw));
        let (t, meta) = common::read_safetensors_bytes(&raw);
        assert_eq!(meta["nonfinite"], "{}", "{dtype}");
        assert!(t["hidden_states"].f32.iter().all(|v| v.is_finite()), "{dtype}");
    }
}

/// One NaN in a weight (a q projection, an FP8 scale) is refused at load, naming the tensor; so
/// is an infinity in a bf16 tensor and a NaN in an F8_E4M3 weight.
#[test]
fn a_checkpoint_holding_a_non_finite_weight_is_refused_at_load() {
    let poison = |name: &'static str, at: usize| {
        move |t: &mut Vec<OwnedTensor>| {
            let e = t.iter_mut().find(|e| e.0 == name).unwrap_or_else(|| panic!("no tensor {name}"));
            match e.1 {
                Dtype::F32 => e.3[at * 4..at * 4 + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
                Dtype::BF16 => e.3[at * 2..at * 2 + 2].copy_from_slice(&half::bf16::INFINITY.to_le_bytes()),
                Dtype::F8_E4M3 => e.3[at] = 0x7F,
                other => panic!("{other:?}"),
            }
        }
    };
    for (model, name, at) in [
        ("tiny/qwen3_qknorm", "model.layers.1.self_attn.q_proj.weight", 77),
        ("tiny/qwen3_qknorm", "model.layers.0.self_attn.k_norm.weight", 0),
        ("fp8/qwen3_bf16_scales", "model.layers.0.self_attn.q_proj.weight_scale_inv", 0),
        ("fp8/qwen3_bf16_scales", "model.layers.0.mlp.down_proj.weight", 5),
    ] {
        let dir = common::edited_fixture(&fixtures().join(model), poison(name, at), |_| {});
        let e = common::refusal(dir.path()).unwrap_or_else(|| panic!("{model} {name}: must be refused"));
        assert!(e.contains(name) && e.contains("not finite"), "{model} {name}: {e}");
        assert!(e.contains(&format!("element {at}")), "{e}");
    }
    // The unedited fixtures load.
    for model in ["tiny/qwen3_qknorm", "fp8/qwen3_bf16_scales"] {
        assert_eq!(common::refusal(&fixtures().join(model)), None, "{model}");
    }
}

/// A checkpoint holding more decoder layers than config.json's num_hidden_layers is refused,
/// naming the extra layers; a float tensor the model does not read is refused for what it is.
#[test]
fn extra_layers_and_unknown_parameters_are_refused_for_what_they_are() {
    let src = fixtures().join("tiny/qwen3_qknorm");
    // Layer 2's tensors copied as layers 3 and 4 (the config says 3 layers).
    let dir = common::edited_fixture(
        &src,
        |t| {
            let extra: Vec<OwnedTensor> = t
                .iter()
                .filter(|e| e.0.starts_with("model.layers.2."))
                .flat_map(|e| {
                    [3, 4].map(|i| (e.0.replace("layers.2.", &format!("layers.{i}.")), e.1, e.2.clone(), e.3.clone()))
                })
                .collect();
            t.extend(extra);
        },
        |_| {},
    );
    let e = common::refusal(dir.path()).expect("extra layers must be refused");
    assert!(e.contains("decoder layers 3..=4") && e.contains("num_hidden_layers"), "{e}");
    // A bf16 tensor of a running layer that no layer reads.
    let dir = common::edited_fixture(
        &src,
        |t| t.push(("model.layers.1.mlp.extra_proj.weight".into(), Dtype::BF16, vec![4, 4], vec![0; 32])),
        |_| {},
    );
    let e = common::refusal(dir.path()).expect("an unknown parameter must be refused");
    assert!(e.contains("model.layers.1.mlp.extra_proj.weight") && e.contains("not a parameter of the model"), "{e}");
    assert!(!e.contains("reads decoder parameters stored as"), "{e}");
}

/// A model whose vocabulary (40) is smaller than --max-top-k: /v1/info offers 40, a request
/// for more is refused alone with a 4xx, and a valid small-k request batched with a large-k one
/// is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_k_is_bounded_by_the_vocabulary_and_checked_per_request() {
    const VOCAB: usize = 40;
    let dir = edited(
        "tiny/qwen2_bias_tied",
        |t| {
            let e = t.iter_mut().find(|e| e.0 == "model.embed_tokens.weight").unwrap();
            let row = e.3.len() / e.2[0];
            e.3.truncate(VOCAB * row);
            e.2[0] = VOCAB;
        },
        |c| c["vocab_size"] = json!(VOCAB),
    );
    let (_running, base) = real_server(&path(&dir), limits()).await;
    let info: Value = client().get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["max_top_k"], json!(VOCAB), "{info}");
    let ask = |k: usize| json!({"inputs": [{"input_ids": [1, 2, 3]}], "layers": [1], "logprobs": {"top_k": k}});
    let (status, _, msg) = error_of(post(&base, "/v1/hidden-states", ask(50)).await).await;
    assert_eq!(status, 422, "{msg}");
    assert!(msg.contains("between 1 and 40") && msg.contains("vocabulary"), "{msg}");
    // Many at once, so that some share a batch: every one is answered.
    let reqs = (0..16).map(|i| {
        let base = base.clone();
        let k = if i % 2 == 0 { 2 } else { VOCAB };
        tokio::spawn(async move { (k, hidden_states(&base, ask(k)).await) })
    });
    for r in futures::future::join_all(reqs).await {
        let (k, (status, raw)) = r.unwrap();
        assert_eq!(status, 200, "top_k {k}: {}", String::from_utf8_lossy(&raw));
        let (t, _) = common::read_safetensors_bytes(&raw);
        assert_eq!(t["topk_ids"].shape, vec![3, k]);
    }
}

/// A self-check that fails because the checkpoint's own values overflow: the hidden-states route
/// answers 503 selfcheck_failed without Retry-After, naming the cause, and /ready and /v1/info
/// say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_self_check_is_told_on_every_route_with_its_cause() {
    // The first layer's input norm overflows: the probe's states are not finite from index 1 on.
    let dir = edited("tiny/qwen3_qknorm", |t| fill(t, "model.layers.0.input_layernorm.weight", f32::MAX), |_| {});
    let (_running, base) = real_server_with(&path(&dir), limits(), SelfCheckMode::Enforce, |e| e);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let ready = loop {
        let r = client().get(format!("{base}/ready")).send().await.unwrap();
        let v: Value = r.json().await.unwrap();
        if v["status"] == "selfcheck_failed" || std::time::Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(ready["status"], "selfcheck_failed", "{ready}");
    assert!(ready["error"].as_str().unwrap_or("").contains("checkpoint's own values are not finite"), "{ready}");
    let r = post(&base, "/v1/hidden-states", json!({"inputs": [{"input_ids": [1, 2]}], "layers": [1]})).await;
    assert!(r.headers().get("retry-after").is_none(), "no Retry-After: waiting does not help");
    let (status, kind, msg) = error_of(r).await;
    assert_eq!((status, kind.as_str()), (503, "selfcheck_failed"), "{msg}");
    assert!(msg.contains("checkpoint's own values are not finite") && msg.contains("index"), "{msg}");
    let info: Value = client().get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["selfcheck"]["passed"], json!(false), "{info}");
    assert!(info["selfcheck"]["error"].as_str().unwrap_or("").contains("checkpoint's own values"), "{info}");
    // Tokenizing needs no model values: it is still served.
    let r = post(&base, "/v1/tokenize", json!({"inputs": [{"text": "hi"}]})).await;
    assert_eq!(r.status(), 200);
}

/// `logprobs.target` with a selection that returns no row says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_with_no_returned_row_is_refused_for_that_reason() {
    let (_running, base) = real_server("tiny/qwen3_qknorm", limits()).await;
    let body = |tokens: Value| {
        json!({"inputs": [{"input_ids": [1, 2, 3]}], "layers": [1], "tokens": tokens,
               "logprobs": {"top_k": 2, "target": true}})
    };
    let (status, _, msg) = error_of(post(&base, "/v1/hidden-states", body(json!([[]]))).await).await;
    assert_eq!(status, 422);
    assert!(msg.contains("returns no row at all") && !msg.contains("each is the last token"), "{msg}");
    let (status, _, msg) = error_of(post(&base, "/v1/hidden-states", body(json!({"last": 1}))).await).await;
    assert_eq!(status, 422);
    assert!(msg.contains("each is the last token of its input"), "{msg}");
}

/// `layertap extract` refuses states that are not finite as written (here: float16 output of
/// states past its range) unless --allow-nonfinite, records them in the file's metadata, and
/// names final_prenorm by name in its summary.
#[test]
fn extract_screens_what_it_writes() {
    let dir = edited("tiny/qwen3_qknorm", |t| fill(t, "model.embed_tokens.weight", 1e5), |_| {});
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("x.safetensors");
    let run = |extra: &[&str]| {
        let mut args = vec!["extract", "--model", dir.path().to_str().unwrap(), "--layers", "0,final_prenorm"];
        args.extend_from_slice(&["--input-ids", "1,2,3", "--out", file.to_str().unwrap()]);
        args.extend_from_slice(extra);
        std::process::Command::new(env!("CARGO_BIN_EXE_layertap")).args(&args).output().unwrap()
    };
    let o = run(&["--out-dtype", "float16"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("non-finite") && err.contains("--allow-nonfinite"), "{err}");
    assert!(!file.exists(), "nothing written");
    let o = run(&["--out-dtype", "float16", "--allow-nonfinite"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let raw = std::fs::read(&file).unwrap();
    let (_, meta) = common::read_safetensors_bytes(&raw);
    assert_eq!(serde_json::from_str::<Value>(&meta["nonfinite"]).unwrap(), json!({"0": 3, "final_prenorm": 3}));
    let o = run(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("[0,\"final_prenorm\"]"), "{err}");
    let (_, meta) = common::read_safetensors_bytes(&std::fs::read(&file).unwrap());
    assert_eq!(meta["nonfinite"], "{}");
}

/// LAYERTAP_SYNTHETIC_WEIGHTS takes the usual boolean spellings: 1 is read as true (and the
/// folder, which has no manifest, is then refused for that), "off" as false.
#[test]
fn boolean_variables_take_the_usual_spellings() {
    let model = fixtures().join("tiny/qwen3_qknorm");
    let run = |value: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_layertap"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "1", "--host", "256.0.0.1"])
            .env("LAYERTAP_SYNTHETIC_WEIGHTS", value)
            .output()
            .unwrap()
    };
    for on in ["1", "yes", "TRUE", "on"] {
        let o = run(on);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("synthetic-weights.json"), "{on}: {err}");
    }
    for off in ["0", "no", "false", "off"] {
        let o = run(off);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("synthetic-weights.json") && !err.contains("invalid value"), "{off}: {err}");
    }
}
