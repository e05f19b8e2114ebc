//! What an answer holds beyond the plain states: fp8 with per-token scales, token selection,
//! checksums, the non-finite screen and the pre-norm final state, over a real socket against
//! the fake engine (whose states are a known function of token and layer), and the pre-norm
//! state of every fixture family against transformers.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use layertap::answer::{LayerRef, LayerSet};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, OutDType, Output, Rows};
use serde_json::{json, Value};

/// The answer's tensors and metadata (identity encoding, so the bytes are the file).
async fn answer(
    base: &str,
    body: Value,
) -> (std::collections::HashMap<String, Read>, std::collections::HashMap<String, String>, Vec<u8>) {
    let r = client()
        .post(format!("{base}/v1/hidden-states"))
        .header("accept-encoding", "identity")
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let bytes = r.bytes().await.unwrap().to_vec();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    layertap::answer::checksum::verify_checksums(&bytes).expect("every answer's checksums verify");
    let (t, meta) = read_safetensors_bytes(&bytes);
    (t, meta, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fp8_answers_hold_the_quantised_states_and_their_scales() {
    let s = fake_server(limits(), vec![]).await;
    let ids = [3u32, 17, 250, 0];
    let layers = [2usize, 0, 4];
    for dtype in ["float8_e4m3fn", "fp8"] {
        let (t, meta, raw) =
            answer(&s.base, json!({"inputs": [{"input_ids": ids}], "layers": layers, "dtype": dtype})).await;
        assert_eq!(meta["dtype"], "float8_e4m3fn");
        let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
        assert_eq!(st.tensor("hidden_states").unwrap().dtype(), safetensors::Dtype::F8_E4M3);
        let hs = st.tensor("hidden_states").unwrap().data().to_vec();
        let scale = &t["hidden_states_scale"];
        assert_eq!(scale.shape, [ids.len(), layers.len()]);
        let mut worst = 0f64;
        for (r, &id) in ids.iter().enumerate() {
            for (k, &l) in layers.iter().enumerate() {
                let row: Vec<f32> = (0..FAKE_HIDDEN).map(|h| fake_value(id, l, h)).collect();
                let (q, sc) = fp8_of(&row);
                let at = (r * layers.len() + k) * FAKE_HIDDEN;
                assert_eq!(&hs[at..at + FAKE_HIDDEN], &q[..], "row {r} layer {l}: fp8 bits");
                assert_eq!(scale.f32[r * layers.len() + k].to_bits(), sc.to_bits(), "row {r} layer {l}: scale");
                let back: Vec<f32> = t["hidden_states"].f32[at..at + FAKE_HIDDEN].iter().map(|x| x * sc).collect();
                worst = worst.max(rel_err(&back, &row));
            }
        }
        // E4M3 keeps 3 mantissa bits: each value within 1/16 of itself, so each row too.
        assert!(worst < 1.0 / 16.0, "dequantised rows {worst} from the states");
    }
    // The JSON answer carries the same fp8 values and scales.
    let r = client()
        .post(format!("{}/v1/hidden-states", s.base))
        .header("accept", "application/json")
        .json(&json!({"inputs": [{"input_ids": ids}], "layers": layers, "dtype": "fp8"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["dtype"], "float8_e4m3fn");
    let sc = v["hidden_states_scale"].as_array().unwrap();
    assert_eq!(sc.len(), ids.len() * layers.len());
    let row: Vec<f32> = (0..FAKE_HIDDEN).map(|h| fake_value(ids[0], layers[0], h)).collect();
    let (q, want) = fp8_of(&row);
    assert_eq!(sc[0].as_f64().unwrap() as f32, want);
    assert_eq!(v["hidden_states"][1].as_f64().unwrap() as f32, float8::F8E4M3::from_bits(q[1]).to_f32());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_selections_return_the_rows_they_name_with_their_positions() {
    let s = fake_server(limits(), vec![]).await;
    let msgs = json!([{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "General Kenobi"}]);
    let inputs = json!([{"input_ids": [5, 6, 7, 8, 9]}, {"messages": msgs}, {"input_ids": [42]}]);
    let (all, meta, _) = answer(&s.base, json!({"inputs": inputs, "layers": [1, 3]})).await;
    assert!(!all.contains_key("positions"), "no positions without a selection");
    assert_eq!(meta["tokens"], "all");
    let cu = all["cu_seqlens"].i64.clone();
    let lens: Vec<usize> = cu.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
    let mask = &all["loss_mask"].i64;
    let row = |i: usize, p: usize| cu[i] as usize + p;
    let expect = |picked: Vec<Vec<usize>>| -> (Vec<i64>, Vec<i64>, Vec<f32>, Vec<i64>) {
        let mut cu = vec![0i64];
        let (mut ids, mut vals, mut pos) = (vec![], vec![], vec![]);
        for (i, ps) in picked.iter().enumerate() {
            for &p in ps {
                ids.push(all["input_ids"].i64[row(i, p)]);
                vals.extend_from_slice(&all["hidden_states"].f32[row(i, p) * 2 * FAKE_HIDDEN..][..2 * FAKE_HIDDEN]);
                pos.push(p as i64);
            }
            cu.push(cu.last().unwrap() + ps.len() as i64);
        }
        (ids, cu, vals, pos)
    };
    let assistant: Vec<Vec<usize>> = (0..3).map(|i| (0..lens[i]).filter(|&p| mask[row(i, p)] == 1).collect()).collect();
    assert!(assistant[1].len() < lens[1] && !assistant[1].is_empty(), "the chat has assistant and other tokens");
    let cases = [
        (json!("assistant"), assistant, "assistant"),
        (json!({"last": 2}), vec![vec![3, 4], vec![lens[1] - 2, lens[1] - 1], vec![0]], "last:2"),
        (json!([[[0, 2], [3, 4]], [], [[0, 1]]]), vec![vec![0, 1, 3], vec![], vec![0]], "ranges"),
    ];
    for (tokens, picked, label) in cases {
        let (t, meta, _) = answer(&s.base, json!({"inputs": inputs, "layers": [1, 3], "tokens": tokens})).await;
        let (ids, cu, vals, pos) = expect(picked.clone());
        assert_eq!(meta["tokens"], label);
        assert_eq!(t["input_ids"].i64, ids, "{label}: input_ids");
        assert_eq!(t["cu_seqlens"].i64, cu, "{label}: cu_seqlens");
        assert_eq!(t["positions"].i64, pos, "{label}: positions");
        assert_eq!(t["hidden_states"].shape, [ids.len(), 2, FAKE_HIDDEN], "{label}: shape");
        assert_eq!(t["hidden_states"].f32, vals, "{label}: values");
        let m: Vec<i64> =
            picked.iter().enumerate().flat_map(|(i, ps)| ps.iter().map(move |&p| mask[row(i, p)])).collect();
        assert_eq!(t["loss_mask"].i64, m, "{label}: loss_mask");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_selections_layers_and_dtypes_are_refused_with_the_reason() {
    let s = fake_server(limits(), vec![]).await;
    let two = json!([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]);
    let cases = [
        (json!({"inputs": two, "layers": [1], "tokens": [[[0, 1]]]}), "1 entries for 2 inputs"),
        (json!({"inputs": two, "layers": [1], "tokens": [[[0, 1]], [[1, 3]]]}), "inputs[1], which has 2 tokens"),
        (json!({"inputs": two, "layers": [1], "tokens": [[[2, 1]], []]}), "tokens[0][0]"),
        (json!({"inputs": two, "layers": [1], "tokens": {"last": 0}}), "k >= 1"),
        (json!({"inputs": two, "layers": [1], "tokens": "some"}), "unknown \"tokens\""),
        (json!({"inputs": two, "layers": ["final_prenorm", "final_prenorm"]}), "twice"),
        (json!({"inputs": two, "layers": ["last"]}), "unknown layer name"),
        (json!({"inputs": two, "layers": [1], "dtype": "fp4"}), "unknown dtype"),
    ];
    for (body, needle) in cases {
        let (status, kind, msg) = error_of(post(&s.base, "/v1/hidden-states", body.clone()).await).await;
        assert_eq!((status, kind.as_str()), (422, "invalid_request"), "{body}: {msg}");
        assert!(msg.contains(needle), "{body}: {msg:?} should say {needle:?}");
    }
    // The layers list may now name every index and the pre-norm state once each, no more.
    let n = FAKE_LAYERS as i64;
    let mut every: Vec<Value> = (0..=n).map(Value::from).collect();
    every.push(json!("final_prenorm"));
    let (t, meta, _) = answer(&s.base, json!({"inputs": [{"input_ids": [1]}], "layers": every})).await;
    assert_eq!(t["hidden_states"].shape, [1, FAKE_LAYERS + 2, FAKE_HIDDEN]);
    assert_eq!(meta["layers"], "[0,1,2,3,4,\"final_prenorm\"]");
    every.push(json!(-1));
    let (status, _, msg) =
        error_of(post(&s.base, "/v1/hidden-states", json!({"inputs": [{"input_ids": [1]}], "layers": every})).await)
            .await;
    assert_eq!(status, 422, "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_every_kind_share_a_batch_and_each_gets_its_own_rows() {
    let s = fake_server(limits(), vec![]).await;
    // Slow batches, so that the requests below queue up and run together.
    s.control.delay_ms.store(300, Ordering::SeqCst);
    let seq = |k: u32| (0..6).map(|i| 10 * k + i).collect::<Vec<u32>>();
    let bodies = vec![
        json!({"inputs": [{"input_ids": seq(0)}], "layers": [2]}),
        json!({"inputs": [{"input_ids": seq(1)}], "layers": [1, 2], "dtype": "fp8"}),
        json!({"inputs": [{"input_ids": seq(2)}], "layers": [2], "tokens": {"last": 2}}),
        json!({"inputs": [{"input_ids": seq(3)}], "layers": [3], "dtype": "fp8", "tokens": [[[1, 3]]]}),
        json!({"inputs": [{"input_ids": seq(4)}], "layers": ["final_prenorm", 0]}),
    ];
    // A first request occupies the engine while the others queue.
    let first = tokio::spawn({
        let base = s.base.clone();
        async move { answer(&base, json!({"inputs": [{"input_ids": [1]}], "layers": [1]})).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let handles: Vec<_> = bodies
        .into_iter()
        .map(|b| {
            let base = s.base.clone();
            tokio::spawn(async move { answer(&base, b).await })
        })
        .collect();
    first.await.unwrap();
    let mut got = Vec::new();
    for h in handles {
        got.push(h.await.unwrap());
    }
    assert!(s.control.batches.load(Ordering::SeqCst) <= 3, "the five requests should share batches");
    let value = |id: u32, l: usize| (0..FAKE_HIDDEN).map(move |h| fake_value(id, l, h));
    let plain = |k: u32, picks: &[usize], layers: &[usize]| -> Vec<f32> {
        picks.iter().flat_map(|&p| layers.iter().flat_map(move |&l| value(10 * k + p as u32, l))).collect()
    };
    assert_eq!(got[0].0["hidden_states"].f32, plain(0, &[0, 1, 2, 3, 4, 5], &[2]));
    assert_eq!(got[2].0["hidden_states"].f32, plain(2, &[4, 5], &[2]));
    assert_eq!(got[2].0["positions"].i64, vec![4, 5]);
    assert_eq!(got[4].0["hidden_states"].f32, plain(4, &[0, 1, 2, 3, 4, 5], &[FAKE_LAYERS + 1, 0]));
    for (g, k, picks, layers) in
        [(&got[1], 1u32, vec![0, 1, 2, 3, 4, 5], vec![1, 2]), (&got[3], 3, vec![1, 2], vec![3])]
    {
        let want: Vec<u8> = picks
            .iter()
            .flat_map(|&p| layers.iter().flat_map(move |&l| fp8_of(&value(10 * k + p as u32, l).collect::<Vec<_>>()).0))
            .collect();
        let raw = &g.2;
        let st = safetensors::SafeTensors::deserialize(raw).unwrap();
        assert_eq!(st.tensor("hidden_states").unwrap().data(), &want[..], "request {k}: fp8 rows");
        assert_eq!(g.0["hidden_states_scale"].shape, [picks.len(), layers.len()]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_states_are_refused_unless_allowed_and_counted_per_layer() {
    let s = fake_server(limits(), vec![]).await;
    *s.control.nonfinite_token.lock().unwrap() = Some(7);
    let body = |extra: Value| {
        let mut b = json!({"inputs": [{"input_ids": [1, 2]}, {"input_ids": [3, 7, 4]}], "layers": [0, 1, 3]});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let (status, kind, msg) = error_of(post(&s.base, "/v1/hidden-states", body(json!({}))).await).await;
    assert_eq!((status, kind.as_str()), (422, "invalid_request"), "{msg}");
    assert!(msg.contains("layer 1") && msg.contains("inputs[1], position 1"), "{msg}");
    assert!(msg.contains("allow_nonfinite"), "{msg}");
    // Allowed: the states come back, the metadata says which layers and how many rows.
    for dtype in ["float32", "fp8"] {
        let (t, meta, _) = answer(&s.base, body(json!({"allow_nonfinite": true, "dtype": dtype}))).await;
        let nonfinite: Value = serde_json::from_str(&meta["nonfinite"]).unwrap();
        assert_eq!(nonfinite, json!({"1": 1, "3": 1}), "{dtype}");
        let h = FAKE_HIDDEN;
        if dtype == "float32" {
            assert_eq!(t["hidden_states"].f32[(3 * 3 + 1) * h], f32::INFINITY);
            assert!(t["hidden_states"].f32[(3 * 3 + 2) * h].is_nan());
        }
        assert!(t["hidden_states"].f32[..3 * 3 * h].iter().all(|x| x.is_finite()), "{dtype}: other rows intact");
    }
    // A selection that leaves the bad token out is clean; the pre-norm state is screened too.
    let (_, meta, _) = answer(&s.base, body(json!({"tokens": {"last": 1}}))).await;
    assert_eq!(meta["nonfinite"], "{}");
    let (status, _, msg) = error_of(
        post(&s.base, "/v1/hidden-states", json!({"inputs": [{"input_ids": [7]}], "layers": ["final_prenorm"]})).await,
    )
    .await;
    assert!(status == 422 && msg.contains("layer final_prenorm"), "{msg}");
    let metrics = client().get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    let count = |layer: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("layertap_nonfinite_total{{layer=\"{layer}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
    };
    // Refused once, allowed twice (layers 1 and 3), the pre-norm request once.
    assert_eq!(count("1"), Some(3), "{metrics}");
    assert_eq!(count("3"), Some(3));
    assert_eq!(count("final_prenorm"), Some(1));
    assert_eq!(count("0"), None, "index 0 never held a non-finite value");
}

/// The last decoder layer's output before the final norm, for every family, against the state
/// transformers' last decoder layer returns (a forward hook in the reference run).
#[test]
fn the_prenorm_final_state_matches_transformers_for_every_family() {
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let mut m = files.load(&Device::Cpu, DType::F32).unwrap();
        let n = m.info.num_layers;
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let mut seqs = Vec::new();
        for i in 0.. {
            let Some(ids) = reference.get(&format!("seq{i}.input_ids")) else { break };
            seqs.push(ids.i64.iter().map(|&x| x as u32).collect::<Vec<u32>>());
        }
        assert!(seqs.len() >= 3, "{name}: reference sequences");
        let mut cu = vec![0];
        for s in &seqs {
            cu.push(cu.last().unwrap() + s.len());
        }
        // Packed with the post-norm index, in one batch.
        let batch = Batch::new(seqs.concat(), cu.clone(), vec![n + 1, n]);
        let taps = m.engine.forward(&batch).unwrap();
        for (i, s) in seqs.iter().enumerate() {
            let want = &reference[&format!("seq{i}.final_prenorm")];
            assert_eq!(want.shape, [s.len(), m.info.hidden_size], "{name}");
            let got = taps.gather(cu[i], s.len(), &[n + 1], OutDType::Float32).unwrap().to_f32();
            let e = rel_err(&got, &want.f32);
            assert!(e < 1e-5, "{name} seq{i}: final_prenorm {e:e} from transformers");
            let post = taps.gather(cu[i], s.len(), &[n], OutDType::Float32).unwrap().to_f32();
            assert!(rel_err(&post, &want.f32) > 1e-2, "{name} seq{i}: the pre-norm state is not the normed one");
        }
    }
}

/// On the real CPU engine: selected and fp8 rows are cut and quantised from the same states the
/// plain answer holds, and a poisoned layer is flagged exactly where its NaNs are.
#[test]
fn the_engine_selects_quantises_and_screens_on_its_device() {
    let dir = fixtures().join("tiny/qwen3_qknorm");
    let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
    let mut m = files.load(&Device::Cpu, DType::F32).unwrap();
    let n = m.info.num_layers;
    let h = m.info.hidden_size;
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 % 500) as u32).collect();
    let layers = vec![1, n, n + 1];
    let full = m.engine.forward(&Batch::new(ids.clone(), vec![0, 12, 20], layers.clone())).unwrap();
    assert!(full.nonfinite.iter().all(|&f| f == 0));
    let mut batch = Batch::new(ids.clone(), vec![0, 12, 20], layers.clone());
    batch.output = Output { plain: Rows::Only(vec![0, 5, 19]), fp8: Rows::Only(vec![2, 3, 13]), ..Output::default() };
    let sel = m.engine.forward(&batch).unwrap();
    for (k, &r) in [0usize, 5, 19].iter().enumerate() {
        assert_eq!(
            sel.gather(k, 1, &layers, OutDType::Float32).unwrap().to_f32(),
            full.gather(r, 1, &layers, OutDType::Float32).unwrap().to_f32(),
            "plain row {r}"
        );
    }
    let fp8 = sel.fp8.as_ref().expect("fp8 rows");
    assert_eq!(fp8.host.shape, [3, layers.len(), h]);
    for (k, &r) in [2usize, 3, 13].iter().enumerate() {
        let states = full.gather(r, 1, &layers, OutDType::Float32).unwrap().to_f32();
        for c in 0..layers.len() {
            let (q, sc) = fp8_of(&states[c * h..(c + 1) * h]);
            let at = (k * layers.len() + c) * h;
            assert_eq!(&fp8.host.data[at..at + h], &q[..], "fp8 row {r} layer {}", layers[c]);
            assert_eq!(fp8.scale[k * layers.len() + c], sc);
        }
    }
    // Decoder layer 2's MLP overflows (its projections hold the largest finite f32; a NaN weight
    // would be refused at load): flags exactly at indices >= 2, every row.
    let poisoned = common::edited_fixture(
        &dir,
        |ts| {
            for (name, _, _, data) in ts.iter_mut().filter(|t| t.0.starts_with("model.layers.1.mlp.")) {
                assert_eq!(name.rsplit('.').next(), Some("weight"));
                *data = f32::MAX.to_le_bytes().repeat(data.len() / 4);
            }
        },
        |_| {},
    );
    let files = ModelFiles::locate(&poisoned.path().to_string_lossy()).unwrap();
    let mut m = files.load(&Device::Cpu, DType::F32).unwrap();
    // Token 0's embedding row is zero (the padding row), and a zero state stays zero through
    // any finite weights: the batch leaves it out.
    let ids: Vec<u32> = ids.iter().map(|&i| i + 1).collect();
    let taps = m.engine.forward(&Batch::new(ids.clone(), vec![0, 20], vec![0, 1, 2, n + 1])).unwrap();
    for r in 0..ids.len() {
        assert_eq!(&taps.nonfinite[r * 4..r * 4 + 4], &[0, 0, 1, 1], "row {r}");
    }
}

/// The one-shot path (`layertap extract --out-dtype fp8`) quantises on the engine as the service
/// does, and its file carries the scales and checksums.
#[test]
fn one_shot_extraction_writes_fp8_with_scales() {
    let control = std::sync::Arc::new(FakeControl::default());
    let mut engine = FakeEngine(control);
    let seqs = vec![layertap::tokenizer::Tokenized { ids: vec![4, 9, 300], loss_mask: vec![1, 1, 1] }];
    let layers = [3usize, FAKE_LAYERS + 1];
    let set = LayerSet::resolve(&[LayerRef::Index(3), LayerRef::Name("final_prenorm".into())], FAKE_LAYERS).unwrap();
    assert_eq!(set.indices(), layers);
    let (x, found) =
        layertap::answer::assemble::once(&mut engine, &fake_info(), &seqs, &set, OutDType::Float8E4M3).unwrap();
    assert_eq!(found.refusal(&set), None);
    assert_eq!(x.metadata["nonfinite"], "{}");
    assert_eq!(x.hidden_states.dtype, OutDType::Float8E4M3);
    let scale = x.hidden_states_scale.as_ref().expect("scales");
    for (r, &id) in seqs[0].ids.iter().enumerate() {
        for (k, &l) in layers.iter().enumerate() {
            let (q, sc) = fp8_of(&(0..FAKE_HIDDEN).map(|h| fake_value(id, l, h)).collect::<Vec<_>>());
            let at = (r * layers.len() + k) * FAKE_HIDDEN;
            assert_eq!(&x.hidden_states.data[at..at + FAKE_HIDDEN], &q[..]);
            assert_eq!(scale[r * layers.len() + k], sc);
        }
    }
    let bytes = x.to_safetensors().unwrap();
    layertap::answer::checksum::verify_checksums(&bytes).unwrap();
    let (t, meta) = read_safetensors_bytes(&bytes);
    assert_eq!(t["hidden_states_scale"].shape, [3, 2]);
    assert_eq!(meta["layers"], "[3,\"final_prenorm\"]");
}
