//! The decoder in stages (`--pipeline N`) on the CPU: every stage the CPU, the states bitwise
//! those of one stage (dense, hybrid Gated DeltaNet and MoE fixtures), through the engine and
//! through the real binary; the split by weight bytes; early exit and cancellation across
//! stages; and the refusals at start-up.

mod common;

use std::ops::Range;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{fixtures, read_safetensors, read_safetensors_bytes, serve_binary, unzstd};
use layertap::engine::logprobs::LogprobRows;
use layertap::engine::{
    Batch, Cancel, DType, Device, Engine, EngineError, EngineOptions, ModelEngine, Output, Rows, Taps,
};
use serde_json::{json, Value};

/// Dense attention, hybrid (Gated DeltaNet and attention), MoE, hybrid with MoE, and the block
/// variants: sandwich norms with a dense MLP beside the experts (Gemma 4), per-layer inputs and
/// keys and values reused from an earlier layer, across a stage boundary (Gemma 4 E2B), latent
/// attention (DeepSeek-V3, in FP8, and GLM-5's sparse attention where it is dense), attention
/// sinks with MXFP4 experts (gpt-oss).
const MODELS: [&str; 10] = [
    "tiny/qwen3_qknorm",
    "tiny/qwen3_5_text",
    "tiny/qwen3_moe",
    "tiny/qwen3_next_per_expert",
    "gemma4/gemma4_moe",
    "gemma4/gemma4_e2b",
    "mla/deepseek_v3",
    "mla/deepseek_v3_fp8",
    "mla/glm_moe_dsa",
    "gpt_oss/gpt_oss_mxfp4",
];

/// The decoder layers of `model`'s config.
fn layers(model: &str) -> usize {
    files(model).config().num_hidden_layers
}

fn files(model: &str) -> layertap::engine::loader::ModelFiles {
    layertap::engine::loader::ModelFiles::locate(&fixtures().join(model).to_string_lossy()).unwrap()
}

/// The model in `n` stages, every one on the CPU, in f32.
fn staged(model: &str, n: usize) -> ModelEngine {
    files(model).load_stages(&vec![Device::Cpu; n], DType::F32, EngineOptions::startup()).unwrap().engine
}

/// The fixture's three reference sequences.
fn sequences(model: &str) -> Vec<Vec<u32>> {
    let r = read_safetensors(&fixtures().join(model).join("reference.safetensors"));
    (0..3).map(|i| r[&format!("seq{i}.input_ids")].i64.iter().map(|&x| x as u32).collect()).collect()
}

/// Every index `0..=L + 1` (in a mixed order) of the sequences packed in one batch, with the
/// top-5 log-probabilities of every row.
fn every_index(seqs: &[Vec<u32>], n: usize) -> Batch {
    let mut layers: Vec<usize> = (0..=n + 1).rev().collect();
    layers.swap(0, n / 2);
    let mut b = Batch::pack(seqs.iter().map(Vec::as_slice), layers);
    b.output = Output { logprobs: Some(LogprobRows { rows: Rows::All, top_k: 5 }), ..Output::default() };
    b
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The states and log-probabilities of a batch, as bits.
fn answer(t: &Taps) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>) {
    let lp = t.logprobs.as_ref().expect("log-probabilities asked for");
    (bits(&t.host.to_f32()), lp.ids.clone(), bits(&lp.logprobs), bits(&lp.target))
}

#[test]
fn two_and_three_stages_give_the_states_of_one_bitwise() {
    for model in MODELS {
        let seqs = sequences(model);
        let mut one = staged(model, 1);
        let n = one.decoder.cfg.num_hidden_layers;
        let batch = every_index(&seqs, n);
        let want = one.forward(&batch).unwrap();
        assert_eq!(want.layers_run, n);
        assert_eq!(one.decoder.stages().len(), 1);
        assert_eq!(one.decoder.stages()[0].layers, 0..n);
        for stages in [2, 3].into_iter().filter(|&k| k <= n) {
            let mut e = staged(model, stages);
            assert_eq!(e.decoder.stages().len(), stages, "{model}");
            // The three sequences go through the stages as micro-batches, the stages at work at once.
            let refs: Vec<&layertap::engine::stages::Stage> = e.decoder.stages().iter().collect();
            assert!(layertap::engine::stages::overlap_between(&refs));
            assert_eq!(layertap::engine::stages::micro_batches(&batch.cu_seqlens, stages).len(), 3);
            let got = e.forward(&batch).unwrap();
            assert_eq!(got.layers_run, n, "{model} in {stages} stages");
            assert!(answer(&got) == answer(&want), "{model}: {stages} stages differ from one");
            // Each sequence alone, too (a batch of one still crosses every stage).
            for s in &seqs {
                let b = every_index(std::slice::from_ref(s), n);
                let (a, b1) = (e.forward(&b).unwrap(), one.forward(&b).unwrap());
                assert!(answer(&a) == answer(&b1), "{model}: {stages} stages differ on a single sequence");
            }
        }
    }
}

/// Layers past the deepest tap are not run, and the stages past it not entered: the layers run
/// stop at the deepest index asked whatever the stage count.
#[test]
fn early_exit_stops_inside_the_stage_of_the_deepest_tap() {
    let model = "tiny/qwen3_5_text";
    let seqs = sequences(model);
    let mut one = staged(model, 1);
    let mut three = staged(model, 3);
    let n = one.decoder.cfg.num_hidden_layers;
    for deepest in 0..=n + 1 {
        let batch = Batch::pack(seqs.iter().map(Vec::as_slice), [deepest, 0]);
        let (a, b) = (three.forward(&batch).unwrap(), one.forward(&batch).unwrap());
        assert_eq!(a.layers_run, deepest.min(n), "index {deepest}");
        assert_eq!(b.layers_run, deepest.min(n), "index {deepest}");
        assert_eq!(bits(&a.host.to_f32()), bits(&b.host.to_f32()), "index {deepest}");
    }
}

/// The cancellation check runs before each layer in every stage: a batch of one sequence
/// (which crosses the stages in turn) cancelled after k checks stops there, past the first
/// stage's boundary or not. A batch of several goes through the stages as micro-batches at once:
/// cancelled, every stage stops at its next check (one more check per stage at most).
#[test]
fn cancellation_stops_between_layers_across_stages() {
    let model = "tiny/qwen3_moe";
    let seqs = sequences(model);
    for stages in [1, 2, 3] {
        let mut e = staged(model, stages);
        let n = e.decoder.cfg.num_hidden_layers;
        for after in [0, 1, 2, 3] {
            let checks = Arc::new(AtomicUsize::new(0));
            let c = checks.clone();
            let cancel = Cancel::new(move || c.fetch_add(1, Ordering::SeqCst) >= after);
            let batch = Batch::pack([seqs[0].as_slice()], [n]);
            match e.launch_cancellable(&batch, &cancel).map(|p| p.wait()) {
                Err(EngineError::Cancelled { layers_run }) => assert_eq!(layers_run, after, "{stages} stages"),
                other => panic!("{stages} stages, cancelled after {after}: {:?}", other.map(|_| ())),
            }
            let checks = Arc::new(AtomicUsize::new(0));
            let c = checks.clone();
            let cancel = Cancel::new(move || c.fetch_add(1, Ordering::SeqCst) >= after);
            let batch = Batch::pack(seqs.iter().map(Vec::as_slice), [n]);
            match e.launch_cancellable(&batch, &cancel).map(|p| p.wait()) {
                Err(EngineError::Cancelled { .. }) => {}
                other => panic!("{stages} stages, 3 sequences, cancelled after {after}: {:?}", other.map(|_| ())),
            }
            let seen = checks.load(Ordering::SeqCst);
            assert!(seen <= after + stages, "{stages} stages: {seen} checks after cancelling at {after}");
        }
    }
}

/// The bytes of the fixture's stored tensors: per decoder layer, the embeddings, and the final
/// norm with the head (the embeddings again where tied), read from the file here; anything else
/// (a vision tower, an MTP head) counts nowhere.
fn stored_bytes(model: &str, layers: usize, tied: bool) -> (Vec<u64>, u64, u64) {
    let bytes = std::fs::read(fixtures().join(model).join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (mut per_layer, mut first, mut last) = (vec![0u64; layers], 0, 0);
    for (name, view) in st.tensors() {
        let size = view.data().len() as u64;
        let name = name.strip_prefix("model.language_model.").or(name.strip_prefix("model.")).unwrap_or(&name);
        if let Some(i) = name.strip_prefix("layers.").and_then(|r| r.split('.').next()?.parse::<usize>().ok()) {
            // Layers past the decoder's (a multi-token-prediction head) are never loaded.
            if let Some(l) = per_layer.get_mut(i) {
                *l += size;
            }
        } else if name.starts_with("embed_tokens.") {
            first += size;
            last += if tied { size } else { 0 };
        } else if name.starts_with("norm.") || name == "lm_head.weight" {
            last += size;
        }
    }
    (per_layer, first, last)
}

/// The stages cover every layer exactly once, in order, non-empty; their bytes are the stored
/// bytes of their layers (the embeddings with the first, the norm and head with the last); and
/// no other split into as many stages has a lighter heaviest stage.
#[test]
fn the_split_is_balanced_by_weight_bytes_and_covers_every_layer_once() {
    for model in MODELS {
        for stages in [2, 3].into_iter().filter(|&k| k <= layers(model)) {
            let e = staged(model, stages);
            let cfg = &e.decoder.cfg;
            let n = cfg.num_hidden_layers;
            let (per_layer, first, last) = stored_bytes(model, n, cfg.tie_word_embeddings);
            let s = e.decoder.stages();
            let ranges: Vec<Range<usize>> = s.iter().map(|s| s.layers.clone()).collect();
            let mut covered = vec![0; n];
            for r in &ranges {
                assert!(!r.is_empty(), "{model}: an empty stage in {ranges:?}");
                r.clone().for_each(|i| covered[i] += 1);
            }
            assert!(covered.iter().all(|&c| c == 1), "{model}: {ranges:?}");
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start), "{model}: {ranges:?}");
            let weigh = |r: &Range<usize>, k: usize| {
                per_layer[r.clone()].iter().sum::<u64>()
                    + if k == 0 { first } else { 0 }
                    + if k + 1 == stages { last } else { 0 }
            };
            for (k, st) in s.iter().enumerate() {
                assert_eq!(st.weight_bytes, weigh(&st.layers, k), "{model} stage {k}");
                let layout = st.layout();
                assert_eq!((layout.first_layer, layout.last_layer), (st.layers.start + 1, st.layers.end));
                assert_eq!(layout.device, "cpu");
            }
            let heaviest = s.iter().map(|s| s.weight_bytes).max().unwrap();
            // Every other split: cut points 0 < c1 < ... < n.
            let mut best = u64::MAX;
            let cuts = |c: &[usize]| -> u64 {
                let mut bounds = vec![0];
                bounds.extend_from_slice(c);
                bounds.push(n);
                bounds.windows(2).enumerate().map(|(k, w)| weigh(&(w[0]..w[1]), k)).max().unwrap()
            };
            for a in 1..n {
                if stages == 2 {
                    best = best.min(cuts(&[a]));
                }
                for b in a + 1..n {
                    if stages == 3 {
                        best = best.min(cuts(&[a, b]));
                    }
                }
            }
            assert_eq!(heaviest, best, "{model} in {stages} stages: {ranges:?}");
        }
    }
}

#[test]
fn more_stages_than_layers_are_refused_with_the_numbers() {
    let f = files("tiny/qwen3_5_text");
    let e = f.load_stages(&vec![Device::Cpu; 5], DType::F32, EngineOptions::startup()).err().unwrap().to_string();
    assert!(e.contains("--pipeline 5") && e.contains("4 decoder layers"), "{e}");
    let e = f.load_stages(&[], DType::F32, EngineOptions::startup()).err().unwrap().to_string();
    assert!(e.contains("device"), "{e}");
    // As many stages as layers: one layer each.
    let e = staged("tiny/qwen3_5_text", 4);
    let ranges: Vec<_> = e.decoder.stages().iter().map(|s| s.layers.clone()).collect();
    assert_eq!(ranges, vec![0..1, 1..2, 2..3, 3..4]);
}

/// `layertap serve` refuses at start-up, naming the numbers: a device count that is not a
/// multiple of the stages, more stages than the model has layers, and no stage at all.
#[test]
fn serve_refuses_a_pipeline_that_does_not_fit() {
    let model = fixtures().join("tiny/qwen3_5_text");
    for (args, want) in [
        (&["--pipeline", "5"][..], &["--pipeline 5", "4 decoder layers"][..]),
        (&["--device", "cuda:0,1,2", "--pipeline", "2"], &["--pipeline 2 needs a multiple of 2 devices", "names 3"]),
        (&["--pipeline", "0"], &["--pipeline 0", "at least 1 stage"]),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_layertap"))
            .args(["serve", "--model", &model.to_string_lossy(), "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?} must not start");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(want.iter().all(|w| err.contains(w)), "{args:?}: {err}");
    }
}

/// The real binary with `--pipeline 3` on the CPU: self-checked and ready, `/v1/info` shows the
/// stages, and the states it serves are those of one stage, bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_three_stages_with_the_states_of_one() {
    let model = "tiny/qwen3_moe";
    let (mut child, base) = serve_binary(&fixtures().join(model), &["--pipeline", "3"], |_| {}).await;
    let c = common::client();
    let info: Value = c.get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["devices"], json!(["cpu"]));
    assert_eq!(info["selfcheck"]["passed"], true, "{info}");
    let one = staged(model, 1);
    let n = one.decoder.cfg.num_hidden_layers;
    let e = staged(model, 3);
    let want_stages: Vec<Value> = e
        .decoder
        .stages()
        .iter()
        .map(|s| {
            json!({"device": "cpu", "first_layer": s.layers.start + 1, "last_layer": s.layers.end,
                   "weight_bytes": s.weight_bytes})
        })
        .collect();
    assert_eq!(info["replicas"], json!([{"device": "cpu", "stages": want_stages}]), "{info}");
    let mut one = one;
    let layers: Vec<usize> = (0..=n).collect();
    for s in sequences(model) {
        let r = c
            .post(format!("{base}/v1/hidden-states"))
            .json(&json!({"inputs": [{"input_ids": s}], "layers": layers}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let got = read_safetensors_bytes(&unzstd(&r.bytes().await.unwrap())).0;
        let want = one.forward(&Batch::pack([s.as_slice()], layers.clone())).unwrap();
        assert_eq!(bits(&got["hidden_states"].f32), bits(&want.host.to_f32()), "served states differ from one stage");
    }
    let metrics = c.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("layertap_selfcheck_relative_error{device=\"cpu\""), "{metrics}");
    assert!(metrics.contains("layertap_tokens_total"), "{metrics}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Without `--pipeline`, `/v1/info` shows one replica of one stage holding every layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stage_holds_every_layer_in_info() {
    let (running, base) = common::real_server("tiny/qwen3_qknorm", common::limits()).await;
    let info: Value = common::client().get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    let stages = &info["replicas"][0]["stages"];
    assert_eq!(info["replicas"].as_array().map(Vec::len), Some(1), "{info}");
    assert_eq!(
        (&stages[0]["device"], &stages[0]["first_layer"], &stages[0]["last_layer"]),
        (&json!("cpu"), &json!(1), &json!(3))
    );
    assert!(stages[0]["weight_bytes"].as_u64().unwrap() > 0);
    running.shutdown.cancel();
    running.task.await.unwrap().unwrap();
}
