//! Next-token log-probabilities (`logprobs`): for every family fixture and the default GGUF
//! model, the engine's top-k ids, their log-probabilities and the target log-probabilities equal
//! Hugging Face transformers' `log_softmax(model(ids).logits.float())` (references from
//! scripts/make_logprob_references.py), rows picked as an answer's selection picks them.

mod common;

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use common::{fixture_models, fixtures, read_safetensors, Read};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, LogprobRows, ModelEngine, Rows};

/// The largest absolute difference allowed between a log-probability and the reference's, for
/// the output head, log-softmax and top-k alone (on the reference's own final state).
const TOLERANCE: f32 = 1e-5;

/// End to end, the states' own differences from transformers come through: the tiny fixtures'
/// states are within 1e-5 relative (norm-wise) of transformers, and their log-probabilities,
/// amplified by the head, within 3.5e-5 (the deep hybrid; the dense families within 3.4e-6).
const TINY_END_TO_END: f32 = 5e-5;

/// The default model's logits reach 33 over a 576-wide state, where f32 sums are only good to
/// a few 1e-5: transformers' own f32 log-probabilities are 3.7e-5 from a float64 run of the same
/// head on the same state, and ours, on that state, 4.9e-5 from transformers'. Its states are
/// within 1e-4 relative of transformers (tests/smollm2.rs); its log-probabilities end to end within
/// 7.8e-5. Both are checked against 1e-4.
const DEFAULT_MODEL: f32 = 1e-4;

fn default_model() -> PathBuf {
    std::env::var("LAYERTAP_DEFAULT_MODEL").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    })
}

/// What one model's engine gives against its reference: the largest absolute error of the
/// top-k and of the target log-probabilities, and how many ranks hold another id where the
/// reference has a near tie (two log-probabilities within the tolerance).
#[derive(Debug, Default)]
struct Figures {
    /// The head alone, on the reference's final state: top-k and target log-probabilities.
    head: f32,
    topk: f32,
    target: f32,
    swapped_near_ties: usize,
    rows: usize,
}

fn check(model: &Path, reference: &Path) -> Figures {
    let files = ModelFiles::locate(&model.to_string_lossy()).unwrap();
    let n = files.config().num_hidden_layers;
    let mut engine = files.load(&Device::Cpu, DType::F32).unwrap().engine;
    let r = read_safetensors(reference);
    let mut names: Vec<&str> = r.keys().filter_map(|k| k.strip_suffix(".topk_ids")).collect();
    names.sort();
    assert!(!names.is_empty(), "{}: no sequences", reference.display());
    let mut f = Figures::default();
    for name in names {
        let get = |what: &str| -> &Read { &r[&format!("{name}.{what}")] };
        let ids: Vec<u32> = get("input_ids").i64.iter().map(|&x| x as u32).collect();
        let positions: Vec<u32> = get("positions").i64.iter().map(|&x| x as u32).collect();
        let k = get("topk_ids").shape[1];
        // A second sequence packed after it: its rows must not change the first's.
        let other: Vec<u32> = ids.iter().rev().copied().collect();
        let mut batch = Batch::pack([&ids[..], &other[..]], [n]);
        batch.output.logprobs = Some(LogprobRows { rows: Rows::Only(positions.clone()), top_k: k });
        let taps = engine.forward(&batch).unwrap();
        let lp = taps.logprobs.expect("log-probabilities");
        let (got_ids, got_lp, got_t) = lp.slice(0, positions.len(), k).unwrap();
        let (want_ids, want_lp, want_t) =
            (&get("topk_ids").i64, &get("topk_logprobs").f32, &get("target_logprobs").f32);
        for row in 0..positions.len() {
            for j in 0..k {
                let at = row * k + j;
                let err = (got_lp[at] - want_lp[at]).abs();
                f.topk = f.topk.max(err);
                if got_ids[at] != want_ids[at] {
                    let near = |o: usize| o < k && (want_lp[row * k + o] - want_lp[at]).abs() <= TOLERANCE;
                    // The last rank may hold an id past the reference's k (a near tie at the cut).
                    let tie = j + 1 == k || near(j + 1) || (j > 0 && near(j - 1));
                    assert!(
                        tie,
                        "{} {name} position {}: rank {j} is id {} ({}), transformers says {} ({})",
                        model.display(),
                        positions[row],
                        got_ids[at],
                        got_lp[at],
                        want_ids[at],
                        want_lp[at]
                    );
                    f.swapped_near_ties += 1;
                }
            }
            let (g, w) = (got_t[row], want_t[row]);
            if w.is_nan() {
                assert!(g.is_nan(), "{name} position {}: the last token has no target, got {g}", positions[row]);
                assert_eq!(positions[row] as usize + 1, ids.len());
            } else {
                f.target = f.target.max((g - w).abs());
            }
            f.rows += 1;
        }
        // The head alone, on the final state transformers computed.
        let fs = get("final_state");
        let state = Tensor::from_vec(fs.f32.clone(), (fs.shape[0], fs.shape[1]), &Device::Cpu).unwrap();
        let targets: Vec<i32> = positions.iter().map(|&p| ids.get(p as usize + 1).map_or(-1, |&t| t as i32)).collect();
        let head = layertap::engine::logprobs::top_k(&state, engine.decoder.head().unwrap(), k, &targets).unwrap();
        let head = head.to_host().unwrap();
        for (a, b) in head.logprobs.iter().chain(&head.target).zip(want_lp.iter().chain(want_t)) {
            if !b.is_nan() {
                f.head = f.head.max((a - b).abs());
            }
        }
    }
    f
}

#[test]
fn every_family_matches_transformers() {
    let dirs: Vec<PathBuf> =
        fixture_models().into_iter().filter(|d| d.join("logprobs.safetensors").is_file()).collect();
    assert_eq!(dirs.len(), fixture_models().len(), "every fixture has log-probability references");
    let mut worst = Vec::new();
    for dir in dirs {
        let f = check(&dir, &dir.join("logprobs.safetensors"));
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        eprintln!("{name}: {f:?}");
        worst.push((name, f));
    }
    for (name, f) in worst {
        assert!(f.head <= TOLERANCE, "{name}: the head alone {f:?}");
        assert!(f.topk <= TINY_END_TO_END && f.target <= TINY_END_TO_END, "{name}: {f:?}");
    }
}

#[test]
fn the_default_model_matches_transformers() {
    let model = default_model();
    assert!(model.is_file(), "{} is missing: run `make model`", model.display());
    let f = check(&model, &fixtures().join("smollm2/logprobs.safetensors"));
    eprintln!("SmolLM2-135M-Instruct Q4_1: {f:?}");
    assert!(f.head <= DEFAULT_MODEL, "the head alone: {f:?}");
    assert!(f.topk <= DEFAULT_MODEL && f.target <= DEFAULT_MODEL, "{f:?}");
}

/// Log-probabilities of a few rows come out the same whatever else the batch holds or asks:
/// every row, hidden states or none, a larger k (its first entries).
#[test]
fn rows_are_the_same_in_any_batch() {
    let dir = fixtures().join("tiny/llama_gqa_rope3");
    let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
    let n = files.config().num_hidden_layers;
    let mut engine = files.load(&Device::Cpu, DType::F32).unwrap().engine;
    let a: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 500).collect();
    let b: Vec<u32> = (0..9).map(|i| (i * 11 + 3) % 500).collect();
    let run = |engine: &mut ModelEngine, layers: Vec<usize>, rows: Rows, k: usize| {
        let mut batch = Batch::pack([&a[..], &b[..]], layers);
        batch.output.logprobs = Some(LogprobRows { rows, top_k: k });
        engine.forward(&batch).unwrap().logprobs.unwrap()
    };
    let all = run(&mut engine, vec![2, n], Rows::All, 8);
    assert_eq!(all.rows(), 29);
    let some = run(&mut engine, vec![], Rows::Only(vec![3, 19, 20, 28]), 3);
    let (ids, lps, t) = some.slice(0, 4, 3).unwrap();
    for (i, &row) in [3usize, 19, 20, 28].iter().enumerate() {
        let (wi, wl, wt) = all.slice(row, 1, 3).unwrap();
        assert_eq!(&ids[i * 3..i * 3 + 3], &wi[..]);
        assert_eq!(&lps[i * 3..i * 3 + 3], &wl[..], "row {row}");
        assert_eq!(t[i].to_bits(), wt[0].to_bits(), "row {row}");
    }
    // The last row of each sequence has no next token.
    assert!(t[1].is_nan() && t[3].is_nan() && !t[0].is_nan() && !t[2].is_nan());
    // Log-probabilities are sorted and each row's distribution sums to at most 1.
    for row in 0..29 {
        let (_, l, _) = all.slice(row, 1, 8).unwrap();
        assert!(l.windows(2).all(|w| w[0] >= w[1]));
        assert!(l.iter().map(|x| x.exp()).sum::<f32>() <= 1.0 + 1e-5);
    }
}

mod http {
    use super::common::{
        edited_fixture, error_of, fixtures, limits, read_safetensors_bytes, real_server, unzstd, Read,
    };
    use layertap::answer::checksum::verify_checksums;
    use serde_json::{json, Value};
    use std::collections::HashMap;

    async fn answer(base: &str, body: Value) -> (HashMap<String, Read>, HashMap<String, String>) {
        let r = reqwest::Client::new().post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        let raw = unzstd(&r.bytes().await.unwrap());
        verify_checksums(&raw).unwrap();
        read_safetensors_bytes(&raw)
    }

    async fn refused(base: &str, body: Value) -> String {
        let r = reqwest::Client::new().post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
        let (status, kind, message) = error_of(r).await;
        assert_eq!((status, kind.as_str()), (422, "invalid_request"), "{message}");
        message
    }

    fn rows_of(t: &Read, rows: &[usize]) -> Vec<u32> {
        let w = t.shape.get(1).copied().unwrap_or(1);
        let v: Vec<u32> = if t.f32.is_empty() {
            t.i64.iter().map(|&x| x as u32).collect()
        } else {
            t.f32.iter().map(|x| x.to_bits()).collect()
        };
        rows.iter().flat_map(|&r| v[r * w..(r + 1) * w].to_vec()).collect()
    }

    /// The answer carries the tensors, shaped by the rows it returns, checksummed; every token
    /// selection and `layers: []` give the same rows' values, bitwise; JSON carries the same.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_hold_the_logprobs_of_their_rows() {
        let (running, base) = real_server("tiny/llama_headdim_bias_tied", limits()).await;
        let info: Value = reqwest::get(format!("{base}/v1/info")).await.unwrap().json().await.unwrap();
        assert_eq!((info["max_top_k"].as_u64(), info["lm_head"].as_bool()), (Some(64), Some(true)));
        let a: Vec<i64> = (0..12).map(|i| (i * 41 + 7) % 500).collect();
        let b: Vec<i64> = vec![3, 99, 250];
        let inputs = json!([{"input_ids": a}, {"input_ids": b}]);
        let lp = json!({"top_k": 5, "target": true});
        let (all, meta) = answer(&base, json!({"inputs": inputs, "layers": [-1], "logprobs": lp})).await;
        assert_eq!(all["topk_ids"].shape, vec![15, 5]);
        assert_eq!(all["topk_logprobs"].shape, vec![15, 5]);
        assert_eq!(all["target_logprobs"].shape, vec![15]);
        assert_eq!(meta["top_k"], "5");
        let checksums: Value = serde_json::from_str(&meta["checksums"]).unwrap();
        for t in ["topk_ids", "topk_logprobs", "target_logprobs"] {
            assert!(checksums[t].is_string(), "{t} has a checksum");
        }
        let t = &all["target_logprobs"].f32;
        for (row, v) in t.iter().enumerate() {
            assert_eq!(v.is_nan(), row == 11 || row == 14, "row {row}: NaN only on each input's last token");
            assert!(v.is_nan() || *v <= 0.0);
        }
        for row in 0..15 {
            let l = &all["topk_logprobs"].f32[row * 5..row * 5 + 5];
            assert!(l.windows(2).all(|w| w[0] >= w[1]), "row {row} sorted");
            // The target's log-probability is its entry wherever it is among the top k.
            let next = if row < 11 {
                Some(a[row + 1])
            } else if (12..14).contains(&row) {
                Some(b[row - 11])
            } else {
                None
            };
            if let Some(id) = next {
                if let Some(j) = all["topk_ids"].i64[row * 5..row * 5 + 5].iter().position(|&x| x == id) {
                    assert_eq!(l[j].to_bits(), t[row].to_bits());
                }
            }
        }
        // Without target: no target_logprobs; layers [] gives the same rows, no states.
        let (bare, _) = answer(&base, json!({"inputs": inputs, "layers": [], "logprobs": {"top_k": 5}})).await;
        assert!(!bare.contains_key("target_logprobs"));
        assert_eq!(bare["hidden_states"].shape, vec![15, 0, 64]);
        for t in ["topk_ids", "topk_logprobs"] {
            assert_eq!(rows_of(&bare[t], &(0..15).collect::<Vec<_>>()), rows_of(&all[t], &(0..15).collect::<Vec<_>>()));
        }
        // A smaller k is the first entries of a larger one.
        let (k2, _) = answer(&base, json!({"inputs": inputs, "layers": [0], "logprobs": {"top_k": 2}})).await;
        assert_eq!(k2["topk_ids"].shape, vec![15, 2]);
        for row in 0..15 {
            assert_eq!(k2["topk_ids"].i64[row * 2..row * 2 + 2], all["topk_ids"].i64[row * 5..row * 5 + 2]);
        }
        // Selections: the rows they name, bitwise.
        for (tokens, rows) in [
            (json!({"last": 2}), vec![10, 11, 13, 14]),
            (json!([[[0, 2], [5, 6]], [[1, 3]]]), vec![0, 1, 5, 13, 14]),
            (json!([[], [[0, 1]]]), vec![12]),
        ] {
            let body =
                json!({"inputs": inputs, "layers": [-1], "tokens": tokens, "logprobs": lp, "dtype": "float8_e4m3fn"});
            let (sel, _) = answer(&base, body).await;
            for t in ["topk_ids", "topk_logprobs", "target_logprobs"] {
                assert_eq!(
                    rows_of(&sel[t], &(0..rows.len()).collect::<Vec<_>>()),
                    rows_of(&all[t], &rows),
                    "{tokens} {t}"
                );
            }
        }
        // JSON: the same values, NaN as null.
        let r = reqwest::Client::new()
            .post(format!("{base}/v1/hidden-states"))
            .header("accept", "application/json")
            .json(&json!({"inputs": inputs, "layers": [], "logprobs": lp}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let j: Value = r.json().await.unwrap();
        let ids: Vec<i64> = j["topk_ids"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
        assert_eq!(ids, all["topk_ids"].i64);
        assert!(j["target_logprobs"][11].is_null() && j["target_logprobs"][0].is_number());
        assert_eq!(j["metadata"]["top_k"], "5");
        running.shutdown.cancel();
        running.task.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_logprob_requests_are_refused_with_what_to_fix() {
        let (running, base) = real_server("tiny/llama_gqa_rope3", limits()).await;
        let inputs = json!([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]);
        for k in [0, 65, -1] {
            let m = refused(&base, json!({"inputs": inputs, "layers": [1], "logprobs": {"top_k": k}})).await;
            assert!(m.contains("between 1 and 64") && m.contains("--max-top-k"), "{m}");
        }
        let m = refused(
            &base,
            json!({"inputs": inputs, "layers": [1], "tokens": {"last": 1}, "logprobs": {"top_k": 2, "target": true}}),
        )
        .await;
        assert!(m.contains("no returned row has one"), "{m}");
        let m = refused(
            &base,
            json!({"inputs": [{"input_ids": [5]}], "layers": [1], "logprobs": {"top_k": 2, "target": true}}),
        )
        .await;
        assert!(m.contains("target"), "{m}");
        // Without target, the last token alone is fine.
        answer(&base, json!({"inputs": inputs, "layers": [], "tokens": {"last": 1}, "logprobs": {"top_k": 2}})).await;
        let m = refused(&base, json!({"inputs": inputs, "layers": []})).await;
        assert!(m.contains("at least one") && m.contains("logprobs"), "{m}");
        running.shutdown.cancel();
        running.task.await.unwrap().unwrap();
        // A checkpoint with untied embeddings and no lm_head tensor has no output head.
        let headless = edited_fixture(
            &fixtures().join("tiny/mistral_sliding"),
            |t| t.retain(|(name, ..)| name != "lm_head.weight"),
            |_| {},
        );
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
            std::fs::copy(fixtures().join("tiny/mistral_sliding").join(f), headless.path().join(f)).unwrap();
        }
        let (running, base) = real_server(&headless.path().to_string_lossy(), limits()).await;
        let info: Value = reqwest::get(format!("{base}/v1/info")).await.unwrap().json().await.unwrap();
        assert_eq!((info["max_top_k"].as_u64(), info["lm_head"].as_bool()), (Some(0), Some(false)));
        let m = refused(&base, json!({"inputs": inputs, "layers": [1], "logprobs": {"top_k": 2}})).await;
        assert!(m.contains("no output head") && m.contains("lm_head") && m.contains("tie_word_embeddings"), "{m}");
        // Hidden states are served as before.
        answer(&base, json!({"inputs": inputs, "layers": [1]})).await;
        running.shutdown.cancel();
        running.task.await.unwrap().unwrap();
    }
}
